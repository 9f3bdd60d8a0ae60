"""Behaviour of the EMA wrapper: construction, swap, forward, state, resume, pickling, errors."""

from __future__ import annotations

import copy
import inspect
import io
import pickle
import threading
from functools import partial

import pytest
import torch
from torch import nn

import emakit
from _models import conv_bn_classifier
from emakit import EMA, EMAError, EMAPytree, EMARuntimeError, EMAStateError, EMAValueError

make_net = partial(conv_bn_classifier, image_size=8, out_features=5, dropout=0.5)


def train_steps(net: nn.Module, ema: EMA | None, steps: int, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    for _ in range(steps):
        x = torch.randn(8, 3, 8, 8, generator=gen)
        net(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if ema is not None:
            ema.update()


def shadow_state(ema: EMA) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in ema.ema_model.state_dict().items()}


# -- basic semantics ------------------------------------------------------------------------


def test_first_update_copies_and_counts_calls():
    net = make_net()
    ema = EMA(net, beta=0.9, update_after_step=0, update_every=1)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)
    ema.update()
    assert int(ema.step) == 1 and ema.step.item() == 1
    assert bool(ema.initted)
    for (_, a), (_, b) in zip(
        net.state_dict().items(), ema.ema_model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b)


def test_averaging_matches_closed_form_constant_schedule():
    w = nn.Linear(3, 1, bias=False)
    ema = EMA(w, update_after_step=0, update_every=1, schedule=lambda t: 0.5)
    ema.update()  # copies w0
    start = w.weight.detach().clone()
    with torch.no_grad():
        w.weight.zero_()
    ema.update()
    ema.update()
    # two averaging steps toward 0 with decay 0.5
    assert torch.allclose(ema.ema_model.weight, start * 0.25)


def test_frozen_beta_one_keeps_teacher_fixed_after_warmup():
    net = make_net()
    ema = EMA(net, beta=1.0, update_after_step=2, update_every=1)
    train_steps(net, ema, 3)  # init + two warm-up copies
    frozen = shadow_state(ema)
    train_steps(net, ema, 10, seed=5)
    for k, v in ema.ema_model.state_dict().items():
        if v.is_floating_point():
            assert torch.equal(v, frozen[k]), k


def test_skipped_calls_do_nothing():
    net = make_net()
    ema = EMA(net, beta=0.5, update_after_step=0, update_every=4)
    ema.update()
    before = shadow_state(ema)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)
    for _ in range(3):  # calls 2, 3, 4 (pre-increment steps 1, 2, 3) are skipped
        ema.update()
        for k, v in ema.ema_model.state_dict().items():
            assert torch.equal(v, before[k]), k
    ema.update()  # pre-increment step 4 averages
    assert not torch.equal(ema.ema_model[0].weight, before["0.weight"])


def test_integer_buffers_copied_not_averaged():
    net = make_net()
    ema = EMA(net, beta=0.9, update_after_step=0, update_every=1)
    train_steps(net, ema, 7)
    assert ema.ema_model[1].num_batches_tracked.item() == net[1].num_batches_tracked.item() == 7
    assert ema.ema_model[1].num_batches_tracked.dtype == torch.long


def test_no_ema_names_are_copied():
    net = make_net()
    ema = EMA(
        net, beta=0.99, update_after_step=0, update_every=1, param_or_buffer_names_no_ema={"4.bias"}
    )
    train_steps(net, ema, 5)
    assert torch.equal(ema.ema_model[4].bias, net[4].bias)
    assert not torch.equal(ema.ema_model[4].weight, net[4].weight)


def test_ignored_names_never_touched():
    net = make_net()
    ema = EMA(
        net,
        beta=0.9,
        update_after_step=2,
        update_every=1,
        ignore_names={"4.bias"},
        ignore_startswith_names={"1."},
    )
    sentinel_bias = ema.ema_model[4].bias.detach().clone()
    sentinel_bn = ema.ema_model[1].running_mean.detach().clone()
    train_steps(net, ema, 6)
    ema.copy_params_from_model_to_ema()
    assert torch.equal(ema.ema_model[4].bias, sentinel_bias)
    assert torch.equal(ema.ema_model[1].running_mean, sentinel_bn)
    before = net[4].bias.detach().clone()
    ema.copy_params_from_ema_to_model()
    assert torch.equal(net[4].bias, before)
    assert torch.equal(net[0].weight, ema.ema_model[0].weight)


def test_update_model_with_ema_hare_and_tortoise():
    net = make_net()
    ema = EMA(
        net,
        beta=0.9,
        update_after_step=0,
        update_every=1,
        update_model_with_ema_every=3,
        update_model_with_ema_beta=0.25,
    )
    train_steps(net, ema, 3)
    online_before = net[0].weight.detach().clone()
    # the fourth call (pre-increment step 3) averages, then pulls the model toward the EMA
    ema.update()
    expected = 0.25 * online_before + 0.75 * ema.ema_model[0].weight
    assert torch.allclose(net[0].weight, expected, atol=1e-7)


def test_update_model_with_ema_zero_copies():
    net = make_net()
    ema = EMA(net, beta=0.9, update_after_step=0, update_every=1)
    train_steps(net, ema, 4)
    ema.update_model_with_ema()
    assert torch.equal(net[0].weight, ema.ema_model[0].weight)
    with pytest.raises(emakit.EMAValueError, match="decay"):
        ema.update_model_with_ema(decay=1.5)


def test_optimizer_post_step_hook():
    net = make_net()
    ema = EMA(net, beta=0.9, update_after_step=0, update_every=1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    handle = ema.add_to_optimizer_post_step_hook(opt)
    for _ in range(3):
        net(torch.randn(2, 3, 8, 8)).sum().backward()
        opt.step()
    assert int(ema.step) == 3
    handle.remove()
    opt.step()
    assert int(ema.step) == 3
    with pytest.raises(emakit.EMATypeError, match="optimizer"):
        ema.add_to_optimizer_post_step_hook(object())


# -- construction ---------------------------------------------------------------------------


def test_ema_model_factory_and_module():
    net = make_net()
    ema = EMA(
        net, ema_model=lambda: make_net(seed=3), beta=0.9, update_after_step=0, update_every=1
    )
    ema.update()
    assert torch.equal(ema.ema_model[0].weight, net[0].weight)
    given = make_net(seed=4)
    ema2 = EMA(net, ema_model=given)
    assert ema2.ema_model is given


def test_copy_does_not_duplicate_gradients_and_detaches():
    net = make_net()
    net(torch.randn(2, 3, 8, 8)).sum().backward()
    ema = EMA(net)
    for p in ema.ema_model.parameters():
        assert p.grad is None and not p.requires_grad
    assert all(p.grad is not None for p in net.parameters())


def test_lazy_init():
    net = make_net()
    ema = EMA(net, lazy_init_ema=True, update_after_step=0, update_every=1)
    assert ema.ema_model is None
    with pytest.raises(EMARuntimeError, match="update"):
        ema(torch.randn(1, 3, 8, 8))
    ema.update()
    assert torch.equal(ema.ema_model[0].weight, net[0].weight)
    with pytest.raises(emakit.EMAValueError, match="lazy_init_ema"):
        EMA(net, ema_model=make_net(), lazy_init_ema=True)


def test_an_uninitialized_lazy_module_is_refused_with_the_fix():
    model = nn.Sequential(nn.LazyLinear(3))
    with pytest.raises(EMAValueError, match=r"0\.weight.*forward.*lazy_init_ema=True"):
        EMA(model)
    ema = EMA(model, lazy_init_ema=True)  # the way out it names
    model(torch.zeros(1, 2))
    ema.update()
    assert ema.ema_model[0].weight.shape == (3, 2)


def test_forward_method_names():
    class Gen(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)

        def generate(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * 2

    net = Gen()
    ema = EMA(net, forward_method_names=("generate",))
    x = torch.randn(1, 2)
    assert torch.equal(ema.generate(x), ema.ema_model.generate(x))
    clone = copy.deepcopy(ema)  # a copy calls its own EMA model's method
    assert clone.generate.module is clone.ema_model
    assert torch.equal(clone.generate(x), ema.generate(x))
    with pytest.raises(emakit.EMAValueError, match="forward_method_names"):
        EMA(net, forward_method_names=("missing",))


def test_uncopyable_model_points_to_ema_model():
    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.lock = threading.Lock()

    with pytest.raises(emakit.EMATypeError, match="ema_model="):
        EMA(Holder())
    ema = EMA(Holder(), ema_model=lambda: Holder())
    assert isinstance(ema.ema_model, Holder)


def test_wrappers_are_unwrapped():
    net = make_net()
    compiled = torch.compile(net)
    ema = EMA(compiled)
    assert ema.model is net
    assert set(ema.state_dict()) >= {"ema_model.0.weight"}
    dp = nn.DataParallel(net)
    assert EMA(dp).model is net


# -- forward and swap -------------------------------------------------------------------------


def test_call_runs_ema_model_in_eval_without_grad_and_restores_modes():
    net = make_net()
    ema = EMA(net)
    ema.ema_model.train()
    ema.ema_model[1].eval()  # a submodule deliberately in eval mode
    x = torch.randn(4, 3, 8, 8)
    y = ema(x)
    assert not y.requires_grad
    ema.ema_model.eval()
    expected = ema.ema_model(x)
    assert torch.equal(y, expected)  # eval mode: dropout off, BN running stats
    ema.ema_model.train()
    ema.ema_model[1].eval()
    ema(x)
    assert ema.ema_model.training and ema.ema_model[5].training and not ema.ema_model[1].training


def test_swap_holds_ema_weights_and_restores_without_copies():
    net = make_net()
    ema = EMA(net, beta=0.5, update_after_step=0, update_every=1)
    train_steps(net, ema, 5)
    own = {k: v.clone() for k, v in net.state_dict().items()}
    ptrs = {n: p.data_ptr() for n, p in net.named_parameters()}
    with ema.swap():
        for k, v in ema.ema_model.state_dict().items():
            assert torch.equal(net.state_dict()[k], v), k
        # zero extra memory: the online parameters point at the shadow's storage
        for n, p in net.named_parameters():
            assert p.data_ptr() == dict(ema.ema_model.named_parameters())[n].data_ptr()
    for k, v in net.state_dict().items():
        assert torch.equal(v, own[k]), k
    assert {n: p.data_ptr() for n, p in net.named_parameters()} == ptrs


def test_swap_restores_on_exception_and_forbids_update_and_nesting():
    net = make_net()
    ema = EMA(net, beta=0.5, update_after_step=0, update_every=1)
    train_steps(net, ema, 3)
    own = net[0].weight.detach().clone()
    with pytest.raises(KeyError), ema.swap():
        raise KeyError("boom")
    assert torch.equal(net[0].weight, own)
    with ema.swap():
        with pytest.raises(EMARuntimeError, match="swap"):
            ema.update()
        with pytest.raises(EMARuntimeError, match="nested"), ema.swap():
            pass
    assert torch.equal(net[0].weight, own)
    ema.update()  # fine again afterwards


def test_swap_with_wider_shadow_casts():
    net = make_net().to(torch.bfloat16)
    ema = EMA(net, ema_dtype=torch.float32, beta=0.5, update_after_step=0, update_every=1)
    ema.update()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.5)
    ema.update()
    own = net[0].weight.detach().clone()
    with ema.swap():
        assert net[0].weight.dtype == torch.bfloat16
        assert torch.equal(net[0].weight, ema.ema_model[0].weight.to(torch.bfloat16))
    assert torch.equal(net[0].weight, own)
    assert ema.ema_model[0].weight.dtype == torch.float32


# -- state --------------------------------------------------------------------------------------


def test_state_dict_layout():
    net = make_net()
    ema = EMA(net)
    sd = ema.state_dict()
    assert sd._metadata[""]["version"] == emakit.STATE_VERSION
    assert "version" not in sd
    assert int(sd["step"]) == 0 and not bool(sd["initted"])
    assert "online_model.0.weight" in sd  # ema-pytorch's default: the model too
    assert "ema_model.1.num_batches_tracked" in sd
    small = EMA(net, include_online_model=False).state_dict()
    assert not any(k.startswith("online_model.") for k in small)
    assert set(ema.state_dict(include_online_model=False)) == set(small)


def test_load_keeps_shadow_dtype_and_values():
    net = make_net()
    ema = EMA(net, ema_dtype=torch.float64, update_after_step=0, update_every=1)
    train_steps(net, ema, 3)
    sd = {k: (v.half() if v.is_floating_point() else v) for k, v in ema.state_dict().items()}
    fresh = EMA(make_net(seed=9), ema_dtype=torch.float64)
    fresh.load_state_dict(sd)
    assert fresh.ema_model[0].weight.dtype == torch.float64
    assert torch.equal(fresh.ema_model[0].weight, sd["ema_model.0.weight"].double())
    assert int(fresh.step) == 3


def test_load_mismatch_names_keys():
    ema = EMA(make_net())
    sd = ema.state_dict()
    sd["ema_model.extra.weight"] = torch.zeros(1)
    del sd["ema_model.0.bias"]
    with pytest.raises(EMAStateError, match=r"ema_model\.0\.bias") as info:
        ema.load_state_dict(sd)
    assert "ema_model.extra.weight" in str(info.value)
    newer = ema.state_dict()
    newer["version"] = torch.tensor(emakit.STATE_VERSION + 1)
    with pytest.raises(EMAStateError, match="version"):
        ema.load_state_dict(newer)
    with pytest.raises(emakit.EMATypeError, match="mapping"):
        ema.load_state_dict([1, 2])


@pytest.mark.parametrize("use_foreach", [False, True, None])
def test_resume_is_bit_identical(tmp_path, use_foreach):
    kw = dict(beta=0.99, update_after_step=3, update_every=2, use_foreach=use_foreach)
    # uninterrupted
    net_a = make_net()
    ema_a = EMA(net_a, **kw)
    opt_a = torch.optim.AdamW(net_a.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    data = [torch.randn(4, 3, 8, 8, generator=gen) for _ in range(30)]

    def run(net, ema, opt, batches):
        for x in batches:
            net(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            ema.update()

    torch.manual_seed(123)  # dropout draws from the global generator
    run(net_a, ema_a, opt_a, data)
    # interrupted at step 13: save, rebuild everything fresh, load, continue
    net_b = make_net()
    ema_b = EMA(net_b, **kw)
    opt_b = torch.optim.AdamW(net_b.parameters(), lr=1e-2)
    torch.manual_seed(123)
    run(net_b, ema_b, opt_b, data[:13])
    path = tmp_path / "ckpt.pt"
    torch.save(
        {
            "model": net_b.state_dict(),
            "opt": opt_b.state_dict(),
            "ema": ema_b.state_dict(),
            "rng": torch.get_rng_state(),
        },
        path,
    )
    ckpt = torch.load(path)
    net_c = make_net(seed=42)
    net_c.load_state_dict(ckpt["model"])
    ema_c = EMA(net_c, **kw)
    ema_c.load_state_dict(ckpt["ema"])
    opt_c = torch.optim.AdamW(net_c.parameters(), lr=1e-2)
    opt_c.load_state_dict(ckpt["opt"])
    torch.set_rng_state(ckpt["rng"])
    run(net_c, ema_c, opt_c, data[13:])
    assert int(ema_c.step) == int(ema_a.step) == 30
    for k, v in ema_a.ema_model.state_dict().items():
        assert torch.equal(ema_c.ema_model.state_dict()[k], v), k


def test_pickle_deepcopy_and_torch_save_whole():
    net = make_net()
    ema = EMA(net, beta=0.9, update_after_step=0, update_every=1)
    train_steps(net, ema, 4)
    for clone in (pickle.loads(pickle.dumps(ema)), copy.deepcopy(ema)):
        assert int(clone.step) == 4
        for k, v in ema.ema_model.state_dict().items():
            assert torch.equal(clone.ema_model.state_dict()[k], v)
        train_steps(clone.model, clone, 2)  # the copy keeps working on its own model copy
        assert int(clone.step) == 6
    buf = io.BytesIO()
    torch.save(ema, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert torch.equal(loaded.ema_model[0].weight, ema.ema_model[0].weight)


def test_to_rebuilds_plan():
    net = make_net()
    ema = EMA(net, beta=0.5, update_after_step=0, update_every=1, include_online_model=False)
    train_steps(net, ema, 2)
    ema.to(torch.float64)
    assert ema.ema_model[0].weight.dtype == torch.float64
    with pytest.raises(EMAStateError, match="coerce_dtype"):
        ema.update()


def test_to_moves_the_registered_online_model_as_ema_pytorch():
    net = make_net()
    ema = EMA(net, beta=0.5, update_after_step=0, update_every=1)  # include_online_model
    train_steps(net, ema, 2)
    ema.to(torch.float64)
    assert net[0].weight.dtype == ema.ema_model[0].weight.dtype == torch.float64
    ema.update()  # one dtype again: the plan is rebuilt and runs


# -- pytree -------------------------------------------------------------------------------------


def test_non_module_is_an_ema_of_a_pytree_with_the_real_signature():
    """EMA(tensor) is an EMA (not a different class behind __new__) tracking the pytree,
    and EMA's signature is its real one (bug of the __new__ routing)."""
    assert "beta" in inspect.signature(EMA).parameters
    assert "model" in inspect.signature(EMA).parameters
    t = torch.zeros(3)
    ema = EMA(t, update_after_step=0, update_every=1, schedule=lambda t: 0.5)
    assert isinstance(ema, EMA) and ema.kind == "pytree"
    assert ema.pytree is t
    ema.update()
    t.fill_(2.0)
    ema.update()
    assert torch.equal(ema.ema_pytree, torch.full((3,), 1.0))
    assert torch.equal(ema(), ema.ema_pytree)


def test_pytree_nested_state_and_int_leaves():
    tree = {"w": torch.ones(2, 2), "inner": [torch.zeros(3), (torch.tensor([1, 2]), "label")]}
    ema = EMAPytree(tree, update_after_step=0, update_every=1, schedule=lambda t: 0.5)
    ema.update()
    tree["w"].mul_(3.0)
    tree["inner"][0].add_(4.0)
    tree["inner"][1][0].add_(10)
    ema.update()
    assert torch.equal(ema.ema_pytree["w"], torch.full((2, 2), 2.0))
    assert torch.equal(ema.ema_pytree["inner"][0], torch.full((3,), 2.0))
    assert torch.equal(ema.ema_pytree["inner"][1][0], torch.tensor([11, 12]))
    sd = ema.state_dict()
    assert {"ema.w", "ema.inner.0", "ema.inner.1.0", "initted", "step"} <= set(sd)
    fresh = EMAPytree(
        {"w": torch.zeros(2, 2), "inner": [torch.zeros(3), (torch.tensor([0, 0]), "x")]}
    )
    fresh.load_state_dict(sd)
    assert torch.equal(fresh.ema_pytree["w"], ema.ema_pytree["w"])
    assert int(fresh.step) == 2
    with pytest.raises(emakit.EMATypeError, match="pytree"):
        EMAPytree("not tensors")


# -- errors -------------------------------------------------------------------------------------

BAD_ARGS = [
    (dict(beta=1.5), "beta"),
    (dict(beta=-0.1), "beta"),
    (dict(beta=float("nan")), "beta"),
    (dict(beta="0.9"), "beta"),
    (dict(beta=True), "beta"),
    (dict(update_every=0), "update_every"),
    (dict(update_every=2.0), "update_every"),
    (dict(update_after_step=-1), "update_after_step"),
    (dict(inv_gamma=0.0), "inv_gamma"),
    (dict(power=-1.0), "power"),
    (dict(min_value=0.5, beta=0.4), "min_value"),
    (dict(param_or_buffer_names_no_ema="0.weight"), "param_or_buffer_names_no_ema"),
    (dict(ignore_names=[1]), "ignore_names"),
    (dict(update_model_with_ema_every=0), "update_model_with_ema_every"),
    (dict(update_model_with_ema_beta=2.0), "update_model_with_ema_beta"),
    (dict(use_foreach="yes"), "use_foreach"),
    (dict(coerce_dtype=1), "coerce_dtype"),
    (dict(ema_dtype=torch.int64), "ema_dtype"),
    (dict(ema_dtype="float32"), "ema_dtype"),
    (dict(schedule=0.99), "schedule"),
    (dict(forward_method_names="generate"), "forward_method_names"),
    (dict(ema_model=42), "ema_model"),
    (dict(ema_model=lambda: 42), "ema_model"),
    (dict(ema_model=nn.Linear(2, 2)), "ema_model"),
]


@pytest.mark.parametrize(
    ("kwargs", "name"), BAD_ARGS, ids=[f"{n}-{i}" for i, (_, n) in enumerate(BAD_ARGS)]
)
def test_bad_arguments_raise_named_errors(kwargs, name):
    with pytest.raises(EMAError) as info:
        EMA(make_net(), **kwargs)
    assert isinstance(info.value, (ValueError, TypeError))
    assert name in str(info.value)


def test_dtype_and_device_mismatch_errors():
    net = make_net()
    with pytest.raises(EMAStateError, match="coerce_dtype"):
        EMA(net, ema_model=make_net().double())
    ema = EMA(
        net, ema_model=make_net().double(), coerce_dtype=True, update_after_step=0, update_every=1
    )
    ema.update()
    assert torch.equal(ema.ema_model[0].weight, net[0].weight.double())


def test_module_only_keywords_are_refused_for_a_pytree():
    with pytest.raises(emakit.EMAValueError, match="update_model_with_ema_every"):
        EMA(torch.zeros(3), update_model_with_ema_every=2)
    with pytest.raises(emakit.EMAValueError, match="decay_groups"):
        EMA({"w": torch.zeros(3)}, decay_groups={"w": 0.9})
    ema = EMAPytree({"w": torch.zeros(3)})
    assert isinstance(ema, EMA) and ema.kind == "pytree"


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(param_or_buffer_names_no_ema={"nope"}), "param_or_buffer_names_no_ema"),
        (dict(ignore_names={"0.wieght"}), "ignore_names"),
        (dict(ignore_startswith_names={"decoder."}), "ignore_startswith_names"),
    ],
)
def test_names_that_match_nothing_yet_warn_naming_the_argument(kwargs, name):
    with pytest.warns(UserWarning, match=name):
        EMA(make_net(), **kwargs)


def test_a_submodule_put_back_after_building_the_ema_stays_ignored():
    """A real trainer pattern: remove a submodule that cannot be deep-copied, build the EMA
    with ignore_startswith_names={'codec.'}, put the submodule back."""
    net = make_net()
    with pytest.warns(UserWarning, match="ignore_startswith_names"):
        ema = EMA(net, ignore_startswith_names={"codec."}, update_after_step=0, update_every=1)
    net.codec = nn.Linear(5, 5)  # back in place (a Sequential: it runs last)
    train_steps(net, ema, 3)
    online = net.codec.weight.detach().clone()
    with ema.swap():
        assert torch.equal(net.codec.weight, online)  # ignored: never swapped or averaged
        assert torch.equal(net[0].weight, ema.ema_model[0].weight)  # the rest is swapped
    assert int(ema.step) == 3 and "codec.weight" not in ema.ema_model.state_dict()

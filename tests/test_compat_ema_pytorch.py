"""Differential tests against ema-pytorch 0.8.3, and tests of each deliberate difference.

The same training sequence (same data, same SGD, two deep copies of one model) runs
through ``emakit.EMA`` and ``ema_pytorch.EMA`` with the same configuration; after every
step all floating tensors of both ``ema_model``s must be bit-identical and
``get_current_decay()`` equal. Where SPEC §1 lists a deliberate fix of an ema-pytorch
defect, the test asserts emakit's behaviour (and, to show the difference is real, that
ema-pytorch 0.8.3 still behaves the old way).
"""

from __future__ import annotations

import copy
import importlib.metadata
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import emakit
from _models import conv_bn_net as make_net
from emakit.schedules import inverse_gamma_float32

ema_pytorch = pytest.importorskip("ema_pytorch")
if importlib.metadata.version("ema-pytorch") != "0.8.3":  # pragma: no cover
    pytest.skip("these tests pin ema-pytorch 0.8.3", allow_module_level=True)


pytestmark = pytest.mark.usefixtures("one_thread")


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 3, 5, 5, generator=gen), torch.randn(8, 3, generator=gen)


def make_opt(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    x, y = batch(step)
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()


def floating(module: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: t
        for n, t in (*module.named_parameters(), *module.named_buffers())
        if t.is_floating_point()
    }


def ignored(name: str, cfg: dict[str, Any]) -> bool:
    return name in cfg.get("ignore_names", ()) or any(
        name.startswith(p) for p in cfg.get("ignore_startswith_names", ())
    )


def assert_same_floats(
    ours: nn.Module, theirs: nn.Module, what: str, skip: Callable[[str], bool] = lambda n: False
) -> int:
    a, b = floating(ours), floating(theirs)
    assert a.keys() == b.keys(), what
    compared = 0
    for name in a:
        if skip(name):
            continue
        assert a[name].dtype == b[name].dtype, f"{what}: {name} dtype"
        assert torch.equal(a[name], b[name]), f"{what}: {name} differs"
        compared += 1
    return compared


# -- the configuration table ----------------------------------------------------------------

# Each row: (id, EMA keywords, how the EMA model is given, flatten the emakit model).
# "module_f64": a float64 ema_model= Module (each side its own copy); "factory": a zero-arg
# factory; "lazy": lazy_init_ema=True; None: the default deep copy.
CONFIGS: list[tuple[str, dict[str, Any], str | None, bool]] = [
    ("defaults", {}, None, False),
    ("every1", {"update_every": 1, "update_after_step": 5}, None, False),
    ("every3", {"update_every": 3, "update_after_step": 5}, None, False),
    ("every10", {"update_every": 10, "update_after_step": 5}, None, False),
    ("after0", {"update_every": 1, "update_after_step": 0}, None, False),
    ("after5", {"update_every": 2, "update_after_step": 5}, None, False),
    ("after100", {"update_every": 1, "update_after_step": 100}, None, False),
    ("after100_every3", {"update_every": 3, "update_after_step": 100}, None, False),
    ("inv_gamma_half", {"update_every": 1, "update_after_step": 2, "inv_gamma": 0.5}, None, False),
    (
        "inv_gamma10_power1",
        {"update_every": 2, "update_after_step": 2, "inv_gamma": 10.0, "power": 1.0},
        None,
        False,
    ),
    ("power3_4", {"update_every": 1, "update_after_step": 3, "power": 3 / 4}, None, False),
    (
        "min_value",
        {"update_every": 1, "update_after_step": 3, "min_value": 0.6, "beta": 0.95},
        None,
        False,
    ),
    ("beta0.9", {"update_every": 1, "update_after_step": 2, "beta": 0.9}, None, False),
    ("beta0.999", {"update_every": 2, "update_after_step": 2, "beta": 0.999}, None, False),
    ("beta1_frozen", {"update_every": 1, "update_after_step": 3, "beta": 1.0}, None, False),
    (
        "no_ema_names",
        {
            "update_every": 1,
            "update_after_step": 3,
            "beta": 0.9,
            "param_or_buffer_names_no_ema": {"bn.running_var", "fc.weight"},
        },
        None,
        False,
    ),
    (
        "ignore_names",
        {
            "update_every": 2,
            "update_after_step": 3,
            "beta": 0.9,
            "ignore_names": {"fc.bias", "bn.running_mean"},
            "ignore_startswith_names": {"bn_out."},
        },
        None,
        False,
    ),
    (
        "model_with_ema_b0",
        {
            "update_every": 3,
            "update_after_step": 5,
            "beta": 0.9,
            "update_model_with_ema_every": 6,
            "update_model_with_ema_beta": 0.0,
        },
        None,
        False,
    ),
    (
        "model_with_ema_b05",
        {
            "update_every": 2,
            "update_after_step": 4,
            "beta": 0.9,
            "update_model_with_ema_every": 4,
            "update_model_with_ema_beta": 0.5,
        },
        None,
        False,
    ),
    (
        "model_with_ema_every1_b05",
        {
            "update_every": 1,
            "update_after_step": 3,
            "beta": 0.8,
            "update_model_with_ema_every": 5,
            "update_model_with_ema_beta": 0.5,
        },
        None,
        False,
    ),
    (
        "model_with_ema_no_ema_names",
        {
            "update_every": 1,
            "update_after_step": 3,
            "beta": 0.9,
            "param_or_buffer_names_no_ema": {"bn.running_var", "fc.weight"},
            "update_model_with_ema_every": 3,
            "update_model_with_ema_beta": 0.5,
        },
        None,
        False,
    ),
    (
        "coerce_float64",
        {"update_every": 1, "update_after_step": 3, "beta": 0.9, "coerce_dtype": True},
        "module_f64",
        False,
    ),
    ("lazy_init", {"update_every": 2, "update_after_step": 3, "beta": 0.9}, "lazy", False),
    ("factory", {"update_every": 2, "update_after_step": 3, "beta": 0.9}, "factory", False),
    ("flattened", {"update_every": 1, "update_after_step": 3, "beta": 0.9}, None, True),
    ("flattened_every3", {"update_every": 3, "update_after_step": 5}, None, True),
    (
        "flattened_no_ema_names",
        {
            "update_every": 1,
            "update_after_step": 3,
            "beta": 0.9,
            "param_or_buffer_names_no_ema": {"bn.running_var", "fc.weight"},
        },
        None,
        True,
    ),
    (
        "flattened_model_with_ema",
        {
            "update_every": 2,
            "update_after_step": 3,
            "beta": 0.9,
            "update_model_with_ema_every": 4,
            "update_model_with_ema_beta": 0.5,
        },
        None,
        True,
    ),
    (
        "flattened_ignore_names",
        {
            "update_every": 1,
            "update_after_step": 2,
            "beta": 0.9,
            "ignore_names": {"conv.bias"},
            "ignore_startswith_names": {"bn_out."},
        },
        None,
        True,
    ),
]


def num_steps(cfg: dict[str, Any]) -> int:
    # Enough calls that warm-up, skipped calls and at least 4 averaging updates all happen.
    return max(40, cfg.get("update_after_step", 100) + 4 * cfg.get("update_every", 10) + 2)


def build_pair(
    model_ours: nn.Module, model_theirs: nn.Module, cfg: dict[str, Any], kind: str | None, **ours_kw
) -> tuple[emakit.EMA, Any]:
    kw_ours, kw_theirs = dict(cfg), dict(cfg)
    if kind == "module_f64":
        kw_ours["ema_model"] = copy.deepcopy(model_theirs).double()
        kw_theirs["ema_model"] = copy.deepcopy(model_theirs).double()
    elif kind == "factory":
        template = copy.deepcopy(model_theirs)
        kw_ours["ema_model"] = lambda: copy.deepcopy(template)
        kw_theirs["ema_model"] = lambda: copy.deepcopy(template)
    elif kind == "lazy":
        kw_ours["lazy_init_ema"] = kw_theirs["lazy_init_ema"] = True
    ours = emakit.EMA(model_ours, **kw_ours, **ours_kw)
    theirs = ema_pytorch.EMA(model_theirs, **kw_theirs)
    return ours, theirs


@pytest.mark.parametrize("use_foreach", [False, True, None], ids=["loop", "foreach", "flat"])
@pytest.mark.parametrize(
    ("cfg", "kind", "flatten"), [c[1:] for c in CONFIGS], ids=[c[0] for c in CONFIGS]
)
def test_matches_ema_pytorch_every_step(cfg, kind, flatten, use_foreach):
    base = make_net()
    model_ours, model_theirs = copy.deepcopy(base), copy.deepcopy(base)
    if flatten:
        emakit.flatten_parameters(model_ours)
    ours, theirs = build_pair(model_ours, model_theirs, cfg, kind, use_foreach=use_foreach)
    if kind == "lazy":
        assert ours.ema_model is None
    opt_ours, opt_theirs = make_opt(model_ours), make_opt(model_theirs)
    pulls_model = cfg.get("update_model_with_ema_every") is not None

    def skip(name: str) -> bool:  # ignored names differ on purpose (see below)
        return ignored(name, cfg)

    averaged = 0
    for step in range(num_steps(cfg)):
        train_step(model_ours, opt_ours, step)
        train_step(model_theirs, opt_theirs, step)
        ours.update()
        theirs.update()

        assert int(ours.step) == int(theirs.step.item()) == step + 1
        assert ours.get_current_decay() == theirs.get_current_decay(), f"decay at call {step + 1}"
        n = assert_same_floats(
            ours.ema_model, theirs.ema_model, f"ema_model after call {step + 1}", skip
        )
        assert n > 0
        if pulls_model:
            assert_same_floats(model_ours, model_theirs, f"online model after call {step + 1}")
        if ours.get_current_decay() > 0 and step % cfg.get("update_every", 10) == 0:
            averaged += 1
    assert averaged >= 4, "the configuration never reached the averaging phase"
    if cfg.get("beta", 0.9999) != 1.0:
        # The EMA really moved away from the online weights (averaging was not a copy).
        assert any(
            not torch.equal(t, floating(model_theirs)[n])
            for n, t in floating(ours.ema_model).items()
            if not ignored(n, cfg)
        )


def test_frozen_config_really_freezes():
    # Guards the table's "beta1_frozen" row: a frozen EMA keeps the last warm-up copy.
    base = make_net()
    ours = emakit.EMA(base, beta=1.0, update_every=1, update_after_step=3)
    opt = make_opt(base)
    for step in range(4):
        train_step(base, opt, step)
        ours.update()
    frozen = {n: t.clone() for n, t in floating(ours.ema_model).items()}
    for step in range(4, 20):
        train_step(base, opt, step)
        ours.update()
    for n, t in floating(ours.ema_model).items():
        assert torch.equal(t, frozen[n]), n
    assert not torch.equal(base.fc.weight, frozen["fc.weight"])


# -- schedule -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("inv_gamma", "power", "min_value", "beta"),
    [
        (1.0, 2 / 3, 0.0, 0.9999),
        (1.0, 3 / 4, 0.0, 0.999),
        (0.5, 1.0, 0.1, 0.99),
        (10.0, 0.5, 0.3, 0.9),
        (2.0, 2 / 3, 0.0, 1.0),
    ],
)
def test_inverse_gamma_float32_matches_ema_pytorch(inv_gamma, power, min_value, beta):
    update_after_step = 7
    theirs = ema_pytorch.EMA(
        nn.Linear(1, 1),
        beta=beta,
        update_after_step=update_after_step,
        inv_gamma=inv_gamma,
        power=power,
        min_value=min_value,
    )
    steps = [*range(0, 1500), *range(1500, 2_000_000, 7919), 10**7, 10**8]
    values = set()
    for s in steps:
        theirs.step.fill_(s)
        t = max(s - update_after_step - 1, 0)
        ours = inverse_gamma_float32(
            t, beta=beta, inv_gamma=inv_gamma, power=power, min_value=min_value
        )
        assert ours == theirs.get_current_decay(), f"{s=}"
        values.add(ours)
    assert len(values) > 20  # the warm-up really varies over the steps compared


# -- loading an ema-pytorch state ------------------------------------------------------------


@pytest.mark.parametrize("use_foreach", [False, True, None], ids=["loop", "foreach", "flat"])
@pytest.mark.parametrize("theirs_include_online", [True, False], ids=["with_online", "no_online"])
def test_loads_ema_pytorch_state_and_continues_identically(theirs_include_online, use_foreach):
    cfg = {"beta": 0.9, "update_every": 2, "update_after_step": 4}
    base = make_net()
    model_ours, model_theirs = copy.deepcopy(base), copy.deepcopy(base)
    opt_ours, opt_theirs = make_opt(model_ours), make_opt(model_theirs)
    theirs = ema_pytorch.EMA(model_theirs, include_online_model=theirs_include_online, **cfg)
    for step in range(15):
        train_step(model_ours, opt_ours, step)
        train_step(model_theirs, opt_theirs, step)
        theirs.update()
    state = theirs.state_dict()
    assert any(k.startswith("online_model.") for k in state) == theirs_include_online

    ours = emakit.EMA(model_ours, use_foreach=use_foreach, **cfg)
    ours.load_state_dict(state)
    assert int(ours.step) == 15
    assert_same_floats(ours.ema_model, theirs.ema_model, "right after loading")
    for step in range(15, 45):
        train_step(model_ours, opt_ours, step)
        train_step(model_theirs, opt_theirs, step)
        ours.update()
        theirs.update()
        assert ours.get_current_decay() == theirs.get_current_decay()
        assert_same_floats(ours.ema_model, theirs.ema_model, f"after call {step + 1}")
    assert ours.get_current_decay() > 0


# -- deliberate differences ------------------------------------------------------------------


def test_integer_buffers_are_copied_into_the_ema():
    base = make_net()
    model_ours, model_theirs = copy.deepcopy(base), copy.deepcopy(base)
    cfg = {"beta": 0.9, "update_every": 1, "update_after_step": 2}
    ours, theirs = emakit.EMA(model_ours, **cfg), ema_pytorch.EMA(model_theirs, **cfg)
    opt_ours, opt_theirs = make_opt(model_ours), make_opt(model_theirs)
    for step in range(8):  # warm-up copies and averaging updates
        train_step(model_ours, opt_ours, step)
        train_step(model_theirs, opt_theirs, step)
        ours.update()
        theirs.update()
        for name in ("bn.num_batches_tracked", "bn_out.num_batches_tracked"):
            live = model_ours.get_buffer(name)
            assert int(live) == step + 1
            assert torch.equal(ours.ema_model.get_buffer(name), live), name
            # ema-pytorch 0.8.3 leaves integer buffers as they were when it copied the model.
            assert int(theirs.ema_model.get_buffer(name)) == 0


def test_ignored_names_are_never_touched():
    cfg = {
        "beta": 0.9,
        "update_every": 1,
        "update_after_step": 5,
        "ignore_names": {"fc.bias", "bn.running_mean"},
        "ignore_startswith_names": {"bn_out."},
    }
    names = ["fc.bias", "bn.running_mean", "bn_out.weight", "bn_out.bias", "bn_out.running_var"]
    base = make_net()
    model_ours, model_theirs = copy.deepcopy(base), copy.deepcopy(base)
    ours, theirs = emakit.EMA(model_ours, **cfg), ema_pytorch.EMA(model_theirs, **cfg)
    # Mark the ignored EMA tensors so any write to them shows.
    for ema in (ours, theirs):
        with torch.no_grad():
            for n in names:
                floating(ema.ema_model)[n].fill_(-7.0)

    def marked(m: nn.Module) -> bool:
        return all(bool((floating(m)[n] == -7.0).all()) for n in names)

    opt_ours, opt_theirs = make_opt(model_ours), make_opt(model_theirs)
    for step in range(4):  # init + warm-up copies
        train_step(model_ours, opt_ours, step)
        train_step(model_theirs, opt_theirs, step)
        ours.update()
        theirs.update()
        assert marked(ours.ema_model), f"warm-up copy {step + 1} wrote an ignored name"
    assert not marked(theirs.ema_model)  # ema-pytorch copies them during warm-up

    # copy_params_from_model_to_ema leaves ignored EMA tensors alone ...
    ours.copy_params_from_model_to_ema()
    assert marked(ours.ema_model)
    assert torch.equal(ours.ema_model.fc.weight, model_ours.fc.weight)
    # ... and copy_params_from_ema_to_model leaves ignored online tensors alone.
    before = {n: floating(model_ours)[n].clone() for n in names}
    with torch.no_grad():
        ours.ema_model.fc.weight.add_(1.0)
    ours.copy_params_from_ema_to_model()
    assert torch.equal(model_ours.fc.weight, ours.ema_model.fc.weight)
    for n in names:
        assert torch.equal(floating(model_ours)[n], before[n]), n
    with torch.no_grad():
        theirs.ema_model.fc.bias.fill_(-7.0)
    theirs.copy_params_from_ema_to_model()
    assert bool((model_theirs.fc.bias == -7.0).all())  # ema-pytorch copies ignored names
    # And averaging updates never touch them either.
    for step in range(4, 12):
        train_step(model_ours, opt_ours, step)
        ours.update()
    assert ours.get_current_decay() > 0
    assert marked(ours.ema_model)


class ModeNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.drop = nn.Dropout(0.5)
        self.seen: list[tuple[str, bool, bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name, m in (("lin", self.lin), ("bn", self.bn), ("drop", self.drop)):
            self.seen.append((name, m.training, torch.is_grad_enabled()))
        return self.drop(self.bn(self.lin(x)))


def test_forward_runs_ema_model_in_eval_mode_without_grad_and_restores_modes():
    torch.manual_seed(0)
    net = ModeNet()
    ema = emakit.EMA(net, beta=0.9, update_every=1, update_after_step=0)
    ema.update()
    ema.ema_model.train()
    ema.ema_model.drop.eval()  # a mixed pattern of modes, restored per submodule
    modes = {n: m.training for n, m in ema.ema_model.named_modules()}
    stats = ema.ema_model.bn.running_mean.clone()
    x = torch.randn(6, 4, requires_grad=True)

    y1, y2 = ema(x), ema(x)  # eval: dropout off, BN uses running stats -> deterministic
    assert torch.equal(y1, y2)
    assert not y1.requires_grad
    assert ema.ema_model.seen[-3:] == [
        ("lin", False, False),
        ("bn", False, False),
        ("drop", False, False),
    ]
    assert {n: m.training for n, m in ema.ema_model.named_modules()} == modes
    assert torch.equal(ema.ema_model.bn.running_mean, stats)  # eval BN did not update stats
    ref = copy.deepcopy(ema.ema_model).eval()
    with torch.no_grad():
        assert torch.equal(y1, ref(x))


def test_online_model_is_in_state_dict_by_default_as_in_ema_pytorch():
    net = make_net()
    small = emakit.EMA(net, beta=0.9, include_online_model=False)
    keys = small.state_dict().keys()
    assert not any(k.startswith("online_model.") for k in keys)
    assert "ema_model.fc.weight" in keys and "step" in keys and "initted" in keys
    assert "version" not in keys  # the layout version lives in the metadata

    included = emakit.EMA(net, beta=0.9)
    assert included.include_online_model is True
    assert set(included.state_dict()) == set(ema_pytorch.EMA(net).state_dict())
    state = included.state_dict()
    assert torch.equal(state["online_model.fc.weight"], net.fc.weight)
    assert {k for k in state if k.startswith("online_model.")} == {
        "online_model." + k for k in net.state_dict()
    }
    # ema-pytorch 0.8.3 saves the online model by default.
    assert "online_model.fc.weight" in ema_pytorch.EMA(net).state_dict()


class Renamed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 3)  # "fc" in Net
        self.bn_out = nn.BatchNorm1d(3)


def test_mismatched_ema_model_raises_naming_missing_and_extra_names():
    with pytest.raises(emakit.EMAStateError) as info:
        emakit.EMA(make_net(), ema_model=Renamed())
    msg = str(info.value)
    for name in ("fc.weight", "fc.bias", "head.weight", "head.bias"):
        assert name in msg
    assert isinstance(info.value, emakit.EMAError)
    # ema-pytorch 0.8.3 accepts it silently (it zips tensors by position).
    ema_pytorch.EMA(make_net(), ema_model=Renamed())


def test_mismatched_factory_ema_model_raises_too():
    with pytest.raises(emakit.EMAStateError, match=r"head\.weight"):
        emakit.EMA(make_net(), ema_model=Renamed)


@pytest.mark.parametrize("use_foreach", [False, True, None], ids=["loop", "foreach", "flat"])
def test_update_model_with_ema_follows_ema_pytorch_cadence_outside_warm_up(use_foreach):
    """ema-pytorch pulls the model every ``update_model_with_ema_every`` calls, whether or
    not the call averaged (update_every=3, pull every 2 on purpose). emakit follows that
    cadence, bit for bit, except during the warm-up, where the EMA is only a copy of the
    model (ema-pytorch pulls there too, on calls that do not copy)."""
    cfg = {
        "beta": 0.9,
        "update_every": 3,
        "update_after_step": 7,
        "update_model_with_ema_every": 2,
        "update_model_with_ema_beta": 0.5,
    }
    base = make_net()
    model_ours, model_theirs = copy.deepcopy(base), copy.deepcopy(base)
    ours = emakit.EMA(model_ours, use_foreach=use_foreach, **cfg)
    theirs = ema_pytorch.EMA(model_theirs, **cfg)
    opt_ours, opt_theirs = make_opt(model_ours), make_opt(model_theirs)
    pulled_ours, pulled_theirs = [], []
    for step in range(30):
        train_step(model_ours, opt_ours, step)
        train_step(model_theirs, opt_theirs, step)
        before_ours = model_ours.fc.weight.clone()
        before_theirs = model_theirs.fc.weight.clone()
        ours.update()
        theirs.update()
        if not torch.equal(model_ours.fc.weight, before_ours):
            pulled_ours.append(step)
        if not torch.equal(model_theirs.fc.weight, before_theirs):
            pulled_theirs.append(step)
    # step = calls before this one: every second call after the warm-up (step > 7)
    assert pulled_ours == [s for s in range(30) if s % 2 == 0 and s > 7]
    assert [s for s in pulled_theirs if s > 7] == pulled_ours
    assert 2 in pulled_theirs and 2 not in pulled_ours  # the documented warm-up exception


def test_update_model_with_ema_cadence_matches_ema_pytorch_bit_for_bit():
    """A protein-model-like config: pull every 25 calls, average every 10. Outside the
    warm-up the online models of emakit and ema-pytorch stay bit-identical."""
    cfg = {
        "beta": 0.9,
        "update_every": 10,
        "update_after_step": 0,
        "update_model_with_ema_every": 25,
        "update_model_with_ema_beta": 0.5,
    }
    base = make_net()
    model_ours, model_theirs = copy.deepcopy(base), copy.deepcopy(base)
    ours = emakit.EMA(model_ours, **cfg)
    theirs = ema_pytorch.EMA(model_theirs, **cfg)
    opt_ours, opt_theirs = make_opt(model_ours), make_opt(model_theirs)
    for step in range(120):
        train_step(model_ours, opt_ours, step)
        train_step(model_theirs, opt_theirs, step)
        ours.update()
        theirs.update()
        assert_same_floats(model_ours, model_theirs, f"online model after call {step + 1}")
        assert_same_floats(ours.ema_model, theirs.ema_model, f"EMA after call {step + 1}")


def test_update_model_with_ema_beta_zero_copies_the_ema_into_the_model():
    cfg = {"beta": 0.9, "update_every": 2, "update_after_step": 2, "update_model_with_ema_every": 4}
    net = make_net()
    ours = emakit.EMA(net, **cfg)
    opt = make_opt(net)
    for step in range(9):
        train_step(net, opt, step)
        ours.update()
    # Call 9 (step 8) averaged and pulled: the online model now equals the EMA.
    assert ours.get_current_decay() > 0
    for n, t in floating(net).items():
        assert torch.equal(t, floating(ours.ema_model)[n]), n


def test_karras_update_every_1_is_one_step_behind_ema_pytorch_as_the_readme_says():
    """README table row: emakit's call c + 1 uses ema-pytorch's decay of call c."""
    import ema_pytorch

    net = make_net()
    ours = emakit.KarrasEMA(net, sigma_rel=0.1, update_every=1)
    theirs = ema_pytorch.KarrasEMA(copy.deepcopy(net), sigma_rel=0.1, update_every=1)
    assert ours.gamma == pytest.approx(theirs.gamma, rel=1e-12)
    ours_decays, theirs_decays = [], []
    for _ in range(8):
        ours.update()
        theirs.update()
        ours_decays.append(ours.get_current_decay())
        theirs_decays.append(theirs.beta)  # the decay its update() just used
    assert ours_decays[0] == 0.0  # the first call copies
    assert ours_decays[1:] == pytest.approx(theirs_decays[:-1], rel=1e-12)
    assert ours_decays[1:] != pytest.approx(theirs_decays[1:], rel=1e-6)

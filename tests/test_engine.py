"""The update engine: every path against the reference loop, flatten_parameters, the plan.

``use_foreach=False`` is the reference per-tensor loop, ``True`` the foreach path and
``None`` the flat path; the functional kernels ``ema_lerp_``/``ema_copy_`` take the same
three as ``impl``. Every fast path must agree bit for bit with the loop, and the loop with
a by-hand reference (``RefEMA``) that walks the live model on every call.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import emakit
from _models import ConvBNLayerNormNet as Net
from _models import conv_bn_layernorm_net as make_net
from _models import reference_ema_step
from emakit import EMA, flatten_parameters
from emakit._core.tracker import Tracker
from emakit._engine.flat import aligned_offsets
from emakit._engine.kernels import IMPLS, ema_copy_, ema_lerp_
from emakit._engine.plan import Plan
from emakit.schedules import inverse_gamma_float32

PATHS = [False, True, None]
PATH_IDS = ["loop", "foreach", "flat"]


pytestmark = pytest.mark.usefixtures("one_thread")


# -- models and helpers ---------------------------------------------------------------------


class MLP(nn.Module):
    """No buffers at all: only parameters can tell the plan that storage moved."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 5)
        self.b = nn.Linear(5, 5)
        self.c = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(F.relu(self.b(F.relu(self.a(x)))))


def named_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    return dict((*module.named_parameters(), *module.named_buffers()))


def perturb(module: nn.Module, gen: torch.Generator) -> None:
    """Move every tensor in place, as training would (integer buffers count up)."""
    with torch.no_grad():
        for t in named_tensors(module).values():
            if t.is_floating_point():
                t.add_(torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.dtype) * 0.1)
            else:
                t.add_(1)


def snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in named_tensors(module).items()}


def assert_bit_identical(a: nn.Module, b: nn.Module, what: str) -> None:
    ta, tb = named_tensors(a), named_tensors(b)
    assert ta.keys() == tb.keys()
    for n in ta:
        assert ta[n].dtype == tb[n].dtype, f"{what}: {n} dtype {ta[n].dtype} vs {tb[n].dtype}"
        assert torch.equal(ta[n], tb[n]), f"{what}: {n} differs"


class RefEMA:
    """The semantics of SPEC §1 written out by hand: walks the live model on every call,
    one ``lerp_`` per tensor, shadow dtypes given by ``shadow_dtypes``."""

    def __init__(
        self,
        shadow_dtypes: dict[str, torch.dtype],
        *,
        beta: float,
        update_after_step: int,
        update_every: int,
        no_ema: frozenset[str] | set[str] = frozenset(),
    ) -> None:
        self.dtypes = shadow_dtypes
        self.beta, self.after, self.every, self.no_ema = (
            beta,
            update_after_step,
            update_every,
            no_ema,
        )
        self.step = 0
        self.shadow: dict[str, torch.Tensor] = {}

    def _copy(self, live: dict[str, torch.Tensor]) -> None:
        self.shadow = {n: live[n].detach().to(dt, copy=True) for n, dt in self.dtypes.items()}

    def update(self, model: nn.Module) -> None:
        live = named_tensors(model)
        step = self.step
        self.step += 1
        if step == 0 or (step % self.every == 0 and step <= self.after):
            self._copy(live)
            return
        if step % self.every or self.beta == 1.0:
            return
        decay = inverse_gamma_float32(
            max(step - self.after, 0), beta=self.beta, inv_gamma=1.0, power=2 / 3, min_value=0.0
        )
        reference_ema_step(self.shadow, live, decay, copy_names=self.no_ema)

    def assert_matches(self, ema_model: nn.Module, what: str) -> None:
        ours = named_tensors(ema_model)
        assert self.shadow, "RefEMA never initialised"
        for n, ref in self.shadow.items():
            assert ours[n].dtype == ref.dtype, f"{what}: {n} dtype"
            assert torch.equal(ours[n], ref), f"{what}: {n} differs from the by-hand reference"


# -- the functional kernels ------------------------------------------------------------------

SHAPES = [(), (3,), (4, 5), (2, 3, 4), (1,), (7, 1, 2)]


def make_lists(
    shadow_dtypes: list[torch.dtype], online_dtypes: list[torch.dtype], seed: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    shadows, onlines = [], []
    for i, (sd, od) in enumerate(zip(shadow_dtypes, online_dtypes, strict=True)):
        shape = SHAPES[i % len(SHAPES)]
        shadows.append(torch.randn(shape, generator=gen, dtype=torch.float64).to(sd))
        onlines.append(torch.randn(shape, generator=gen, dtype=torch.float64).to(od))
    return shadows, onlines


F64, F32, BF16 = torch.float64, torch.float32, torch.bfloat16
DTYPE_CASES = {
    "float64": ([F64] * 6, [F64] * 6),
    "float32": ([F32] * 6, [F32] * 6),
    "bfloat16": ([BF16] * 6, [BF16] * 6),
    "mixed": ([F64, F32, BF16, F32, F64, BF16], [F64, F32, BF16, F32, F64, BF16]),
    "f32_shadow_bf16_online": ([F32] * 6, [BF16] * 6),
    "mixed_cast": ([F64, F32, F32, F64, BF16, F32], [F32, BF16, F32, BF16, BF16, F64]),
}


@pytest.mark.parametrize("weight", [0.0, 0.37, 1.0, 1e-4])
@pytest.mark.parametrize("case", list(DTYPE_CASES))
@pytest.mark.parametrize("impl", IMPLS)
def test_ema_lerp_matches_reference_loop(impl, case, weight):
    shadow_dtypes, online_dtypes = DTYPE_CASES[case]
    shadows, onlines = make_lists(shadow_dtypes, online_dtypes, seed=1)
    expected = [s.clone() for s in shadows]
    for s, o in zip(expected, onlines, strict=True):
        s.lerp_(o.to(s.dtype), weight)
    online_before = [o.clone() for o in onlines]
    ema_lerp_(shadows, onlines, weight, impl=impl)
    for i, (s, e) in enumerate(zip(shadows, expected, strict=True)):
        assert s.dtype == e.dtype
        assert torch.equal(s, e), f"tensor {i}"
    for o, b in zip(onlines, online_before, strict=True):
        assert torch.equal(o, b)  # sources are read only
    if weight != 0.0:  # the shadows really moved
        assert any(
            not torch.equal(s, e)
            for s, e in zip(
                shadows, make_lists(shadow_dtypes, online_dtypes, seed=1)[0], strict=True
            )
        )


@pytest.mark.parametrize("case", list(DTYPE_CASES))
@pytest.mark.parametrize("impl", IMPLS)
def test_ema_copy_matches_reference_loop(impl, case):
    dst_dtypes, src_dtypes = DTYPE_CASES[case]
    dsts, srcs = make_lists(dst_dtypes, src_dtypes, seed=2)
    ema_copy_(dsts, srcs, impl=impl)
    for d, s, dt in zip(dsts, srcs, dst_dtypes, strict=True):
        assert d.dtype == dt
        assert torch.equal(d, s.to(dt))


@pytest.mark.parametrize("impl", IMPLS)
def test_ema_lerp_over_coalesced_spans_matches_per_tensor_loop(impl):
    # The "flat" form: one span covering adjacent tensors gives the per-tensor bits.
    gen = torch.Generator().manual_seed(3)
    flat_s = torch.randn(60, generator=gen)
    flat_o = torch.randn(60, generator=gen)
    views_s = [flat_s[:12].view(3, 4), flat_s[12:20], flat_s[20:60].view(2, 4, 5)]
    views_o = [flat_o[:12].view(3, 4), flat_o[12:20], flat_o[20:60].view(2, 4, 5)]
    expected = [s.clone().lerp_(o, 0.123) for s, o in zip(views_s, views_o, strict=True)]
    ema_lerp_([flat_s], [flat_o], 0.123, impl=impl)
    for s, e in zip(views_s, expected, strict=True):
        assert torch.equal(s, e)


@pytest.mark.parametrize("impl", IMPLS)
def test_kernels_reject_unpaired_lists(impl):
    a, b = make_lists([F32, F32], [F32, F32], seed=0)
    with pytest.raises(emakit.EMAValueError, match="pair"):
        ema_lerp_(a, b[:1], 0.5, impl=impl)
    with pytest.raises(emakit.EMAValueError, match="pair"):
        ema_copy_(a[:1], b, impl=impl)


def test_kernels_reject_unknown_impl():
    a, b = make_lists([F32], [F32], seed=0)
    with pytest.raises(emakit.EMAValueError, match="impl"):
        ema_lerp_(a, b, 0.5, impl="fused")  # type: ignore[arg-type]
    with pytest.raises(emakit.EMAValueError, match="impl"):
        ema_copy_(a, b, impl="fused")  # type: ignore[arg-type]


# -- EMA paths against the loop --------------------------------------------------------------


def setup_bf16(net: nn.Module) -> nn.Module:
    return net.bfloat16()


def setup_mixed(net: nn.Module) -> nn.Module:
    net.lin.double()  # one submodule in float64 inside a float32 model
    net.bn2.double()
    return net


MODEL_SETUPS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "float64": lambda net: net.double(),
    "float32": lambda net: net,
    "bfloat16": setup_bf16,
    "mixed": setup_mixed,
}

NAMES = {
    "param_or_buffer_names_no_ema": {"bn.running_var", "head.weight", "lin.bias"},
    "ignore_names": {"conv.bias", "bn2.running_mean"},
    "ignore_startswith_names": {"norm."},
}

# (id, model setup, EMA keywords, ema_model dtype for coerce_dtype or None)
EMA_CASES: list[tuple[str, str, dict[str, Any], torch.dtype | None]] = [
    ("float64", "float64", {}, None),
    ("float32", "float32", {}, None),
    ("bfloat16", "bfloat16", {}, None),
    ("mixed", "mixed", {}, None),
    ("ema_dtype_f32_on_bf16", "bfloat16", {"ema_dtype": torch.float32}, None),
    ("ema_dtype_f64_on_mixed", "mixed", {"ema_dtype": torch.float64}, None),
    ("coerce_f64_ema_of_f32", "float32", {"coerce_dtype": True}, torch.float64),
    ("coerce_f32_ema_of_mixed", "mixed", {"coerce_dtype": True}, torch.float32),
    ("names_float32", "float32", NAMES, None),
    ("names_mixed", "mixed", NAMES, None),
    ("names_ema_dtype_bf16", "bfloat16", {**NAMES, "ema_dtype": torch.float32}, None),
]


def build_ema(model: nn.Module, kw: dict[str, Any], coerce_to: torch.dtype | None, use_foreach):
    kw = {"beta": 0.9, "update_after_step": 3, "update_every": 2, **kw}
    if coerce_to is not None:
        kw["ema_model"] = copy.deepcopy(model).to(coerce_to)
    return EMA(model, use_foreach=use_foreach, **kw)


def tracked_dtypes(ema: EMA, kw: dict[str, Any]) -> dict[str, torch.dtype]:
    ign, pre = kw.get("ignore_names", ()), kw.get("ignore_startswith_names", ())
    return {
        n: t.dtype
        for n, t in named_tensors(ema.ema_model).items()
        if n not in ign and not any(n.startswith(p) for p in pre)
    }


@pytest.mark.parametrize("flatten", [False, True], ids=["unflattened", "flattened"])
@pytest.mark.parametrize(
    ("setup", "kw", "coerce_to"), [c[1:] for c in EMA_CASES], ids=[c[0] for c in EMA_CASES]
)
def test_every_path_matches_the_loop(setup, kw, coerce_to, flatten):
    model = MODEL_SETUPS[setup](make_net())
    if flatten:
        flatten_parameters(model)
    emas = {uf: build_ema(model, kw, coerce_to, uf) for uf in PATHS}
    loop = emas[False]
    ref = RefEMA(
        tracked_dtypes(loop, kw),
        beta=0.9,
        update_after_step=3,
        update_every=2,
        no_ema=kw.get("param_or_buffer_names_no_ema", frozenset()),
    )
    ignored_before = {
        n: t.clone() for n, t in named_tensors(loop.ema_model).items() if n not in ref.dtypes
    }
    gen = torch.Generator().manual_seed(7)
    for call in range(16):
        perturb(model, gen)
        for ema in emas.values():
            ema.update()
        ref.update(model)
        ref.assert_matches(loop.ema_model, f"loop after call {call + 1}")
        for uf in (True, None):
            assert_bit_identical(
                emas[uf].ema_model, loop.ema_model, f"use_foreach={uf} after call {call + 1}"
            )
    assert loop.get_current_decay() > 0
    for n, t in ignored_before.items():
        assert torch.equal(named_tensors(loop.ema_model)[n], t), f"ignored {n} was touched"
    assert emas[None].tracker.plan().impl == "flat"
    assert emas[True].tracker.plan().impl == "foreach" and loop.tracker.plan().impl == "loop"


@pytest.mark.parametrize("beta", [0.0, 0.5])
@pytest.mark.parametrize("flatten", [False, True], ids=["unflattened", "flattened"])
@pytest.mark.parametrize("setup", ["float32", "mixed", "bfloat16"])
def test_every_path_matches_the_loop_pulling_the_model(setup, flatten, beta):
    # update_model_with_ema / copy_params_from_ema_to_model write into the online model:
    # each path gets its own copy of it.
    base = MODEL_SETUPS[setup](make_net())
    models = {uf: copy.deepcopy(base) for uf in PATHS}
    emas = {}
    for uf, m in models.items():
        if flatten:
            flatten_parameters(m)
        emas[uf] = EMA(
            m,
            beta=0.8,
            update_after_step=2,
            update_every=1,
            update_model_with_ema_every=3,
            update_model_with_ema_beta=beta,
            param_or_buffer_names_no_ema={"head.bias"},
            ignore_names={"conv.bias"},
            use_foreach=uf,
        )
    for call in range(12):
        for uf in PATHS:
            perturb(models[uf], torch.Generator().manual_seed(call))
            emas[uf].update()
        for uf in (True, None):
            assert_bit_identical(models[uf], models[False], f"online, {uf=}, call {call + 1}")
            assert_bit_identical(emas[uf].ema_model, emas[False].ema_model, f"ema, {uf=}")
    for uf in PATHS:
        emas[uf].update_model_with_ema(0.25)
    for uf in (True, None):
        assert_bit_identical(models[uf], models[False], "after update_model_with_ema(0.25)")
    for uf in PATHS:
        perturb(models[uf], torch.Generator().manual_seed(99))
        emas[uf].copy_params_from_ema_to_model()
    for uf in (True, None):
        assert_bit_identical(models[uf], models[False], "after copy_params_from_ema_to_model")
    # The pulls really wrote into the online model.
    assert torch.equal(models[None].lin.weight, emas[None].ema_model.lin.weight)


# -- plan size -------------------------------------------------------------------------------


def num_kernels_after_update(model: nn.Module, **kw: Any) -> dict[Any, int]:
    out = {}
    for uf in PATHS:
        ema = EMA(model, beta=0.9, update_after_step=0, update_every=1, use_foreach=uf, **kw)
        ema.update()
        ema.update()  # one averaging update
        plan = ema.tracker.plan()
        assert isinstance(plan, Plan)
        out[uf] = plan.num_kernels
    return out


def test_flattened_model_updates_as_one_float_span_plus_integer_copies():
    model = make_net()
    flatten_parameters(model)
    tensors = named_tensors(model)
    n = num_kernels_after_update(model)
    # One lerp span for all float tensors, one copy span for the adjacent integer
    # num_batches_tracked buffers.
    assert n[None] == 1 + 1
    assert n[False] == n[True] == len(tensors)


def test_flattened_mixed_model_updates_as_one_span_per_group():
    model = setup_mixed(make_net())
    flatten_parameters(model)
    n = num_kernels_after_update(model)
    assert n[None] == 2 + 1  # float32 span, float64 span, int64 copy span


def test_flattened_mlp_updates_as_one_span():
    torch.manual_seed(0)
    model = MLP()
    flatten_parameters(model)
    assert num_kernels_after_update(model)[None] == 1
    # ema_dtype: the shadow is float32, the online bf16; still one staged span.
    model16 = MLP().bfloat16()
    flatten_parameters(model16)
    assert num_kernels_after_update(model16, ema_dtype=torch.float32)[None] == 1


def test_unflattened_model_updates_one_kernel_per_tensor():
    model = make_net()
    n = num_kernels_after_update(model)
    assert n[None] == n[True] == n[False] == len(named_tensors(model))


# -- flatten_parameters ----------------------------------------------------------------------


def test_flatten_parameters_keeps_identity_values_and_layout():
    model = make_net()
    model.conv.to(memory_format=torch.channels_last)
    assert model.conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert not model.conv.weight.is_contiguous()
    params_before = list(model.parameters())
    buffers_before = dict(model.named_buffers())
    values = snapshot(model)
    x = torch.randn(2, 3, 5, 5)
    model.eval()
    out_before = model(x)

    flats = flatten_parameters(model)

    assert all(a is b for a, b in zip(model.parameters(), params_before, strict=True))
    assert all(buffers_before[n] is b for n, b in model.named_buffers())
    for n, t in named_tensors(model).items():
        assert torch.equal(t, values[n]), n
        assert t.dtype == values[n].dtype
    assert model.conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert {f.dtype for f in flats} == {torch.float32, torch.int64}
    f32 = next(f for f in flats if f.dtype == torch.float32)
    floats = [t for t in named_tensors(model).values() if t.is_floating_point()]
    # each tensor starts on a 64-element boundary; the padding between them is zero
    assert f32.numel() == aligned_offsets([t.numel() for t in floats])[-1] + floats[-1].numel()
    assert all(t.data_ptr() % 64 == 0 for t in floats)
    covered = torch.zeros(f32.numel(), dtype=torch.bool)
    for t in floats:
        covered[t.storage_offset() : t.storage_offset() + t.numel()] = True
    assert not f32[~covered].any()
    lo, hi = f32.data_ptr(), f32.data_ptr() + f32.numel() * f32.element_size()
    for n, t in named_tensors(model).items():
        if t.is_floating_point():
            assert lo <= t.data_ptr() < hi, f"{n} is not inside the flat buffer"
    assert torch.equal(model(x), out_before)
    # Writing through the flat buffer writes the parameters (they are views of it).
    with torch.no_grad():
        f32.zero_()
    assert not model.head.weight.any()


def adamw(params, foreach: bool) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=foreach)


def sgd(params, foreach: bool) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3, foreach=foreach)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for s in steps:
        gen = torch.Generator().manual_seed(500 + s)
        x, y = torch.randn(8, 3, 5, 5, generator=gen), torch.randn(8, 3, generator=gen)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()


@pytest.mark.parametrize("when", ["before", "before_after_steps", "after"])
@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
@pytest.mark.parametrize("make_opt", [sgd, adamw], ids=["SGD", "AdamW"])
def test_optimizers_train_a_flattened_model_like_an_unflattened_one(make_opt, foreach, when):
    flat_model, plain_model = make_net(), make_net()
    plain_opt = make_opt(plain_model.parameters(), foreach)
    if when == "after":
        flatten_parameters(flat_model)
        flat_opt = make_opt(flat_model.parameters(), foreach)
    else:
        flat_opt = make_opt(flat_model.parameters(), foreach)
        if when == "before_after_steps":  # optimizer state already exists when flattening
            train(flat_model, flat_opt, range(2))
            train(plain_model, plain_opt, range(2))
        flatten_parameters(flat_model)
    start = snapshot(plain_model)
    train(flat_model, flat_opt, range(2, 6))
    train(plain_model, plain_opt, range(2, 6))
    assert_bit_identical(flat_model, plain_model, f"{make_opt.__name__}, {foreach=}, {when}")
    assert not torch.equal(plain_model.head.weight, start["head.weight"])
    # The optimizer really stepped the parameters that live in the flat buffer.
    flats = flatten_parameters(flat_model)  # idempotent re-homing; values unchanged
    assert_bit_identical(flat_model, plain_model, "after re-flattening")
    assert len(flats) == 2


def test_ema_of_a_flattened_model_trains_and_updates_with_one_span_per_group():
    model, plain = make_net(), make_net()
    flatten_parameters(model)
    ema = EMA(model, beta=0.9, update_after_step=2, update_every=1)
    ema_plain = EMA(plain, beta=0.9, update_after_step=2, update_every=1, use_foreach=False)
    opt, opt_plain = sgd(model.parameters(), True), sgd(plain.parameters(), True)
    for s in range(8):
        train(model, opt, range(s, s + 1))
        train(plain, opt_plain, range(s, s + 1))
        ema.update()
        ema_plain.update()
        assert_bit_identical(ema.ema_model, ema_plain.ema_model, f"call {s + 1}")
    assert ema.get_current_decay() > 0
    assert ema.tracker.plan().num_kernels == 2  # one float span, one integer span


# -- the plan follows storage moves ----------------------------------------------------------


def run_with_reference(
    model: nn.Module, ema: EMA, ref: RefEMA, calls: int, gen: torch.Generator, what: str
) -> None:
    for call in range(calls):
        perturb(model, gen)
        ema.update()
        ref.update(model)
        ref.assert_matches(ema.ema_model, f"{what}, call {call + 1}")


@pytest.mark.parametrize("use_foreach", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("flatten", [False, True], ids=["unflattened", "flattened"])
@pytest.mark.parametrize("kind", ["net", "mlp"])
def test_plan_follows_model_to_float64(kind, flatten, use_foreach):
    torch.manual_seed(0)
    model = Net() if kind == "net" else MLP()
    if flatten:
        flatten_parameters(model)
    ema = EMA(
        model,
        beta=0.9,
        update_after_step=2,
        update_every=1,
        coerce_dtype=True,
        use_foreach=use_foreach,
    )
    ref = RefEMA(tracked_dtypes(ema, {}), beta=0.9, update_after_step=2, update_every=1)
    gen = torch.Generator().manual_seed(1)
    run_with_reference(model, ema, ref, 5, gen, "float32 model")
    model.to(torch.float64)  # every storage moves; Parameters keep their identity
    assert all(p.dtype == torch.float64 for p in model.parameters())
    run_with_reference(model, ema, ref, 5, gen, "after model.to(float64)")


@pytest.mark.parametrize("use_foreach", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("flatten", [False, True], ids=["unflattened", "flattened"])
def test_plan_follows_model_and_ema_to_float64(flatten, use_foreach):
    model = make_net()
    if flatten:
        flatten_parameters(model)
    ema = EMA(model, beta=0.9, update_after_step=2, update_every=1, use_foreach=use_foreach)
    ref = RefEMA(tracked_dtypes(ema, {}), beta=0.9, update_after_step=2, update_every=1)
    gen = torch.Generator().manual_seed(1)
    run_with_reference(model, ema, ref, 5, gen, "float32")
    model.double()
    ema.double()
    ref.shadow = {n: t.double() if t.is_floating_point() else t for n, t in ref.shadow.items()}
    ref.dtypes = {n: t.dtype for n, t in ref.shadow.items()}
    run_with_reference(model, ema, ref, 5, gen, "after model.double(); ema.double()")


@pytest.mark.parametrize("use_foreach", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("flatten", [False, True], ids=["unflattened", "flattened"])
def test_plan_follows_replaced_buffer_objects(flatten, use_foreach):
    model = make_net()
    if flatten:
        flatten_parameters(model)
    ema = EMA(model, beta=0.9, update_after_step=2, update_every=1, use_foreach=use_foreach)
    ref = RefEMA(tracked_dtypes(ema, {}), beta=0.9, update_after_step=2, update_every=1)
    gen = torch.Generator().manual_seed(1)
    run_with_reference(model, ema, ref, 5, gen, "before")
    old = model.bn.running_mean
    model.bn.running_mean = torch.full((4,), 3.0)  # a new object under the same name
    model.bn2.num_batches_tracked = torch.tensor(1000)
    assert model.bn.running_mean is not old
    run_with_reference(model, ema, ref, 5, gen, "after replacing buffers")
    # And BatchNorm writing into the new buffer in place is seen as well.
    model.train()
    model(torch.randn(4, 3, 5, 5))
    ema.update()
    ref.update(model)
    ref.assert_matches(ema.ema_model, "after a forward pass")
    assert int(ema.ema_model.bn2.num_batches_tracked) == int(model.bn2.num_batches_tracked) > 1000


@pytest.mark.parametrize("use_foreach", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("flatten", [False, True], ids=["unflattened", "flattened"])
def test_plan_follows_parameter_data_swaps(flatten, use_foreach):
    # The plan docstring promises that ``.data`` swaps of a Parameter are seen, including
    # for a parameter in the middle of a flattened run.
    torch.manual_seed(0)
    model = MLP()
    if flatten:
        flatten_parameters(model)
    ema = EMA(model, beta=0.9, update_after_step=1, update_every=1, use_foreach=use_foreach)
    ref = RefEMA(tracked_dtypes(ema, {}), beta=0.9, update_after_step=1, update_every=1)
    gen = torch.Generator().manual_seed(1)
    run_with_reference(model, ema, ref, 4, gen, "before")
    model.b.weight.data = torch.randn(5, 5, generator=gen)
    run_with_reference(model, ema, ref, 4, gen, "after model.b.weight.data = ...")


# -- no host sync and no walk in update() ----------------------------------------------------


def test_meta_tensors_cannot_be_read_back():
    # The premise of the meta-device test below.
    with pytest.raises((RuntimeError, NotImplementedError)):
        torch.ones(2, device="meta").sum().item()
    with pytest.raises((RuntimeError, NotImplementedError)):
        bool(torch.ones((), device="meta"))


@pytest.mark.parametrize("use_foreach", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("variant", ["float32", "flattened", "bf16_ema_dtype", "names"])
def test_update_on_meta_device_reads_nothing_back(variant, use_foreach):
    with torch.device("meta"):
        model = make_net()
    kw: dict[str, Any] = {}
    if variant == "flattened":
        flatten_parameters(model)
    elif variant == "bf16_ema_dtype":
        model.bfloat16()
        kw["ema_dtype"] = torch.float32
    elif variant == "names":
        kw.update(NAMES)
    ema = EMA(
        model,
        beta=0.9,
        update_after_step=5,
        update_every=2,
        use_foreach=use_foreach,
        update_model_with_ema_every=4,
        update_model_with_ema_beta=0.5,
        **kw,
    )
    for _ in range(30):  # init, warm-up copies, skipped calls, averaging, model pulls
        ema.update()
    assert int(ema.step) == 30
    assert ema.get_current_decay() > 0
    assert all(t.device.type == "meta" for t in named_tensors(ema.ema_model).values())
    ema.copy_params_from_model_to_ema()
    ema.copy_params_from_ema_to_model()


def _raise(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("called inside EMA.update()")


@pytest.mark.parametrize("use_foreach", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("flatten", [False, True], ids=["unflattened", "flattened"])
def test_update_does_not_walk_the_model_or_branch_on_tensors(flatten, use_foreach, monkeypatch):
    model = make_net()
    if flatten:
        flatten_parameters(model)
    kw = {
        "beta": 0.9,
        "update_after_step": 4,
        "update_every": 2,
        "param_or_buffer_names_no_ema": {"head.weight"},
    }
    ema = EMA(model, use_foreach=use_foreach, update_model_with_ema_every=6, **kw)
    ref = RefEMA(
        tracked_dtypes(ema, {}),
        beta=0.9,
        update_after_step=4,
        update_every=2,
        no_ema={"head.weight"},
    )
    gen = torch.Generator().manual_seed(3)
    perturb(model, gen)
    ema.update()  # the first update builds the plan
    ref.update(model)
    tensors = list(named_tensors(model).values())

    def perturb_listed() -> None:
        with torch.no_grad():
            for t in tensors:
                if t.is_floating_point():
                    t.add_(torch.randn(t.shape, generator=gen).to(t.dtype) * 0.1)
                else:
                    t.add_(1)

    averaged = 0
    for call in range(1, 20):
        perturb_listed()
        pulled_before = snapshot(model) if call % 6 == 0 else None
        with monkeypatch.context() as mp:
            mp.setattr(torch.nn.Module, "named_parameters", _raise)
            mp.setattr(torch.nn.Module, "named_buffers", _raise)
            mp.setattr(torch.nn.Module, "parameters", _raise)
            mp.setattr(torch.Tensor, "__bool__", _raise)
            with pytest.raises(AssertionError):  # the patches are live
                model.parameters()
            ema.update()
        if pulled_before is None:
            ref.update(model)
        else:
            # This call also pulled the model toward the EMA; re-derive the reference
            # from the values the model had before the pull.
            pulled_model = copy.deepcopy(model)
            with torch.no_grad():
                for n, t in named_tensors(pulled_model).items():
                    t.copy_(pulled_before[n])
            ref.update(pulled_model)
        ref.assert_matches(ema.ema_model, f"call {call + 1}")
        if call % 2 == 0 and call > 4:
            averaged += 1
    assert averaged >= 5 and ema.get_current_decay() > 0


@pytest.mark.parametrize("use_foreach", PATHS, ids=PATH_IDS)
def test_skipped_call_does_nothing_observable(use_foreach, monkeypatch):
    model = make_net()
    ema = EMA(model, beta=0.5, update_after_step=0, update_every=4, use_foreach=use_foreach)
    ema.update()
    gen = torch.Generator().manual_seed(5)
    perturb(model, gen)
    shadow_before, online_before = snapshot(ema.ema_model), snapshot(model)
    plan_before = ema.tracker.plan()
    with monkeypatch.context() as mp:
        for cls, name in (
            (Tracker, "plan"),
            (Tracker, "apply"),
            (Plan, "run"),
            (Plan, "freshness"),
            (Plan, "copy_to_shadow"),
            (Plan, "lerp_online"),
            (Plan, "copy_to_online"),
            (torch.nn.Module, "named_parameters"),
            (torch.nn.Module, "named_buffers"),
            (torch.Tensor, "__bool__"),
        ):
            mp.setattr(cls, name, _raise)
        for _ in range(3):  # calls with pre-increment steps 1, 2, 3 are skipped
            ema.update()
    assert int(ema.step) == 4
    assert ema.tracker.plan() is plan_before
    assert_bit_identical_dicts(snapshot(ema.ema_model), shadow_before)
    assert_bit_identical_dicts(snapshot(model), online_before)
    ema.update()  # pre-increment step 4 averages
    assert not torch.equal(ema.ema_model.head.weight, shadow_before["head.weight"])


def assert_bit_identical_dicts(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n], b[n]), n


# -- issue 19: one function per path, the guard and the staging around it --------------------


def _laid_out_pairs(online_dtype: torch.dtype, seed: int) -> list:
    """Pairs over two flat buffers (online, shadow), so the flat path finds spans: four
    averaged tensors in two decay groups, and one integer tensor that is copied."""
    from emakit._engine.pairs import TensorPair

    g = torch.Generator().manual_seed(seed)
    shapes = [(3, 4), (5,), (2, 2, 2), (1,)]
    total = sum(torch.Size(s).numel() for s in shapes)
    online = torch.randn(total, generator=g).to(online_dtype)
    shadow = torch.randn(total, generator=g)
    pairs, at = [], 0
    for i, shape in enumerate(shapes):
        n = torch.Size(shape).numel()
        o, s = online[at : at + n].view(shape), shadow[at : at + n].view(shape)
        pairs.append(TensorPair(f"t{i}", s, o, average=True, group=int(i == 3)))
        at += n
    ints = torch.randint(0, 9, (4,), generator=g), torch.randint(0, 9, (4,), generator=g)
    pairs.append(TensorPair("count", ints[0], ints[1], average=False))
    return pairs


@pytest.mark.parametrize("guarded", [False, True], ids=["plain", "guarded"])
@pytest.mark.parametrize("online_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("impl", "staged"), [("foreach", False), ("flat", False), ("flat", True)])
@pytest.mark.parametrize("kind", ["lerp", "copy"])
def test_each_path_equals_the_loop_bit_for_bit(kind, impl, staged, online_dtype, guarded):
    """The path a plan picks (foreach, flat over spans, flat through staging buffers, the
    staged halves a background runner calls), plain or through the non-finite guard's
    wrapper with the flag true, gives the reference loop's bits."""
    from emakit.decay import Action

    ref_pairs = _laid_out_pairs(online_dtype, 0)
    pairs = _laid_out_pairs(online_dtype, 0)
    reference = Plan(ref_pairs, "loop")
    plan = Plan(pairs, impl, staged=staged)
    assert reference.path.name == "loop"
    assert plan.path.name == "foreach"  # flat: foreach over spans
    if impl == "flat" and online_dtype == torch.float32 and not staged:
        assert plan.num_kernels < len(pairs)  # spans, not tensors
    weights = (0.3, 0.7)
    reference.run(Action(kind, weights if kind == "lerp" else (), 2))  # type: ignore[arg-type]
    action = Action(
        kind,  # type: ignore[arg-type]
        weights if kind == "lerp" else (),
        2,
        guard=torch.tensor(True) if guarded else None,
    )
    if staged:
        plan.stage()
        plan.finish(action)
    else:
        plan.run(action)
    for a, b in zip(ref_pairs, pairs, strict=True):
        assert a.shadow.dtype == b.shadow.dtype
        assert torch.equal(a.shadow.view(torch.uint8), b.shadow.view(torch.uint8)), a.name


@pytest.mark.parametrize(("impl", "staged"), [("loop", False), ("flat", False), ("flat", True)])
def test_the_guarded_path_leaves_every_bit_when_the_flag_is_false(impl, staged):
    from emakit.decay import Action

    pairs = _laid_out_pairs(torch.float32, 1)
    before = [p.shadow.clone() for p in pairs]
    plan = Plan(pairs, impl, staged=staged)
    action = Action("lerp", (0.3, 0.7), 2, guard=torch.tensor(False))
    plan.run(action)
    for p, b in zip(pairs, before, strict=True):
        assert torch.equal(p.shadow, b), p.name


def test_a_shadow_on_another_device_needs_allow_different_devices():
    """The device check pairs every tensor by device (a meta ``ema_model`` is on another
    device than a CPU model, which no other test here has)."""
    net = nn.Linear(3, 2)
    meta = nn.Linear(3, 2, device="meta")
    with pytest.raises(emakit.EMAStateError, match=r"'weight' is on meta.*allow_different_devices"):
        EMA(net, ema_model=meta)
    ema = EMA(net, ema_model=nn.Linear(3, 2, device="meta"), allow_different_devices=True)
    assert ema.ema_model.weight.device.type == "meta"


def test_thread_runner_submit_waits_for_the_pending_finish():
    """Deterministic: the first finish blocks on an event that only the second submit's
    wait() sets; a submit that no longer waits stages while the first is still running."""
    import threading
    from types import SimpleNamespace

    from emakit._engine.runners import ThreadRunner

    release, finished, staged_after = threading.Event(), [], []

    class Work:
        on_accelerator = False

        def stage(self, non_blocking: bool, guard: object) -> None:
            staged_after.append(len(finished))

        def finish(self, action: object) -> None:
            release.wait(timeout=60)
            finished.append(action)

    runner = ThreadRunner()
    real_wait, waits = runner.wait, []

    def wait() -> None:
        waits.append(1)
        if len(waits) == 2:  # the second submit: now let the first finish
            release.set()
        real_wait()

    runner.wait = wait  # type: ignore[method-assign]
    try:
        action = SimpleNamespace(guard=None)
        runner.submit(Work(), action)
        runner.submit(Work(), action)
    finally:
        release.set()
        runner.close()
    assert staged_after == [0, 1]  # the second snapshot only after the first finish

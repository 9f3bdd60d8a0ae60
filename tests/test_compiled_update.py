"""``compile_update=True``: the opt-in fused cast-and-lerp, compiled by torch.compile on CPU.

Bit-identical to the eager update and to ema-pytorch's ``coerce_dtype=True`` (the compiled
function is torch's lerp formula, contracted into the same fused multiply-add), through
the warm-up's weights of 1 and above 0.5, for bf16, fp16 and fp32 models and bf16 and
fp64 shadows. Also: one compile per EMA (no recompile for a new decay value, none shared
between EMAs), the eager path kept for what it cannot fuse, and the combinations it
refuses at construction.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from _launch import DIST_MARKS, FSDP2_MARK, run_ranks
from emakit import EMA, MultiEMA
from emakit._engine.compiled import refusal
from emakit.errors import EMAValueError

# one compile of a small model takes seconds on a CPU; inductor needs a C++ compiler there
pytestmark = pytest.mark.slow
#: The tests that compile: emakit refuses compile_update on older torch (by design).
COMPILES = pytest.mark.skipif(refusal() is not None, reason=str(refusal()))


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 4))
    model.register_buffer("seen", torch.zeros((), dtype=torch.long))
    return model.to(torch.bfloat16)


def _step(model: nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen).to(p.dtype) * 0.05)
        if hasattr(model, "seen"):
            model.seen += 1


def _pair(model: nn.Module, **kw: object) -> tuple[EMA, EMA]:
    kw = {"beta": 0.99, "update_after_step": 0, "update_every": 1, "ema_dtype": torch.float32, **kw}
    return EMA(model, compile_update=True, **kw), EMA(model, **kw)


def _assert_equal(compiled: EMA, eager: EMA) -> None:
    a, b = compiled.ema_model.state_dict(), eager.ema_model.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name


@pytest.fixture(scope="module")
def trained() -> tuple[EMA, EMA, dict[str, torch.Tensor]]:
    """40 updates with the default warm-up (a new decay each time) and no recompile, beside
    the eager update and a float64 reference of the same bf16 weights."""
    model = _model()
    compiled, eager = _pair(model, beta=0.999, power=2 / 3)  # a decay that changes per step
    gen = torch.Generator().manual_seed(1)
    ref = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    decays = set()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(40):
            _step(model, gen)
            compiled.update()
            eager.update()
            decay = compiled.get_current_decay()
            decays.add(decay)
            for n, p in model.named_parameters():
                ref[n].lerp_(p.detach().double(), 1.0 - decay)
    assert len(decays) > 30  # the weight really changed from call to call
    return compiled, eager, ref


@COMPILES
def test_compiled_update_is_bit_identical_to_the_eager_one(trained):
    compiled, eager, ref = trained
    assert compiled.get_current_decay() == eager.get_current_decay()
    _assert_equal(compiled, eager)  # the warm-up's first weights are 1 and above 0.5
    assert compiled.ema_model[0].weight.dtype == torch.float32
    assert int(compiled.ema_model.seen) == 40  # the integer buffer: copied, eagerly
    ours = dict(compiled.ema_model.named_parameters())
    for name, r in ref.items():  # a real average (not a copy of the model)
        assert ((ours[name].double() - r).norm() / r.norm()).item() < 1e-5, name


class _Awkward(nn.Module):
    """Layouts the compiled function meets: channels-last, transposed, odd-sized, empty."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.conv = nn.Conv2d(5, 6, 3).to(memory_format=torch.channels_last)
        self.transposed = nn.Parameter(torch.randn(7, 61).t())
        self.odd = nn.Parameter(torch.randn(1001))
        self.empty = nn.Parameter(torch.randn(0))
        self.register_buffer("running", torch.randn(11))  # averaged like a weight


@COMPILES
@pytest.mark.parametrize(
    ("model_dtype", "ema_dtype"),
    [
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float32),
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float64),
    ],
    ids=["bf16-fp32", "fp16-fp32", "fp32-fp32", "bf16-bf16", "fp32-fp64"],
)
def test_compiled_update_is_bit_identical_to_ema_pytorch(model_dtype, ema_dtype):
    ema_pytorch = pytest.importorskip("ema_pytorch")
    import copy

    model = _Awkward().to(model_dtype)
    settings = {"beta": 0.99, "update_after_step": 0, "update_every": 1}
    ours = EMA(model, ema_dtype=ema_dtype, compile_update=True, **settings)
    theirs = ema_pytorch.EMA(
        model,
        ema_model=copy.deepcopy(model).to(ema_dtype),
        coerce_dtype=True,
        include_online_model=False,
        **settings,
    )
    gen = torch.Generator().manual_seed(6)
    for step in range(12):  # lerp weights 1 (a copy), 0.63, then below 0.5
        with torch.no_grad():
            for t in (*model.parameters(), *model.buffers()):
                t.add_(torch.randn(t.shape, generator=gen).to(t.dtype) * 0.1)
        ours.update()
        theirs.update()
        a, b = ours.ema_model.state_dict(), theirs.ema_model.state_dict()
        for name in a:
            assert a[name].dtype == b[name].dtype == ema_dtype, name
            assert torch.equal(a[name], b[name]), f"step {step}: {name}"
    assert any(
        g.lerp.fused is not None and g.lerp.fused.compiled for g in ours.tracker.plan().groups
    )


@COMPILES
def test_compiled_plan_fuses_the_averaged_pairs(trained):
    compiled, _eager, _ref = trained
    plan = compiled.tracker.plan()
    fused = [g.lerp.fused for g in plan.groups if g.lerp.fused is not None]
    assert len(fused) == 1 and fused[0].compiled
    assert len(fused[0].dsts) == 6  # every averaged parameter, in one compiled call
    assert plan.num_kernels == 2  # the fused call and the integer buffer's copy
    assert all(not g.lerp.rounds for g in plan.groups)  # no cast buffer


@COMPILES
def test_each_ema_compiles_its_own_function():
    # torch keeps compiled versions per code object; two EMAs must not share one, or the
    # second would be a recompile of the first (and past cache_size_limit, silently eager)
    model = _model()
    other = nn.Linear(8, 3).to(torch.bfloat16)
    a, a_eager = _pair(model)
    b, b_eager = _pair(other, beta=0.9)
    gen = torch.Generator().manual_seed(4)
    with torch._dynamo.config.patch(error_on_recompile=True, cache_size_limit=1):
        for _ in range(3):
            _step(model, gen)
            _step(other, gen)
            for ema in (a, a_eager, b, b_eager):
                ema.update()
    _assert_equal(a, a_eager)
    _assert_equal(b, b_eager)


@COMPILES
def test_compiled_update_reads_a_repointed_weight_and_a_new_dtype():
    model = _model()
    compiled, eager = _pair(model)
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        _step(model, gen)
        compiled.update()
        eager.update()
    layer = model[0]
    layer.weight.data = layer.weight.data.clone() + 1  # a new storage under the Parameter
    compiled.update()
    eager.update()
    _assert_equal(compiled, eager)
    model.float()  # every weight changes dtype: the plans rebuild (a new compile)
    for _ in range(2):
        _step(model, gen)
        compiled.update()
        eager.update()
    _assert_equal(compiled, eager)
    assert next(g for g in compiled.tracker.plan().groups if g.lerp.dst).lerp.fused.compiled


@COMPILES
def test_compiled_update_of_a_pytree_and_of_a_same_dtype_model():
    torch.manual_seed(3)
    tree = {"w": torch.randn(5, 7, dtype=torch.float16), "b": [torch.randn(3)]}
    kw = {"beta": 0.9, "update_after_step": 0, "update_every": 1}
    compiled = EMA(tree, compile_update=True, ema_dtype=torch.float32, **kw)
    eager = EMA(tree, ema_dtype=torch.float32, **kw)
    for _ in range(4):
        tree["w"].add_(0.1)
        tree["b"][0].mul_(1.1)
        compiled.update()
        eager.update()
    ours, theirs = compiled.ema_pytree, eager.ema_pytree
    for x, y in ((ours["w"], theirs["w"]), (ours["b"][0], theirs["b"][0])):
        assert x.dtype == y.dtype == torch.float32
        assert torch.equal(x, y)


@pytest.mark.parametrize(
    ("keyword", "value"),
    [
        ("use_foreach", True),
        ("use_foreach", False),
        ("skip_nonfinite", True),
        ("device", "cpu"),
        ("async_update", True),
        ("stream", True),
        ("partition", True),
    ],
)
def test_compile_update_refuses_what_it_cannot_fuse(keyword, value):
    with pytest.raises(
        EMAValueError, match=f"compile_update=True cannot be combined with {keyword}="
    ):
        EMA(nn.Linear(2, 2), compile_update=True, **{keyword: value})


def test_compile_update_must_be_a_bool_and_multi_ema_refuses_it():
    with pytest.raises(Exception, match="compile_update"):
        EMA(nn.Linear(2, 2), compile_update="yes")
    with pytest.raises(EMAValueError, match="MultiEMA does not take compile_update=True"):
        MultiEMA(nn.Linear(2, 2), compile_update=True)


def _fsdp2_ranks(rank: int, out: object) -> dict[str, object]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from emakit._dist.dtensor import local_tensor

    # a forked rank compiles in its own process: no pool of compile workers per rank
    torch._inductor.config.compile_threads = 1
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 5))
    model.to(torch.bfloat16)
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    compiled, eager = _pair(model)
    gen = torch.Generator().manual_seed(7 + rank)  # the same steps on both ranks' shards
    for _ in range(4):
        with torch.no_grad():
            for p in model.parameters():
                local = local_tensor(p)
                local.add_(torch.randn(local.shape, generator=gen).to(local.dtype) * 0.05)
        compiled.update()
        eager.update()
    a, b = compiled.ema_model.state_dict(), eager.ema_model.state_dict()
    return {
        "fused": [g.lerp.fused is not None for g in compiled.tracker.plan().groups],
        "diff": max((local_tensor(a[k]) - local_tensor(b[k])).abs().max().item() for k in a),
        "moved": max(
            (local_tensor(a[k]) - local_tensor(p).float()).abs().max().item()
            for k, p in model.state_dict().items()
        ),
        "dtypes": {str(local_tensor(v).dtype) for v in a.values()},
    }


@FSDP2_MARK
@COMPILES
def test_compiled_update_of_an_fsdp2_model_updates_each_rank_shards(tmp_path):
    for result in run_ranks(_fsdp2_ranks, tmp_path, world=2, timeout_s=240):
        assert result["fused"] and all(result["fused"])
        assert result["dtypes"] == {"torch.float32"}
        assert result["diff"] == 0  # bit for bit the eager update, shard by shard
        assert result["moved"] > 0  # a real average: the shadow lags the shards


for _mark in DIST_MARKS:  # gloo and fork, as every test that launches ranks
    test_compiled_update_of_an_fsdp2_model_updates_each_rank_shards = _mark(
        test_compiled_update_of_an_fsdp2_model_updates_each_rank_shards
    )


def test_compile_update_is_refused_where_torch_would_change_the_process(monkeypatch):
    # torch 2.4's Inductor turns on flush-to-zero for the whole process when it loads a
    # CPU kernel (seen: denormals became zero for every later computation)
    from emakit._engine import compiled

    monkeypatch.setattr(compiled, "torch_version", lambda: (2, 4))
    with pytest.raises(EMAValueError, match=r"compile_update=True needs torch >= 2\.9"):
        EMA(nn.Linear(2, 2), compile_update=True)


@COMPILES
def test_compiling_leaves_denormals_alone(trained):
    # no flush-to-zero left behind in the process by the compiled kernel (torch 2.4 did)
    import struct

    smallest = struct.unpack("d", struct.pack("q", 1))[0]
    assert smallest * 1.0 > 0.0
    assert torch.tensor(1e-40) * 1.0 > 0


@COMPILES
def test_an_inductor_without_the_fma_option_is_named(monkeypatch):
    from emakit._engine import compiled
    from emakit.errors import EMARuntimeError

    monkeypatch.setattr(compiled, "FMA_OPTIONS", {"cpp.no_such_option": "fast"})
    ema = EMA(_model(), compile_update=True, update_after_step=0, update_every=1)
    with pytest.raises(EMARuntimeError, match=r"compile_update=True needs Inductor's options"):
        ema.update()  # the first update builds the plan, and the compiled function with it
    assert int(ema.step) == 0  # the failed call did not count

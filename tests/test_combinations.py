"""The combination matrix: every EMA kind x runner x feature, bit for bit.

Each cell builds one EMA kind with one runner and one feature on a small BatchNorm MLP,
and its *reference*: the same kind and feature with ``use_foreach=False`` on the
synchronous runner, tracking an identical (unflattened) deep copy of the model that is
trained identically. After every ``update()`` the two are read through the runner-agnostic
readers (``state_dict()``, which waits for background work) and must agree exactly,
tensor by tensor and dtype by dtype, counters included.

A combination that does not mean anything must be refused when the EMA is built, so
every cell of the matrix is either compared or proven refused (:data:`MATRIX`).
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

import emakit
from _models import bn_mlp
from emakit import EMA, EMAPytree, EMATypeError, EMAValueError, KarrasEMA, MultiEMA, PostHocEMA
from emakit._engine.fused import FusedPlan
from emakit._engine.plan import Plan
from emakit.schedules import constant

KINDS = ("ema", "pytree", "multi", "karras", "posthoc")
RUNNERS: dict[str, dict[str, Any]] = {
    "sync": {},
    "async": {"async_update": True},
    "offload": {"device": "cpu"},  # implies async_update=True; same device on a CPU model
    "stream": {"stream": True},  # CUDA only
}
FEATURES = ("plain", "decay_groups", "schedule", "skip_nonfinite", "ema_dtype", "flatten")

CALLS = 12  # update() calls per cell
NAN_CALLS = (5, 6, 7)  # skip_nonfinite: "0.weight" holds a NaN during these calls
CHECKPOINT_EVERY = 4  # PostHocEMA: snapshots at calls 4, 8, 12 (none while NaN)

# How a refused combination fails at construction: (exception type, message fragment).
# KarrasEMA and EMAPytree have no such keyword in their signature: Python's plain TypeError
# (not an EMAError). PostHocEMA checks its **kwargs itself: EMATypeError.
UNKNOWN_KEYWORD = (TypeError, "unexpected keyword argument")
POSTHOC_UNKNOWN = (EMATypeError, "PostHocEMA got unknown keyword arguments")
NEEDS_CUDA = (EMAValueError, "stream=True needs a model on a CUDA device")

REFUSED_FEATURES = {
    ("pytree", "decay_groups"): UNKNOWN_KEYWORD,
    ("multi", "decay_groups"): (EMAValueError, "MultiEMA does not take decay_groups="),
    ("karras", "decay_groups"): UNKNOWN_KEYWORD,
    ("karras", "schedule"): UNKNOWN_KEYWORD,
    ("posthoc", "decay_groups"): POSTHOC_UNKNOWN,
    ("posthoc", "schedule"): POSTHOC_UNKNOWN,
}
REFUSED_RUNNERS = {
    ("pytree", "stream"): UNKNOWN_KEYWORD,
    ("karras", "stream"): UNKNOWN_KEYWORD,
    ("posthoc", "stream"): POSTHOC_UNKNOWN,
}


def _cell(kind: str, runner: str, feature: str) -> Any:
    cell_id = f"{kind}-{runner}-{feature}"
    refusal = REFUSED_FEATURES.get((kind, feature)) or REFUSED_RUNNERS.get((kind, runner))
    if refusal is not None:
        return "refused", pytest.param(kind, runner, feature, refusal, id=cell_id)
    if runner == "stream":
        no_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="stream needs CUDA")
        return "compared", pytest.param(kind, runner, feature, id=cell_id, marks=no_cuda)
    return "compared", pytest.param(kind, runner, feature, id=cell_id)


#: Every cell: ("compared" | "refused", its pytest.param).
MATRIX = [_cell(k, r, f) for k in KINDS for r in RUNNERS for f in FEATURES]
COMPARED = [p for status, p in MATRIX if status == "compared"]
REFUSED = [p for status, p in MATRIX if status == "refused"]
#: The stream cells compared on CUDA are refused on a CPU model.
STREAM_ON_CPU = [
    pytest.param(p.values[0], p.values[2], id=p.id) for p in COMPARED if p.values[1] == "stream"
]


# -- building a cell -------------------------------------------------------------------------


def make_model() -> nn.Sequential:
    return bn_mlp(4, 8, 3, relu=True, seed=0)  # "0.*" Linear, "1.*" BatchNorm, "3.*" Linear


def feature_kwargs(kind: str, feature: str) -> dict[str, Any]:
    if feature == "decay_groups":
        return {"decay_groups": {"0.*": 0.9, "3.*": constant(0.5)}}
    if feature == "schedule":
        if kind == "multi":
            return {"schedules": (constant(0.8), constant(0.6))}
        return {"schedule": constant(0.8)}
    if feature == "skip_nonfinite":
        return {"skip_nonfinite": True}
    if feature == "ema_dtype":
        return {"ema_dtype": torch.float64}
    return {}  # "plain", and "flatten" (which flattens the cell's model instead)


def build(kind: str, model: nn.Module, folder: Path, **kw: Any) -> Any:
    """One EMA of ``kind`` for ``model``: warm-up copies at calls 1 and 3, then averaging
    at every other call (KarrasEMA: no warm-up, averaging from call 3)."""
    timing = {"update_after_step": 2, "update_every": 2}
    if kind == "ema":
        return EMA(model, beta=0.9, **timing, **kw)
    if kind == "pytree":
        tree = {"params": dict(model.named_parameters()), "buffers": list(model.buffers())}
        return EMAPytree(tree, beta=0.9, **timing, **kw)
    if kind == "multi":
        return MultiEMA(model, betas=(0.9, 0.99), **timing, **kw)
    if kind == "karras":
        return KarrasEMA(model, sigma_rel=0.1, update_every=2, **kw)
    assert kind == "posthoc"
    return PostHocEMA(
        model,
        sigma_rels=(0.05, 0.2),
        update_every=2,
        checkpoint_every_num_steps=CHECKPOINT_EVERY,
        checkpoint_folder=folder,
        checkpoint_dtype=None,  # keep every bit in the snapshots
        **kw,
    )


def members(obj: Any) -> list[Any]:
    """The single EMAs inside ``obj`` (itself for EMA, EMAPytree and KarrasEMA)."""
    if isinstance(obj, MultiEMA):
        return list(obj)
    if isinstance(obj, PostHocEMA):
        return obj.profiles
    return [obj]


def comparable(obj: Any) -> dict[str, torch.Tensor]:
    """Every tensor of the EMA state (weights and counters), read through ``state_dict()``,
    which waits for a background update first."""
    return {k: v.detach().cpu() for k, v in obj.state_dict().items()}


def assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], where: str):
    assert actual.keys() == expected.keys(), where
    for name, e in expected.items():
        a = actual[name]
        assert a.dtype == e.dtype, f"{where}: {name} is {a.dtype}, reference {e.dtype}"
        assert torch.equal(a, e), f"{where}: {name} differs from the reference"


# -- training ---------------------------------------------------------------------------------


@contextlib.contextmanager
def nan_in(model: nn.Module) -> Iterator[None]:
    """``0.weight[0, 0]`` is NaN inside the block (after the optimizer step, so training
    itself never sees it)."""
    p = model.get_parameter("0.weight")
    with torch.no_grad():
        saved = p[0, 0].clone()
        p[0, 0] = float("nan")
    try:
        yield
    finally:
        with torch.no_grad():
            p[0, 0] = saved


def train_and_compare(cell, cell_model, ref, ref_model, *, inject_nan: bool, where: str) -> None:
    """Train both models identically; after every update() the EMAs must agree."""
    gen = torch.Generator().manual_seed(1)
    device = next(cell_model.parameters()).device
    pairs = [
        (cell, cell_model, torch.optim.SGD(cell_model.parameters(), lr=0.1, momentum=0.9)),
        (ref, ref_model, torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)),
    ]
    for call in range(1, CALLS + 1):
        x = torch.randn(16, 4, generator=gen).to(device)
        for _, model, opt in pairs:
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        assert_same(
            comparable(cell_model), comparable(ref_model), f"{where}: online models, call {call}"
        )
        for ema, model, _ in pairs:
            poison = nan_in(model) if inject_nan and call in NAN_CALLS else contextlib.nullcontext()
            with poison:
                ema.update()
        assert_same(comparable(cell), comparable(ref), f"{where}: call {call}")


def assert_same_snapshots(cell_folder: Path, ref_folder: Path) -> None:
    names = sorted(p.name for p in cell_folder.glob("*.safetensors"))
    assert names == sorted(p.name for p in ref_folder.glob("*.safetensors"))
    assert len(names) == 2 * (CALLS // CHECKPOINT_EVERY)  # two profiles
    for name in names:
        assert_same(load_file(cell_folder / name), load_file(ref_folder / name), name)
        with safe_open(cell_folder / name, "pt") as a, safe_open(ref_folder / name, "pt") as b:
            meta_a, meta_b = a.metadata(), b.metadata()
            assert meta_a.pop("run") != meta_b.pop("run")  # two runs, each with its id
            assert meta_a == meta_b, name


# -- the matrix -------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::emakit.PostHocWarning")  # few snapshots: rough synthesis
@pytest.mark.parametrize(("kind", "runner", "feature"), COMPARED)
def test_cell_matches_the_reference_loop(kind, runner, feature, tmp_path):
    model = make_model()
    if runner == "stream":
        model.cuda()
    ref_model = copy.deepcopy(model)
    if feature == "flatten":
        emakit.flatten_parameters(model)
    kw = feature_kwargs(kind, feature)
    cell = build(kind, model, tmp_path / "cell", **RUNNERS[runner], **kw)
    ref = build(kind, ref_model, tmp_path / "ref", use_foreach=False, **kw)
    assert all(m.use_foreach is False for m in members(ref))
    assert all(m.async_update is (runner in ("async", "offload")) for m in members(cell))

    skips = feature == "skip_nonfinite"
    warns = pytest.warns(RuntimeWarning, match="skipped an EMA update")
    with warns if skips else contextlib.nullcontext():
        train_and_compare(cell, model, ref, ref_model, inject_nan=skips, where=kind)

    for m in members(cell):
        # calls 5 and 7 average (also KarrasEMA's) and see the NaN; call 6 does no work
        assert m.num_skipped_nonfinite == (2 if skips else 0)
        assert all(t.isfinite().all() for t in comparable(m).values() if t.is_floating_point())
    # the feature took effect (the comparison alone would pass if both sides ignored it)
    if feature == "decay_groups":
        decays = cell.current_decays()  # "0.*" shares the default warm-up, capped at 0.9
        assert decays["0.*"] == decays["default"] < 0.9 and decays["3.*"] == 0.5
    if feature == "schedule":
        assert [m.get_current_decay() for m in members(cell)] == [0.8, 0.6][: len(members(cell))]
    if feature == "ema_dtype":
        assert comparable(members(cell)[0])[_first_weight(kind)].dtype == torch.float64
    if feature == "flatten":
        first, last = model.get_parameter("0.weight"), model.get_parameter("3.bias")
        assert first.untyped_storage().data_ptr() == last.untyped_storage().data_ptr()
    if kind == "posthoc":
        assert_same_snapshots(tmp_path / "cell", tmp_path / "ref")
        synth, synth_ref = (e.synthesize_ema_model(sigma_rel=0.1) for e in (cell, ref))
        assert synth.step == synth_ref.step == CALLS
        assert_same(comparable(synth), comparable(synth_ref), "synthesized")


def _first_weight(kind: str) -> str:
    return "ema.params.0.weight" if kind == "pytree" else "ema_model.0.weight"


@pytest.mark.parametrize(("kind", "runner", "feature", "refusal"), REFUSED)
def test_cell_is_refused_at_construction(kind, runner, feature, refusal, tmp_path):
    error, message = refusal
    with pytest.raises(error, match=message) as info:
        build(kind, make_model(), tmp_path, **RUNNERS[runner], **feature_kwargs(kind, feature))
    assert isinstance(info.value, TypeError | ValueError)
    # an EMAError exactly where the kind checks the keyword itself
    assert isinstance(info.value, emakit.EMAError) == (error is not TypeError)


@pytest.mark.parametrize(("kind", "feature"), STREAM_ON_CPU)
def test_stream_cell_is_refused_on_a_cpu_model(kind, feature, tmp_path):
    error, message = NEEDS_CUDA
    with pytest.raises(error, match=message):
        build(kind, make_model(), tmp_path, stream=True, **feature_kwargs(kind, feature))


@pytest.mark.parametrize(
    ("build_it", "message"),
    [
        pytest.param(
            lambda m: EMA(dict(m.named_parameters()), decay_groups={"0.*": 0.9}),
            "decay_groups applies to an EMA of a module",
            id="EMA(pytree)-decay_groups",
        ),
        pytest.param(
            lambda m: EMA(dict(m.named_parameters()), stream=True),
            "stream=True applies to an EMA of a module",
            id="EMA(pytree)-stream",
        ),
        pytest.param(
            lambda m: MultiEMA(m, schedule=constant(0.8)),
            "MultiEMA does not take schedule=",
            id="MultiEMA-schedule",
        ),
    ],
)
def test_the_same_refusals_through_other_entry_points(build_it, message):
    """``EMA(pytree)`` is EMAPytree without its signature, and MultiEMA's schedules are
    ``schedules=``: the module-only and singular keywords are refused as EMAValueError."""
    with pytest.raises(EMAValueError, match=message):
        build_it(make_model())


@pytest.mark.parametrize("runner", ["sync", "async", "offload"])
def test_posthoc_skip_nonfinite_guards_the_snapshot_catch_up(runner, tmp_path):
    """A checkpoint between averaging calls first averages the current weights in
    (``KarrasEMA.catch_up``); with ``skip_nonfinite=True`` that must skip NaN weights too,
    as every other averaging update does, instead of writing them into the profile and the
    snapshot for good."""
    model = make_model()
    ema = build("posthoc", model, tmp_path, skip_nonfinite=True, **RUNNERS[runner])
    for call in range(1, CHECKPOINT_EVERY + 1):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1)
        # the checkpoint at call 4 (not an averaging call) catches up with a NaN weight
        with nan_in(model) if call == CHECKPOINT_EVERY else contextlib.nullcontext():
            ema.update()
    for i, profile in enumerate(ema.profiles):
        weights = comparable(profile)["ema_model.0.weight"]
        assert bool(weights.isfinite().all()), f"profile {i} averaged in the NaN weight"
    for path in sorted(tmp_path.glob("*.safetensors")):
        assert bool(load_file(path)["0.weight"].isfinite().all()), f"{path.name} holds NaN"


# -- the background runners really run on the worker -----------------------------------------


@pytest.mark.parametrize("runner", ["async", "offload"])
@pytest.mark.parametrize("kind", KINDS)
def test_background_runner_averages_on_the_worker(kind, runner, monkeypatch, tmp_path):
    seen: list[tuple[str, str]] = []
    for cls in (Plan, FusedPlan):
        original = cls.finish

        def finish(self, action, _original=original):
            seen.append((threading.current_thread().name, action.kind))
            return _original(self, action)

        monkeypatch.setattr(cls, "finish", finish)

    model = make_model()
    ema = build(kind, model, tmp_path, **RUNNERS[runner])
    for _ in range(5):  # averaging at call 5 (KarrasEMA: 3 and 5)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1)
        ema.update()
    assert comparable(ema)  # a reader: waits for the worker
    lerps = [name for name, action in seen if action == "lerp"]
    assert lerps, f"no averaging update went through a runner's finish(): {seen}"
    assert all(name.startswith("emakit-ema") for name, _ in seen), seen


# -- members of the set kinds against lone reference EMAs ------------------------------------


@pytest.mark.parametrize("runner", ["sync", "async", "offload"])
@pytest.mark.parametrize("kind", ["multi", "posthoc"])
def test_members_match_lone_reference_emas(kind, runner, tmp_path):
    """MultiEMA's fused pass and PostHocEMA's profiles, against one lone reference loop
    (``use_foreach=False``, sync) per member, so a defect shared by the set kind and its
    own reference cannot hide."""
    model = make_model()
    lone_model = copy.deepcopy(model)
    if kind == "multi":
        obj = MultiEMA(
            model, betas=(0.9, 0.99), update_after_step=2, update_every=2, **RUNNERS[runner]
        )
        lone = [
            EMA(
                lone_model,
                beta=b,
                update_after_step=2,
                update_every=2,
                use_foreach=False,
                include_online_model=False,  # as MultiEMA's members
            )
            for b in (0.9, 0.99)
        ]
    else:
        obj = PostHocEMA(
            model,
            sigma_rels=(0.05, 0.2),
            update_every=2,
            checkpoint_every_num_steps="manual",
            checkpoint_folder=tmp_path,
            **RUNNERS[runner],
        )
        lone = [
            KarrasEMA(lone_model, sigma_rel=s, update_every=2, use_foreach=False)
            for s in (0.05, 0.2)
        ]
    gen = torch.Generator().manual_seed(2)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, lone_model)]
    for call in range(1, CALLS + 1):
        x = torch.randn(16, 4, generator=gen)
        for m, opt in zip((model, lone_model), opts, strict=True):
            m(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        obj.update()
        for e in lone:
            e.update()
        for i, (member, e) in enumerate(zip(members(obj), lone, strict=True)):
            assert_same(comparable(member), comparable(e), f"{kind}[{i}], call {call}")


def test_partition_applies_to_modules_and_is_the_whole_ema_in_one_process(tmp_path: Path) -> None:
    with pytest.raises(EMAValueError, match="partition=True applies to an EMA of a module"):
        EMA({"w": torch.ones(3)}, partition=True)
    with pytest.raises(EMATypeError, match="ema_model= is not supported for a partitioned EMA"):
        EMA(nn.Linear(3, 2), ema_model=nn.Linear(3, 2), partition=True)
    with pytest.raises(EMATypeError, match="ema_model= is not supported for a partitioned EMA"):
        PostHocEMA(
            nn.Linear(3, 2), ema_model=nn.Linear(3, 2), partition=True, checkpoint_folder=tmp_path
        )
    with pytest.raises(EMAValueError, match=r"inside ema.swap\(\) instead"):
        EMA(nn.Linear(3, 2), partition=True, forward_method_names=("forward",))
    torch.manual_seed(0)
    net = nn.Linear(3, 2)
    kw: dict[str, Any] = dict(beta=0.9, update_after_step=0, update_every=1)
    parted, ref = EMA(net, partition=True, **kw), EMA(net, **kw)
    for _ in range(3):
        with torch.no_grad():
            net.weight.add_(1.0)
        parted.update()
        ref.update()
    # one process: each "partition" is the whole (flattened) tensor, equal to the plain EMA
    model = parted.ema_model
    for name, v in ref.ema_model.state_dict().items():
        assert torch.equal(model.full(name, None), v), name
    with torch.no_grad():
        assert torch.equal(parted(torch.ones(1, 3)), ref(torch.ones(1, 3)))

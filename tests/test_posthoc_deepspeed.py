"""Post-hoc EMA of a DeepSpeed ZeRO-3 model (issue 23): every rank snapshots its partitions
(flat ranges of the flattened parameters, the padding left out), synthesis on the ranks,
in one process, from another number of ranks and by a sweep, all compared with a
single-process-style ``PostHocEMA`` fed the full weights every step; ``partition=True``
(the same layout for a replicated model); a rank's file missing; the refusals.

One launch of 2 ranks runs every check (a DeepSpeed engine takes seconds to build on the
CPU, see ``tests/test_deepspeed.py``, whose shm-op fixture this module shares). The model's
``inp.weight`` (35 elements) leaves rank 1's partition padded and ``scale`` (1 element)
leaves it empty. The tests at the end need no launch (one process, ``partition=True``).
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import safetensors
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from torch import nn

from _deepspeed import DEEPSPEED_MARKS, start_rank
from _launch import run_ranks
from _models import seeded
from emakit import EMAStateError, EMATypeError, PostHocEMA
from emakit._files.atomic import TEMP_PREFIX
from emakit.inspection import inspect_cmd
from emakit.posthoc import PostHocWarning, list_snapshots, sweep, synthesize_state_dict
from emakit.posthoc.commands import synthesize
from emakit.posthoc.snapshots.shards import Block, align, flat_range, parse_layout

WORLD = 2
STEPS = 6
SIGMAS = (0.05, 0.28)
TARGET = 0.15
RUN = "zero3run"
#: float32 snapshots: the partitioned and the full-weight runs agree to float32 rounding.
KW: dict[str, Any] = dict(sigma_rels=SIGMAS, update_every=1, checkpoint_dtype=torch.float32)
TOL = dict(rtol=1e-5, atol=1e-6)


class Net(nn.Module):
    """``inp.weight`` has 35 elements (rank 1's partition padded), ``scale`` one (rank 1's
    partition empty); ``count`` is a buffer (copied, stored by rank 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 7)
        self.out = nn.Linear(7, 3)
        self.scale = nn.Parameter(torch.ones(1))
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count += 1
        return self.out(torch.tanh(self.inp(x))) * self.scale


def config() -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 10},
        "optimizer": {"type": "Adam", "params": {"lr": 0.05, "torch_adam": True}},
        "zero_allow_untested_optimizer": True,
    }


def full_state(engine: Any) -> dict[str, torch.Tensor]:
    """The engine's module with its parameters gathered, and its buffers."""
    import deepspeed

    module = engine.module
    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        out = {n: p.data.clone() for n, p in module.named_parameters()}
    out.update((n, b.clone()) for n, b in module.named_buffers())
    return out


def full_ema(synth: Any) -> dict[str, torch.Tensor]:
    """A partitioned EMA's model in full (a collective)."""
    model = synth.ema_model
    return {n: model.full(n, None).clone() for n in model.layout()}


X = torch.randn(3, 5, generator=torch.Generator().manual_seed(3))


def score(model: nn.Module) -> float:
    return float(model(X).pow(2).sum())


def zero3_job(rank: int, out: Path, deepspeed: Any) -> dict[str, Any]:
    engine, *_ = deepspeed.initialize(model=seeded(Net, 0), config=config())
    twin = seeded(Net, 0)
    every = dict(checkpoint_every_num_steps=2, **KW)
    ema = PostHocEMA(engine, checkpoint_folder=out / "zero3", run_id=RUN, **every)
    ref = PostHocEMA(twin, checkpoint_folder=out / "ref", **every)
    parted = PostHocEMA(twin, checkpoint_folder=out / "parted", partition=True, **every)
    g = torch.Generator().manual_seed(10 + rank)
    for _ in range(STEPS):
        x, y = torch.randn(2, 5, generator=g), torch.randn(2, 3, generator=g)
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
        twin.load_state_dict(full_state(engine))
        for e in (ema, ref, parted):
            e.update()
    r: dict[str, Any] = {"files": sorted(p.name for p in (out / "zero3").glob("*.safetensors"))}
    r["local_numel"] = sum(p.numel() for p in ema.profiles[0].ema_model.parameters())
    r["profiles"] = [full_ema(p) for p in ema.profiles]
    synth = ema.synthesize_ema_model(sigma_rel=TARGET)
    r["on_ranks"], r["synth_step"] = full_ema(synth), int(synth.step)
    online = full_state(engine)
    r["call_out"] = synth(X)
    with torch.no_grad(), synth.swap():
        r["swap_out"] = engine.module(X)
    r["restored"] = all(torch.equal(v, online[n]) for n, v in full_state(engine).items())
    # another number of ranks: the full-weight run's whole-model files (world 1) cut into
    # this rank's partitions
    from_whole = PostHocEMA(engine, checkpoint_folder=out / "ref", **KW)
    r["from_whole"] = full_ema(from_whole.synthesize_ema_model(sigma_rel=TARGET))
    r["parted_on_ranks"] = full_ema(parted.synthesize_ema_model(sigma_rel=TARGET))
    # the sweep on the ranks (evaluate runs the engine's module on the partitions)
    r["sweep"] = list(ema.sweep(score, sigma_rels=[0.1, 0.2], lengths_per_pass=1))
    r["per_length"] = [
        (s, float(ema.synthesize_ema_model(sigma_rel=s)(X).pow(2).sum())) for s in (0.1, 0.2)
    ]
    if rank == 0:
        r["ref"] = ref.synthesize_ema_model(sigma_rel=TARGET).ema_model.state_dict()
        r["ref_early"] = ref.synthesize_ema_model(sigma_rel=TARGET, step=STEPS - 2).ema_model
        r["ref_early"] = r["ref_early"].state_dict()
        r["ref_profiles"] = [p.ema_model.state_dict() for p in ref.profiles]
        with torch.no_grad():
            r["ref_out"] = ref.synthesize_ema_model(sigma_rel=TARGET).ema_model(X)
    r.update(refusals(engine, rank, out))
    return r


def refusals(engine: Any, rank: int, out: Path) -> dict[str, str]:
    from emakit import KarrasEMA
    from emakit.posthoc.snapshots.writer import check_snapshottable

    r = {}
    try:
        PostHocEMA(engine, ema_model=lambda: Net(), checkpoint_folder=out / "no", **KW)
    except EMATypeError as e:
        r["factory"] = str(e)
    # partitions cut over a subgroup (MiCS): every replica would write them
    groups = [torch.distributed.new_group([0]), torch.distributed.new_group([1])]
    profile = KarrasEMA(engine, sigma_rel=0.1, update_every=1)
    shapes = profile.ema_model.shapes
    for name, (shape, numel, _, size) in list(shapes.items()):
        shapes[name] = (shape, numel, groups[rank], size)
    try:
        check_snapshottable(profile)
    except EMATypeError as e:
        r["subgroup"] = str(e)
    return r


def worker(rank: int, out: Path, shm: bool) -> dict[str, Any]:
    deepspeed = start_rank(rank, WORLD, shm)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PostHocWarning)  # few snapshots: a rough fit
        return zero3_job(rank, out, deepspeed)


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory, shm_op: bool) -> tuple[Path, list[dict]]:
    import deepspeed  # noqa: F401  (once here, not per rank: importing takes seconds)

    out = tmp_path_factory.mktemp("posthoc-zero3")
    return out, run_ranks(lambda rank, o: worker(rank, o, shm_op), out, world=WORLD, timeout_s=300)


def close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        if want[name].is_floating_point():
            torch.testing.assert_close(got[name].float(), want[name].float(), **TOL, msg=name)
        else:
            assert torch.equal(got[name], want[name]), name


def quiet(fn: Any, *args: Any, **kwargs: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PostHocWarning)
        return fn(*args, **kwargs)


class TestZero3:
    pytestmark = DEEPSPEED_MARKS

    def test_every_rank_writes_its_partitions_with_flat_ranges(self, job) -> None:
        out, results = job
        rank_files = {
            r: [f for f in results[0]["files"] if f".rank-{r:05d}-of-00002" in f] for r in (0, 1)
        }
        assert len(rank_files[0]) == len(rank_files[1]) == 3 * 2  # 3 steps x 2 profiles
        layouts = {}
        for r, names in rank_files.items():
            with safetensors.safe_open(str(out / "zero3" / names[-1]), "pt") as f:
                meta, keys = f.metadata(), set(f.keys())
                layouts[r] = (meta, keys, {k: tuple(f.get_slice(k).get_shape()) for k in keys})
        (meta0, keys0, shapes0), (meta1, keys1, shapes1) = layouts[0], layouts[1]
        assert meta0["format_version"] == meta1["format_version"] == "2"
        assert shapes0["inp.weight"] == (18,) and shapes1["inp.weight"] == (17,)  # no padding
        assert "scale" in keys0 and "scale" not in keys1  # rank 1's partition is empty
        assert "count" in keys0 and "count" not in keys1  # a buffer: stored once
        assert '"inp.weight":[[7,5],{"flat":[18,17]}]' in meta1["shard_layout"]
        snaps = list_snapshots(out / "zero3")
        assert [(s.step, s.world) for s in snaps] == [(s, 2) for s in (2, 2, 4, 4, 6, 6)]
        whole = list_snapshots(out / "ref")
        assert abs(snaps[-1].nbytes - whole[-1].nbytes) < 2 * 4096  # one model's bytes per set
        for r in results:
            assert r["local_numel"] <= 67 // WORLD + 3  # its partitions only

    def test_an_emakit_without_flat_ranges_refuses_the_files(self, job, monkeypatch) -> None:
        from emakit.posthoc.snapshots import format as snapshots

        out, _ = job
        monkeypatch.setattr(snapshots, "FLAT_LAYOUT_VERSION", 1)  # what emakit read before
        monkeypatch.setattr(snapshots, "SNAPSHOT_FORMAT_VERSION", 1)  # (nor side files)
        with pytest.raises(EMAStateError, match=r"format_version=2.*upgrade emakit"):
            list_snapshots(out / "zero3")

    def test_profiles_equal_the_full_weight_ones(self, job) -> None:
        _, results = job
        for r in results:
            for got, want in zip(r["profiles"], results[0]["ref_profiles"], strict=True):
                close(got, want)

    def test_synthesis_on_the_ranks_equals_the_full_weight_reference(self, job) -> None:
        _, results = job
        want = results[0]["ref"]
        for r in results:
            assert r["synth_step"] == STEPS
            close(r["on_ranks"], want)
            torch.testing.assert_close(r["call_out"], results[0]["ref_out"], **TOL)
            torch.testing.assert_close(r["swap_out"], results[0]["ref_out"], **TOL)
            assert r["restored"]  # the online partitions came back, bit for bit

    def test_synthesis_in_one_process_reassembles_the_partitions(self, job) -> None:
        out, results = job
        close(quiet(synthesize_state_dict, out / "zero3", sigma_rel=TARGET), results[0]["ref"])
        dest = out / "cli.safetensors"
        ran = CliRunner().invoke(
            synthesize,
            [str(out / "zero3"), "--sigma-rel", str(TARGET), "--out", str(dest), "--no-progress"],
        )
        assert ran.exit_code == 0, ran.output
        net = Net()
        net.load_state_dict(load_file(str(dest)))  # strict: loads into the model class
        close(net.state_dict(), results[0]["ref"])
        shown = CliRunner().invoke(inspect_cmd, [str(out / "zero3")])
        assert shown.exit_code == 0, shown.output
        assert "6 tensors (5 averaged, 1 copied), 67 averaged values" in shown.output

    def test_synthesis_from_another_number_of_ranks(self, job) -> None:
        _, results = job
        want = results[0]["ref"]
        for r in results:
            close(r["from_whole"], want)  # 1 rank's files -> 2 ranks' partitions

    def test_partition_true_writes_the_same_layout(self, job) -> None:
        out, results = job
        want = results[0]["ref"]
        for r in results:
            close(r["parted_on_ranks"], want)
        close(quiet(synthesize_state_dict, out / "parted", sigma_rel=TARGET), results[0]["ref"])

    def test_the_sweep_equals_one_synthesis_per_length(self, job) -> None:
        out, results = job
        for r in results:
            assert [s for s, _ in r["sweep"]] == [0.1, 0.2]
            for (_, got), (_, want) in zip(r["sweep"], r["per_length"], strict=True):
                assert got == pytest.approx(want, rel=1e-6)

        def evaluate(state: dict[str, torch.Tensor]) -> float:
            net = Net()
            net.load_state_dict(state)
            with torch.no_grad():
                return score(net)

        folder = quiet(sweep, out / "zero3", evaluate, sigma_rels=[0.1, 0.2])
        for (_, got), (_, want) in zip(folder, results[0]["sweep"], strict=True):
            assert got == pytest.approx(want, rel=1e-5)

    def test_a_missing_rank_file_leaves_the_previous_set_usable(self, job, tmp_path) -> None:
        out, results = job
        folder = tmp_path / "copy"
        shutil.copytree(out / "zero3", folder)
        for path in folder.glob(f"step-{STEPS:09d}_*.rank-00001-of-00002.safetensors"):
            path.unlink()  # rank 1 was killed while writing its files of the last step:
            (folder / f".{path.name}{TEMP_PREFIX}k1").write_bytes(b"partial")  # its temp file
        with pytest.warns(PostHocWarning, match="ranks \\[1\\] are missing"):
            snaps = list_snapshots(folder)
        assert max(s.step for s in snaps) == STEPS - 2
        close(quiet(synthesize_state_dict, folder, sigma_rel=TARGET), results[0]["ref_early"])

    def test_unsupported_combinations_raise_at_construction(self, job) -> None:
        _, results = job
        for r in results:
            assert "ema_model= is not supported for a partitioned EMA" in r["factory"]
            assert "partitioned over 1 of the 2 ranks" in r["subgroup"]
            assert "MiCS" in r["subgroup"]


# -- one process: the flat ranges' arithmetic, partition=True without a process group ------


def test_flat_ranges_of_blocks() -> None:
    shape = (4, 3)
    assert flat_range(Block((1, 0), (2, 3)), shape) == Block((3,), (6,), True)  # rows
    assert flat_range(Block((2, 1), (1, 2)), shape) == Block((7,), (2,), True)  # part of a row
    assert flat_range(Block((0, 1), (4, 1)), shape) is None  # a column
    assert flat_range(Block((), ()), ()) == Block((0,), (1,), True)  # a scalar
    region, stored = align(Block((1, 0), (2, 3)), Block((5,), (4,), True), shape, "w")
    assert (region, stored) == (Block((3,), (6,), True), Block((5,), (4,), True))
    with pytest.raises(Exception, match="cannot combine"):
        align(Block((0, 1), (4, 1)), Block((5,), (4,), True), shape, "w")


def test_a_flat_range_outside_its_tensor_is_refused() -> None:
    meta = {"shard_layout": '{"w": [[4, 3], {"flat": [10, 4]}]}'}
    with pytest.raises(Exception, match="flat range \\[10, 14\\) of its 12 elements"):
        parse_layout(Path("x.safetensors"), meta, {"w": (4,)})
    ok = parse_layout(
        Path("x.safetensors"), {"shard_layout": '{"w": [[4, 3], {"flat": [8, 4]}]}'}, {"w": (4,)}
    )
    assert ok == {"w": ((4, 3), Block((8,), (4,), True))}


def test_partition_true_in_one_process_equals_the_plain_posthoc_ema(tmp_path: Path) -> None:
    net = seeded(Net, 1)
    kw = dict(checkpoint_every_num_steps=2, **KW)
    parted = PostHocEMA(net, checkpoint_folder=tmp_path / "parted", partition=True, **kw)
    plain = PostHocEMA(net, checkpoint_folder=tmp_path / "plain", **kw)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(6):
        net(torch.randn(2, 5)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        parted.update()
        plain.update()
    got = quiet(parted.synthesize_ema_model, sigma_rel=TARGET)
    want = quiet(plain.synthesize_ema_model, sigma_rel=TARGET).ema_model.state_dict()
    close(full_ema(got), want)
    close(quiet(synthesize_state_dict, tmp_path / "parted", sigma_rel=TARGET), want)

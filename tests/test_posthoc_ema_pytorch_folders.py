"""ema-pytorch's post-hoc folders, both ways, against the real ema-pytorch 0.8.3.

* Reading: emakit synthesizes from the ``<index>.<step>.pt`` folders ema-pytorch's
  ``PostHocEMA`` writes, in every configuration (its defaults, any ``update_every`` and
  ``checkpoint_every_num_steps``, ``sigma_rels`` or ``gammas``), from the weights each file
  really holds. The ground truth is computed here from the recorded trajectory with the
  closed-form per-step weights of the power-function EMA (arXiv:2312.02696 §3),
  ``w_s = (s/T)^(gamma+1) - ((s-1)/T)^(gamma+1)``, never through emakit.
* Writing: `to_ema_pytorch()` / ``emakit convert --to ema-pytorch`` write emakit's
  snapshots as files ema-pytorch's own ``synthesize_ema_model`` reads.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from torch import nn

from emakit import EMAStateError, EMAValueError, EMAWriteError
from emakit.posthoc import (
    LegacyProfiles,
    PostHocEMA,
    PostHocWarning,
    plan_synthesis,
    solve_weights,
    synthesize,
    to_ema_pytorch,
)
from emakit.posthoc.convert import convert_cmd
from emakit.posthoc.snapshots.folder import list_snapshots
from emakit.posthoc.snapshots.format import read_snapshot_info, write_snapshot

ema_pytorch = pytest.importorskip("ema_pytorch")


pytestmark = pytest.mark.usefixtures("one_thread")


# -- a trajectory and its exact power-function EMA -------------------------------------------


def trajectory(steps: int, seed: int = 0) -> torch.Tensor:
    """theta(t), t = 1..steps, rows of 64: an offset, drift, slow oscillations and a random
    walk (the weights move by about their own size over training)."""
    g = torch.Generator().manual_seed(seed)
    c, a, b = (torch.randn(64, generator=g, dtype=torch.float64) for _ in range(3))
    freq = 0.25 + 0.75 * torch.rand(64, generator=g, dtype=torch.float64)
    phase = 2 * math.pi * torch.rand(64, generator=g, dtype=torch.float64)
    x = torch.arange(1, steps + 1, dtype=torch.float64)[:, None] / steps
    walk = torch.randn(steps, 64, generator=g, dtype=torch.float64).cumsum(0) / steps**0.5
    return 3 * c + a * torch.sin(2 * math.pi * freq * x + phase) + b * x * x + walk


def gamma_of(sigma_rel: float) -> float:
    """gamma from sigma_rel by bisection on the paper's definition (independent of emakit)."""
    lo, hi = 0.0, 1e6
    for _ in range(200):
        mid = (lo + hi) / 2
        sr = math.sqrt((mid + 1) / ((mid + 2) ** 2 * (mid + 3)))
        lo, hi = (mid, hi) if sr > sigma_rel else (lo, mid)
    return (lo + hi) / 2


def exact_ema(theta: torch.Tensor, gamma: float, upto: int) -> torch.Tensor:
    """The per-step power-function EMA at ``upto`` from its closed-form weights."""
    s = torch.arange(0, upto + 1, dtype=torch.float64) / upto
    w = s[1:] ** (gamma + 1) - s[:-1] ** (gamma + 1)
    return w @ theta[:upto]


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double().flatten() - ref).norm() / ref.norm())


def drive(ema: object, net: nn.Module, theta: torch.Tensor, steps: range) -> None:
    for t in steps:
        with torch.no_grad():
            net.weight.copy_(theta[t].view(net.weight.shape))
        ema.update()  # type: ignore[attr-defined]


def their_run(folder: Path, theta: torch.Tensor, steps: int, **kwargs: object) -> object:
    """ema-pytorch's PostHocEMA over steps 1..steps, writing to ``folder``."""
    torch.manual_seed(0)
    net = nn.Linear(8, 8, bias=False)
    theirs = ema_pytorch.PostHocEMA(net, checkpoint_folder=str(folder), **kwargs)
    drive(theirs, net, theta, range(steps))
    return theirs


def ours_on(folder: Path, **kwargs: object) -> PostHocEMA:
    """emakit's PostHocEMA built as the ema-pytorch run was, on its folder."""
    kwargs = {k: v for k, v in kwargs.items() if k != "checkpoint_dtype"}
    return PostHocEMA(nn.Linear(8, 8, bias=False), checkpoint_folder=folder, **kwargs)  # type: ignore[arg-type]


# -- 1. every configuration ema-pytorch writes, at least as close as its own synthesis -------

CONFIGS = {
    # name: (steps, ema-pytorch PostHocEMA keywords)
    "defaults": (2000, {"sigma_rels": (0.05, 0.28)}),
    "update_every=1": (
        200,
        {"sigma_rels": (0.05, 0.28), "update_every": 1, "checkpoint_every_num_steps": 10},
    ),
    "update_every=1 fp32": (
        200,
        {
            "sigma_rels": (0.05, 0.28),
            "update_every": 1,
            "checkpoint_every_num_steps": 10,
            "checkpoint_dtype": torch.float32,
        },
    ),
    "update_every=10": (
        2000,
        {"sigma_rels": (0.05, 0.28), "update_every": 10, "checkpoint_every_num_steps": 100},
    ),
    "update_every=100, every 200": (
        2000,
        {"sigma_rels": (0.05, 0.28), "update_every": 100, "checkpoint_every_num_steps": 200},
    ),
    "update_every=7 > every 5": (
        300,
        {"sigma_rels": (0.05, 0.15), "update_every": 7, "checkpoint_every_num_steps": 5},
    ),
    "gammas, update_every=3": (
        400,
        {"gammas": (5.0, 15.0), "update_every": 3, "checkpoint_every_num_steps": 20},
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_synthesis_from_their_folder_is_at_least_as_close_as_theirs(name: str, tmp_path: Path):
    """For each configuration, synthesizing three lengths at the last step: emakit's result is
    at least as close to the exact EMA as ema-pytorch's ``synthesize_ema_model`` (in fact
    much closer wherever ema-pytorch's profiles differ from their gammas), and, where the
    fit is good, far closer than the raw weights."""
    steps, kwargs = CONFIGS[name]
    theta = trajectory(steps)
    theirs = their_run(tmp_path, theta, steps, **kwargs)
    ours = ours_on(tmp_path, **kwargs)
    for sigma_rel in (0.1, 0.15, 0.2):
        truth = exact_ema(theta, gamma_of(sigma_rel), steps)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PostHocWarning)
            plan = plan_synthesis(tmp_path, sigma_rel=sigma_rel, legacy=ours.legacy_profiles())
            mine = ours.synthesize_ema_model(sigma_rel=sigma_rel).ema_model.weight
        their = theirs.synthesize_ema_model(sigma_rel=sigma_rel).ema_model.weight
        err, their_err = rel_err(mine, truth), rel_err(their, truth)
        assert err <= their_err, (name, sigma_rel, err, their_err)
        if plan.solution.residual < 0.1:
            assert err < 0.2 * rel_err(theta[steps - 1], truth), (name, sigma_rel, err)


def test_update_every_1_beats_theirs_by_far(tmp_path: Path):
    """With update_every=1 ema-pytorch's files are the power profiles one step late; taking
    that into account (rather than reading them as profiles ending at their step) makes the
    synthesis at least 10x closer than ema-pytorch's, and closer than its own tracked EMA."""
    steps, kwargs = CONFIGS["update_every=1 fp32"]
    theta = trajectory(steps)
    theirs = their_run(tmp_path, theta, steps, **kwargs)
    ours = ours_on(tmp_path, **kwargs)
    for index, sigma_rel in enumerate((0.05, 0.28)):
        truth = exact_ema(theta, gamma_of(sigma_rel), steps)
        mine = ours.synthesize_ema_model(sigma_rel=sigma_rel).ema_model.weight
        their = theirs.synthesize_ema_model(sigma_rel=sigma_rel).ema_model.weight
        tracked = theirs.ema_models[index].ema_model.weight  # ema-pytorch's own EMA
        assert rel_err(mine, truth) < min(rel_err(their, truth), rel_err(tracked, truth)) / 10


def test_the_profiles_are_what_their_files_really_hold(tmp_path: Path):
    """The solve's model of each file, checked against what ema-pytorch really averages:
    driven with one-hot weights (theta(c) = e_c), each file *is* its weights over the
    trajectory. The residual the solve reports must equal the cumulative distance of the
    combination of those measured weights from the target's, which fails for any error in
    the decays, the update calls, the atom on step 1 or the step each file ends at."""
    steps, k = 160, 7
    torch.manual_seed(0)
    net = nn.Linear(steps, 1, bias=False).double()
    theirs = ema_pytorch.PostHocEMA(
        net,
        sigma_rels=(0.05, 0.2),
        update_every=k,
        checkpoint_every_num_steps=16,
        checkpoint_folder=str(tmp_path),
        checkpoint_dtype=torch.float64,
    )
    drive(theirs, net, torch.eye(steps, dtype=torch.float64), range(steps))
    legacy = LegacyProfiles.from_sigma_rels((0.05, 0.2), update_every=k)
    for target_step, sigma_rel in ((160, 0.1), (144, 0.15), (64, 0.08)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PostHocWarning)
            plan = plan_synthesis(tmp_path, sigma_rel=sigma_rel, step=target_step, legacy=legacy)
        held = torch.stack(
            [
                torch.load(s.path, weights_only=True)["ema_model.weight"][0, :target_step]
                for s in plan.snapshots
            ]
        )
        assert torch.allclose(held.sum(1), torch.ones(len(held), dtype=torch.float64))
        combined = torch.tensor(plan.weights, dtype=torch.float64) @ held
        a = gamma_of(sigma_rel) + 1
        s = torch.arange(1, target_step + 1, dtype=torch.float64)
        target_cdf = (s / target_step) ** a
        off = (combined.cumsum(0) - target_cdf)[:-1]
        expected = float(off.norm() / target_cdf[:-1].norm())
        assert plan.solution.residual == pytest.approx(expected, rel=1e-6, abs=1e-9)
        assert plan.solution.start_weights[-1] == pytest.approx(float(combined[0]), abs=1e-9)


# -- 2. a folder that never averaged --------------------------------------------------------


def test_a_folder_that_never_averaged_is_refused_with_the_reason(tmp_path: Path):
    """ema-pytorch's KarrasEMA defaults to update_every=100: after 40 updates its files hold
    the weights of step 1. The error says so, with the steps and what to do (it used to say
    "weights sum to 2.5e-20")."""
    theta = trajectory(40)
    kwargs = {"sigma_rels": (0.05, 0.1), "checkpoint_every_num_steps": 10}
    their_run(tmp_path, theta, 40, **kwargs)
    ours = ours_on(tmp_path, **kwargs)
    for call in (
        lambda: ours.synthesize_ema_model(sigma_rel=0.08),
        lambda: plan_synthesis(tmp_path, sigma_rel=0.08, legacy=ours.legacy_profiles()),
    ):
        with pytest.raises(EMAValueError) as info:
            call()
        message = str(info.value)
        assert "averaged nothing" in message and "update_every=100" in message
        assert "steps 10..40" in message and "weights of step 1" in message
        assert "step of 101 or later" in message and "update_every=1" in message
        assert "sum to" not in message
    # At step 1 the target is those weights: no refusal for a folder of step-1 files.
    folder = tmp_path / "one"
    their_run(folder, theta, 1, sigma_rels=(0.05, 0.1), checkpoint_every_num_steps=1)
    state = synthesize(folder, sigma_rel=0.08, legacy=LegacyProfiles.from_sigma_rels((0.05, 0.1)))
    assert torch.allclose(state["weight"].double().flatten(), theta[0], atol=1e-2)


# -- 3. the folders users already have: ema-pytorch's defaults -------------------------------


def nominal_synthesis(folder: Path, legacy: LegacyProfiles, sigma_rel: float, step: int):
    """What reading the files as power profiles with their nominal gammas gives (emakit
    before this change): the paper's solve at each file's last update call."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PostHocWarning)
        plan = plan_synthesis(folder, sigma_rel=sigma_rel, legacy=legacy)
        sol = solve_weights(
            [s.t for s in plan.snapshots], [s.gamma for s in plan.snapshots], step, plan.gamma
        )
    tensors = [torch.load(s.path, weights_only=True)["ema_model.weight"] for s in plan.snapshots]
    return sum(w * x.double() for w, x in zip(sol.weights, tensors, strict=True))


def test_defaults_over_2000_steps_beat_the_nominal_model_and_warn_with_numbers(tmp_path: Path):
    """ema-pytorch's defaults (update_every=100, a snapshot every 1000 steps, float16) over
    2000 steps: each file holds 53% to 97% of its weight on the weights of step 1. The
    true profiles give a synthesis closer to the exact EMA than the nominal ones and than
    ema-pytorch's, and the warning says that the target is out of reach, with numbers."""
    steps = 2000
    theta = trajectory(steps)
    theirs = their_run(tmp_path, theta, steps, sigma_rels=(0.05, 0.28))
    ours = ours_on(tmp_path, sigma_rels=(0.05, 0.28))
    truth = exact_ema(theta, gamma_of(0.1), steps)
    with pytest.warns(PostHocWarning) as record:
        mine = ours.synthesize_ema_model(sigma_rel=0.1).ema_model.weight
    text = " ".join(str(w.message) for w in record)
    assert (
        "update_every=100" in text and "53% to 97%" in text and "on the weights of step 1" in text
    )
    assert "times as far from the target's as the raw weights' at step 2000" in text
    nominal = nominal_synthesis(tmp_path, ours.legacy_profiles(), 0.1, steps)
    their = theirs.synthesize_ema_model(sigma_rel=0.1).ema_model.weight
    err = rel_err(mine, truth)
    assert err < rel_err(nominal, truth) / 2 and err < rel_err(their, truth) / 2


def test_more_snapshots_make_their_defaults_usable(tmp_path: Path):
    """update_every=100 with a snapshot every 200 steps: the atom on step 1 is cancelled
    well enough that the synthesis lands at a few % of the raw weights' error, against
    ema-pytorch's several times the raw weights'."""
    steps, kwargs = CONFIGS["update_every=100, every 200"]
    theta = trajectory(steps)
    theirs = their_run(tmp_path, theta, steps, **kwargs)
    ours = ours_on(tmp_path, **kwargs)
    truth = exact_ema(theta, gamma_of(0.1), steps)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PostHocWarning)
        mine = ours.synthesize_ema_model(sigma_rel=0.1).ema_model.weight
    raw = rel_err(theta[steps - 1], truth)
    nominal = nominal_synthesis(tmp_path, ours.legacy_profiles(), 0.1, steps)
    assert rel_err(mine, truth) < 0.3 * raw
    assert (
        rel_err(nominal, truth) > raw
        and rel_err(theirs.synthesize_ema_model(sigma_rel=0.1).ema_model.weight, truth) > raw
    )


# -- 4. emakit's snapshots for ema-pytorch ---------------------------------------------------


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)


def our_folder(
    folder: Path, steps: int = 120, sigma_rels: tuple[float, ...] = (0.05, 0.28), **kwargs: object
) -> tuple[Net, PostHocEMA]:
    theta = trajectory(steps)
    net = Net()
    ours = PostHocEMA(
        net,
        sigma_rels=sigma_rels,
        update_every=1,
        checkpoint_every_num_steps=10,
        checkpoint_folder=folder,
        **kwargs,  # type: ignore[arg-type]
    )
    for t in range(steps):
        with torch.no_grad():
            net.lin.weight.copy_(theta[t].view(8, 8))
            net.bn(torch.randn(16, 8))
        ours.update()
    ours.release_folder()
    return net, ours


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_ema_pytorch_synthesizes_from_a_converted_folder(tmp_path: Path, dtype: torch.dtype):
    """emakit's snapshots, converted, read by the real ema-pytorch: its synthesis equals
    emakit's times the raw weight sum (ema-pytorch does not normalize), to float32
    rounding. Buffers differ by design (ema-pytorch sums them with the weights)."""
    src, out = tmp_path / "ours", tmp_path / "theirs"
    net, ours = our_folder(src, checkpoint_dtype=dtype)
    before = digest(src)
    paths = to_ema_pytorch(src, out)
    assert digest(src) == before  # the source is only read
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in paths)
    assert [p.name for p in paths] == [f"{i}.{s}.pt" for s in range(10, 121, 10) for i in (0, 1)]
    state = torch.load(out / "0.120.pt", weights_only=True)
    assert state["ema_model.lin.weight"].dtype == dtype  # stored as the snapshot stores it
    assert set(state) == {"initted", "step"} | {f"ema_model.{n}" for n in net.state_dict()}
    assert (
        int(state["step"]) == 120 and state["ema_model.bn.num_batches_tracked"].dtype == torch.int64
    )
    theirs = ema_pytorch.PostHocEMA(
        net, sigma_rels=(0.05, 0.28), checkpoint_folder=str(out), update_every=1
    )
    for sigma_rel in (0.05, 0.1, 0.2):
        plan = plan_synthesis(src, sigma_rel=sigma_rel)
        mine = ours.synthesize_ema_model(sigma_rel=sigma_rel).ema_model
        their = theirs.synthesize_ema_model(sigma_rel=sigma_rel).ema_model
        for name in ("lin.weight", "lin.bias"):
            a = dict(mine.named_parameters())[name] * plan.solution.raw_sum
            b = dict(their.named_parameters())[name]
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-5 * float(a.abs().max())), name
    # A tracked length comes back as the file itself, in both.
    their = theirs.synthesize_ema_model(sigma_rel=0.05).ema_model.lin.weight
    assert torch.allclose(
        their, state["ema_model.lin.weight"].float(), atol=1e-3 if dtype == torch.float16 else 1e-6
    )


def test_frozen_weights_and_emakit_reads_the_converted_folder_back(tmp_path: Path):
    """Frozen weights stored once in a side file are joined into every converted file; and
    emakit reads the converted folder back (as ema-pytorch's, update_every=1: its files are
    then taken as one step late, so the synthesis is a little further from the truth than
    from emakit's own folder, but still far closer than the raw weights)."""
    src, out = tmp_path / "ours", tmp_path / "theirs"
    theta = trajectory(120)
    net = Net()
    net.lin.bias.requires_grad_(False)
    ours = PostHocEMA(
        net,
        sigma_rels=(0.05, 0.28),
        update_every=1,
        checkpoint_every_num_steps=10,
        checkpoint_folder=src,
        checkpoint_dtype=torch.float32,
        share_frozen=True,  # (copied by default: no side file then)
    )
    for t in range(120):
        with torch.no_grad():
            net.lin.weight.copy_(theta[t].view(8, 8))
        ours.update()
    ours.release_folder()
    assert any(p.name.startswith("frozen-") for p in src.iterdir())
    to_ema_pytorch(src, out)
    state = torch.load(out / "1.60.pt", weights_only=True)
    assert torch.equal(state["ema_model.lin.bias"], net.lin.bias.detach())
    legacy = LegacyProfiles.from_sigma_rels((0.05, 0.28), update_every=1)
    back = synthesize(out, sigma_rel=0.1, legacy=legacy)["lin.weight"]
    mine = synthesize(src, sigma_rel=0.1)["lin.weight"]
    truth = exact_ema(theta, gamma_of(0.1), 120)
    raw = rel_err(theta[119], truth)
    assert rel_err(mine, truth) < 0.01 * raw and rel_err(back, truth) < 0.05 * raw


def test_convert_refuses_the_source_and_a_non_empty_folder(tmp_path: Path):
    src = tmp_path / "ours"
    our_folder(src, steps=20)
    before = digest(src)
    with pytest.raises(EMAValueError) as info:
        to_ema_pytorch(src, src)
    assert str(info.value) == (
        f"out_folder={str(src)!r} is the snapshot folder itself; converting never writes "
        f"into its source: pass another folder"
    )
    with pytest.raises(EMAValueError, match="never writes into its source"):
        to_ema_pytorch(src, src, force=True)
    (tmp_path / "link").symlink_to(src)
    with pytest.raises(EMAValueError, match="never writes into its source"):
        to_ema_pytorch(src, tmp_path / "link", force=True)
    assert digest(src) == before
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(EMAValueError) as info:
        to_ema_pytorch(src, out)
    assert str(info.value) == (
        f"out_folder={str(out)!r} is not empty, and ema-pytorch reads every *.pt file "
        f"in it; pass an empty or new folder, or force=True (--force) to write into it"
    )
    (out / "7.5.pt").write_bytes(b"old")
    with pytest.warns(PostHocWarning, match=r"1 other \.pt file\(s\) \(7\.5\.pt\)"):
        paths = to_ema_pytorch(src, out, force=True)
    assert (out / "notes.txt").read_text() == "mine" and len(paths) == 4
    with pytest.raises(EMAValueError) as info:
        to_ema_pytorch(tmp_path / "out", tmp_path / "x")
    assert str(info.value).startswith(
        f"no emakit snapshots in {str(tmp_path / 'out')!r} to convert; pass the checkpoint_folder "
    )
    (tmp_path / "file").write_text("x")
    with pytest.raises(EMAValueError, match=r"^out_folder must be a folder"):
        to_ema_pytorch(src, tmp_path / "file")


def test_other_pt_files_in_the_output_folder_are_named_in_a_warning(tmp_path: Path):
    """ema-pytorch reads every ``*.pt`` of its folder: other ones already there are named
    (three at most), at the caller's line, and said to fail to parse when their names are
    not ``<index>.<step>.pt``."""
    src, out = tmp_path / "ours", tmp_path / "out"
    our_folder(src, steps=20)
    out.mkdir()
    for name in ("0.99.pt", "1.5.pt", "7.5.pt"):
        (out / name).write_bytes(b"old")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        to_ema_pytorch(src, out, force=True)
    (found,) = [w for w in caught if issubclass(w.category, PostHocWarning)]
    assert str(found.message) == (
        f"{str(out)!r} also holds 3 other .pt file(s) (0.99.pt, 1.5.pt, 7.5.pt) that "
        f"ema-pytorch's synthesize_ema_model will read as snapshots too"
    )
    if "MUTANT_UNDER_TEST" not in os.environ:  # mutmut's trampolines add stack frames
        assert found.filename == __file__
    (out / "notes.pt").write_bytes(b"mine")
    with pytest.warns(PostHocWarning) as caught:
        to_ema_pytorch(src, out, force=True)
    assert str(caught[0].message) == (
        f"{str(out)!r} also holds 4 other .pt file(s) (0.99.pt, 1.5.pt, 7.5.pt, ...) that "
        f"ema-pytorch's synthesize_ema_model will read as snapshots too (or fail to parse)"
    )


def test_a_failed_conversion_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The files appear all at once: a write failing at the third file (a full disk) leaves
    the output folder without any converted file or temporary file."""
    src, out = tmp_path / "ours", tmp_path / "out"
    our_folder(src, steps=20)
    real_save, calls = torch.save, []

    def failing_save(obj: object, f: object, *args: object, **kwargs: object) -> None:
        calls.append(f)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(EMAWriteError) as info:
        to_ema_pytorch(src, out)
    assert re.match(
        rf"\[Errno 28\] could not write the ema-pytorch snapshots {re.escape(str(out))}/\d\.\d+\.pt, "
        r".* \(No space left on device\); they were left as before the write",
        str(info.value),
    ), str(info.value)
    assert not out.exists() or list(out.iterdir()) == []


def test_convert_picks_one_run_of_a_shared_folder(tmp_path: Path):
    """A folder two runs wrote into is refused, naming the folder and both runs; with
    ``run=`` only that run's snapshots are written, exactly as from a folder of that run
    alone."""
    shared, alone = tmp_path / "shared", tmp_path / "alone"
    _, first = our_folder(shared, steps=20)
    with pytest.warns(PostHocWarning, match="other run"):
        _, second = our_folder(shared, steps=30, sigma_rels=(0.06, 0.25))
    our_folder(alone, steps=30, sigma_rels=(0.06, 0.25))
    with pytest.raises(EMAStateError) as info:
        to_ema_pytorch(shared, tmp_path / "out")
    assert str(info.value).startswith(f"{str(shared)!r} holds the snapshots of 2 runs (")
    assert first.run_id in str(info.value) and second.run_id in str(info.value)
    assert not (tmp_path / "out").exists()
    picked = to_ema_pytorch(shared, tmp_path / "picked", run=second.run_id)
    clean = to_ema_pytorch(alone, tmp_path / "clean")
    assert [p.name for p in picked] == [p.name for p in clean]
    assert {p.name for p in picked} == {f"{i}.{s}.pt" for i in (0, 1) for s in (10, 20, 30)}
    for a, b in zip(picked, clean, strict=True):
        ours, theirs = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), a.name


def rewrite(path: Path, **fields: object) -> None:
    """Rewrite a snapshot's header fields in place, its tensors unchanged."""
    info = read_snapshot_info(path)
    tensors = load_file(path)
    old = {f: getattr(info, f) for f in ("step", "t", "gamma", "sigma_rel", "profile")}
    old |= {"update_every": info.update_every, "copied": info.copied, "run": info.run}
    write_snapshot(path, tensors, **(old | fields))


def test_convert_refuses_what_one_ema_pytorch_name_cannot_carry(tmp_path: Path):
    """ema-pytorch's file name ``<profile>.<step>.pt`` carries one gamma per profile index
    and one number for the step and the profile's length: a profile index with two gammas,
    or a snapshot whose profile ends before its step, is refused with the reason, and
    nothing is written."""
    src, out = tmp_path / "ours", tmp_path / "out"
    our_folder(src, steps=20)
    (step20,) = [s for s in list_snapshots(src) if s.profile == 0 and s.step == 20]
    rewrite(step20.path, gamma=5.0)
    with pytest.raises(EMAStateError) as info:
        to_ema_pytorch(src, out)
    assert str(info.value) == (
        f"{step20.path} cannot be written as ema-pytorch's 0.20.pt: profile index 0 has gamma "
        f"{step20.gamma:.6g} in another snapshot and 5 here; convert one run (run=...)"
    )
    rewrite(step20.path, gamma=step20.gamma, t=15)
    with pytest.raises(EMAStateError) as info:
        to_ema_pytorch(src, out)
    assert str(info.value) == (
        f"{step20.path} cannot be written as ema-pytorch's 0.20.pt: its profile ends at step "
        f"15, not at its step 20, and ema-pytorch's file name carries one number for both"
    )
    assert not out.exists()


def test_convert_a_mixed_folder_copies_their_files(tmp_path: Path):
    """A folder where emakit continued an ema-pytorch run: ema-pytorch's files are copied as
    they are, emakit's converted; a clash of names is refused."""
    theta = trajectory(60)
    src = tmp_path / "mixed"
    kwargs = {"sigma_rels": (0.05, 0.28), "update_every": 1, "checkpoint_every_num_steps": 10}
    theirs = their_run(src, theta, 30, **kwargs)
    net = nn.Linear(8, 8, bias=False)
    ours = PostHocEMA(net, checkpoint_folder=src, **kwargs)  # type: ignore[arg-type]
    ours.load_state_dict(theirs.state_dict())
    drive(ours, net, theta, range(30, 60))
    ours.release_folder()
    out = tmp_path / "out"
    names = {p.name for p in to_ema_pytorch(src, out)}
    assert names == {f"{i}.{s}.pt" for i in (0, 1) for s in range(10, 61, 10)}
    assert (out / "0.20.pt").read_bytes() == (src / "0.20.pt").read_bytes()
    (src / "0.60.pt").write_bytes((src / "0.20.pt").read_bytes())
    with pytest.raises(EMAStateError) as info:
        to_ema_pytorch(src, tmp_path / "out2")
    assert str(info.value) == (
        f"{str(src)!r} holds both emakit's snapshot and ema-pytorch's file 0.60.pt; "
        f"move one of them out of the folder before converting"
    )


def test_cli_convert(tmp_path: Path):
    src, out = tmp_path / "ours", tmp_path / "out"
    our_folder(src, steps=20)
    result = CliRunner().invoke(convert_cmd, ["--to", "ema-pytorch", str(src), str(out)])
    assert result.exit_code == 0, result.output
    assert (
        "wrote 4 ema-pytorch snapshot file(s)" in result.output and "steps 10..20" in result.output
    )
    assert sorted(p.name for p in out.iterdir()) == ["0.10.pt", "0.20.pt", "1.10.pt", "1.20.pt"]
    result = CliRunner().invoke(convert_cmd, ["--to", "ema-pytorch", str(src), str(out)])
    assert (
        result.exit_code == 1
        and "Error: out_folder=" in result.output
        and "--force" in result.output
    )
    result = CliRunner().invoke(convert_cmd, ["--to", "ema-pytorch", "--force", str(src), str(out)])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(convert_cmd, ["--to", "timm", str(src), str(out)])
    assert result.exit_code == 2 and "ema-pytorch" in result.output

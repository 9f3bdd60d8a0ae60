"""Snapshots written by ema-pytorch's ``PostHocEMA`` (``<profile index>.<step>.pt``), read
by emakit's ``PostHocEMA``, ``plan_synthesis`` and the CLI, against the real ema-pytorch.

The model is driven along a known smooth trajectory theta(t) (one Linear's weights), so
the power-function EMA the synthesis should reconstruct is computed directly here by the
paper's per-step recursion (arXiv:2312.02696 §3), never through emakit's own math.
"""

from __future__ import annotations

import inspect
import math
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from torch import nn

from _models import power_ema, rel_err
from emakit import EMAStateError, EMAValueError
from emakit.inspection import inspect_cmd
from emakit.posthoc import (
    LegacyProfiles,
    PostHocEMA,
    PostHocWarning,
    list_legacy_files,
    list_snapshots,
    plan_synthesis,
    sigma_rel_to_gamma,
)
from emakit.posthoc.commands import synthesize

ema_pytorch = pytest.importorskip("ema_pytorch")

T = 200  # training steps of the ema-pytorch run
EVERY = 10  # snapshot interval
SIGMA_RELS = (0.05, 0.28)


pytestmark = pytest.mark.usefixtures("one_thread")


# -- a smooth trajectory and its float64 ground truth ---------------------------------------


def trajectory(steps: int, seed: int = 0) -> torch.Tensor:
    """theta(t) for t = 1..steps as rows of 64 values: drift plus slow oscillations."""
    g = torch.Generator().manual_seed(seed)
    c, a, b = (torch.randn(64, generator=g, dtype=torch.float64) for _ in range(3))
    freq = 0.25 + 0.75 * torch.rand(64, generator=g, dtype=torch.float64)
    phase = 2 * math.pi * torch.rand(64, generator=g, dtype=torch.float64)
    x = torch.arange(1, steps + 1, dtype=torch.float64)[:, None] / steps
    return c + a * torch.sin(2 * math.pi * freq * x + phase) + b * x * x


def gamma_of(sigma_rel: float) -> float:
    """gamma from sigma_rel by bisection on the paper's definition (independent of emakit)."""
    lo, hi = 0.0, 1e6
    for _ in range(200):
        mid = (lo + hi) / 2
        sr = math.sqrt((mid + 1) / ((mid + 2) ** 2 * (mid + 3)))
        lo, hi = (mid, hi) if sr > sigma_rel else (lo, mid)
    return (lo + hi) / 2


class Net(nn.Module):
    """A Linear driven along theta, a BatchNorm (float and integer buffers) and an integer
    buffer ``counter`` (ema-pytorch never updates integer buffers: its files keep the value
    the model had when ema-pytorch copied it)."""

    def __init__(self, counter: int = 1234) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8, bias=False)
        self.bn = nn.BatchNorm1d(8)
        self.register_buffer("counter", torch.tensor(counter))


def drive(ema: object, theta: torch.Tensor, net: Net, steps: range) -> None:
    for t in steps:
        with torch.no_grad():
            net.lin.weight.copy_(theta[t].view(8, 8))
            net.bn.running_mean.copy_(theta[t, :8])
            net.bn.num_batches_tracked.add_(1)
        ema.update()  # type: ignore[attr-defined]


def theirs_posthoc(net: Net, folder: Path, **kwargs: object) -> object:
    return ema_pytorch.PostHocEMA(
        net,
        sigma_rels=SIGMA_RELS,
        update_every=kwargs.pop("update_every", 1),
        checkpoint_every_num_steps=EVERY,
        checkpoint_folder=str(folder),
        **kwargs,
    )


def ours_posthoc(net: Net, folder: Path, **kwargs: object) -> PostHocEMA:
    return PostHocEMA(
        net,
        sigma_rels=SIGMA_RELS,
        update_every=1,
        checkpoint_every_num_steps=EVERY,
        checkpoint_folder=folder,
        **kwargs,  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module")
def theta() -> torch.Tensor:
    return trajectory(2 * T)


@pytest.fixture(scope="module")
def their_run(theta: torch.Tensor, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """ema-pytorch's PostHocEMA over steps 1..T, float32 snapshots (so the comparisons are
    not blurred by float16 rounding)."""
    folder = tmp_path_factory.mktemp("theirs")
    net = Net()
    theirs = theirs_posthoc(net, folder, checkpoint_dtype=torch.float32)
    drive(theirs, theta, net, range(T))
    return theirs, net, folder


@pytest.fixture(scope="module")
def our_run(theta: torch.Tensor, tmp_path_factory: pytest.TempPathFactory) -> PostHocEMA:
    """emakit's own PostHocEMA over the same training, float32 snapshots."""
    net = Net()
    ours = ours_posthoc(net, tmp_path_factory.mktemp("ours"), checkpoint_dtype=torch.float32)
    drive(ours, theta, net, range(T))
    return ours


def copy_folder(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


# -- 1. synthesis right after switching -----------------------------------------------------


def test_their_files_are_snapshots_of_our_profiles(their_run: tuple):
    """Each ``<i>.<step>.pt`` becomes a snapshot of profile i (gamma = gammas[i]) whose
    profile ends at the step in its name (update_every=1: the last averaging update is the
    step-th call)."""
    _, net, folder = their_run
    ours = ours_posthoc(net, folder)
    snaps = ours.snapshots()
    assert len(snaps) == 2 * T // EVERY and all(s.is_legacy for s in snaps)
    assert [s.step for s in snaps] == sorted(s.step for s in snaps)
    for s in snaps:
        profile, step = map(int, s.path.stem.split("."))
        assert (s.profile, s.step, s.t) == (profile, step, step)
        assert s.gamma == ours.gammas[profile] and s.sigma_rel == SIGMA_RELS[profile]
    assert list_snapshots(folder) == []  # without the profiles they are not emakit's


def test_a_tracked_profile_comes_back(their_run: tuple, theta: torch.Tensor):
    """Can fail on the index -> gamma mapping or on t: synthesizing profile i's own length at
    the last step puts the largest weight on ``i.200.pt`` and returns about ema-pytorch's own
    EMA. Not exactly: with update_every=1 ema-pytorch's files hold the power profile one step
    late, which the synthesis corrects, so it is closer to the exact per-step EMA."""
    theirs, net, folder = their_run
    ours = ours_posthoc(net, folder)
    for index, sigma_rel in enumerate(SIGMA_RELS):
        plan = plan_synthesis(folder, sigma_rel=sigma_rel, legacy=ours.legacy_profiles())
        heaviest = max(zip(plan.weights, plan.snapshots, strict=True), key=lambda p: abs(p[0]))
        assert heaviest[1].path.name == f"{index}.{T}.pt"
        synth = ours.synthesize_ema_model(sigma_rel=sigma_rel).ema_model.lin.weight
        tracked = theirs.ema_models[index].ema_model.lin.weight
        truth = power_ema(theta, gamma_of(sigma_rel), T)
        assert rel_err(synth, tracked.double().flatten()) < 5e-3
        assert rel_err(synth, truth) < rel_err(tracked, truth) / 10


@pytest.mark.parametrize("sigma_rel", [0.1, 0.15, 0.2])
def test_synthesis_from_their_files_is_accurate(
    their_run: tuple, our_run: PostHocEMA, theta: torch.Tensor, sigma_rel: float
):
    """Synthesis from ema-pytorch's files right after switching to emakit, against the
    float64 per-step power EMA of the trajectory (the closed-form target): at least 10x
    closer than ema-pytorch's own ``synthesize_ema_model`` from the same files, closer than
    ema-pytorch's tracked EMAs are to their own targets (``floor``: they are one step late),
    and about as close as emakit's synthesis from an emakit run of the same training."""
    theirs, net, folder = their_run
    ours = ours_posthoc(net, folder)
    synth = ours.synthesize_ema_model(sigma_rel=sigma_rel).ema_model.lin.weight
    their_synth = theirs.synthesize_ema_model(sigma_rel=sigma_rel).ema_model.lin.weight
    truth = power_ema(theta, gamma_of(sigma_rel), T)
    floor = min(
        rel_err(m.ema_model.lin.weight, power_ema(theta, gamma_of(s), T))
        for m, s in zip(theirs.ema_models, SIGMA_RELS, strict=True)
    )
    emakit = our_run.synthesize_ema_model(sigma_rel=sigma_rel).ema_model.lin.weight
    err = rel_err(synth, truth)
    assert err < rel_err(their_synth, truth) / 10 and err < floor
    assert rel_err(theta[T - 1], truth) > 1000 * err
    assert err < 2 * rel_err(emakit, truth) + 1e-6


def test_integer_buffers_come_back_as_integers(theta: torch.Tensor, tmp_path: Path):
    """ema-pytorch stores every value as float16, integer buffers included; they come back
    in the model's integer dtype, rounded. Float buffers are taken from the latest file."""
    net = Net(counter=1234)
    theirs = theirs_posthoc(net, tmp_path)  # default checkpoint_dtype: float16
    drive(theirs, theta, net, range(50))
    stored = torch.load(tmp_path / "0.50.pt", weights_only=True)
    assert stored["ema_model.counter"].dtype == torch.float16
    ours = ours_posthoc(net, tmp_path)
    synth = ours.synthesize_ema_model(sigma_rel=0.1).ema_model
    assert synth.counter.dtype == torch.int64 and int(synth.counter) == 1234
    assert synth.bn.num_batches_tracked.dtype == torch.int64
    plan = plan_synthesis(tmp_path, sigma_rel=0.1, legacy=ours.legacy_profiles())
    assert plan.buffers_from.path.name == "0.50.pt"  # latest step, the closer gamma
    source = torch.load(plan.buffers_from.path, weights_only=True)
    assert torch.equal(synth.bn.running_var, source["ema_model.bn.running_var"].float())


def test_an_integer_lost_to_float16_keeps_the_models_value(theta: torch.Tensor, tmp_path: Path):
    net = Net(counter=70_000)  # > 65504: ema-pytorch stores inf
    drive(theirs_posthoc(net, tmp_path), theta, net, range(20))
    ours = ours_posthoc(net, tmp_path)
    with pytest.warns(PostHocWarning, match="'counter' in float16 .* overflowed"):
        synth = ours.synthesize_ema_model(sigma_rel=0.05)
    assert int(synth.ema_model.counter) == 70_000
    legacy = ours.legacy_profiles()
    with pytest.raises(EMAStateError, match=r"'counter' .* value is lost"):
        plan_synthesis(tmp_path, sigma_rel=0.05, legacy=legacy).run()


def test_update_every_sets_where_their_profiles_end(theta: torch.Tensor, tmp_path: Path):
    """ema-pytorch averages on calls 1, 6, 11, ... with update_every=5, so ``0.10.pt`` ends
    at step 6; three snapshot steps of such files fit the target poorly, and the warning
    says how much of them sits on the weights of step 1 under that update_every."""
    net = Net()
    drive(theirs_posthoc(net, tmp_path, update_every=5), theta, net, range(30))
    legacy = LegacyProfiles.from_sigma_rels(SIGMA_RELS, update_every=5)
    snaps = list_snapshots(tmp_path, legacy=legacy)
    assert {(s.step, s.t) for s in snaps} == {(10, 6), (20, 16), (30, 26)}
    with pytest.warns(PostHocWarning, match=r"update_every=5\) leaves \d+% to \d+%"):
        plan_synthesis(tmp_path, sigma_rel=0.1, legacy=legacy)


# -- 2. more training with emakit: both kinds together --------------------------------------


def test_after_more_training_synthesis_uses_both_kinds(
    their_run: tuple, theta: torch.Tensor, tmp_path: Path
):
    theirs, _, src = their_run
    folder = copy_folder(src, tmp_path / "mixed")
    net = Net()
    ours = ours_posthoc(net, folder, checkpoint_dtype=torch.float32)
    ours.load_state_dict(theirs.state_dict())  # resume ema-pytorch's run
    assert int(ours.step) == T
    drive(ours, theta, net, range(T, 2 * T))

    snaps = ours.snapshots()
    assert [s.step for s in snaps] == sorted(s.step for s in snaps)
    assert {s.source for s in snaps if s.step <= T} == {"ema-pytorch"}
    assert {s.source for s in snaps if s.step > T} == {"emakit"}
    plan = plan_synthesis(folder, sigma_rel=0.15, legacy=ours.legacy_profiles())
    used = {s.source for s, w in zip(plan.snapshots, plan.weights, strict=True) if abs(w) > 1e-6}
    assert used == {"emakit", "ema-pytorch"} and len(plan.snapshots) == len(snaps)

    truth = power_ema(theta, gamma_of(0.15), 2 * T)
    synth = ours.synthesize_ema_model(sigma_rel=0.15).ema_model.lin.weight
    assert rel_err(theta[-1], truth) > 20 * rel_err(synth, truth)
    # ema-pytorch's files matter: the emakit snapshots alone (steps > T) fit worse.
    later = tmp_path / "later"
    later.mkdir()
    for s in snaps:
        if not s.is_legacy:
            shutil.copy(s.path, later / s.path.name)
    alone = plan_synthesis(later, sigma_rel=0.15)
    assert alone.solution.residual > 5 * plan.solution.residual


def test_later_files_of_theirs_are_reported_on_resume(their_run: tuple, tmp_path: Path):
    _, _, src = their_run
    folder = copy_folder(src, tmp_path / "f")
    ours = ours_posthoc(Net(), folder)
    ours.update()
    with pytest.warns(
        PostHocWarning, match=r"not ema-pytorch's 40 file\(s\) like 0\.10\.pt: remove"
    ):
        ours.checkpoint()


# -- 3. the CLI -----------------------------------------------------------------------------


def test_cli_inspect_lists_their_files_and_says_what_synthesis_needs(their_run: tuple):
    _, _, folder = their_run
    result = CliRunner().invoke(inspect_cmd, [str(folder)])
    assert result.exit_code == 0, result.output
    out = result.output
    assert f"{2 * T // EVERY} ema-pytorch snapshot file(s)" in out
    assert "profile index" in out and "0.10.pt" in out and f"steps {EVERY}..{T}" in out
    assert "--legacy-sigma-rels" in out and "do not record their profiles" in out

    args = [str(folder), "--legacy-sigma-rels", "0.05,0.28", "--legacy-update-every", "1"]
    result = CliRunner().invoke(inspect_cmd, args)
    assert result.exit_code == 0, result.output
    assert "16.9722" in result.output and "ema-pytorch" in result.output
    assert f"{2 * T // EVERY} snapshots at {T // EVERY} steps" in result.output


def test_cli_synthesize_refuses_their_files_without_the_option(their_run: tuple, tmp_path: Path):
    _, _, folder = their_run
    out = tmp_path / "ema.safetensors"
    result = CliRunner().invoke(
        synthesize, [str(folder), "--sigma-rel", "0.1", "--out", str(out), "--no-progress"]
    )
    assert result.exit_code == 1
    assert "ema-pytorch snapshot file(s) (0.10.pt" in result.output
    assert "--legacy-sigma-rels" in result.output and not out.exists()
    result = CliRunner().invoke(
        synthesize,
        [str(folder), "--sigma-rel", "0.1", "--out", str(out), "--legacy-sigma-rels", "0.05,0.28"],
    )
    assert result.exit_code == 2 and "--legacy-update-every" in result.output


def test_cli_synthesize_with_the_option(their_run: tuple, tmp_path: Path):
    _, net, folder = their_run
    out = tmp_path / "ema.safetensors"
    args = ["--legacy-sigma-rels", "0.05,0.28", "--legacy-update-every", "1", "--no-progress"]
    result = CliRunner().invoke(
        synthesize, [str(folder), "--sigma-rel", "0.1", "--out", str(out), *args]
    )
    assert result.exit_code == 0, result.output
    assert f"{2 * T // EVERY} snapshots ({2 * T // EVERY} from ema-pytorch)" in result.output
    assert "norm-layer buffer(s)" in result.output  # it had to guess the buffers: says so
    state = load_file(str(out))
    assert state["bn.num_batches_tracked"].dtype == torch.int64
    expected = ours_posthoc(net, folder).synthesize_ema_model(sigma_rel=0.1).ema_model
    assert torch.equal(state["lin.weight"], expected.lin.weight)
    assert torch.equal(state["bn.running_var"], expected.bn.running_var)
    # --legacy-gammas gives the same
    by_gamma = tmp_path / "g.safetensors"
    gammas = ",".join(repr(sigma_rel_to_gamma(s)) for s in SIGMA_RELS)
    result = CliRunner().invoke(
        synthesize,
        [
            str(folder),
            "--sigma-rel",
            "0.1",
            "--out",
            str(by_gamma),
            "--legacy-gammas",
            gammas,
            *args[2:],
        ],
    )
    assert result.exit_code == 0, result.output
    assert torch.equal(load_file(str(by_gamma))["lin.weight"], state["lin.weight"])


def test_cli_on_a_mixed_folder_matches_the_api(
    their_run: tuple, theta: torch.Tensor, tmp_path: Path
):
    theirs, _, src = their_run
    folder = copy_folder(src, tmp_path / "mixed")
    net = Net()
    ours = ours_posthoc(net, folder, checkpoint_dtype=torch.float32)
    ours.load_state_dict(theirs.state_dict())
    drive(ours, theta, net, range(T, T + 50))
    out = tmp_path / "ema.safetensors"
    args = ["--legacy-sigma-rels", "0.05,0.28", "--legacy-update-every", "1", "--no-progress"]
    result = CliRunner().invoke(
        synthesize, [str(folder), "--sigma-rel", "0.15", "--out", str(out), *args]
    )
    assert result.exit_code == 0, result.output
    assert "norm-layer" not in result.output  # emakit's snapshots say which are buffers
    state = load_file(str(out))
    expected = ours.synthesize_ema_model(sigma_rel=0.15).ema_model.state_dict()
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[k], expected[k]) for k in state)
    result = CliRunner().invoke(inspect_cmd, [str(folder), *args[:4]])
    assert result.exit_code == 0, result.output
    assert "ema-pytorch+emakit" in result.output or "emakit+ema-pytorch" in result.output


# -- 4. bad files ---------------------------------------------------------------------------


def test_a_profile_index_out_of_range_is_a_clear_error(their_run: tuple, tmp_path: Path):
    _, net, src = their_run
    folder = copy_folder(src, tmp_path / "f")
    shutil.copy(folder / f"0.{T}.pt", folder / f"2.{T}.pt")
    ours = ours_posthoc(net, folder)
    for call in (ours.snapshots, lambda: ours.synthesize_ema_model(sigma_rel=0.1)):
        with pytest.raises(EMAStateError, match=rf"2\.{T}\.pt is of profile index 2, but only 2"):
            call()
    args = ["--legacy-sigma-rels", "0.05,0.28", "--legacy-update-every", "1"]
    out = tmp_path / "x.safetensors"
    result = CliRunner().invoke(
        synthesize, [str(folder), "--sigma-rel", "0.1", "--out", str(out), *args]
    )
    assert result.exit_code == 1 and "profile index 2" in result.output
    assert "at least 3 of them" in result.output and not out.exists()


def test_plan_synthesis_without_their_profiles_refuses_their_files(their_run: tuple):
    _, _, folder = their_run
    with pytest.raises(EMAStateError, match=r"ema-pytorch snapshot file\(s\) .*legacy="):
        plan_synthesis(folder, sigma_rel=0.1)


class Evil:
    """Unpickling this runs code (``__reduce__``): weights_only must refuse it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('pwned')",))


def test_a_malicious_pickle_is_refused_not_executed(their_run: tuple, tmp_path: Path):
    _, net, src = their_run
    folder = copy_folder(src, tmp_path / "f")
    marker = tmp_path / "pwned"
    torch.save({"ema_model.lin.weight": Evil(marker)}, folder / f"0.{T}.pt")
    ours = ours_posthoc(net, folder)
    with pytest.raises(EMAStateError, match=r"weights_only=True\) refused it"):
        ours.synthesize_ema_model(sigma_rel=0.05)
    assert not marker.exists()
    args = ["--legacy-sigma-rels", "0.05,0.28", "--legacy-update-every", "1"]
    result = CliRunner().invoke(
        synthesize,
        [
            str(folder),
            "--sigma-rel",
            "0.05",
            "--out",
            str(tmp_path / "x.safetensors"),
            "--no-progress",
            *args,
        ],
    )
    assert result.exit_code == 1 and "refused" in result.output and not marker.exists()

    torch.save([1, 2, 3], folder / f"0.{T}.pt")  # loads with weights_only, but is no state
    with pytest.raises(EMAStateError, match="not an ema-pytorch KarrasEMA state dict"):
        ours.synthesize_ema_model(sigma_rel=0.05)


def test_legacy_profiles_validate(tmp_path: Path):
    with pytest.raises(EMAValueError, match="one value per profile index"):
        LegacyProfiles(())
    with pytest.raises(EMAValueError, match="update_every"):
        LegacyProfiles((1.0, 2.0), update_every=0)
    with pytest.raises(EMAValueError, match="sigma_rels"):
        LegacyProfiles.from_sigma_rels((0.05, 0.5))
    assert list_legacy_files(tmp_path) == []


# -- B. argument order --------------------------------------------------------------------


def test_synthesize_ema_model_takes_ema_pytorchs_argument_order():
    ours = inspect.signature(PostHocEMA.synthesize_ema_model).parameters
    theirs = inspect.signature(ema_pytorch.PostHocEMA.synthesize_ema_model).parameters
    assert list(ours) == list(theirs) == ["self", "gamma", "sigma_rel", "step"]

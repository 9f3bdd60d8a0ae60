"""Post-hoc EMA: KarrasEMA's decay, PostHocEMA's snapshots, and synthesis accuracy.

The accuracy tests drive a model along a known smooth trajectory theta(t) and compare
against a float64 power-function EMA computed directly here, by the paper's recursion
(arXiv:2312.02696 §3), never through emakit's own math.
"""

from __future__ import annotations

import copy
import itertools
import math
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from _models import float16_overflow_linear, power_ema, rel_err, train
from emakit import (
    EMAError,
    EMAFileNotFoundError,
    EMARuntimeError,
    EMAStateError,
    EMATypeError,
    EMAValueError,
)
from emakit.posthoc import (
    KarrasEMA,
    PostHocEMA,
    PostHocWarning,
    list_snapshots,
    plan_synthesis,
    read_snapshot_info,
    sigma_rel_to_gamma,
    synthesize_state_dict,
)
from emakit.posthoc.math import COND_LIMIT, solve_weights
from emakit.posthoc.snapshots import format as reading_module
from emakit.posthoc.snapshots import format as snapshots_module
from emakit.posthoc.synthesis import plan as synthesis_module

pytestmark = pytest.mark.usefixtures("one_thread")

T = 4000  # training steps of the smooth trajectory
EVERY = 200  # snapshot interval
N = 64  # parameters driven along the trajectory


# -- a smooth trajectory and its float64 ground truth ---------------------------------------


def trajectory(steps: int = T, seed: int = 0) -> torch.Tensor:
    """theta(t) for t = 1..steps as rows: drift plus slow oscillations, float64."""
    g = torch.Generator().manual_seed(seed)
    c, a, b = (torch.randn(N, generator=g, dtype=torch.float64) for _ in range(3))
    freq = 0.25 + 0.75 * torch.rand(N, generator=g, dtype=torch.float64)
    phase = 2 * math.pi * torch.rand(N, generator=g, dtype=torch.float64)
    x = torch.arange(1, steps + 1, dtype=torch.float64)[:, None] / steps
    return c + a * torch.sin(2 * math.pi * freq * x + phase) + b * x * x


def gamma_of(sigma_rel: float) -> float:
    """gamma from sigma_rel by bisection on the paper's definition (independent of emakit)."""

    def sr(g: float) -> float:
        return math.sqrt((g + 1) / ((g + 2) ** 2 * (g + 3)))

    lo, hi = 0.0, 1e6
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sr(mid) > sigma_rel else (lo, mid)
    return (lo + hi) / 2


def drive(ema: object, theta: torch.Tensor, net: nn.Linear, steps: int | None = None) -> None:
    for t in range(steps or theta.shape[0]):
        with torch.no_grad():
            net.weight.copy_(theta[t].view(8, 8))
        ema.update()  # type: ignore[attr-defined]


def linear() -> nn.Linear:
    return nn.Linear(8, 8, bias=False)


@pytest.fixture(scope="module")
def theta() -> torch.Tensor:
    return trajectory()


@pytest.fixture(scope="module")
def runs(theta: torch.Tensor, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """PostHocEMA over the trajectory with update_every 1 and 10 (float32 snapshots)."""
    out = {}
    for every in (1, 10):
        folder = tmp_path_factory.mktemp(f"every{every}")
        net = linear()
        ema = PostHocEMA(
            net,
            sigma_rels=(0.05, 0.28),
            update_every=every,
            checkpoint_every_num_steps=EVERY,
            checkpoint_folder=folder,
            checkpoint_dtype=torch.float32,
        )
        drive(ema, theta, net)
        out[every] = (ema, folder)
    return out


# -- the math -------------------------------------------------------------------------------


def test_sigma_rel_to_gamma_matches_the_definition():
    from emakit.posthoc import gamma_to_sigma_rel

    assert sigma_rel_to_gamma(0.05) == pytest.approx(16.97, abs=0.01)
    assert sigma_rel_to_gamma(0.10) == pytest.approx(6.94, abs=0.01)
    for s in (1e-4, 0.01, 0.05, 0.1, 0.15, 0.2, 0.28, 0.2886):
        g = sigma_rel_to_gamma(s)
        assert g > 0
        assert g == pytest.approx(gamma_of(s), rel=1e-9)
        assert gamma_to_sigma_rel(g) == pytest.approx(s, rel=1e-12)


def test_sigma_rel_up_to_the_widest_profile_takes_ema_pytorchs_root():
    """ema-pytorch's README example, PostHocEMA(net, sigma_rels=(0.05, 0.3)): gamma = -1/3,
    the largest real root of the cubic, as ema-pytorch computes it with np.roots."""
    from ema_pytorch.post_hoc_ema import sigma_rel_to_gamma as theirs

    from emakit.posthoc import GAMMA_MIN, SIGMA_REL_MAX, gamma_to_sigma_rel

    assert abs(SIGMA_REL_MAX - 0.3002831060) < 1e-10
    assert sigma_rel_to_gamma(0.3) == pytest.approx(-1 / 3, abs=1e-12)
    for s in (0.05, 0.28, 1 / math.sqrt(12), 0.29, 0.3, 0.3002, 0.30028, SIGMA_REL_MAX):
        g = sigma_rel_to_gamma(s)
        assert g >= GAMMA_MIN
        assert g == pytest.approx(theirs(s), rel=1e-9, abs=1e-12), s
        assert gamma_to_sigma_rel(g) == pytest.approx(s, rel=1e-12)
    assert KarrasEMA(linear(), sigma_rel=0.3).gamma == pytest.approx(-1 / 3, abs=1e-12)


def test_posthoc_with_sigma_rel_0_3_synthesizes_finite_weights(theta, tmp_path):
    net = linear()
    ema = PostHocEMA(
        net,
        sigma_rels=(0.05, 0.3),
        checkpoint_every_num_steps=EVERY,
        checkpoint_folder=tmp_path,
        checkpoint_dtype=torch.float32,
    )
    drive(ema, theta, net, steps=1000)
    tracked = ema.ema_models[1].ema_model.weight
    synth = ema.synthesize_ema_model(sigma_rel=0.3)
    assert torch.isfinite(synth.ema_model.weight).all()
    assert torch.allclose(synth.ema_model.weight, tracked, rtol=0, atol=1e-5)
    wide = ema.synthesize_ema_model(sigma_rel=0.29).ema_model.weight  # gamma < 0 too
    truth = power_ema(theta, sigma_rel_to_gamma(0.29), 1000)
    err = rel_err(wide, truth)
    assert torch.isfinite(wide).all() and err < 0.5 * rel_err(theta[999], truth)


@pytest.mark.parametrize("bad", [0.0, -0.1, float("nan"), float("inf"), 0.3003, 0.31, 1.0])
def test_bad_sigma_rel_is_rejected_naming_the_range(bad: float):
    with pytest.raises(
        EMAValueError, match=r"sigma_rel must be a finite number in \(0, 0\.300283\]"
    ):
        sigma_rel_to_gamma(bad)
    with pytest.raises(EMAValueError, match="sigma_rel"):
        KarrasEMA(linear(), sigma_rel=bad)
    with pytest.raises(EMAValueError, match="sigma_rels"):
        PostHocEMA(linear(), sigma_rels=(0.05, bad), checkpoint_every_num_steps="manual")


@pytest.mark.parametrize("bad", [True, "0.1", None])
def test_sigma_rel_of_wrong_type_is_rejected(bad: object):
    with pytest.raises(EMAError):
        sigma_rel_to_gamma(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-0.4, -1.0, float("nan"), float("inf")])
def test_bad_gamma_is_rejected(bad: float):
    with pytest.raises(EMAValueError, match="gamma"):
        KarrasEMA(linear(), gamma=bad)


def test_sample_weights_and_beta_agree_with_the_recursion():
    from emakit.posthoc import power_function_beta, power_function_sample_weights

    gamma, steps = 3.5, [1, 10, 20, 35, 50]
    # Run the recursion on unit vectors: the EMA then *is* the weight vector.
    ema = torch.zeros(len(steps), dtype=torch.float64)
    ema[0] = 1.0
    for j in range(1, len(steps)):
        beta = power_function_beta(steps[j], steps[j] - steps[j - 1], gamma)
        assert beta == pytest.approx((1 - (steps[j] - steps[j - 1]) / steps[j]) ** (gamma + 1))
        e = torch.zeros(len(steps), dtype=torch.float64)
        e[j] = 1.0
        ema = beta * ema + (1 - beta) * e
    w = power_function_sample_weights(steps, gamma)
    assert sum(w) == pytest.approx(1.0, abs=1e-15)
    assert torch.allclose(ema, torch.tensor(w, dtype=torch.float64), rtol=0, atol=1e-15)


def test_profile_inner_product_matches_numerical_integration():
    from emakit.posthoc import power_function_profile, profile_inner_product

    for ta, ga, tb, gb in [(1.0, 3.0, 0.6, 7.0), (0.3, 0.2, 0.9, 16.9), (1.0, 2.0, 1.0, 2.0)]:
        # Both profiles are smooth on (0, min(ta, tb)] and their product is 0 beyond.
        tau = torch.linspace(0, min(ta, tb), 20_001, dtype=torch.float64)
        prod = [
            power_function_profile(x, ta, ga) * power_function_profile(x, tb, gb)
            for x in tau.tolist()
        ]
        numeric = float(torch.trapezoid(torch.tensor(prod, dtype=torch.float64), tau))
        assert profile_inner_product(ta, ga, tb, gb) == pytest.approx(numeric, rel=1e-6)


def test_solve_weights_returns_a_tracked_profile_exactly():
    from emakit.posthoc import solve_weights

    ts = [t for t in range(200, 2001, 200) for _ in range(2)]
    gs = [sigma_rel_to_gamma(s) for _ in range(10) for s in (0.05, 0.28)]
    sol = solve_weights(ts, gs, 2000, gs[-2])
    expect = [0.0] * 20
    expect[-2] = 1.0
    assert sol.weights == pytest.approx(expect, abs=1e-9)
    assert sol.residual < 1e-6 and sol.method == "solve"


def test_solve_weights_refuses_later_snapshots_and_empty_sets():
    from emakit.posthoc import solve_weights

    with pytest.raises(EMAValueError, match="after the target step"):
        solve_weights([100, 300], [5.0, 5.0], 200, 5.0)
    with pytest.raises(EMAValueError, match="no snapshots"):
        solve_weights([], [], 200, 5.0)
    with pytest.raises(EMAValueError, match="cannot represent"):
        # every snapshot ends long before a very short target EMA begins
        solve_weights([1, 2], [1.0, 2.0], 1_000_000, 1000.0)


def test_duplicate_snapshots_fall_back_to_least_squares_with_a_warning():
    from emakit.posthoc import solve_weights

    with pytest.warns(PostHocWarning, match="duplicate"):
        sol = solve_weights([100, 100, 200, 200], [5.0, 5.0, 5.0, 9.0], 200, 7.0)
    assert sol.method == "lstsq"
    assert sum(sol.weights) == pytest.approx(1.0, abs=1e-12)


def test_an_ill_conditioned_snapshot_set_falls_back_to_least_squares():
    """Near-duplicate snapshots (no exact duplicate) make the normal equations singular to
    working precision: the solve must switch to least squares (with a warning), and the
    near-duplicates together carry the weight the one snapshot would."""
    ts = [500.0, 1000.0, 1000.0 * (1 - 1e-13), 1000.0 * (1 - 2e-13)]
    gammas = [6.94, 16.97, 16.97, 16.97]
    with pytest.warns(PostHocWarning, match="ill-conditioned"):
        sol = solve_weights(ts, gammas, 1000.0, 10.0)
    assert sol.method == "lstsq" and sol.cond > COND_LIMIT
    assert math.isclose(sum(sol.weights), 1.0, abs_tol=1e-12)
    well = solve_weights([500.0, 1000.0], [6.94, 16.97], 1000.0, 10.0)
    assert well.method == "solve"
    assert math.isclose(sum(sol.weights[1:]), well.weights[1], abs_tol=1e-9)
    assert math.isclose(sol.residual, well.residual, rel_tol=1e-6)


@settings(max_examples=60, deadline=None)
@given(
    snaps=st.lists(
        st.tuples(st.integers(1, 100_000), st.floats(0.01, 0.28)), min_size=1, max_size=24
    ),
    target=st.floats(0.03, 0.28),
    extra=st.floats(1.0, 1.2),
)
def test_weights_sum_to_one_for_any_valid_snapshot_set(snaps, target, extra):
    from emakit.posthoc import solve_weights

    ts = [t for t, _ in snaps]
    gs = [sigma_rel_to_gamma(s) for _, s in snaps]
    t_r = max(ts) * extra
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PostHocWarning)
        sol = solve_weights(ts, gs, t_r, sigma_rel_to_gamma(target))
    assert all(math.isfinite(w) for w in sol.weights)
    assert sum(sol.weights) == pytest.approx(1.0, abs=1e-9)
    assert sol.residual >= 0.0 and math.isfinite(sol.residual)


# -- KarrasEMA ------------------------------------------------------------------------------


def test_karras_needs_exactly_one_of_sigma_rel_and_gamma():
    with pytest.raises(EMAValueError, match="exactly one"):
        KarrasEMA(linear())
    with pytest.raises(EMAValueError, match="exactly one"):
        KarrasEMA(linear(), sigma_rel=0.1, gamma=6.9)


@pytest.mark.parametrize("every", [1, 10])
def test_karras_beta_honours_update_every(theta: torch.Tensor, every: int):
    steps = 1 + every * 150  # ends on an averaging update
    gamma = sigma_rel_to_gamma(0.1)
    net = linear()
    ema = KarrasEMA(net, sigma_rel=0.1, update_every=every)
    drive(ema, theta, net, steps)
    assert ema.t == steps
    # The decay of the last update covers the whole gap, not one step.
    assert ema.get_current_decay() == pytest.approx((1 - every / steps) ** (gamma + 1), rel=1e-12)
    assert ema.beta == ema.get_current_decay()
    # The EMA is exactly the float64 power-function EMA of the weights it saw ...
    seen = list(range(1, steps + 1, every))
    ref = theta[0].clone()
    for prev, t in itertools.pairwise(seen):
        beta = (1 - (t - prev) / t) ** (gamma + 1)
        ref = beta * ref + (1 - beta) * theta[t - 1]
    assert rel_err(ema.ema_model.weight, ref) < 1e-6
    # ... and close to the per-step EMA of every weight (only the sampling differs).
    assert rel_err(ema.ema_model.weight, power_ema(theta, gamma, steps)) < 3e-3


def test_ema_pytorch_karras_beta_ignores_update_every(theta: torch.Tensor):
    """Differential: ema-pytorch 0.8.3's KarrasEMA with update_every=10 is far off."""
    ema_pytorch = pytest.importorskip("ema_pytorch")
    steps, gamma = 1501, sigma_rel_to_gamma(0.1)
    truth = power_ema(theta, gamma, steps)
    raw = rel_err(theta[steps - 1], truth)
    errs = {}
    for name, cls in (("emakit", KarrasEMA), ("ema_pytorch", ema_pytorch.KarrasEMA)):
        net = linear()
        ema = cls(net, sigma_rel=0.1, update_every=10)
        drive(ema, theta, net, steps)
        errs[name] = rel_err(ema.ema_model.weight, truth)
    assert errs["emakit"] < 5e-3
    assert errs["ema_pytorch"] > 10 * errs["emakit"]
    assert errs["ema_pytorch"] > raw  # worse than no averaging at all


def test_karras_resume_is_exact_and_checks_gamma(theta: torch.Tensor):
    net_a, net_b = linear(), linear()
    a = KarrasEMA(net_a, sigma_rel=0.1, update_every=7)
    drive(a, theta, net_a, 300)
    b = KarrasEMA(net_b, sigma_rel=0.1, update_every=7)
    drive(b, theta, net_b, 123)
    state = b.state_dict()
    meta = state._metadata[""]
    assert meta["karras_version"] == 2 and meta["t"] == b.t and "t" not in state
    c = KarrasEMA(net_b, sigma_rel=0.1, update_every=7)
    c.load_state_dict(state)
    for t in range(123, 300):
        with torch.no_grad():
            net_b.weight.copy_(theta[t].view(8, 8))
        c.update()
    assert torch.equal(a.ema_model.weight, c.ema_model.weight)
    with pytest.raises(EMAStateError, match="gamma"):
        KarrasEMA(linear(), sigma_rel=0.2).load_state_dict(state)


def test_karras_loads_an_ema_pytorch_state():
    ema_pytorch = pytest.importorskip("ema_pytorch")
    net = linear()
    theirs = ema_pytorch.KarrasEMA(net, sigma_rel=0.1, update_every=10)
    for _ in range(25):
        theirs.update()
    ours = KarrasEMA(linear(), sigma_rel=0.1, update_every=10)
    ours.load_state_dict(theirs.state_dict())
    assert int(ours.step) == 25 and ours.t == 21
    assert torch.equal(ours.ema_model.weight, theirs.ema_model.weight)


def test_karras_is_picklable_and_deep_copyable():
    net = linear()
    ema = KarrasEMA(net, sigma_rel=0.1, update_every=2)
    for _ in range(5):
        ema.update()
    for clone in (pickle.loads(pickle.dumps(ema)), copy.deepcopy(ema)):
        assert clone.t == ema.t and clone.gamma == ema.gamma
        assert torch.equal(clone.ema_model.weight, ema.ema_model.weight)
        clone.update()


# -- PostHocEMA: snapshots ------------------------------------------------------------------


def bn_net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    net.register_buffer("counter", torch.tensor(0, dtype=torch.int64))
    return net


def bn_sgd(net: nn.Module) -> dict[str, Any]:
    """`train()`'s keywords for `bn_net`: 16 x 4 batches, lr 0.05, and ``counter`` moved by
    1000 before each update."""
    return dict(batch=(16, 4), lr=0.05, then=lambda i: net.counter.add_(1000))


def test_each_profile_owns_its_ema_copy(tmp_path: Path):
    net = bn_net()
    template = bn_net()
    ema = PostHocEMA(
        net,
        ema_model=template,
        update_every=1,
        checkpoint_every_num_steps="manual",
        checkpoint_folder=tmp_path,
    )
    models = [m.ema_model for m in ema.ema_models]
    assert len({id(m) for m in models}) == 2 and all(m is not template for m in models)
    ptrs = [m[0].weight.data_ptr() for m in models]
    assert len(set(ptrs)) == 2
    train(net, [ema], 30, **bn_sgd(net))
    assert not torch.equal(models[0][0].weight, models[1][0].weight)


def test_snapshot_files_carry_their_metadata_and_readable_names(tmp_path: Path):
    net = bn_net()
    ema = PostHocEMA(
        net,
        sigma_rels=(0.05, 0.28),
        update_every=3,
        checkpoint_every_num_steps=10,
        checkpoint_folder=tmp_path,
    )
    train(net, [ema], 20, **bn_sgd(net))
    names = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))
    assert names == [
        "step-000000010_sigma_rel-0.05_gamma-16.9722.safetensors",
        "step-000000010_sigma_rel-0.28_gamma-0.169344.safetensors",
        "step-000000020_sigma_rel-0.05_gamma-16.9722.safetensors",
        "step-000000020_sigma_rel-0.28_gamma-0.169344.safetensors",
    ]
    info = read_snapshot_info(tmp_path / names[2])
    assert (info.step, info.t, info.profile, info.update_every) == (20, 20, 0, 3)
    assert info.gamma == sigma_rel_to_gamma(0.05) and info.sigma_rel == 0.05
    assert info.format_version == 1 and info.run == ema.run_id
    assert "1.num_batches_tracked" in info.copied and "counter" in info.copied
    assert "1.running_var" in info.copied and "0.weight" not in info.copied
    from safetensors import safe_open

    with safe_open(str(info.path), framework="pt") as f:
        meta = f.metadata()
        assert meta["format"] == "emakit.posthoc.snapshot" and meta["format_version"] == "1"
        assert f.get_tensor("0.weight").dtype == torch.float16  # the default checkpoint_dtype


def test_integer_buffers_round_trip_exactly(tmp_path: Path):
    net = bn_net()
    ema = PostHocEMA(net, update_every=5, checkpoint_every_num_steps=35, checkpoint_folder=tmp_path)
    train(net, [ema], 70, **bn_sgd(net))
    assert int(net.counter) == 70_000
    snap = list_snapshots(tmp_path)[-1]
    from safetensors.torch import load_file

    stored = load_file(str(snap.path))
    assert stored["counter"].dtype == torch.int64 and int(stored["counter"]) == 70_000
    assert int(stored["1.num_batches_tracked"]) == 70
    synth = ema.synthesize_ema_model(sigma_rel=0.05)
    assert int(synth.ema_model.counter) == 70_000
    assert int(synth.ema_model[1].num_batches_tracked) == 70


def test_ema_pytorch_casts_integer_buffers_to_float16(tmp_path: Path):
    """Differential: ema-pytorch 0.8.3 stores step 70000 as fp16 inf."""
    ema_pytorch = pytest.importorskip("ema_pytorch")
    net = bn_net()
    net.counter.fill_(70_000)  # e.g. a step counter the model keeps
    theirs = ema_pytorch.PostHocEMA(
        net,
        sigma_rels=(0.05, 0.28),
        checkpoint_every_num_steps=70,
        checkpoint_folder=tmp_path / "theirs",
    )
    train(net, [theirs], 70, **bn_sgd(net))
    state = torch.load(tmp_path / "theirs" / "0.70.pt", weights_only=True)
    assert torch.isinf(state["ema_model.counter"])


def test_snapshots_are_written_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    net = bn_net()
    ema = PostHocEMA(net, checkpoint_every_num_steps="manual", checkpoint_folder=tmp_path)
    train(net, [ema], 5, **bn_sgd(net))
    first = ema.checkpoint()
    before = {p: p.read_bytes() for p in first}

    from emakit.posthoc.snapshots import format as snapshots

    def crash(f, tensors, metadata, dtype=None):  # a writer dying half-way
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(snapshots, "write_safetensors", crash)
    # Same step again: the files exist, and a failed rewrite must leave them whole.
    with pytest.raises(OSError, match="disk full"):
        ema.checkpoint()
    assert {p: p.read_bytes() for p in first} == before
    files = sorted(p for p in tmp_path.iterdir() if not p.name.startswith(".emakit-posthoc"))
    assert files == sorted(first)  # no temporary file left behind


def test_only_rank_zero_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    net = bn_net()
    ema = PostHocEMA(net, checkpoint_every_num_steps="manual", checkpoint_folder=tmp_path)
    train(net, [ema], 5, **bn_sgd(net))
    monkeypatch.setattr(torch.distributed, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)
    assert ema.checkpoint() == []
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)
    assert len(ema.checkpoint()) == 2


def test_unrelated_files_in_the_folder_are_ignored(tmp_path: Path):
    net = bn_net()
    ema = PostHocEMA(net, update_every=2, checkpoint_every_num_steps=10, checkpoint_folder=tmp_path)
    train(net, [ema], 30, **bn_sgd(net))
    from safetensors.torch import save_file

    (tmp_path / "notes.txt").write_text("run notes")
    (tmp_path / "train.log").write_text("loss 0.1")
    save_file({"w": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    (tmp_path / "broken.safetensors").write_bytes(b"not a safetensors file")
    (tmp_path / ".step-000000040_x.safetensors.emakit-tmp-abc").write_bytes(b"junk")
    (tmp_path / "subdir.safetensors").mkdir()
    with pytest.warns(PostHocWarning, match="broken"):
        snaps = list_snapshots(tmp_path)
    assert [s.step for s in snaps] == [10, 10, 20, 20, 30, 30]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PostHocWarning)
        ema.synthesize_ema_model(sigma_rel=0.1)


def test_resumed_run_continues_the_same_folder(tmp_path: Path):
    # Uninterrupted run
    net_a = bn_net()
    a = PostHocEMA(
        net_a,
        update_every=3,
        checkpoint_every_num_steps=10,
        checkpoint_folder=tmp_path / "a",
        checkpoint_dtype=torch.float32,
    )
    train(net_a, [a], 40, **bn_sgd(net_a))
    # Interrupted at step 20, resumed from its state into a new process/object.
    net_b = bn_net()
    b = PostHocEMA(
        net_b,
        update_every=3,
        checkpoint_every_num_steps=10,
        checkpoint_folder=tmp_path / "b",
        checkpoint_dtype=torch.float32,
    )
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.SGD(net_b.parameters(), lr=0.05)
    for i in range(40):
        if i == 20:
            state = {k: v.clone() for k, v in b.state_dict().items()}
            b = PostHocEMA(
                net_b,
                update_every=3,
                checkpoint_every_num_steps=10,
                checkpoint_folder=tmp_path / "b",
                checkpoint_dtype=torch.float32,
            )
            b.load_state_dict(state)
        net_b(torch.randn(16, 4, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            net_b.counter.add_(1000)
        b.update()
    names_a = sorted(p.name for p in (tmp_path / "a").iterdir() if not p.name.startswith("."))
    names_b = sorted(p.name for p in (tmp_path / "b").iterdir() if not p.name.startswith("."))
    assert names_a == names_b and len(names_a) == 8
    from safetensors import safe_open

    for name in names_a:
        with (
            safe_open(str(tmp_path / "a" / name), framework="pt") as fa,
            safe_open(str(tmp_path / "b" / name), framework="pt") as fb,
        ):
            meta_a, meta_b = fa.metadata(), fb.metadata()
            assert meta_a.pop("run") == a.run_id and meta_b.pop("run") == b.run_id
            assert meta_a == meta_b
            assert sorted(fa.keys()) == sorted(fb.keys())
            for key in fa.keys():  # noqa: SIM118 - safe_open is not a dict
                assert torch.equal(fa.get_tensor(key), fb.get_tensor(key)), (name, key)


def test_resume_warns_about_snapshots_from_an_abandoned_future(tmp_path: Path):
    net = bn_net()
    ema = PostHocEMA(net, checkpoint_every_num_steps=10, checkpoint_folder=tmp_path)
    train(net, [ema], 10, **bn_sgd(net))
    state = ema.state_dict()
    train(net, [ema], 20, **bn_sgd(net))  # snapshots at 20 and 30
    again = PostHocEMA(net, checkpoint_every_num_steps=10, checkpoint_folder=tmp_path)
    again.load_state_dict(state)
    with pytest.warns(PostHocWarning, match="after step 20"):
        train(net, [again], 10, **bn_sgd(net))
    plan = plan_synthesis(tmp_path, sigma_rel=0.05, step=20)
    assert max(s.step for s in plan.snapshots) == 20


def test_posthoc_state_is_versioned_and_checks_profiles(tmp_path: Path):
    net = bn_net()
    ema = PostHocEMA(net, checkpoint_every_num_steps="manual", checkpoint_folder=tmp_path)
    train(net, [ema], 7, **bn_sgd(net))
    state = ema.state_dict()
    assert state._metadata[""]["version"] == 2 and "version" not in state
    assert state._metadata[""]["gammas"] == list(ema.gammas)
    assert int(state["ema_models.1.step"]) == 7
    other = PostHocEMA(
        bn_net(),
        sigma_rels=(0.05, 0.2),
        checkpoint_every_num_steps="manual",
        checkpoint_folder=tmp_path,
    )
    with pytest.raises(EMAStateError, match="gammas"):
        other.load_state_dict(state)
    newer = dict(state, version=torch.tensor(99))
    with pytest.raises(EMAStateError, match="upgrade emakit"):
        ema.load_state_dict(newer)
    clone = pickle.loads(pickle.dumps(ema))
    assert int(clone.step) == 7


def test_a_state_of_other_profiles_is_refused_naming_both_and_the_fix(tmp_path: Path):
    """The refusal names the sigma_rels and gammas of the state and of the PostHocEMA, and
    the keyword to build it with; built so, the state loads (sigma_rels or gammas form)."""
    kw = dict(update_every=1, checkpoint_every_num_steps="manual")
    for saved_with, other in [
        ({"sigma_rels": (0.05, 0.28)}, {"sigma_rels": (0.05, 0.1)}),
        ({"gammas": (6.94, 16.97)}, {"gammas": (6.94, 5.0)}),
        ({"sigma_rels": (0.05, 0.28)}, {"sigma_rels": (0.05,)}),  # another profile count
    ]:
        net = bn_net()
        ema = PostHocEMA(net, checkpoint_folder=tmp_path / "a", **saved_with, **kw)
        train(net, [ema], 3, **bn_sgd(net))
        state = ema.state_dict()
        loader = PostHocEMA(bn_net(), checkpoint_folder=tmp_path / "b", **other, **kw)
        with pytest.raises(EMAStateError) as err:
            loader.load_state_dict(state)
        message = str(err.value)
        srs = tuple(round(s, 12) for s in ema.sigma_rels)
        assert f"with sigma_rels={srs!r} (gammas={ema.gammas!r})" in message, message
        mine = tuple(round(s, 12) for s in loader.sigma_rels)
        assert f"has sigma_rels={mine!r} (gammas={loader.gammas!r})" in message, message
        assert f"saved with: sigma_rels={srs!r} or gammas={ema.gammas!r}" in message, message
        assert int(loader.step) == 0  # nothing was loaded
        for fix in ({"sigma_rels": srs}, {"gammas": ema.gammas}):  # the fix, as printed
            fixed = PostHocEMA(bn_net(), checkpoint_folder=tmp_path / "c", **fix, **kw)
            fixed.load_state_dict(state)
            assert int(fixed.step) == 3
    theirs = dict(state)  # no recorded gammas (ema-pytorch's): the profile count tells
    with pytest.raises(EMAStateError, match=r"holds 2 profile\(s\).*has 1: sigma_rels=\(0\.05,\)"):
        loader.load_state_dict(theirs)
    karras = KarrasEMA(linear(), sigma_rel=0.05, update_every=1)
    karras.update()
    with pytest.raises(EMAStateError, match=r"sigma_rel=0\.05 or gamma=16\.97"):
        KarrasEMA(linear(), sigma_rel=0.1, update_every=1).load_state_dict(karras.state_dict())


def test_posthoc_loads_an_ema_pytorch_state(tmp_path: Path):
    ema_pytorch = pytest.importorskip("ema_pytorch")
    net = bn_net()
    theirs = ema_pytorch.PostHocEMA(
        net,
        sigma_rels=(0.05, 0.28),
        checkpoint_every_num_steps="manual",
        checkpoint_folder=tmp_path / "theirs",
    )
    train(net, [theirs], 12, **bn_sgd(net))
    ours = PostHocEMA(
        net,
        sigma_rels=(0.05, 0.28),
        checkpoint_every_num_steps="manual",
        checkpoint_folder=tmp_path / "ours",
    )
    ours.load_state_dict(theirs.state_dict())
    assert int(ours.step) == 12
    for a, b in zip(ours.ema_models, theirs.ema_models, strict=True):
        assert torch.equal(a.ema_model[0].weight, b.ema_model[0].weight)


# -- synthesis ------------------------------------------------------------------------------


@pytest.mark.parametrize("every", [1, 10])
def test_reconstructing_a_tracked_profile_returns_it(runs: dict, every: int):
    ema, _ = runs[every]
    for index, sigma_rel in enumerate((0.05, 0.28)):
        synth = ema.synthesize_ema_model(sigma_rel=sigma_rel)
        tracked = ema.ema_models[index].ema_model.weight
        assert torch.allclose(synth.ema_model.weight, tracked, rtol=0, atol=1e-6)


@pytest.mark.parametrize("every", [1, 10])
@pytest.mark.parametrize("sigma_rel", [0.10, 0.15])
def test_untracked_sigma_rel_matches_float64_power_ema(
    runs: dict, theta: torch.Tensor, every: int, sigma_rel: float
):
    ema, _ = runs[every]
    truth = power_ema(theta, gamma_of(sigma_rel), T)
    synth = ema.synthesize_ema_model(sigma_rel=sigma_rel)
    assert isinstance(synth, KarrasEMA) and int(synth.step) == T
    err = rel_err(synth.ema_model.weight, truth)
    assert rel_err(theta[-1], truth) > 0.15  # the raw weights are far from the EMA ...
    assert err < (5e-4 if every == 1 else 4e-3)  # ... the reconstruction is not


def test_ema_pytorch_posthoc_is_worse_with_update_every_10(
    theta: torch.Tensor, runs: dict, tmp_path: Path
):
    """Differential: ema-pytorch 0.8.3's reconstruction is further from the truth than the
    raw weights with update_every=10 (its beta ignores the gap; weights not normalized)."""
    ema_pytorch = pytest.importorskip("ema_pytorch")
    truth = power_ema(theta, gamma_of(0.15), T)
    net = linear()
    theirs = ema_pytorch.PostHocEMA(
        net,
        sigma_rels=(0.05, 0.28),
        update_every=10,
        checkpoint_every_num_steps=EVERY,
        checkpoint_folder=tmp_path,
        checkpoint_dtype=torch.float32,
    )
    drive(theirs, theta, net)
    their_err = rel_err(theirs.synthesize_ema_model(sigma_rel=0.15).ema_model.weight, truth)
    our_err = rel_err(runs[10][0].synthesize_ema_model(sigma_rel=0.15).ema_model.weight, truth)
    raw_err = rel_err(theta[-1], truth)
    assert our_err < 4e-3
    assert their_err > raw_err > 100 * our_err


def test_synthesis_uses_only_snapshots_at_or_before_the_step(
    runs: dict, theta: torch.Tensor, tmp_path: Path
):
    ema, folder = runs[10]
    step = 2000
    plan = plan_synthesis(folder, sigma_rel=0.15, step=step)
    assert max(s.step for s in plan.snapshots) == step
    assert sum(plan.weights) == pytest.approx(1.0, abs=1e-12)
    synth = ema.synthesize_ema_model(sigma_rel=0.15, step=step)
    assert int(synth.step) == step
    assert rel_err(synth.ema_model.weight, power_ema(theta, gamma_of(0.15), step)) < 4e-3
    # Later snapshots do not matter: without them the result is the same.
    import shutil

    early = tmp_path / "early"
    early.mkdir()
    for s in list_snapshots(folder):
        if s.step <= step:
            shutil.copy(s.path, early / s.path.name)
    alone = synthesize_state_dict(early, sigma_rel=0.15)
    assert torch.equal(alone["weight"], synth.ema_model.weight)


def test_synthesis_streams_one_snapshot_at_a_time(runs: dict, monkeypatch: pytest.MonkeyPatch):
    _, folder = runs[10]
    real = reading_module.SafetensorsFile
    state = {"open": 0, "max": 0, "files": 0}

    class Counting:
        def __init__(self, *args, **kwargs):
            self._inner = real(*args, **kwargs)

        def __enter__(self):
            state["open"] += 1
            state["files"] += 1
            state["max"] = max(state["max"], state["open"])
            return self._inner.__enter__()

        def __exit__(self, *exc):
            state["open"] -= 1
            return self._inner.__exit__(*exc)

    monkeypatch.setattr(reading_module, "SafetensorsFile", Counting)
    plan = plan_synthesis(folder, sigma_rel=0.15)
    state.update(files=0, max=0)
    plan.run()
    assert state["max"] == 1
    assert state["files"] == len(plan.snapshots) + 1  # + the buffer source


def test_buffers_come_from_the_latest_snapshot(tmp_path: Path):
    net = bn_net()
    ema = PostHocEMA(
        net,
        update_every=2,
        checkpoint_every_num_steps=10,
        checkpoint_folder=tmp_path,
        checkpoint_dtype=torch.float32,
    )
    train(net, [ema], 30, **bn_sgd(net))
    with pytest.warns(PostHocWarning, match="last usable snapshot is at step 20"):
        plan = plan_synthesis(tmp_path, sigma_rel=0.1, step=25)
    assert plan.buffers_from.step == 20 and plan.buffers_from.sigma_rel == 0.05  # closest gamma
    from safetensors.torch import load_file

    source = load_file(str(plan.buffers_from.path))
    out = plan.run()
    for name in ("1.running_mean", "1.running_var", "1.num_batches_tracked", "counter"):
        assert torch.equal(out[name], source[name])
    assert not torch.equal(out["0.weight"], source["0.weight"])


def test_synthesis_returns_a_usable_karras_ema(runs: dict):
    ema, _ = runs[10]
    synth = ema.synthesize_ema_model(sigma_rel=0.15)
    assert synth.gamma == pytest.approx(sigma_rel_to_gamma(0.15))
    assert synth.ema_model is not ema.ema_models[0].ema_model
    out = synth(torch.ones(1, 8))
    assert out.shape == (1, 8) and not out.requires_grad
    by_gamma = ema.synthesize_ema_model(gamma=sigma_rel_to_gamma(0.15))
    assert torch.equal(by_gamma.ema_model.weight, synth.ema_model.weight)


def test_synthesize_ema_model_takes_gamma_first_like_ema_pytorch(runs: dict):
    """ema-pytorch's order is (gamma, sigma_rel, step): a positional 7.0 is gamma=7.0."""
    ema, _ = runs[10]
    positional = ema.synthesize_ema_model(7.0)
    assert positional.gamma == 7.0
    by_keyword = ema.synthesize_ema_model(gamma=7.0)
    assert torch.equal(positional.ema_model.weight, by_keyword.ema_model.weight)
    at_step = ema.synthesize_ema_model(7.0, None, 2000)
    assert int(at_step.step) == 2000
    assert torch.equal(
        at_step.ema_model.weight, ema.synthesize_ema_model(gamma=7.0, step=2000).ema_model.weight
    )


# -- bad input ------------------------------------------------------------------------------


def test_synthesis_errors_are_clear(tmp_path: Path, runs: dict):
    net = bn_net()
    empty = PostHocEMA(net, checkpoint_every_num_steps="manual", checkpoint_folder=tmp_path / "e")
    with pytest.raises(EMAValueError, match="no post-hoc EMA snapshots"):
        empty.synthesize_ema_model(sigma_rel=0.1)
    with pytest.raises(EMAFileNotFoundError, match="does not exist"):
        synthesize_state_dict(tmp_path / "missing", sigma_rel=0.1)
    ema, _ = runs[10]
    with pytest.raises(EMAValueError, match=r"step=100 is before the first snapshot \(step 200\)"):
        ema.synthesize_ema_model(sigma_rel=0.1, step=100)
    with pytest.raises(EMAValueError, match="sigma_rel must be a finite number in"):
        ema.synthesize_ema_model(sigma_rel=float("nan"))
    with pytest.raises(EMAValueError, match="sigma_rel must be a finite number in"):
        ema.synthesize_ema_model(sigma_rel=0.5)
    with pytest.raises(EMAValueError, match="exactly one"):
        ema.synthesize_ema_model()
    with pytest.raises(EMATypeError, match="step"):
        ema.synthesize_ema_model(sigma_rel=0.1, step=1.5)  # type: ignore[arg-type]
    with pytest.raises(EMAValueError, match="step must be >= 1"):
        ema.synthesize_ema_model(sigma_rel=0.1, step=0)


def test_posthoc_constructor_errors(tmp_path: Path):
    net = bn_net()
    kw = {"checkpoint_folder": tmp_path}
    with pytest.raises(EMAValueError, match="not both"):
        PostHocEMA(net, sigma_rels=(0.05,), gammas=(5.0,), **kw)
    with pytest.raises(EMAValueError, match="distinct"):
        PostHocEMA(net, sigma_rels=(0.05, 0.05), **kw)
    with pytest.raises(EMAValueError, match="at least one"):
        PostHocEMA(net, sigma_rels=(), **kw)
    with pytest.raises(EMATypeError, match="tuple of numbers"):
        PostHocEMA(net, sigma_rels="0.05", **kw)  # type: ignore[arg-type]
    with pytest.raises(EMAValueError, match="checkpoint_every_num_steps"):
        PostHocEMA(net, checkpoint_every_num_steps=0, **kw)
    with pytest.raises(EMATypeError, match="checkpoint_dtype"):
        PostHocEMA(net, checkpoint_dtype=torch.int8, **kw)
    with pytest.raises(EMATypeError, match="unknown keyword"):
        PostHocEMA(net, beta=0.99, **kw)
    with pytest.raises(EMATypeError, match="model"):
        PostHocEMA(torch.zeros(3), **kw)  # type: ignore[arg-type]
    with pytest.raises(EMARuntimeError, match="update"):
        PostHocEMA(net, checkpoint_every_num_steps="manual", **kw).checkpoint()


def test_snapshot_dtype_overflow_warns(tmp_path: Path):
    net = linear()
    with torch.no_grad():
        net.weight.fill_(1e6)
    ema = PostHocEMA(net, checkpoint_every_num_steps="manual", checkpoint_folder=tmp_path)
    ema.update()
    with pytest.warns(PostHocWarning, match="overflow"):
        ema.checkpoint()


def test_synthesis_from_overflowed_float16_snapshots_raises_naming_them(tmp_path: Path):
    net = float16_overflow_linear()
    ema = PostHocEMA(
        net, sigma_rels=(0.05, 0.28), checkpoint_every_num_steps=2, checkpoint_folder=tmp_path
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the snapshot-time warning about float16
        for _ in range(6):
            ema.update()
        with pytest.raises(EMAStateError, match=r"not finite.*'weight'.*step-"):
            ema.synthesize_ema_model(sigma_rel=0.1)


def test_snapshot_from_a_newer_emakit_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    net = linear()
    ema = PostHocEMA(net, checkpoint_every_num_steps="manual", checkpoint_folder=tmp_path)
    ema.update()
    ema.checkpoint()  # format_version 1
    monkeypatch.setattr(snapshots_module, "SNAPSHOT_FORMAT_VERSION", 0)  # an older reader
    with pytest.raises(EMAStateError, match="upgrade emakit"):
        list_snapshots(tmp_path)


def test_poor_reconstruction_warns(runs: dict):
    _, folder = runs[10]
    assert synthesis_module.RESIDUAL_WARN == 0.1
    with pytest.warns(PostHocWarning, match="only roughly"):
        plan_synthesis(folder, sigma_rel=0.01)  # far shorter than the tracked 0.05
    with pytest.raises(EMAValueError, match="after the last snapshot"):  # issue 30, item 20
        plan_synthesis(folder, sigma_rel=0.2, step=5000)  # 1000 steps after the last snapshot


def test_snapshots_of_another_model_are_refused(tmp_path: Path):
    net = bn_net()
    ema = PostHocEMA(net, update_every=1, checkpoint_every_num_steps=5, checkpoint_folder=tmp_path)
    train(net, [ema], 10, **bn_sgd(net))
    ema.release_folder()  # a later run of the same id (a resume) writes another model
    other = PostHocEMA(
        linear(),
        gammas=(3.0,),
        checkpoint_every_num_steps="manual",
        checkpoint_folder=tmp_path,
        run_id=ema.run_id,
    )
    other.update()
    with pytest.warns(PostHocWarning, match="before a resume"):
        other.checkpoint()  # step 1: a different model in the same folder
    with pytest.raises(EMAStateError, match="does not hold the same tensors"):
        ema.synthesize_ema_model(sigma_rel=0.05)


def test_gammas_and_frozen_profiles(tmp_path: Path):
    net = linear()
    ema = PostHocEMA(
        net,
        gammas=(16.97, 6.94),
        update_every=1,
        frozen=True,
        checkpoint_every_num_steps="manual",
        checkpoint_folder=tmp_path,
    )
    assert ema.sigma_rels == pytest.approx((0.05, 0.1), abs=1e-4)
    ema.update()
    start = ema.profiles[0].ema_model.weight.clone()
    with torch.no_grad():
        net.weight.add_(1.0)
    for _ in range(3):
        ema.update()
    assert torch.equal(ema.profiles[0].ema_model.weight, start)  # frozen after the first copy


def test_snapshots_of_another_model_are_refused_by_name_and_by_shape(tmp_path: Path):
    """A model held whole is filled as a sharded one is, by regions checked against the
    snapshots first: other names or other shapes raise before any tensor is summed."""
    kw = {"update_every": 1, "checkpoint_every_num_steps": 2, "run_id": "one"}
    ema = PostHocEMA(nn.Linear(3, 3), checkpoint_folder=tmp_path, **kw)
    for _ in range(4):
        ema.update()
    ema.release_folder()
    for other, why in ((nn.Linear(3, 4), "has shape"), (nn.Sequential(nn.Linear(3, 3)), "lacks")):
        reader = PostHocEMA(other, checkpoint_folder=tmp_path, **kw)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PostHocWarning)
            with pytest.raises(EMAStateError, match=why) as e:
                reader.synthesize_ema_model(sigma_rel=0.1)
        assert "do not match the model" in str(e.value)

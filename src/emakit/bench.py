"""``emakit bench``: the cost of one EMA update on your machine, path by path.

Times one averaging ``update()`` of each engine path (reference loop, foreach, the
default flat path, and the flat path after [`flatten_parameters()`][emakit.flatten_parameters]) on a
standard model, and compares each with the memory-bandwidth floor: a single ``lerp_``
over one flat tensor holding as many elements. A ratio near 1 means the update costs no
more than streaming the weights through memory once.

How it times, so that a busy machine shows up as a warning instead of as nonsense:

* torch runs on one CPU thread by default: on a shared machine a second OpenMP thread is
  often scheduled late, which turns a 0.2 ms ``lerp_`` into 10 ms at random.
* The contenders are timed side by side, round-robin: every round times one batch of
  back-to-back calls (about ``sample_ms`` long) of each path in turn, in the listed order
  on even rounds and in reverse on odd ones (who runs after whom changes cache warmth).
  A disturbance then hits all paths alike instead of one path's whole measurement.
* Each row reports the median over the rounds and the spread (interquartile range over
  the median). Warnings name a busy machine (load average above the idle cores, or wall
  time well above this thread's CPU time), a wide spread, or a path that looks faster
  than the floor (which only a disturbed floor measurement can cause).

Example:
    >>> result = bench_update("mlp", repeats=3)  # doctest: +SKIP
    >>> result.rows[0].path
    'floor: one lerp_ over a flat tensor'
"""

from __future__ import annotations

import copy
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from . import _validate as check
from ._engine.flat import flatten_parameters
from .ema import EMA
from .errors import EMAValueError

__all__ = ["MODELS", "BenchResult", "BenchRow", "bench_update", "build_model"]

FLOOR = "floor: one lerp_ over a flat tensor"
#: Interquartile range over the median above which a row's timing is called noisy.
WIDE_SPREAD = 0.25
#: Median wall time over this thread's CPU time above which the thread was kept waiting.
WAIT_RATIO = 1.25


def _tiny() -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64)) for _ in range(300)])


def _transformer() -> nn.Module:
    layer = nn.TransformerEncoderLayer(384, 6, 1536, batch_first=True)
    return nn.TransformerEncoder(layer, 12, enable_nested_tensor=False)


def _mlp() -> nn.Module:
    return nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(6)])


def _resnet() -> nn.Module:
    try:
        import torchvision
    except ImportError as e:
        raise EMAValueError("--model resnet needs torchvision: pip install torchvision") from e
    return torchvision.models.resnet50()


#: The benchmark models: name -> (description, factory).
MODELS: dict[str, tuple[str, Callable[[], nn.Module]]] = {
    "tiny": ("300 x (Linear(64, 64) + LayerNorm(64)): 1200 tiny tensors", _tiny),
    "transformer": ("TransformerEncoder 12 x (384, 6 heads, 1536): 144 tensors, 21M", _transformer),
    "mlp": ("6 x Linear(2048, 2048): 12 tensors, 25M", _mlp),
    "resnet": ("torchvision ResNet-50: 320 tensors, 25.6M (BatchNorm buffers)", _resnet),
}


def build_model(name: str, device: str | torch.device = "cpu") -> nn.Module:
    """One of `MODELS` on ``device`` (seeded, so runs compare).

    Args:
        name: a key of `MODELS`.
        device: where to build it. Default ``"cpu"``.

    Returns:
        The model.

    Raises:
        EMAValueError: an unknown name.
    """
    if name not in MODELS:
        raise EMAValueError(f"model must be one of {sorted(MODELS)}, got {name=!r}")
    torch.manual_seed(0)
    return MODELS[name][1]().to(device)


@dataclass(frozen=True)
class BenchRow:
    """One path's timing: seconds per call over the rounds.

    Attributes:
        path: what was timed.
        median_s: median seconds per call.
        q1_s: first quartile (the same as the median with fewer than 2 rounds).
        q3_s: third quartile.
        cpu_median_s: median CPU seconds of the timing thread per call.
        ratio: ``median_s`` over the floor's ``median_s``.
    """

    path: str
    median_s: float
    q1_s: float
    q3_s: float
    cpu_median_s: float
    ratio: float

    @property
    def spread(self) -> float:
        """Interquartile range over the median (0.1 = the middle half within 10%)."""
        return (self.q3_s - self.q1_s) / self.median_s if self.median_s > 0 else 0.0


@dataclass(frozen=True)
class BenchResult:
    """What `bench_update()` measured, and what to distrust in it.

    Attributes:
        model: the key of `MODELS`.
        device: ``"cpu"`` or ``"cuda"``.
        threads: torch's CPU threads during the timing.
        repeats: rounds (samples per path).
        rows: the floor first, then each path.
        load_average: the 1-minute load average before timing (None where the OS has none).
        cpus: CPU cores the OS reports.
        warnings: why the numbers may be unreliable; empty when nothing was noticed.
    """

    model: str
    device: str
    threads: int
    repeats: int
    rows: tuple[BenchRow, ...]
    load_average: float | None
    cpus: int
    warnings: tuple[str, ...] = ()


def _time_side_by_side(
    fns: dict[str, Callable[[], object]],
    device: torch.device,
    repeats: int,
    sample_s: float,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, tuple[list[float], list[float]]]:
    """Per-call (wall, thread CPU) seconds per round, contenders interleaved round-robin;
    ``progress(done, repeats)`` after each round."""

    def batch_seconds(fn: Callable[[], object], calls: int) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.thread_time()
        for _ in range(calls):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - wall) / calls, (time.thread_time() - cpu) / calls

    batches = {}
    for name, fn in fns.items():
        batch_seconds(fn, 1)  # warm-up: first-call allocations, plan building
        once = min(batch_seconds(fn, 1)[0] for _ in range(3))
        batches[name] = max(1, math.ceil(sample_s / max(once, 1e-7)))
    samples: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in fns}
    order = list(fns.items())
    for r in range(repeats):
        for name, fn in order if r % 2 == 0 else order[::-1]:
            wall, cpu = batch_seconds(fn, batches[name])
            samples[name][0].append(wall)
            samples[name][1].append(cpu)
        if progress is not None:
            progress(r + 1, repeats)  # between rounds: never inside a timed batch
    return samples


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # not on every OS
        return None


def _diagnose(
    rows: list[BenchRow], load: float | None, cpus: int, threads: int, cpu_clock: bool
) -> list[str]:
    notes = []
    if load is not None and load > max(cpus - threads, 0) + 0.5:
        notes.append(
            f"the machine is busy: load average {load:.2f} on {cpus} CPU cores, and the bench "
            f"wants {threads} of them idle; other processes' work lands in these timings"
        )
    floor = rows[0]
    if cpu_clock:
        waited = [
            r for r in rows if r.cpu_median_s > 0 and r.median_s / r.cpu_median_s > WAIT_RATIO
        ]
        if waited:
            worst = max(waited, key=lambda r: r.median_s / r.cpu_median_s)
            notes.append(
                f"the timing thread was kept waiting: '{worst.path}' took "
                f"{worst.median_s / worst.cpu_median_s:.1f}x more wall time than CPU time "
                f"(other processes held the cores)"
            )
    wide = [r for r in rows if r.spread > WIDE_SPREAD]
    if wide:
        shown = ", ".join(f"'{r.path}' {r.spread:.0%}" for r in wide[:3])
        notes.append(
            f"wide spread (interquartile range over median above {WIDE_SPREAD:.0%}): {shown}; "
            f"rerun on an idle machine or with more --repeats"
        )
    faster = [r for r in rows[1:] if r.median_s < 0.9 * floor.median_s]
    if faster:
        notes.append(
            f"{len(faster)} path(s) look faster than the floor, which only a disturbed floor "
            f"measurement can cause: do not trust these ratios"
        )
    return notes


def bench_update(
    model: str = "tiny",
    device: str = "cpu",
    repeats: int = 20,
    *,
    threads: int | None = 1,
    sample_ms: float = 10.0,
    progress: Callable[[int, int], None] | None = None,
) -> BenchResult:
    """Seconds per averaging update of each path, side by side, with the ratio to the floor.

    Args:
        model: a key of `MODELS`. Default ``"tiny"``.
        device: ``"cpu"`` or ``"cuda"``. Default ``"cpu"``.
        repeats: rounds; each times one batch of calls of every path. Default 20.
        threads: torch CPU threads during the timing (restored afterwards); None keeps
            torch's setting. Default 1: steady numbers on a shared machine.
        sample_ms: length of one batch of back-to-back calls, in milliseconds (at least
            one call). Default 10.
        progress: called as ``progress(done, repeats)`` after each round (between timed
            batches, so it never lands inside one); ``emakit bench`` draws its bar with it.
            Default None.

    Returns:
        A `BenchResult`: the floor and the four paths (median, quartiles, ratio to
        the floor) and the warnings, if any.

    Raises:
        EMAValueError: an unknown model or device, no CUDA device, ``repeats < 1``,
            ``threads < 1`` or a non-positive ``sample_ms``.
        EMATypeError: ``repeats``, ``threads`` or ``sample_ms`` is not a number.
    """
    if device not in ("cpu", "cuda"):
        raise EMAValueError(f"device must be 'cpu' or 'cuda', got {device=!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise EMAValueError("device='cuda' was asked for but torch sees no CUDA device")
    check.integer("repeats", repeats, low=1)
    if threads is not None:
        check.integer("threads", threads, low=1)
    check.real("sample_ms", sample_ms, low=0.0, low_open=True)
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        used_threads = torch.get_num_threads()
        load = _load_average()
        dev = torch.device(device)
        net = build_model(model, dev)
        numel = sum(t.numel() for t in (*net.parameters(), *net.buffers()) if t.is_floating_point())
        a = torch.randn(numel, device=dev)
        b = torch.randn(numel, device=dev)
        flat_net = copy.deepcopy(net)
        flatten_parameters(flat_net)
        fns: dict[str, Callable[[], object]] = {FLOOR: lambda: a.lerp_(b, 1e-3)}
        paths = {
            "loop (use_foreach=False)": (net, False),
            "foreach (use_foreach=True)": (net, True),
            "default (use_foreach=None)": (net, None),
            "default after flatten_parameters": (flat_net, None),
        }
        for label, (m, use_foreach) in paths.items():
            ema = EMA(m, beta=0.999, update_after_step=0, update_every=1, use_foreach=use_foreach)
            ema.update()  # the first call copies; every timed call averages
            fns[label] = ema.update
        with torch.no_grad():
            samples = _time_side_by_side(fns, dev, repeats, sample_ms / 1e3, progress)
    finally:
        torch.set_num_threads(old_threads)
    floor = statistics.median(samples[FLOOR][0])
    rows = []
    for label, (wall, cpu) in samples.items():
        # quantiles() needs two samples: one round's quartiles are that round's time
        twice = wall if len(wall) > 1 else wall * 2
        q1, median, q3 = statistics.quantiles(twice, n=4, method="inclusive")
        rows.append(BenchRow(label, median, q1, q3, statistics.median(cpu), median / floor))
    cpus = os.cpu_count() or 1
    notes = _diagnose(rows, load, cpus, used_threads, device == "cpu" and used_threads == 1)
    return BenchResult(model, device, used_threads, repeats, tuple(rows), load, cpus, tuple(notes))

"""Update cost and memory of an EMA of model weights: emakit's paths against its peers, on CPU.

Usage::

    python benchmarks/bench_update.py [--quick] [--json OUT] [--threads N] [--before DIR]

``--before DIR`` also times an older emakit, loaded from its package directory (for
example a ``git worktree`` of an earlier commit: ``--before /tmp/emakit-before/src/emakit``)
as a second top-level package ``emakit_before``, side by side with the current one.

What is timed, for each of three models:

* one averaging ``update()`` (``update_after_step=0, update_every=1``, after warm-up, so
  every timed call really runs ``lerp``) for emakit (``use_foreach=False``, ``True``,
  ``None`` = the default, and the default on a copy of the model re-homed by
  ``flatten_parameters``), ema-pytorch 0.8.3 (loop and ``use_foreach=True``), timm
  ``ModelEmaV3``, torch ``AveragedModel`` with ``get_ema_multi_avg_fn`` and torch_ema
  ``ExponentialMovingAverage``;
* bare ``torch._foreach_lerp_(shadows, onlines, 1 - beta)`` over the model's own tensors
  (separate shadow copies of its parameters, lists built once): what the default path
  costs at best without flattening;
* the floor: one ``lerp_`` over a flat float32 tensor with as many elements as the model;
* with ``--before``: the older emakit's default path, and its default path after its own
  ``flatten_parameters``.

The contenders of one model are timed side by side in one process, round-robin over
several repeats (each sample is a batch of back-to-back calls lasting ~20 ms, at least one
call). Each sample records the wall clock and this thread's CPU time (``time.thread_time``:
with torch single-threaded it is what the calls cost even while other processes compete
for the cores); the tables show the median (and the wall minimum) per call and the ratios
to the floor by each measure.

Also timed with the contenders: the default path with ``skip_nonfinite=True`` (and, with
``--before``, the older emakit's). Then the host time of one averaging ``update()`` with
the kernels stubbed out, against the number of modules (``N x Linear(4, 4)``, N = 20 to
2,000; see :func:`bench_host`).

Also measured: the cost of a *skipped* call (``update_every=10``, a call that does
nothing; with ``--before`` for the older emakit too), and peak memory (process RSS
high-water mark, ``VmHWM`` in ``/proc/self/status``, reset through
``/proc/self/clear_refs`` and read in a fresh subprocess per contender) of creating an EMA
of the transformer and of ``swap()``.

Torch runs single-threaded by default (``--threads``), because on small shared VMs the
second OpenMP thread of an element-wise kernel is often scheduled late, which turns a
0.2 ms ``lerp_`` into 8 ms at random and drowns every ratio in noise.

At the end a "targets" table checks the redesign's targets by both medians (wall, CPU):
(a) the default path costs at most 1.05x the bare ``_foreach_lerp_``; (b) a skipped call
costs at most 1 µs; (c) after ``flatten_parameters`` the default path costs at most 1.25x
the floor.

This file is a script, not part of the test suite; it asserts nothing about timings.
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib.util
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

import emakit
from emakit import EMA, flatten_parameters
from peers import allow_timm

BETA = 0.999
FLOOR = "floor: one lerp_ over a flat tensor"
BARE_FOREACH = "bare torch._foreach_lerp_ over the model's tensors"
EMAKIT_DEFAULT = "emakit default (use_foreach=None)"
EMAKIT_FLAT = "emakit default, after flatten_parameters"
BEFORE_DEFAULT = "emakit before: default (use_foreach=None)"
BEFORE_FLAT = "emakit before: default, after flatten_parameters"
EMAKIT_NONFINITE = "emakit default, skip_nonfinite=True"
BEFORE_NONFINITE = "emakit before: default, skip_nonfinite=True"
HOST_MODULES = (20, 200, 1000, 2000)
EMAPT_FOREACH = "ema-pytorch 0.8.3 use_foreach=True"
CLOCKS = ("median_us", "min_us", "cpu_median_us")
# The redesign's targets: (a) default / bare foreach, (b) skipped call in µs,
# (c) default after flatten_parameters / floor.
TARGET_DEFAULT_OVER_BARE = 1.05
TARGET_SKIPPED_US = 1.0
TARGET_FLAT_OVER_FLOOR = 1.25
SKIPPED_MODELS = ("1200-tensor model", "Linear(4, 4)")

# -- models ----------------------------------------------------------------------------


def tiny_1200() -> nn.Module:
    """300 x (Linear(64, 64) + LayerNorm(64)): 1200 tiny tensors."""
    return nn.Sequential(*[m for _ in range(300) for m in (nn.Linear(64, 64), nn.LayerNorm(64))])


def transformer() -> nn.Module:
    """A 12-layer encoder, d=384: 144 tensors, about 21M parameters."""
    layer = nn.TransformerEncoderLayer(384, 6, 1536, batch_first=True)
    return nn.TransformerEncoder(layer, 12, enable_nested_tensor=False)


def linear_2048() -> nn.Module:
    """6 x Linear(2048, 2048): 12 tensors, about 25M parameters."""
    return nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(6)])


MODELS: dict[str, Callable[[], nn.Module]] = {
    "1200 tiny tensors (300 x Linear(64,64)+LayerNorm(64))": tiny_1200,
    "TransformerEncoder 12 x d384 (144 tensors)": transformer,
    "6 x Linear(2048, 2048) (12 tensors)": linear_2048,
}


def describe(model: nn.Module) -> tuple[int, int]:
    """(number of parameter tensors, number of elements)."""
    params = list(model.parameters())
    return len(params), sum(p.numel() for p in params)


# -- contenders: each builds an EMA of the model and returns its update() ----------------


def c_emakit(use_foreach: bool | None) -> Callable[[nn.Module], Callable[[], None]]:
    def make(model: nn.Module) -> Callable[[], None]:
        ema = EMA(model, beta=BETA, update_after_step=0, update_every=1, use_foreach=use_foreach)
        return ema.update

    return make


def c_emakit_nonfinite(model: nn.Module) -> Callable[[], None]:
    ema = EMA(model, beta=BETA, update_after_step=0, update_every=1, skip_nonfinite=True)
    return ema.update


def c_emakit_flat(model: nn.Module) -> Callable[[], None]:
    flat_model = copy.deepcopy(model)
    flatten_parameters(flat_model)
    ema = EMA(flat_model, beta=BETA, update_after_step=0, update_every=1)
    return ema.update


def c_before(
    pkg: ModuleType, *, flat: bool, skip_nonfinite: bool = False
) -> Callable[[nn.Module], Callable[[], None]]:
    """The older emakit's default path (``--before``), optionally after its own flattening
    or with ``skip_nonfinite=True``."""

    def make(model: nn.Module) -> Callable[[], None]:
        if flat:
            model = copy.deepcopy(model)
            pkg.flatten_parameters(model)
        kw = {"skip_nonfinite": True} if skip_nonfinite else {}
        ema = pkg.EMA(model, beta=BETA, update_after_step=0, update_every=1, **kw)
        return ema.update

    return make


def c_ema_pytorch(use_foreach: bool) -> Callable[[nn.Module], Callable[[], None]]:
    def make(model: nn.Module) -> Callable[[], None]:
        import ema_pytorch

        ema = ema_pytorch.EMA(
            model,
            beta=BETA,
            update_after_step=0,
            update_every=1,
            use_foreach=use_foreach,
            include_online_model=False,
        )
        return ema.update

    return make


def c_timm(model: nn.Module) -> Callable[[], None]:
    allow_timm()
    from timm.utils.model_ema import ModelEmaV3

    ema = ModelEmaV3(model, decay=BETA)
    return lambda: ema.update(model)


def c_averaged_model(model: nn.Module) -> Callable[[], None]:
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(BETA))
    return lambda: ema.update_parameters(model)


def c_torch_ema(model: nn.Module) -> Callable[[], None]:
    from torch_ema import ExponentialMovingAverage

    ema = ExponentialMovingAverage(model.parameters(), decay=BETA, use_num_updates=False)
    return ema.update


def c_bare_foreach(model: nn.Module) -> Callable[[], None]:
    """``torch._foreach_lerp_`` over separate shadow copies of the model's parameters.

    The EMA also averages buffers; the benchmark models have none, so the parameters are
    exactly the tensors its default path averages.
    """
    if list(model.buffers()):
        raise SystemExit(
            f"{type(model).__name__} has buffers: the bare _foreach_lerp_ contender averages "
            "parameters only, so it would not cover the same tensors as the EMA"
        )
    shadows = [p.detach().clone() for p in model.parameters()]
    onlines = [p.detach() for p in model.parameters()]
    weight = 1.0 - BETA
    return lambda: torch._foreach_lerp_(shadows, onlines, weight)


def c_floor(model: nn.Module) -> Callable[[], None]:
    n = describe(model)[1]
    shadow, online = torch.randn(n), torch.randn(n)
    return lambda: shadow.lerp_(online, 1.0 - BETA)


CONTENDERS: dict[str, Callable[[nn.Module], Callable[[], None]]] = {
    "emakit use_foreach=False (reference loop)": c_emakit(False),
    "emakit use_foreach=True": c_emakit(True),
    EMAKIT_DEFAULT: c_emakit(None),
    EMAKIT_FLAT: c_emakit_flat,
    EMAKIT_NONFINITE: c_emakit_nonfinite,
    "ema-pytorch 0.8.3 loop": c_ema_pytorch(False),
    EMAPT_FOREACH: c_ema_pytorch(True),
    "timm ModelEmaV3": c_timm,
    "torch AveragedModel + get_ema_multi_avg_fn": c_averaged_model,
    "torch_ema ExponentialMovingAverage": c_torch_ema,
    BARE_FOREACH: c_bare_foreach,
    FLOOR: c_floor,
}


def contenders(before: ModuleType | None) -> dict[str, Callable[[nn.Module], Callable[[], None]]]:
    """CONTENDERS, plus the older emakit's two default paths next to the current ones."""
    if before is None:
        return dict(CONTENDERS)
    out = {}
    for name, make in CONTENDERS.items():
        out[name] = make
        if name == EMAKIT_FLAT:
            out[BEFORE_DEFAULT] = c_before(before, flat=False)
            out[BEFORE_FLAT] = c_before(before, flat=True)
        if name == EMAKIT_NONFINITE:
            out[BEFORE_NONFINITE] = c_before(before, flat=False, skip_nonfinite=True)
    return out


def load_before(directory: str) -> ModuleType:
    """Import the emakit package in ``directory`` as a second top-level package.

    It is registered as ``emakit_before``; emakit imports itself only relatively, so its
    submodules load as ``emakit_before.*`` from that directory, apart from the current
    ``emakit``.
    """
    pkg_dir = Path(directory).resolve()
    init = pkg_dir / "__init__.py"
    if not init.is_file():
        raise SystemExit(f"--before {directory}: no __init__.py there (want .../src/emakit)")
    if pkg_dir == Path(emakit.__file__).resolve().parent:
        raise SystemExit(f"--before {directory} is the emakit being benchmarked")
    spec = importlib.util.spec_from_file_location(
        "emakit_before", init, submodule_search_locations=[str(pkg_dir)]
    )
    if spec is None or spec.loader is None:
        raise SystemExit(f"--before {directory}: cannot load {init}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["emakit_before"] = module
    spec.loader.exec_module(module)
    strays = [
        name
        for name, mod in sys.modules.items()
        if not name.startswith("emakit_before")
        and str(getattr(mod, "__file__", None) or "").startswith(str(pkg_dir) + os.sep)
    ]
    if strays:
        raise SystemExit(f"--before {directory}: loaded outside emakit_before: {strays}")
    return module


# -- timing ------------------------------------------------------------------------------


@dataclass
class Timing:
    """Per-call samples of one contender: wall clock and this thread's CPU time, in µs."""

    name: str
    batch: int
    wall_us: list[float] = field(default_factory=list)
    cpu_us: list[float] = field(default_factory=list)

    def add(self, wall_s: float, cpu_s: float, calls: int) -> None:
        self.wall_us.append(wall_s / calls * 1e6)
        self.cpu_us.append(cpu_s / calls * 1e6)

    def summary(self) -> dict[str, float]:
        return {
            "median_us": statistics.median(self.wall_us),
            "min_us": min(self.wall_us),
            "cpu_median_us": statistics.median(self.cpu_us),
            "samples": len(self.wall_us),
            "batch": self.batch,
        }


def _batch_seconds(fn: Callable[[], None], batch: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this thread) for ``batch`` back-to-back calls.

    With torch single-threaded all the work runs on this thread, so the CPU time is what
    the calls cost even while other processes compete for the cores; the wall time
    includes the waits.
    """
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(batch):
        fn()
    return time.perf_counter() - wall, time.thread_time() - cpu


def time_side_by_side(
    fns: dict[str, Callable[[], None]], *, repeats: int, sample_s: float, warmup: int
) -> dict[str, Timing]:
    """Round-robin timing: every repeat times one batch of each contender in turn, in the
    given order on even repeats and in reverse on odd ones. Contenders that read the same
    model warm the caches for whoever runs next (a few % on the 1200-tensor model), so a
    fixed order would favour some; alternating gives each both neighbours."""
    timings = {}
    for name, fn in fns.items():
        for _ in range(warmup):
            fn()
        once = min(_batch_seconds(fn, 1)[1] for _ in range(3))
        timings[name] = Timing(name, batch=max(1, math.ceil(sample_s / max(once, 1e-7))))
    order = list(fns.items())
    for r in range(repeats):
        for name, fn in order if r % 2 == 0 else order[::-1]:
            t = timings[name]
            t.add(*_batch_seconds(fn, t.batch), t.batch)
    return timings


def _ratio(stats: dict[str, dict[str, float]], num: str, den: str) -> dict[str, float]:
    return {clock: stats[num][clock] / stats[den][clock] for clock in CLOCKS}


def bench_update(args: argparse.Namespace, before: ModuleType | None) -> list[dict[str, Any]]:
    results = []
    for model_name, build in MODELS.items():
        torch.manual_seed(0)
        model = build()
        n_tensors, n_elems = describe(model)
        fns = {}
        for name, make in contenders(before).items():
            try:
                fns[name] = make(model)
            except ImportError as e:  # a peer library that is not installed (timm ...)
                print(f"  {name}: skipped ({e})")
        timings = time_side_by_side(
            fns, repeats=args.repeats, sample_s=args.sample_ms / 1e3, warmup=args.warmup
        )
        stats = {name: t.summary() for name, t in timings.items()}
        floor = stats[FLOOR]
        rows = [
            {
                "contender": name,
                **st,
                "x_floor": st["median_us"] / floor["median_us"],
                "x_floor_min": st["min_us"] / floor["min_us"],
                "x_floor_cpu": st["cpu_median_us"] / floor["cpu_median_us"],
            }
            for name, st in stats.items()
        ]
        res: dict[str, Any] = {
            "model": model_name,
            "tensors": n_tensors,
            "elements": n_elems,
            "rows": rows,
            "emapt_foreach_over_emakit_default": _ratio(stats, EMAPT_FOREACH, EMAKIT_DEFAULT),
            "emapt_foreach_over_emakit_flat": _ratio(stats, EMAPT_FOREACH, EMAKIT_FLAT),
            "default_over_bare_foreach": _ratio(stats, EMAKIT_DEFAULT, BARE_FOREACH),
            "flat_over_floor": _ratio(stats, EMAKIT_FLAT, FLOOR),
        }
        if before is not None:
            res["before_default_over_bare_foreach"] = _ratio(stats, BEFORE_DEFAULT, BARE_FOREACH)
            res["before_flat_over_floor"] = _ratio(stats, BEFORE_FLAT, FLOOR)
            res["after_over_before"] = {
                "default": _ratio(stats, EMAKIT_DEFAULT, BEFORE_DEFAULT),
                "flat": _ratio(stats, EMAKIT_FLAT, BEFORE_FLAT),
                "skip_nonfinite": _ratio(stats, EMAKIT_NONFINITE, BEFORE_NONFINITE),
            }
        results.append(res)
        del fns, timings, model
        gc.collect()
    return results


# -- skipped calls -----------------------------------------------------------------------


def calls(ema: Any) -> int:
    """The call count, read without side effects: emakit's ``ema.step`` is a tensor view
    that client writes go through (reading it makes the next call check it), so read the
    tracker's integer where there is one, as a training loop that never reads ``step``
    would leave it."""
    tracker = getattr(ema, "tracker", None)
    return int(tracker.step) if tracker is not None else int(ema.step)


def bench_skipped(args: argparse.Namespace, before: ModuleType | None) -> list[dict[str, Any]]:
    """Per-call cost of calls that do nothing (update_every=10, between averaging calls).

    Each sample times the 9 skipped calls that follow an averaging call; the averaging
    call itself runs untimed. Model: the 1200-tensor one (the cost must not depend on it).
    """
    import ema_pytorch

    torch.manual_seed(0)
    every = 10
    kw = {"beta": BETA, "update_after_step": 0, "update_every": every}
    wrappers = {}
    # After an averaging call over the 1200-tensor model (10 MB touched) the wrapper's
    # Python objects are out of the CPU caches, as they are after a training step; with
    # a one-layer model they stay warm. The skip does the same work in both cases.
    for label, model in zip(SKIPPED_MODELS, (tiny_1200(), nn.Linear(4, 4)), strict=True):
        wrappers[f"emakit EMA (default), {label}"] = EMA(model, **kw)
        if before is not None:
            wrappers[f"emakit before EMA (default), {label}"] = before.EMA(model, **kw)
        wrappers[f"ema-pytorch 0.8.3 EMA, {label}"] = ema_pytorch.EMA(
            model, include_online_model=False, **kw
        )
    timings = {name: Timing(name, batch=every - 1) for name in wrappers}
    noop = Timing("reference: an empty Python function call", batch=every - 1)

    def nothing() -> None:
        pass

    for ema in wrappers.values():
        for _ in range(3 * every):  # initialized, warmed up, averaged at least twice
            ema.update()
    for _ in range(max(20, args.repeats * 20)):
        for name, ema in wrappers.items():
            # Align so the next update_every - 1 calls are all skips: emakit averages when
            # the pre-increment step is a multiple of update_every, as ema-pytorch does.
            while calls(ema) % every != 1:
                ema.update()
            timings[name].add(*_batch_seconds(ema.update, every - 1), every - 1)
        noop.add(*_batch_seconds(nothing, every - 1), every - 1)
    return [{"contender": t.name, **t.summary()} for t in (*timings.values(), noop)]


# -- host time per update, kernels stubbed --------------------------------------------------


def bench_host(args: argparse.Namespace, before: ModuleType | None) -> list[dict[str, Any]]:
    """The host (Python) time of one averaging ``update()`` against the number of modules.

    Models: ``N x Linear(4, 4)`` for N in :data:`HOST_MODULES`, the default path. The
    kernels (``torch._foreach_lerp_``/``_foreach_copy_``) are replaced by no-ops while
    this runs, so what is timed is everything around them: on a GPU, the whole cost of
    the update for a many-tensor model. CPU time per call, emakit and (``--before``) the
    older emakit interleaved; the model does not change between calls.
    """
    from emakit._engine.paths import FOREACH  # it holds the kernels it was built with

    def noop(*args: Any, **kwargs: Any) -> None:
        return None

    kernels = ("copy_each", "lerp_same")
    saved = torch._foreach_lerp_, torch._foreach_copy_, [getattr(FOREACH, k) for k in kernels]
    rows = []
    try:
        torch._foreach_lerp_ = torch._foreach_copy_ = noop
        for k in kernels:
            object.__setattr__(FOREACH, k, noop)  # a frozen dataclass, patched for the run
        for n in HOST_MODULES:
            torch.manual_seed(0)
            model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(n)])
            fns = {"emakit": c_emakit(None)(model)}
            if before is not None:
                fns["emakit before"] = c_before(before, flat=False)(model)
            timings = time_side_by_side(
                fns, repeats=args.repeats, sample_s=args.sample_ms / 1e3, warmup=args.warmup
            )
            for name, t in timings.items():
                rows.append({"modules": n, "contender": name, **t.summary()})
    finally:
        torch._foreach_lerp_, torch._foreach_copy_ = saved[:2]
        for k, fn in zip(kernels, saved[2], strict=True):
            object.__setattr__(FOREACH, k, fn)
    return rows


# -- memory (each contender in a fresh subprocess) -----------------------------------------

MEMORY_CASES = {
    "create: emakit EMA": "create_emakit",
    "create: ema-pytorch 0.8.3 EMA (deepcopy)": "create_emapt",
    "create: timm ModelEmaV3 (deepcopy)": "create_timm",
    "create: torch AveragedModel (deepcopy)": "create_averaged",
    "create: torch_ema ExponentialMovingAverage": "create_torch_ema",
    "swap: emakit `with ema.swap():`": "swap_emakit",
    "swap: emakit, bf16 model with ema_dtype=float32 shadow": "swap_emakit_bf16",
    "swap by copy: clone model state, copy EMA in, load back (ema-pytorch pattern)": "swap_emapt",
}


def _vm_kib() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":")
                out[key] = int(value.split()[0])
    return out


def _reset_peak() -> None:
    # Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0).
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def memory_worker(case: str) -> dict[str, float]:
    """Run one memory case in this (fresh) process; return MiB deltas over the baseline."""
    # Import every peer library first: importing timm alone adds ~200 MiB of RSS, which
    # must not be charged to creating its EMA.
    import importlib

    for peer in ("ema_pytorch", "torch_ema", "timm.utils.model_ema", "torch.optim.swa_utils"):
        try:
            importlib.import_module(peer)
        except ImportError:
            if case == "create_timm" and peer.startswith("timm"):
                raise  # that case needs it (reported as its error)
    torch.manual_seed(0)
    model = transformer()
    if case == "swap_emakit_bf16":
        model = model.to(torch.bfloat16)
    model_mib = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**20
    keep: list[Any] = []
    if case.startswith("swap"):
        if case == "swap_emakit_bf16":
            ema = EMA(model, update_after_step=0, update_every=1, ema_dtype=torch.float32)
        elif case == "swap_emakit":
            ema = EMA(model, update_after_step=0, update_every=1)
        else:
            import ema_pytorch

            ema = ema_pytorch.EMA(
                model, update_after_step=0, update_every=1, include_online_model=False
            )
        ema.update()
        keep.append(ema)
    gc.collect()
    _reset_peak()
    base = _vm_kib()["VmRSS"]

    if case == "create_emakit":
        ema = EMA(model, update_after_step=0, update_every=1)
        ema.update()
        keep.append(ema)
    elif case == "create_emapt":
        import ema_pytorch

        ema = ema_pytorch.EMA(
            model, update_after_step=0, update_every=1, include_online_model=False
        )
        ema.update()
        keep.append(ema)
    elif case == "create_timm":
        allow_timm()
        from timm.utils.model_ema import ModelEmaV3

        keep.append(ModelEmaV3(model, decay=BETA))
        keep[-1].update(model)
    elif case == "create_averaged":
        from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

        keep.append(AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(BETA)))
        keep[-1].update_parameters(model)
    elif case == "create_torch_ema":
        from torch_ema import ExponentialMovingAverage

        keep.append(ExponentialMovingAverage(model.parameters(), decay=BETA))
        keep[-1].update()
    elif case in ("swap_emakit", "swap_emakit_bf16"):
        with keep[0].swap():
            pass
    elif case == "swap_emapt":
        backup = {k: v.clone() for k, v in model.state_dict().items()}
        keep[0].copy_params_from_ema_to_model()
        model.load_state_dict(backup)
        del backup
    else:
        raise SystemExit(f"unknown memory case {case!r}")
    gc.collect()
    after = _vm_kib()
    return {
        "peak_mib": (after["VmHWM"] - base) / 1024,
        "retained_mib": (after["VmRSS"] - base) / 1024,
        "model_mib": model_mib,
    }


def bench_memory(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for label, case in MEMORY_CASES.items():
        proc = subprocess.run(
            [sys.executable, __file__, "--memory-worker", case, "--threads", str(args.threads)],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            rows.append({"case": label, "error": proc.stderr.strip().splitlines()[-1:]})
            continue
        rows.append({"case": label, **json.loads(proc.stdout.strip().splitlines()[-1])})
    return rows


# -- report ------------------------------------------------------------------------------


def _git(directory: str, *args: str) -> str | None:
    """Output of a read-only git command in ``directory`` (None outside a checkout)."""
    try:
        proc = subprocess.run(
            ["git", "--no-optional-locks", "-C", directory, *args],
            capture_output=True,
            text=True,
            check=False,
        )
    except OSError:
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def _version(directory: str) -> dict[str, Any]:
    """Where a benchmarked emakit comes from: its directory, commit, uncommitted changes."""
    status = _git(directory, "status", "--porcelain", "--", ".")
    return {
        "path": directory,
        "commit": _git(directory, "rev-parse", "--short", "HEAD"),
        "uncommitted_changes": None if status is None else bool(status),
    }


def machine(before: ModuleType | None) -> dict[str, Any]:
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "emakit": emakit.__version__,
        "emakit_path": os.path.dirname(emakit.__file__),
        "emakit_source": _version(os.path.dirname(emakit.__file__)),
        "emakit_before_source": None
        if before is None
        else _version(os.path.dirname(before.__file__)),
    }


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The redesign's targets (a), (b), (c), each judged by the wall and CPU medians.

    (a) and (c) are ratios of contenders timed side by side in one run; (b) is µs per
    skipped call (``unit``); ``wall`` and ``cpu`` are the two medians. ``before`` is the
    same measure for the older emakit (``--before``).
    """
    rows = []

    def row(target: str, case: str, limit: float, unit: str, now: dict, old: dict | None) -> None:
        def pick(r: dict | None) -> dict[str, float] | None:
            return None if r is None else {"wall": r["median_us"], "cpu": r["cpu_median_us"]}

        rows.append(
            {
                "target": target,
                "case": case,
                "limit": limit,
                "unit": unit,
                "emakit": pick(now),
                "before": pick(old),
                "met": {
                    "wall median": now["median_us"] <= limit,
                    "CPU median": now["cpu_median_us"] <= limit,
                },
            }
        )

    for res in report["update"]:
        row(
            f"(a) default <= {TARGET_DEFAULT_OVER_BARE}x bare foreach",
            res["model"],
            TARGET_DEFAULT_OVER_BARE,
            "x",
            res["default_over_bare_foreach"],
            res.get("before_default_over_bare_foreach"),
        )
    skipped = {r["contender"]: r for r in report["skipped"]}
    for label in SKIPPED_MODELS:
        row(
            f"(b) skipped call <= {TARGET_SKIPPED_US:g} µs",
            label,
            TARGET_SKIPPED_US,
            "µs",
            skipped[f"emakit EMA (default), {label}"],
            skipped.get(f"emakit before EMA (default), {label}"),
        )
    for res in report["update"]:
        row(
            f"(c) flattened <= {TARGET_FLAT_OVER_FLOOR}x floor",
            res["model"],
            TARGET_FLAT_OVER_FLOOR,
            "x",
            res["flat_over_floor"],
            res.get("before_flat_over_floor"),
        )
    return rows


def _print_report(report: dict[str, Any]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain text fallback
        print(json.dumps(report, indent=2))
        return
    console = Console(width=130)
    console.print(f"[bold]machine[/]: {report['machine']}")
    console.print(
        f"load average (1, 5, 15 min) at start {report['loadavg_at_start']}, "
        f"at end {report['loadavg_at_end']}"
    )
    for res in report["update"]:
        table = Table(
            title=f"{res['model']}: {res['tensors']} tensors, {res['elements']:,} elements"
        )
        cols = (
            "contender",
            "wall median µs",
            "wall min µs",
            "CPU median µs",
            "x floor (wall median)",
            "x floor (wall min)",
            "x floor (CPU median)",
        )
        for col in cols:
            table.add_column(col, justify="left" if col == "contender" else "right")
        for r in res["rows"]:
            table.add_row(
                r["contender"],
                f"{r['median_us']:,.1f}",
                f"{r['min_us']:,.1f}",
                f"{r['cpu_median_us']:,.1f}",
                f"{r['x_floor']:.2f}",
                f"{r['x_floor_min']:.2f}",
                f"{r['x_floor_cpu']:.2f}",
            )
        console.print(table)
        for key, label in (
            ("emapt_foreach_over_emakit_default", "emakit default"),
            ("emapt_foreach_over_emakit_flat", "emakit after flatten_parameters"),
        ):
            r = res[key]
            console.print(
                f"ema-pytorch use_foreach=True / {label}: {r['median_us']:.1f}x (wall median), "
                f"{r['min_us']:.1f}x (wall min), {r['cpu_median_us']:.1f}x (CPU median)"
            )
        ratios = [
            (res["default_over_bare_foreach"], "emakit default / bare _foreach_lerp_"),
            (res["flat_over_floor"], "emakit after flatten_parameters / floor"),
        ]
        if "after_over_before" in res:
            ratios += [
                (res["after_over_before"]["default"], "emakit default: after / before"),
                (
                    res["after_over_before"]["flat"],
                    "emakit after flatten_parameters: after / before",
                ),
                (res["after_over_before"]["skip_nonfinite"], "skip_nonfinite: after / before"),
            ]
        for r, label in ratios:
            console.print(
                f"{label}: {r['median_us']:.3f}x (wall median), "
                f"{r['min_us']:.3f}x (wall min), {r['cpu_median_us']:.3f}x (CPU median)"
            )
        console.print()
    table = Table(title="skipped call (update_every=10)")
    for col in ("contender", "wall median µs", "wall min µs", "CPU median µs"):
        table.add_column(col)
    for r in report["skipped"]:
        table.add_row(
            r["contender"],
            f"{r['median_us']:.2f}",
            f"{r['min_us']:.2f}",
            f"{r['cpu_median_us']:.2f}",
        )
    console.print(table)
    table = Table(title="host time of one update(), kernels stubbed, N x Linear(4, 4)")
    for col in ("modules", "contender", "wall median µs", "CPU median µs"):
        table.add_column(col)
    for r in report["host"]:
        table.add_row(
            str(r["modules"]), r["contender"], f"{r['median_us']:.1f}", f"{r['cpu_median_us']:.1f}"
        )
    console.print(table)
    if report.get("memory"):
        table = Table(title="memory, TransformerEncoder (RSS high-water mark delta, fresh process)")
        for col in ("case", "peak MiB", "retained MiB", "model MiB"):
            table.add_column(col)
        for r in report["memory"]:
            if "error" in r:
                table.add_row(r["case"], "error", str(r["error"]), "")
            else:
                table.add_row(
                    r["case"],
                    f"{r['peak_mib']:.1f}",
                    f"{r['retained_mib']:.1f}",
                    f"{r['model_mib']:.1f}",
                )
        console.print(table)
    _print_targets(console, report["targets"])


def _print_targets(console: Any, rows: list[dict[str, Any]]) -> None:
    from rich.table import Table

    def fmt(value: float, unit: str) -> str:
        return f"{value:.3f}x" if unit == "x" else f"{value:.2f} µs"

    table = Table(title="targets, by median per call (met: by both the wall and the CPU median)")
    cols = ("target", "case", "emakit wall", "emakit CPU", "met", "before wall", "before CPU")
    for col in cols:
        table.add_column(col, justify="left" if col in ("target", "case", "met") else "right")
    for r in rows:
        met = r["met"]
        verdict = (
            "met"
            if all(met.values())
            else "not met"
            if not any(met.values())
            else "met by " + " and ".join(k for k, v in met.items() if v) + " only"
        )
        old = r["before"]
        table.add_row(
            r["target"],
            r["case"].split(" (")[0],  # the model's name without its description
            fmt(r["emakit"]["wall"], r["unit"]),
            fmt(r["emakit"]["cpu"], r["unit"]),
            verdict,
            "" if old is None else fmt(old["wall"], r["unit"]),
            "" if old is None else fmt(old["cpu"], r["unit"]),
        )
    console.print(table)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON here")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory subprocesses")
    parser.add_argument(
        "--before",
        metavar="DIR",
        help="also time an older emakit package directory (e.g. a worktree's src/emakit)",
    )
    parser.add_argument("--memory-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.memory_worker:
        print(json.dumps(memory_worker(args.memory_worker)))
        return
    args.repeats, args.sample_ms, args.warmup = (5, 5.0, 3) if args.quick else (21, 20.0, 5)
    before = None if args.before is None else load_before(args.before)
    started = time.perf_counter()
    report: dict[str, Any] = {
        "machine": machine(before),
        "loadavg_at_start": os.getloadavg(),
        "mode": "quick" if args.quick else "full",
        "repeats": args.repeats,
        "sample_ms": args.sample_ms,
        "update": bench_update(args, before),
        "skipped": bench_skipped(args, before),
        "host": bench_host(args, before),
        "memory": [] if args.no_memory else bench_memory(args),
    }
    report["loadavg_at_end"] = os.getloadavg()
    report["seconds"] = time.perf_counter() - started
    report["targets"] = targets(report)
    _print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()

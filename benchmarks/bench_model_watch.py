"""What following the model costs, now that the EMA reads the model and never alters it.

Usage::

    python benchmarks/bench_model_watch.py [--before /tmp/emakit-before/src/emakit]
        [--modules 20 200 1000 2000] [--compiled 64 256 1024] [--repeats 30]

Two measurements, torch single-threaded, contenders interleaved round-robin (the order
reversed on every other repeat, as in ``bench_update.py``), CPU time of this thread:

* **host time of one averaging update(), kernels stubbed** (``N x Linear(4, 4)``, the
  default path, ``torch._foreach_lerp_``/``_foreach_copy_`` replaced by no-ops): the
  default (each update compares copies of the tracked modules' registry dicts with the
  live ones), ``watch_model=True`` (the registries replaced by a counting dict subclass:
  one integer compare), the older emakit (``--before``: the same subclass, always on), the
  registry comparison alone, and ema-pytorch's update (its per-tensor ``lerp_`` on these
  4 x 4 tensors is mostly host time too). Beside them, the machine's load: ``sum(range(10**4))``
  timed in the same rounds (about 50 µs on an idle core of this class; divide by it to
  compare runs on a loaded machine).
* **a torch.compile'd forward** (``backend="eager"``, a chain of ``N`` ``Linear(16, 16)``
  with ``tanh``, batch 4, no grad) of the same model without an EMA, with one (default),
  with ``watch_model=True``, and with the older emakit's EMA (``--before``); each
  contender its own model and its own forward code object (so dynamo's caches never mix);
  and the compiles each EMA caused when attached after the first compiled call (counted
  by a backend that counts the graphs it is given).

This file is a script, not part of the test suite; it asserts nothing about timings.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_update as B
from emakit import EMA

KW: dict[str, Any] = {"beta": 0.999, "update_after_step": 0, "update_every": 1}


def calibration() -> None:
    sum(range(10**4))


def host_time(args: argparse.Namespace, before: ModuleType | None) -> None:
    """The host time of one averaging update, kernels stubbed (see the module docstring)."""
    from emakit._engine.paths import FOREACH  # it holds the kernels it was built with

    def noop(*a: Any, **k: Any) -> None:
        return None

    kernels = ("copy_each", "lerp_same")
    saved = torch._foreach_lerp_, torch._foreach_copy_, [getattr(FOREACH, k) for k in kernels]
    try:
        import ema_pytorch as peer
    except ImportError:
        peer = None
    print("\nhost time of one averaging update(), kernels stubbed, N x Linear(4, 4), CPU µs")
    print(
        "| modules | default | watch_model=True | before | the comparison alone | ema-pytorch "
        "(its own lerp_) | load: sum(range(10**4)) | default / calibration |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    try:
        torch._foreach_lerp_ = torch._foreach_copy_ = noop  # type: ignore[assignment]
        for k in kernels:
            object.__setattr__(FOREACH, k, noop)  # a frozen dataclass, patched for the run
        for n in args.modules:
            torch.manual_seed(0)
            model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(n)])
            default = EMA(model, **KW)
            watched = EMA(
                nn.Sequential(*[nn.Linear(4, 4) for _ in range(n)]), watch_model=True, **KW
            )
            for e in (default, watched):
                e.update()
                e.update()
            fns: dict[str, Callable[[], None]] = {
                "default": default.update,
                "watch_model=True": watched.update,
                "comparison": default.tracker.plan().guards.registries.changed,  # type: ignore[dict-item]
                "calibration": calibration,
            }
            if before is not None:
                old = before.EMA(nn.Sequential(*[nn.Linear(4, 4) for _ in range(n)]), **KW)
                old.update()
                fns["before"] = old.update
            if peer is not None:  # its per-tensor lerp_ on 4 x 4 tensors: mostly host time
                theirs = peer.EMA(
                    nn.Sequential(*[nn.Linear(4, 4) for _ in range(n)]),
                    include_online_model=False,
                    **KW,
                )
                theirs.update()
                fns["ema-pytorch"] = theirs.update
            timings = B.time_side_by_side(fns, repeats=args.repeats, sample_s=0.02, warmup=3)
            med = {k: t.summary()["cpu_median_us"] for k, t in timings.items()}
            old_us = f"{med['before']:.1f}" if "before" in med else "-"
            peer_us = f"{med['ema-pytorch']:,.0f}" if "ema-pytorch" in med else "-"
            print(
                f"| {n:,} | {med['default']:.1f} | {med['watch_model=True']:.1f} | {old_us} "
                f"| {med['comparison']:.1f} | {peer_us} | {med['calibration']:.1f} "
                f"| {med['default'] / med['calibration']:.3f} |"
            )
    finally:
        torch._foreach_lerp_, torch._foreach_copy_ = saved[:2]  # type: ignore[assignment]
        for k, fn in zip(kernels, saved[2], strict=True):
            object.__setattr__(FOREACH, k, fn)


class Counter:
    """A ``torch.compile`` backend that counts the graphs it is given (runs them eagerly)."""

    def __init__(self) -> None:
        self.compiles = 0

    def __call__(self, gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Callable:
        self.compiles += 1
        return gm.forward


def chain(n: int, tag: str) -> nn.Module:
    """``n`` x ``Linear(16, 16)`` with ``tanh``, whose forward is a code object of its own
    (``tag``), so that dynamo caches each contender's graph apart."""

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:  # type: ignore[attr-defined]
            x = torch.tanh(layer(x))
        return x

    code = forward.__code__.replace(co_name=f"forward_{tag}")
    cls = type(f"Chain_{tag}", (nn.Module,), {"forward": types.FunctionType(code, globals())})
    torch.manual_seed(0)
    model = cls()
    model.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(n))
    return model


def compiled_forward(args: argparse.Namespace, before: ModuleType | None) -> None:
    """A compiled forward with and without an EMA (see the module docstring)."""
    builders: dict[str, Callable[[nn.Module], Any]] = {
        "no EMA": lambda m: None,
        "EMA (default)": lambda m: EMA(m, **KW),
        "EMA watch_model=True": lambda m: EMA(m, watch_model=True, **KW),
    }
    if before is not None:
        builders["EMA, before"] = lambda m: before.EMA(m, **KW)
    names = list(builders)
    print("\na torch.compile'd forward (backend eager), N x Linear(16, 16) + tanh, CPU µs")
    print(
        "| modules | "
        + " | ".join(names)
        + " | "
        + " | ".join(f"{n} / no EMA" for n in names[1:])
        + " | compiles caused by attaching: "
        + ", ".join(names[1:])
        + " |"
    )
    print("|---:|" + "---:|" * (2 * len(names) - 1) + "---|")
    x = torch.randn(4, 16)
    for n in args.compiled:
        torch._dynamo.reset()
        fns: dict[str, Callable[[], None]] = {}
        caused: list[int] = []
        keep = []
        for i, (name, build) in enumerate(builders.items()):
            model = chain(n, f"{n}_{i}")
            counter = Counter()
            compiled = torch.compile(model, backend=counter)
            with torch.no_grad():
                compiled(x)  # the first call compiles; the EMA comes after it
            first = counter.compiles
            ema = build(model)
            if ema is not None:
                ema.update()
                ema.update()
            with torch.no_grad():
                compiled(x)
            if name != "no EMA":
                caused.append(counter.compiles - first)
            keep.append((model, ema))

            def call(c: Callable = compiled) -> None:
                with torch.no_grad():
                    c(x)

            fns[name] = call
        start = time.perf_counter()
        timings = B.time_side_by_side(fns, repeats=args.repeats, sample_s=0.02, warmup=3)
        med = {k: t.summary()["cpu_median_us"] for k, t in timings.items()}
        ratios = [med[k] / med["no EMA"] for k in names[1:]]
        print(
            f"| {n:,} | "
            + " | ".join(f"{med[k]:.0f}" for k in names)
            + " | "
            + " | ".join(f"{r:.3f}x" for r in ratios)
            + " | "
            + ", ".join(map(str, caused))
            + " |",
            f"({time.perf_counter() - start:.0f} s)" if args.verbose else "",
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", help="another emakit's src/emakit, loaded beside")
    parser.add_argument("--modules", type=int, nargs="*", default=[20, 200, 1000, 2000])
    parser.add_argument("--compiled", type=int, nargs="*", default=[64, 256, 1024])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    before = B.load_before(args.before) if args.before else None

    def once_us() -> float:
        t0 = time.thread_time_ns()
        calibration()
        return (time.thread_time_ns() - t0) / 1e3

    load = statistics.median(once_us() for _ in range(50))
    print(f"torch {torch.__version__}, 1 thread; sum(range(10**4)) now: {load:.0f} µs")
    if args.modules:
        host_time(args, before)
    if args.compiled:
        compiled_forward(args, before)


if __name__ == "__main__":
    main()

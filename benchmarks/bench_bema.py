"""BEMA's memory and update cost: emakit beside TRL's ``BEMACallback`` and one flat ``lerp_``.

Usage: python benchmarks/bench_bema.py [--rounds R] [--layers L]

A config-built GPT-2 (``n_layer=6, n_embd=384``, vocabulary 8192, 1024 positions; nothing
downloaded): 14.2M parameters, all trainable, float32, on the CPU, one thread. Contenders
run in one process, interleaved round-robin (each round times every contender as the
median of 3 calls), so a busy machine slows them alike; the table reports the median over
rounds and, beside it, the smallest ratio to the floor seen in any round.

* **copies retained** counts the bytes of every storage a contender holds that the model
  does not (a walk over the objects it references), over the bytes of the trainable
  weights, measured right after an update (nothing read since) and after a read of the
  evaluated weights (``bema.ema_model``; TRL's ``running_model``).
* **update** is one averaging call (``update_freq=1``): ``bema.update()``; TRL: one
  ``_update_bema_weights`` (what its ``on_step_end`` does on an update step). Times are
  the calling thread's CPU time (``time.thread_time``), which a busy machine inflates
  less than the wall clock. For the background BEMA (``device="cpu"``) that is what the
  training thread pays (the snapshot; the worker's ``lerp_`` runs beside it).
* **update + read** adds a read of the evaluated weights after every update (as an
  evaluation after each update would): ``bema.ema_model``, which builds them (and
  allocates the stash of the plain EMA: on a CPU the first touch of its pages is most of
  a read's cost).
* **floor**: one ``lerp_`` over a flat float32 buffer of as many elements as the model's
  trainable weights, toward another.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

import emakit
from emakit import BEMA, EMA

BACKGROUND = "emakit BEMA, device='cpu' (background)"


def gpt2(layers: int) -> Any:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=8192, n_positions=1024, n_embd=384, n_layer=layers, n_head=6
    )
    return transformers.GPT2LMHeadModel(config)


def reachable_tensors(root: object) -> list[torch.Tensor]:
    """Every tensor reachable from ``root`` through containers, modules and the attributes
    of emakit's, TRL's and torch's objects (nothing else is walked)."""
    seen: set[int] = set()
    found: list[torch.Tensor] = []
    stack: list[object] = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif type(obj).__module__.startswith(("emakit", "trl", "torch.nn", "transformers")):
            stack.extend(getattr(obj, "__dict__", {}).values())
    return found


def storages(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    out = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.nbytes():
            out[s.data_ptr()] = s.nbytes()
    return out


def copies(model: torch.nn.Module, holder: object, trainable: int) -> float:
    """Bytes of the storages ``holder`` reaches that the model does not own, in copies of
    the trainable weights."""
    own = storages([*model.parameters(), *model.buffers()])
    held = storages(reachable_tensors(holder))
    return sum(n for ptr, n in held.items() if ptr not in own) / trainable


def median_s(fn: Callable[[], Any], clock: Callable[[], float], calls: int = 3) -> float:
    times = []
    for _ in range(calls):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--layers", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)
    import trl

    model = gpt2(args.layers)
    params = [p for p in model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in params)
    trainable = sum(p.numel() * p.element_size() for p in params)
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(
        f"emakit {emakit.__version__} from {os.path.dirname(emakit.__file__)}, torch "
        f"{torch.__version__}, trl {trl.__version__}, 1 thread; GPT-2 {args.layers}x384: "
        f"{n / 1e6:.1f}M trainable parameters ({trainable / 2**20:.1f} MiB)\nuptime: {uptime}"
    )

    def nudge() -> None:  # a stand-in optimizer step: the weights move between updates
        with torch.no_grad():
            params[0].add_(1e-6)

    bema = BEMA(model, update_freq=1)
    background = BEMA(model, update_freq=1, device="cpu")
    ema = EMA(model, beta=0.999, update_after_step=0, update_every=1)
    cb = trl.BEMACallback(update_freq=1)
    cb.on_train_begin(None, None, None, model=model)
    for _ in range(2):  # past the first calls, every contender warm
        nudge()
        bema.update()
        background.update()
        ema.update()
        with torch.no_grad():
            cb._update_bema_weights(10)
    background.tracker.runner.wait()
    memory = {
        "emakit BEMA": copies(model, bema, trainable),
        "emakit BEMA, device='cpu' (background)": copies(model, background, trainable),
        "emakit EMA (for scale)": copies(model, ema, trainable),
        "TRL BEMACallback": copies(model, cb, trainable),
    }
    _ = bema.ema_model, background.ema_model  # a read: the evaluated weights built
    read = {
        "emakit BEMA": copies(model, bema, trainable),
        "emakit BEMA, device='cpu' (background)": copies(model, background, trainable),
        "emakit EMA (for scale)": memory["emakit EMA (for scale)"],
        "TRL BEMACallback": memory["TRL BEMACallback"],
    }
    flat_ema, flat_theta = torch.zeros(n), torch.randn(n)

    def trl_update() -> None:
        with torch.no_grad():
            cb._update_bema_weights(10)

    contenders: dict[str, Callable[[], Any]] = {
        "floor: one flat lerp_": lambda: flat_ema.lerp_(flat_theta, 0.01),
        "emakit BEMA": bema.update,
        BACKGROUND: background.update,
        "emakit EMA (for scale)": ema.update,
        "TRL BEMACallback": trl_update,
        "emakit BEMA, update + read": lambda: (bema.update(), bema.ema_model),
    }
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(args.rounds):
        for name, fn in contenders.items():
            nudge()
            times[name].append(median_s(fn, time.thread_time))
        background.tracker.runner.wait()
    floor = times["floor: one flat lerp_"]
    print(
        "\n| contender | copies retained after an update | after a read | update (ms) "
        "| vs floor (median) | vs floor (min) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, ts in times.items():
        ratios = [t / f for t, f in zip(ts, floor, strict=True)]
        mem = memory.get(name)
        ms, rd = ("-", "-") if mem is None else (f"{mem:.2f}", f"{read[name]:.2f}")
        print(
            f"| {name} | {ms} | {rd} | {statistics.median(ts) * 1e3:.2f} "
            f"| {statistics.median(ratios):.2f}x | {min(ratios):.2f}x |"
        )
    print(
        f"\nuptime after: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}"
    )


if __name__ == "__main__":
    main()

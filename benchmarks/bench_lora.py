"""EMA of a PEFT LoRA model: memory and update time, emakit beside ema-pytorch and TRL.

Usage: python benchmarks/bench_lora.py [--repeats R] [--layers L] [--snapshots N]
                                      [--snapshots-only] [--fixed-cost-only] [--rounds N]

A config-built GPT-2 (``n_layer=6, n_embd=768``, vocabulary 2048; nothing downloaded) with
LoRA adapters (``r=8`` on ``c_attn``), on the CPU, one thread. Contenders run in one
process, interleaved round-robin; the median per call is reported.

* **EMA memory** counts the bytes of every storage an EMA holds that the model does not
  (so a weight shared with the model costs nothing; ema-pytorch's deep copy and TRL's
  ``running_model`` count in full).
* **update** is one averaging ``update()`` (``update_every=1``, after the warm-up), and for
  TRL's ``BEMACallback`` one ``_update_bema_weights`` (what its ``on_step_end`` does on an
  update step); the floor is a bare ``torch._foreach_lerp_`` over the trainable tensors.
* **frozen check** (``share_frozen=True``): what reading the shared frozen weights'
  ``requires_grad`` flags, version counters and peft's merge flags costs before each
  update and read (`FrozenShare.changed()`, timed alone); nothing is attached to the model,
  so a forward costs what it costs without an EMA.
* **fixed cost** (also alone with ``--fixed-cost-only``): one averaging ``update()``
  against a bare ``torch._foreach_lerp_`` over the EMA's *own* adapter tensors (the same
  memory), thread CPU time, ``--rounds`` alternated rounds of 50 calls each; and the
  update with its kernel stubbed out (the host time around it), with three of its parts
  timed alone (``share_frozen=True``): the watch of the shared frozen weights' storages
  (also between two bare kernels, as updates meet it), the rule's decay and ``Action``, entering and leaving
  inference mode. Median and minimum ratio.
* **post-hoc snapshots** (``--snapshots N``, also alone with ``--snapshots-only``): a
  ``PostHocEMA`` of two profiles writes ``N`` snapshot steps (float16) with the frozen base
  shared (``share_frozen=True``) and stored once, shared and stored in every snapshot
  (``store_frozen_once=False``), and copied by the EMA (the default, ema-pytorch's
  behaviour); the bytes on disk
  of the first step, of each later one, the median ``checkpoint()`` time, which
  includes the digest of the frozen base at every step (its change detection), and one
  ``synthesize_state_dict(sigma_rel=0.1)`` from the folder, which includes reading and
  hashing each side file once (its SHA-256 check, timed alone in the last column).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from emakit import BEMA, EMA


def gpt2(layers: int) -> Any:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=2048,
        n_positions=1024,
        n_embd=768,
        n_layer=layers,
        n_head=12,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)


def lora_model(layers: int) -> Any:
    import peft

    lora = peft.LoraConfig(r=8, target_modules=["c_attn"], lora_dropout=0.0)
    return peft.get_peft_model(gpt2(layers), lora)


def storages(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def extra_bytes(model: torch.nn.Module, tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages under ``tensors`` that the model does not own."""
    own = storages([*model.parameters(), *model.buffers()])
    return sum(n for ptr, n in storages(tensors).items() if ptr not in own)


def median_us(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--snapshots", type=int, default=4, help="post-hoc snapshot steps")
    parser.add_argument("--snapshots-only", action="store_true")
    parser.add_argument("--fixed-cost-only", action="store_true")
    parser.add_argument("--rounds", type=int, default=200, help="fixed cost: rounds")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.snapshots_only:
        snapshot_costs(lora_model(args.layers), args.snapshots)
        return
    if args.fixed_cost_only:
        fixed_cost(lora_model(args.layers), args.rounds)
        return
    import ema_pytorch
    import trl

    model = lora_model(args.layers)
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    mib = 2**20
    total = sum(p.numel() for p in params)
    adapters = sum(p.numel() * p.element_size() for p in trainable)
    print(
        f"torch {torch.__version__}, 1 thread; GPT-2 {args.layers}x768 + LoRA r=8: "
        f"{total / 1e6:.1f}M parameters, {sum(p.numel() for p in trainable) / 1e6:.3f}M "
        f"trainable ({adapters / mib:.2f} MiB of adapters)"
    )
    kw = {"beta": 0.999, "update_after_step": 0, "update_every": 1}
    rows: dict[str, tuple[int | None, Callable[[], Any] | None, str]] = {}

    ema = EMA(model, share_frozen=True, **kw)
    rows["emakit EMA, share_frozen=True (frozen base shared)"] = (
        extra_bytes(model, [*ema.ema_model.parameters(), *ema.ema_model.buffers()]),
        ema.update,
        "",
    )
    copied = EMA(model, **kw)
    rows["emakit EMA, default (frozen base copied)"] = (
        extra_bytes(model, [*copied.ema_model.parameters(), *copied.ema_model.buffers()]),
        copied.update,
        "",
    )
    bema = BEMA(model, update_freq=1, share_frozen=True)
    bema_state = [*bema.state_dict(keep_vars=True).values()]
    rows["emakit BEMA (update_freq=1, share_frozen=True)"] = (
        extra_bytes(model, [t for t in bema_state if isinstance(t, torch.Tensor)]),
        bema.update,
        "",
    )
    ref = ema_pytorch.EMA(model, include_online_model=False, **kw)
    rows["ema-pytorch 0.8.3 EMA"] = (
        extra_bytes(model, [*ref.ema_model.parameters(), *ref.ema_model.buffers()]),
        ref.update,
        "",
    )
    rows["TRL BEMACallback, the PEFT model"] = (None, None, trl_on(model, trl))
    rows["TRL BEMACallback, its LoRA-injected base"] = (
        None,
        None,
        trl_on(model.get_base_model(), trl),
    )
    full = gpt2(args.layers)
    cb = trl.BEMACallback(update_freq=1)
    cb.on_train_begin(None, None, None, model=full)
    trl_tensors = [*cb.running_model.parameters(), *cb.theta0_params, *cb.ema_params]
    rows["TRL BEMACallback, base fully trainable"] = (
        extra_bytes(full, trl_tensors),
        torch.no_grad()(lambda: cb._update_bema_weights(10)),
        "all 45M weights trainable: what it supports",
    )
    shadows = [p.detach().clone() for p in trainable]
    rows["floor: _foreach_lerp_ over the adapters"] = (
        None,
        lambda: torch._foreach_lerp_(shadows, trainable, 0.001),
        "",
    )
    for _, fn, _ in rows.values():
        if fn is not None:
            fn()
            fn()
    timings: dict[str, list[float]] = {k: [] for k in rows}
    for _ in range(args.repeats):  # round-robin: every contender sees the same machine
        for name, (_, fn, _) in rows.items():
            if fn is not None:
                timings[name].append(median_us(fn, 3))
    floor = statistics.median(timings["floor: _foreach_lerp_ over the adapters"])
    print("\n| contender | EMA memory (MiB) | update (µs) | vs floor | note |")
    print("|---|---:|---:|---:|---|")
    for name, (nbytes, fn, note) in rows.items():
        mem = "-" if nbytes is None else f"{nbytes / mib:.2f}"
        t = statistics.median(timings[name]) if fn is not None else None
        ts = "-" if t is None else f"{t:.0f}"
        ratio = "-" if t is None else f"{t / floor:.2f}x"
        print(f"| {name} | {mem} | {ts} | {ratio} | {note} |")
    frozen_check_cost(ema, args.repeats)
    fixed_cost(model, args.rounds)
    if args.snapshots > 0:
        snapshot_costs(model, args.snapshots)


def fixed_cost(model: Any, rounds: int, calls: int = 50) -> None:
    """``update()`` against the bare kernel over the EMA's own tensors, and stubbed."""
    from emakit._engine.paths import FOREACH, no_autograd  # FOREACH: the kernel it was built with

    ema = EMA(model, beta=0.999, update_after_step=0, update_every=1, share_frozen=True)
    for _ in range(5):
        ema.update()
    plan = ema.tracker.plan()
    shadows = [p.shadow for p in plan.pairs if p.average]
    onlines = [p.online.detach() for p in plan.pairs if p.average]

    def bare() -> None:
        torch._foreach_lerp_(shadows, onlines, 0.001)

    def batch(fn: Callable[[], Any]) -> float:
        t0 = time.thread_time_ns()
        for _ in range(calls):
            fn()
        return (time.thread_time_ns() - t0) / calls / 1e3

    def noop(*args: Any) -> None:
        return None

    # parts of the stubbed update, each timed alone: the watch of the shared frozen weights'
    # storages (Plan.freshness()), the rule's decay and Action, entering inference mode
    tracker, watch = ema.tracker, plan.shared_pointers

    def decay() -> None:
        tracker.rule.action(tracker.step, tracker.last)

    def inference() -> None:
        with no_autograd(True):
            pass

    def watch_then_bare() -> None:  # the watch as an update meets it: after a kernel
        watch.moved()
        bare()

    parts = {
        "watch": watch.moved,
        "watch+bare": watch_then_bare,
        "decay": decay,
        "inference": inference,
    }
    kernel = FOREACH.lerp_same
    samples: dict[str, list[float]] = {"update": [], "bare": [], "stubbed": []}
    samples.update({k: [] for k in parts})
    for r in range(rounds):
        pair = [("update", ema.update), ("bare", bare)]
        for name, fn in pair if r % 2 == 0 else pair[::-1]:
            samples[name].append(batch(fn))
        object.__setattr__(FOREACH, "lerp_same", noop)  # a frozen dataclass, patched briefly
        try:
            samples["stubbed"].append(batch(ema.update))
        finally:
            object.__setattr__(FOREACH, "lerp_same", kernel)
        for name, fn in parts.items():
            samples[name].append(batch(fn))
    med = {k: statistics.median(v) for k, v in samples.items()}
    ratios = [u / b for u, b in zip(samples["update"], samples["bare"], strict=True)]
    print(
        f"\nfixed cost, {len(shadows)} adapter tensors ({sum(t.numel() for t in shadows):,} "
        f"values), thread CPU time, {rounds} alternated rounds of {calls} calls: update() "
        f"{med['update']:.1f} µs, bare _foreach_lerp_ over its own tensors {med['bare']:.1f} "
        f"µs: {med['update'] / med['bare']:.3f}x (medians; per-round ratio median "
        f"{statistics.median(ratios):.3f}x, min {min(ratios):.3f}x); update() with its "
        f"kernel stubbed {med['stubbed']:.1f} µs, of which the watch of the "
        f"{len(watch.tensors)} shared frozen weights {med['watch']:.1f} µs, the decay and "
        f"its Action {med['decay']:.1f} µs, entering and leaving inference mode "
        f"{med['inference']:.1f} µs, the rest (Python calls, other checks) "
        f"{med['stubbed'] - med['watch'] - med['decay'] - med['inference']:.1f} µs; the "
        f"watch between two kernels (its storages no longer in the cache) "
        f"{med['watch+bare'] - med['bare']:.1f} µs"
    )


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.suffix == ".safetensors")


def snapshot_costs(model: Any, steps: int) -> None:
    """Post-hoc snapshots of the LoRA model, frozen base stored once or in every file."""
    from emakit import PostHocEMA
    from emakit.posthoc import synthesize_state_dict
    from emakit.posthoc.snapshots.frozen import check_side_file, is_side_file

    trainable = [p for p in model.parameters() if p.requires_grad]
    kinds = {
        "share_frozen=True, frozen base stored once": {"share_frozen": True},
        "share_frozen=True, store_frozen_once=False": {
            "share_frozen": True,
            "store_frozen_once": False,
        },
        "default: frozen base copied (ema-pytorch's)": {},
    }
    mib = 2**20
    print(f"\npost-hoc snapshots: 2 profiles, float16, {steps} snapshot steps")
    print(
        "| snapshots | first step (MiB) | each later step (MiB) | checkpoint() (ms) "
        "| synthesis (ms) | of which the side file's SHA-256 check (ms) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, kw in kinds.items():
            folder = Path(tmp) / str(len(name))
            ema = PostHocEMA(
                model,
                sigma_rels=(0.05, 0.28),
                update_every=1,
                checkpoint_every_num_steps="manual",
                checkpoint_folder=folder,
                **kw,
            )
            sizes, times = [], []
            for _ in range(steps):
                with torch.no_grad():
                    for p in trainable:
                        p.add_(torch.randn_like(p), alpha=1e-3)
                ema.update()
                t0 = time.perf_counter()
                ema.checkpoint()
                times.append(time.perf_counter() - t0)
                sizes.append(folder_bytes(folder))
            later = (sizes[-1] - sizes[0]) / max(steps - 1, 1)
            ms = statistics.median(times[1:] or times) * 1e3
            ema.release_folder()
            sides = [p for p in folder.iterdir() if is_side_file(p.name)]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # few snapshots: a rough fit, said once
                synth = median_us(lambda f=folder: synthesize_state_dict(f, sigma_rel=0.1), 3)
            check = median_us(lambda s=sides: [check_side_file(p) for p in s], 3) if sides else 0
            print(
                f"| {name} | {sizes[0] / mib:.2f} | {later / mib:.2f} | {ms:.0f} "
                f"| {synth / 1e3:.0f} | {check / 1e3:.0f} |"
            )
            del ema


def trl_on(model: Any, trl: Any) -> str:
    """What TRL's callback does with the PEFT model (it builds ``type(model)(model.config)``
    and zips trainable against all parameters, strictly)."""
    try:
        cb = trl.BEMACallback(update_freq=1)
        cb.on_train_begin(None, None, None, model=model)
        with torch.no_grad():
            cb._update_bema_weights(10)
    except Exception as e:
        return f"fails: {type(e).__name__}: {str(e).splitlines()[0][:70]}"
    return "runs"


def frozen_check_cost(ema: EMA, repeats: int) -> None:
    """The check of the shared frozen weights before each update and read, timed alone."""
    frozen = ema._source.frozen  # type: ignore[union-attr]
    each = statistics.median(median_us(frozen.changed, 200) for _ in range(repeats))
    print(
        f"\nfrozen check (share_frozen=True): {len(frozen.pairs)} shared weights, "
        f"{len(frozen._layer_objects)} peft layers: {each:.1f} µs per update or read; "
        f"nothing is attached to the model (a forward costs what it costs without an EMA)"
    )


if __name__ == "__main__":
    main()

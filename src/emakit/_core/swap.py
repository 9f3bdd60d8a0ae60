"""Swapping the EMA weights into the online model, and back: the one implementation.

`Swap` is both a context manager (``with ema.swap():``) and an object with explicit
`enter()` and `exit()`, which framework callbacks use across hooks
(validation start and end). Per tensor it swaps

* **by reference** when the shadow has the online tensor's dtype and device: the online
  tensor's ``.data`` points at the shadow; nothing is copied or allocated;
* **by cast** when they differ (``ema_dtype``, an offloaded shadow): ``.data`` points at a
  temporary cast of the shadow, freed on exit;
* **by copy** for FSDP2 DTensors (FSDP2 all-gathers from its own shard storage, so
  re-pointing ``.data`` would not be seen) and when asked (``in_place=True``, for
  frameworks that read their own storage): the shadow is copied into the online tensor
  and the online values, stashed, are copied back on exit. FSDP2 modules are resharded on
  entry and exit, so no stale gathered weight is used. DeepSpeed ZeRO-3 partitions
  (``ds_tensor``) are copied the same way, with the gathered parameters released on entry
  and exit, so DeepSpeed's next forward gathers the partitions then in place (and the
  persistent parameters gathered again on exit: a collective, every rank).

One semantics in every mode: **inside the block the model's tensors are the EMA's**.
Whatever writes them there (an ``optimizer.step()``, a train-mode forward updating
BatchNorm statistics, ``load_state_dict``) writes the EMA: by reference directly, by cast
and by copy through a write-back on exit of every tensor whose values now differ from the
shadow they came from (compared element by element, one host read per device: version
counters would miss writes such as BatchNorm's running statistics). Untouched tensors are
not written back, so a cast never rounds the shadow. To evaluate
without touching the EMA, evaluate in eval mode without grad, as ``ema(x)`` does.

The original weights come back on exit, also when the block raises. Updating the EMA
while swapped is an error; its message names the usual cause, an ``optimizer.step()`` in
the block that calls ``update()`` through a post-step hook (the step has trained the EMA
weights by then). After the block, updates go on as usual, averaging the model into the
EMA weights as the block left them: nothing needs to raise, so nothing does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from .._dist.deepspeed import PartitionSwap, zero3_params
from .._dist.dtensor import fsdp_modules, is_dtensor, local_tensor, reshard
from ..errors import EMARuntimeError
from .tracker import Tracker

#: Swaps entered and not yet exited, in the order entered. Two EMAs of one model may swap
#: nested (``s1.enter(); s2.enter()``), but must exit in reverse: the second one saved the
#: first one's tensors as "the model's own".
_ACTIVE: list[Swap] = []


class Swap:
    """The EMA weights in the online model between `enter()` and `exit()`.

    Args:
        tracker: the EMA's tracker (its plan says which tensors pair).
        model: the online module (its FSDP2 modules are resharded), or None.
        in_place: copy every tensor instead of re-pointing ``.data``. Default False.
    """

    def __init__(self, tracker: Tracker, model: object = None, *, in_place: bool = False) -> None:
        self.tracker = tracker
        self.model = model
        self.in_place = in_place
        # (online, its own data, the shadow when online holds a cast of it, else None)
        self._pointed: list[tuple[Tensor, Tensor, Tensor | None]] = []
        # (online local tensor, its stashed values, shadow local tensor)
        self._copied: list[tuple[Tensor, Tensor, Tensor]] = []
        self._roots: list[nn.Module] = []
        self._zero = PartitionSwap([], [])  # partitions: DeepSpeed ZeRO-3, partition=True
        self.active = False

    def enter(self) -> Swap:
        """Put the EMA weights into the online model."""
        tracker = self.tracker
        if tracker.swapped:
            raise EMARuntimeError("swap() blocks cannot be nested")
        tracker.runner.wait()
        self._roots = fsdp_modules(self.model)
        reshard(self._roots)  # the sharded parameters registered, not gathered ones
        pairs = tracker.plan().pairs
        self._zero = PartitionSwap(zero3_params(self.model), pairs)
        in_place = self.in_place or self._zero.active
        try:
            self._zero.release()
            with torch.no_grad():
                for p in pairs:
                    online, shadow = p.online, p.shadow
                    if in_place or is_dtensor(online):
                        local, saved = local_tensor(online), local_tensor(online).clone()
                        local.copy_(local_tensor(shadow))
                        self._copied.append((local, saved, local_tensor(shadow)))
                        continue
                    data = online.data
                    if online.dtype == shadow.dtype and online.device == shadow.device:
                        online.data = shadow.data  # writes land in the shadow itself
                        self._pointed.append((online, data, None))
                    else:
                        online.data = shadow.data.to(online.device, online.dtype)
                        self._pointed.append((online, data, shadow))
            self._zero.spread()
            reshard(self._roots)  # gathered from the shards just copied in
        except BaseException:
            self._restore()
            raise
        tracker.swapped = self.active = True
        _ACTIVE.append(self)
        return self

    def exit(self) -> None:
        """Put the online weights back (a no-op when not entered).

        Raises:
            EMARuntimeError: a swap of the same tensors entered after this one is still
                active (exit that one first); nothing is changed.
        """
        if not self.active:
            return
        mine = self._online_ids()
        later = _ACTIVE[_ACTIVE.index(self) + 1 :]
        if any(other._online_ids() & mine for other in later):
            raise EMARuntimeError(
                "swaps of one model must exit in the reverse order they were entered: "
                "another EMA's swap() entered after this one is still active, and it holds "
                "this EMA's weights as the model's; exit it first (nested with-blocks do "
                "this). Nothing was changed"
            )
        try:
            self._restore()
        finally:
            self.tracker.swapped = self.active = False
            _ACTIVE.remove(self)

    def _online_ids(self) -> set[int]:
        return {id(o) for o, _, _ in self._pointed} | {id(o) for o, _, _ in self._copied}

    def _restore(self) -> None:
        self._zero.release()
        with torch.no_grad():
            # Tensors whose values changed inside the block (compared with the shadow they
            # came from; not all writes bump a version counter: BatchNorm's running
            # statistics do not) go back into the EMA; untouched ones are left alone, so a
            # cast never rounds the shadow. One host read per device.
            held = [(o.data, s) for o, _, s in self._pointed if s is not None]
            held += [(local, s) for local, _, s in self._copied]
            for value, shadow in _written(held):
                shadow.copy_(value)
            for online, data, _ in reversed(self._pointed):
                online.data = data
            for local, saved, _ in reversed(self._copied):
                local.copy_(saved)
        self._pointed, self._copied = [], []
        reshard(self._roots)
        self._roots = []
        self._zero.spread()
        self._zero.restore()

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` inside the swap (entered and left around the call)."""
        with self:
            return fn(*args)

    def __enter__(self) -> Swap:
        return self.enter()

    def __exit__(self, *exc: object) -> None:
        self.exit()  # also when the block raised: the original weights come back


def _written(held: list[tuple[Tensor, Tensor]]) -> list[tuple[Tensor, Tensor]]:
    """The ``(value, shadow)`` pairs whose value no longer equals the shadow it came from
    (one host read per device)."""
    flags: dict[torch.device, list[tuple[int, Tensor]]] = {}
    for i, (value, shadow) in enumerate(held):
        flag = (value != shadow.to(value.device, value.dtype)).any()
        flags.setdefault(value.device, []).append((i, flag))
    changed: set[int] = set()
    for items in flags.values():
        hits = torch.stack([f for _, f in items]).tolist()
        changed.update(i for (i, _), hit in zip(items, hits, strict=True) if hit)
    return [pair for i, pair in enumerate(held) if i in changed]

"""Frozen weights shared with the online model: which ones, and the watch that un-shares them.

A ``Parameter`` with ``requires_grad=False`` (a LoRA base, a frozen encoder) is not
copied into the EMA: the EMA model holds a ``Parameter`` of its own that *aliases the
online tensor's storage*. While the weight stays frozen, ema-pytorch's copy of it equals
it at every step (a lerp of equal values is exact), so sharing it is bit-identical and
costs no memory and no update work: a shared pair is left out of the plan.

Where the assumption ends, the pair gets its own storage first (copy-on-write), and from
then on it is averaged like any other weight, which is again what ema-pytorch computes:

* **unfreezing**: a process-wide optimizer pre-step hook (``torch.optim``'s global hook)
  looks, before every ``optimizer.step()``, for shared weights that this step would write
  (in the optimizer, ``requires_grad`` and a gradient). The optimizer's parameters are
  matched against the shared ones once per optimizer and parameter-group layout, so a
  step costs a few attribute reads when no shared weight is in the optimizer (the LoRA
  case), and a loop over the overlap otherwise; ``update()`` pays nothing;
* **writes into the EMA** that would change a shared value (``load_state_dict``,
  ``load_ema_weights``): the writer calls `FrozenShare.unshare_changed()` first.

A frozen value changed in place by the user (``frozen.copy_(new_base)``) is seen by the
EMA at once, where ema-pytorch's copy would lag; ``share_frozen=False`` copies frozen
weights as ema-pytorch does.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from .._dist.dtensor import is_dtensor
from .._engine.pairs import TensorPair

__all__ = ["FrozenShare", "shared_parameters", "shares"]


def shares(p: TensorPair) -> bool:
    """Whether the pair's shadow is the online tensor's own storage (a shared frozen weight)."""
    s, o = p.shadow, p.online
    return (
        s.numel() > 0
        and not is_dtensor(s)
        and s.dtype == o.dtype
        and s.data_ptr() == o.data_ptr()
        and s.stride() == o.stride()
    )


_WATCHES: weakref.WeakSet[FrozenShare] = weakref.WeakSet()
_HOOK: list[Any] = []  # the global pre-step hook's handle, installed once


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for watch in list(_WATCHES):
        if watch.pairs:
            watch.before_step(optimizer)


class FrozenShare:
    """The shared frozen pairs of one EMA (see the module docstring).

    Args:
        on_unshare: called after a pair got its own storage (the owner rebuilds its plan).
    """

    def __init__(self, on_unshare: Callable[[], None]) -> None:
        self.on_unshare = on_unshare
        self.pairs: list[TensorPair] = []
        self._by_id: dict[int, TensorPair] = {}
        # optimizer -> (its parameter layout, the shared pairs among its parameters)
        self._overlap: weakref.WeakKeyDictionary[Any, tuple[tuple[int, ...], list]] = (
            weakref.WeakKeyDictionary()
        )

    def watch(self, pairs: Iterable[TensorPair]) -> None:
        """Watch ``pairs`` (the shared ones of the current pairing) from now on."""
        self.pairs = list(pairs)
        self._by_id = {id(p.online): p for p in self.pairs}
        self._overlap = weakref.WeakKeyDictionary()
        if self.pairs:
            _WATCHES.add(self)
            if not _HOOK:
                from torch.optim.optimizer import register_optimizer_step_pre_hook

                _HOOK.append(register_optimizer_step_pre_hook(_before_step))

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Un-share every shared weight that ``optimizer.step()`` is about to write."""
        groups = optimizer.param_groups
        layout = tuple(len(g["params"]) for g in groups)
        seen = self._overlap.get(optimizer)
        if seen is None or seen[0] != layout:
            by_id = self._by_id
            overlap = [by_id[id(p)] for g in groups for p in g["params"] if id(p) in by_id]
            seen = self._overlap[optimizer] = (layout, overlap)
        hits = [p for p in seen[1] if p.online.requires_grad and p.online.grad is not None]
        if hits:
            self.unshare(hits)

    def unshare(self, pairs: Iterable[TensorPair]) -> None:
        """Give each pair's shadow its own storage holding its current value (copy-on-write);
        from the next plan on, the pair is averaged like any other."""
        changed = False
        with torch.no_grad():
            for p in pairs:
                if shares(p):
                    p.shadow.data = p.shadow.detach().clone()
                    changed = True
        if not changed:
            return
        self.watch([p for p in self.pairs if shares(p)])
        self.on_unshare()

    def unshare_changed(self, values: Mapping[str, Any], prefix: str) -> None:
        """Before ``values`` (a state dict, keys ``prefix + name``) are copied into the EMA:
        un-share every shared weight whose value would change."""
        hits = []
        for p in self.pairs:
            value = values.get(prefix + p.name)
            if not isinstance(value, Tensor) or not shares(p):
                continue
            same = value.shape == p.shadow.shape and torch.equal(
                value.to(p.shadow.device, p.shadow.dtype), p.shadow
            )
            if not same:
                hits.append(p)
        if hits:
            self.unshare(hits)

    def __getstate__(self) -> dict[str, Any]:
        return {"on_unshare": self.on_unshare, "pairs": [], "_by_id": {}, "_overlap": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._overlap = weakref.WeakKeyDictionary()


def shared_parameters(model: nn.Module, eligible: Callable[[str, Tensor], bool]) -> set[int]:
    """The ids of ``model``'s parameters that an EMA should share: frozen (no grad),
    floating, not sharded, and ``eligible`` (the owner's rule: tracked, same dtype and
    device as their shadow would have)."""
    return {
        id(t)
        for name, t in model.named_parameters()
        if not t.requires_grad
        and (t.is_floating_point() or t.is_complex())
        and not is_dtensor(t)
        and eligible(name, t)
    }

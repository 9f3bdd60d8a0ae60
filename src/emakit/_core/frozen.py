"""Frozen weights shared with the online model: which ones, and the watch that un-shares them.

A ``Parameter`` with ``requires_grad=False`` (a LoRA base, a frozen encoder) is not
copied into the EMA: the EMA model holds a ``Parameter`` of its own that *aliases the
online tensor's storage*. While the weight stays frozen, ema-pytorch's copy of it equals
it at every step (a lerp of equal values is exact), so sharing it is bit-identical and
costs no memory and no update work: a shared pair is left out of the plan.

Where the assumption ends, the pair gets its own storage first (copy-on-write), and from
then on it is averaged like any other weight, which is again what ema-pytorch computes:

* **unfreezing**: every module that registers a shared weight gets a forward pre-hook
  (on that module only) that looks whether one of its shared weights now requires grad;
  if so, the weight gets its own storage before the forward that starts the step that
  could train it. A hook costs one Python call per forward of its module and reads a few
  flags; ``update()`` pays nothing. A weight trained without its module's forward running
  (used directly by another module) is not seen: pass ``share_frozen=False`` there. The
  hooks are removed when the EMA is deleted; a model pickled or deep-copied carries an
  inert hook (it does nothing);
* **writes into the EMA** that would change a shared value (``load_state_dict``,
  ``load_ema_weights``): the writer calls `FrozenShare.unshare_changed()` first;
* **the online storage replaced** (``p.data = new``, ``load_state_dict(assign=True)``,
  ``model.to()``): the plan watches the shared weights' storages (their use counts, see
  `emakit._engine.paths.Pointers`) and goes stale; the next pairing finds the weight no
  longer shared, and it is averaged from its old value on.

A frozen value changed in place by the user (``frozen.copy_(new_base)``) is seen by the
EMA at once, where ema-pytorch's copy would lag; ``share_frozen=False`` copies frozen
weights as ema-pytorch does.

**FSDP2 shards** follow the same rule. The EMA copy's parameter is a DTensor whose local
shard is the model's own, adopted by FSDP2 as the storage it all-gathers from
(`emakit._core.sharding.share_shards`), so ``ema(x)`` reads the model's frozen shards;
un-sharing gives it a cloned shard through the same route. A parameter whose shards FSDP2
pads (dim 0 not divisible by the shard world size) is not shared on any rank: the EMA owns
and averages it (one shard per rank), so every rank's plan holds the same parameters.
Unfreezing and loads are decided per rank on the local shards, without a collective (so
ranks may differ in what they share; ``skip_nonfinite``'s agreement counts the shared
pairs, ``Tracked.shared``, so every rank joins its all-reduce alike).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .._dist.dtensor import fsdp_modules, is_dtensor, local_tensor, reshard, same_sharding
from .._engine.pairs import TensorPair
from ..errors import EMARuntimeError
from .sharding import adopt_shard, places_of


def shares(p: TensorPair) -> bool:
    """Whether the pair's shadow is the online tensor's own storage (a shared frozen weight);
    for DTensors (FSDP2), whether the shadow's local shard is the online one's, with the
    same mesh and placements."""
    s, o = p.shadow, p.online
    if is_dtensor(s) or is_dtensor(o):
        if not same_sharding(s, o):
            return False
        s, o = local_tensor(s), local_tensor(o)
    return (
        s.numel() > 0
        and s.dtype == o.dtype
        and s.data_ptr() == o.data_ptr()
        and s.stride() == o.stride()
    )


def _same_value(value: Tensor, shadow: Tensor) -> bool:
    """Whether loading ``value`` would leave ``shadow`` as it is. DTensors compare their
    local shards (no collective); a value sharded otherwise counts as a change."""
    if is_dtensor(value) or is_dtensor(shadow):
        if not (same_sharding(value, shadow) and value.shape == shadow.shape):
            return False
        value, shadow = local_tensor(value), local_tensor(shadow)
    return value.shape == shadow.shape and torch.equal(
        value.to(shadow.device, shadow.dtype), shadow
    )


@torch.compiler.disable  # a compiled forward calls it eagerly (once: it removes itself)
def _unshare_unfrozen(hook: UnfreezeHook) -> None:
    share = hook.share() if hook.share is not None else None
    if share is not None:
        with torch.inference_mode(False), torch.no_grad():  # the copies outlive the forward
            share.unshare([p for p in share.pairs if p.online.requires_grad])


class UnfreezeHook:
    """The forward pre-hook on a module that registers shared frozen weights (see the
    module docstring); inert once its EMA is deleted.

    Pickled or deep-copied (with the model), it becomes ``{}.get``, which a forward
    pre-hook call ``hook(module, args)`` answers with ``args``: inputs unchanged, and a
    model saved whole with ``torch.save`` loads where emakit is not installed."""

    def __init__(self, share: FrozenShare | None = None, params: Sequence[Tensor] = ()) -> None:
        self.share = weakref.ref(share) if share is not None else None
        self.params = list(params)

    def __call__(self, module: nn.Module, args: Any) -> None:
        for p in self.params:
            if p.requires_grad:
                _unshare_unfrozen(self)
                return

    def __reduce__(self) -> tuple[Any, ...]:
        return (getattr, ({}, "get"))


def drop_unfreeze_hooks(model: nn.Module, copy: nn.Module) -> None:
    """Remove from ``copy`` (a deep copy of ``model``) the hooks that were `UnfreezeHook`s
    in ``model`` (another EMA's)."""
    for original, copied in zip(model.modules(), copy.modules(), strict=False):
        for key, hook in original._forward_pre_hooks.items():
            if isinstance(hook, UnfreezeHook):
                copied._forward_pre_hooks.pop(key, None)


def _remove(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


class FrozenShare:
    """The shared frozen pairs of one EMA (see the module docstring).

    Args:
        on_unshare: called after a pair got its own storage (the owner rebuilds its plan).
    """

    def __init__(self, on_unshare: Callable[[], None]) -> None:
        self.on_unshare = on_unshare
        self.pairs: list[TensorPair] = []
        self._root: nn.Module | None = None  # the EMA model (FSDP2: where shards re-register)
        self._model: nn.Module | None = None  # the online model (where the hooks are)
        self._handles: list[Any] = []
        weakref.finalize(self, _remove, self._handles)

    def watch(
        self,
        pairs: Iterable[TensorPair],
        root: nn.Module | None = None,
        model: nn.Module | None = None,
    ) -> None:
        """Watch ``pairs`` (the shared ones of the current pairing) from now on: an
        `UnfreezeHook` on each module of ``model`` that registers one. ``root``: the EMA
        model holding their shadows (needed to un-share FSDP2 shards). Both default to the
        ones given before."""
        self.pairs = list(pairs)
        self._root = root if root is not None else self._root
        self._model = model if model is not None else self._model
        _remove(self._handles)
        if not self.pairs or self._model is None:
            return
        shared = {id(p.online) for p in self.pairs}
        for module in self._model.modules():
            params = [t for t in module._parameters.values() if t is not None and id(t) in shared]
            if params:
                hook = UnfreezeHook(self, params)
                self._handles.append(module.register_forward_pre_hook(hook))

    def unshare(self, pairs: Iterable[TensorPair]) -> None:
        """Give each pair's shadow its own storage holding its current value (copy-on-write);
        from the next plan on, the pair is averaged like any other."""
        hits = [p for p in pairs if shares(p)]
        if not hits:
            return
        self._own_storage(hits)
        done = {id(p) for p in hits}  # an un-shared DTensor pair's shadow is a new object
        self.watch([p for p in self.pairs if id(p) not in done and shares(p)])
        self.on_unshare()

    def own_replaced(self, pairs: Iterable[TensorPair]) -> bool:
        """Of ``pairs`` (a new pairing), give each one that this EMA shared and that no
        longer shares (the online storage was replaced: ``p.data = new``) a storage of its
        own holding the old value. Every EMA of the model shared that old storage; from now
        on each averages its own copy of it, as ema-pytorch's copies would be. Returns
        whether any pair changed (the caller pairs again)."""
        was = {p.name for p in self.pairs}
        hits = [p for p in pairs if p.name in was and not shares(p)]
        if not hits:
            return False
        self._own_storage(hits)
        return True

    def _own_storage(self, pairs: list[TensorPair]) -> None:
        """Give each pair's shadow a storage of its own holding its current value."""
        with torch.no_grad():
            for p in pairs:
                if not is_dtensor(p.shadow):
                    p.shadow.data = p.shadow.detach().clone()
            sharded = [p for p in pairs if is_dtensor(p.shadow)]
            if sharded:
                self._own_shards(sharded)

    def _own_shards(self, pairs: list[TensorPair]) -> None:
        """Give FSDP2 shadows a cloned shard each, registered in the EMA model in place of
        the shared one (`emakit._core.sharding.adopt_shard`, with the copy resharded first)."""
        root = self._root
        if root is None:  # pragma: no cover - build() and pairs() always give it
            raise EMARuntimeError("FrozenShare has no EMA model to un-share FSDP2 shards in")
        reshard(fsdp_modules(root))
        places = places_of(root)
        for p in pairs:
            adopt_shard(root, p.shadow, local_tensor(p.shadow).clone(), places)

    def unshare_changed(self, values: Mapping[str, Any], prefix: str) -> None:
        """Before ``values`` (a state dict, keys ``prefix + name``) are copied into the EMA:
        un-share every shared weight whose value would change."""
        hits = []
        for p in self.pairs:
            value = values.get(prefix + p.name)
            if isinstance(value, Tensor) and shares(p) and not _same_value(value, p.shadow):
                hits.append(p)
        if hits:
            self.unshare(hits)

    def __getstate__(self) -> dict[str, Any]:
        return {"on_unshare": self.on_unshare}  # pairs and hooks come back at the next pairing

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.on_unshare = state["on_unshare"]
        self.pairs, self._root, self._model, self._handles = [], None, None, []
        weakref.finalize(self, _remove, self._handles)


def shared_parameters(model: nn.Module, eligible: Callable[[str, Tensor], bool]) -> set[int]:
    """The ids of ``model``'s parameters that an EMA should share: frozen (no grad),
    floating, and ``eligible`` (the owner's rule: tracked, same dtype and device as their
    shadow would have). FSDP2 (DTensor) parameters included: the copy shares those whose
    shards are unpadded (`emakit._core.sharding.share_shards`)."""
    return {
        id(t)
        for name, t in model.named_parameters()
        if not t.requires_grad and (t.is_floating_point() or t.is_complex()) and eligible(name, t)
    }

"""Frozen weights shared with the online model (``share_frozen=True``): which ones, and the
check that keeps them honest.

By default an EMA copies every tracked weight, frozen ones included, and averages it as
ema-pytorch does. With ``share_frozen=True`` a ``Parameter`` with ``requires_grad=False``
(a LoRA base, a frozen encoder) is not copied into the EMA: the EMA model holds a
``Parameter`` of its own that *aliases the online tensor's storage*. While the weight stays
frozen and unwritten, ema-pytorch's copy of it equals it at every step (a lerp of equal
values is exact), so sharing it is bit-identical and costs no memory and no update work: a
shared pair is left out of the plan.

Nothing is attached to the model. Before anything reads the EMA (``update()``, ``ema(x)``,
``swap()``, ``ema.ema_model``, ``state_dict()`` and the exports) `FrozenShare.changed()`
reads, in C, the shared online tensors' ``requires_grad`` flags and version counters, and
peft's ``merged_adapters`` lists of the tuner layers above them (a few µs for hundreds of
weights); when one moved, `FrozenShare.settle()` decides:

* **unfrozen, not yet written** (``requires_grad_(True)``, also through an
  ``nn.ParameterList`` or without a forward): the pair gets its own storage holding the
  frozen value (copy-on-write) and is averaged from then on: ema-pytorch's numbers;
* **written in place** (the version counter moved: trained after unfreezing before the EMA
  was read, new values copied in, ``load_state_dict`` into the model): the EMA's value was
  that storage and is gone, so the EMA refuses to be read or updated
  ([`EMAStateError`][emakit.errors.EMAStateError] naming the weights, the cause and the
  fix: ``share_frozen=False``), until a load into the EMA sets those weights;
* **merged by peft** (``merge_adapter()``, ``merge_and_unload()``: the online adapters
  added into the shared base weights through ``.data``, which no version counter sees):
  refused the same way, naming ``unmerge_adapter()``; after ``unmerge_adapter()`` the EMA
  reads the base weights again.

Where the EMA itself would change a shared value, it copies first: **loads** into the EMA
(``load_state_dict``, ``load_ema_weights``; also a state's ``online_model.*`` that would
write new values into the model's shared storage) call `FrozenShare.unshare_changed()`
first and re-read the version counters after. **The online storage replaced**
(``p.data = new``, ``load_state_dict(assign=True)``, ``model.to()``): the plan watches the
shared weights' storages (their use counts, see `emakit._engine.paths.Pointers`) and goes
stale; the next pairing finds the weight no longer shared, and it is averaged from its old
value on. Not seen: an in-place write through ``.data`` other than peft's merges
(``p.data.add_(x)`` bumps no version counter); use ``share_frozen=False`` where frozen
weights are rewritten that way.

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

from collections.abc import Callable, Iterable, Mapping
from operator import attrgetter
from typing import Any

import torch
from torch import Tensor, nn

from .._dist.dtensor import (
    fsdp_modules,
    is_dtensor,
    local_tensor,
    reshard,
    same_sharding,
    shard_identity,
)
from .._engine.pairs import TensorPair
from .._validate import few
from ..errors import EMARuntimeError, EMAStateError
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
        and s.device.type != "meta"  # (every meta tensor's data_ptr() is 0: none is shared)
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


_requires_grad = attrgetter("requires_grad")
_version = attrgetter("_version")
_merged = attrgetter("merged_adapters")


def _versioned(t: Tensor) -> Tensor:
    """The tensor whose version counter in-place writes to ``t`` move (a DTensor's local
    shard: FSDP2 and the user write there)."""
    return shard_identity(t) if is_dtensor(t) else t  # type: ignore[return-value]


#: Elements per step of `fingerprint()` (its int64 scratch: 8 bytes each).
_PRINT_CHUNK = 1 << 22
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(t: Tensor) -> Tensor:
    """Two int64 sums of ``t``'s bits, the second weighted by position (wrapping), on
    ``t``'s device: the same for the same values; after a write that changes them, the
    same only by a chance of about one in 2**64. Computed when a shared weight is first
    watched and when its version counter moved, to tell a write that put the same values
    back (another EMA's in-place ``swap()``, a load of equal values) from a change."""
    with torch.no_grad():
        flat = t.detach().reshape(-1)
        bits = flat.view(_BITS.get(flat.element_size(), torch.uint8))
        sums = torch.zeros(2, dtype=torch.int64, device=t.device)
        for start in range(0, bits.numel(), _PRINT_CHUNK):
            piece = bits[start : start + _PRINT_CHUNK].to(torch.int64)
            place = torch.arange(start + 1, start + 1 + piece.numel(), device=t.device)
            sums[0] += piece.sum()
            sums[1] += (piece * place).sum()
        return sums


def _peft_layers(modules: Iterable[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """peft's tuner layers (a ``merged_adapters`` list) that nothing is merged into yet."""
    return [
        (name, m)
        for name, m in modules
        if isinstance(getattr(m, "merged_adapters", None), list) and not m.merged_adapters
    ]


class FrozenShare:
    """The shared frozen pairs of one EMA and their check (see the module docstring).

    Args:
        on_unshare: called after a pair got its own storage (the owner rebuilds its plan).
    """

    def __init__(self, on_unshare: Callable[[], None]) -> None:
        self.on_unshare = on_unshare
        self.pairs: list[TensorPair] = []
        self._root: nn.Module | None = None  # the EMA model (FSDP2: where shards re-register)
        self._model: nn.Module | None = None  # the online model (peft's layers are read there)
        self._online: list[Tensor] = []
        self._versioned: list[Tensor] = []
        self._versions: list[int] = []
        self._prints: dict[int, tuple[int, Tensor]] = {}  # id -> (version, fingerprint)
        self._layers: list[tuple[str, nn.Module]] = []
        self._layer_objects: list[nn.Module] = []

    def watch(
        self,
        pairs: Iterable[TensorPair],
        root: nn.Module | None = None,
        model: nn.Module | None = None,
    ) -> None:
        """Watch ``pairs`` (the shared ones of the current pairing) from now on: record
        their flags, version counters and peft's layers in ``model`` and ``root`` (the EMA
        model holding their shadows, also needed to un-share FSDP2 shards). Both default to
        the ones given before."""
        self.pairs = list(pairs)
        self._root = root if root is not None else self._root
        self._model = model if model is not None else self._model
        self._online = [p.online for p in self.pairs]
        self._versioned = list(map(_versioned, self._online))
        self._versions = list(map(_version, self._versioned))
        prints = self._prints
        self._prints = {}
        for t, v in zip(self._versioned, self._versions, strict=True):
            known = prints.get(id(t))
            self._prints[id(t)] = known if known and known[0] == v else (v, fingerprint(t))
        self._layers = []
        if self.pairs:
            for where, m in (("model", self._model), ("ema_model", self._root)):
                if m is not None:
                    named = ((f"{where}.{n}" if n else where, x) for n, x in m.named_modules())
                    self._layers += _peft_layers(named)
        self._layer_objects = [m for _, m in self._layers]

    def rebase(self) -> None:
        """Take the current version counters as the shared values' own (after a load into
        the EMA, which wrote equal values or un-shared the others first)."""
        self._versions = list(map(_version, self._versioned))
        for t, v in zip(self._versioned, self._versions, strict=True):
            self._prints[id(t)] = (v, self._prints[id(t)][1])

    def changed(self) -> bool:
        """Whether a shared weight was unfrozen, written in place or merged into by peft
        since it was watched (read in C; `settle()` says which)."""
        return (
            any(map(_requires_grad, self._online))
            or list(map(_version, self._versioned)) != self._versions
            or any(map(_merged, self._layer_objects))
        )

    def settle(self) -> None:
        """After `changed()`: give each unfrozen, unwritten weight its own storage, or
        raise for a written or merged one (see the module docstring).

        Raises:
            EMAStateError: a shared weight was written in place or merged into by peft;
                the message names the weights, the cause and the fix.
        """
        merged = [name for name, m in self._layers if m.merged_adapters]
        if merged:
            raise EMAStateError(
                f"peft merged adapters into base weights this EMA shares with the model "
                f"(share_frozen=True), in {few(merged)}: merge_adapter() and "
                f"merge_and_unload() add the model's adapters into the shared base weights, "
                f"so the EMA would apply them on top of its own. Call unmerge_adapter() "
                f"before reading or updating the EMA (after merge_and_unload(), build a new "
                f"EMA of the merged model), or build the EMA with share_frozen=False (the "
                f"default), which keeps its own copy of the base weights"
            )
        written = []
        for i, (p, t) in enumerate(zip(self.pairs, self._versioned, strict=True)):
            if t._version != self._versions[i]:  # written: to the same values again?
                if torch.equal(fingerprint(t), self._prints[id(t)][1]):
                    self._versions[i] = t._version
                    self._prints[id(t)] = (t._version, self._prints[id(t)][1])
                else:
                    written.append(p)
        if written:
            names = few([p.name for p in written])
            if any(p.online.requires_grad for p in written):
                cause = (
                    "were unfrozen (requires_grad=True) and trained before the EMA was read "
                    "again, so their EMA values, which were the model's storage, are gone"
                )
                fix = (
                    "; or read the EMA (update(), ema(x)) between requires_grad_(True) and "
                    "the next optimizer step: it then takes its own copy first"
                )
            else:
                cause = (
                    "were written in place (new values copied in, load_state_dict into the "
                    "model): their EMA values were the model's storage, so they would jump "
                    "to the new values where ema-pytorch's copy would lag"
                )
                fix = "; or load the EMA's own state (ema.load_state_dict) to set them"
            raise EMAStateError(
                f"the frozen weights {names}, shared with the model (share_frozen=True), "
                f"{cause}. Build the EMA with share_frozen=False (the default: frozen "
                f"weights copied and averaged as ema-pytorch does){fix}"
            )
        self.unshare([p for p in self.pairs if p.online.requires_grad])

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
        return {"on_unshare": self.on_unshare}  # the pairs come back at the next pairing

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["on_unshare"])  # type: ignore[misc]


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

"""Staleness: how a plan sees that the tensors it holds are no longer the model's.

A plan holds tensor objects, as an optimizer does, so in-place writes are always seen.
What it must notice is the model changing under it. It does so by *reading* the modules
it tracks (the online model and the EMA copy), never by changing them: their classes, their
``_parameters``/``_buffers``/``_modules`` dicts and their hooks stay as torch made them.

* **Registrations** (a parameter, buffer or submodule added, replaced or deleted:
  ``model.head = nn.Linear(...)``, ``load_state_dict(..., assign=True)``,
  ``register_buffer``, ``del module.weight``, ``to_empty()``, and ``module.to()``, which
  assigns buffers straight into ``module._buffers``): when a plan is built, `Registries`
  keeps a copy of every registry dict of every tracked module, holding the same objects.
  Each update compares the copies with the live dicts in one C-level comparison
  (``copies == live``): Python compares two dicts by size, then key by key, each value by
  identity first, so an unchanged model never leaves C; empty dicts are checked by their
  truth value. For a model of 2,000 modules and its EMA that is about 0.1 ms per update on
  an idle core (``benchmarks/bench_model_watch.py``, BENCHMARKS.md). A replaced value makes the
  comparison call the old value's ``==``, which for the values kept in the copies can
  only say "different" or raise (a tensor of several elements, or none, has no truth
  value; a module compares by identity): either way the owner pairs again, and keeps the
  plan if the pairs are its own (``"check"``). (That ``==`` runs once per change, on the
  first replaced tensor: an element-wise compare, on its device, whose result is then
  refused a truth value; should it fail to allocate, that too says "changed".) The dicts holding a value whose ``==`` could
  call another object equal (a one-element tensor, a tensor subclass, a module defining
  ``__eq__``) are checked by the identity of each value and their sizes instead.
  ``torch.func.functional_call`` puts the model's own tensors back: nothing to re-pair.
* **Sharded parameters** (DTensors: FSDP2, tensor parallel): FSDP2 swaps the gathered and
  the sharded parameter in and out of ``_parameters`` around every forward, so those dicts
  are not compared; instead every update checks, in C, that each tracked DTensor is still
  registered (a plain tensor there is FSDP2's gathered parameter, not a change) and still
  holds its local shard (``to()`` replaces it).
* **DeepSpeed partitions** are checked on every update through their `PartitionSlot`.
* ``.data`` re-pointed, ``.to()`` of the weights: the plan's groups and spans check their
  dtype, device and storage (see `emakit._engine.plan`).
* **Shared frozen weights** (``share_frozen=True``): the owner's check, `Tracked.frozen`,
  reads their ``requires_grad`` flags and version counters (see `emakit._core.frozen`).

``EMA(watch_model=True)`` trades the comparison for a constant-time check and alters the
model to get it: the tracked modules' registry dicts become a `WatchedDict` that counts
its changes (`watch_modules()`), which a compiled forward pays for (dynamo guards a dict
subclass more slowly) and which recompiles a forward compiled before the EMA was built.

Not seen: a registry dict replaced wholesale (``module._parameters = {...}``), and a
parameter registered later on a module whose parameters are DTensors.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable
from operator import is_, is_not
from typing import Any

from torch import Tensor, nn

from .._dist.dtensor import is_dtensor, shard_identity_getter

_REGISTRIES = ("_parameters", "_buffers", "_modules")
#: Tensor classes whose ``==`` against another object is element-wise (no truth value for
#: several elements or none), so a registry copy may hold them (see the module docstring).
_PLAIN_TENSORS = frozenset(
    c for c in (Tensor, nn.Parameter, getattr(nn, "Buffer", None)) if c is not None
)


def _compares_by_identity(value: object) -> bool:
    """Whether ``value == other`` is never true for another object that a registry could
    hold instead (see the module docstring)."""
    if value is None:
        return True
    if type(value) in _PLAIN_TENSORS:
        return value.numel() != 1  # type: ignore[attr-defined]
    return isinstance(value, nn.Module) and type(value).__eq__ is object.__eq__


class Registries:
    """The registry dicts of the modules under ``roots``, compared with copies of
    themselves on every update (see the module docstring). ``_parameters`` holding
    DTensors are left out (FSDP2 swaps them; their tensors are checked by `Guards`).

    Under the roots after the first (the EMA model), empty dicts are left out too: what
    the plan must see there is a tracked tensor or a module holding some replaced or
    deleted, which only a non-empty dict can show; a tensor *added* to the EMA model alone
    is no tensor of the model's, never averaged (it costs a third of the comparison at
    2,000 modules, where most modules hold no buffers and no children)."""

    __slots__ = ("copies", "empty", "holders", "keys", "live", "odd", "sizes", "values")

    def __init__(self, roots: Iterable[nn.Module]) -> None:
        self.live: list[dict] = []  # compared with `copies` in one C-level comparison
        self.empty: list[dict] = []  # empty dicts: their truth values (cheaper than a comparison)
        self.odd: list[dict] = []  # dicts checked value by value, and by size
        seen: set[int] = set()
        for index, root in enumerate(roots):
            for module in root.modules():
                if id(module) in seen:
                    continue
                seen.add(id(module))
                state = module.__dict__
                for registry in _REGISTRIES:
                    d = state.get(registry)
                    if not isinstance(d, dict) or (index and not d):
                        continue
                    if registry == "_parameters" and any(map(is_dtensor, d.values())):
                        continue
                    if not d:
                        self.empty.append(d)
                    elif all(map(_compares_by_identity, d.values())):
                        self.live.append(d)
                    else:
                        self.odd.append(d)
        self.copies = list(map(dict, self.live))  # plain (DeepSpeed's ZeROOrderedDict: no copy())
        self.sizes = list(map(len, self.odd))
        self.holders = [d for d in self.odd for _ in d]  # each value's dict, and its key
        self.keys = [k for d in self.odd for k in d]
        self.values = list(map(dict.__getitem__, self.holders, self.keys))

    def changed(self) -> bool:
        """Whether a registry of the modules changed since they were copied (what
        `Guards.check()` runs inline, one Python call less per update)."""
        if any(self.empty) or (self.odd and self.odd_changed()):
            return True
        try:
            return self.copies != self.live
        except Exception:  # a replaced tensor's ``==`` has no truth value: changed
            return True

    def odd_changed(self) -> bool:
        """Whether a dict checked value by value changed (size or identity)."""
        return list(map(len, self.odd)) != self.sizes or not all(
            map(is_, map(dict.get, self.holders, self.keys), self.values)
        )


class Changes:
    """How many registrations the watched modules of one EMA have seen
    (``watch_model=True``, see `WatchedDict`); an EMA's guards compare it with the count
    their plan was built at."""

    __slots__ = ("__weakref__", "count")

    def __init__(self) -> None:
        self.count = 0


class WatchedDict(dict):
    """A module's registry dict that counts its changes on the `Changes` it is watched by
    (``EMA(watch_model=True)``, which alters the model: see the module docstring).

    Storing the object already stored under a key (``self.step += 1`` on a buffer) is no
    change. Reading costs what a ``dict`` costs: no read method is overridden. Pickled and
    deep-copied as the dict class it replaced (``plain``: ``dict``, or torch 2.4's
    ``OrderedDict``), so saved or copied models carry nothing of emakit.
    """

    __slots__ = ("plain", "watchers")
    plain: type[dict[str, Any]]
    watchers: weakref.WeakSet[Changes]

    def _changed(self) -> None:
        for changes in self.watchers:
            changes.count += 1

    def __setitem__(self, key: str, value: Any) -> None:
        if dict.get(self, key, self) is not value:
            self._changed()
        dict.__setitem__(self, key, value)

    def __delitem__(self, key: str) -> None:
        dict.__delitem__(self, key)
        self._changed()

    def pop(self, *args: Any) -> Any:
        value = dict.pop(self, *args)
        self._changed()
        return value

    def popitem(self) -> tuple[str, Any]:
        item = dict.popitem(self)
        self._changed()
        return item

    def clear(self) -> None:
        dict.clear(self)
        self._changed()

    def update(self, *args: Any, **kwargs: Any) -> None:
        dict.update(self, *args, **kwargs)
        self._changed()

    def setdefault(self, key: str, default: Any = None) -> Any:
        if key not in self:
            self._changed()
        return dict.setdefault(self, key, default)

    def __ior__(self, other: Any) -> WatchedDict:  # type: ignore[override,misc]
        self.update(other)
        return self

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        return (self.plain, (dict(self),))  # pickled and deep-copied as the dict it replaced


#: The registry dicts a `WatchedDict` replaces: torch 2.4 keeps them in OrderedDicts.
_PLAIN = (dict, OrderedDict)


def watch_modules(roots: tuple[nn.Module, ...], changes: Changes) -> None:
    """Make every registry dict of the modules under ``roots`` count its changes on
    ``changes`` (``watch_model=True``: a `WatchedDict` replaces a plain one once; the first
    watcher does it). ``_parameters`` holding DTensors are left alone."""
    for root in roots:
        for module in root.modules():
            state = module.__dict__
            for registry in _REGISTRIES:
                d = state.get(registry)
                if type(d) is WatchedDict:
                    d.watchers.add(changes)
                elif (
                    isinstance(d, dict)
                    and type(d) in _PLAIN
                    and not (registry == "_parameters" and any(map(is_dtensor, d.values())))
                ):
                    watched = WatchedDict(d)
                    watched.plain = type(d)
                    watched.watchers = weakref.WeakSet((changes,))
                    state[registry] = watched


class Guards:
    """The staleness checks of one plan (see the module docstring).

    Args:
        watched: ``(slot, tensor)`` of every tracked tensor, online and shadow, where a
            slot is ``(container, key, owner id)`` or None (see `emakit._engine.pairs`).
        shared_shards: the online DTensors of shared frozen pairs (FSDP2 may replace their
            local shards too).
        roots: the modules whose registries are compared on every update (the online and
            the EMA model; none for a pytree, where nothing registers).
        changes: with ``watch_model=True``, the `Changes` of the watched modules, which
            replaces the comparison of ``roots``' registries.
        frozen: the owner's check of its shared frozen weights (True: changed), or None.
    """

    def __init__(
        self,
        watched: list[tuple[Any, Tensor]],
        shared_shards: list[Tensor],
        roots: tuple[nn.Module, ...] = (),
        changes: Changes | None = None,
        frozen: Callable[[], bool] | None = None,
    ) -> None:
        self.roots = roots
        self.changes = changes
        self.frozen = frozen
        self.seen = changes.count if changes is not None else 0
        self.registries = Registries(roots if changes is None else ())
        self.slots: list[tuple[Any, str, Tensor]] = []  # checked on every update
        # DTensors by their shard getter: (getter, the DTensors, their local shards)
        self.sharded: dict[Any, tuple[list[Tensor], list[object]]] = {}
        for slot, t in watched:
            if is_dtensor(t):
                self._watch_shard(t)
            if slot is not None and (is_dtensor(t) or not isinstance(slot[0], dict)):
                self.slots.append((slot[0], slot[1], t))
        for t in shared_shards:
            self._watch_shard(t)

    def check(self) -> str:
        """``"stale"`` if a tracked tensor is certainly no longer the one registered, or a
        shared frozen weight changed; ``"check"`` if a tracked module registered, replaced
        or deleted something since (the owner compares the live pairs with the plan's,
        then calls `accept()`); else ``"fresh"``."""
        changes = self.changes
        if changes is not None:
            if changes.count != self.seen:
                return "check"
        else:  # Registries.changed(), inline
            r = self.registries
            if any(r.empty) or (r.odd and r.odd_changed()):
                return "check"
            try:
                if r.copies != r.live:
                    return "check"
            except Exception:  # a replaced tensor's ``==`` has no truth value: changed
                return "check"
        if self.frozen is not None and self.frozen():
            return "stale"
        for container, key, t in self.slots:
            now = container.get(key)
            if now is not t and (now is None or not is_dtensor(t) or is_dtensor(now)):
                return "stale"  # (a DTensor's slot holding a plain tensor: FSDP2 gathered)
        for get, (dtensors, shards) in self.sharded.items():  # one getter, in C, per class
            if any(map(is_not, map(get, dtensors), shards)):
                return "stale"
        return "fresh"

    def _watch_shard(self, t: Tensor) -> None:
        get = shard_identity_getter(t)
        dtensors, shards = self.sharded.setdefault(get, ([], []))
        dtensors.append(t)
        shards.append(get(t))

    def accept(self) -> None:
        """The owner found the live tensors unchanged: fresh again until the next change."""
        if self.changes is not None:
            self.seen = self.changes.count
        else:
            self.registries = Registries(self.roots)

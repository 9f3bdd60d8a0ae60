"""Staleness: how a plan sees that the tensors it holds are no longer the model's.

A plan holds tensor objects, as an optimizer does, so in-place writes are always seen.
What it must notice is the model changing under it. Everything here is local to the modules
the EMA tracks (the online model and the EMA copy); nothing global in torch is touched.

* **Registrations** (a parameter, buffer or submodule added, replaced or deleted:
  ``model.head = nn.Linear(...)``, ``load_state_dict(..., assign=True)``,
  ``register_buffer``, ``del module.weight``, and ``module.to()``, which assigns buffers
  straight into ``module._buffers``): `watch_modules()` gives each tracked module's
  ``_parameters``, ``_buffers`` and ``_modules`` dicts a `WatchedDict` with the same
  contents, which counts every change on the `Changes` of each EMA watching it. An unchanged
  model costs one integer compare per update, whatever its size; after a change the owner
  pairs again and keeps the plan if the pairs are its own (``"check"``).
  A watched dict pickles and deep-copies as a plain ``dict``, so saved or copied models
  carry nothing of emakit.
* **Sharded parameters** (DTensors: FSDP2, tensor parallel): FSDP2 swaps the gathered and
  the sharded parameter in and out of ``_parameters`` around every forward, so those dicts
  are not watched; instead every update checks, in C, that each tracked DTensor is still
  registered (a plain tensor there is FSDP2's gathered parameter, not a change) and still
  holds its local shard (``to()`` replaces it).
* **DeepSpeed partitions** are checked on every update through their `PartitionSlot`.
* ``.data`` re-pointed, ``.to()`` of the weights: the plan's groups and spans check their
  dtype, device and storage (see `emakit._engine.plan`).

Not seen: a registry dict replaced wholesale (``module._parameters = {...}``), a parameter
registered later on a module whose parameters are DTensors, and writes made through
``dict.__setitem__`` on the dict's class rather than the dict.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from operator import is_not
from typing import Any

from torch import Tensor, nn

from .._dist.dtensor import is_dtensor, shard_identity_getter


class Changes:
    """How many registrations the watched modules of one EMA have seen (see the module
    docstring); an EMA's guards compare it with the count their plan was built at."""

    __slots__ = ("__weakref__", "count")

    def __init__(self) -> None:
        self.count = 0


class WatchedDict(dict):
    """A module's registry dict that counts its changes on the `Changes` it is watched by.

    Storing the object already stored under a key (``self.step += 1`` on a buffer) is no
    change. Reading costs what a ``dict`` costs: no read method is overridden.
    """

    __slots__ = ("watchers",)
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
        return (dict, (dict(self),))  # pickled and deep-copied as a plain dict


_REGISTRIES = ("_parameters", "_buffers", "_modules")
#: The registry dicts a `WatchedDict` replaces: torch 2.4 keeps them in OrderedDicts.
_PLAIN = (dict, OrderedDict)


def watch_modules(roots: tuple[nn.Module, ...], changes: Changes) -> None:
    """Make every registry dict of the modules under ``roots`` count its changes on
    ``changes`` (a `WatchedDict` replaces a plain one once; the first watcher does it).
    ``_parameters`` holding DTensors are left alone (see the module docstring)."""
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
                    watched.watchers = weakref.WeakSet((changes,))
                    state[registry] = watched


class Guards:
    """The staleness checks of one plan (see the module docstring).

    Args:
        watched: ``(slot, tensor)`` of every tracked tensor, online and shadow, where a
            slot is ``(container, key, owner id)`` or None (see `emakit._engine.pairs`).
        shared_shards: the online DTensors of shared frozen pairs (FSDP2 may replace their
            local shards too).
        changes: the `Changes` of the watched modules (None: a pytree, nothing registers).
    """

    def __init__(
        self,
        watched: list[tuple[Any, Tensor]],
        shared_shards: list[Tensor],
        changes: Changes | None,
    ) -> None:
        self.changes = changes
        self.seen = changes.count if changes is not None else 0
        self.slots: list[tuple[Any, str, Tensor]] = []  # checked on every update
        # DTensors by their shard getter: (getter, the DTensors, their local shards)
        self.sharded: dict[Any, tuple[list[Tensor], list[object]]] = {}
        for slot, t in watched:
            if is_dtensor(t):
                self._watch_shard(t)
            if slot is not None and (is_dtensor(t) or type(slot[0]) not in (dict, WatchedDict)):
                self.slots.append((slot[0], slot[1], t))
        for t in shared_shards:
            self._watch_shard(t)

    def check(self) -> str:
        """``"stale"`` if a tracked tensor is certainly no longer the one registered;
        ``"check"`` if a watched module registered, replaced or deleted something since
        (the owner compares the live pairs with the plan's, then calls `accept()`); else
        ``"fresh"``. Constant time for an unchanged model without DTensors or partitions."""
        changes = self.changes
        if changes is not None and changes.count != self.seen:
            return "check"
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

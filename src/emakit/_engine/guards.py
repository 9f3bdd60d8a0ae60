"""Staleness: how a plan sees that the tensors it holds are no longer the model's.

A plan holds tensor objects, as an optimizer does, so in-place writes are always seen.
What it must notice is the model changing under it:

* a Parameter, buffer or submodule **replaced or added** (``model.head = nn.Linear(...)``,
  ``load_state_dict(..., assign=True)``, ``register_buffer``, ``add_module``): torch's
  global registration hooks bump a process-wide epoch, and only when the epoch moved does
  the owner walk the model again and compare the live pairs with the plan's (so an
  unchanged model pays one integer compare per update, and a registration elsewhere one
  walk);
* a parameter, buffer or submodule deleted with ``del`` (no torch hook reports one):
  ``nn.Module.__delattr__`` is wrapped once, when the hooks are installed, to note the
  deletion as a registration event on that module, so a ``del`` costs the same as a
  registration and an unchanged model pays nothing per update whatever its size (a
  ``del`` straight from ``module._parameters`` bypasses ``__delattr__`` and is not seen
  until the next registration);
* a buffer replaced without registration (``module.to()`` assigns ``_buffers`` directly),
  or a DTensor's local shard replaced (FSDP2 after ``to()``): checked by identity on every
  update, which costs one lookup per buffer and per sharded tensor;
* ``.data`` re-pointed, ``.to()`` of the weights: the plan's groups and spans check their
  dtype, device and storage (see `emakit._engine.plan`).
"""

from __future__ import annotations

import itertools
from collections import deque
from operator import is_not
from typing import Any

from torch import Tensor, nn

from .._dist.dtensor import is_dtensor, shard_identity_getter
from .pairs import Tracked

__all__ = ["Guards", "registration_epoch"]

_counter = itertools.count(1)
_epoch = 0
_hooked: bool | None = None  # None: not tried yet; False: hooks unavailable
#: Recent registrations: (epoch, id of the module a parameter or buffer was registered on,
#: or 0 for a submodule registration, which may add tensors under any module).
_events: deque[tuple[int, int]] = deque(maxlen=4096)


def _event(owner: int) -> None:
    global _epoch
    _epoch = next(_counter)
    _events.append((_epoch, owner))


def _note(module: nn.Module, registry: str, name: str, value: object) -> None:
    if module.__dict__.get(registry, {}).get(name) is value:
        return  # the same object again (``self.step += 1`` on a buffer): nothing changed
    _event(0 if registry == "_modules" else id(module))


_REGISTRIES = ("_parameters", "_buffers", "_modules")


def _wrap_delattr() -> None:
    """Make ``del module.name`` of a parameter, buffer or submodule a registration event."""
    original = nn.Module.__delattr__

    def delattr_noting(self: nn.Module, name: str) -> None:
        registered = any(name in self.__dict__.get(r, ()) for r in _REGISTRIES)
        original(self, name)
        if registered:
            _event(id(self))

    delattr_noting.__wrapped__ = original  # type: ignore[attr-defined]
    nn.Module.__delattr__ = delattr_noting  # type: ignore[method-assign]


def _on_parameter(module: nn.Module, name: str, value: object) -> None:
    _note(module, "_parameters", name, value)


def _on_buffer(module: nn.Module, name: str, value: object) -> None:
    _note(module, "_buffers", name, value)


def _on_module(module: nn.Module, name: str, value: object) -> None:
    _note(module, "_modules", name, value)


def registration_epoch() -> int:
    """A number that changes whenever any module registers a new parameter, buffer or
    submodule (re-registering the same object does not count), or deletes one with ``del``.

    Installs torch's global registration hooks (and the ``del`` event) on first use. Where they are unavailable,
    every call returns a new number, so callers fall back to checking every time.
    """
    global _hooked, _epoch
    if _hooked is None:
        try:
            from torch.nn.modules import module as torch_module

            torch_module.register_module_parameter_registration_hook(_on_parameter)
            torch_module.register_module_buffer_registration_hook(_on_buffer)
            torch_module.register_module_module_registration_hook(_on_module)
            _wrap_delattr()
            _hooked = True
        except AttributeError:  # pragma: no cover - torch without registration hooks
            _hooked = False
    if not _hooked:  # pragma: no cover
        _event(0)
    return _epoch


def _touched(since: int, owners: set[int]) -> bool:
    """Whether a registration after epoch ``since`` may concern modules in ``owners``."""
    if not _events or _events[0][0] > since + 1:
        return True  # older events fell out of the window: assume so
    for epoch, owner in reversed(_events):
        if epoch <= since:
            return False
        if owner == 0 or owner in owners:
            return True
    return False


class Guards:
    """Identity guards over the tensors of a `Tracked` value
    (see the module docstring).

    Args:
        tracked: the plan's pairs (each may carry an ``online_slot`` and a
            ``shadow_slot``) and the ids of the modules they live in.
    """

    def __init__(self, tracked: Tracked) -> None:
        self.epoch = registration_epoch()
        always: list[tuple[Any, str, Tensor]] = []
        on_epoch: list[tuple[Any, str, Tensor]] = []
        # DTensors by their shard getter: (getter, the DTensors, their local shards)
        self.sharded: dict[Any, tuple[list[Tensor], list[object]]] = {}
        self.owners: set[int] = set(tracked.modules)
        for p in tracked.pairs:
            for slot, t in ((p.online_slot, p.online), (p.shadow_slot, p.shadow)):
                if is_dtensor(t):
                    self._watch_shard(t)
                if slot is None:
                    continue
                container, key, owner = slot
                self.owners.add(owner)
                target = on_epoch if isinstance(t, nn.Parameter) else always
                target.append((container, key, t))
        for p in tracked.shared:  # a shared shard replaced under FSDP2 (``to()``)
            if is_dtensor(p.online):
                self._watch_shard(p.online)
        self.always = always
        self.on_epoch = on_epoch

    def check(self) -> str:
        """``"stale"`` if a tracked tensor is no longer the one registered; ``"check"`` if
        something registered (or deleted) a parameter, buffer or module on one of the
        models since (the owner then compares the live pairs with the plan's, see
        `accept()`); else ``"fresh"``. Constant time for an unchanged model, apart from
        one lookup per buffer and per sharded tensor."""
        for container, key, t in self.always:
            if container.get(key) is not t:
                return "stale"
        for get, (dtensors, shards) in self.sharded.items():  # one getter, in C, per class
            if any(map(is_not, map(get, dtensors), shards)):
                return "stale"
        epoch = _epoch if _hooked else registration_epoch()  # hooks installed by __init__
        if epoch == self.epoch:
            return "fresh"
        if not self.owners or not _touched(self.epoch, self.owners):
            self.epoch = epoch  # registrations elsewhere (another model being built)
            return "fresh"
        for container, key, t in self.on_epoch:
            if container.get(key) is not t:
                return "stale"
        return "check"

    def _watch_shard(self, t: Tensor) -> None:
        get = shard_identity_getter(t)
        dtensors, shards = self.sharded.setdefault(get, ([], []))
        dtensors.append(t)
        shards.append(get(t))

    def accept(self) -> None:
        """The owner found the live tensors unchanged: stop checking until the next change."""
        self.epoch = registration_epoch()

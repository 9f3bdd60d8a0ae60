"""What the drop-ins shaped as a module share: timm's ``ModelEmaV3``, torch's
``AveragedModel`` and mmengine's averaged models.

Each is an ``nn.Module`` holding the average as ``.module`` (its state dict is ``module.*``,
as the peer's), run by ``forward``; `AveragedModule` adds the engine EMA that updates it,
kept out of the module tree, planned again after ``.to()``/``.cuda()``, and dropped from a
copy or a pickle (it holds the online model). `HostCount` mirrors a count the peer keeps in
a buffer (``n_averaged``, ``steps``) on the host, reading the buffer back only when it was
written or replaced: no host sync per update in the common case.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from ..ema import EMA

__all__ = ["AveragedModule", "HostCount"]


class AveragedModule(nn.Module):
    """An average of a model kept as ``.module``, updated by an engine EMA (see the
    module docstring). Subclasses set ``.module`` and call `attach_engine()`."""

    module: nn.Module
    _engine: EMA | None  # the engine EMA over .module (kept out of the module tree)

    def __init__(self) -> None:
        super().__init__()
        self.__dict__["_engine"] = None

    def __getstate__(self) -> dict[str, Any]:
        # the engine holds the online model: a copy builds its own at its next update
        return {**self.__dict__, "_engine": None}

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run ``.module``."""
        return self.module(*args, **kwargs)

    def attach_engine(self, model: nn.Module, count: int, **settings: Any) -> EMA:
        """A new engine EMA averaging ``model`` into ``.module``, which already holds an
        average of ``count`` updates (so the next update uses the decay after ``count``);
        ``settings`` are the EMA's other keywords."""
        engine = EMA(
            model,
            ema_model=self.module,
            update_after_step=0,
            update_every=1,
            include_online_model=False,
            **settings,
        )
        engine.tracker.reset(count)
        self.__dict__["_engine"] = engine  # not a child: the state dict stays module.*
        return engine

    def _apply(self, fn: Any, recurse: bool = True) -> nn.Module:
        if self._engine is not None:
            self._engine.tracker.invalidate()  # .to()/.cuda() replace storages: plan again
        return super()._apply(fn, recurse)


class HostCount:
    """A count the peer keeps in a tensor buffer, mirrored on the host.

    `changed()` says whether the buffer was written (``fill_(0)``, ``copy_``, a loaded
    state dict) or replaced (``.to()``, an assignment) since the count was last synced,
    by comparing the tensor's version counter, which lives on the host; only then does
    `read()` copy the value back (the one host read). A write through ``.data`` moves no
    version counter and is not seen. An inference tensor has no version counter: it is
    read every time, as the peers do.
    """

    __slots__ = ("buffer", "value", "version")

    def __init__(self) -> None:
        self.value = 0
        self.buffer: Tensor | None = None  # no buffer matches: the first update reads it
        self.version = 0

    def __getstate__(self) -> dict[str, Any]:
        # a copied or unpickled buffer has a new version counter: read it at the next update
        return {"value": self.value, "buffer": None, "version": 0}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            setattr(self, name, value)

    def changed(self, buffer: Tensor) -> bool:
        """Whether ``buffer`` is not the tensor last synced, or was written since."""
        version = version_of(buffer)
        return buffer is not self.buffer or version < 0 or version != self.version

    def read(self, buffer: Tensor) -> int:
        """Sync from ``buffer`` (a host read) and return its value."""
        self.value = int(buffer)
        self.buffer, self.version = buffer, version_of(buffer)
        return self.value

    def advanced(self, buffer: Tensor, version: int) -> None:
        """Record that this update added one to ``buffer``, whose version was ``version``
        before the update: a write of anyone else's during the update is still seen."""
        self.value += 1
        self.buffer, self.version = buffer, version + 1


def version_of(t: Tensor) -> int:
    """``t``'s version counter, which every in-place write moves (a loaded state dict
    included); -1 for an inference tensor, which has none: that never equals a version
    seen, so such a count is read at every update."""
    return -1 if t.is_inference() else t._version

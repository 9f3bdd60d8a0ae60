"""The counters of one EMA, and ema-pytorch's tensor views of two of them.

ema-pytorch keeps ``step`` and ``initted`` as tensors that clients write in place
(``ema.step += 1``, ``ema.initted.data.fill_(True)``). emakit counts with Python integers
(a skipped call costs an integer compare) and hands out tensor *views* on request:
`Counters` reads them back before the next call, so a write takes effect (also one
made through ``.data``, which no version counter sees, and one made to a view the client
dropped right after), and keeps them current after the call.

While a client holds a view every call reads it back (a few µs); once none does, calls
stop. "Holds" is the views' reference count above the one taken when nobody held them
(``sys.getrefcount``): a weak reference would lose a write made to a view dropped before
the next call, and the tensors' version counters miss writes through ``.data``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import Tensor

__all__ = ["Counters"]


def _references(views: tuple[Tensor, Tensor]) -> int:
    """How many references the views have (measured the same way every time, so that a
    count above the one taken at creation means a client holds one)."""
    step, initted = views
    return max(sys.getrefcount(step), sys.getrefcount(initted))


class Counters:
    """``step`` (calls so far), ``initted`` (the first call happened), ``last`` (the last
    averaging call) and ``gap`` (calls between the last two averaging calls), with the
    tensor views of ``step`` and ``initted`` (see the module docstring)."""

    def __init__(self) -> None:
        self.step = 0
        self.initted = False
        self.last = 0
        self.gap = 0
        self._views = (torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.bool))
        #: Whether the views were handed out and may be held (read back at each call).
        self.held = False
        self._unheld = _references(self._views)  # the count when nobody else holds them

    def step_tensor(self) -> Tensor:
        """``step`` as a CPU int64 tensor that client code may write in place; the write
        takes effect at the next call."""
        self.sync()
        self.refresh()  # both: the next sync reads both back
        self.held = True
        return self._views[0]

    def initted_tensor(self) -> Tensor:
        """``initted`` as a CPU bool tensor that client code may write in place (also
        through ``.data``); the write takes effect at the next call."""
        self.sync()
        self.refresh()
        self.held = True
        return self._views[1]

    def sync(self) -> None:
        """Take the values of handed-out views (clients may have written them), and stop
        watching them once nobody else holds them. A few µs, only after a hand-out."""
        if not self.held:
            return
        views = self._views  # no names bound to the tensors: they would count as holders
        self.step, self.initted = int(views[0]), bool(views[1])
        if _references(views) <= self._unheld:
            self.held = False

    def refresh(self) -> None:
        """Write the current values into the views."""
        step, initted = self._views
        step.fill_(self.step)
        initted.fill_(self.initted)

    def set(self, *, step: int | None = None, initted: bool | None = None) -> None:
        """Set ``step`` and/or ``initted`` (a loaded state, a client's assignment); views
        already handed out see the new values."""
        self.sync()
        if step is not None:
            self.step = step
        if initted is not None:
            self.initted = initted
        if self.held:
            self.refresh()

    def __getstate__(self) -> dict[str, Any]:
        self.sync()
        state = self.__dict__.copy()
        state["held"] = False
        return state

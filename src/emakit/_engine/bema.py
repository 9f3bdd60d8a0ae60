"""BEMA's update over an EMA's pairs, and its evaluated weights, built only when read.

A [`BEMA`][emakit.BEMA] keeps two copies of its averaged tensors: the plain EMA, which
*is* the EMA model's own tensors (the shadows), and ``theta0``, laid out like them. Its
update is therefore an EMA's: `BEMAWork` hands the EMA's [`Plan`][emakit._engine.plan.Plan]
to the runner (inline, background thread, CUDA side stream: the plan snapshots what the
background reads), and after a copy (the first call, ``t == update_after``) sets
``theta0`` to the copied shadows:

.. math:: \\text{ema} \\leftarrow \\text{ema} + \\beta_t(\\theta_t - \\text{ema})

The evaluated weights ``ema + alpha * (theta - theta0)`` are built only when something
reads the EMA model (`BEMAWork.build()`): the plain EMA moves into a *stash* allocated
then, and the shadows take

.. math:: \\text{out} \\leftarrow ((\\theta - \\theta_0)\\,\\alpha) + \\text{ema}

from the model's weights ``theta`` read then, on the caller's thread, in TRL's order of
operations (so ``out`` has TRL's bits for a given ``ema``). `BEMAWork.restore()` puts the
plain EMA back and frees the stash before the next update. The arithmetic runs over
spans (`emakit._engine.flat`): one kernel per run of memory-adjacent tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from .._dist.dtensor import local_tensor
from .flat import memory_order, span, split_runs
from .pairs import TensorPair
from .paths import no_autograd
from .plan import Plan

if TYPE_CHECKING:
    from ..decay import Action


def held(p: TensorPair) -> bool:
    """Whether an averaged pair is a frozen weight that BEMA holds as it was copied (a
    frozen weight the EMA could not share, e.g. offloaded: TRL's ``running_model`` holds
    those too): no ``theta0``, no correction, until it is trained again."""
    online = p.online
    return p.average and isinstance(online, nn.Parameter) and not online.requires_grad


def state_order(pairs: Sequence[TensorPair]) -> list[TensorPair]:
    """The averaged pairs BEMA corrects, in the memory order of their shadows, the order
    in which the ``theta0`` tensors are laid out (so they form the same spans)."""
    averaged = [p for p in pairs if p.average and not held(p)]
    return sorted(averaged, key=lambda p: memory_order(local_tensor(p.shadow)))


class BEMAWork:
    """A BEMA's update and evaluated weights over a plan's pairs (see the module docstring).

    Args:
        plan: the EMA's plan; its pairs' shadow tensors hold the plain EMA.
        theta0: ``theta0`` of every corrected pair (`state_order()`), by name, laid out
            like the shadows (DTensors: this rank's shard).
    """

    def __init__(self, plan: Plan, theta0: Mapping[str, Tensor]) -> None:
        self.plan = plan
        #: The corrected pairs' shadows (the EMA) and online tensors, one per pair.
        self.shadows: list[Tensor] = []
        self.onlines: list[Tensor] = []
        self.ema: list[Tensor] = []  # spans of the shadows
        self.theta0: list[Tensor] = []  # spans of theta0, alike
        #: name -> (span, offset in it, index in `shadows`) of each corrected tensor: its
        #: place in a stash.
        self.where: dict[str, tuple[int, int, int]] = {}
        by_key: dict[tuple[Any, ...], list[TensorPair]] = {}
        for p in state_order(plan.pairs):
            s = local_tensor(p.shadow)
            by_key.setdefault((s.device, s.dtype), []).append(p)
        for group in by_key.values():
            shadows = [local_tensor(p.shadow) for p in group]
            starts = [theta0[p.name] for p in group]
            for run in split_runs([shadows, starts]):  # memory-adjacent in both
                first = shadows[run[0]]
                for i in run:
                    offset = int(shadows[i].storage_offset() - first.storage_offset())
                    self.where[group[i].name] = (len(self.ema), offset, len(self.where))
                self.ema.append(span([shadows[i] for i in run]))
                self.theta0.append(span([starts[i] for i in run]))
            self.shadows += shadows
            self.onlines += [local_tensor(p.online) for p in group]
        self.held = [p.online for p in plan.pairs if held(p)]
        #: Whether the online tensors live on a CUDA device (snapshots are non-blocking).
        self.on_accelerator = plan.on_accelerator

    def thawed(self) -> bool:
        """Whether a held frozen weight is trainable again (the work must be rebuilt)."""
        return any(t.requires_grad for t in self.held)

    # -- the update: the plan's, then theta0 after a copy ----------------------------------

    def run(self, action: Action) -> None:
        """Carry out ``action`` now."""
        self.plan.run(action)
        self._after(action)

    def stage(self, *, non_blocking: bool = False, guard: Any = None) -> None:
        """Snapshot the online tensors into the plan's staging buffers (what a background
        runner reads later: the model is never read after ``update()`` returns)."""
        self.plan.stage(non_blocking=non_blocking, guard=guard)

    def finish(self, action: Action) -> None:
        """The arithmetic of ``action`` from the snapshot: the EMA's ``lerp_`` (``"lerp"``,
        ``beta_t = action.weights[0]``), or a copy that also sets ``theta0``."""
        self.plan.finish(action)
        self._after(action)

    def _after(self, action: Action) -> None:
        if action.kind in ("init", "copy") and self.ema:
            with no_autograd(True):
                torch._foreach_copy_(self.theta0, self.ema)  # theta0 = the copy, its dtype

    # -- the evaluated weights -------------------------------------------------------------

    def versions(self) -> list[tuple[int, int]]:
        """What the evaluated weights were built from: each online tensor's storage and
        version counter (any in-place write, e.g. an optimizer step, bumps it)."""
        return [(t.data_ptr(), t._version) for t in self.onlines]

    def build(self, alpha: float, stash: list[Tensor] | None) -> list[Tensor]:
        """Write ``ema + alpha * (theta - theta0)`` into the shadows, ``theta`` the model's
        weights now (cast to the shadows' dtype and device). ``stash`` holds the plain EMA
        (from an earlier build); None moves it into a new stash first. Returns the stash."""
        if stash is None:  # made outside inference mode: the state dict may hand it out
            stash = [torch.empty_like(s) for s in self.ema]
            with no_autograd(True):
                if stash:
                    torch._foreach_copy_(stash, self.ema)
        with no_autograd(True):
            if not self.ema:  # nothing corrected (foreach kernels refuse empty lists)
                return stash
            if alpha == 0.0:  # before the first averaging update: the EMA itself
                torch._foreach_copy_(self.ema, stash)
                return stash
            torch._foreach_copy_(self.shadows, self.onlines)
            torch._foreach_sub_(self.ema, self.theta0)
            torch._foreach_mul_(self.ema, alpha)
            torch._foreach_add_(self.ema, stash)
        return stash

    def restore(self, stash: list[Tensor]) -> None:
        """Put the plain EMA back into the shadows from ``stash`` (see `build()`)."""
        if stash:
            with no_autograd(True):
                torch._foreach_copy_(self.ema, stash)

    def stashed(self, stash: list[Tensor]) -> dict[str, Tensor]:
        """The plain EMA of each corrected tensor, by name: views of ``stash``."""
        out = {}
        for name, (r, offset, i) in self.where.items():
            s, like = stash[r], self.shadows[i]
            alone = self.ema[r] is like  # a span of one tensor is the tensor itself
            out[name] = s if alone else s.narrow(0, offset, like.numel()).view(like.shape)
        return out

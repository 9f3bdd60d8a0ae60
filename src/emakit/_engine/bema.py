"""BEMA's update over an EMA's pairs: the EMA, ``theta0`` and the evaluated weights.

A `BEMAWork` is the work a runner runs for a [`BEMA`][emakit.BEMA] (see
`emakit._engine.runners`). Over the averaged tensors, grouped by device and dtype, it
keeps three lists laid out alike, one span per run of memory-adjacent tensors:

* ``out``: the evaluated (bias-corrected) weights, which are the EMA model's own tensors
  (so ``swap()``, ``ema(x)`` and every export read them);
* ``ema``: the plain EMA;
* ``theta0``: the weights at ``update_after``;

and a source per span: the online tensors themselves when they already form the same span
in the same dtype and device, else a staging buffer laid out like the shadow (pinned when
the values come from an accelerator), allocated once. An averaging update is five
foreach kernels and allocates nothing:

.. math:: \\text{ema} \\leftarrow \\text{ema} + \\beta_t(\\theta_t - \\text{ema}),\\qquad
   \\text{out} \\leftarrow ((\\theta_t - \\theta_0)\\,\\alpha_t) + \\text{ema}

The second line is TRL's ``ema + alpha * (thetat - theta0)`` in TRL's order of operations,
so ``out`` has TRL's bits for a given ``ema``; the first is one ``lerp_`` where TRL does
``ema.mul_(1 - beta).add_(theta, alpha=beta)`` (the two agree to float rounding). A copy
action (the first call, or ``t == update_after``) sets all three to the online values.
Tensors that are copied rather than averaged (integer buffers, no-EMA names) are copied
into the EMA model on every update and every copy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from .._dist.dtensor import local_tensor
from .flat import memory_order
from .pairs import TensorPair
from .paths import pair_spans
from .plan import Plan

if TYPE_CHECKING:
    from ..decay import Action


def held(p: TensorPair) -> bool:
    """Whether an averaged pair is a frozen weight that BEMA holds as it was copied (a
    frozen weight the EMA could not share, e.g. offloaded: TRL's ``running_model`` holds
    those too): no ``theta0``, no EMA, no work until it is trained again."""
    online = p.online
    return p.average and isinstance(online, nn.Parameter) and not online.requires_grad


def state_order(pairs: Sequence[TensorPair]) -> list[TensorPair]:
    """The averaged pairs BEMA works on, in the memory order of their shadows, the order
    in which the EMA and ``theta0`` tensors are laid out (so they form the same spans)."""
    averaged = [p for p in pairs if p.average and not held(p)]
    return sorted(averaged, key=lambda p: memory_order(local_tensor(p.shadow)))


class BEMAWork:
    """The BEMA update of a plan's pairs (see the module docstring), runnable by any runner.

    Args:
        plan: the EMA's plan: its pairs' shadow tensors are the evaluated weights, and it
            copies the pairs that are never averaged.
        ema: the EMA tensor of each averaged pair, by name, laid out in
            `state_order()` (DTensors: this rank's shard).
        theta0: ``theta0`` likewise.
    """

    def __init__(self, plan: Plan, ema: Mapping[str, Tensor], theta0: Mapping[str, Tensor]) -> None:
        self.plan = plan
        by_key: dict[tuple[Any, ...], list[TensorPair]] = {}
        for p in state_order(plan.pairs):
            s = local_tensor(p.shadow)
            by_key.setdefault((s.device, s.dtype), []).append(p)
        #: Spans of the evaluated weights, the EMA and ``theta0``, and what each reads (the
        #: online tensors, or the staging buffer), every group's; the copies that gather.
        self.out: list[Tensor] = []
        self.ema: list[Tensor] = []
        self.theta0: list[Tensor] = []
        self.src: list[Tensor] = []
        self.gathers: list[tuple[list[Tensor], list[Tensor]]] = []
        for members in by_key.values():
            outs = [local_tensor(p.shadow) for p in members]
            onlines = [local_tensor(p.online) for p in members]
            staged = any(o.dtype != outs[0].dtype or o.device != outs[0].device for o in onlines)
            states = [outs, [ema[p.name] for p in members], [theta0[p.name] for p in members]]
            (out, ema_spans, theta0_spans), src, gather_dst, gather_src = pair_spans(
                states, onlines, staged=staged
            )
            self.out += out
            self.ema += ema_spans
            self.theta0 += theta0_spans
            self.src += src
            self.gathers.append((gather_dst, gather_src))
        self.held = [p.online for p in plan.pairs if held(p)]
        #: Whether the online tensors live on a CUDA device (snapshots are non-blocking).
        self.on_accelerator = plan.on_accelerator

    def thawed(self) -> bool:
        """Whether a held frozen weight is trainable again (the work must be rebuilt)."""
        return any(t.requires_grad for t in self.held)

    def run(self, action: Action) -> None:
        """Carry out ``action`` now."""
        self.stage()
        self.finish(action)

    @torch.no_grad()
    def stage(self, *, non_blocking: bool = False, guard: Any = None) -> None:
        """Copy the never-averaged tensors into the EMA model and snapshot the averaged
        ones into the staging buffers (where they are staged)."""
        self.plan.copy_unaveraged()
        for dst, src in self.gathers:
            if dst:
                torch._foreach_copy_(dst, src, non_blocking=non_blocking)

    @torch.no_grad()
    def finish(self, action: Action) -> None:
        """The arithmetic of ``action`` from the snapshot (``"lerp"``: BEMA's update with
        ``beta_t = action.weights[0]`` and ``alpha_t = action.bias``; ``"init"`` and
        ``"copy"``: snapshot ``theta0``, the EMA and the output)."""
        if not self.out:  # nothing averaged (foreach kernels refuse empty lists)
            return
        if action.kind == "lerp":
            torch._foreach_lerp_(self.ema, self.src, action.weights[0])
            torch._foreach_copy_(self.out, self.src)
            torch._foreach_sub_(self.out, self.theta0)
            torch._foreach_mul_(self.out, action.bias)
            torch._foreach_add_(self.out, self.ema)
        elif action.kind in ("init", "copy"):
            for dst in (self.theta0, self.ema, self.out):
                torch._foreach_copy_(dst, self.src)

"""Update kernels: ``shadow <- shadow + w * (online - shadow)`` over lists of tensors.

Every implementation computes exactly what ``torch.Tensor.lerp_`` computes for each
pair, so all of them agree bit for bit with the reference loop (and with ema-pytorch,
which calls ``lerp_`` per tensor). They differ only in how many kernels they launch and
how much Python runs per tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from ..errors import EMAValueError

Impl = Literal["loop", "foreach", "flat"]
IMPLS: tuple[str, ...] = ("loop", "foreach", "flat")


def _check(impl: str, names: str, a: Sequence[Tensor], b: Sequence[Tensor]) -> None:
    if impl not in IMPLS:
        raise EMAValueError(f"impl must be one of {IMPLS}, got {impl=!r}")
    if len(a) != len(b):
        x, y = names.split()
        raise EMAValueError(
            f"{x} and {y} must pair one to one, got len({x})={len(a)} and len({y})={len(b)}"
        )


def copy_each(dsts: Sequence[Tensor], srcs: Sequence[Tensor]) -> None:
    """The reference copy: one ``copy_`` per pair (casting as needed)."""
    for d, s in zip(dsts, srcs, strict=True):
        d.copy_(s)


def single_tensor_lerp(shadows: Sequence[Tensor], onlines: Sequence[Tensor], weight: float) -> None:
    """The reference kernel: one ``lerp_`` per pair, exactly as ema-pytorch's loop."""
    for s, o in zip(shadows, onlines, strict=True):
        s.lerp_(o.to(s.device, s.dtype), weight)  # .to() is a no-op where they match


def multi_tensor_lerp(shadows: Sequence[Tensor], onlines: Sequence[Tensor], weight: float) -> None:
    """One ``torch._foreach_lerp_`` over all pairs (onlines cast/moved where they differ)."""
    if shadows:
        onlines = [o.to(s.device, s.dtype) for s, o in zip(shadows, onlines, strict=True)]
        torch._foreach_lerp_(list(shadows), onlines, weight)


def ema_lerp_(
    shadows: Sequence[Tensor],
    onlines: Sequence[Tensor],
    weight: float,
    *,
    impl: Impl = "foreach",
) -> None:
    """Move each shadow tensor toward its online tensor, in place.

    .. math:: s \\leftarrow s + w\\,(o - s) = \\beta s + (1 - \\beta) o, \\quad w = 1 - \\beta

    Args:
        shadows: tensors updated in place (the EMA weights).
        onlines: tensors read (the training weights), paired with ``shadows`` by position;
            cast/moved to each shadow's dtype and device when they differ.
        weight: ``w = 1 - decay`` in ``[0, 1]``; a Python float, so no host sync happens.
        impl: ``"loop"`` (reference), ``"foreach"`` (one ``torch._foreach_lerp_``) or
            ``"flat"`` (the caller already passes coalesced spans; runs like ``"foreach"``).
            Default ``"foreach"``.

    Example:
        >>> s, o = [torch.zeros(3)], [torch.ones(3)]
        >>> ema_lerp_(s, o, 0.25)
        >>> s[0]
        tensor([0.2500, 0.2500, 0.2500])
    """
    _check(impl, "shadows onlines", shadows, onlines)
    with torch.no_grad():
        (single_tensor_lerp if impl == "loop" else multi_tensor_lerp)(shadows, onlines, weight)


def ema_copy_(dsts: Sequence[Tensor], srcs: Sequence[Tensor], *, impl: Impl = "foreach") -> None:
    """Copy each source into its destination in place (``dst.copy_(src)``, casting as needed).

    Args:
        dsts: tensors written.
        srcs: tensors read, paired with ``dsts`` by position.
        impl: ``"loop"`` for one ``copy_`` per pair, otherwise one ``torch._foreach_copy_``.
            Default ``"foreach"``.
    """
    _check(impl, "dsts srcs", dsts, srcs)
    if dsts:
        with torch.no_grad():
            (copy_each if impl == "loop" else torch._foreach_copy_)(list(dsts), list(srcs))

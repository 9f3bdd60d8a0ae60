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
from .spans import aligned_offsets, span, split_runs

__all__ = [
    "GUARD_CHUNK",
    "IMPLS",
    "Impl",
    "ema_copy_",
    "ema_lerp_",
    "guarded_copy_",
    "guarded_lerp_",
]

Impl = Literal["loop", "foreach", "flat"]
IMPLS: tuple[str, ...] = ("loop", "foreach", "flat")

#: Elements per batch of a guarded update (:func:`guarded_lerp_`): the most scratch memory
#: it holds at once is this many elements of the shadow's dtype (16 MiB in float32).
GUARD_CHUNK = 1 << 22


def _check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise EMAValueError(f"impl must be one of {IMPLS}, got {impl=!r}")


def _converted(srcs: Sequence[Tensor], dsts: Sequence[Tensor]) -> list[Tensor]:
    """``srcs`` moved/cast to each destination's device and dtype (no copy when equal)."""
    return [
        s if (s.dtype == d.dtype and s.device == d.device) else s.to(d.device, d.dtype)
        for s, d in zip(srcs, dsts, strict=True)
    ]


def single_tensor_lerp(shadows: Sequence[Tensor], onlines: Sequence[Tensor], weight: float) -> None:
    """The reference kernel: one ``lerp_`` per pair, exactly as ema-pytorch's loop."""
    for s, o in zip(shadows, onlines, strict=True):
        if o.dtype != s.dtype or o.device != s.device:
            o = o.to(s.device, s.dtype)
        s.lerp_(o, weight)


def multi_tensor_lerp(shadows: Sequence[Tensor], onlines: Sequence[Tensor], weight: float) -> None:
    """One ``torch._foreach_lerp_`` over all pairs (onlines cast/moved where they differ)."""
    if shadows:
        torch._foreach_lerp_(list(shadows), _converted(onlines, shadows), weight)


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
    _check_impl(impl)
    if len(shadows) != len(onlines):
        raise EMAValueError(
            f"shadows and onlines must pair one to one, got {len(shadows)=} and {len(onlines)=}"
        )
    with torch.no_grad():
        if impl == "loop":
            single_tensor_lerp(shadows, onlines, weight)
        else:
            multi_tensor_lerp(shadows, onlines, weight)


def ema_copy_(dsts: Sequence[Tensor], srcs: Sequence[Tensor], *, impl: Impl = "foreach") -> None:
    """Copy each source into its destination in place (``dst.copy_(src)``, casting as needed).

    Args:
        dsts: tensors written.
        srcs: tensors read, paired with ``dsts`` by position.
        impl: ``"loop"`` for one ``copy_`` per pair, otherwise one ``torch._foreach_copy_``.
            Default ``"foreach"``.
    """
    _check_impl(impl)
    if len(dsts) != len(srcs):
        raise EMAValueError(
            f"dsts and srcs must pair one to one, got {len(dsts)=} and {len(srcs)=}"
        )
    if not dsts:
        return
    with torch.no_grad():
        if impl == "loop":
            for d, s in zip(dsts, srcs, strict=True):
                d.copy_(s)
        else:
            torch._foreach_copy_(list(dsts), list(srcs))


# -- guarded kernels: the update happens only if a device-side flag says so ----------------


def _pieces(dsts: Sequence[Tensor], srcs: Sequence[Tensor]) -> list[tuple[Tensor, Tensor]]:
    """Non-empty ``(dst, src)`` pairs, tensors over :data:`GUARD_CHUNK` elements cut into
    1-D chunks (when both sides are contiguous)."""
    out = []
    for d, s in zip(dsts, srcs, strict=True):
        n = d.numel()
        if n == 0:
            continue
        if n <= GUARD_CHUNK or not (d.is_contiguous() and s.is_contiguous()):
            out.append((d, s))
            continue
        fd, fs = d.view(-1), s.reshape(-1)
        for at in range(0, n, GUARD_CHUNK):
            size = min(GUARD_CHUNK, n - at)
            out.append((fd.narrow(0, at, size), fs.narrow(0, at, size)))
    return out


def _batches(pieces: list[tuple[Tensor, Tensor]]) -> list[list[tuple[Tensor, Tensor]]]:
    """``pieces`` in consecutive batches of one destination device and dtype and at most
    about :data:`GUARD_CHUNK` elements."""
    batches: list[list[tuple[Tensor, Tensor]]] = []
    size, key = GUARD_CHUNK, None
    for d, s in pieces:
        if size + d.numel() > GUARD_CHUNK or (d.device, d.dtype) != key:
            batches.append([])
            size, key = 0, (d.device, d.dtype)
        batches[-1].append((d, s))
        size += d.numel()
    return batches


class _Batch:
    """One batch of a :class:`Guarded`: destinations, sources, and scratch views."""

    def __init__(self, pairs: list[tuple[Tensor, Tensor]]) -> None:
        self.dsts = [d for d, _ in pairs]
        self.srcs = [s for _, s in pairs]
        first = self.dsts[0]
        self.key = (first.device, first.dtype)
        self.convert = any((s.device, s.dtype) != self.key for s in self.srcs)
        # one where() over the destinations when they are one run in memory; the scratch
        # then mirrors their layout, alignment padding included
        contiguous = first.is_contiguous() and len(split_runs(self.dsts)) == 1
        self.flat = span(self.dsts).view(-1) if contiguous else None
        base = first.storage_offset()
        self.at = [
            d.storage_offset() - base if contiguous else at
            for d, at in zip(
                self.dsts, aligned_offsets([d.numel() for d in self.dsts]), strict=True
            )
        ]
        self.numel = self.at[-1] + self.dsts[-1].numel()
        self.new = first  # set by place(): the scratch as one 1-D view, and per tensor
        self.views: list[Tensor] = []

    def place(self, buf: Tensor) -> None:
        self.new = buf.narrow(0, 0, self.numel)
        for d, at in zip(self.dsts, self.at, strict=True):
            self.views.append(buf.narrow(0, at, d.numel()).view(d.shape))

    def select(self, ok: Tensor) -> None:
        """``dst = where(ok, scratch, dst)``: every bit of the scratch, or of the old dst."""
        if self.flat is not None:
            torch.where(ok, self.new, self.flat, out=self.flat)
            return
        for d, t in zip(self.dsts, self.views, strict=True):
            torch.where(ok, t, d, out=d)


def _memory_order(pair: tuple[Tensor, Tensor]) -> tuple[str, str, int, int]:
    d = pair[0]
    return str(d.device), str(d.dtype), d.untyped_storage().data_ptr(), int(d.storage_offset())


class Guarded:
    """Pairs of tensors prepared for updates that happen only where a device-side flag
    says so (``skip_nonfinite=True``); build once, call :meth:`lerp` / :meth:`copy` often.

    .. math:: s \\leftarrow \\text{where}(ok,\\ \\text{lerp}(s, o, w),\\ s)

    A select, not ``lerp_`` with the weight multiplied by ``ok``: ``s + 0 * (o - s)`` is NaN
    where ``o`` is NaN or Inf. Each batch of at most :data:`GUARD_CHUNK` elements is copied
    into a scratch buffer, averaged there by the same ``lerp_`` (one foreach copy, one
    foreach lerp), then selected back: one ``where`` per batch when the shadows are one run
    in memory (emakit lays a shadow out so), else one per tensor. With ``ok`` true the
    result is bit for bit ``shadow.lerp_(online, weight)``; with ``ok`` false every shadow
    keeps every bit (``-0.0`` included). Large tensors go in chunks. The scratch, held for
    the object's life, is one buffer per device and dtype of at most
    :data:`GUARD_CHUNK` elements (16 MiB in float32), less for smaller models.

    Args:
        dsts: tensors updated in place (the shadow).
        srcs: tensors read, paired by position (cast/moved to the destination's dtype and
            device where they differ, at each call).
    """

    def __init__(self, dsts: Sequence[Tensor], srcs: Sequence[Tensor]) -> None:
        # In memory order (the pairs are independent): neighbours in a shadow's storage
        # end up in one batch, updated by one where() whatever order the model lists them.
        pieces = sorted(_pieces(dsts, srcs), key=_memory_order)
        self.batches = [_Batch(b) for b in _batches(pieces)]
        sizes: dict[tuple[torch.device, torch.dtype], int] = {}
        for b in self.batches:
            sizes[b.key] = max(sizes.get(b.key, 0), b.numel)
        # zeros: the padding between views is selected into the shadow's padding
        bufs = {k: torch.zeros(n, dtype=k[1], device=k[0]) for k, n in sizes.items()}
        for b in self.batches:
            b.place(bufs[b.key])

    def lerp(self, weight: float, ok: Tensor) -> None:
        """``dst.lerp_(src, weight)`` where the 0-dim bool ``ok`` is true, else nothing."""
        flag = _OnDevice(ok)
        with torch.no_grad():
            for b in self.batches:
                torch._foreach_copy_(b.views, b.dsts)
                srcs = _converted(b.srcs, b.dsts) if b.convert else b.srcs
                torch._foreach_lerp_(b.views, srcs, weight)
                b.select(flag(b.key[0]))

    def copy(self, ok: Tensor) -> None:
        """``dst.copy_(src)`` where the 0-dim bool ``ok`` is true, else nothing."""
        flag = _OnDevice(ok)
        with torch.no_grad():
            for b in self.batches:
                torch._foreach_copy_(b.views, b.srcs)  # casts as copy_ does
                b.select(flag(b.key[0]))


class _OnDevice:
    """``ok`` on each destination device, moved once per call (no host sync: a 0-dim copy)."""

    def __init__(self, ok: Tensor) -> None:
        self.by_device = {ok.device: ok}

    def __call__(self, device: torch.device) -> Tensor:
        flag = self.by_device.get(device)
        if flag is None:
            flag = self.by_device[device] = self.by_device[next(iter(self.by_device))].to(
                device, non_blocking=True
            )
        return flag


def guarded_lerp_(
    shadows: Sequence[Tensor], onlines: Sequence[Tensor], weight: float, ok: Tensor
) -> None:
    """``shadow.lerp_(online, weight)`` for every pair where the 0-dim bool tensor ``ok`` is
    true; where it is false every shadow keeps its bits. No host sync: ``ok`` stays on the
    device. A one-off :class:`Guarded` (build one to update the same tensors often).

    Args:
        shadows: tensors updated in place.
        onlines: tensors read, paired by position (cast/moved to the shadow's dtype and
            device where they differ).
        weight: ``1 - decay``.
        ok: 0-dim bool tensor: average (true) or leave every shadow unchanged (false).

    Example:
        >>> s, o = [torch.zeros(2)], [torch.tensor([1.0, float("nan")])]
        >>> guarded_lerp_(s, o, 0.5, torch.tensor(False))
        >>> s[0]
        tensor([0., 0.])
    """
    Guarded(shadows, onlines).lerp(weight, ok)


def guarded_copy_(dsts: Sequence[Tensor], srcs: Sequence[Tensor], ok: Tensor) -> None:
    """``dst.copy_(src)`` for every pair where the 0-dim bool tensor ``ok`` is true; else
    nothing changes (see :func:`guarded_lerp_`)."""
    Guarded(dsts, srcs).copy(ok)

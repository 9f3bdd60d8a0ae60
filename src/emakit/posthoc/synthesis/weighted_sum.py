"""The streamed weighted sum of snapshots, for one or many targets, whole or by blocks.

Karras et al. 2024 (arXiv:2312.02696, §3.2 and Algorithm 3): a synthesized EMA is
``sum_i w_i * snapshot_i``, with the float64 weights of
[`solve_weights()`][emakit.posthoc.math.solve_weights]. `weighted_sums()` computes that sum for
several weight vectors at once (a sweep: each snapshot is read once and its tensors added
into every target), and for a *region* of every tensor: the whole tensor (one process), or
the block a rank holds of a sharded model (synthesis on the ranks, on as many ranks as
wrote the snapshots or on another number: the blocks are cut out of whichever rank files
overlap them, as a ``torch.distributed.checkpoint`` load reshards). Rectangular blocks
(DTensor shards) and flat ranges (ZeRO-3 partitions) combine through
[`align()`][emakit.posthoc.snapshots.shards.align]: where one side is a flat range, both are taken as
ranges of the flattened tensor.

Memory is the outputs (one float32 accumulator per target and tensor, of the region's
size) plus one stored tensor (or one rank's block of it) at a time: one file is open at a
time (with its side file, see `emakit.posthoc.snapshots.frozen`), and a rank reads only the
files that overlap its blocks, its own first. Frozen tensors that snapshots share through
their side files are read once, with the sum of those snapshots' weights (of a sharded set:
those that no rank keeps in its own file).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from ...errors import EMAStateError
from ..math import PostHocWarning
from ..snapshots.format import SnapshotInfo, snapshot_sources
from ..snapshots.shards import Block, align, intersect

__all__ = ["Target", "weighted_sums"]

#: Elements added per call when the stored dtype differs from the accumulator's: the cast
#: float16 -> float32 goes through a temporary of this size, not of the whole tensor.
ADD_CHUNK = 1 << 20


def _add(dst: Tensor, src: Tensor, alpha: float) -> None:
    """``dst += alpha * src``, in row blocks of about `ADD_CHUNK` elements when a
    cast is needed (torch casts ``src`` into a temporary the size of what it adds)."""
    if src.dtype == dst.dtype or src.dim() == 0 or src.numel() <= ADD_CHUNK:
        dst.add_(src, alpha=alpha)
        return
    rows = max(1, ADD_CHUNK // max(1, src[0].numel()))
    for d, s in zip(dst.split(rows), src.split(rows), strict=True):
        d.add_(s, alpha=alpha)


@dataclass(frozen=True)
class Piece:
    """The part of one stored tensor that falls in a region, and where it goes.

    Attributes:
        stored: the stored tensor (its whole block, as the file holds it).
        src: the index of the part in ``stored`` (flattened when ``flat``).
        dst: the index of the part in the region's tensor (flattened when ``flat``).
        flat: whether both indices are into the flattened tensors (a flat range on one
            side, see [`align()`][emakit.posthoc.snapshots.shards.align]).
        whole: whether the part is the whole stored tensor and the whole region.
    """

    stored: Tensor
    src: tuple[slice, ...]
    dst: tuple[slice, ...]
    flat: bool
    whole: bool

    def part(self, stored: Tensor | None = None) -> Tensor:
        """The part, cut out of ``stored`` (default: `stored` as read)."""
        x = self.stored if stored is None else stored
        return (x.reshape(-1) if self.flat else x)[self.src]

    def into(self, region: Tensor) -> Tensor:
        """Where the part goes in ``region`` (a tensor of the region's shape), a view."""
        return (region.view(-1) if self.flat else region)[self.dst]


class Target(Protocol):
    """One reconstruction in a pass over the snapshots (a
    [`SynthesisPlan`][emakit.posthoc.synthesis.plan.SynthesisPlan] is one).

    Attributes:
        weights: one float64 weight per snapshot of the pass, in its order.
        buffers_from: the snapshot whose copied tensors (buffers, integer tensors) it takes.
    """

    @property
    def weights(self) -> tuple[float, ...]: ...

    @property
    def buffers_from(self) -> SnapshotInfo: ...


def _exact(
    snap: SnapshotInfo, name: str, value: Tensor, fill: Mapping[str, Tensor] | None
) -> Tensor:
    """``value`` of ``name`` from ``snap`` in its exact dtype: an ema-pytorch file stored
    integer and bool tensors as floats (rounded back here); one that overflowed is lost,
    and taken from ``fill`` (the model's current value) with a warning, or refused."""
    dtype = dict(snap.exact_dtypes).get(name)
    if dtype is None or value.dtype == dtype:
        return value
    if not value.is_floating_point():
        return value.to(dtype)
    if bool(torch.isfinite(value).all()):
        return value.round().to(dtype)
    why = (
        f"ema-pytorch stored the integer tensor {name!r} in float16 (its checkpoint_dtype) and "
        f"it overflowed to inf in {snap.path}: its value is lost"
    )
    if fill is None or name not in fill:
        raise EMAStateError(
            f"{why}. Synthesize at a step whose latest snapshot is an emakit one, or with "
            f"PostHocEMA.synthesize_ema_model, which keeps the model's current value"
        )
    warnings.warn(f"{why}; keeping the model's current value", PostHocWarning, stacklevel=5)
    return fill[name].detach().to("cpu", copy=True)


def _mismatch(have: Mapping[str, Any], want: Mapping[str, Any]) -> str:
    """How the tensors ``have`` (name -> shape) differ from ``want``: the names it lacks
    and adds, the shapes that differ; ``""`` when they match."""
    lacks, adds = sorted(want.keys() - have.keys()), sorted(have.keys() - want.keys())
    both = sorted(have.keys() & want.keys())
    shapes = [f"{n!r} has shape {have[n]}, not {want[n]}" for n in both if have[n] != want[n]]
    if not (lacks or adds or shapes):
        return ""
    return "; ".join([f"lacks {lacks[:10]}", f"has {adds[:10]}", *shapes[:3]])


@dataclass
class _Pass:
    """One pass over snapshots: the tensors' names and global shapes (learned from the
    first file read, which every later one must match), the region of each to build, and
    the pieces of the stored tensors that fall in them.

    Attributes:
        wanted: name -> the block of each tensor to build; None: every tensor whole.
        rank: the caller's rank, whose files of a sharded snapshot are read first.
        model_shapes: the model's global shape of each tensor in ``wanted``.
        base: the first snapshot read (None until then).
        shapes: the tensors' global shapes, learned from ``base``.
        regions: name -> the block of each tensor built.
    """

    wanted: Mapping[str, Block] | None
    rank: int | None
    model_shapes: Mapping[str, tuple[int, ...]]
    base: SnapshotInfo | None = None
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    regions: dict[str, Block] = field(default_factory=dict)

    def _learn(self, snap: SnapshotInfo, shapes: dict[str, tuple[int, ...]]) -> None:
        """Take the names and global shapes from the first file, checked against the model's."""
        self.base, self.shapes = snap, shapes
        if self.wanted is None:
            self.regions = {n: Block.whole(s) for n, s in shapes.items()}
            return
        model = {n: tuple(self.model_shapes.get(n, shapes.get(n, ()))) for n in self.wanted}
        why = _mismatch(model, shapes)
        if why:
            raise EMAStateError(
                f"the snapshots do not match the model ({snap.path} and those like it): the "
                f"model {why}"
            )
        self.regions = dict(self.wanted)

    def visit(
        self,
        snap: SnapshotInfo,
        names: set[str] | Callable[[set[str]], set[str]],
        use: Callable[[str, Piece], None],
    ) -> None:
        """Call ``use(name, piece)`` for every stored block of ``names`` in ``snap`` that
        overlaps its region (the `Piece` says what part and where it goes); files are
        read until every region is covered. ``names`` may be a function of the model's
        names, for the first visit (which learns them).

        Raises:
            EMAStateError: ``snap`` does not hold the tensors (names, global shapes, copied
                names) of the first snapshot read.
        """
        need: dict[str, int] | None = None
        for f, layout in snapshot_sources(snap, first=self.rank):
            if need is None:
                shapes = {n: shape for n, (shape, _) in layout.items()}
                if self.base is None:
                    self._learn(snap, shapes)
                base: Any = self.base
                why = _mismatch(shapes, self.shapes)
                if why or snap.copied != base.copied:
                    raise EMAStateError(
                        f"snapshot {snap.path} does not hold the same tensors as {base.path}: "
                        f"it {why or 'copies other names'}; keep only snapshots of one model in "
                        f"the folder"
                    )
                wanted = names(set(shapes)) if callable(names) else names
                need = {n: self.regions[n].numel for n in wanted}
            for name, left in need.items():
                shape, block = layout[name]
                if block is None or left == 0:
                    continue
                region, block = align(self.regions[name], block, shape, name)
                common = intersect(block, region)
                if common is not None:
                    whole = block == region == common
                    src, dst = block.slices(common), region.slices(common)
                    use(name, Piece(f.get(name), src, dst, region.flat, whole))
                    need[name] -= common.numel
            if not any(need.values()):
                break


def weighted_sums(
    snapshots: Sequence[SnapshotInfo],
    targets: Sequence[Target],
    *,
    regions: Mapping[str, Block] | None = None,
    rank: int | None = None,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
    dtype: torch.dtype | None = torch.float32,
    fill: Mapping[str, Tensor] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[dict[str, Tensor]]:
    """Stream ``snapshots`` once into one state dict per target.

    .. math:: \\hat\\theta_k = \\sum_i w_{k,i}\\,\\hat\\theta_i

    (arXiv:2312.02696, §3.2), accumulated in float32 (complex64 for complex tensors); the
    tensors a snapshot records as copied come from each target's ``buffers_from``, exactly.

    Args:
        snapshots: the snapshots, in the order of every target's weights.
        targets: the reconstructions (weights and buffer source each).
        regions: name -> the block of each tensor to compute (a rank's shard). Default
            None: every tensor whole.
        rank: the caller's rank: for sharded snapshots its file is read first.
        shapes: name -> the model's global shape of each tensor in ``regions``, checked
            against the snapshots'. Default None: not checked.
        dtype: dtype of the averaged tensors returned; None keeps the stored dtype.
        fill: values for integer tensors an ema-pytorch file lost (see
            [`SynthesisPlan.run()`][emakit.posthoc.synthesis.plan.SynthesisPlan.run]).
        progress: called as ``progress(done, total)`` after each snapshot.

    Returns:
        One name -> tensor dict per target (CPU tensors of the regions' shapes).

    Raises:
        EMAStateError: the snapshots disagree on tensor names or shapes, a file is damaged
            or changed since it was listed, ``regions`` names other tensors than the
            snapshots hold, or a snapshot used holds inf or NaN in an averaged tensor (the
            message names the snapshots).
    """
    run = _Pass(regions, rank, shapes or {})
    copied: dict[Path, dict[str, Tensor]] = {}

    def copies(source: SnapshotInfo) -> dict[str, Tensor]:  # read once per buffer source
        if source.path not in copied:
            copied[source.path] = _copied(run, source, fill)
        return copied[source.path]

    base = targets[0].buffers_from
    copies(base)  # the first read learns the layout
    averaged = set(run.shapes) - base.copied
    accs: list[dict[str, Tensor]] = [{} for _ in targets]
    stored: dict[str, torch.dtype] = {}
    nonfinite: dict[str, list[str]] = {}  # tensor -> snapshots holding inf/NaN for it

    def add(weights: Sequence[float], label: str) -> Callable[[str, Piece], None]:
        used = any(w != 0.0 for w in weights)

        def use(name: str, piece: Piece) -> None:
            x, part = piece.stored, piece.part()
            stored.setdefault(name, x.dtype)
            if used and not bool(torch.isfinite(part).all()):
                nonfinite.setdefault(name, []).append(label)
            for acc, weight in zip(accs, weights, strict=True):
                if name not in acc:
                    wide = torch.complex64 if x.is_complex() else torch.float32
                    acc[name] = torch.zeros(run.regions[name].size, dtype=wide)
                _add(piece.into(acc[name]), part, weight)

        return use

    # Frozen tensors stored once (a side file many snapshots share) are added once per
    # side file, with the sum of its snapshots' weights: the same sum, one read.
    shared: dict[tuple[Any, ...], list[int]] = {}
    for i, snap in enumerate(snapshots):
        once = (snap.frozen_names if snap.frozen else frozenset()) & averaged
        run.visit(snap, averaged - once, add([t.weights[i] for t in targets], snap.path.name))
        if once:
            shared.setdefault((snap.frozen, once), []).append(i)
        if progress is not None:
            progress(i + 1, len(snapshots))
    for (_, once), members in shared.items():
        first = snapshots[members[0]]
        sums = [math.fsum(t.weights[i] for i in members) for t in targets]
        run.visit(first, set(once), add(sums, first.frozen[0].name))
    if nonfinite:
        name, files = next(iter(nonfinite.items()))
        raise EMAStateError(
            f"the reconstruction is not finite: {len(files)} snapshot(s) hold inf or NaN in "
            f"{name!r} (and {len(nonfinite) - 1} other tensor(s)): {files[:5]} in "
            f"{str(base.path.parent)!r}. float16 snapshots overflow above 65504: snapshot in "
            f"float32 or bfloat16 (PostHocEMA(checkpoint_dtype=...)); or synthesize at a step "
            f"before the first such snapshot"
        )
    outs = []
    for acc, target in zip(accs, targets, strict=True):
        out = dict(copies(target.buffers_from))
        for name in averaged:
            # an empty region (or an empty tensor) read nothing: zeros
            x = acc.pop(name, None)
            x = torch.zeros(run.regions[name].size) if x is None else x
            want = dtype if dtype is not None else stored.get(name, x.dtype)
            out[name] = x if (x.is_complex() or x.dtype == want) else x.to(want)
        outs.append({n: out[n] for n in run.shapes})
    return outs


def _copied(
    run: _Pass, source: SnapshotInfo, fill: Mapping[str, Tensor] | None
) -> dict[str, Tensor]:
    """The copied tensors' regions, exactly as ``source`` stores them."""
    out: dict[str, Tensor] = {}

    def use(name: str, piece: Piece) -> None:
        x = _exact(source, name, piece.stored, fill)
        size = run.regions[name].size
        if piece.whole and tuple(x.shape) == size:
            out[name] = x
            return
        if name not in out:
            out[name] = torch.zeros(size, dtype=x.dtype)
        piece.into(out[name]).copy_(piece.part(x))

    run.visit(source, lambda names: names & source.copied, use)
    for name in source.copied & set(run.shapes):
        if name not in out:  # an empty region: the model's dtype is not known from here
            out[name] = torch.zeros(run.regions[name].size)
    return out

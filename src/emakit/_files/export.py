"""The full export of a sharded EMA, streamed: one tensor gathered and written at a time.

Imported by [`emakit.checkpoint`][emakit.checkpoint] only, for
[`save_ema_weights()`][emakit.checkpoint.save_ema_weights] of a sharded EMA (and of any EMA when
it is a collective, `save_full_ema_weights()`). `write_sharded()` writes the file that
the unsharded EMA's save would write, byte for byte (same header, same order, loads
straight into the model class), without ever holding more than one full tensor:

1. every rank builds the header from names, dtypes and global shapes alone
   (`safetensors_layout()`), and rank 0 writes it first;
2. for each tensor, in the file's order, every rank casts its shard to the export dtype
   (``to_local()``, then ``.to(dtype)``: the cast happens *before* the gather, so a bf16
   export moves and holds bf16) and the shards are gathered into one buffer on rank 0
   (`tensor_for_writer()`: a ``gather``, not an all-gather, so no other rank receives
   anything beyond its own shard, and at 1,000 ranks the traffic is rank 0's alone); rank 0
   appends the bytes, and the full tensor is dropped before the next one;
3. rank 0 writes into a temporary file that replaces ``path`` atomically when complete.

Rank 0's extra memory is therefore the largest tensor in the export dtype, gathered (plus
a padded copy of its own shard), plus its CPU copy on the way to the file (none when it
already is on the CPU): at most about twice the largest tensor, whatever the model's
size. Every other rank holds its padded shard of one tensor at a time (placements other
than rows, e.g. tensor parallelism, fall back to an all-gather: one full tensor at a time
on each rank of the mesh). A failure to write on rank 0 (disk full...) does not leave the other ranks waiting
in a gather: rank 0 goes on gathering without writing, and `share_outcome()` then
raises on every rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor

from .._dist.collectives import dist_ready, is_rank_zero
from .._dist.dtensor import is_dtensor
from ..errors import EMAError, EMAWriteError
from .atomic import atomic_path
from .reading import write_errors
from .safetensors_file import safetensors_layout, write_tensor

__all__ = ["full_tensor", "share_outcome", "tensor_for_writer", "write_sharded"]


def full_tensor(t: Tensor, dtype: torch.dtype | None) -> Tensor:
    """``t`` in full on every rank (a collective for a DTensor), floating values cast to
    ``dtype`` before they are gathered; a plain tensor is returned as it is.

    FSDP2's layout (``Shard(0)`` on a 1-D mesh) is gathered with one
    ``all_gather_into_tensor`` into a buffer of ``world * ceil(rows / world)`` rows, whose
    first ``rows`` rows are the tensor (``torch.chunk``'s split: only the last ranks hold
    fewer rows, or none), so the full tensor is a view of the one buffer it arrives in.
    Any other placement goes through ``DTensor.full_tensor()``.
    """
    if not is_dtensor(t):
        return t
    from torch.distributed.tensor import DTensor

    d = cast(Any, t)
    local = _cast_local(d, dtype)
    mesh = d.device_mesh
    shape = tuple(d.shape)
    if mesh.ndim == 1 and _rows_dim(mesh, d.placements, shape, writer=False) == 0:
        return cast(Tensor, _gather_rows(local, shape, mesh))
    return DTensor.from_local(
        local, mesh, d.placements, run_check=False, shape=d.shape, stride=d.stride()
    ).full_tensor()


def tensor_for_writer(t: Tensor, dtype: torch.dtype | None) -> Tensor | None:
    """``t`` in full on rank 0 (the writer), None on the ranks that sent it their shards:
    a collective for a DTensor, floating values cast to ``dtype`` before they move; a
    plain tensor is returned as it is on every rank.

    FSDP2's rows (``Shard(0)`` over a 1-D mesh), and HSDP's (``Shard(0)`` along one mesh
    dimension, replicated along the others), are *gathered* to rank 0 (``dist.gather``
    into one buffer of ``world * ceil(rows / world)`` rows): rank 0 receives the tensor,
    every other rank receives nothing, and the ranks of the other HSDP replicas take no
    part. Any other placement (tensor parallelism...) goes through
    ``DTensor.full_tensor()``, an all-gather, and every rank of its mesh receives it.
    """
    if not is_dtensor(t):
        return t
    d = cast(Any, t)
    mesh, shape = d.device_mesh, tuple(d.shape)
    along = _rows_dim(mesh, d.placements, shape)
    if along is None:
        return full_tensor(t, dtype)
    local = _cast_local(d, dtype)
    coordinate = mesh.get_coordinate() or []
    if any(c != 0 for i, c in enumerate(coordinate) if i != along):
        return None  # another replica: rank 0's replica sends everything
    return _gather_rows(local, shape, mesh, along=along, to_writer=True)


def _cast_local(d: Any, dtype: torch.dtype | None) -> Tensor:
    local = d.to_local()
    if dtype is not None and local.is_floating_point():
        local = local.to(dtype)
    mesh = d.device_mesh
    if local.device.type != mesh.device_type:  # e.g. shards kept on the CPU by FSDP's offload
        target = torch.device(mesh.device_type)
        if mesh.device_type == "cuda":
            target = torch.device("cuda", torch.cuda.current_device())
        local = local.to(target)
    return local


def _rows_dim(
    mesh: Any, placements: Any, shape: tuple[int, ...], *, writer: bool = True
) -> int | None:
    """The mesh dimension a tensor's rows are split along, when every other mesh dimension
    replicates it, the ranks along it are in order and (with ``writer``) rank 0 sits at
    coordinate 0 of the others (the same answer on every rank); else None."""
    if not shape or len(placements) != mesh.ndim:
        return None
    rows = [i for i, p in enumerate(placements) if p.is_shard(0)]
    if len(rows) != 1 or not all(
        p.is_replicate() for i, p in enumerate(placements) if i != rows[0]
    ):
        return None
    ranks = mesh.mesh
    line = ranks[tuple(0 if i != rows[0] else slice(None) for i in range(mesh.ndim))].tolist()
    if (writer and 0 not in line) or line != sorted(line):
        return None
    return rows[0]


def _gather_rows(
    local: Tensor,
    shape: tuple[int, ...],
    mesh: Any,
    *,
    along: int = 0,
    to_writer: bool = False,
) -> Tensor | None:
    """The rows of every rank along mesh dimension ``along`` in one buffer: on every rank
    (an all-gather), or with ``to_writer`` on rank 0 alone (a gather; None elsewhere)."""
    dist = torch.distributed
    world = mesh.size(along)
    rows = -(-shape[0] // world)
    if local.shape[0] != rows:  # the last ranks' shards are shorter, or empty: pad them
        padded = local.new_zeros((rows, *shape[1:]))
        padded[: local.shape[0]].copy_(local)
        local = padded
    group = mesh.get_group(along)
    if not to_writer:
        out = local.new_empty((world * rows, *shape[1:]))
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, local.contiguous(), group=group)
        return out[: shape[0]]
    if dist.get_rank() != 0:
        dist.gather(local.contiguous(), None, dst=0, group=group)
        return None
    out = local.new_empty((world * rows, *shape[1:]))
    dist.gather(local.contiguous(), list(out.chunk(world)), dst=0, group=group)
    return out[: shape[0]]


def write_sharded(
    dest: Path,
    tensors: Mapping[str, Tensor],
    header: Mapping[str, str],
    dtype: torch.dtype | None,
    gather: Callable[[str, torch.dtype | None], Tensor | None],
) -> BaseException | None:
    """Write the full EMA to ``dest`` from rank 0, one gathered tensor at a time (call on
    every rank).

    Args:
        dest: the file rank 0 writes.
        tensors: the tensors by name, for the header (only names, dtypes and full shapes
            are read).
        header: the header metadata.
        dtype: the export dtype of floating tensors (None: as they are).
        gather: ``(name, dtype) -> full tensor`` on rank 0 (None or the tensor elsewhere),
            called on every rank in the file's order.

    Returns:
        On rank 0, the exception that stopped the write (an [`EMAWriteError`][emakit.errors.EMAWriteError]
        for a full disk...) or None; None on the other ranks. Pass it to
        `share_outcome()`.
    """
    head, order = safetensors_layout(tensors, header, dtype)
    writer = is_rank_zero()
    failure: BaseException | None = None
    try:
        with contextlib.ExitStack() as stack:
            f = None
            if writer:
                try:
                    stack.enter_context(write_errors([dest], "EMA weights file"))
                    tmp = stack.enter_context(atomic_path(dest))
                    f = stack.enter_context(open(tmp, "wb"))
                    f.write(head)
                except OSError as e:  # still take part in the gathers below
                    failure, f = e, None
            for name in order:
                full = gather(name, dtype)  # every rank, in the same order
                if f is not None and full is not None:
                    try:
                        write_tensor(f, full, dtype)
                    except OSError as e:  # keep gathering: the other ranks are in the loop
                        failure, f = e, None
                del full
            if failure is not None:
                raise failure  # unwinds the temporary file; OSError -> EMAWriteError
    except (OSError, EMAError) as e:  # on rank 0: a write, or the final rename, failed
        if not writer:
            raise
        failure = e
    return failure


def share_outcome(failure: BaseException | None, what: str) -> None:
    """Make rank 0's outcome every rank's: return everywhere, or raise everywhere (rank 0
    its own exception, the others an [`EMAWriteError`][emakit.errors.EMAWriteError] quoting it). Doubles as
    the barrier after which every rank knows the file is complete."""
    if not dist_ready():
        if failure is not None:
            raise failure
        return
    box: list[Any] = [None if failure is None else f"{type(failure).__name__}: {failure}"]
    torch.distributed.broadcast_object_list(box, src=0)
    if failure is not None:
        raise failure
    if box[0] is not None:
        raise EMAWriteError(f"rank 0 could not write {what}: {box[0]}")

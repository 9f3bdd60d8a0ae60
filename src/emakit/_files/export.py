"""EMA weights files, streamed: one tensor gathered and written at a time.

Imported by [`emakit.checkpoint`][emakit.checkpoint] only: every
[`save_ema_weights()`][emakit.checkpoint.save_ema_weights] goes through `write_streamed()`.
An EMA that is whole in this process is written tensor by tensor by the caller. A
sharded EMA (and any EMA when the save is a collective, `save_full_ema_weights()`) is
written by rank 0 into the file that the unsharded EMA's save would write, byte for byte
(same header, same order, loads straight into the model class), without ever holding
more than one full tensor:

1. every rank builds the header from names, dtypes and global shapes alone
   (`safetensors_layout()`), and rank 0 writes it first;
2. for each tensor, in the file's order, every rank casts its shard to the export dtype
   (``to_local()``, then ``.to(dtype)``: the cast happens *before* the gather, so a bf16
   export moves and holds bf16) and the shards are gathered into one buffer on rank 0
   (`tensor_for_writer()`: a ``gather``, not an all-gather, so no other rank receives
   anything beyond its own shard, and at 1,000 ranks the traffic is rank 0's alone); rank 0
   appends the bytes, and the full tensor is dropped before the next one;
3. rank 0 writes into a temporary file that replaces ``path`` atomically when complete.

Rank 0's extra memory is therefore the largest tensor in the export dtype, gathered, plus
its CPU copy on the way to the file (none when it already is on the CPU): at most about
twice the largest tensor, whatever the model's size. Over gloo on the CPU, rank 0
receives each rank's rows straight into the output (`gather_padded()`: point-to-point,
since gloo's ``gather`` holds a second, flat copy), so there it is about once the largest
tensor plus a few MiB (1.5x measured on a model of 4 MiB float32 tensors, BENCHMARKS.md).
Every other rank holds its padded shard of one tensor at a time (placements other than
rows, e.g. tensor parallelism, are assembled on every rank of the mesh from each rank's
block, `_from_blocks()`: one full tensor at a time on each rank of the mesh). DeepSpeed's
partitions are gathered to rank 0 the same way
([`ZeroPartitions.gathered()`][emakit._dist.deepspeed.ZeroPartitions.gathered]). A failure on rank 0
(disk full, a value the export ``dtype`` cannot hold) does not leave the other ranks
waiting in a gather: rank 0 goes on gathering without writing, and `share_outcome()`
then raises on every rank.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor

from .._dist.collectives import gather_padded
from .._dist.dtensor import is_dtensor, local_block, stores_block
from ..errors import EMAError, EMAValueError, EMAWriteError
from .atomic import atomic_path
from .reading import write_errors
from .safetensors_file import out_dtype, safetensors_layout, write_tensor


def full_tensor(t: Tensor, dtype: torch.dtype | None, *, to_writer: bool = False) -> Tensor | None:
    """``t`` in full on every rank (a collective for a DTensor), floating values cast to
    ``dtype`` before they are gathered; a plain tensor is returned as it is.

    FSDP2's layout (``Shard(0)`` on a 1-D mesh) is gathered with one all-gather into a
    buffer of ``world * ceil(rows / world)`` rows, whose first ``rows`` rows are the tensor
    (``torch.chunk``'s split: only the last ranks hold fewer rows, or none), so the full
    tensor is a view of the one buffer it arrives in. Any other placement (tensor
    parallelism, with or without FSDP2) is assembled from every rank's block where
    ``__create_chunk_list__`` places it (`_from_blocks()`), never by
    ``DTensor.full_tensor()``, which on torch 2.8 and 2.9 misplaces the rows of FSDP2 with
    tensor parallelism when they do not divide evenly.

    With ``to_writer``, `tensor_for_writer()`: FSDP2's rows, and HSDP's (``Shard(0)``
    along one mesh dimension, replicated along the others), are *gathered* to rank 0 (the
    writer) alone: rank 0 receives the tensor, every other rank None, and the ranks of
    the other HSDP replicas take no part. Any other placement is still assembled on
    every rank of its mesh, which all receive it.
    """
    if not is_dtensor(t):
        return t
    d = cast(Any, t)
    mesh, shape = d.device_mesh, tuple(d.shape)
    local = _cast_local(d, dtype)
    along = _rows_dim(mesh, d.placements, shape, writer=to_writer)
    if along is not None and (to_writer or mesh.ndim == 1):
        if any(c != 0 for i, c in enumerate(mesh.get_coordinate() or []) if i != along):
            return None  # another replica: rank 0's replica sends everything
        return _gather_rows(local, shape, mesh, along=along, to_writer=to_writer)
    return _from_blocks(d, local)


def _from_blocks(d: Any, local: Tensor) -> Tensor:
    """The DTensor ``d`` in full on every rank of its mesh, ``local`` (its local shard,
    already cast) placed where ``__create_chunk_list__`` says
    (`emakit._dist.dtensor.local_block`).

    Each rank writes the block it stores (`emakit._dist.dtensor.stores_block`: one
    replica of a replicated block) into a buffer of zeros of the full shape, and the
    buffers are summed over each mesh dimension in turn, as bytes (``uint8``): every byte
    is one rank's byte plus zeros, so the result is the shards' bits exactly (``-0.0``
    and NaN payloads included), whatever the dtype. One all-reduce of the full tensor
    per mesh dimension, and one full tensor held on each rank.
    """
    out = local.new_zeros(tuple(d.shape))
    if stores_block(d):
        offsets, sizes = local_block(d)
        out[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))] = local
    raw = out.reshape(-1).view(torch.uint8)
    mesh = d.device_mesh
    for dim in range(mesh.ndim):
        torch.distributed.all_reduce(raw, group=mesh.get_group(dim))
    return out


def tensor_for_writer(t: Tensor, dtype: torch.dtype | None) -> Tensor | None:
    """``t`` in full on rank 0 (the writer), None on the ranks that sent it their shards
    (`full_tensor()` with ``to_writer``): what the streamed export gathers."""
    return full_tensor(t, dtype, to_writer=True)


def _cast_local(d: Any, dtype: torch.dtype | None) -> Tensor:
    local = d.to_local()
    target, kind = local.device, d.device_mesh.device_type
    if target.type != kind:  # e.g. shards kept on the CPU by FSDP's offload
        target = torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else kind
    return local.to(target, out_dtype(local, dtype))


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
    line = mesh.mesh[tuple(0 if i != rows[0] else slice(None) for i in range(mesh.ndim))].tolist()
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
    rows = -(-shape[0] // mesh.size(along))
    out = gather_padded(local, rows, mesh.get_group(along), to_writer=to_writer)
    return None if out is None else out[: shape[0]]


def _check_fits(name: str, t: Tensor, dtype: torch.dtype | None) -> None:
    """Refuse a cast to ``dtype`` that would turn finite EMA values of ``t`` into ``inf``."""
    limit = math.inf if dtype is None else torch.finfo(dtype).max
    if not t.is_floating_point() or t.numel() == 0 or torch.finfo(t.dtype).max <= limit:
        return  # nothing to narrow
    big = float(t.detach().abs().nan_to_num(nan=0.0, posinf=0.0).max())
    if big > limit:
        raise EMAValueError(
            f"dtype={dtype} cannot hold the EMA tensor {name!r}: its largest magnitude is "
            f"{big:.6g}, above {str(dtype).replace('torch.', '')}'s maximum {limit:g}, so "
            f"it would be written as inf; export in a wider dtype (torch.bfloat16 keeps "
            f"float32's range) or leave dtype=None"
        )


def write_streamed(
    dest: Path,
    tensors: Mapping[str, Tensor],
    header: Mapping[str, str],
    dtype: torch.dtype | None,
    gather: Callable[[str, torch.dtype | None], Tensor | None],
    *,
    writer: bool,
) -> BaseException | None:
    """Write the EMA weights file ``dest`` one tensor at a time, from the ``writer`` (every
    rank calls it when ``gather`` is a collective).

    Args:
        dest: the file the writer writes.
        tensors: the tensors by name, for the header (only names, dtypes and full shapes
            are read).
        header: the header metadata.
        dtype: the export dtype of floating tensors (None: as they are).
        gather: ``(name, dtype) -> full tensor`` on the writer (None or the tensor
            elsewhere), called on every rank in the file's order.
        writer: whether this rank writes (rank 0 of a collective; the caller otherwise).

    Returns:
        On the writer, the exception that stopped the write (an
        [`EMAWriteError`][emakit.errors.EMAWriteError] for a full disk, an
        ``EMAValueError`` for a value ``dtype`` cannot hold...) or None; None on the other
        ranks. Pass it to `share_outcome()`.
    """
    head, order = safetensors_layout(tensors, header, dtype)
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
                        _check_fits(name, full, dtype)
                        write_tensor(f, full, dtype)
                    except (OSError, EMAError) as e:  # keep gathering: the others are in the loop
                        failure, f = e, None
                del full
            if failure is not None:
                raise failure  # unwinds the temporary file; OSError -> EMAWriteError
    except (OSError, EMAError) as e:  # on the writer: a write, or the final rename, failed
        if not writer:
            raise
        failure = e
    return failure


def share_outcome(failure: BaseException | None, what: str, collective: bool) -> None:
    """Make the writer's outcome every rank's: return everywhere, or raise everywhere
    (rank 0 its own exception, the others an [`EMAWriteError`][emakit.errors.EMAWriteError]
    quoting it). Doubles as the barrier after which every rank of a ``collective`` write
    knows the file is complete."""
    if collective:
        box: list[Any] = [None if failure is None else f"{type(failure).__name__}: {failure}"]
        torch.distributed.broadcast_object_list(box, src=0)
        if failure is None and box[0] is not None:
            raise EMAWriteError(f"rank 0 could not write {what}: {box[0]}")
    if failure is not None:
        raise failure

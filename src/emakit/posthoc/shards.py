"""Snapshots of a sharded model: one safetensors file per rank, the layout in its header.

A sharded EMA (FSDP2, HSDP, FSDP with tensor parallelism: DTensor parameters) is
snapshotted by every rank at once: each rank writes the part of every tensor that it holds
into its own file, ``<snapshot name>.rank-<r>-of-<world>.safetensors``, with the header
of a snapshot (see `emakit.posthoc.snapshots`) plus

* ``"format": "emakit.posthoc.snapshot-shard"`` (so a reader that knows only whole-model
  snapshots leaves the files alone),
* ``"rank"`` and ``"world"``: the writing rank and the number of ranks,
* ``"shard_layout"``: JSON, for every tensor of the model, ``[global shape, offset]``, where
  ``offset`` is where the block this file stores starts in the full tensor (one index per
  dimension), or ``null`` when this file stores nothing of it,
* ``"shard_set"``: the id of the write that made the file (16 hex digits drawn by rank 0,
  the same in every rank's file of one write; absent in files of emakit before it), so
  that the files of one step left by two writes (a rewrite of the step interrupted after
  some ranks had replaced their files) never pass for one set.

The stored block of a DTensor is its local shard (a rectangular block of the full tensor,
as ``DTensor.__create_chunk_list__`` describes it, the protocol
``torch.distributed.checkpoint`` uses), stored by one replica only: a rank whose
coordinate is not 0 along a mesh dimension where the tensor is replicated (HSDP's
replicate dimension, a bias replicated over tensor-parallel ranks) stores nothing of it,
and a tensor that is not a DTensor (a buffer) is stored by rank 0 alone. So the shards of a
set partition every tensor: the set holds one model's bytes, whatever the mesh.

A set is **complete** when the files of ranks ``0 .. world-1`` are all there, agree on
the step, profile, run and write (``shard_set``), and their blocks add up to every tensor; an incomplete set (a
snapshot that a crash interrupted) is skipped with a [`PostHocWarning`][emakit.posthoc.math.PostHocWarning].

This module is a leaf of `emakit.posthoc`: block arithmetic, headers and the
grouping of shard files into sets; `emakit.posthoc.snapshots` lists them and
`emakit.posthoc.assemble` reads them.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .._dist.dtensor import is_dtensor
from ..errors import EMAStateError
from .math import PostHocWarning

__all__ = [
    "SHARD_FORMAT",
    "Block",
    "ShardEntry",
    "complete_sets",
    "held_block",
    "intersect",
    "layout_json",
    "local_block",
    "parse_layout",
    "shard_fields",
    "shard_suffix",
]

#: ``format`` of one rank's file of a sharded snapshot.
SHARD_FORMAT = "emakit.posthoc.snapshot-shard"


@dataclass(frozen=True)
class Block:
    """A rectangular block of a tensor: where it starts and how big it is.

    Attributes:
        offset: the index of its first element in the full tensor, per dimension.
        size: its shape.
    """

    offset: tuple[int, ...]
    size: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.size)

    @staticmethod
    def whole(shape: Iterable[int]) -> Block:
        """The block that is the whole tensor of ``shape``."""
        size = tuple(int(s) for s in shape)
        return Block((0,) * len(size), size)

    def slices(self, inner: Block) -> tuple[slice, ...]:
        """Index of ``inner`` (a block inside this one) in a tensor holding this block."""
        return tuple(
            slice(i - o, i - o + s)
            for i, o, s in zip(inner.offset, self.offset, inner.size, strict=True)
        )


def intersect(a: Block, b: Block) -> Block | None:
    """The common part of two blocks of one tensor, or None (nothing in common)."""
    start = tuple(max(x, y) for x, y in zip(a.offset, b.offset, strict=True))
    stop = tuple(
        min(x + s, y + t) for x, s, y, t in zip(a.offset, a.size, b.offset, b.size, strict=True)
    )
    size = tuple(e - s for s, e in zip(start, stop, strict=True))
    if any(s <= 0 for s in size) and size:
        return None
    return Block(start, size)


def _is_rank_zero() -> bool:
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def held_block(t: Tensor) -> Block:
    """The block of the full tensor that this rank holds of ``t``: a DTensor's local shard
    (``__create_chunk_list__``, the protocol ``torch.distributed.checkpoint`` uses), or the
    whole of another tensor."""
    if not is_dtensor(t):
        return Block.whole(t.shape)
    chunk = t.__create_chunk_list__()[0]  # type: ignore[attr-defined]
    return Block(tuple(int(x) for x in chunk.offsets), tuple(int(x) for x in chunk.sizes))


def local_block(t: Tensor) -> tuple[Tensor, Block] | None:
    """The block of the full tensor ``t`` that this rank stores in a sharded snapshot, and
    the local tensor holding it; None when this rank stores nothing of ``t``.

    A DTensor's block is its local shard (``__create_chunk_list__``), stored by the replica
    at coordinate 0 of every mesh dimension it is replicated over; another tensor (the same
    on every rank) is stored whole by rank 0. No collective is run.
    """
    if not is_dtensor(t):
        return (t, Block.whole(t.shape)) if _is_rank_zero() else None
    d: Any = t
    coordinate = d.device_mesh.get_coordinate() or []
    for placement, c in zip(d.placements, coordinate, strict=False):
        if placement.is_partial():
            raise EMAStateError(
                f"a tensor with a Partial placement ({d.placements}) cannot be snapshotted: "
                f"its shards are summands, not parts; an EMA's weights are never partial"
            )
        if placement.is_replicate() and c != 0:
            return None
    local = d.to_local()
    block = held_block(t)
    if tuple(local.shape) != block.size:  # a torch whose chunks are not the local shard
        raise EMAStateError(
            f"a DTensor's local shard has shape {tuple(local.shape)} but its chunk is "
            f"{block.size} (placements {d.placements}): emakit cannot snapshot this layout; "
            f"save it with emakit.distributed.save_sharded_ema instead"
        )
    if block.numel == 0:
        return None
    return local, block


def shard_suffix(rank: int, world: int) -> str:
    """The part of a shard's file name after the snapshot's name, e.g.
    ``.rank-00003-of-00004``."""
    return f".rank-{rank:05d}-of-{world:05d}"


def layout_json(shapes: Mapping[str, tuple[int, ...]], blocks: Mapping[str, Block]) -> str:
    """The ``shard_layout`` header field: ``{name: [global shape, offset or null]}``."""
    return json.dumps(
        {
            n: [list(shape), list(blocks[n].offset) if n in blocks else None]
            for n, shape in shapes.items()
        },
        separators=(",", ":"),
    )


def _bad(path: Path, why: str) -> EMAStateError:
    return EMAStateError(
        f"sharded snapshot file {path} has a malformed header ({why}); the file is damaged "
        f"or was not written by emakit: move it out of the folder"
    )


def shard_fields(path: Path, meta: Mapping[str, str]) -> tuple[int, int]:
    """``(rank, world)`` of a shard file's header, checked."""
    try:
        rank, world = int(meta["rank"]), int(meta["world"])
    except (KeyError, ValueError):
        raise _bad(path, f"rank={meta.get('rank')!r}, world={meta.get('world')!r}") from None
    if not 0 <= rank < world:
        raise _bad(path, f"rank={rank} is not in [0, world={world})")
    return rank, world


def parse_layout(
    path: Path, meta: Mapping[str, str], stored: Mapping[str, tuple[int, ...]]
) -> dict[str, tuple[tuple[int, ...], Block | None]]:
    """A shard file's ``shard_layout``: name -> (global shape, the block stored or None),
    checked against the tensors the file holds (``stored``: name -> shape)."""
    try:
        raw = json.loads(meta.get("shard_layout", ""))
    except ValueError:
        raise _bad(path, "shard_layout is not JSON") from None
    if not isinstance(raw, dict):
        raise _bad(path, "shard_layout is not a mapping")
    out: dict[str, tuple[tuple[int, ...], Block | None]] = {}
    for name, entry in raw.items():
        ok = isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], list)
        shape = tuple(entry[0]) if ok else ()
        ok = ok and all(isinstance(s, int) and s >= 0 for s in shape)
        offset = entry[1] if ok else None
        if not ok or (offset is not None and not isinstance(offset, list)):
            raise _bad(path, f"shard_layout[{name!r}] = {entry!r}")
        if offset is None:
            if name in stored:
                raise _bad(path, f"{name!r} is stored but shard_layout says it is not")
            out[name] = (shape, None)
            continue
        if name not in stored:
            raise _bad(path, f"shard_layout places {name!r}, which the file does not hold")
        block = Block(tuple(int(x) for x in offset), stored[name])
        whole = Block.whole(shape)
        if len(block.offset) != len(shape) or intersect(block, whole) != block:
            raise _bad(path, f"{name!r}'s block {block} lies outside its shape {shape}")
        out[name] = (shape, block)
    if set(stored) - set(out):
        raise _bad(path, f"tensors {sorted(set(stored) - set(out))[:5]} are not in shard_layout")
    return out


@dataclass(frozen=True)
class ShardEntry:
    """One shard file, as listed: the set it belongs to and what it stores.

    Attributes:
        key: what the files of one set share (step, t, gamma, run...).
        rank: the writing rank.
        world: the number of ranks of the set.
        path: the file.
        volumes: name -> (global shape, elements stored in this file).
    """

    key: tuple[Any, ...]
    rank: int
    world: int
    path: Path
    volumes: Mapping[str, tuple[tuple[int, ...], int]]


def _gap(entries: list[ShardEntry], world: int) -> str:
    ranks = sorted({e.rank for e in entries})
    if len(ranks) != len(entries):
        return "two files for one rank"
    if len(ranks) < world:
        missing = sorted(set(range(world)) - set(ranks))
        return f"the files of ranks {missing[:8]}{' ...' if len(missing) > 8 else ''} are missing"
    names = set(entries[0].volumes)
    for e in entries:
        if set(e.volumes) != names:
            return f"rank {e.rank}'s file lists other tensors than rank {entries[0].rank}'s"
    for name in sorted(names):
        shapes = {e.volumes[name][0] for e in entries}
        total = sum(e.volumes[name][1] for e in entries)
        if len(shapes) > 1 or total != math.prod(next(iter(shapes))):
            return f"the files' blocks of {name!r} do not add up to its shape"
    return ""


def complete_sets(entries: Iterable[ShardEntry]) -> list[list[ShardEntry]]:
    """The complete sets among shard files, each sorted by rank (see the module
    docstring); every incomplete one is skipped with a [`PostHocWarning`][emakit.posthoc.math.PostHocWarning]."""
    groups: dict[tuple[Any, ...], list[ShardEntry]] = {}
    for e in entries:
        groups.setdefault((*e.key, e.world), []).append(e)
    out = []
    for _, group in sorted(groups.items(), key=lambda kv: str(kv[0])):
        group.sort(key=lambda e: e.rank)
        why = _gap(group, group[0].world)
        if why:
            warnings.warn(
                f"skipping the sharded snapshot {group[0].path.name.split('.rank-')[0]} "
                f"({len(group)} of {group[0].world} rank files): {why}; a snapshot that a "
                f"crash interrupted, or a folder missing some ranks' files (copy every "
                f"rank's files into one folder to synthesize from it)",
                PostHocWarning,
                stacklevel=3,
            )
            continue
        out.append(group)
    return out

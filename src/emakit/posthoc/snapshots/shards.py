"""Snapshots of a sharded model: one safetensors file per rank, the layout in its header.

A sharded EMA (FSDP2, HSDP, FSDP with tensor parallelism: DTensor parameters; DeepSpeed
ZeRO-3 partitions, or ``EMA(partition=True)``'s slices) is snapshotted by every rank at
once: each rank writes the part of every tensor that it holds into its own file,
``<snapshot name>.rank-<r>-of-<world>.safetensors``, with the header of a snapshot (see
`emakit.posthoc.snapshots.format`) plus

* ``"format": "emakit.posthoc.snapshot-shard"`` (so a reader that knows only whole-model
  snapshots leaves the files alone),
* ``"rank"`` and ``"world"``: the writing rank and the number of ranks,
* ``"shard_layout"``: JSON, for every tensor of the model, ``[global shape, where]``:
  ``where`` is the ``offset`` of the rectangular block this file stores (where it starts
  in the full tensor, one index per dimension), or ``{"flat": [start, length]}`` for a
  range of the flattened tensor (C order) stored as a 1-D tensor of ``length`` elements,
  or ``null`` when this file stores nothing of it. For example::

      {"inp.weight": [[16, 8], [4, 0]],            # rows 4.. of an FSDP2 shard
       "0.weight": [[7, 5], {"flat": [18, 17]}],   # elements 18..34 of a ZeRO-3 partition
       "count": [[], null]}                        # a buffer, stored by rank 0

* ``"shard_set"``: the id of the write that made the file (16 hex digits drawn by rank 0,
  the same in every rank's file of one write; absent in files of emakit before it), so
  that the files of one step left by two writes (a rewrite of the step interrupted after
  some ranks had replaced their files) never pass for one set.

A file holding a flat range has ``"format_version": "2"`` (`FLAT_LAYOUT_VERSION`), so an
emakit that predates flat ranges refuses it by asking for an upgrade; every other file is
still version 1.

The stored block of a DTensor is its local shard (a rectangular block of the full tensor,
as ``DTensor.__create_chunk_list__`` describes it, the protocol
``torch.distributed.checkpoint`` uses), stored by one replica only: a rank whose
coordinate is not 0 along a mesh dimension where the tensor is replicated (HSDP's
replicate dimension, a bias replicated over tensor-parallel ranks) stores nothing of it,
and a tensor that is not a DTensor (a buffer) is stored by rank 0 alone. The stored
block of a ZeRO-3 partition is the rank's range of the flattened parameter without
DeepSpeed's padding (``param.ds_tensor``'s first elements, see
`emakit._dist.deepspeed.own_span`); an empty range (a parameter with fewer elements than
ranks) is not stored. So the shards of a set partition every tensor: the set holds one
model's bytes, whatever the mesh.

Readers combine both kinds ([`align()`][emakit.posthoc.snapshots.shards.align]): a rectangular block that
is a contiguous range of the flattened tensor (FSDP2's row blocks, a whole tensor) is
that range, so a ZeRO-3 folder synthesizes into an FSDP2 model, a whole model or another
number of ranks, and the reverse.

A set is **complete** when the files of ranks ``0 .. world-1`` are all there, agree on
the step, profile, run and write (``shard_set``), and their blocks add up to every tensor; an incomplete set (a
snapshot that a crash interrupted) is skipped with a [`PostHocWarning`][emakit.posthoc.math.PostHocWarning].

This module is a leaf of `emakit.posthoc`: block arithmetic, headers and the
grouping of shard files into sets; `emakit.posthoc.snapshots.folder` lists them and
`emakit.posthoc.synthesis.weighted_sum` reads them.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from ..._dist.collectives import is_rank_zero
from ..._dist.deepspeed import WORLD_KEY, ZeroPartitions
from ..._dist.dtensor import is_dtensor, local_block, stores_block
from ..._files.reading import parse_json
from ...errors import EMAStateError
from ..math import PostHocWarning

__all__ = [
    "FLAT_LAYOUT_VERSION",
    "SHARD_FORMAT",
    "Block",
    "ShardEntry",
    "align",
    "complete_sets",
    "header_names",
    "intersect",
    "is_sharded",
    "malformed",
    "model_blocks",
    "parse_layout",
    "set_frozen_names",
    "shard_fields",
    "shard_header",
    "shard_suffix",
]

#: ``format`` of one rank's file of a sharded snapshot.
SHARD_FORMAT = "emakit.posthoc.snapshot-shard"
#: ``format_version`` of a shard file whose layout holds flat ranges (``{"flat": ...}``).
FLAT_LAYOUT_VERSION = 2


@dataclass(frozen=True)
class Block:
    """A rectangular block of a tensor, or a range of the flattened tensor: where it
    starts and how big it is.

    Attributes:
        offset: the index of its first element in the full tensor, per dimension (one
            index, into the flattened tensor, for a flat range).
        size: its shape (``(length,)`` for a flat range).
        flat: whether it is a range of the tensor flattened in C order (a ZeRO-3
            partition) rather than a block of its dimensions. Default False.
    """

    offset: tuple[int, ...]
    size: tuple[int, ...]
    flat: bool = False

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
    """The common part of two blocks of one tensor, both rectangular or both flat ranges
    (see `align()`), or None (nothing in common)."""
    if a.flat != b.flat:
        raise EMAStateError(f"cannot intersect a flat range with a block: {a}, {b} (align them)")
    start = tuple(max(x, y) for x, y in zip(a.offset, b.offset, strict=True))
    stop = tuple(
        min(x + s, y + t) for x, s, y, t in zip(a.offset, a.size, b.offset, b.size, strict=True)
    )
    size = tuple(e - s for s, e in zip(start, stop, strict=True))
    if any(s <= 0 for s in size) and size:
        return None
    return Block(start, size, a.flat)


def flat_range(block: Block, shape: tuple[int, ...]) -> Block | None:
    """``block`` of a tensor of ``shape`` as a range of the flattened tensor (C order), or
    None when its elements are not contiguous there (a block of columns).

    A block is one range when, after its first dimension longer than 1, it spans every
    later dimension whole: FSDP2's row blocks, a whole tensor, a single row.
    """
    if block.flat:
        return block
    first = next((i for i, s in enumerate(block.size) if s != 1), len(shape))
    later = range(first + 1, len(shape))
    if block.numel and any(block.offset[i] != 0 or block.size[i] != shape[i] for i in later):
        return None
    start = sum(o * math.prod(shape[i + 1 :]) for i, o in enumerate(block.offset))
    return Block((start if block.numel else 0,), (block.numel,), flat=True)


def align(region: Block, stored: Block, shape: tuple[int, ...], name: str) -> tuple[Block, Block]:
    """``region`` and ``stored`` (two blocks of the tensor ``name`` of ``shape``) in one
    frame: as they are when both are rectangular or both flat ranges, else both as flat
    ranges (`flat_range()`).

    Raises:
        EMAStateError: one is a flat range and the other a block that is not one (a
            tensor-parallel column shard against a ZeRO-3 partition).
    """
    if region.flat == stored.flat:
        return region, stored
    r, s = flat_range(region, shape), flat_range(stored, shape)
    if r is None or s is None:
        raise EMAStateError(
            f"tensor {name!r} (shape {shape}) is stored as a range of its flattened elements "
            f"in one place and as the block {region if r is None else stored} of its columns "
            f"in another, which emakit cannot combine; synthesize the snapshots in one process "
            f"(emakit.posthoc.synthesize) and load the result instead"
        )
    return r, s


def is_sharded(model: nn.Module | None) -> bool:
    """Whether an EMA model's weights are DTensors (FSDP2 and friends) or partitions
    (DeepSpeed ZeRO-3, ``partition=True``): then each rank holds a part of each tensor."""
    if isinstance(model, ZeroPartitions):
        return True
    return model is not None and any(is_dtensor(v) for v in model.state_dict().values())


def _held(t: Tensor, store: bool) -> tuple[Tensor, Block] | None:
    """The block of the full tensor ``t`` that this rank holds, with the local tensor
    holding it: a DTensor's local shard (where `emakit._dist.dtensor.local_block` places
    it: ``__create_chunk_list__``, the protocol ``torch.distributed.checkpoint`` uses),
    the whole of another tensor. With ``store``, what this rank stores of it in a sharded
    snapshot, or None: a replicated block is stored by the replica at coordinate 0 of
    every mesh dimension it is replicated over (`emakit._dist.dtensor.stores_block`), a
    plain tensor (the same on every rank) by rank 0, an empty block nowhere."""
    if not is_dtensor(t):
        return (t, Block.whole(t.shape)) if is_rank_zero() or not store else None
    d: Any = t
    block = Block(*local_block(t))
    if not store:
        return d.to_local(), block
    if not stores_block(t):
        return None
    return (d.to_local(), block) if block.numel else None


def model_blocks(
    model: nn.Module, *, empty: bool = False
) -> tuple[dict[str, Tensor], dict[str, Block], dict[str, tuple[int, ...]]]:
    """What this rank holds of an EMA model, as a sharded snapshot sees it:
    ``(local tensors, their blocks, global shapes)`` of the tensors it stores; with
    ``empty``, the blocks of every tensor it holds, empty ones included (the regions a
    synthesis on this rank fills).

    A DTensor contributes its local shard, a partition of a ZeRO-3 EMA model (a
    `ZeroPartitions`, see `emakit._dist.deepspeed`) its flat range (1-D, the padding
    left out); any other tensor is stored whole by rank 0 (with ``empty``, held whole on
    every rank). No collective is run.
    """
    state = model.state_dict()
    zero = model if isinstance(model, ZeroPartitions) else None
    if zero is not None:
        state.pop(WORLD_KEY, None)
    tensors: dict[str, Tensor] = {}
    blocks: dict[str, Block] = {}
    shapes = {n: tuple(v.shape) for n, v in state.items()}
    for name, value in state.items():
        span = None if zero is None else zero.span(name)
        held: tuple[Tensor, Block] | None
        if zero is not None and span is not None:
            shapes[name] = tuple(int(x) for x in zero.shapes[name][0])
            held = (value, Block((span[0],), (span[1],), True)) if span[1] or empty else None
        else:
            held = _held(value, store=not empty)
        if held is not None:
            tensors[name], blocks[name] = held
    return tensors, blocks, shapes


def shard_suffix(rank: int, world: int) -> str:
    """The part of a shard's file name after the snapshot's name, e.g.
    ``.rank-00003-of-00004``."""
    return f".rank-{rank:05d}-of-{world:05d}"


def shard_header(
    shard: tuple[int, int],
    write_id: int,
    shapes: Mapping[str, tuple[int, ...]],
    blocks: Mapping[str, Block],
) -> dict[str, str]:
    """The header entries of rank ``shard[0]``'s file (of ``shard[1]`` ranks) of the write
    ``write_id`` (see the module docstring): the format, rank, world, set id and
    ``shard_layout`` (``{name: [global shape, offset, flat range or null]}``), and
    `FLAT_LAYOUT_VERSION` when the file stores a flat range."""

    def where(b: Block | None) -> object:
        if b is None:
            return None
        return {"flat": [b.offset[0], b.size[0]]} if b.flat else list(b.offset)

    layout = {n: [list(shape), where(blocks.get(n))] for n, shape in shapes.items()}
    header = {
        "format": SHARD_FORMAT,
        "rank": str(shard[0]),
        "world": str(shard[1]),
        "shard_set": f"{write_id:016x}",
        "shard_layout": json.dumps(layout, separators=(",", ":")),
    }
    if any(b.flat for b in blocks.values()):  # an emakit before flat ranges refuses it
        header["format_version"] = str(FLAT_LAYOUT_VERSION)
    return header


def malformed(path: Path, why: str) -> EMAStateError:
    """The error for a snapshot file whose header emakit cannot read (any snapshot's: this
    leaf module holds what every header reader shares); ``why`` names the field and its
    value."""
    return EMAStateError(
        f"snapshot file {path} has a malformed header ({why}); the file is damaged or was "
        f"not written by emakit: move it out of the folder"
    )


def header_names(path: Path, meta: Mapping[str, str], key: str, absent: str = "") -> frozenset[str]:
    """The header entry ``key`` of a snapshot file: a JSON list of tensor names, checked;
    ``absent`` is read in its place when it is missing (by default, an error)."""
    try:
        names = parse_json(meta.get(key, absent))
    except ValueError:
        names = None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        text = repr(meta.get(key))
        text = text if len(text) <= 80 else f"{text[:80]}... ({len(text)} characters)"
        raise malformed(path, f"{key}={text}: not a JSON list of names")
    return frozenset(names)


def shard_fields(path: Path, meta: Mapping[str, str]) -> tuple[int, int]:
    """``(rank, world)`` of a shard file's header, checked."""
    try:
        rank, world = int(meta["rank"]), int(meta["world"])
    except (KeyError, ValueError):
        raise malformed(path, f"rank={meta.get('rank')!r}, world={meta.get('world')!r}") from None
    if not 0 <= rank < world:
        raise malformed(path, f"rank={rank} is not in [0, world={world})")
    return rank, world


def _naturals(x: object) -> bool:
    return isinstance(x, list) and all(type(i) is int and i >= 0 for i in x)


def _block(
    path: Path, name: str, entry: object, stored: Mapping[str, tuple[int, ...]]
) -> tuple[tuple[int, ...], Block | None]:
    """One ``shard_layout`` entry ``[global shape, where]``, checked against the tensors
    the file holds: ``where`` is an offset, ``{"flat": [start, length]}`` or null."""
    ok = isinstance(entry, list) and len(entry) == 2 and _naturals(entry[0])
    shape, where = (tuple(entry[0]), entry[1]) if ok else ((), ())  # type: ignore[index]
    if (where is None) != (name not in stored):
        held = "stored but shard_layout says it is not" if where is None else "not stored"
        raise malformed(path, f"{name!r} is {held}, but shard_layout[{name!r}] = {entry!r}")
    if where is None:
        return shape, None
    size = tuple(stored[name])
    span = where.get("flat") if isinstance(where, dict) and len(where) == 1 else None
    if _naturals(span) and len(span) == 2:  # type: ignore[arg-type]
        start, length = span  # type: ignore[misc]
        if size != (length,) or start + length > math.prod(shape):
            raise malformed(
                path,
                f"{name!r}'s flat range [{start}, {start + length}) of its {math.prod(shape)} "
                f"elements does not match the stored tensor of shape {size}",
            )
        return shape, Block((start,), (length,), flat=True)
    block = Block(tuple(where), size) if _naturals(where) and len(where) == len(shape) else None
    if block is None or intersect(block, Block.whole(shape)) != block:
        raise malformed(
            path, f"shard_layout[{name!r}] = {entry!r} is no block of it (stored: {size})"
        )
    return shape, block


def parse_layout(
    path: Path, meta: Mapping[str, str], stored: Mapping[str, tuple[int, ...]]
) -> dict[str, tuple[tuple[int, ...], Block | None]]:
    """A shard file's ``shard_layout``: name -> (global shape, the block or flat range
    stored, or None), checked against the tensors the file holds (``stored``: name ->
    shape)."""
    try:
        raw = parse_json(meta.get("shard_layout", ""))
    except ValueError:
        raise malformed(path, "shard_layout is not JSON") from None
    if not isinstance(raw, dict):
        raise malformed(path, "shard_layout is not a mapping")
    out = {name: _block(path, name, entry, stored) for name, entry in raw.items()}
    if set(stored) - set(out):
        raise malformed(
            path, f"tensors {sorted(set(stored) - set(out))[:5]} are not in shard_layout"
        )
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


def set_frozen_names(
    entries: Sequence[ShardEntry], frozen: Sequence[frozenset[str]]
) -> frozenset[str]:
    """The frozen tensors of a sharded set (``entries``, with each file's own frozen
    names in ``frozen``): those that every rank storing a block of them keeps in its side
    file, so that the side files alone determine them."""
    names = frozenset().union(*frozen)
    return frozenset(
        n
        for n in names
        if all(
            n in own or e.volumes.get(n, ((), 0))[1] == 0
            for e, own in zip(entries, frozen, strict=True)
        )
    )


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

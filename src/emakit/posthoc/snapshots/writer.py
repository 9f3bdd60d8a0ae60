"""Writing one step's snapshots of a [`PostHocEMA`][emakit.PostHocEMA]: whole-model files from
one writer, or every rank's shard files at once.

* **A model held whole on every rank** (one process, DDP): rank 0 writes one file per
  profile (`write_snapshots()`: the step's set, all or none);
  the other ranks write nothing and run no collective, as before.
* **A sharded model** (FSDP2, HSDP, FSDP with tensor parallelism: DTensor weights;
  DeepSpeed ZeRO-3 partitions, ``partition=True``'s slices): a snapshot is a collective.
  Every rank first checks that every other rank is in the same call at the same step
  (`agree()`, bounded by ``timeout_s``: a call that only some ranks make, e.g. inside ``if is_rank_zero():``,
  raises instead of hanging), then writes its own blocks of every tensor
  ([`model_blocks()`][emakit.posthoc.snapshots.shards.model_blocks]: a DTensor's shard, a ZeRO-3
  partition's flat range; no collective, no gathered tensor, one tensor's CPU copy at a
  time) into temporary files, and the ranks exchange their
  outcomes before any rank puts its files in place (a two-phase commit over
  [`atomic_paths()`][emakit._files.atomic.atomic_paths]' ``before_replace``): a rank that
  could not write (disk full) makes every rank raise, naming it, and no rank replaces
  anything, so a step written again (a resumed run reaching a step it had snapshotted)
  keeps its earlier complete set; a rank killed mid-write makes the others raise after
  `OUTCOME_TIMEOUT_S`, with nothing replaced either. Only a crash or a failed rename in
  the last moment, after every rank has written and voted, leaves some ranks' files in
  place and others not: such files never make a set with another write's (each write's
  files carry its id, ``shard_set``), so listing skips them with a warning
  ([`complete_sets()`][emakit.posthoc.snapshots.shards.complete_sets]), and the earlier steps stay
  usable.

The folder's lock ([`FolderLock`][emakit.posthoc.snapshots.folder.FolderLock]) is held by rank 0.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import secrets
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..._dist.collectives import AGREE_TIMEOUT_S, agree, dist_ready, is_rank_zero
from ..._dist.deepspeed import ZeroPartitions
from ...errors import EMAError, EMARuntimeError, EMATypeError, EMAWriteError
from ..karras import KarrasEMA
from ..math import PostHocWarning
from .folder import FolderLock, collect_frozen_files, first_write_warnings, own_path
from .format import SnapshotInfo, snapshot_filename, snapshot_header, write_snapshots
from .frozen import check_side_file, frozen_part, snapshot_tensors
from .shards import is_sharded, model_blocks, shard_header

__all__ = ["OUTCOME_TIMEOUT_S", "SnapshotWriter", "check_snapshottable"]

#: Seconds the ranks of a sharded snapshot wait for each other to finish writing (writing
#: a shard can take a while on a slow file system); a rank that died mid-write makes the
#: others raise after this long.
OUTCOME_TIMEOUT_S = 600.0


def check_snapshottable(ema: KarrasEMA) -> None:
    """Refuse, when the [`PostHocEMA`][emakit.PostHocEMA] is built, an EMA whose sharded
    snapshots could not be put together again: ZeRO-3 partitions cut over a subgroup of
    the ranks (DeepSpeed's MiCS, whose shard groups are replicated) would be written by
    every replica, so the rank files of a set would not add up to one model.

    Raises:
        EMATypeError: the partitions are cut over a subgroup; the message says what works.
    """
    model = ema.ema_model
    if not (isinstance(model, ZeroPartitions) and dist_ready()):
        return
    world = torch.distributed.get_world_size()
    for name, (_, _, group, _) in model.shapes.items():
        size = torch.distributed.get_world_size(group) if group is not None else world
        if size != world:
            raise EMATypeError(
                f"PostHocEMA cannot snapshot this DeepSpeed model: parameter {name!r} is "
                f"partitioned over {size} of the {world} ranks (a MiCS or hierarchical "
                f"partitioning: several ranks hold the same partition), and post-hoc "
                f"snapshots need each element on one rank. Partition over every rank (plain "
                f"ZeRO-3), or snapshot with emakit.distributed.save_full_ema_weights"
            )


class SnapshotWriter:
    """Writes the snapshots of a PostHocEMA's profiles; holds the folder's lock meanwhile.

    Attributes:
        store_frozen_once: whether shared frozen tensors go into side files.
        checked: whether the folder was checked before this run's first write.
        intact: the side files (path and version) whose bytes were checked, which new
            snapshots may refer to without reading them again.
        lock: the folder lock held (rank 0), or None.
    """

    def __init__(self, store_frozen_once: bool = True) -> None:
        self.store_frozen_once = store_frozen_once
        self.checked = False
        self.lock: FolderLock | None = None
        self.intact: set[tuple[Path, tuple[int, ...]]] = set()

    def release(self) -> None:
        """Release the folder lock, if held."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def _take_folder(self, folder: Path, run: str, step: int) -> None:
        lock = self.lock
        if lock is None or not lock.locked or lock.run != run:
            self.release()
            folder.mkdir(parents=True, exist_ok=True)
            self.lock = FolderLock(folder, run)
        if not self.checked:
            self.checked = True
            for message in first_write_warnings(folder, run, step):
                warnings.warn(message, PostHocWarning, stacklevel=4)

    def write(
        self,
        profiles: Sequence[KarrasEMA],
        folder: Path,
        *,
        step: int,
        dtype: torch.dtype | None,
        run: str,
        timeout_s: float = AGREE_TIMEOUT_S,
    ) -> tuple[list[Path], str]:
        """Write every profile's snapshot of ``step`` (see the module docstring).

        Returns:
            ``(the files this rank wrote, the run id written)``: for a sharded model,
            rank 0's, which every rank adopts (ids drawn at random differ by rank).
        """
        if not (is_sharded(profiles[0].ema_model) and dist_ready()):
            if is_rank_zero():
                self._take_folder(folder, run, step)
            for ema in profiles:
                ema.catch_up()
            return (self._files(profiles, folder, step, dtype, run) if is_rank_zero() else []), run
        profile_names = ", ".join(f"(sigma_rel={e.sigma_rel}, gamma={e.gamma})" for e in profiles)
        agreed = agree(
            "PostHocEMA.checkpoint",
            step=step,
            skips=profiles[0].num_skipped_nonfinite,
            timeout_s=timeout_s,
            extra=secrets.randbits(64),  # rank 0's draw names this write on every rank
            settings={  # every rank's profiles alike, or no rank writes
                **profiles[0].tracker.agreed_settings(),
                "profiles (sigma_rels or gammas)": profile_names,
                "checkpoint dtype": str(dtype),
            },
        )
        box = [run]
        torch.distributed.broadcast_object_list(box, src=0)
        run = str(box[0])
        for ema in profiles:  # every rank, before anything can fail: the EMAs stay alike
            ema.catch_up()
        voted = []

        def vote() -> None:  # every file written: replace the old ones only if all ranks did
            voted.append(True)
            _share(None, folder, step)

        shard = (torch.distributed.get_rank(), torch.distributed.get_world_size())
        try:
            if shard[0] == 0:
                self._take_folder(folder, run, step)
            folder.mkdir(parents=True, exist_ok=True)
            return self._files(profiles, folder, step, dtype, run, shard, agreed, vote), run
        except (OSError, EMAError) as e:
            if voted:  # the vote failed (nothing replaced), or a rename after it did
                raise
            _share(e, folder, step)
            raise  # pragma: no cover - _share raises

    def _intact(self, path: Path, digest: str) -> bool:
        """Whether the existing side file ``path`` that this step would refer to holds what
        ``digest`` says (its bytes read and hashed once per writer and version of the file:
        a damaged one is written again instead of being referred to by new snapshots)."""
        try:
            key = (path, _identity(path))
            if key not in self.intact:
                check_side_file(path, digest=digest)
                self.intact.add(key)
        except (EMAError, OSError):
            return False
        return True

    def _files(
        self,
        profiles: Sequence[KarrasEMA],
        folder: Path,
        step: int,
        dtype: torch.dtype | None,
        run: str,
        shard: tuple[int, int] | None = None,
        write_id: int = 0,
        vote: Callable[[], None] | None = None,
    ) -> list[Path]:
        """Write this rank's files of ``step``: the side file of the shared frozen tensors
        (`emakit.posthoc.snapshots.frozen`) if new, renamed into place first, then one
        snapshot file per profile (of this rank's blocks, with ``shard=(rank, world)``), as
        one set."""
        names = [snapshot_filename(step, e.sigma_rel, e.gamma, shard) for e in profiles]
        paths = [own_path(folder / name, run) for name in names]  # never another run's
        models: list[Any] = [e.ema_model for e in profiles]
        part = None
        if self.store_frozen_once and not any(isinstance(m, ZeroPartitions) for m in models):
            states = [m.state_dict() if shard is None else model_blocks(m)[0] for m in models]
            shared = [e.shared_names() for e in profiles]
            part = frozen_part(states, shared, dtype=dtype, folder=folder, run=run, shard=shard)
            if part is not None and not part.new and not self._intact(part.path, part.digest):
                part = dataclasses.replace(part, new=True)  # damaged: written again, healed
        side = [part.path] if part is not None and part.new else []

        def produce(index: int) -> tuple[dict[str, Tensor], dict[str, str]]:
            if part is not None and side and index == 0:
                return snapshot_tensors(part.tensors, dtype), part.header(run)
            index -= len(side)
            ema, model = profiles[index], models[index]
            if shard is not None:
                state, blocks, shapes = model_blocks(model)
            elif isinstance(model, ZeroPartitions):  # one process: the partitions are whole
                state = {n: model.full(n, None) for n in model.layout()}
            else:
                state = model.state_dict()
            info = SnapshotInfo(
                path=paths[index],
                step=step,
                t=ema.t,
                gamma=ema.gamma,
                sigma_rel=ema.sigma_rel,
                profile=index,
                update_every=int(ema.update_every or 1),
                copied=frozenset(shapes if shard is not None else state) - ema.averaged_names(),
                run=run,
            )
            header = snapshot_header(info, None if part is None else part.fields(index))
            if shard is not None:
                header.update(shard_header(shard, write_id, shapes, blocks))
            leave = frozenset() if part is None else part.names[index]
            return snapshot_tensors(
                {n: v for n, v in state.items() if n not in leave}, dtype
            ), header

        written = write_snapshots(side + paths, produce, before_replace=vote)
        if side:  # written from the tensors just hashed: no need to read it back
            self.intact.add((side[0], _identity(side[0])))
        collect_frozen_files(folder, run, shard)  # the files of values no snapshot uses
        return written


def _identity(path: Path) -> tuple[int, ...]:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _share(failure: BaseException | None, folder: Path, step: int) -> None:
    """Every rank learns whether every rank wrote its files of ``step`` (each rank calls it
    once, with its failure or, its files complete but not yet in place, with None); if one
    did not, every rank raises, and no rank puts its new files in place, so the files they
    would have replaced (an earlier write of the same step) stay as they were."""
    dist = torch.distributed
    world = dist.get_world_size()
    mine = torch.tensor([0 if failure is None else 1], dtype=torch.int64)
    flags = [torch.empty_like(mine) for _ in range(world)]
    try:
        work = dist.all_gather(flags, mine, async_op=True)
        work.wait(timeout=datetime.timedelta(seconds=OUTCOME_TIMEOUT_S))
    except RuntimeError as e:
        raise EMARuntimeError(
            f"PostHocEMA.checkpoint: rank {dist.get_rank()} wrote its snapshot files of step "
            f"{step} but not every rank reported back within {OUTCOME_TIMEOUT_S:g} s (a rank "
            f"died while writing?): this rank put none of them in place, so the snapshots in "
            f"{str(folder)!r} are as they were before the call "
            f"({' '.join(str(e).split())[:160]})"
        ) from e
    failed = [r for r, f in enumerate(flags) if int(f) != 0]
    if not failed:
        return
    texts: list[Any] = [None] * world
    dist.all_gather_object(
        texts, None if failure is None else f"{type(failure).__name__}: {failure}"
    )
    if failure is not None:
        raise failure
    why = "; ".join(f"rank {r}: {texts[r]}" for r in failed)
    raise EMAWriteError(
        f"the snapshot of step {step} could not be written on every rank ({why}); no rank "
        f"put its files of that step in place: the snapshots in {str(folder)!r} are as they "
        f"were before the call (an earlier write of step {step}, if any, included)"
    )

"""EMAs of distributed models: DDP, FSDP2 (DTensor shards), sharded checkpoints, full exports.

* **DDP** needs nothing special: ``EMA(ddp_model)`` tracks ``ddp_model.module`` (see
  [`unwrap_model()`][emakit.unwrap_model], which also strips ``torch.compile``'s ``_orig_mod``). DDP
  keeps the weights equal on every rank, so every rank computes the same EMA with no
  communication; guard your own single-writer files with [`is_rank_zero()`][emakit.distributed.is_rank_zero] (not
  emakit's saves and exports: those are collectives, see below).
* **FSDP2** (``torch.distributed.fsdp.fully_shard``): each parameter is a ``DTensor`` of
  which a rank holds one shard. ``EMA(model)`` builds its EMA copy with
  [`copy_module()`][emakit.distributed.copy_module]: the same module tree, sharded by ``fully_shard`` with the same mesh,
  placements and grouping, so every rank stores the EMA of exactly the shard it owns. The
  update engine works on the local shards ([`local_tensor()`][emakit.distributed.local_tensor]), so ``update()`` runs no
  collective and allocates nothing (with ``skip_nonfinite=True``: one all-reduce of three
  numbers, so every rank skips alike). The EMA model runs a sharded forward (``ema(x)``, a
  collective: call it on every rank); ``swap()`` copies the EMA shards into the model's
  shards (FSDP2 all-gathers from its own shard storage, so re-pointing ``.data`` would not
  be seen) and copies them back on exit.
* **Checkpoints**: ``ema.state_dict()`` holds DTensors; [`save_sharded_ema()`][emakit.distributed.save_sharded_ema] and
  [`load_sharded_ema()`][emakit.distributed.load_sharded_ema] write and read them with ``torch.distributed.checkpoint`` (DCP),
  one file per rank, loadable into another world size (DCP reshards) or into a
  non-distributed EMA. A save goes into a fresh version folder and is switched to
  atomically, so a crash mid-save leaves the previous checkpoint loadable; a load never
  unpickles code (see `emakit._files.dcp`).
* **Weights files**: [`save_ema_weights()`][emakit.checkpoint.save_ema_weights] of a sharded
  EMA streams the full EMA into one safetensors file that loads straight into the model
  class, one tensor gathered and written at a time (`emakit._files.export`);
  [`load_ema_weights()`][emakit.checkpoint.load_ema_weights] reads it back, into any world
  size. Both are collectives for a sharded EMA; `save_full_ema_weights()` and
  `load_full_ema_weights()` are their older names, kept.
* **DeepSpeed** (``EMA(engine)`` or ``EMA(engine.module)``): under ZeRO-1 and 2 the
  parameters are whole on every rank, so the EMA is as under DDP. Under ZeRO-3 each rank
  keeps the EMA of its own partitions (``param.ds_tensor``, `emakit._dist.deepspeed`):
  ``update()`` runs no collective (``skip_nonfinite``: one all-reduce of three numbers);
  ``swap()`` and ``ema(x)`` copy the EMA partitions into ``ds_tensor`` and let DeepSpeed's
  own gather do the rest (collectives: every rank); ``ema.state_dict()`` is this rank's
  part, saved through ``engine.save_checkpoint(dir, client_state={"ema": ...})`` (every
  rank at the same step, checked); ``save_ema_weights`` streams the full EMA and
  ``load_ema_weights`` reads it back into any world size.
* **Collectives, checked**: the saves, the load and the export are collectives (call them
  on every rank, never inside ``if is_rank_zero():``). Each starts with a bounded
  agreement step (`emakit._dist.collectives`): ranks missing after ``timeout_s``, ranks in
  another call, or ranks whose EMAs are at different steps or skip counts raise on every
  rank instead of hanging or saving a mix.

Nothing here imports ``torch.distributed`` submodules at import time: a process that never
created a DTensor or an FSDP module pays one dictionary lookup per check.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from . import _validate as check
from ._core.sharding import copy_module
from ._core.swap import Swap
from ._dist.collectives import AGREE_TIMEOUT_S, agree_on, dist_ready, is_rank_zero
from ._dist.dtensor import fsdp_modules, is_dtensor, local_tensor
from ._files.reading import writable_folder
from .checkpoint import check_ema, load_ema_weights, write_weights
from .ema import EMA
from .errors import EMARuntimeError, EMAStateError, EMAValueError

__all__ = [
    "copy_module",
    "fsdp_modules",
    "is_dtensor",
    "is_rank_zero",
    "load_full_ema_weights",
    "load_sharded_ema",
    "local_tensor",
    "save_full_ema_weights",
    "save_sharded_ema",
    "sharded_checkpoint_dir",
    "swap_in_place",
]


def swap_in_place(ema: EMA) -> Swap:
    """Alias of [`ema.swap(in_place=True)`][emakit.EMA.swap], kept for code written before
    ``swap()`` took ``in_place``.

    Inside the block the model's own tensors hold the EMA values, copied in (a shard
    where sharded), so frameworks that read their own storage see them; the model's
    values come back on exit, also when the block raises.

    Example:
        >>> net = torch.nn.Linear(2, 2)
        >>> from emakit import EMA
        >>> ema = EMA(net, beta=0.9)
        >>> with swap_in_place(ema):
        ...     _ = net(torch.zeros(1, 2))  # runs on the EMA weights
    """
    return check_ema(ema).swap(in_place=True)


def save_full_ema_weights(
    ema: EMA,
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    timeout_s: float = AGREE_TIMEOUT_S,
) -> Path:
    """Alias of [`save_ema_weights()`][emakit.checkpoint.save_ema_weights] as a collective
    for every EMA, kept for code written before ``save_ema_weights`` wrote sharded EMAs.

    It writes the same file. The one difference: under ``torch.distributed`` it is a
    collective also for an EMA that every rank holds whole (DDP): **every rank must call
    it**; the ranks agree (same call, same ``step`` and skip count, bounded by
    ``timeout_s``) and rank 0 writes.

    Example:
        >>> # on every rank of a torchrun job, after ema = EMA(fsdp_model):
        >>> # save_full_ema_weights(ema, "ema.safetensors", dtype=torch.bfloat16)
    """
    return write_weights(ema, path, dtype=dtype, timeout_s=timeout_s, every_rank=True)


def load_full_ema_weights(
    ema: EMA, path: str | os.PathLike[str], *, timeout_s: float = AGREE_TIMEOUT_S
) -> dict[str, str]:
    """Alias of [`load_ema_weights()`][emakit.checkpoint.load_ema_weights], kept for code
    written before ``load_ema_weights`` read a file into a partitioned EMA (DeepSpeed
    ZeRO-3, ``partition=True``: a collective, every rank calls it)."""
    return load_ema_weights(ema, path, timeout_s=timeout_s)


# -- sharded checkpoints (DCP) ------------------------------------------------------------------


def _group(kwargs: dict[str, Any]) -> tuple[bool, Any, bool]:
    """``(distributed, process_group, coordinator)`` for DCP's keyword arguments."""
    group = kwargs.get("process_group")
    if kwargs.get("no_dist") or not dist_ready():
        return False, group, True
    return True, group, torch.distributed.get_rank(group=group) == 0


def _checked(ema: object, timeout_s: object) -> tuple[EMA, float]:
    """The EMA of a sharded save or load (its EMA model built if lazy) and its timeout."""
    ema = check_ema(ema)
    if ema.kind == "module" and ema._modules.get("ema_model") is None:  # (no read: a load
        ema.init_ema()  # may set shared frozen weights that the read would refuse)
    return ema, check.real("timeout_s", timeout_s, low=0.0, low_open=True)


def _failures(e: BaseException, folder: Path) -> str:
    """One line per failed rank of a DCP ``CheckpointException`` (its own text is a
    traceback per rank), and ``"; the disk is full ..."`` when a rank's failure is a full
    disk: an ``OSError`` ENOSPC, or torch's zip writer's "unexpected pos" (its way of
    saying it)."""
    failures = getattr(e, "failures", None) or {}
    lines, full = [], False
    for rank, (exc, _) in sorted(failures.items()):
        lines.append(f"rank {rank}: {' '.join(str(exc).split()) or type(exc).__name__}")
        chain: BaseException | None = exc
        while chain is not None and not full:
            full = isinstance(chain, OSError) and chain.errno == errno.ENOSPC
            full = full or "unexpected pos" in str(chain)
            chain = chain.__cause__ or chain.__context__
    disk = f"; the disk is full (ENOSPC: no space left on device) under {folder}" if full else ""
    return ("; ".join(lines) or str(e)) + disk


def save_sharded_ema(
    ema: EMA,
    checkpoint_id: str | os.PathLike[str],
    *,
    timeout_s: float = AGREE_TIMEOUT_S,
    **kwargs: Any,
) -> None:
    """Save the EMA's state with ``torch.distributed.checkpoint`` (call on every rank).

    The state is ``ema.state_dict(include_online_model=False)``: the online model is
    saved by the training checkpoint, never twice.

    Each rank writes the shards it holds (DTensors), plain tensors are written once, and
    the ``.metadata`` records the global layout, so the checkpoint loads into any world
    size (DCP reshards) or into a non-distributed EMA. To keep the EMA in one checkpoint
    with the model and optimizer, put ``ema.state_dict()`` under a key of the state you
    pass to ``torch.distributed.checkpoint.save`` instead.

    Crash-safe: ``checkpoint_id`` is a folder whose current checkpoint is named by a
    pointer file (``emakit-sharded.json``); the save writes a fresh version folder inside
    it (``v-<random>/``, a plain DCP checkpoint), then rank 0 replaces the pointer
    atomically and removes the previous version and any left by a killed save. A crash
    (SIGKILL, OOM, power cut) at any moment leaves the previous checkpoint loadable. A
    plain DCP folder (written by an older emakit or by ``dcp.save``) is switched to this
    layout by the first save over it. All ranks return once the new checkpoint is current.

    Before anything is written, the ranks check that they agree (one all-gather of a few
    numbers, which also hands every rank the new version's name): every rank must be in
    this call, and every rank's EMA at the same ``step`` with the same
    ``num_skipped_nonfinite``. A rank that called ``update()`` once more than the others
    would otherwise be saved under another rank's step.

    Args:
        ema: the EMA to save.
        checkpoint_id: the checkpoint folder, on a file system every rank shares (not a
            URL); created if missing.
        timeout_s: keyword-only; seconds a rank waits for the others at the agreement
            step before it raises (a call that only some ranks make fails this way instead
            of hanging until the process group times out). Default 30.
        **kwargs: passed to ``torch.distributed.checkpoint.save`` (``storage_writer``,
            ``planner``, ``process_group``, ``no_dist``...); a ``storage_writer`` is
            pointed at the new version folder.

    Raises:
        EMAValueError: ``checkpoint_id`` is a URL or not a valid UTF-8 name.
        EMAStateError: the ranks' EMAs are at different steps or skip counts (raised on
            every rank, naming the ranks and steps); nothing is written.
        EMARuntimeError: some ranks did not call it within ``timeout_s``, or DCP failed
            on some rank (disk full...); the message names the ranks and errors. The
            previous checkpoint stays current.

    Example:
        >>> # on every rank of a torchrun job, after ema = EMA(fsdp_model):
        >>> # save_sharded_ema(ema, "ckpt/ema")
    """
    import torch.distributed.checkpoint as dcp

    from ._files import dcp as _dcp

    ema, timeout_s = _checked(ema, timeout_s)
    if isinstance(checkpoint_id, str) and "://" in checkpoint_id:
        raise EMAValueError(
            f"checkpoint_id must be a file-system folder, got checkpoint_id={checkpoint_id!r}; "
            f"emakit switches sharded checkpoints over atomically with a pointer file, which "
            f"needs a (shared) file system: save to a local or mounted folder and copy it"
        )
    folder = writable_folder("checkpoint_id", checkpoint_id)
    distributed, group, coordinator = _group(kwargs)
    version = _dcp.new_version()
    if distributed:  # the coordinator's version name rides along with the check
        extra = int(version[2:], 16)
        agreed = agree_on("save_sharded_ema", ema, group=group, timeout_s=timeout_s, extra=extra)
        version = f"v-{agreed:016x}"
    if coordinator:
        folder.mkdir(parents=True, exist_ok=True)
    try:
        # The model's own checkpoint holds the online model: only the EMA is written.
        state = ema.state_dict(include_online_model=False)
        dcp.save(state, checkpoint_id=folder / version, **kwargs)
    except dcp.CheckpointException as e:
        if coordinator:  # every rank is done with it: DCP gathered their outcomes
            shutil.rmtree(folder / version, ignore_errors=True)
        raise EMARuntimeError(
            f"saving the sharded checkpoint {folder} failed ({_failures(e, folder)}); the "
            f"partial version folder {version} was removed and "
            f"the previous checkpoint there is still the current one"
        ) from e
    # DCP returns on the coordinator once every rank's data and the .metadata are written.
    if coordinator:
        _dcp.commit(folder, version)
        _dcp.remove_stale(folder, keep=version)
    if distributed:
        torch.distributed.barrier(group=group)


def sharded_checkpoint_dir(checkpoint_id: str | os.PathLike[str]) -> Path:
    """The DCP checkpoint folder holding ``checkpoint_id``'s current checkpoint: the version
    its pointer file names, or ``checkpoint_id`` itself for a plain DCP checkpoint. Pass it
    to ``torch.distributed.checkpoint.load`` to read the EMA state yourself.

    Raises:
        EMAStateError: the pointer file is damaged.
    """
    from ._files import dcp as _dcp

    folder = Path(os.fspath(checkpoint_id))
    current = _dcp.read_pointer(folder)
    return folder if current is None else folder / current


def load_sharded_ema(
    ema: EMA,
    checkpoint_id: str | os.PathLike[str],
    *,
    timeout_s: float = AGREE_TIMEOUT_S,
    **kwargs: Any,
) -> None:
    """Load a checkpoint written by [`save_sharded_ema()`][emakit.distributed.save_sharded_ema] into ``ema`` (every rank).

    DCP reads each rank's part of every tensor straight into the EMA's own tensors, so a
    checkpoint saved on N ranks loads on M ranks, or in a process without
    ``torch.distributed`` into a plain ``EMA(model)`` (full tensors). The step counter and
    the other bookkeeping come back too. A plain DCP checkpoint folder loads as well.

    Nothing is unpickled but DCP's own metadata classes: the ``.metadata`` file is read with
    an unpickler that resolves only those (a crafted file raises instead of running code),
    entries stored as pickled objects are refused, and tensor data is read with
    ``torch.load(weights_only=True)``. A ``storage_reader`` you pass replaces that reader
    and reads as it does (DCP's ``FileSystemReader`` unpickles the metadata).

    Under ``torch.distributed`` the ranks first check that every one of them is in this
    call (one small all-gather, bounded by ``timeout_s``), and after loading that every
    rank holds the same ``step`` and ``num_skipped_nonfinite`` (another).

    Args:
        ema: the EMA to load into (built like the saved one: same model and names).
        checkpoint_id: the checkpoint folder.
        timeout_s: keyword-only; seconds a rank waits for the others at the first check
            before it raises. Default 30.
        **kwargs: passed to ``torch.distributed.checkpoint.load``.

    Raises:
        EMAStateError: the checkpoint refers to anything but DCP's metadata classes, holds
            pickled entries or file names outside the folder, or does not fit the EMA; or
            the ranks loaded different steps or skip counts (on every rank).
        EMARuntimeError: some ranks did not call it within ``timeout_s``.
    """
    import torch.distributed.checkpoint as dcp

    from ._files import dcp as _dcp

    ema, timeout_s = _checked(ema, timeout_s)
    distributed, group, coordinator = _group(kwargs)
    folder = Path(os.fspath(checkpoint_id))
    # the coordinator's current version (0: a plain DCP folder) rides along with the check
    current = _dcp.read_pointer(folder) if coordinator else None
    if distributed:
        extra = 0 if current is None else int(current[2:], 16)
        kw = {"group": group, "timeout_s": timeout_s, "extra": extra, "check_counts": False}
        agreed = agree_on("load_sharded_ema", ema, **kw)
        current = f"v-{agreed:016x}" if agreed else None
    target = folder if current is None else folder / current
    reader = kwargs.pop("storage_reader", None) or _dcp.SafeReader(target)
    # the EMA's own tensors to load into (keep_vars: past the check of shared frozen
    # weights, which a load may be setting), detached as DCP loads into plain tensors
    state = ema.state_dict(keep_vars=True, include_online_model=False)
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            state[key] = value.detach()
    _unalias(state, ema.model)
    try:
        dcp.load(state, checkpoint_id=target, storage_reader=reader, **kwargs)
    except dcp.CheckpointException as e:
        refused = getattr(reader, "refused", None)  # torch 2.9 hides the reader's refusal
        if refused is not None:
            raise refused from None
        raise EMAStateError(
            f"sharded checkpoint {folder} cannot be loaded: {_failures(e, folder)}"
        ) from None
    ema.load_state_dict(state)
    if distributed:
        agree_on("load_sharded_ema (after loading)", ema, group=group, timeout_s=timeout_s)


def _unalias(state: dict[str, Any], model: object) -> None:
    """Replace the entries of ``state`` that are ``model``'s own parameters (the frozen
    weights an EMA shares with it, see ``share_frozen``) by empty tensors like them: DCP
    loads into the tensors it is given, in place, which would write into the model. The
    EMA's ``load_state_dict`` then copies them in, copy-on-write."""
    if not isinstance(model, torch.nn.Module):
        return
    own = {local_tensor(p).data_ptr() for p in model.parameters() if local_tensor(p).numel()}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue
        local = local_tensor(value)
        if local.numel() and local.data_ptr() in own:
            state[key] = torch.empty_like(value)

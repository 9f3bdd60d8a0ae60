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
  unpickles code (see `emakit._files.dcp`). [`save_full_ema_weights()`][emakit.distributed.save_full_ema_weights] streams the
  full EMA into one safetensors file that loads straight into the model class, one
  tensor gathered and written at a time (`emakit._files.export`).
* **DeepSpeed** (``EMA(engine)`` or ``EMA(engine.module)``): under ZeRO-1 and 2 the
  parameters are whole on every rank, so the EMA is as under DDP. Under ZeRO-3 each rank
  keeps the EMA of its own partitions (``param.ds_tensor``, `emakit._dist.deepspeed`):
  ``update()`` runs no collective (``skip_nonfinite``: one all-reduce of three numbers);
  ``swap()`` and ``ema(x)`` copy the EMA partitions into ``ds_tensor`` and let DeepSpeed's
  own gather do the rest (collectives: every rank); ``ema.state_dict()`` is this rank's
  part, saved through ``engine.save_checkpoint(dir, client_state={"ema": ...})`` (every
  rank at the same step, checked);
  [`save_full_ema_weights`][emakit.distributed.save_full_ema_weights] streams the full
  EMA and [`load_full_ema_weights`][emakit.distributed.load_full_ema_weights] reads it
  back into any world size.
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
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from . import _validate as check
from ._core.sharding import copy_module
from ._dist.collectives import AGREE_TIMEOUT_S
from ._dist.deepspeed import WORLD_KEY, ZeroPartitions
from ._dist.dtensor import fsdp_modules, is_dtensor, local_tensor
from ._dist.ranks import dist_ready, is_rank_zero
from ._files.reading import writable_folder, writable_path
from .checkpoint import save_ema_weights
from .ema import EMA
from .errors import EMAError, EMARuntimeError, EMAStateError, EMATypeError, EMAValueError

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


@contextmanager
def swap_in_place(ema: EMA) -> Iterator[None]:
    """Like ``ema.swap()``, but the EMA values are copied into the model's tensors in place.

    ``swap()`` re-points ``.data``, which frameworks that read their own storage do not
    see (it already copies for FSDP2 shards and DeepSpeed ZeRO-3 partitions). Use this for
    them: whatever reads the model's storage then reads the EMA weights. The model's
    values are stashed (one copy of each tracked tensor, a shard where sharded) and copied
    back on exit, also when the block raises; ``update()`` inside the block is an error,
    as in ``swap()``. Same as ``ema.swap(in_place=True)``.

    Args:
        ema: an [`EMA`][emakit.EMA] (of a module or a pytree).

    Example:
        >>> net = torch.nn.Linear(2, 2)
        >>> from emakit import EMA
        >>> ema = EMA(net, beta=0.9)
        >>> with swap_in_place(ema):
        ...     _ = net(torch.zeros(1, 2))  # runs on the EMA weights
    """
    if not isinstance(ema, EMA):
        raise EMATypeError(f"ema must be an emakit EMA or EMAPytree, got {type(ema).__name__}")
    with ema.swap(in_place=True):
        yield


# -- checkpoints ------------------------------------------------------------------------------


def _ema_module(ema: object) -> EMA:
    if not isinstance(ema, EMA):
        raise EMATypeError(
            f"ema must be an emakit EMA of a module, got ema={type(ema).__name__}; "
            f"wrap the model first: ema = emakit.EMA(model)"
        )
    if ema.ema_model is None:
        ema.init_ema()
    return ema


def _checkpoint_folder(checkpoint_id: object) -> Path:
    if isinstance(checkpoint_id, str) and "://" in checkpoint_id:
        raise EMAValueError(
            f"checkpoint_id must be a file-system folder, got checkpoint_id={checkpoint_id!r}; "
            f"emakit switches sharded checkpoints over atomically with a pointer file, which "
            f"needs a (shared) file system: save to a local or mounted folder and copy it"
        )
    return writable_folder("checkpoint_id", checkpoint_id)


def _group(kwargs: dict[str, Any]) -> tuple[bool, Any, bool]:
    """``(distributed, process_group, coordinator)`` for DCP's keyword arguments."""
    group = kwargs.get("process_group")
    if kwargs.get("no_dist") or not dist_ready():
        return False, group, True
    return True, group, torch.distributed.get_rank(group=group) == 0


def _agree(name: str, distributed: bool, group: Any) -> str:
    """The coordinator's ``name`` on every rank of ``group``."""
    if not distributed:
        return name
    box = [name]
    source = torch.distributed.get_global_rank(group, 0) if group is not None else 0
    torch.distributed.broadcast_object_list(box, src=source, group=group)
    return str(box[0])


def _check_ranks(
    ema: EMA,
    operation: str,
    group: Any,
    timeout_s: float,
    *,
    counts: bool = True,
    extra: int = 0,
) -> Any:
    """Every rank is in ``operation`` with the same step and skip count (one bounded
    all-gather; see `emakit._dist.collectives`)."""
    from ._dist import collectives as _collectives

    return _collectives.agree(
        operation,
        step=int(ema.step),
        skips=ema.num_skipped_nonfinite,
        group=group,
        timeout_s=timeout_s,
        check_counts=counts,
        extra=extra,
    )


def _timeout(timeout_s: float) -> float:
    return check.real("timeout_s", timeout_s, low=0.0, low_open=True)


def _failures(e: BaseException) -> str:
    """One line per failed rank of a DCP ``CheckpointException`` (its own text is a
    traceback per rank)."""
    failures = getattr(e, "failures", None) or {}
    lines = []
    for rank, (exc, _) in sorted(failures.items()):
        text = " ".join(str(exc).split()) or type(exc).__name__
        lines.append(f"rank {rank}: {text}")
    return "; ".join(lines) or str(e)


def _disk_full(e: BaseException, folder: Path) -> str:
    """``"; the disk is full (ENOSPC ...)"`` when a rank's failure is a full disk: an
    ``OSError`` ENOSPC, or torch's zip writer's "unexpected pos" (its way of saying it)."""
    failures = getattr(e, "failures", None) or {}
    for exc, _ in failures.values():
        chain: BaseException | None = exc
        while chain is not None:
            full = isinstance(chain, OSError) and chain.errno == errno.ENOSPC
            if full or "unexpected pos" in str(chain):
                return f"; the disk is full (ENOSPC: no space left on device) under {folder}"
            chain = chain.__cause__ or chain.__context__
    return ""


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

    ema = _ema_module(ema)
    timeout_s = _timeout(timeout_s)
    folder = _checkpoint_folder(checkpoint_id)
    distributed, group, coordinator = _group(kwargs)
    version = _dcp.new_version()
    if distributed:  # the coordinator's version name rides along with the check
        agreed = _check_ranks(ema, "save_sharded_ema", group, timeout_s, extra=int(version[2:], 16))
        version = f"v-{agreed.extra:016x}"
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
            f"saving the sharded checkpoint {folder} failed ({_failures(e)})"
            f"{_disk_full(e, folder)}; the partial version folder {version} was removed and "
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

    return _dcp.resolve(Path(os.fspath(checkpoint_id)))


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

    ema = _ema_module(ema)
    timeout_s = _timeout(timeout_s)
    distributed, group, coordinator = _group(kwargs)
    if distributed:
        _check_ranks(ema, "load_sharded_ema", group, timeout_s, counts=False)
    folder = Path(os.fspath(checkpoint_id))
    name = _agree(str(_dcp.resolve(folder)) if coordinator else "", distributed, group)
    target = Path(name)
    reader = kwargs.pop("storage_reader", None) or _dcp.SafeReader(target)
    state = ema.state_dict(include_online_model=False)
    _unalias(state, ema.model)
    try:
        dcp.load(state, checkpoint_id=target, storage_reader=reader, **kwargs)
    except dcp.CheckpointException as e:
        raise EMAStateError(
            f"sharded checkpoint {folder} cannot be loaded: {_failures(e)}"
        ) from None
    ema.load_state_dict(state)
    if distributed:
        _check_ranks(ema, "load_sharded_ema (after loading)", group, timeout_s)


def save_full_ema_weights(
    ema: EMA,
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    timeout_s: float = AGREE_TIMEOUT_S,
) -> Path:
    """Write the full EMA weights to one safetensors file (a collective: call on every rank).

    **Every rank must call it**, not only rank 0: do not put it inside
    ``if is_rank_zero():``. Rank 0 writes the file; the others take part in gathering the
    shards and return once the file is complete. Under ``torch.distributed`` the ranks
    first check that they agree (one small all-gather): a call that only some ranks make
    raises [`EMARuntimeError`][emakit.errors.EMARuntimeError] after ``timeout_s`` seconds instead of hanging,
    and EMAs at different steps or skip counts raise [`EMAStateError`][emakit.errors.EMAStateError] on
    every rank.

    For an FSDP2 EMA, and for an EMA of a DeepSpeed ZeRO-3 model (gathered from the
    ranks' partitions), the file is streamed: tensor by tensor, each rank casts its shard to
    ``dtype``, the shards are gathered to rank 0 (for FSDP2's and HSDP's rows a gather, not
    an all-gather: the other ranks receive nothing), rank 0 appends the tensor to the file
    and drops it. Rank 0's extra memory is about twice the largest tensor in the export
    dtype (the gathered tensor and its CPU copy), whatever the model's size; every other
    rank holds its padded shard of one tensor at a time (a ZeRO-3 gather: one gathered
    tensor). Otherwise (DDP, one process) every rank already holds
    the full EMA and rank 0 writes it with [`save_ema_weights()`][emakit.checkpoint.save_ema_weights].
    Either way the file has ``save_ema_weights``'s layout and header (the model's own class
    name), is written atomically, and loads straight into the model class::

        model.load_state_dict(safetensors.torch.load_file(path))

    Args:
        ema: the EMA to export.
        path: the destination file; its folder is created if missing.
        dtype: cast floating tensors to this dtype on the way out (e.g. ``torch.bfloat16``),
            before they are gathered. Default None keeps the shadow dtype.
        timeout_s: keyword-only; seconds a rank waits for the others at the agreement step.
            Default 30.

    Returns:
        ``path`` as a `Path`, on every rank.

    Raises:
        EMARuntimeError: some ranks did not call it within ``timeout_s`` (the process group
            is unusable afterwards), or they are in another emakit collective.
        EMAStateError: the ranks' EMAs are at different steps or skip counts.
        OSError: rank 0 could not write the file: an ``EMAWriteError`` (also an
            [`EMAError`][emakit.errors.EMAError]), raised on every rank; any previous file is left
            whole.

    Example:
        >>> # on every rank of a torchrun job, after ema = EMA(fsdp_model):
        >>> # save_full_ema_weights(ema, "ema.safetensors", dtype=torch.bfloat16)
    """
    from ._files import export as _export

    ema = _ema_module(ema)
    dest = writable_path("path", path)
    dtype = check.floating_dtype("dtype", dtype)
    timeout_s = _timeout(timeout_s)
    if dist_ready():
        _check_ranks(ema, "save_full_ema_weights", None, timeout_s)
    failure: BaseException | None = None
    model = ema.ema_model
    if isinstance(model, ZeroPartitions):  # DeepSpeed ZeRO-3: gathered from the partitions
        failure = _export.write_sharded(
            ema,
            dest,
            dtype,
            tensors=model.layout(),
            gather=model.full,
            model_name=model.model_class,
        )
    elif any(is_dtensor(t) for t in model.state_dict().values()):
        failure = _export.write_sharded(ema, dest, dtype)
    elif is_rank_zero():
        try:
            save_ema_weights(ema, dest, dtype=dtype)
        except (OSError, EMAError) as e:  # reported on every rank below
            failure = e
    _export.share_outcome(failure, str(dest))
    return dest


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


def load_full_ema_weights(
    ema: EMA, path: str | os.PathLike[str], *, timeout_s: float = AGREE_TIMEOUT_S
) -> dict[str, str]:
    """Load a full EMA file
    ([`save_full_ema_weights`][emakit.distributed.save_full_ema_weights]) into a
    partitioned EMA (of a DeepSpeed ZeRO-3 model, or ``partition=True``; a collective:
    call on every rank), on any number of ranks.

    Each rank reads the file, one tensor at a time, and keeps its own partition of each
    (the slice of the flattened tensor that DeepSpeed's ``ds_tensor`` holds on this rank);
    ``step`` and ``initted`` come from the header. This is how an EMA moves to another
    world size: a per-rank ``ema.state_dict()`` holds partitions cut for one world size
    and is refused on another. Any other EMA loads the file with
    [`load_ema_weights()`][emakit.checkpoint.load_ema_weights].

    Args:
        ema: a partitioned EMA (``EMA(engine)`` of a ZeRO-3 engine, or ``partition=True``).
        path: the safetensors file, readable by every rank.
        timeout_s: keyword-only; seconds a rank waits for the others at the agreement step.
            Default 30.

    Returns:
        The file's header metadata.

    Raises:
        EMATypeError: ``ema`` is not a partitioned EMA.
        EMAStateError: the file does not fit the model (names, shapes), or is damaged.
        EMARuntimeError: some ranks did not call it within ``timeout_s``.
    """
    from ._files.safetensors_file import SafetensorsFile
    from .checkpoint import as_path, emakit_header, load_weights

    ema = _ema_module(ema)
    model = ema.ema_model
    if not isinstance(model, ZeroPartitions):
        raise EMATypeError(
            "load_full_ema_weights loads into a partitioned EMA (DeepSpeed ZeRO-3, or "
            "partition=True); load a full file into any other EMA with "
            "emakit.checkpoint.load_ema_weights(ema, path)"
        )
    src = as_path("path", path)
    timeout_s = _timeout(timeout_s)
    if dist_ready():
        _check_ranks(ema, "load_full_ema_weights", None, timeout_s, counts=False)
    weights: dict[str, torch.Tensor] = {WORLD_KEY: model.layout_tensor()}
    with SafetensorsFile(src, "EMA weights file") as f:
        metadata = dict(f.metadata)
        for name in f.keys():  # noqa: SIM118 (a file, not a dict)
            weights[name] = model.own_part(name, f.get(name))
    header = emakit_header(metadata, str(src))
    step, initted = header if header is not None else (None, True)
    load_weights(ema, weights, step=step, initted=initted, strict=True, source=str(src))
    return metadata

"""EMAs of distributed models: DDP, FSDP2 (DTensor shards), sharded checkpoints, full exports.

* **DDP** needs nothing special: ``EMA(ddp_model)`` tracks ``ddp_model.module`` (see
  :func:`~emakit.unwrap_model`, which also strips ``torch.compile``'s ``_orig_mod``). DDP
  keeps the weights equal on every rank, so every rank computes the same EMA with no
  communication; write files from one rank only (:func:`is_rank_zero`).
* **FSDP2** (``torch.distributed.fsdp.fully_shard``): each parameter is a ``DTensor`` of
  which a rank holds one shard. ``EMA(model)`` builds its EMA copy with
  :func:`copy_module`: the same module tree, sharded by ``fully_shard`` with the same mesh,
  placements and grouping, so every rank stores the EMA of exactly the shard it owns. The
  update engine works on the local shards (:func:`local_tensor`), so ``update()`` runs no
  collective and allocates nothing. The EMA model runs a sharded forward (``ema(x)``, a
  collective: call it on every rank); ``swap()`` copies the EMA shards into the model's
  shards (FSDP2 all-gathers from its own shard storage, so re-pointing ``.data`` would not
  be seen) and copies them back on exit.
* **Checkpoints**: ``ema.state_dict()`` holds DTensors; :func:`save_sharded_ema` and
  :func:`load_sharded_ema` write and read them with ``torch.distributed.checkpoint`` (DCP),
  one file per rank, loadable into another world size (DCP reshards) or into a
  non-distributed EMA. A save goes into a fresh version folder and is switched to
  atomically, so a crash mid-save leaves the previous checkpoint loadable; a load never
  unpickles code (see :mod:`emakit._dcp`). :func:`save_full_ema_weights` gathers the full EMA weights to rank 0
  and writes one safetensors file that loads straight into the model class.

Nothing here imports ``torch.distributed`` submodules at import time: a process that never
created a DTensor or an FSDP module pays one dictionary lookup per check.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor

from . import _validate as check
from ._dtensor import (
    dist_ready,
    fsdp_module_type,
    fsdp_modules,
    is_dtensor,
    is_rank_zero,
    local_tensor,
)
from ._files import writable_path
from ._io import atomic_path
from ._safetensors import write_safetensors
from .checkpoint import save_ema_weights, weights_header
from .core.sharding import copy_module
from .ema import EMA
from .errors import EMARuntimeError, EMAStateError, EMATypeError, EMAValueError

__all__ = [
    "copy_module",
    "fsdp_modules",
    "is_dtensor",
    "is_rank_zero",
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
    see (it already copies for FSDP2 shards). Use this for them, e.g. for an EMA of
    DeepSpeed ZeRO-3 partitions (``EMA({n: p.ds_tensor for n, p in
    engine.module.named_parameters()})``), whose ``GatheredParameters`` then gathers the
    EMA weights. The model's values are stashed (one copy of each tracked tensor, a shard
    where sharded) and copied back on exit, also when the block raises; ``update()``
    inside the block is an error, as in ``swap()``. Same as ``ema.swap(in_place=True)``.

    Args:
        ema: an :class:`~emakit.EMA` (of a module or a pytree).

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
    return writable_path("checkpoint_id", checkpoint_id)


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


def _failures(e: BaseException) -> str:
    """One line per failed rank of a DCP ``CheckpointException`` (its own text is a
    traceback per rank)."""
    failures = getattr(e, "failures", None) or {}
    lines = []
    for rank, (exc, _) in sorted(failures.items()):
        text = " ".join(str(exc).split()) or type(exc).__name__
        lines.append(f"rank {rank}: {text}")
    return "; ".join(lines) or str(e)


def save_sharded_ema(ema: EMA, checkpoint_id: str | os.PathLike[str], **kwargs: Any) -> None:
    """Save ``ema.state_dict()`` with ``torch.distributed.checkpoint`` (call on every rank).

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

    Args:
        ema: the EMA to save.
        checkpoint_id: the checkpoint folder, on a file system every rank shares (not a
            URL); created if missing.
        **kwargs: passed to ``torch.distributed.checkpoint.save`` (``storage_writer``,
            ``planner``, ``process_group``, ``no_dist``...); a ``storage_writer`` is
            pointed at the new version folder.

    Raises:
        EMAValueError: ``checkpoint_id`` is a URL or not a valid UTF-8 name.
        EMARuntimeError: DCP failed on some rank (disk full...); the message names the
            ranks and errors. The previous checkpoint stays current.

    Example:
        >>> # on every rank of a torchrun job, after ema = EMA(fsdp_model):
        >>> # save_sharded_ema(ema, "ckpt/ema")
    """
    import torch.distributed.checkpoint as dcp

    from . import _dcp

    ema = _ema_module(ema)
    folder = _checkpoint_folder(checkpoint_id)
    distributed, group, coordinator = _group(kwargs)
    version = _agree(_dcp.new_version(), distributed, group)
    if coordinator:
        folder.mkdir(parents=True, exist_ok=True)
    try:
        dcp.save(ema.state_dict(), checkpoint_id=folder / version, **kwargs)
    except dcp.CheckpointException as e:
        raise EMARuntimeError(
            f"saving the sharded checkpoint {folder} failed ({_failures(e)}); the previous "
            f"checkpoint there is still the current one"
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
    from . import _dcp

    return _dcp.resolve(Path(os.fspath(checkpoint_id)))


def load_sharded_ema(ema: EMA, checkpoint_id: str | os.PathLike[str], **kwargs: Any) -> None:
    """Load a checkpoint written by :func:`save_sharded_ema` into ``ema`` (every rank).

    DCP reads each rank's part of every tensor straight into the EMA's own tensors, so a
    checkpoint saved on N ranks loads on M ranks, or in a process without
    ``torch.distributed`` into a plain ``EMA(model)`` (full tensors). The step counter and
    the other bookkeeping come back too. A plain DCP checkpoint folder loads as well.

    Nothing is unpickled but DCP's own metadata classes: the ``.metadata`` file is read with
    an unpickler that resolves only those (a crafted file raises instead of running code),
    entries stored as pickled objects are refused, and tensor data is read with
    ``torch.load(weights_only=True)``. A ``storage_reader`` you pass replaces that reader
    and reads as it does (DCP's ``FileSystemReader`` unpickles the metadata).

    Args:
        ema: the EMA to load into (built like the saved one: same model and names).
        checkpoint_id: the checkpoint folder.
        **kwargs: passed to ``torch.distributed.checkpoint.load``.

    Raises:
        EMAStateError: the checkpoint refers to anything but DCP's metadata classes, holds
            pickled entries or file names outside the folder, or does not fit the EMA.
    """
    import torch.distributed.checkpoint as dcp

    from . import _dcp

    ema = _ema_module(ema)
    distributed, group, coordinator = _group(kwargs)
    folder = Path(os.fspath(checkpoint_id))
    name = _agree(str(_dcp.resolve(folder)) if coordinator else "", distributed, group)
    target = Path(name)
    reader = kwargs.pop("storage_reader", None) or _dcp.SafeReader(target)
    state = ema.state_dict()
    try:
        dcp.load(state, checkpoint_id=target, storage_reader=reader, **kwargs)
    except dcp.CheckpointException as e:
        raise EMAStateError(
            f"sharded checkpoint {folder} cannot be loaded: {_failures(e)}"
        ) from None
    ema.load_state_dict(state)


def save_full_ema_weights(
    ema: EMA,
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write the full EMA weights to one safetensors file, from rank 0 only (call on every rank).

    For an FSDP2 EMA the shards are gathered to rank 0's CPU memory, tensor group by tensor
    group (``get_model_state_dict(full_state_dict=True, cpu_offload=True)``; other ranks
    keep nothing). Otherwise (DDP, one process) every rank already holds the full EMA and
    rank 0 writes it. The file has :func:`~emakit.checkpoint.save_ema_weights`'s layout and
    header, is written atomically, and loads straight into the model class::

        model.load_state_dict(safetensors.torch.load_file(path))

    All ranks wait until the file is complete before returning.

    Args:
        ema: the EMA to export.
        path: the destination file; its folder is created if missing.
        dtype: cast floating tensors to this dtype on the way out (e.g. ``torch.bfloat16``).
            Default None keeps the shadow dtype.

    Returns:
        ``path`` as a :class:`~pathlib.Path`, on every rank.
    """
    ema = _ema_module(ema)
    dest = Path(os.fspath(path))
    dtype = check.floating_dtype("dtype", dtype)
    ema_model = ema.ema_model
    if any(is_dtensor(t) for t in ema_model.parameters()):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        tensors = cast(
            dict[str, Tensor], get_model_state_dict(ema_model, options=options)
        )  # a collective
        if is_rank_zero():
            header = weights_header(ema, tensors, dtype)
            fsdp_cls = fsdp_module_type()
            cls = next(c for c in type(ema_model).__mro__ if not issubclass(c, fsdp_cls or ()))
            header["model_class"] = cls.__name__
            with atomic_path(dest) as tmp, open(tmp, "wb") as f:
                write_safetensors(f, tensors, header, dtype)
    elif is_rank_zero():
        save_ema_weights(ema, dest, dtype=dtype)
    if dist_ready():
        torch.distributed.barrier()
    return dest

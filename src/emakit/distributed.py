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
  non-distributed EMA. :func:`save_full_ema_weights` gathers the full EMA weights to rank 0
  and writes one safetensors file that loads straight into the model class.

Nothing here imports ``torch.distributed`` submodules at import time: a process that never
created a DTensor or an FSDP module pays one dictionary lookup per check.
"""

from __future__ import annotations

import os
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from copy import deepcopy
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn

from .errors import EMAStateError, EMATypeError

if TYPE_CHECKING:
    from .ema import EMA, _EMABase
    from .engine.plan import TensorPair

__all__ = [
    "copy_module",
    "fsdp_modules",
    "is_dtensor",
    "is_rank_zero",
    "load_sharded_ema",
    "local_tensor",
    "save_full_ema_weights",
    "save_sharded_ema",
    "swap_in_place",
    "unsharded_pairs",
]


# -- DTensor and FSDP2 detection (no import unless the user already imported them) -----


def _dtensor_type() -> type | None:
    module = sys.modules.get("torch.distributed.tensor._api")
    return getattr(module, "DTensor", None)


def _fsdp_module_type() -> type | None:
    module = sys.modules.get("torch.distributed.fsdp._fully_shard._fully_shard")
    return getattr(module, "FSDPModule", None)


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (e.g. an FSDP2 parameter)."""
    cls = _dtensor_type()
    return cls is not None and isinstance(t, cls)


def local_tensor(t: Tensor) -> Tensor:
    """The shard of a DTensor this rank holds; any other tensor is returned as is.

    For an FSDP2 parameter this is the very tensor FSDP2 all-gathers from (a view of its
    padded shard storage), so in-place updates of it are seen by the next forward.

    Example:
        >>> local_tensor(torch.ones(2)).shape
        torch.Size([2])
    """
    return t._local_tensor if is_dtensor(t) else t  # type: ignore[attr-defined]


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that ``fully_shard`` was applied to (``[]`` without FSDP2)."""
    cls = _fsdp_module_type()
    return [] if cls is None else [m for m in model.modules() if isinstance(m, cls)]


def _dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def is_rank_zero() -> bool:
    """True on rank 0 of the default process group, and in a non-distributed process.

    Guard single-writer outputs with it (``save_ema_weights``, snapshots, logs) so they are
    written once, not once per rank.
    """
    return not _dist_ready() or torch.distributed.get_rank() == 0


# -- hooks the EMA calls ------------------------------------------------------------------


def check_sharded_pair(name: str, shadow: Tensor, online: Tensor) -> None:
    """Raise unless the EMA tensor is sharded exactly like the model tensor (or neither is)."""
    s, o = is_dtensor(shadow), is_dtensor(online)
    if not (s or o):
        return
    if s != o:
        where, other = ("the model", "the EMA") if o else ("the EMA", "the model")
        hint = (
            "build the EMA after fully_shard (EMA(model) shards its copy like the model), or "
            "pass an ema_model sharded with the same fully_shard calls"
            if o
            else "if the model is FSDP2, its parameters are gathered right now (after a "
            "no-grad forward of a module with reshard_after_forward=False): call reshard() "
            "on its FSDP modules first"
        )
        raise EMAStateError(
            f"tensor {name!r} is a DTensor (sharded) in {where} but a plain tensor in "
            f"{other}; {hint}"
        )
    ls, lo = local_tensor(shadow), local_tensor(online)
    sp, op = tuple(shadow.placements), tuple(online.placements)  # type: ignore[attr-defined]
    same_mesh = shadow.device_mesh == online.device_mesh  # type: ignore[attr-defined]
    if not same_mesh or sp != op or ls.shape != lo.shape:
        raise EMAStateError(
            f"tensor {name!r} is sharded as {sp} with local shape {tuple(ls.shape)} in the EMA "
            f"but as {op} with local shape {tuple(lo.shape)} in the model"
            f"{'' if same_mesh else ', on another device mesh'}; shard ema_model with the "
            f"same mesh and fully_shard calls as the model"
        )


def unsharded_pairs(pairs: list[TensorPair], *, device: object = None) -> list[TensorPair]:
    """The pairs whose shadow is not a DTensor: the ones the EMA lays out in its own buffers.

    DTensor shadows stay in FSDP2's shard storage (filled by :func:`copy_module`), on the
    model's device; an EMA kept on another ``device`` is refused for them.
    """
    plain = [p for p in pairs if not is_dtensor(p.shadow)]
    if device is not None and len(plain) < len(pairs):
        raise EMATypeError(
            f"device={device!r} (an offloaded EMA) is not supported for FSDP2 models: each "
            f"rank's EMA shard stays with its model shard, already 1/world_size of the EMA; "
            f"to keep shards in CPU memory, shard the model with "
            f"fully_shard(..., offload_policy=CPUOffloadPolicy()) and the EMA copy follows"
        )
    return plain


class _AttrView(dict):
    """``view.get(name)`` reads ``obj.name``: lets the EMA's identity guards (which watch
    ``dict`` entries, e.g. ``module._buffers``) watch an attribute of a DTensor."""

    def __init__(self, obj: object) -> None:
        super().__init__()
        self._obj = obj

    def get(self, key: Any, default: Any = None) -> Any:
        return getattr(self._obj, key, default)


def sharded_guards(model: nn.Module) -> list[tuple[dict, str, Tensor]]:
    """Identity guards on the local shard of every DTensor of ``model``.

    FSDP2 replaces a parameter's local tensor when the parameter is moved or re-loaded
    (``model.to()``, ``load_state_dict(assign=True)``); the EMA's plan holds the local
    tensors, so it must be rebuilt then.
    """
    if _dtensor_type() is None:
        return []
    return [
        (_AttrView(t), "_local_tensor", t._local_tensor)  # type: ignore[attr-defined]
        for t in (*model.parameters(), *model.buffers())
        if is_dtensor(t)
    ]


def _reshard(modules: Sequence[nn.Module]) -> None:
    # A root with reshard_after_forward=False keeps its all-gathered weights after a
    # no-grad forward; the next forward would reuse them instead of re-gathering the
    # shards that swap() just changed.
    for m in modules:
        m.reshard()  # type: ignore[operator]


@contextmanager
def _copied_in(pairs: Sequence[TensorPair]) -> Iterator[None]:
    """Copy each shadow into its online tensor in place; copy the online values back on exit.

    The stash holds one copy of each online tensor (for a sharded model: of this rank's
    shard only).
    """
    stash: list[tuple[Tensor, Tensor]] = []
    try:
        with torch.no_grad():
            for p in pairs:
                online = local_tensor(p.online)
                stash.append((online, online.clone()))
                online.copy_(local_tensor(p.shadow))
        yield
    finally:
        with torch.no_grad():
            for online, saved in reversed(stash):
                online.copy_(saved)


@contextmanager
def swap_sharded(model: object, pairs: Sequence[TensorPair]) -> Iterator[None]:
    """Inside the block the model's DTensor shards hold the EMA's; plain pairs are untouched.

    FSDP2 all-gathers from its own shard storage, not from ``param.data``, so the EMA
    values are copied in (and the model's copied out to a stash, one shard per tensor) and
    the FSDP modules are resharded on entry and exit so no stale gathered weight is used.
    """
    sharded = [p for p in pairs if is_dtensor(p.online)]
    if not sharded:
        yield
        return
    roots = fsdp_modules(model) if isinstance(model, nn.Module) else []
    _reshard(roots)
    try:
        with _copied_in(sharded):
            yield
    finally:
        _reshard(roots)


@contextmanager
def swap_in_place(ema: _EMABase) -> Iterator[None]:
    """Like ``ema.swap()``, but the EMA values are copied into the model's tensors in place.

    ``swap()`` re-points ``.data``, which frameworks that read their own storage do not
    see (it already copies for FSDP2 shards). Use this for them, e.g. for an EMA of
    DeepSpeed ZeRO-3 partitions (``EMA({n: p.ds_tensor for n, p in
    engine.module.named_parameters()})``), whose ``GatheredParameters`` then gathers the
    EMA weights. The model's values are stashed (one copy of each tracked tensor, a shard
    where sharded) and copied back on exit, also when the block raises; ``update()``
    inside the block is an error, as in ``swap()``.

    Args:
        ema: an :class:`~emakit.EMA` or :class:`~emakit.EMAPytree`.

    Example:
        >>> net = torch.nn.Linear(2, 2)
        >>> from emakit import EMA
        >>> ema = EMA(net, beta=0.9)
        >>> with swap_in_place(ema):
        ...     _ = net(torch.zeros(1, 2))  # runs on the EMA weights
    """
    from .ema import _EMABase
    from .errors import EMARuntimeError

    if not isinstance(ema, _EMABase):
        raise EMATypeError(f"ema must be an emakit EMA or EMAPytree, got {type(ema).__name__}")
    if ema._swapped:
        raise EMARuntimeError("swap blocks cannot be nested")
    ema._sync()
    pairs = ema._ensure_plan().pairs
    model = getattr(ema, "model", None)
    roots = fsdp_modules(model) if isinstance(model, nn.Module) else []
    _reshard(roots)
    try:
        with _copied_in(pairs):
            ema._swapped = True
            yield
    finally:
        ema._swapped = False
        _reshard(roots)


# -- the EMA copy of an FSDP2 model ----------------------------------------------------------

_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_backward_pre_hooks",
    "_backward_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)
_HOOK_FLAGS = (
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)
_FSDP_ATTRS = ("_is_fsdp_managed_module", "_fsdp_use_orig_params")


def _is_fsdp_hook(hook: object) -> bool:
    fn = getattr(hook, "hook", hook)  # load_state_dict pre-hooks come wrapped
    fn = getattr(fn, "func", fn)  # functools.partial
    return str(getattr(fn, "__module__", None) or "").startswith("torch.distributed.fsdp")


def _plain_clone(module: nn.Module, memo: dict[int, Any], fsdp_cls: type) -> nn.Module:
    """A copy of ``module`` without FSDP2's class, state and hooks (children from ``memo``)."""
    cls = next(c for c in type(module).__mro__ if not issubclass(c, fsdp_cls))
    clone = cast(nn.Module, cls.__new__(cls))
    dropped = {
        hook_id
        for key in _HOOK_DICTS
        for hook_id, hook in module.__dict__.get(key, {}).items()
        if _is_fsdp_hook(hook)
    }
    state: dict[str, Any] = {}
    for key, value in module.__dict__.items():
        if key.startswith("__composable_api") or key in _FSDP_ATTRS:
            continue  # fully_shard's registry and state keys, and its dynamo flags
        if key in _HOOK_DICTS or key in _HOOK_FLAGS:
            value = OrderedDict((k, v) for k, v in value.items() if k not in dropped)
        state[key] = value
    clone.__dict__.update(deepcopy(state, memo))
    return clone


def _shard_groups(model: nn.Module, fsdp_cls: type) -> list[tuple[list[str], dict[str, Any]]]:
    """The ``fully_shard`` calls that built ``model``: module names and arguments, in an
    order that shards children before parents."""
    from torch.distributed.fsdp import fully_shard

    names = {id(m): n for n, m in model.named_modules()}
    meshes = [p.device_mesh for p in model.parameters() if is_dtensor(p)]  # type: ignore[attr-defined]
    groups: list[tuple[list[str], dict[str, Any]]] = []
    seen: set[int] = set()
    for m in reversed(list(model.modules())):
        if not isinstance(m, fsdp_cls):
            continue
        state = fully_shard.state(m)  # type: ignore[attr-defined]
        if id(state) in seen:
            continue
        seen.add(id(state))
        group = getattr(state, "_fsdp_param_group", None)
        kwargs: dict[str, Any] = {"reshard_after_forward": True}  # eval only: free gathers
        if group is not None:
            mesh_info = group.mesh_info
            if getattr(mesh_info, "is_spmd_mesh", False):
                raise EMATypeError(
                    "fully_shard(..., dp_mesh_dims=...) models are not copied automatically; "
                    "pass ema_model= a zero-argument factory that builds and shards the model "
                    "the same way"
                )
            kwargs.update(
                mesh=mesh_info.mesh, mp_policy=group.mp_policy, offload_policy=group.offload_policy
            )
            for fp in group.fsdp_params:
                if fp.sharded_param.device_mesh != mesh_info.mesh:
                    raise EMATypeError(
                        f"parameter {fp._param_fqn or '?'} is sharded on another mesh than its "
                        f"fully_shard group (FSDP2 with tensor parallelism or per-parameter "
                        f"meshes); pass ema_model= a zero-argument factory that builds and "
                        f"shards the model the same way"
                    )
        elif meshes:
            kwargs["mesh"] = meshes[0]
        modules = getattr(state, "_modules", None) or (m,)
        groups.append(([names[id(x)] for x in modules], kwargs))
    return groups


def _copy_fsdp(
    model: nn.Module, memo: dict[int, Any], dtype_for: Callable[[Tensor], torch.dtype | None]
) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    fsdp_cls = _fsdp_module_type()
    assert fsdp_cls is not None  # only called when FSDP modules exist
    _reshard(fsdp_modules(model))  # the sharded parameters registered, not gathered ones
    groups = _shard_groups(model, fsdp_cls)
    online = dict((*model.named_parameters(), *model.named_buffers()))
    sharded = {n: t for n, t in online.items() if is_dtensor(t)}
    device = next(iter(sharded.values()))._local_tensor.device  # type: ignore[attr-defined]
    # 1. The module tree without FSDP, each sharded parameter a meta placeholder of its
    #    global shape: nothing of full size is ever allocated.
    for t in sharded.values():
        meta = torch.empty(t.shape, dtype=dtype_for(t) or t.dtype, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=False)
    for m in reversed(list(model.modules())):  # children first, so parents find them in memo
        memo[id(m)] = _plain_clone(m, memo, fsdp_cls)
    copy: nn.Module = memo[id(model)]
    # 2. Shard it with the model's fully_shard calls, then allocate this rank's shards.
    params = dict(copy.named_parameters())
    placement = {
        id(p): sharded[n].placements[-1]  # type: ignore[attr-defined]
        for n, p in params.items()
        if n in sharded
    }
    ignored = {p for n, p in params.items() if n not in sharded}
    for names, kwargs in groups:
        targets = [copy.get_submodule(n) for n in names]
        fully_shard(
            targets if len(targets) > 1 else targets[0],
            shard_placement_fn=lambda p: placement.get(id(p)),
            ignored_params=ignored or None,
            **kwargs,
        )
    copy.to_empty(device=device)
    with torch.no_grad():
        for name, t in (*copy.named_parameters(), *copy.named_buffers()):
            src = online[name]
            if is_dtensor(src):
                local_tensor(t).copy_(local_tensor(src))
            else:
                # A placeholder again, where the model has it: the EMA fills it later.
                t.data = torch.empty(0, dtype=t.dtype, device=src.device)
    return copy


def copy_module(
    model: nn.Module,
    memo: dict[int, Any],
    *,
    dtype_for: Callable[[Tensor], torch.dtype | None] = lambda t: None,
) -> nn.Module:
    """``copy.deepcopy(model, memo)``, except that an FSDP2 model is rebuilt sharded.

    FSDP2 modules refuse ``deepcopy``. For a model with ``fully_shard`` applied, the copy
    is the same module tree (the original classes, user hooks kept, FSDP's dropped), built
    on the meta device, sharded by the same ``fully_shard`` calls (same mesh, placements,
    grouping, mixed-precision and offload policies; ``reshard_after_forward=True`` since
    the copy only runs evaluation forwards), then given this rank's shards of the model's
    values, in ``dtype_for(param)`` where that is not None. Parameters and buffers that
    are not sharded are left as empty placeholders for the caller to fill (as ``memo``
    already says for a plain model).

    Args:
        model: the module to copy.
        memo: the ``deepcopy`` memo, pre-filled with placeholders for plain tensors.
        dtype_for: the dtype a sharded parameter's copy should have (None: the same).
            Default: always None.

    Returns:
        The copy.
    """
    if not fsdp_modules(model):
        return deepcopy(model, memo)
    return _copy_fsdp(model, memo, dtype_for)


# -- checkpoints ------------------------------------------------------------------------------


def _ema_module(ema: object) -> EMA:
    from .ema import EMA

    if not isinstance(ema, EMA):
        raise EMATypeError(
            f"ema must be an emakit EMA of a module, got ema={type(ema).__name__}; "
            f"wrap the model first: ema = emakit.EMA(model)"
        )
    if ema.ema_model is None:
        ema.init_ema()
    return ema


def save_sharded_ema(ema: _EMABase, checkpoint_id: str | os.PathLike[str], **kwargs: Any) -> None:
    """Save ``ema.state_dict()`` with ``torch.distributed.checkpoint`` (call on every rank).

    Each rank writes the shards it holds (DTensors), plain tensors are written once, and
    the folder's ``.metadata`` records the global layout, so the checkpoint loads into any
    world size (DCP reshards) or into a non-distributed EMA. To keep the EMA in one
    checkpoint with the model and optimizer, put ``ema.state_dict()`` under a key of the
    state you pass to ``torch.distributed.checkpoint.save`` instead.

    Args:
        ema: the EMA to save.
        checkpoint_id: the checkpoint folder.
        **kwargs: passed to ``torch.distributed.checkpoint.save`` (``storage_writer``,
            ``planner``, ``process_group``...).

    Example:
        >>> # on every rank of a torchrun job, after ema = EMA(fsdp_model):
        >>> # save_sharded_ema(ema, "ckpt/ema-step1000")
    """
    import torch.distributed.checkpoint as dcp

    ema = _ema_module(ema)
    dcp.save(ema.state_dict(), checkpoint_id=checkpoint_id, **kwargs)


def load_sharded_ema(ema: _EMABase, checkpoint_id: str | os.PathLike[str], **kwargs: Any) -> None:
    """Load a checkpoint written by :func:`save_sharded_ema` into ``ema`` (every rank).

    DCP reads each rank's part of every tensor straight into the EMA's own tensors, so a
    checkpoint saved on N ranks loads on M ranks, or in a process without
    ``torch.distributed`` into a plain ``EMA(model)`` (full tensors). The step counter and
    the other bookkeeping come back too.

    Args:
        ema: the EMA to load into (built like the saved one: same model and names).
        checkpoint_id: the checkpoint folder.
        **kwargs: passed to ``torch.distributed.checkpoint.load``.
    """
    import torch.distributed.checkpoint as dcp

    ema = _ema_module(ema)
    state = ema.state_dict()
    dcp.load(state, checkpoint_id=checkpoint_id, **kwargs)
    ema.load_state_dict(state)


def save_full_ema_weights(
    ema: _EMABase,
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
    from . import _validate as check
    from ._io import atomic_path
    from ._safetensors import write_safetensors
    from .checkpoint import save_ema_weights, weights_header

    ema = _ema_module(ema)
    dest = Path(os.fspath(path))
    dtype = check.floating_dtype("dtype", dtype)
    ema_model = ema.ema_model
    assert ema_model is not None  # _ema_module created it
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
            fsdp_cls = _fsdp_module_type()
            cls = next(c for c in type(ema_model).__mro__ if not issubclass(c, fsdp_cls or ()))
            header["model_class"] = cls.__name__
            with atomic_path(dest) as tmp, open(tmp, "wb") as f:
                write_safetensors(f, tensors, header, dtype)
    elif is_rank_zero():
        save_ema_weights(ema, dest, dtype=dtype)
    if _dist_ready():
        torch.distributed.barrier()
    return dest

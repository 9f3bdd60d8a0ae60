"""The EMA copy of an FSDP2 model: the same module tree, sharded by the same calls.

FSDP2 modules refuse ``deepcopy``. :func:`copy_module` rebuilds the module tree without
FSDP's state on the meta device, applies the model's own ``fully_shard`` calls (same mesh,
placements, grouping, mixed-precision and offload policies) and gives each rank its shards
of the model's values, so every rank stores the EMA of exactly the shard it owns.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from copy import deepcopy
from typing import Any, cast

import torch
from torch import Tensor, nn

from .._dtensor import fsdp_module_type, fsdp_modules, is_dtensor, local_tensor, reshard
from ..engine.pairs import TensorPair
from ..errors import EMATypeError

__all__ = ["copy_module", "unsharded_pairs"]


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

    fsdp_cls = fsdp_module_type()
    if fsdp_cls is None:  # pragma: no cover - only called when FSDP modules exist
        raise EMATypeError("copying an FSDP2 model needs torch.distributed.fsdp imported")
    reshard(fsdp_modules(model))  # the sharded parameters registered, not gathered ones
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

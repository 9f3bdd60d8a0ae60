"""The EMA copy of an FSDP2 model: the same module tree, sharded by the same calls.

FSDP2 modules refuse ``deepcopy``. [`copy_module()`][emakit._core.sharding.copy_module] rebuilds the module tree without
FSDP's state on the meta device, applies the model's own ``fully_shard`` calls (same mesh,
placements, grouping, mixed-precision and offload policies) and copies this rank's shards
of the model's values into it (DTensor to DTensor with the same placements: shard-local,
no communication), so every rank stores the EMA of exactly the shard it owns. Frozen
parameters the EMA shares (`share_shards()`) get the model's own shard instead, through
`adopt_shard()`.

Everything here goes through torch's public API (``fully_shard``,
``register_fsdp_forward_method``, ``FSDPModule.reshard``, DTensor ``placements``,
``device_mesh``, ``from_local`` and ``copy_``, ``Module.load_state_dict(assign=True)``)
except `fsdp_layout()`: torch has no public
way to ask which ``fully_shard`` call built a module, with which policies, or which
module attributes and hooks are FSDP's. That one function reads them, and
``tests/test_fsdp_copy.py::test_torch_internals_emakit_reads_are_where_it_expects``
fails loudly when a torch release moves them. Where it cannot read them, the error says
to pass ``ema_model=`` a factory, a route that needs no private name at all.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Callable, Iterable
from copy import deepcopy
from dataclasses import dataclass, field
from types import MethodType
from typing import Any, cast

import torch
from torch import Tensor, nn

from .._dist.dtensor import (
    check_fsdp2_torch,
    dtensor_like,
    fsdp_module_type,
    fsdp_modules,
    is_dtensor,
    local_tensor,
    reshard,
)
from .._engine.pairs import TensorPair
from ..errors import EMATypeError


def unsharded_pairs(pairs: list[TensorPair], *, device: object = None) -> list[TensorPair]:
    """The pairs whose shadow is not a DTensor: the ones the EMA lays out in its own buffers.

    DTensor shadows stay in FSDP2's shard storage (filled by [`copy_module()`][emakit._core.sharding.copy_module]), on the
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


# -- the one function that reads torch's private FSDP2 state ------------------------------

_FACTORY_HINT = (
    "pass ema_model= a zero-argument factory that builds and shards the model the same way "
    "(see docs/distributed.md)"
)


@dataclass(frozen=True)
class ShardGroup:
    """One ``fully_shard`` call that built a model.

    Attributes:
        modules: the names of the modules it was given (one, or several for a list).
        mesh: its device mesh.
        mp_policy: its ``MixedPrecisionPolicy``.
        offload_policy: its ``OffloadPolicy``.
        params: the DTensor parameters it manages.
        spmd: it was called with ``dp_mesh_dims`` (not repeated automatically).
    """

    modules: tuple[str, ...]
    mesh: Any
    mp_policy: Any
    offload_policy: Any
    params: tuple[Tensor, ...] = ()
    spmd: bool = False


@dataclass
class FSDPLayout:
    """What `fsdp_layout()` read: the ``fully_shard`` calls, children before parents,
    and, per module (by ``id``), the ``__dict__`` keys that are FSDP's own and, per hook
    registry (``_forward_pre_hooks``, its ``_with_kwargs`` flags, ...), FSDP's hook ids."""

    groups: list[ShardGroup] = field(default_factory=list)
    fsdp_keys: dict[int, set[str]] = field(default_factory=dict)
    fsdp_hooks: dict[int, dict[str, set[int]]] = field(default_factory=dict)


#: nn.Module's hook registries, and FSDP's per-module flags, in a module's ``__dict__``.
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
_FSDP_FLAGS = ("_is_fsdp_managed_module", "_fsdp_use_orig_params")


def _is_fsdp_hook(hook: object) -> bool:
    fn = getattr(hook, "hook", hook)  # load_state_dict pre-hooks come wrapped
    fn = getattr(fn, "func", fn)  # functools.partial
    return str(getattr(fn, "__module__", None) or "").startswith("torch.distributed.fsdp")


def fsdp_layout(model: nn.Module) -> FSDPLayout:
    """How ``fully_shard`` was applied to ``model``: the one place emakit reads torch's
    private FSDP2 state.

    Read, for each FSDP module: ``fully_shard.state(module)``, its ``_fsdp_param_group``
    (``mesh_info.mesh``, ``mp_policy``, ``offload_policy``, ``fsdp_params[i].sharded_param``)
    and ``_modules``; the ``__composable_api*`` keys and FSDP flags ``fully_shard`` puts in
    a module's ``__dict__``; the hooks FSDP registers (nn.Module's ``_forward_pre_hooks``
    etc., recognized by their defining module ``torch.distributed.fsdp``). Torch has no
    public getter for any of these.

    Args:
        model: a module with ``fully_shard`` applied to it or to submodules.

    Returns:
        The `FSDPLayout`.

    Raises:
        EMATypeError: this torch keeps them elsewhere (the message names what moved and
            says to pass ``ema_model=`` a factory).
    """
    from torch.distributed.fsdp import fully_shard

    fsdp_cls = fsdp_module_type() or ()
    names = {id(m): n for n, m in model.named_modules()}
    layout = FSDPLayout()
    seen: set[int] = set()
    try:
        for m in model.modules():
            keys = {k for k in m.__dict__ if k.startswith("__composable_api") or k in _FSDP_FLAGS}
            if keys:
                layout.fsdp_keys[id(m)] = keys
            hooks = {
                registry: {i for i, h in m.__dict__.get(registry, {}).items() if _is_fsdp_hook(h)}
                for registry in _HOOK_DICTS
            }
            ids = set().union(*hooks.values())
            hooks.update(
                (flags, {i for i in m.__dict__.get(flags, {}) if i in ids}) for flags in _HOOK_FLAGS
            )
            if ids:
                layout.fsdp_hooks[id(m)] = {k: v for k, v in hooks.items() if v}
        for m in reversed(list(model.modules())):  # reversed pre-order: children first
            if not isinstance(m, fsdp_cls):
                continue
            state = fully_shard.state(m)  # type: ignore[attr-defined]
            if id(state) in seen:
                continue  # a module of a list given to one fully_shard call
            seen.add(id(state))
            grouped = getattr(state, "_modules", None) or (m,)  # a list given to fully_shard
            modules = tuple(names[id(x)] for x in grouped)
            group = state._fsdp_param_group
            if group is None:  # a fully_shard call that found no parameter to manage
                layout.groups.append(ShardGroup(modules, None, None, None))
                continue
            info = group.mesh_info
            layout.groups.append(
                ShardGroup(
                    modules,
                    info.mesh,
                    group.mp_policy,
                    group.offload_policy,
                    tuple(fp.sharded_param for fp in group.fsdp_params),
                    bool(getattr(info, "is_spmd_mesh", False)),
                )
            )
    except (AttributeError, KeyError, TypeError) as e:
        raise EMATypeError(
            f"emakit cannot read how torch {torch.__version__} applied fully_shard to this "
            f"model ({type(e).__name__}: {e}): FSDP2's internals moved in this torch "
            f"release; {_FACTORY_HINT}, and please report it"
        ) from e
    return layout


# -- the copy -------------------------------------------------------------------------------


def _shared_objects(state: dict[str, Any]) -> list[object]:
    """Device meshes and process groups in a module's state: shared by the copy, never
    copied (they name communicators, not data)."""
    kinds = tuple(
        kind
        for mod, name in (
            ("torch.distributed.device_mesh", "DeviceMesh"),
            ("torch.distributed", "ProcessGroup"),
        )
        if isinstance(kind := getattr(sys.modules.get(mod), name, None), type)
    )
    return [v for v in state.values() if isinstance(v, kinds)]


def _fsdp_methods(module: nn.Module) -> list[str]:
    """Names of methods that ``register_fsdp_forward_method`` wrapped on ``module``: an
    instance attribute bound to the module whose function wraps the module's own method."""
    out = []
    for key, value in module.__dict__.items():
        if isinstance(value, MethodType) and value.__self__ is module:
            inner = getattr(value.__func__, "__wrapped__", None)
            if isinstance(inner, MethodType) and inner.__self__ is module:
                out.append(key)
    return out


def _plain_clone(
    module: nn.Module, memo: dict[int, Any], layout: FSDPLayout, methods: list[str]
) -> nn.Module:
    """A copy of ``module`` without FSDP2's class, state and hooks (children from ``memo``).

    The state is the module's own ``__getstate__()`` (so a class that leaves attributes out
    of its pickles, as ``LightningModule`` leaves its trainer, leaves them out here too),
    less what `fsdp_layout()` found to be FSDP's and the ``methods`` registered with
    ``register_fsdp_forward_method`` (the caller registers them on the sharded copy).
    Other methods bound to the module itself (monkeypatched) are bound to the clone.
    """
    fsdp_cls: Any = fsdp_module_type() or ()
    cls: Any = next(c for c in type(module).__mro__ if not issubclass(c, fsdp_cls))
    clone = cast(nn.Module, cls.__new__(cls))
    state = dict(module.__getstate__())
    drop = layout.fsdp_keys.get(id(module), set()) | set(methods)
    hooks = layout.fsdp_hooks.get(id(module), {})
    for key in drop:
        state.pop(key, None)
    for registry, ids in hooks.items():
        if registry in state:
            state[registry] = OrderedDict(
                (k, v) for k, v in state[registry].items() if k not in ids
            )
    bound = {k: v for k, v in state.items() if isinstance(v, MethodType) and v.__self__ is module}
    for key in bound:
        del state[key]
    for obj in _shared_objects(state):
        memo[id(obj)] = obj
    clone.__setstate__(deepcopy(state, memo))
    for key, method in bound.items():
        clone.__dict__[key] = MethodType(method.__func__, clone)
    return clone


def _where(modules: tuple[str, ...]) -> str:
    return ", ".join(repr(n) if n else "the root module" for n in modules)


def _check_groups(model: nn.Module, groups: list[ShardGroup]) -> None:
    """Refuse shardings that the copy cannot repeat, naming the parameters (all of them,
    in the model's order, up to ten)."""
    for g in groups:
        if g.spmd:
            raise EMATypeError(
                f"the fully_shard call on {_where(g.modules)} used dp_mesh_dims=..., which "
                f"emakit does not repeat by itself; {_FACTORY_HINT}"
            )
    other = {id(p) for g in groups for p in g.params if p.device_mesh != g.mesh}  # type: ignore[attr-defined]
    if other:
        names = [n for n, p in model.named_parameters() if id(p) in other]
        more = f" and {len(names) - 10} more" if len(names) > 10 else ""
        raise EMATypeError(
            f"parameters {names[:10]}{more} are sharded on a device mesh other than the one "
            f"their fully_shard call was given (FSDP2 with tensor parallelism, or "
            f"per-parameter meshes), which emakit cannot repeat by itself; {_FACTORY_HINT}"
        )


def _copy_fsdp(
    model: nn.Module,
    memo: dict[int, Any],
    dtype_for: Callable[[Tensor], torch.dtype | None],
    shared: set[int],
) -> nn.Module:
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    reshard(fsdp_modules(model))  # the sharded parameters registered, not gathered ones
    layout = fsdp_layout(model)
    _check_groups(model, layout.groups)
    online = dict((*model.named_parameters(), *model.named_buffers()))
    sharded = {n: t for n, t in online.items() if is_dtensor(t)}
    device = next(iter(sharded.values())).device
    # 1. The module tree without FSDP, each sharded parameter a meta placeholder of its
    #    global shape: nothing of full size is ever allocated.
    for t in sharded.values():
        meta = torch.empty(t.shape, dtype=dtype_for(t) or t.dtype, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=False)
    fsdp_cls = fsdp_module_type() or ()
    methods = {id(m): _fsdp_methods(m) if isinstance(m, fsdp_cls) else [] for m in model.modules()}
    for m in reversed(list(model.modules())):  # children first, so parents find them in memo
        memo[id(m)] = _plain_clone(m, memo, layout, methods[id(m)])
    copy: nn.Module = memo[id(model)]
    # 2. Shard it with the model's fully_shard calls (reshard_after_forward=True: the copy
    #    only runs evaluation forwards), then allocate this rank's shards.
    params = dict(copy.named_parameters())
    placement = {
        id(p): sharded[n].placements[-1]  # type: ignore[attr-defined]
        for n, p in params.items()
        if n in sharded
    }
    ignored = {p for n, p in params.items() if n not in sharded}
    for g in layout.groups:
        targets = [copy.get_submodule(n) for n in g.modules]
        kwargs: dict[str, Any] = {"reshard_after_forward": True}
        kwargs.update(
            (k, v)
            for k, v in (
                ("mesh", g.mesh or next(iter(sharded.values())).device_mesh),  # type: ignore[attr-defined]
                ("mp_policy", g.mp_policy),
                ("offload_policy", g.offload_policy),
                ("ignored_params", ignored),  # torch>=2.7; only models sharded with it have any
            )
            if v
        )
        fully_shard(
            targets if len(targets) > 1 else targets[0],
            shard_placement_fn=lambda p: placement.get(id(p)),
            **kwargs,
        )
    for m in model.modules():
        for name in methods[id(m)]:
            register_fsdp_forward_method(memo[id(m)], name)
    copy.to_empty(device=device)
    # 3. Frozen shards shared with the model (their FSDP storage is the model's), then
    #    this rank's shards of the model's values for the rest.
    shared_names = share_shards(copy, {n: t for n, t in sharded.items() if id(t) in shared})
    _fill_shards(copy, online, skip=shared_names)
    return copy


def _fill_shards(copy: nn.Module, online: dict[str, Tensor], skip: set[str]) -> None:
    """Copy this rank's shards of the model's values into ``copy`` (names in ``skip``
    aside): DTensor copies (same mesh and placements, so each is shard-local), cast to the
    copy's dtype. Not through ``load_state_dict``, whose pre-hooks (kept from the model)
    may rename keys."""
    with torch.no_grad():
        for name, t in (*copy.named_parameters(), *copy.named_buffers()):
            src = online[name]
            if name in skip:
                continue
            if is_dtensor(src):
                t.copy_(src)
            else:
                # A placeholder again, where the model has it: the EMA fills it later.
                t.data = torch.empty(0, dtype=t.dtype, device=src.device)


# -- frozen shards shared with the model ----------------------------------------------------


def evenly_sharded(t: Tensor) -> bool:
    """Whether every rank's shard of the DTensor ``t`` is unpadded: each sharded dimension
    divides evenly over its mesh dimension. FSDP2 pads the shards of an uneven parameter
    (dim 0 not divisible by the world size; the empty shards of a small one) into buffers
    of its own, which a shard of another module cannot alias. The same answer on every
    rank, so every rank shares the same parameters (and averages the same others)."""
    mesh, placements = t.device_mesh, t.placements  # type: ignore[attr-defined]
    return all(
        not pl.is_shard() or t.shape[pl.dim] % mesh.size(i) == 0 for i, pl in enumerate(placements)
    )


def places_of(root: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """Where each parameter of ``root`` is registered (tied ones: every place)."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in root.modules():
        for key, t in m.named_parameters(recurse=False):
            places.setdefault(id(t), []).append((m, key))
    return places


def adopt_shard(
    root: nn.Module,
    old: Tensor,
    local: Tensor,
    places: dict[int, list[tuple[nn.Module, str]]] | None = None,
) -> Tensor:
    """Put a DTensor whose local shard is ``local`` (the mesh, placements, global shape and
    stride of the DTensor parameter ``old``) in place of ``old`` in every module of the
    FSDP2 model ``root`` that registers it, and return it.

    Through public API only: ``load_state_dict(..., assign=True)`` of the module that
    holds it, whose FSDP2 post-hook (``reset_sharded_param``) makes FSDP2 all-gather from
    ``local`` itself, without a copy, where the shard needs no padding (where it does,
    FSDP2 copies ``local`` into a padded buffer of its own: compare
    ``local_tensor(result).data_ptr()`` with ``local``'s).

    ``places``: where ``root``'s parameters are registered, from a caller that resharded
    ``root``. Default None: ``root``'s FSDP2 modules are resharded (so the registered
    parameters are the sharded ones) and the places looked up.
    ``tests/test_fsdp_copy.py::test_torch_internals_emakit_reads_are_where_it_expects``
    checks that FSDP2's forward then reads ``local``.
    """
    if places is None:
        reshard(fsdp_modules(root))
        places = places_of(root)
    new = nn.Parameter(dtensor_like(local, old), requires_grad=False)
    for m, key in places.get(id(old), []):
        m.load_state_dict({key: new}, strict=False, assign=True)  # tied: every place
    return new


def share_shards(copy: nn.Module, frozen: dict[str, Tensor]) -> set[str]:
    """Make the shards of ``copy``'s parameters named in ``frozen`` (name -> the model's
    frozen DTensor parameter) alias the model's shards (`adopt_shard()`), where every
    rank's shard is unpadded (`evenly_sharded()`); the names shared. Where FSDP2 still
    copied (a padded shard), the copy owns a shard holding the model's values."""
    done: set[str] = set()
    params = dict(copy.named_parameters())
    places = places_of(copy)
    reshard(fsdp_modules(copy))
    for name, src in frozen.items():
        if name not in params or not evenly_sharded(src):
            continue
        local = local_tensor(src)
        if local.numel() == 0:
            continue
        new = adopt_shard(copy, params[name], local, places)
        if local_tensor(new).data_ptr() == local.data_ptr():
            done.add(name)
    return done


def copy_module(
    model: nn.Module,
    memo: dict[int, Any],
    *,
    dtype_for: Callable[[Tensor], torch.dtype | None] = lambda t: None,
    shared: Iterable[int] = (),
) -> nn.Module:
    """``copy.deepcopy(model, memo)``, except that an FSDP2 model is rebuilt sharded.

    FSDP2 modules refuse ``deepcopy``. For a model with ``fully_shard`` applied, the copy
    is the same module tree (the original classes, user hooks kept, FSDP's dropped), built
    on the meta device, sharded by the same ``fully_shard`` calls (same mesh, placements,
    grouping, mixed-precision and offload policies; ``reshard_after_forward=True`` since
    the copy only runs evaluation forwards; methods registered with
    ``register_fsdp_forward_method`` registered on the copy too), then given this rank's
    shards of the model's values, in ``dtype_for(param)`` where that is not None.
    Parameters and buffers that are not sharded are left as empty placeholders for the
    caller to fill (as ``memo`` already says for a plain model). The sharded parameters
    whose id is in ``shared`` (frozen weights, see `emakit._core.frozen`) share the
    model's shard storage instead (`share_shards()`) where their shards are unpadded.

    Args:
        model: the module to copy.
        memo: the ``deepcopy`` memo, pre-filled with placeholders for plain tensors.
        dtype_for: the dtype a sharded parameter's copy should have (None: the same).
            Default: always None.
        shared: ids of the model's frozen DTensor parameters to share. Default: none.

    Returns:
        The copy.

    Raises:
        EMATypeError: the model is sharded in a way the copy cannot repeat (tensor
            parallelism, ``dp_mesh_dims``), or on a torch older than 2.6; the message
            names the parameters or versions and says the fix.
    """
    check_fsdp2_torch((*model.parameters(), *model.buffers()), model.modules())
    if not fsdp_modules(model):
        return deepcopy(model, memo)
    return _copy_fsdp(model, memo, dtype_for, set(shared))

"""The EMA copy of a module: which tensors it tracks, how it is built and laid out.

* `module_tensors()` walks a module once and returns its parameters and buffers by
  name (as ``named_parameters()``/``named_buffers()`` name them), where each is registered
  (so a replaced tensor can be seen) and which are buffers.
* `copy_model()` deep-copies a module's structure with every tensor replaced by an
  empty placeholder (no weight or gradient is duplicated); FSDP2 models are rebuilt
  sharded (see `emakit._core.sharding`).
* `layout_shadow()` gives the shadow tensors their storage: one flat buffer per
  (device, dtype), in the online tensors' memory order, averaged tensors first, so a
  flattened model updates each group as one span.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .._dist.deepspeed import unwrap_engine
from .._engine.flat import memory_order, rehome_
from .._engine.pairs import Slot, TensorPair, refuse_layout
from ..errors import EMATypeError
from .sharding import copy_module, unsharded_pairs


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module that holds the weights: strips DDP/DataParallel ``.module``, a DeepSpeed
    engine's ``.module`` and ``torch.compile``'s ``_orig_mod`` wrappers (in any nesting)."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif (engine_module := unwrap_engine(model)) is not model:
            model = engine_module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return model


def module_tensors(
    module: nn.Module, skip: Callable[[str], bool] = lambda name: False
) -> tuple[dict[str, Tensor], dict[str, Slot], set[str]]:
    """``(tensors, slots, buffer names)`` of ``module``, minus names ``skip`` refuses.

    Names and order are those of ``named_parameters()`` then ``named_buffers()`` (tied
    tensors once, under their first name); ``slots[name]`` is the ``(dict, key)`` the
    tensor is registered in (and the registering module's id).
    """
    tensors: dict[str, Tensor] = {}
    slots: dict[str, Slot] = {}
    buffers: set[str] = set()
    for kind in ("_parameters", "_buffers"):
        seen: set[int] = set()
        for prefix, mod in module.named_modules(remove_duplicate=True):
            registry = mod.__dict__[kind]
            for key, t in registry.items():
                if t is None or id(t) in seen:
                    continue
                seen.add(id(t))
                name = f"{prefix}.{key}" if prefix else key
                if skip(name):
                    continue
                tensors[name] = t
                slots[name] = (registry, key, id(mod))
                if kind == "_buffers":
                    buffers.add(name)
    return tensors, slots, buffers


def copy_model(
    model: nn.Module,
    *,
    dtype_for: Callable[[Tensor], torch.dtype | None],
    tracked: Callable[[str], bool],
    shared: Iterable[int] = (),
) -> nn.Module:
    """A copy of ``model`` whose tracked tensors are empty placeholders to be laid out.

    Untracked (ignored) tensors get a clone of the model's, since the copy still needs
    them to run. Parameters whose id is in ``shared`` (frozen weights, see
    `emakit._core.frozen`) get a ``Parameter`` aliasing the model's storage (FSDP2
    shards: a DTensor whose shard is the model's, where it is unpadded; see
    `emakit._core.sharding.share_shards`).

    Args:
        model: the module to copy.
        dtype_for: the dtype a sharded parameter's copy should have (None: the same).
        tracked: whether a name is tracked by the EMA.
        shared: ids of parameters to share instead of copy. Default: none.

    Raises:
        EMATypeError: the model cannot be deep-copied (the message says the fix).
    """
    memo: dict[int, Any] = {}
    share = set(shared)
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        if t.layout is not torch.strided:  # sparse...: refused if tracked, else cloned
            if tracked(name):
                refuse_layout(name, t)
            clone = t.detach().clone()
            memo[id(t)] = nn.Parameter(clone, False) if isinstance(t, nn.Parameter) else clone
    for t in (*model.parameters(), *model.buffers()):
        if id(t) in memo:
            continue
        empty = torch.empty(0, dtype=t.dtype, device=t.device)
        if type(t) is nn.Parameter and id(t) in share:
            # ``.data``: the same storage under a version counter of its own, so that the
            # EMA's writes (loads, un-shared updates) never move the model's (which the
            # check of shared weights reads, see emakit._core.frozen)
            memo[id(t)] = nn.Parameter(t.data, requires_grad=False)
        elif type(t) is nn.Parameter:
            memo[id(t)] = nn.Parameter(empty, requires_grad=False)
        elif type(t) is Tensor:
            memo[id(t)] = empty
    try:
        copy = copy_module(model, memo, dtype_for=dtype_for, shared=share)  # FSDP2: sharded
    except EMATypeError:
        raise
    except Exception as e:
        raise EMATypeError(
            f"the model could not be deep-copied ({type(e).__name__}: {e}); pass ema_model= "
            f"a Module with the same structure, or a zero-argument factory that builds one"
        ) from e
    online = dict((*model.named_parameters(), *model.named_buffers()))
    with torch.no_grad():
        for name, t in (*copy.named_parameters(), *copy.named_buffers()):
            if not tracked(name) and t.numel() != online[name].numel():
                t.data = online[name].detach().clone()
    return copy  # ModuleSource.build() turns requires_grad off on every EMA parameter


def layout_shadow(
    pairs: Sequence[TensorPair],
    *,
    from_online: bool,
    dtype_for: Callable[[Tensor], torch.dtype | None],
    device: torch.device | None = None,
) -> None:
    """Give the shadow tensors of ``pairs`` their storage (see the module docstring).

    Args:
        pairs: the tracked pairs.
        from_online: take the values from the online tensors (a fresh copy) instead of the
            shadow's own.
        dtype_for: the shadow dtype of a tensor (None: keep it); ``ema_dtype`` widens here.
        device: keep the shadow on this device (offload), pinned when the model is on an
            accelerator. Default None: each tensor's own device.
    """
    plain = unsharded_pairs(list(pairs), device=device)

    # averaged first, by decay group, then as the online tensors sit in memory
    ordered = sorted(plain, key=lambda p: (not p.average, p.group, *memory_order(p.online)))
    # pinned when offloaded from an accelerator (rehome_ pins only CPU buffers)
    pin = device is not None and any(p.online.is_cuda for p in ordered)
    rehome_(
        [p.shadow for p in ordered],
        sources=[p.online if from_online else p.shadow for p in ordered],
        dtype_for=[dtype_for(p.shadow) for p in ordered],
        device=device,
        pin_memory=pin,
    )

"""Pairing online and shadow tensors by name, with one validation routine for all EMA kinds.

`pair_tensors()` is the only place that decides whether an EMA tensor may track a
model tensor: same name set, same shape, same dtype (unless a cast is allowed), same
device (unless allowed), and the same sharding (FSDP2 DTensors). Every error names the
tensor and says the fix.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor, strided

from .._dist.dtensor import is_dtensor, local_tensor, same_sharding
from .._validate import few
from ..errors import EMAStateError, EMATypeError
from .guards import Changes

#: Where a tensor is registered: ``(container, key, id(module))``, e.g.
#: ``(module._parameters, "weight", id(module))``. Where the container is not a registry
#: the plan compares whole (a DTensor's, a DeepSpeed partition's), the plan checks
#: ``container.get(key) is tensor`` on every update (see `emakit._engine.guards`).
Slot = tuple[Mapping[str, Any], str, int]


@dataclass(frozen=True)
class TensorPair:
    """One tracked tensor: its name, the EMA copy, the training copy, and its role.

    ``average`` is True for tensors that are averaged (``lerp_``) and False for tensors
    that are copied (integer buffers, names in ``param_or_buffer_names_no_ema``).
    ``group`` is the decay group (0 the default; see ``EMA(decay_groups=...)``): averaged
    tensors of one group share one lerp weight. ``buffer`` marks module buffers (which a
    forward pass may write, unlike parameters). ``online_slot`` and ``shadow_slot`` say
    where each tensor is registered, so the plan can see it replaced (None: not watched).
    """

    name: str
    shadow: Tensor
    online: Tensor
    average: bool
    group: int = 0
    buffer: bool = False
    online_slot: Slot | None = None
    shadow_slot: Slot | None = None


@dataclass(frozen=True)
class Tracked:
    """What an EMA tracks, as one value: its pairs and the modules they live in.

    Built by the owner (an EMA's source) whenever the plan must be built, and passed
    explicitly to the plan and its staleness guards (`emakit._engine.guards`).

    Attributes:
        pairs: the pairs, in the order the shadow is laid out.
        roots: the online and EMA models, whose modules' registries the plan compares
            with its copies on every update (a registration or a ``del`` on any of them
            makes the plan compare the live pairs again). Empty for a pytree (nothing
            registers on one).
        shared: the pairs left out of ``pairs`` because the shadow is the online storage
            (frozen weights, see `emakit._core.frozen`): no work, but a sharded EMA's
            agreement between ranks still counts them, so that every rank agrees alike
            whichever of them it shares. Default: none.
        changes: with ``watch_model=True``, the `Changes` counter of the watched modules
            (`emakit._engine.guards.watch_modules`), checked instead of the registries.
        frozen: the owner's check of its shared frozen weights (True when one was
            unfrozen, written or merged into), run on every update; None without any.
    """

    pairs: tuple[TensorPair, ...]
    roots: tuple[Any, ...] = ()
    shared: tuple[TensorPair, ...] = ()
    changes: Changes | None = None
    frozen: Callable[[], bool] | None = None

    @classmethod
    def of(cls, pairs: Sequence[TensorPair] | Tracked) -> Tracked:
        """``pairs`` as a `Tracked` value (no watched modules), or ``pairs`` itself."""
        return pairs if isinstance(pairs, Tracked) else cls(tuple(pairs))


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
    if not same_sharding(shadow, online) or ls.shape != lo.shape:
        sp, op = tuple(shadow.placements), tuple(online.placements)  # type: ignore[attr-defined]
        same_mesh = shadow.device_mesh == online.device_mesh  # type: ignore[attr-defined]
        raise EMAStateError(
            f"tensor {name!r} is sharded as {sp} with local shape {tuple(ls.shape)} in the EMA "
            f"but as {op} with local shape {tuple(lo.shape)} in the model"
            f"{'' if same_mesh else ', on another device mesh'}; shard ema_model with the "
            f"same mesh and fully_shard calls as the model"
        )


def pair_tensors(
    online: Mapping[str, Tensor],
    shadow: Mapping[str, Tensor],
    *,
    average: Callable[[str, Tensor], bool],
    group: Callable[[str], int] = lambda name: 0,
    buffers: Container[str] = (),
    online_slots: Mapping[str, Slot] | None = None,
    shadow_slots: Mapping[str, Slot] | None = None,
    cast: bool = False,
    other_devices: bool = False,
    placeholders: bool = False,
    shadow_arg: str = "ema_model",
    item: str = "tensor",
) -> list[TensorPair]:
    """Pair ``online`` and ``shadow`` tensors by name, strictly, and validate each pair.

    Args:
        online: the model's tracked tensors by name.
        shadow: the EMA's tensors by name.
        average: whether a tensor is averaged (else copied).
        group: the decay group of a name. Default: always 0.
        buffers: names that are module buffers.
        online_slots, shadow_slots: where each tensor is registered (see `Slot`).
        cast: shadow and online dtypes may differ (``coerce_dtype``/``ema_dtype``).
        other_devices: shadow and online devices may differ.
        placeholders: empty shadow tensors stand for ones not laid out yet (any shape).
        shadow_arg: the argument that holds the EMA, for messages (``"ema_model"``).
        item: what a tensor is called in messages (``"tensor"``, ``"leaf"``).

    Returns:
        The pairs, in ``online``'s order.

    Raises:
        EMAStateError: names, shapes, dtypes, devices or sharding do not match; the
            message names the tensors and says the fix.
        EMATypeError: a tensor is not strided (dense): a sparse or other layout.
    """
    missing = sorted(online.keys() - shadow.keys())
    extra = sorted(shadow.keys() - online.keys())
    if missing or extra:
        raise EMAStateError(
            f"{shadow_arg} does not match the model by name: missing from {shadow_arg} "
            f"{few(missing)}, not in the model {few(extra)}; give {shadow_arg} the same "
            f"structure as the model (or, after changing the model, make the same change "
            f"to {shadow_arg}, or build a new EMA)"
        )
    oslots, sslots = online_slots or {}, shadow_slots or {}
    pairs = []
    for name, o in online.items():
        s = shadow[name]
        if o.layout is not strided or s.layout is not strided:
            refuse_layout(name, o if o.layout is not strided else s, item)
        if s.shape != o.shape and not (placeholders and s.numel() == 0):
            raise EMAStateError(
                f"{item} {name!r} has shape {tuple(s.shape)} in the EMA but {tuple(o.shape)} "
                f"in the model; give {shadow_arg} the same structure as the model (a replaced "
                f"layer of another shape needs a new EMA)"
            )
        if s.dtype != o.dtype and not cast:
            raise EMAStateError(
                f"{item} {name!r} is {s.dtype} in the EMA but {o.dtype} in the model; pass "
                f"coerce_dtype=True (cast on update) or ema_dtype={s.dtype} (keep a wider shadow)"
            )
        if s.device != o.device and not other_devices:
            raise EMAStateError(
                f"{item} {name!r} is on {s.device} in the EMA but on {o.device} in the model; "
                f"pass allow_different_devices=True (or move_ema_to_online_device=True)"
            )
        check_sharded_pair(name, s, o)
        pairs.append(
            TensorPair(
                name,
                s,
                o,
                average(name, o),
                group(name),
                name in buffers,
                oslots.get(name),
                sslots.get(name),
            )
        )
    return pairs


def refuse_layout(name: str, t: Tensor, item: str = "tensor") -> None:
    """Raise for a sparse (or other non-strided) tensor ``name``: it has no storage to lay
    out or average in place. ``item``: what a tensor is called (``"leaf"`` of a pytree)."""
    fix = (
        "leave it out of the pytree, or make it dense (.to_dense())"
        if item == "leaf"
        else f"exclude it with ignore_names={{{name!r}}} (the EMA copy then keeps the value "
        f"it had when the EMA was built), or register it dense (.to_dense())"
    )
    raise EMATypeError(
        f"{item} {name!r} has layout {t.layout}; an EMA averages strided (dense) tensors "
        f"only: {fix}"
    )

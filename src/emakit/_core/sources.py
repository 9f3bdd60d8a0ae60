"""What an EMA tracks: a module (`ModuleSource`) or a pytree (`TreeSource`).

A source knows which tensors of the online model are tracked and how (averaged or copied,
which decay group, which shadow dtype), builds the EMA copy, and pairs online and shadow
tensors through `pair_tensors()`, the one validation routine.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .._dist.deepspeed import build_partitions, partition_tensors, zero3_params
from .._dist.dtensor import check_fsdp2_torch
from .._engine.guards import Changes, watch_modules
from .._engine.pairs import TensorPair, Tracked, pair_tensors
from ..errors import EMATypeError, EMAValueError
from .frozen import FrozenShare, shared_parameters, shares
from .shadow import copy_model, layout_shadow, module_tensors
from .tree import leaves, tree_copy


def call_factory(factory: Any) -> nn.Module:
    """The module a zero-argument ``ema_model`` factory returns (checked)."""
    if not callable(factory):
        raise EMATypeError(
            f"ema_model must be a Module or a zero-argument factory, got {type(factory).__name__}"
        )
    ema_model = factory()
    if not isinstance(ema_model, nn.Module):
        raise EMATypeError(
            f"the ema_model factory must return a Module, it returned {type(ema_model).__name__}"
        )
    return ema_model


@dataclass(eq=False, kw_only=True)
class _Source:
    """What every source keeps: the shadow's dtype rule and where it may live (see
    [`EMA`][emakit.EMA]'s ``ema_dtype``, ``coerce_dtype``, ``allow_different_devices``,
    ``device``)."""

    ema_dtype: torch.dtype | None
    cast: bool
    other_devices: bool
    device: torch.device | None = None

    def before_load(self, state_dict: Mapping[str, Any], prefix: str) -> None:
        """Called before ``state_dict`` is copied into the EMA (a module's shares frozen
        weights: see `ModuleSource.before_load()`)."""

    def after_load(self) -> None:
        """Called after a state was copied into the EMA (see `ModuleSource.after_load()`)."""

    def before_read(self) -> None:
        """Called before the EMA is read (see `ModuleSource.before_read()`)."""

    def shadow_dtype(self, t: Tensor) -> torch.dtype | None:
        """The shadow dtype of ``t`` (None: its own). ``ema_dtype`` only ever widens: a
        float64 buffer stays float64 under ``ema_dtype=torch.float32``."""
        if self.ema_dtype is None or not t.is_floating_point():
            return None
        return torch.promote_types(t.dtype, self.ema_dtype)


@dataclass(eq=False, kw_only=True)
class ModuleSource(_Source):
    """The tracked tensors of a module and their EMA copy (built from keywords only).

    Attributes:
        ignore_names: names never touched.
        ignore_prefixes: name prefixes never touched.
        no_ema: names copied instead of averaged.
        group_patterns: fnmatch patterns of decay groups 1, 2, ... (first match wins).
        move_to_online: move the EMA to the model's device when they differ.
        share_frozen: share frozen parameters with the model (``EMA(share_frozen=True)``).
        watch_model: watch the modules' registries through `WatchedDict`s, which alters
            the model (``EMA(watch_model=True)``, see `emakit._engine.guards`).
        on_unshare: called when a shared weight gets its own storage (the plan is stale).
        partition: keep only this rank's slice of each parameter (``EMA(partition=True)``).
        ema_dtype, cast, other_devices, device: see [`EMA`][emakit.EMA].
        frozen: the shared frozen weights and their watch (see `emakit._core.frozen`).
        changes: with ``watch_model``, the registrations on the online and EMA models'
            modules (see `emakit._engine.guards`).
    """

    kind = "module"
    ignore_names: frozenset[str] = frozenset()
    ignore_prefixes: tuple[str, ...] = ()
    no_ema: frozenset[str] = frozenset()
    group_patterns: Sequence[str] = ()
    move_to_online: bool = False
    share_frozen: bool = False
    watch_model: bool = False
    on_unshare: Callable[[], None] = lambda: None
    partition: bool = False

    def __post_init__(self) -> None:
        self.frozen = FrozenShare(self.on_unshare)
        self.changes = Changes()

    def before_load(self, state_dict: Mapping[str, Any], prefix: str) -> None:
        """Copy-on-write: give every shared frozen weight whose value the load would change
        (in the EMA under ``prefix``, or in the model under ``online_model.``) its own
        storage first (see `emakit._core.frozen`)."""
        self.frozen.unshare_changed(state_dict, prefix)
        if prefix.endswith("ema_model."):
            self.frozen.unshare_changed(state_dict, prefix[: -len("ema_model.")] + "online_model.")

    def after_load(self) -> None:
        """The shared weights' version counters, moved by the load, are the EMA's again."""
        self.frozen.rebase()

    def before_read(self) -> None:
        """Settle the shared frozen weights (un-share the unfrozen ones, refuse a written or
        merged one: `emakit._core.frozen`). Costs a few C-level reads; nothing without
        shared weights."""
        frozen = self.frozen
        if frozen.pairs and frozen.changed():
            frozen.settle()

    def tracked(self, name: str) -> bool:
        """Whether ``name`` is tracked (not ignored)."""
        return not self.ignored(name)

    def ignored(self, name: str) -> bool:
        """Whether ``name`` is never touched."""
        return name in self.ignore_names or name.startswith(self.ignore_prefixes)

    def group_of(self, name: str) -> int:
        """The decay group of ``name`` (0 when no pattern matches)."""
        for g, pattern in enumerate(self.group_patterns, start=1):
            if fnmatch.fnmatchcase(name, pattern):
                return g
        return 0

    def build(self, model: nn.Module, ema_model: nn.Module | None) -> nn.Module:
        """The EMA copy of ``model`` (``ema_model`` adopted if given), laid out."""
        fresh = ema_model is None
        for m in (model, ema_model):
            if m is not None:
                _refuse_lazy(m, "model" if m is model else "ema_model")
                check_fsdp2_torch((*m.parameters(), *m.buffers()), m.modules())
        parted = self.partition or bool(zero3_params(model))  # the EMA of partitions
        if parted and not fresh:
            raise EMATypeError(
                "ema_model= is not supported for a partitioned EMA (DeepSpeed ZeRO-3, or "
                "partition=True): it keeps this rank's partitions, built from the model; "
                "leave ema_model=None"
            )
        if ema_model is None:
            tracked = self.tracked
            if parted:
                ema_model = build_partitions(
                    model, dtype_for=self.shadow_dtype, tracked=tracked, replicated=self.partition
                )
            else:
                ema_model = copy_model(
                    model,
                    dtype_for=self.shadow_dtype,
                    tracked=tracked,
                    shared=shared_parameters(model, self._shareable) if self.share_frozen else (),
                )
        for p in ema_model.parameters():
            p.requires_grad_(False)
        pairs = self.pair(model, ema_model, placeholders=fresh)
        own = [p for p in pairs if not shares(p)]
        layout_shadow(own, from_online=fresh, dtype_for=self.shadow_dtype, device=self.device)
        self.frozen.watch([p for p in pairs if shares(p)], ema_model, model)
        return ema_model

    def _shareable(self, name: str, t: Tensor) -> bool:
        """Whether a frozen parameter may be shared: tracked, and its shadow would have its
        dtype and device (no ``ema_dtype`` widening, no offload)."""
        return (
            not self.ignored(name)
            and self.shadow_dtype(t) in (None, t.dtype)
            and (self.device is None or self.device == t.device)
        )

    def pair(
        self, model: nn.Module, ema_model: nn.Module, *, placeholders: bool = False
    ) -> list[TensorPair]:
        """The pairs of ``model`` and ``ema_model``, by name, validated (with
        ``watch_model``, their modules watched for registrations first, see
        `emakit._engine.guards.watch_modules`)."""
        if self.watch_model:
            watch_modules((model, ema_model), self.changes)
        online, oslots, buffers = module_tensors(model, self.ignored)
        online, oslots = partition_tensors(online, oslots, replicated=self.partition)
        shadow, sslots, _ = module_tensors(ema_model, self.ignored)
        no_ema = self.no_ema
        return pair_tensors(
            online,
            shadow,
            average=lambda n, t: (t.is_floating_point() or t.is_complex()) and n not in no_ema,
            group=self.group_of,
            buffers=buffers,
            online_slots=oslots,
            shadow_slots=sslots,
            cast=self.cast,
            other_devices=self.other_devices or self.move_to_online,
            placeholders=placeholders,
        )

    def pairs(self, model: nn.Module, ema_model: nn.Module) -> Tracked:
        """`pair()`, after moving the EMA to the model's device if asked and needed,
        with both models (whose registries the plan's guards compare), without the shared
        frozen weights (which need no work; they are checked, see `emakit._core.frozen`).

        Raises:
            EMAStateError: the model no longer pairs, or a shared frozen weight was written
                or merged into (`emakit._core.frozen.FrozenShare.settle()`).
        """
        self.before_read()
        pairs = self.pair(model, ema_model)
        if self.move_to_online and pairs and pairs[0].online.device != pairs[0].shadow.device:
            pairs = self.move_ema(model, ema_model, pairs[0].online.device)
        if self.frozen.own_replaced(pairs):
            pairs = self.pair(model, ema_model)
        shared = [p for p in pairs if shares(p)]
        self.frozen.watch(shared, ema_model, model)
        return Tracked(
            tuple(p for p in pairs if not shares(p)),
            (model, ema_model),
            tuple(shared),
            self.changes if self.watch_model else None,
            self.frozen.changed,
        )

    def move_ema(
        self, model: nn.Module, ema_model: nn.Module, device: torch.device
    ) -> list[TensorPair]:
        """Move the EMA model to ``device`` and lay its storage out again; the new pairs."""
        ema_model.to(device)
        pairs = self.pair(model, ema_model)
        own = [p for p in pairs if not shares(p)]
        layout_shadow(own, from_online=False, dtype_for=self.shadow_dtype)
        return pairs


class TreeSource(_Source):
    """The leaves of a pytree and their EMA copy (saved as ``ema.<path>``)."""

    kind = "pytree"

    def build(self, tree: Any, shadow: Any) -> Any:
        """The EMA copy of ``tree`` (``shadow``, or a factory's result, adopted if given)."""
        if shadow is None:
            shadow = tree_copy(tree)
        elif callable(shadow) and not isinstance(shadow, (Tensor, nn.Module)):
            shadow = shadow()
        pairs = self.pair(tree, shadow)
        layout_shadow(pairs, from_online=False, dtype_for=self.shadow_dtype, device=self.device)
        return shadow

    def pairs(self, tree: Any, shadow: Any) -> Tracked:
        """The pairs of leaves, by path, validated, as the plan takes them."""
        return Tracked(tuple(self.pair(tree, shadow)))

    def pair(self, tree: Any, shadow: Any) -> list[TensorPair]:
        """The pairs of leaves, by path, validated."""
        return pair_tensors(
            leaves(tree),
            leaves(shadow),
            average=lambda n, t: t.is_floating_point() or t.is_complex(),
            cast=self.cast,
            other_devices=self.other_devices,
            shadow_arg="ema_pytree",
            item="leaf",
        )

    @staticmethod
    def save(shadow: Any, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        """Write the EMA leaves under ``prefix + "ema." + path``."""
        for name, t in leaves(shadow).items():
            destination[prefix + "ema." + name] = t if keep_vars else t.detach()

    @staticmethod
    def load(
        shadow: Any,
        state_dict: Mapping[str, Any],
        prefix: str,
        missing_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        """Copy the leaves saved by `save()` into ``shadow``."""
        with torch.no_grad():
            for name, t in leaves(shadow).items():
                key = prefix + "ema." + name
                if key not in state_dict:
                    missing_keys.append(key)
                    continue
                value = state_dict[key]
                if value.shape != t.shape:
                    error_msgs.append(
                        f"size mismatch for {key}: {tuple(value.shape)} vs {tuple(t.shape)}"
                    )
                else:
                    t.copy_(value)


def _refuse_lazy(module: nn.Module, arg: str) -> None:
    """A lazy module (``nn.LazyLinear`` ...) before its first forward has no shapes yet."""
    lazy = [
        n
        for n, t in (*module.named_parameters(), *module.named_buffers())
        if nn.parameter.is_lazy(t)
    ]
    if lazy:
        raise EMAValueError(
            f"{arg} has uninitialized lazy tensors ({lazy[:5]}: nn.LazyLinear and the like "
            f"get their shapes at the first forward); run one forward pass with a real "
            f"batch before building the EMA, or build it with lazy_init_ema=True (the copy "
            f"is made at the first update(), after training has run a forward)"
        )

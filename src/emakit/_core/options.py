"""The keywords of [`EMA`][emakit.EMA], validated once, and the runner they ask for.

`EMAOptions` turns the constructor's keywords into checked values (each check in
`emakit._validate`, each error naming the argument, the value and the fix), refuses
combinations that cannot work, and builds the decay rule. ``EMA`` copies the values onto
itself as its public attributes.
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .. import _validate as check
from .._dist.deepspeed import zero3_params
from .._engine.kernels import Impl
from .._engine.runners import Runner, StreamRunner, SyncRunner, ThreadRunner
from ..decay import DecayRule, ema_rule
from ..errors import EMATypeError, EMAValueError

__all__ = ["KEYWORDS_DOC", "EMAOptions", "as_device", "make_runner"]

#: The ``Args:`` section of `EMA`'s docstring: the keywords are documented
#: here, next to their validation.
KEYWORDS_DOC = """
    Args:
        model: the online (training) module. DDP/DataParallel and ``torch.compile``
            wrappers are unwrapped. A tensor or a nested dict/list/tuple of tensors is
            tracked leaf by leaf, as [`EMAPytree`][emakit.EMAPytree] does: ``ema_model`` is
            then the EMA pytree, the online pytree is never saved, and module-only
            keywords (names, ``decay_groups``, ``update_model_with_ema_every``,
            ``forward_method_names``, ``move_ema_to_online_device``, ``lazy_init_ema``,
            ``stream``) are refused.
        ema_model: a module to hold the EMA weights, or a zero-argument factory returning
            one. Default None: a copy of ``model`` (parameters and buffers only; gradients
            are not copied).
        beta: the ceiling of the decay, in [0, 1]; ``1.0`` freezes the EMA (a frozen
            teacher). Default 0.9999.
        update_after_step: while ``step <= update_after_step`` an update copies the model
            instead of averaging. Default 100.
        update_every: only every ``update_every``-th call does work. Default 10.
        inv_gamma: warm-up scale, > 0. Default 1.0.
        power: warm-up exponent, > 0. Default 2/3.
        min_value: the floor of the decay. Default 0.0.
        param_or_buffer_names_no_ema: names copied from the model on every update instead
            of averaged. Default ().
        ignore_names: names never touched by any path. Default ().
        ignore_startswith_names: name prefixes never touched by any path. Default ().
        include_online_model: also save the online model in `state_dict()` (keys
            ``online_model.*``), as ema-pytorch does, so checkpoints load both ways.
            Default True. ``False`` gives smaller checkpoints; states with or without
            ``online_model.*`` load either way. emakit's own checkpoints (integrations,
            sharded saves, exports, snapshots) never hold the online model.
        allow_different_devices: allow EMA tensors on another device than the model's
            (e.g. a CPU shadow of a GPU model). Default False.
        use_foreach: ``False`` the reference per-tensor loop, ``True`` one foreach call
            per group, ``None`` the fastest correct path (coalesced flat spans). Default None.
        update_model_with_ema_every: every N calls that averaged, pull the model toward
            the EMA (see `update_model_with_ema()`). Default None (never).
        update_model_with_ema_beta: fraction of the model kept when doing so; 0 copies the
            EMA into the model. Default 0.0.
        forward_method_names: methods of the EMA model exposed on the wrapper (e.g.
            ``("generate",)``). Default ().
        move_ema_to_online_device: move the EMA model to the model's device at update
            time when they differ. Default False.
        coerce_dtype: allow EMA tensors of another dtype than the model's; online values
            are cast before averaging. Default False.
        lazy_init_ema: create the EMA copy at the first `update()` instead of now.
            Default False.
        ema_dtype: keyword-only; keep floating EMA tensors in at least this dtype, e.g.
            ``torch.float32`` for a bf16 model, so small updates at beta 0.9999 are not
            rounded away (a wider tensor, e.g. a float64 buffer, keeps its own dtype).
            Default None (the model's dtypes).
        schedule: keyword-only; a callable ``t -> decay`` (see [`emakit.schedules`][emakit.schedules])
            replacing the beta/inv_gamma/power warm-up (``beta``, ``inv_gamma`` and
            ``power`` are then unused; ``min_value`` still floors the decay). A decay
            outside [0, 1] (or NaN) raises. Default None.
        decay_groups: keyword-only; "layered EMA": fnmatch patterns over tensor names
            mapped to a beta (the same warm-up with that ceiling) or a schedule, e.g.
            ``{"backbone.*": 0.999, "head.*": 0.99}``. The first matching pattern wins;
            unmatched names use ``beta``/``schedule``. Each group is laid out contiguously,
            so it is still updated in as few kernels as its tensors allow. Default None.
        stream: keyword-only; for a GPU model with a GPU shadow: snapshot the weights on the
            current stream and average on a CUDA side stream ordered by events, with no
            host sync; readers wait on the GPU. Not for CUDA-graph capture: the decay is a
            Python float, so a captured update would replay the decay of the capture.
            Default False.
        device: keyword-only; keep the EMA on this device, e.g. ``"cpu"`` for a GPU model
            (offload: pinned memory, non-blocking copies). Implies
            ``allow_different_devices=True``. Default None (the model's device).
        async_update: keyword-only; run the arithmetic of each update on a background
            thread, overlapping the next forward/backward: ``update()`` only snapshots the
            weights into a reusable staging buffer. Everything that reads the EMA waits for
            the pending update first. Default None: True when ``device`` is given.
        share_frozen: keyword-only; parameters with ``requires_grad=False`` (a LoRA base,
            a frozen encoder) are shared with the model instead of copied and averaged:
            no memory, no update work, the same numbers as ema-pytorch while they stay
            frozen. A weight that an ``optimizer.step()`` is about to train again, or that
            a load would change, gets its own copy first and is averaged from then on. A
            frozen value changed in place (new base weights) is seen by the EMA at once;
            ``False`` copies and averages frozen weights as ema-pytorch does (they then
            lag). FSDP2 shards are shared too (the EMA copy's shard is the model's), except
            a parameter whose shards FSDP2 pads (dim 0 not divisible by the world size),
            which the EMA owns and averages. Not shared: with ``ema_dtype`` widening them,
            ``device=`` offload, an ``ema_model=`` given. Default True.
        skip_nonfinite: keyword-only; skip any update whose model weights hold NaN or Inf
            (counted in ``num_skipped_nonfinite``, warned once, when the count is read).
            Decided on the device, with no host read in ``update()``: one reduction to
            the weights' extremes, then a select in the update kernels; for FSDP2/DTensor models, one
            all-reduce of three numbers per update so every rank skips alike (update()
            becomes a collective: call it on every rank). Default False.
        partition: keyword-only; for a model replicated over the ranks of a
            ``torch.distributed`` job (DDP, DeepSpeed ZeRO-1 and 2): each rank keeps the
            EMA of one slice of every parameter (ZeRO-3's split: the flattened parameter cut
            into ``world`` chunks of ``ceil(numel / world)``), 1/world of the EMA's memory,
            updated with no communication. ``swap()``, ``ema(x)``, the state check and the
            full export gather the slices on demand (collectives: every rank); the state is
            per rank, as under ZeRO-3. Buffers stay whole. A ZeRO-3 model is partitioned
            anyway. Default False (every rank keeps the whole EMA).

"""

_IMPLS: dict[bool | None, Impl] = {None: "flat", True: "foreach", False: "loop"}

#: Keywords that only mean something for a module (refused for a pytree unless default).
_MODULE_ONLY: dict[str, object] = {
    "param_or_buffer_names_no_ema": frozenset(),
    "ignore_names": frozenset(),
    "ignore_startswith_names": frozenset(),
    "update_model_with_ema_every": None,
    "forward_method_names": (),
    "move_ema_to_online_device": False,
    "lazy_init_ema": False,
    "stream": False,
    "partition": False,
}


def as_device(device: object) -> torch.device | None:
    """``device`` as a ``torch.device`` (None stays None)."""
    if device is None or isinstance(device, torch.device):
        return device
    if isinstance(device, str):
        try:
            return torch.device(device)
        except RuntimeError as e:
            raise EMAValueError(
                f"device must name a torch device such as 'cpu', got {device=!r}"
            ) from e
    raise EMATypeError(f"device must be a str or torch.device, got {device=!r}")


def _decay_groups(groups: Any) -> dict[str, float | Callable[[int], float]]:
    """``decay_groups`` checked: str patterns to a beta in [0, 1] or a schedule."""
    checked: dict[str, float | Callable[[int], float]] = {}
    if groups is None:
        return checked
    if not isinstance(groups, Mapping):
        raise EMATypeError(
            f"decay_groups must map name patterns to a beta or a schedule, e.g. "
            f'{{"backbone.*": 0.999, "head.*": 0.99}}, got {type(groups).__name__}'
        )
    for pattern, rule in groups.items():
        if not isinstance(pattern, str):
            raise EMATypeError(f"decay_groups keys must be str patterns, got {pattern!r}")
        checked[pattern] = (
            rule
            if callable(rule)
            else check.real(f"decay_groups[{pattern!r}]", rule, low=0.0, high=1.0)
        )
    return checked


def _forward_names(names: Any) -> tuple[str, ...]:
    """``forward_method_names`` checked (a lone string is refused, not split)."""
    if isinstance(names, str):
        raise EMATypeError(
            f"forward_method_names must be a tuple of names, got the string "
            f"{names!r}; wrap it: ({names!r},)"
        )
    return tuple(check.names("forward_method_names", names))


@dataclass
class EMAOptions:
    """The checked keywords of [`EMA`][emakit.EMA] (see its docstring for each)."""

    rule: DecayRule
    values: dict[str, Any]
    decay_groups: dict[str, float | Callable[[int], float]] = field(default_factory=dict)

    @classmethod
    def parse(cls, kw: Mapping[str, Any]) -> EMAOptions:
        """Check the keywords (``EMA.__init__``'s ``locals()``)."""
        checked_groups = _decay_groups(kw["decay_groups"])
        rule = ema_rule(
            beta=kw["beta"],
            update_after_step=kw["update_after_step"],
            update_every=kw["update_every"],
            inv_gamma=kw["inv_gamma"],
            power=kw["power"],
            min_value=kw["min_value"],
            schedule=kw["schedule"],
            groups=list(checked_groups.values()),
        )
        device = as_device(kw["device"])
        async_update = kw["async_update"]
        v: dict[str, Any] = {
            "beta": float(kw["beta"]),
            "update_after_step": kw["update_after_step"],
            "update_every": kw["update_every"],
            "inv_gamma": float(kw["inv_gamma"]),
            "power": float(kw["power"]),
            "min_value": float(kw["min_value"]),
            "schedule": kw["schedule"],
            "allow_different_devices": check.boolean(
                "allow_different_devices", kw["allow_different_devices"]
            )
            or device is not None,
            "use_foreach": check.optional_boolean("use_foreach", kw["use_foreach"]),
            "coerce_dtype": check.boolean("coerce_dtype", kw["coerce_dtype"]),
            "ema_dtype": check.floating_dtype("ema_dtype", kw["ema_dtype"]),
            "skip_nonfinite": check.boolean("skip_nonfinite", kw["skip_nonfinite"]),
            "device": device,
            "async_update": (
                check.boolean("async_update", async_update)
                if async_update is not None
                else device is not None
            ),
            "stream": check.boolean("stream", kw["stream"]),
            "share_frozen": check.boolean("share_frozen", kw["share_frozen"]),
            "param_or_buffer_names_no_ema": check.names(
                "param_or_buffer_names_no_ema", kw["param_or_buffer_names_no_ema"]
            ),
            "ignore_names": check.names("ignore_names", kw["ignore_names"]),
            "ignore_startswith_names": check.names(
                "ignore_startswith_names", kw["ignore_startswith_names"]
            ),
            "include_online_model": check.boolean(
                "include_online_model", kw["include_online_model"]
            ),
            "update_model_with_ema_every": check.optional_integer(
                "update_model_with_ema_every", kw["update_model_with_ema_every"], low=1
            ),
            "update_model_with_ema_beta": check.real(
                "update_model_with_ema_beta", kw["update_model_with_ema_beta"], low=0.0, high=1.0
            ),
            "move_ema_to_online_device": check.boolean(
                "move_ema_to_online_device", kw["move_ema_to_online_device"]
            ),
            "lazy_init_ema": check.boolean("lazy_init_ema", kw["lazy_init_ema"]),
            "partition": check.boolean("partition", kw["partition"]),
            "forward_method_names": _forward_names(kw["forward_method_names"]),
        }
        if v["stream"] and (device is not None or async_update):
            raise EMAValueError(
                "stream=True keeps the EMA on the model's GPU and updates it on a side stream; "
                "it cannot be combined with device= or async_update=True (use one or the other)"
            )
        return cls(rule, v, checked_groups)

    @property
    def impl(self) -> Impl:
        """The engine path ``use_foreach`` asks for."""
        return _IMPLS[self.values["use_foreach"]]

    def attributes(self) -> dict[str, Any]:
        """The public attributes of the EMA (ema-pytorch's names)."""
        return dict(self.values)

    def refuse_for_pytree(self) -> None:
        """Raise for keywords that only apply to a module."""
        for name, default in _MODULE_ONLY.items():
            value = self.values[name]
            if value != default and not (name == "forward_method_names" and not value):
                raise EMAValueError(
                    f"{name}={value!r} applies to an EMA of a module, not of a tensor or "
                    f"pytree; leave it at its default ({default!r}) for a pytree"
                )
        if self.decay_groups:
            raise EMAValueError(
                "decay_groups applies to an EMA of a module; give each pytree its own EMA"
            )

    def check_names(self, model: nn.Module) -> None:
        """Warn for tensor names that match nothing in ``model`` (yet); raise for methods
        and ``decay_groups`` patterns that match nothing."""
        known = {n for n, _ in (*model.named_parameters(), *model.named_buffers())}
        # Names that match nothing *yet* are common in real trainers (a submodule that
        # cannot be deep-copied is removed while the EMA is built, then put back): warn.
        for arg in ("param_or_buffer_names_no_ema", "ignore_names"):
            unknown = sorted(self.values[arg] - known)
            if unknown:
                warnings.warn(
                    f"{arg} names tensors the model does not have (yet): {unknown}; they "
                    f"apply if such tensors appear later. Check the spelling against "
                    f"model.named_parameters()/named_buffers()",
                    UserWarning,
                    stacklevel=4,
                )
        unmatched = sorted(
            p
            for p in self.values["ignore_startswith_names"]
            if not any(n.startswith(p) for n in known)
        )
        if unmatched:
            warnings.warn(
                f"ignore_startswith_names has {unmatched}, which start no tensor name of the "
                f"model (yet); they apply if such tensors appear later",
                UserWarning,
                stacklevel=4,
            )
        names = self.values["forward_method_names"]
        if names and (self.values.get("partition") or zero3_params(model)):
            raise EMAValueError(
                f"forward_method_names={names!r} needs an EMA model of its own, which a "
                f"partitioned EMA (DeepSpeed ZeRO-3, or partition=True) does not have: call "
                f"the method on the online model inside ema.swap() instead, e.g. "
                f"with ema.swap(): model.{names[0]}(...)"
            )
        for method in names:
            if not callable(getattr(model, method, None)):
                raise EMAValueError(
                    f"forward_method_names has {method!r}, which is not a method of the model"
                )
        for pattern in self.decay_groups:
            if not any(fnmatch.fnmatchcase(n, pattern) for n in known):
                raise EMAValueError(
                    f"decay_groups pattern {pattern!r} matches no tensor name of the model; "
                    f"patterns are fnmatch globs over named_parameters()/named_buffers() names"
                )


def make_runner(model: Any, device: object, async_update: bool, stream: bool) -> Runner:
    """The runner the keywords ask for: CUDA side stream, background thread, or inline."""
    if stream:
        tensors = [*model.parameters(), *model.buffers()] if isinstance(model, nn.Module) else []
        first = next((t for t in tensors if t.is_cuda), None)
        if first is None or not torch.cuda.is_available():
            raise EMAValueError(
                "stream=True needs a model on a CUDA device (got one with no CUDA tensors); "
                "leave stream=False on CPU"
            )
        return StreamRunner(first.device)
    if async_update:
        return ThreadRunner()
    return SyncRunner()

"""``EMA``: an exponential moving average of a module's weights, ema-pytorch compatible.

The class is a facade: it checks the keywords and wires the parts that do the work, a
`Tracker` (counters, the pure [`decay`][emakit.decay] rule, the engine's plan and a
runner), the source of the tracked tensors and its shadow copy (`sources`, `shadow`), the
state codec (`state`) and `Swap`. A tensor or a nested dict/list/tuple of tensors is
tracked the same way (see [`EMAPytree`][emakit.EMAPytree]). It also has the rest of
ema-pytorch 0.8.3's members (``get_params_iter``, ``inplace_lerp``,
``update_moving_average`` ...) for code written against it.
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from . import _validate as check
from ._core import state
from ._core.forward import ForwardMethod, eval_call, io_cast
from ._core.shadow import unwrap_model
from ._core.sources import ModuleSource, TreeSource, call_factory
from ._core.swap import Swap
from ._core.tracker import Tracker
from ._core.tree import all_tensors, leaves, named_tensors
from ._dist.deepspeed import ZeroPartitions, zero3_params
from ._engine.compiled import refusal as compile_refusal
from ._engine.pairs import Tracked
from ._engine.plan import Engine
from ._engine.runners import Runner, StreamRunner, SyncRunner, ThreadRunner, hook_optimizer
from .decay import INIT, SKIP, ema_rule
from .errors import EMAError, EMARuntimeError, EMATypeError, EMAValueError

__all__ = ["EMA", "STATE_VERSION", "unwrap_model"]

#: Version of the layout that `EMA.state_dict()` writes (see its docstring); kept in
#: torch's per-module metadata (``EMA._version``), not in the keys.
STATE_VERSION = 2
_CODEC = state.StateCodec(
    STATE_VERSION,
    [
        state.flag("initted", required=True),
        state.integer("step", required=True),
        state.integer("num_skipped_nonfinite", meta=True),
    ],
    legacy_version_key="version",
)
#: The online model's child name, as in ema-pytorch: keys ``online_model.<model's names>``.
_ONLINE = "online_model"
_IMPLS: dict[bool | None, Engine] = {None: "flat", True: "foreach", False: "loop"}
#: Keywords that only mean something for a module, with their defaults (a pytree EMA
#: refuses any other value).
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


def _floating(t: Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


class EMA(nn.Module):
    """An exponential moving average of a module's parameters and buffers.

    Keyword-compatible with ``ema_pytorch.EMA`` 0.8.3: the same names, defaults and
    numbers for the same sequence of calls. Call [`update()`][emakit.ema.EMA.update] after every optimizer
    step; call the wrapper (``ema(x)``) to run the EMA model in eval mode without grad;
    use [`swap()`][emakit.ema.EMA.swap] to evaluate the online model on the EMA weights in place.
    Every keyword but ``model`` and ``ema_model`` is kept as an attribute of the same name
    (``ema.beta``, ``ema.device`` ...), checked and normalized (names as frozensets,
    ``device`` as a ``torch.device``, ``decay_groups`` as a dict).

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
            frozen and unwritten. Nothing is attached to the model: before every update
            and read of the EMA, their ``requires_grad`` flags, version counters and
            peft's merge flags are read (in C). A weight unfrozen and not yet written gets
            its own copy and is averaged from then on (ema-pytorch's numbers); a weight
            written in place (trained before the EMA saw it unfrozen, new values copied
            in) or merged into by peft (``merge_adapter()``) makes the EMA refuse to be
            read or updated ([`EMAStateError`][emakit.errors.EMAStateError] naming the
            cause and the fix) until ``unmerge_adapter()`` or a load; an in-place write
            through ``.data`` other than peft's is not seen. FSDP2 shards are shared too
            (the EMA copy's shard is the model's), except a parameter whose shards FSDP2
            pads (dim 0 not divisible by the world size), which the EMA owns and
            averages. Not shared: with ``ema_dtype`` widening them, ``device=`` offload,
            an ``ema_model=`` given. Default False: frozen weights are copied and
            averaged, as ema-pytorch does (docs/finetuning.md weighs the two).
        watch_model: keyword-only; the EMA reads the model and never alters it: on every
            update it compares copies of the tracked modules' ``_parameters``,
            ``_buffers`` and ``_modules`` dicts with the live ones (in C: about 0.1 ms per
            update for 2,000 modules on an idle core). ``True`` replaces those dicts by a
            ``dict`` subclass that counts its changes, so an unchanged model costs one
            integer compare whatever its size: it *alters the model* (a
            ``torch.compile``d forward pays for the subclass, 1.2-1.5x on many small
            modules, and one compiled before the EMA was built recompiles), for models of
            many modules whose updates are host-bound. Default False.
        skip_nonfinite: keyword-only; skip any update whose model weights hold NaN or Inf
            (counted in ``num_skipped_nonfinite``, warned once, when the count is read).
            Decided on the device, with no host read in ``update()``: one reduction to
            the weights' extremes, then a select in the update kernels; for FSDP2/DTensor models, one
            all-reduce of three numbers per update so every rank skips alike (update()
            becomes a collective: call it on every rank). Set it alike on every rank:
            emakit's collective saves and loads compare it across ranks, but under
            FSDP2/ZeRO-3 a rank that has it waits in its first update()'s all-reduce
            for ranks that never join (until the process group's timeout), before any
            save could compare. Default False.
        partition: keyword-only; for a model replicated over the ranks of a
            ``torch.distributed`` job (DDP, DeepSpeed ZeRO-1 and 2): each rank keeps the
            EMA of one slice of every parameter (ZeRO-3's split: the flattened parameter cut
            into ``world`` chunks of ``ceil(numel / world)``), 1/world of the EMA's memory,
            updated with no communication. ``swap()``, ``ema(x)``, the state check and the
            full export gather the slices on demand (collectives: every rank); the state is
            per rank, as under ZeRO-3. Buffers stay whole. A ZeRO-3 model is partitioned
            anyway. Default False (every rank keeps the whole EMA).
        compile_update: keyword-only; average through one ``torch.compile``'d function
            per group of tensors, which casts and averages in one pass over memory:
            ``shadow.lerp_(online.to(shadow.dtype), w)`` fused, 10 bytes per element for a
            bf16 model with an fp32 shadow (``ema_dtype=torch.float32``), where the eager
            update casts through a small buffer first. Bit-identical to the eager update
            and to ema-pytorch (the function is ``lerp_``'s formula, contracted into the
            same fused multiply-add). The decay is passed as a 0-dim tensor, so no decay
            value recompiles. The first averaging update compiles (seconds on a CPU, which
            needs a C++ compiler; BENCHMARKS.md, "The opt-in compiled update"). Pairs on
            two devices and copied tensors stay eager. Needs torch >= 2.9. Not with
            ``use_foreach``, ``skip_nonfinite``, ``device``, ``async_update``, ``stream``
            or ``partition``. Default False.

    Attributes:
        kind: ``"module"`` for an EMA of a module, ``"pytree"`` for one of a tensor or pytree.
        tracker: the bookkeeping (counters, rule, plan, runner, non-finite guard) that
            emakit's EMA kinds share. **Unstable internals:** it may change in any release;
            the public API (``step``, ``swap()`` ...) is what stays compatible.

    Example:
        >>> net = torch.nn.Linear(4, 4)
        >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
        >>> ema = EMA(net, beta=0.999, update_after_step=0, update_every=1)
        >>> for _ in range(3):
        ...     net(torch.randn(8, 4)).pow(2).mean().backward()
        ...     opt.step(); opt.zero_grad(); ema.update()
        >>> int(ema.step)
        3
        >>> y = ema(torch.randn(2, 4))  # the EMA model, eval mode, no grad
    """

    _version = STATE_VERSION

    def __init__(
        self,
        model: nn.Module | Any,
        ema_model: nn.Module | Callable[[], Any] | Any | None = None,
        beta: float = 0.9999,
        update_after_step: int = 100,
        update_every: int = 10,
        inv_gamma: float = 1.0,
        power: float = 2 / 3,
        min_value: float = 0.0,
        param_or_buffer_names_no_ema: Iterable[str] = (),
        ignore_names: Iterable[str] = (),
        ignore_startswith_names: Iterable[str] = (),
        include_online_model: bool = True,
        allow_different_devices: bool = False,
        use_foreach: bool | None = None,
        update_model_with_ema_every: int | None = None,
        update_model_with_ema_beta: float = 0.0,
        forward_method_names: Sequence[str] = (),
        move_ema_to_online_device: bool = False,
        coerce_dtype: bool = False,
        lazy_init_ema: bool = False,
        *,
        ema_dtype: torch.dtype | None = None,
        schedule: Callable[[int], float] | None = None,
        decay_groups: Mapping[str, float | Callable[[int], float]] | None = None,
        skip_nonfinite: bool = False,
        device: torch.device | str | None = None,
        async_update: bool | None = None,
        stream: bool = False,
        share_frozen: bool = False,
        partition: bool = False,
        compile_update: bool = False,
        watch_model: bool = False,
    ) -> None:
        super().__init__()
        rule = ema_rule(  # checks the numbers, schedule and decay_groups
            beta=beta,
            update_after_step=update_after_step,
            update_every=update_every,
            inv_gamma=inv_gamma,
            power=power,
            min_value=min_value,
            schedule=schedule,
            decay_groups=decay_groups,
        )
        self.beta = float(beta)
        self.update_after_step = int(update_after_step)  # checked by ema_rule: numpy ints too
        self.update_every = int(update_every)
        self.inv_gamma = float(inv_gamma)
        self.power = float(power)
        self.min_value = float(min_value)
        # set past nn.Module's __setattr__: a schedule that is a Module is no part of the state
        self.__dict__["schedule"] = schedule
        self.device = check.device("device", device)
        self.allow_different_devices = (
            check.boolean("allow_different_devices", allow_different_devices)
            or self.device is not None
        )
        self.use_foreach = (
            None if use_foreach is None else check.boolean("use_foreach", use_foreach)
        )
        self.coerce_dtype = check.boolean("coerce_dtype", coerce_dtype)
        self.ema_dtype = check.floating_dtype("ema_dtype", ema_dtype)
        self.skip_nonfinite = check.boolean("skip_nonfinite", skip_nonfinite)
        if async_update is None:  # default: on for an offloaded EMA
            async_update = self.device is not None
        self.async_update = check.boolean("async_update", async_update)
        self.stream = check.boolean("stream", stream)
        self.share_frozen = check.boolean("share_frozen", share_frozen)
        self.watch_model = check.boolean("watch_model", watch_model)
        self.param_or_buffer_names_no_ema = check.names(
            "param_or_buffer_names_no_ema", param_or_buffer_names_no_ema
        )
        self.ignore_names = check.names("ignore_names", ignore_names)
        self.ignore_startswith_names = check.names(
            "ignore_startswith_names", ignore_startswith_names
        )
        self.include_online_model = check.boolean("include_online_model", include_online_model)
        self.update_model_with_ema_every = check.optional_integer(
            "update_model_with_ema_every", update_model_with_ema_every, low=1
        )
        self.update_model_with_ema_beta = check.real(
            "update_model_with_ema_beta", update_model_with_ema_beta, low=0.0, high=1.0
        )
        self.move_ema_to_online_device = check.boolean(
            "move_ema_to_online_device", move_ema_to_online_device
        )
        self.lazy_init_ema = check.boolean("lazy_init_ema", lazy_init_ema)
        self.partition = check.boolean("partition", partition)
        self.forward_method_names = tuple(check.names("forward_method_names", forward_method_names))
        self.compile_update = check.boolean("compile_update", compile_update)
        if self.compile_update:
            self._check_compiled()
        if self.stream and (self.device is not None or async_update):
            raise EMAValueError(
                "stream=True keeps the EMA on the model's GPU and updates it on a side stream; "
                "it cannot be combined with device= or async_update=True (use one or the other)"
            )
        self.decay_groups = dict(decay_groups or {})
        self._tree: list[Any] = []  # [the EMA pytree] for a pytree (a list: not registered)
        tree = not isinstance(model, nn.Module)
        self.kind = "pytree" if tree else "module"
        if tree:
            self._refuse_for_pytree()
            if not leaves(model):
                raise EMATypeError(
                    f"pytree must be a tensor or a nested dict/list/tuple holding tensors, "
                    f"got {type(model).__name__}"
                )
        else:
            model = unwrap_model(model)
            self._check_names(model)
        runner = _make_runner(model, self.async_update, self.stream)
        engine = "compiled" if self.compile_update else _IMPLS[self.use_foreach]
        self.tracker = Tracker(rule, self._tracked, engine, runner, self.skip_nonfinite)
        self.tracker.settings = {  # what every rank of a job must share (see agree_on)
            "ema_dtype (the shadow dtype)": str(self.ema_dtype),
            "decay_groups patterns": repr(list(self.decay_groups)),
            "partition": str(self.partition),
        }
        self._online = [model]  # a list hides it from the module tree and state_dict
        if self.include_online_model and not tree and not zero3_params(model):  # ZeRO-3: empty
            self._modules[_ONLINE] = model  # a child (past the property): saved as online_model.*
        self._modules["ema_model"] = None
        self.register_load_state_dict_post_hook(_keep_online_model)
        common: dict[str, Any] = {
            "ema_dtype": self.ema_dtype,
            "cast": self.coerce_dtype or self.ema_dtype is not None,
            "other_devices": self.allow_different_devices,
            "device": self.device,
        }
        self._source: ModuleSource | TreeSource
        if tree:
            self._source = TreeSource(**common)
            self._tree.append(self._source.build(model, ema_model))
            return
        self._source = ModuleSource(
            ignore_names=self.ignore_names,
            ignore_prefixes=tuple(self.ignore_startswith_names),
            no_ema=self.param_or_buffer_names_no_ema,
            group_patterns=list(self.decay_groups),
            move_to_online=self.move_ema_to_online_device,
            share_frozen=self.share_frozen,
            watch_model=self.watch_model,
            on_unshare=self.tracker.invalidate,
            partition=self.partition,
            **common,
        )
        if ema_model is not None and not isinstance(ema_model, nn.Module):
            ema_model = call_factory(ema_model)
        if not self.lazy_init_ema:
            self.init_ema(ema_model)
        elif ema_model is not None:
            raise EMAValueError(
                "lazy_init_ema=True creates the EMA copy at the first update(); "
                "do not also pass ema_model (or set lazy_init_ema=False)"
            )

    # -- the keywords that need more than their value ------------------------------------

    def _check_compiled(self) -> None:
        """Raise for the keywords ``compile_update=True`` cannot be combined with, and on a
        torch it does not support."""
        others = {
            "use_foreach": (self.use_foreach, None, "the compiled update is its own engine"),
            "skip_nonfinite": (self.skip_nonfinite, False, "the guard has its own kernels"),
            "device": (self.device, None, "it fuses on the model's device"),
            "async_update": (self.async_update, False, "it fuses on the model's device"),
            "stream": (self.stream, False, "it runs on the current stream"),
            "partition": (self.partition, False, "a partitioned EMA is not compiled"),
        }
        for name, (value, default, why) in others.items():
            if value != default:
                raise EMAValueError(
                    f"compile_update=True cannot be combined with {name}={value!r} ({why}); "
                    f"leave {name} at {default!r} or pass compile_update=False"
                )
        if (reason := compile_refusal()) is not None:
            raise EMAValueError(reason)

    def _refuse_for_pytree(self) -> None:
        """Raise for keywords that only apply to a module (see `_MODULE_ONLY`)."""
        for name, default in _MODULE_ONLY.items():
            if (value := getattr(self, name)) != default:
                raise EMAValueError(
                    f"{name}={value!r} applies to an EMA of a module, not of a tensor or "
                    f"pytree; leave it at its default ({default!r}) for a pytree"
                )
        if self.decay_groups:
            raise EMAValueError(
                "decay_groups applies to an EMA of a module; give each pytree its own EMA"
            )

    def _check_names(self, model: nn.Module) -> None:
        """Warn for tensor names of the keywords that match nothing in ``model`` (yet);
        raise for methods and ``decay_groups`` patterns that match nothing."""
        known = set(named_tensors(model))
        prefixes = self.ignore_startswith_names
        unmatched = {p for p in prefixes if not any(n.startswith(p) for n in known)}
        # Names that match nothing *yet* are common in real trainers (a submodule that
        # cannot be deep-copied is removed while the EMA is built, then put back): warn.
        for arg, unknown in (
            ("param_or_buffer_names_no_ema", self.param_or_buffer_names_no_ema - known),
            ("ignore_names", self.ignore_names - known),
            ("ignore_startswith_names", unmatched),
        ):
            if unknown:
                warnings.warn(
                    f"{arg} has {sorted(unknown)}, which match no tensor name of the model "
                    f"(yet); they apply if such tensors appear later. Check the spelling "
                    f"against model.named_parameters()/named_buffers()",
                    UserWarning,
                    stacklevel=4,
                )
        names = self.forward_method_names
        if names and (self.partition or zero3_params(model)):
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

    # -- the models ----------------------------------------------------------------------

    @property
    def model(self) -> nn.Module | Any:
        """The online (training) model (the online pytree for an EMA of a pytree); also
        ``online_model``, ema-pytorch's name. Saved with ``include_online_model``."""
        registered = self._modules.get(_ONLINE)
        return registered if registered is not None else self._online[0]

    online_model = model

    @property
    def ema_model(self) -> nn.Module | Any:
        """The EMA model (None before the first update with ``lazy_init_ema=True``); waits
        for a background update in flight first."""
        self._before_read()
        return self._tree[0] if self._tree else self._modules["ema_model"]

    def _before_read(self) -> None:
        """What every read of the EMA weights does first: wait for a background update in
        flight, and settle shared frozen weights (``share_frozen=True``: un-share an
        unfrozen one, refuse a written one; see `emakit._core.frozen`). A ``BEMA`` also
        builds its evaluated weights here."""
        self.tracker.runner.wait()
        self._source.before_read()

    def init_ema(self, ema_model: nn.Module | None = None) -> None:
        """Create (or adopt) the EMA model and lay out its storage.

        Called by the constructor, or by the first [`update()`][emakit.ema.EMA.update] when
        ``lazy_init_ema=True``.
        """
        if not isinstance(self._source, ModuleSource):
            raise EMATypeError("init_ema() builds the EMA of a module; this EMA tracks a pytree")
        ema_model = self._source.build(self.model, ema_model)
        self._modules["ema_model"] = ema_model
        first = next(iter(all_tensors(ema_model)), None)
        self._home = self.device or (first.device if first is not None else None)
        for name in self.forward_method_names:  # FSDP2: registered, run on fresh shards
            setattr(self, name, ForwardMethod(ema_model, name, self._before_read))
        self.tracker.invalidate()

    def _tracked(self) -> Tracked:
        """The live pairs (the tracker's ``pairs``); creates a lazy EMA model first."""
        if not self._tree and self._modules["ema_model"] is None:
            self.init_ema()
        ema_model: Any = self._tree[0] if self._tree else self._modules["ema_model"]
        return self._source.pairs(self.model, ema_model)  # not a read: no _before_read

    def restore_ema_model_device(self) -> None:
        """Move the EMA model back to its own device (where it was built, or ``device=``)
        after ``move_ema_to_online_device`` moved it to the model's (ema-pytorch's method)."""
        ema_model = self._modules["ema_model"]
        home = getattr(self, "_home", None)
        if ema_model is None or home is None or not isinstance(self._source, ModuleSource):
            return
        self.tracker.runner.wait()
        self._source.move_ema(self.model, ema_model, home)
        self.tracker.invalidate()

    def _apply(self, fn: Any, recurse: bool = True) -> nn.Module:
        # .to()/.cuda()/.half() replace storages: the plan is rebuilt on next use.
        self.tracker.invalidate()
        return super()._apply(fn, recurse)

    # -- counters and decay ----------------------------------------------------------------

    @property
    def step(self) -> Tensor:
        """``update()`` calls so far, as ema-pytorch's CPU int64 tensor: ``ema.step.item()``,
        ``int(ema.step)``; in-place writes (``ema.step += 1``, ``ema.step.copy_(t)``) take
        effect at the next call. ``.to()`` does not move it."""
        return self.tracker.tensor_views()[0]

    @step.setter
    def step(self, value: Tensor | int) -> None:
        self.tracker.set_counters(step=check.count("step", value))

    @property
    def initted(self) -> Tensor:
        """Whether the first ``update()`` has copied the model into the EMA: a CPU bool
        tensor, writable in place as in ema-pytorch (``ema.initted.data.fill_(False)``
        makes the next call initialize again)."""
        return self.tracker.tensor_views()[1]

    @initted.setter
    def initted(self, value: Tensor | bool) -> None:
        if isinstance(value, Tensor):
            if value.numel() != 1 or value.is_floating_point():
                raise EMATypeError(
                    f"initted must be a bool or a 1-element bool tensor, got {value!r}"
                )
            value = bool(value)
        self.tracker.set_counters(initted=check.boolean("initted", value))

    @property
    def is_frozen(self) -> bool:
        """Whether averaging calls leave the EMA unchanged (``beta == 1``)."""
        return self.tracker.rule.frozen

    @property
    def num_skipped_nonfinite(self) -> int:
        """Updates skipped because the weights held NaN or Inf (``skip_nonfinite=True``), the
        same on every rank; reading it reads the count back from the device."""
        return self.tracker.num_skipped_nonfinite

    def get_current_decay(self) -> float:
        """The decay the most recent update used (ema-pytorch's definition).

        .. math:: t = \\max(\\text{step} - \\text{update\\_after\\_step} - 1, 0),\\quad
           \\text{decay} = \\text{clamp}(1 - (1 + t / \\text{inv\\_gamma})^{-\\text{power}},
           \\text{min\\_value}, \\beta)

        and 0 while ``t == 0``. With ``schedule=`` set, ``schedule(t)`` replaces the formula.
        With ``decay_groups``, this is the default group's decay (see [`current_decays()`][emakit.ema.EMA.current_decays]).
        """
        return self.tracker.rule.decay(self.tracker.step)

    def current_decays(self) -> dict[str, float]:
        """The decay of every decay group at the current step: ``{"default": d, pattern: d}``."""
        t = self.tracker
        groups = {p: t.rule.decay(t.step, t.last, g) for g, p in enumerate(self.decay_groups, 1)}
        return {"default": self.get_current_decay(), **groups}

    # -- the update ------------------------------------------------------------------------

    def update(self, *model: Any) -> None:
        """Advance the EMA by one training step; call it after every ``optimizer.step()``.

        The first call copies the model into the EMA. After that, a call does work only
        when ``(step - 1) % update_every == 0`` (``step`` counted after the call): a plain
        copy while ``step - 1 <= update_after_step``, then
        ``ema.lerp_(model, 1 - decay)``. Skipped calls cost one integer compare; no call
        reads a value back from an accelerator (``skip_nonfinite`` decides on the device).

        With ``update_model_with_ema_every=N``, every N-th call (ema-pytorch's cadence:
        ``step % N == 0`` counted before the call) also pulls the model toward the EMA
        ([`update_model_with_ema()`][emakit.ema.EMA.update_model_with_ema]), except during the warm-up
        (``step <= update_after_step``), when the EMA is only a copy of the model.

        It takes no arguments: the EMA follows the model given at construction. timm's
        ``update(model)`` raises [`EMATypeError`][emakit.errors.EMATypeError] saying so
        (``emakit.compat.timm.ModelEmaV3`` takes it).
        """
        if model:  # timm's habit, update(model): refused by name (an empty tuple: free)
            raise self._update_takes_no_model(model)
        tracker = self.tracker
        action = tracker.advance()
        if action is not SKIP:
            tracker.apply(action)
        every = self.update_model_with_ema_every
        if every is None or action is INIT:
            return
        step = tracker.step - 1  # ema-pytorch's count before this call
        if step % every == 0 and step > self.update_after_step:
            self.update_model_with_ema()

    def _update_takes_no_model(self, args: tuple[Any, ...]) -> EMATypeError:
        """The error for ``update(model)``, timm's habit."""
        what = "pytree" if self._tree else "model"
        given = ", ".join(type(a).__name__ for a in args)
        same = " (the one this EMA follows)" if args[0] is self.model else ""
        return EMATypeError(
            f"{type(self).__name__}.update() takes no model, got update({given}){same}: the "
            f"EMA follows the {what} given at construction (ema.{what}). Call ema.update() "
            f"after each optimizer.step(); for timm's update(model) use "
            f"emakit.compat.timm.ModelEmaV3"
        )

    def copy_params_from_model_to_ema(self) -> None:
        """Copy every tracked tensor of the model into the EMA (ignored names untouched)."""
        self.tracker.runner.wait()
        self.tracker.plan().copy_to_shadow()

    def copy_params_from_ema_to_model(self) -> None:
        """Copy every tracked tensor of the EMA into the model (ignored names untouched)."""
        self.update_model_with_ema(0.0)

    def update_model_with_ema(self, decay: float | None = None) -> None:
        """Pull the online model toward the EMA ("hare and tortoise", arXiv:2406.02596).

        .. math:: \\text{model} \\leftarrow b\\,\\text{model} + (1 - b)\\,\\text{ema}

        Args:
            decay: ``b``, the fraction of the model kept, in [0, 1]. Default None uses
                ``update_model_with_ema_beta``; 0 copies the EMA into the model.
        """
        b = self.update_model_with_ema_beta
        if decay is not None:
            b = check.real("decay", decay, low=0.0, high=1.0)
        self._before_read()
        if b == 0.0:
            self.tracker.plan().copy_to_online()
        else:
            self.tracker.plan().lerp_online(1.0 - b)

    def add_to_optimizer_post_step_hook(self, optimizer: torch.optim.Optimizer) -> Any:
        """Call [`update()`][emakit.ema.EMA.update] after every ``optimizer.step()``; returns the hook handle
        (``handle.remove()`` detaches it).

        With ``async_update=True`` on a CPU model this also registers a *pre*-step hook that
        waits for the pending background update. Since no optimizer step can then write the
        weights while the worker reads them, updates stop snapshotting the parameters: the
        worker averages straight from the live tensors, and the training thread only
        updates the (small) buffers, which the next forward may write.
        """
        if not hasattr(optimizer, "register_step_post_hook"):
            raise EMATypeError(
                f"optimizer must be a torch.optim.Optimizer (with register_step_post_hook), "
                f"got {type(optimizer).__name__}"
            )
        on_accelerator = any(t.is_cuda for t in all_tensors(self.model))
        return hook_optimizer(
            optimizer, self.update, self.tracker.runner, on_accelerator=on_accelerator
        )

    # -- reading the EMA -------------------------------------------------------------------

    def swap(self, *, in_place: bool = False) -> Swap:
        """Inside the block the online model holds the EMA weights; afterwards its own.

        Tensors whose shadow has the same dtype and device are swapped by reference
        (``.data`` re-pointing): no weight is copied and no memory is allocated. Tensors
        whose shadow differs (``ema_dtype``, another device) are cast into a temporary;
        FSDP2 shards, and every tensor with ``in_place=True``, are copied in and back.
        The original weights come back on exit, also when the block raises. The returned
        `Swap` also has explicit ``enter()``/``exit()``.

        Inside the block the model's tensors *are* the EMA's: writes into the model there
        (an ``optimizer.step()``, a train-mode forward updating BatchNorm's running
        statistics, ``load_state_dict``) land in the EMA weights and stay there after the
        block, in every mode (by reference directly; by cast or copy through a write-back
        on exit of the tensors that changed). To evaluate without changing the EMA, call
        ``model.eval()`` under ``torch.no_grad()`` inside the block, or use ``ema(x)``.
        No warning is given: writing the EMA this way is also how its BatchNorm
        statistics are recalibrated on purpose. After the block ``update()`` goes on as
        usual, averaging the model into the EMA weights as the block left them (an
        ``optimizer.step()`` there trained them). An ``update()`` inside the block
        raises [`EMARuntimeError`][emakit.errors.EMARuntimeError], also the one that an
        optimizer hooked with
        [`add_to_optimizer_post_step_hook()`][emakit.ema.EMA.add_to_optimizer_post_step_hook]
        calls after such a step; its message says what the step did.

        Example:
            >>> net = torch.nn.Linear(2, 2)
            >>> ema = EMA(net, beta=0.9)
            >>> with ema.swap():
            ...     _ = net(torch.zeros(1, 2))  # runs on the EMA weights
        """
        return Swap(self.tracker, self.model, in_place=check.boolean("in_place", in_place))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the EMA model in eval mode without grad; each submodule's mode is restored.

        It takes the inputs the model takes. With ``ema_dtype`` (an fp32 shadow of a bf16
        or fp16 model) floating inputs are cast to the shadow's dtype and floating outputs
        back to the model's; with ``device=`` (the shadow offloaded) inputs are moved to
        the shadow's device and outputs back to the model's (`emakit._core.forward`).
        For an EMA of a pytree: call the EMA pytree if it is callable, else return it.
        An FSDP2 EMA model is resharded before and after, so every call sees the current
        shards (a collective: call it on every rank). A partitioned EMA (ZeRO-3,
        ``partition=True``) runs the online model inside ``swap()``, a collective too.
        """
        ema_model = self.ema_model
        if self._tree:
            if callable(ema_model) and not isinstance(ema_model, Tensor):
                with torch.no_grad():
                    return ema_model(*args, **kwargs)
            return ema_model
        if ema_model is None:
            raise EMARuntimeError(
                "the EMA model does not exist yet (lazy_init_ema=True): call update() first"
            )
        if isinstance(ema_model, ZeroPartitions):  # the model on the EMA partitions
            return self.swap().run(eval_call, self.model, self.model, args, kwargs)
        cast = io_cast(
            self.model, ema_model, dtype=self.ema_dtype is not None, device=self.device is not None
        )
        if cast is not None:
            args, kwargs = cast.inputs(args, kwargs)
        out = eval_call(ema_model, ema_model, args, kwargs)  # FSDP2: on fresh shards
        return out if cast is None else cast.outputs(out)

    forward_eval = forward

    def eval(self) -> EMA:
        """Put the EMA model in eval mode (the online model is left alone)."""
        if (ema_model := self._modules["ema_model"]) is not None:
            ema_model.eval()
        self.training = False
        return self

    # -- state ---------------------------------------------------------------------------

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        self.tracker.runner.wait()
        if not keep_vars:  # (keep_vars: the tensors themselves, what a load compares with)
            self._source.before_read()  # shared frozen weights written or merged: refused
        if not keep_vars and isinstance(self._modules["ema_model"], ZeroPartitions):
            self._modules["ema_model"].agree(self.tracker)  # every rank at the same step
        super()._save_to_state_dict(destination, prefix, keep_vars)
        t = self.tracker
        t.sync_views()  # a client may have written ema.step / ema.initted in place
        skips = t.num_skipped_nonfinite if self.skip_nonfinite else None
        counters = {"step": t.step, "initted": t.initted, "num_skipped_nonfinite": skips}
        _CODEC.encode(counters, destination, prefix)
        if self._tree:
            TreeSource.save(self._tree[0], destination, prefix, keep_vars)

    def _load_from_state_dict(
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: dict,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        self.tracker.runner.wait()
        if _ONLINE in self._modules and not _has_online(state_dict, prefix):
            self.__dict__["_online_left_out"] = prefix  # see _keep_online_model
        self._init_for_load(state_dict, prefix)  # a parent module loading us
        values = _CODEC.decode(state_dict, prefix, local_metadata, missing_keys)
        t = self.tracker
        t.set_counters(step=values.get("step"), initted=values.get("initted"))
        t.num_skipped_nonfinite = values.get("num_skipped_nonfinite", t.num_skipped_nonfinite)
        self._load_own_state(state_dict, prefix, local_metadata, missing_keys)
        self._source.before_load(state_dict, prefix + "ema_model.")  # copy-on-write
        before = len(unexpected_keys)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        if self._tree:
            TreeSource.load(self._tree[0], state_dict, prefix, missing_keys, error_msgs)
        unexpected_keys[before:] = [
            k for k in unexpected_keys[before:] if not self.owns_state_key(k[len(prefix) :])
        ]

    def _load_own_state(
        self, state_dict: Mapping[str, Any], prefix: str, metadata: dict, missing_keys: list[str]
    ) -> None:
        """Read what a subclass adds to EMA's state (its settings, tensors of its own), once
        the counters are read and before the EMA's tensors are: the step of
        `_load_from_state_dict` that the EMA kinds (``BEMA``, ``KarrasEMA``) fill in.
        ``metadata`` is torch's ``local_metadata`` of this module. A plain EMA adds nothing."""

    def _init_for_load(self, state_dict: Mapping[str, Any], prefix: str) -> None:
        """Create a lazy EMA model (``lazy_init_ema``) when the state brings its weights."""
        lazy = not self._tree and self._modules["ema_model"] is None
        if lazy and any(k.startswith(prefix + "ema_model.") for k in state_dict):
            self.init_ema()

    def owns_state_key(self, key: str) -> bool:
        """Whether a state-dict key (relative to this EMA) is one it reads itself, or
        accepts and ignores, beyond its tensors (earlier layouts' keys, ema-pytorch's
        ``online_model.*``)."""
        if key in _CODEC.keys or (self.kind == "pytree" and key.startswith("ema.")):
            return True
        # without include_online_model, ema-pytorch's online_model.* are accepted and ignored
        return not self.include_online_model and key.startswith("online_model.")

    def state_dict(  # type: ignore[override]
        self, *args: Any, include_online_model: bool = True, **kwargs: Any
    ) -> dict[str, Any]:
        """The EMA state, with ema-pytorch's keys; for ``EMA(nn.Linear(2, 2))``::

            {
                "step": tensor(1234),           # update() calls so far
                "initted": tensor(True),        # whether the first update() happened
                "online_model.weight": tensor(...),  # with include_online_model (default)
                "ema_model.weight": tensor(...),  # the EMA weights, in the shadow dtype
            }

        (and ``.bias``). The version (2) and the ``skip_nonfinite`` count are in the metadata
        (``state._metadata[""]``); a pytree's leaves are ``"ema.<path>"``.

        Args:
            include_online_model: keyword-only; False leaves ``online_model.*`` out (as
                emakit's own checkpoints do). Default True.
        """
        if check.boolean("include_online_model", include_online_model):
            return super().state_dict(*args, **kwargs)
        modules = self._modules  # hide the online model from torch's walk, in order
        self.__dict__["_modules"] = {k: m for k, m in modules.items() if k != _ONLINE}
        try:
            return super().state_dict(*args, **kwargs)
        finally:
            self.__dict__["_modules"] = modules

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load a state written by [`state_dict()`][emakit.ema.EMA.state_dict] (or by ema-pytorch 0.8.3).

        Values are copied into the existing shadow tensors, so the shadow keeps its dtype
        (an fp32 shadow stays fp32 when loading an fp16 checkpoint). With ``strict=True``
        (default) any missing or unexpected key raises [`EMAStateError`][emakit.errors.EMAStateError]
        listing them.

        A partitioned EMA (DeepSpeed ZeRO-3, ``partition=True``) under
        ``torch.distributed`` loads in a collective: call it on every rank. The ranks check
        their own states first, then agree (one bounded all-gather): every rank loads, or
        every rank raises (a rank whose state is refused with its own reason, the others
        naming the ranks that refused). Under ZeRO-1/2 DeepSpeed's ``save_checkpoint``
        keeps rank 0's ``client_state`` alone, so resuming a ``partition=True`` EMA from it
        raises on every rank instead of leaving rank 0 training on while the others stop.
        """
        state.refuse_load_arguments(state_dict, assign)
        self._init_for_load(state_dict, "")
        zero = self._modules.get("ema_model")
        failure = None
        try:
            if isinstance(zero, ZeroPartitions):
                zero.refuse_other_world(state_dict, "ema_model.")  # another rank or world
            # Refuse first, load after (a failed load changes nothing); no online_model.*: kept.
            mine = self.state_dict(keep_vars=True, include_online_model=_has_online(state_dict))
            state.check_loadable(mine, state_dict, strict=strict, owned=self.owns_state_key)
        except EMAError as e:
            failure = e
        if isinstance(zero, ZeroPartitions):
            zero.agree_to_load(self.tracker, failure)  # every rank loads, or every rank raises
        elif failure is not None:
            raise failure
        return state.load_or_restore(
            lambda: super(EMA, self).load_state_dict(state_dict, strict=strict), [self.tracker]
        )

    # -- the rest of ema-pytorch's surface --------------------------------------------------

    @property
    def pytree(self) -> Any:
        """The online pytree (an EMA of a pytree; ema-pytorch's ``EMAPytree.pytree``)."""
        if self.kind != "pytree":
            raise AttributeError("pytree: this is an EMA of a module; see .model")
        return self.model

    @property
    def ema_pytree(self) -> Any:
        """The EMA pytree (an EMA of a pytree); waits for a background update first."""
        if self.kind != "pytree":
            raise AttributeError("ema_pytree: this is an EMA of a module; see .ema_model")
        return self.ema_model

    def copy_params_from_pytree_to_ema(self) -> None:
        """Copy every online leaf into the EMA (ema-pytorch's name for a pytree)."""
        self.copy_params_from_model_to_ema()

    @property
    def parameter_names(self) -> set[str]:
        """Names of the EMA model's floating (and complex) parameters."""
        return {n for n, p in self.ema_model.named_parameters() if _floating(p)}

    @property
    def buffer_names(self) -> set[str]:
        """Names of the EMA model's floating (and complex) buffers."""
        return {n for n, b in self.ema_model.named_buffers() if _floating(b)}

    def get_params_iter(self, model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
        """``(name, parameter)`` of ``model`` for the names in `parameter_names`."""
        names = self.parameter_names
        return ((n, p) for n, p in model.named_parameters() if n in names)

    def get_buffers_iter(self, model: nn.Module) -> Iterator[tuple[str, Tensor]]:
        """``(name, buffer)`` of ``model`` for the names in `buffer_names`."""
        names = self.buffer_names
        return ((n, b) for n, b in model.named_buffers() if n in names)

    def _aligned(self, tgt: Tensor, src: Tensor) -> Tensor:
        if self.allow_different_devices:
            src = src.to(tgt.device)
        if self.coerce_dtype and src.dtype != tgt.dtype:
            src = src.to(tgt.dtype)
        return src

    @torch.no_grad()
    def inplace_copy(self, tgt: Tensor, src: Tensor) -> None:
        """``tgt.copy_(src)``, moving/casting ``src`` as ``allow_different_devices`` and
        ``coerce_dtype`` allow."""
        tgt.copy_(self._aligned(tgt, src))

    @torch.no_grad()
    def inplace_lerp(self, tgt: Tensor, src: Tensor, weight: float) -> None:
        """``tgt.lerp_(src, weight)``, moving/casting ``src`` as allowed."""
        tgt.lerp_(self._aligned(tgt, src), weight)

    @torch.no_grad()
    def update_moving_average(
        self, ma_model: Any, current_model: Any, current_decay: float | None = None
    ) -> None:
        """``ma_model <- decay * ma_model + (1 - decay) * current_model`` by name.

        ``(ema_model, model)`` averages the EMA (the default decay is
        `get_current_decay()`); ``(model, ema_model)`` pulls the model toward the EMA
        (as `update_model_with_ema()` does); other modules are averaged by name over
        the floating tensors they share. A frozen EMA (``beta == 1``) is left alone, as
        in ema-pytorch.
        """
        if self.is_frozen:
            return
        decay = self.get_current_decay() if current_decay is None else float(current_decay)
        if ma_model is self.model and current_model is self.ema_model:
            self.update_model_with_ema(decay)
        elif ma_model is not self.ema_model or current_model is not self.model:
            self._average_by_name(ma_model, current_model, decay)
        else:  # reading self.ema_model above waited for a background update
            t = self.tracker
            weights = [1.0 - decay] * len(t.rule.decays)  # the decay given, for every group
            if current_decay is None:  # every decay group its own current decay
                weights = list(t.rule.weights(t.step, t.last))
            t.plan().lerp_shadow(weights)

    @torch.no_grad()
    def _average_by_name(self, ma: Any, current: Any, decay: float) -> None:
        """``ma <- decay * ma + (1 - decay) * current`` for the floating tensors of two
        modules (parameters and buffers) or two pytrees (leaves) that share a name; other
        tensors of the same name are copied."""
        sources = named_tensors(current)
        for name, tgt in named_tensors(ma).items():
            src = sources.get(name)
            if src is None:
                continue
            if _floating(tgt):
                self.inplace_lerp(tgt.data, src.detach(), 1.0 - decay)
            else:
                self.inplace_copy(tgt.data, src.detach())

    def __getstate__(self) -> dict:
        self.tracker.runner.wait()
        return self.__dict__.copy()


def _has_online(state_dict: Mapping[str, Any], prefix: str = "") -> bool:
    """Whether ``state_dict`` holds any ``<prefix>online_model.*`` key."""
    return any(k.startswith(prefix + _ONLINE + ".") for k in state_dict)


def _keep_online_model(module: nn.Module, incompatible: Any) -> None:
    """A load-state-dict post-hook: a state without ``online_model.*`` (emakit's own
    checkpoints, ema-pytorch's with ``include_online_model=False``) is not missing keys;
    the online model is left as it is (``_load_from_state_dict`` noted the prefix). Also
    the end of every load for shared frozen weights (`ModuleSource.after_load()`)."""
    module._source.after_load()  # type: ignore[union-attr,operator]
    prefix = module.__dict__.pop("_online_left_out", None)
    if prefix is not None:
        ours = prefix + _ONLINE + "."
        incompatible.missing_keys[:] = [
            k for k in incompatible.missing_keys if not k.startswith(ours)
        ]


def _make_runner(model: Any, async_update: bool, stream: bool) -> Runner:
    """The runner the keywords ask for: CUDA side stream, background thread, or inline."""
    if stream:
        first = next((t for t in all_tensors(model) if t.is_cuda), None)
        if first is None or not torch.cuda.is_available():
            raise EMAValueError(
                "stream=True needs a model on a CUDA device (got one with no CUDA tensors); "
                "leave stream=False on CPU"
            )
        return StreamRunner(first.device)
    return ThreadRunner() if async_update else SyncRunner()

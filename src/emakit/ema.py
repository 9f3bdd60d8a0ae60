"""``EMA``: an exponential moving average of a module's weights, ema-pytorch compatible.

The class is a facade: it validates the keywords and wires the parts that do the work, a
`Tracker` (counters, the pure [`decay`][emakit.decay] rule, the
engine's plan and a runner), the shadow copy (`shadow`), the state
codec (`state`) and `Swap`. A tensor or a
nested dict/list/tuple of tensors is tracked the same way (see [`EMAPytree`][emakit.EMAPytree]).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from . import _validate as check
from ._core import online
from ._core.forward import ForwardMethod, eval_call, io_cast
from ._core.options import KEYWORDS_DOC, EMAOptions, make_runner
from ._core.shadow import unwrap_model
from ._core.sources import ModuleSource, TreeSource, call_factory
from ._core.state import StateCodec, check_loadable, flag, integer
from ._core.swap import Swap
from ._core.tracker import Tracker
from ._core.tree import all_tensors, leaves
from ._dist.deepspeed import ZeroPartitions, zero3_params
from ._engine.pairs import Tracked
from ._engine.runners import hook_optimizer
from .compat import EMAPytorchSurface
from .decay import INIT
from .errors import EMARuntimeError, EMAStateError, EMATypeError, EMAValueError

__all__ = ["EMA", "STATE_VERSION", "unwrap_model"]

#: Version of the layout that `EMA.state_dict()` writes (see its docstring); kept in
#: torch's per-module metadata (``EMA._version``), not in the keys.
STATE_VERSION = 2
_CODEC = StateCodec(
    STATE_VERSION,
    [
        flag("initted", required=True),
        integer("step", required=True),
        integer("num_skipped_nonfinite", meta=True),
    ],
    legacy_version_key="version",
)


class EMA(EMAPytorchSurface, nn.Module):
    """An exponential moving average of a module's parameters and buffers.

    Keyword-compatible with ``ema_pytorch.EMA`` 0.8.3: the same names, defaults and
    numbers for the same sequence of calls. Call [`update()`][emakit.ema.EMA.update] after every optimizer
    step; call the wrapper (``ema(x)``) to run the EMA model in eval mode without grad;
    use [`swap()`][emakit.ema.EMA.swap] to evaluate the online model on the EMA weights in place.

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
    beta: float
    update_after_step: int
    update_every: int
    inv_gamma: float
    power: float
    min_value: float
    schedule: Callable[[int], float] | None
    param_or_buffer_names_no_ema: frozenset[str]
    ignore_names: frozenset[str]
    ignore_startswith_names: frozenset[str]
    include_online_model: bool
    allow_different_devices: bool
    use_foreach: bool | None
    update_model_with_ema_every: int | None
    update_model_with_ema_beta: float
    forward_method_names: tuple[str, ...]
    move_ema_to_online_device: bool
    coerce_dtype: bool
    lazy_init_ema: bool
    ema_dtype: torch.dtype | None
    skip_nonfinite: bool
    device: torch.device | None
    async_update: bool
    stream: bool
    share_frozen: bool

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
        share_frozen: bool = True,
        partition: bool = False,
    ) -> None:
        super().__init__()
        opts = EMAOptions.parse(locals())
        self.__dict__.update(opts.attributes())
        tree = not isinstance(model, nn.Module)
        if tree:
            opts.refuse_for_pytree()
            online_tree, shadow_tree = model, ema_model
            if not leaves(online_tree):
                raise EMATypeError(
                    f"pytree must be a tensor or a nested dict/list/tuple holding tensors, "
                    f"got {type(online_tree).__name__}"
                )
            model = nn.Module()  # a stand-in: nothing is registered on it
        else:
            model = unwrap_model(model)
            opts.check_names(model)
        self._tree: list[Any] | None = [online_tree, None] if tree else None
        self._group_patterns = list(opts.decay_groups)
        runner = make_runner(model, self.device, self.async_update, self.stream)
        self._tracker = Tracker(
            opts.rule,
            _LivePairs(self),
            impl=opts.impl,
            runner=runner,
            skip_nonfinite=skip_nonfinite,
        )
        common: dict[str, Any] = {
            "ema_dtype": self.ema_dtype,
            "cast": self.coerce_dtype or self.ema_dtype is not None,
            "other_devices": self.allow_different_devices,
            "device": self.device,
        }
        self._source: ModuleSource | TreeSource
        self._online = [model]  # a list hides it from the module tree and state_dict
        if self.include_online_model and not tree and not zero3_params(model):  # ZeRO-3: empty
            self.online_model = model  # registered: saved under online_model.*
        self._modules["ema_model"] = None
        self.register_load_state_dict_post_hook(online.keep_online_model)
        if self._tree is not None:
            self._source = TreeSource(**common)
            self._tree[1] = self._source.build(online_tree, shadow_tree)
            return
        self._source = ModuleSource.for_ema(
            opts.values, list(opts.decay_groups), self._tracker.invalidate, **common
        )
        if ema_model is not None and not isinstance(ema_model, nn.Module):
            ema_model = call_factory(ema_model)
        if lazy_init_ema:
            if ema_model is not None:
                raise EMAValueError(
                    "lazy_init_ema=True creates the EMA copy at the first update(); "
                    "do not also pass ema_model (or set lazy_init_ema=False)"
                )
        else:
            self.init_ema(ema_model)

    # -- the models ----------------------------------------------------------------------

    @property
    def model(self) -> nn.Module | Any:
        """The online (training) model (the online pytree for an EMA of a pytree)."""
        if self._tree is not None:
            return self._tree[0]
        registered = self._modules.get("online_model")
        return registered if registered is not None else self._online[0]

    @property
    def online_model(self) -> nn.Module | Any:
        """The online model (ema-pytorch's name); saved with ``include_online_model``."""
        return self.model

    @online_model.setter
    def online_model(self, model: nn.Module) -> None:
        self._modules["online_model"] = model

    @property
    def ema_model(self) -> nn.Module | Any:
        """The EMA model (None before the first update with ``lazy_init_ema=True``); waits
        for a background update in flight first."""
        self._tracker.runner.wait()
        return self._tree[1] if self._tree is not None else self._modules["ema_model"]

    @property
    def kind(self) -> str:
        """``"module"`` for an EMA of a module, ``"pytree"`` for one of a tensor or pytree."""
        return "module" if self._tree is None else "pytree"

    def init_ema(self, ema_model: nn.Module | None = None) -> None:
        """Create (or adopt) the EMA model and lay out its storage.

        Called by the constructor, or by the first [`update()`][emakit.ema.EMA.update] when
        ``lazy_init_ema=True``.
        """
        if not isinstance(self._source, ModuleSource):
            raise EMATypeError("init_ema() builds the EMA of a module; this EMA tracks a pytree")
        ema_model = self._source.build(self.model, ema_model)
        self._modules["ema_model"] = ema_model
        first = next((t for t in (*ema_model.parameters(), *ema_model.buffers())), None)
        self._home = self.device or (first.device if first is not None else None)
        for name in self.forward_method_names:  # FSDP2: registered, run on fresh shards
            setattr(self, name, ForwardMethod(ema_model, name, self._tracker.runner.wait))
        self._tracker.invalidate()

    def _tracked(self) -> Tracked:
        """The current pairs (see `_LivePairs`); creates a lazy EMA model first."""
        if self._tree is not None and isinstance(self._source, TreeSource):
            return self._source.pairs(*self._tree)
        if self._modules["ema_model"] is None:
            self.init_ema()
        ema_model: nn.Module = self._modules["ema_model"]  # type: ignore[assignment]
        assert isinstance(self._source, ModuleSource)
        return self._source.pairs(self.model, ema_model)

    def restore_ema_model_device(self) -> None:
        """Move the EMA model back to its own device (where it was built, or ``device=``)
        after ``move_ema_to_online_device`` moved it to the model's (ema-pytorch's method)."""
        ema_model = self._modules.get("ema_model")
        home = getattr(self, "_home", None)
        if ema_model is None or home is None or not isinstance(self._source, ModuleSource):
            return
        self._tracker.runner.wait()
        self._source.move_ema(self.model, ema_model, home)
        self._tracker.invalidate()

    def _apply(self, fn: Any, recurse: bool = True) -> nn.Module:
        # .to()/.cuda()/.half() replace storages: the plan is rebuilt on next use.
        self._tracker.invalidate()
        return super()._apply(fn, recurse)

    # -- counters and decay ----------------------------------------------------------------

    @property
    def step(self) -> Tensor:
        """``update()`` calls so far, as ema-pytorch's CPU int64 tensor: ``ema.step.item()``,
        ``int(ema.step)``; in-place writes (``ema.step += 1``, ``ema.step.copy_(t)``) take
        effect at the next call. ``.to()`` does not move it."""
        return self._tracker.step_tensor()

    @step.setter
    def step(self, value: Tensor | int) -> None:
        self._tracker.set_counters(step=check.count("step", value))

    @property
    def initted(self) -> Tensor:
        """Whether the first ``update()`` has copied the model into the EMA: a CPU bool
        tensor, writable in place as in ema-pytorch (``ema.initted.data.fill_(False)``
        makes the next call initialize again)."""
        return self._tracker.initted_tensor()

    @initted.setter
    def initted(self, value: Tensor | bool) -> None:
        if isinstance(value, Tensor):
            if value.numel() != 1 or value.is_floating_point():
                raise EMATypeError(
                    f"initted must be a bool or a 1-element bool tensor, got {value!r}"
                )
            value = bool(value)
        self._tracker.set_counters(initted=check.boolean("initted", value))

    @property
    def tracker(self) -> Tracker:
        """The internal bookkeeping (rule, plan, runner, counters, non-finite guard) that
        emakit's other EMA kinds share. **Unstable internals:** it may change in any
        release; the public API (``step``, ``swap()`` ...) is what stays compatible."""
        return self._tracker

    @property
    def is_frozen(self) -> bool:
        """Whether averaging calls leave the EMA unchanged (``beta == 1``)."""
        return self._tracker.rule.frozen

    @property
    def num_skipped_nonfinite(self) -> int:
        """Updates skipped because the weights held NaN or Inf (``skip_nonfinite=True``), the
        same on every rank; reading it reads the count back from the device."""
        return self._tracker.num_skipped_nonfinite

    def get_current_decay(self) -> float:
        """The decay the most recent update used (ema-pytorch's definition).

        .. math:: t = \\max(\\text{step} - \\text{update\\_after\\_step} - 1, 0),\\quad
           \\text{decay} = \\text{clamp}(1 - (1 + t / \\text{inv\\_gamma})^{-\\text{power}},
           \\text{min\\_value}, \\beta)

        and 0 while ``t == 0``. With ``schedule=`` set, ``schedule(t)`` replaces the formula.
        With ``decay_groups``, this is the default group's decay (see [`current_decays()`][emakit.ema.EMA.current_decays]).
        """
        return self._tracker.rule.decay(self._tracker.step)

    def current_decays(self) -> dict[str, float]:
        """The decay of every decay group at the current step: ``{"default": d, pattern: d}``."""
        t = self._tracker
        labels = ["default", *self._group_patterns]
        return {label: t.rule.decay(t.step, t.last, g) for g, label in enumerate(labels)}

    # -- the update ------------------------------------------------------------------------

    def update(self) -> None:
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
        """
        action = self._tracker.update()
        every = self.update_model_with_ema_every
        if every is None or action is INIT:
            return
        step = self._tracker.step - 1  # ema-pytorch's count before this call
        if step % every == 0 and step > self.update_after_step:
            self.update_model_with_ema()

    def copy_params_from_model_to_ema(self) -> None:
        """Copy every tracked tensor of the model into the EMA (ignored names untouched)."""
        self._tracker.runner.wait()
        self._tracker.plan().copy_to_shadow()

    def copy_params_from_ema_to_model(self) -> None:
        """Copy every tracked tensor of the EMA into the model (ignored names untouched)."""
        self._tracker.runner.wait()
        self._tracker.plan().copy_to_online()

    def update_model_with_ema(self, decay: float | None = None) -> None:
        """Pull the online model toward the EMA ("hare and tortoise", arXiv:2406.02596).

        .. math:: \\text{model} \\leftarrow b\\,\\text{model} + (1 - b)\\,\\text{ema}

        Args:
            decay: ``b``, the fraction of the model kept, in [0, 1]. Default None uses
                ``update_model_with_ema_beta``; 0 copies the EMA into the model.
        """
        b = (
            self.update_model_with_ema_beta
            if decay is None
            else check.real("decay", decay, low=0.0, high=1.0)
        )
        self._tracker.runner.wait()
        if b == 0.0:
            self._tracker.plan().copy_to_online()
        else:
            self._tracker.plan().lerp_online(1.0 - b)

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
            optimizer, self.update, self._tracker.runner, on_accelerator=on_accelerator
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

        Example:
            >>> net = torch.nn.Linear(2, 2)
            >>> ema = EMA(net, beta=0.9)
            >>> with ema.swap():
            ...     _ = net(torch.zeros(1, 2))  # runs on the EMA weights
        """
        return Swap(self._tracker, self.model, in_place=check.boolean("in_place", in_place))

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
        if self._tree is not None:
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
        ema_model = self._modules.get("ema_model")
        if ema_model is not None:
            ema_model.eval()
        self.training = False
        return self

    # -- state ---------------------------------------------------------------------------

    def _counters(self) -> dict[str, Any]:
        t = self._tracker
        t.sync_views()  # a client may have written ema.step / ema.initted in place
        skips = t.num_skipped_nonfinite if self.skip_nonfinite else None
        return {"step": t.step, "initted": t.initted, "num_skipped_nonfinite": skips}

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        self._tracker.runner.wait()
        if not keep_vars and isinstance(self._modules["ema_model"], ZeroPartitions):
            self._modules["ema_model"].agree(self._tracker)  # every rank at the same step
        super()._save_to_state_dict(destination, prefix, keep_vars)
        _CODEC.encode(self._counters(), destination, prefix)
        if self._tree is not None:
            TreeSource.save(self._tree[1], destination, prefix, keep_vars)

    def _load_counters(self, values: Mapping[str, Any]) -> None:
        t = self._tracker
        t.set_counters(step=values.get("step"), initted=values.get("initted"))
        t.num_skipped_nonfinite = values.get("num_skipped_nonfinite", t.num_skipped_nonfinite)

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
        self._tracker.runner.wait()
        online.note_left_out(self, state_dict, prefix)  # see online.keep_online_model
        if (
            self._modules.get("ema_model") is None
            and self._tree is None
            and any(k.startswith(prefix + "ema_model.") for k in state_dict)
        ):
            self.init_ema()  # a parent module loading us: the state brings the weights
        self._load_counters(_CODEC.decode(state_dict, prefix, local_metadata, missing_keys))
        self._source.before_load(state_dict, prefix + "ema_model.")  # copy-on-write
        before = len(unexpected_keys)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        if self._tree is not None:
            TreeSource.load(self._tree[1], state_dict, prefix, missing_keys, error_msgs)
        unexpected_keys[before:] = [
            k for k in unexpected_keys[before:] if not self.owns_state_key(k[len(prefix) :])
        ]

    def owns_state_key(self, key: str) -> bool:
        """Whether a state-dict key (relative to this EMA) is one it reads itself, or
        accepts and ignores, beyond its tensors (earlier layouts' keys, ema-pytorch's
        ``online_model.*``)."""
        if key in _CODEC.keys or (self._tree is not None and key.startswith("ema.")):
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
        with online.left_out(self, not check.boolean("include_online_model", include_online_model)):
            return super().state_dict(*args, **kwargs)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load a state written by [`state_dict()`][emakit.ema.EMA.state_dict] (or by ema-pytorch 0.8.3).

        Values are copied into the existing shadow tensors, so the shadow keeps its dtype
        (an fp32 shadow stays fp32 when loading an fp16 checkpoint). With ``strict=True``
        (default) any missing or unexpected key raises [`EMAStateError`][emakit.errors.EMAStateError]
        listing them.
        """
        if not isinstance(state_dict, Mapping):
            raise EMATypeError(
                f"state_dict must be a mapping of names to tensors, got {type(state_dict).__name__}"
            )
        if assign:
            raise EMAValueError(
                "assign=True is not supported: the EMA keeps its own shadow storage"
            )
        lazy = self._tree is None and self._modules.get("ema_model") is None
        if lazy and any(k.startswith("ema_model.") for k in state_dict):
            self.init_ema()  # lazy_init_ema: the state brings the weights
        if isinstance(zero := self._modules.get("ema_model"), ZeroPartitions):
            zero.refuse_other_world(state_dict, "ema_model.")  # partitions of another world
        # Refuse first, load after (a failed load changes nothing); no online_model.*: kept.
        mine = self.state_dict(keep_vars=True, include_online_model=online.has_online(state_dict))
        check_loadable(mine, state_dict, strict=strict, owned=self.owns_state_key)
        saved = self._tracker.snapshot()
        try:
            result = super().load_state_dict(state_dict, strict=strict)
        except Exception as e:
            self._tracker.restore(saved)
            if isinstance(e, RuntimeError) and not isinstance(e, EMAStateError):
                raise EMAStateError(f"{e}\nloading failed; the counters were restored") from e
            raise
        self._tracker.invalidate()
        return result

    def __getstate__(self) -> dict:
        self._tracker.runner.wait()
        return self.__dict__.copy()


class _LivePairs:
    """An EMA as its tracker's [`PairSource`][emakit._core.tracker.PairSource]."""

    def __init__(self, ema: EMA) -> None:
        self.ema = ema

    def tracked(self) -> Tracked:
        """The live pairs (see `EMA._tracked`)."""
        return self.ema._tracked()


# The keywords are documented next to their validation (_options.py); help(EMA) shows them.
EMA.__doc__ = (EMA.__doc__ or "").replace("\n    Example:", KEYWORDS_DOC + "    Example:", 1)

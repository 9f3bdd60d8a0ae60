"""timm's ``ModelEmaV3``, ``ModelEmaV2`` and the V1 ``ModelEma`` (``timm.utils.model_ema``,
timm 1.0), on emakit.

Change ``from timm.utils import ModelEmaV3`` (or ``ModelEmaV2``, ``ModelEma``) to ``from
emakit.compat.timm import ...``: the same signature, defaults, methods and attributes
(``.module`` for V2/V3, ``.ema`` for V1) and the same files, so
``timm.utils.get_state_dict``/``unwrap_model``, timm's ``CheckpointSaver``,
``timm.models.load_checkpoint(..., use_ema=True)``, ``train.py --resume`` and DeiT's
``main.py`` read and write the same checkpoints. timm is not imported.

timm's ``train.py`` builds its EMA inside ``timm.task.TrainingTask.setup_ema``, from the
name ``ModelEmaV3`` of the module ``timm.task.task``. The script binds no name ``timm``
(it imports ``from timm import ...``), so these three lines, after its imports, make it
build this class instead::

    import timm.task.task
    import emakit.compat.timm
    timm.task.task.ModelEmaV3 = emakit.compat.timm.ModelEmaV3
"""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Mapping
from typing import IO, Any

import torch
from torch import Tensor, nn

from .. import _validate as check
from ..decay import Action
from ..ema import EMA, unwrap_model
from ..errors import EMAStateError, EMAValueError, user_stacklevel
from ..foreign import read_training_checkpoint
from .averaged_module import AveragedModule

__all__ = ["ModelEma", "ModelEmaV2", "ModelEmaV3"]

#: The largest number of elements timm's stochastic rounding handles in one float32 batch.
_SR_CHUNK = 2**22


def _paired_values(ema: nn.Module, model: nn.Module) -> tuple[list[Tensor], list[Tensor]]:
    """The state-dict values of the EMA copy and of the model, paired by name (timm zips
    them in order; a model of another structure raises here instead)."""
    mine, theirs = ema.state_dict(keep_vars=True), model.state_dict(keep_vars=True)
    if list(mine) != list(theirs):
        missing = [k for k in mine if k not in theirs]
        extra = [k for k in theirs if k not in mine]
        raise EMAStateError(
            f"the model does not match the EMA copy: names missing from the model "
            f"{check.few(missing)}, names the EMA copy lacks {check.few(extra)} (or the order "
            f"differs); update() and set() take the model the EMA was built from"
        )
    return [v.detach() for v in mine.values()], [v.detach() for v in theirs.values()]


def _stochastic_round_lerp_(
    ema: list[Tensor],
    model: list[Tensor],
    weight: float,
    generator: torch.Generator,
    per_tensor: bool,
) -> None:
    """``ema = ema * (1 - weight) + model * weight`` for bfloat16 ``ema`` tensors, computed in
    float32 and rounded to bfloat16 stochastically: 16 random bits are added below the
    bfloat16 mantissa, then truncated, so a value rounds up with the probability of its
    discarded fraction. timm's draws, in the same order from the same generator: batches
    of whole tensors of at most 2**22 elements (one tensor per batch with ``per_tensor``)."""
    batches: list[list[int]] = []
    size = 0
    for i, t in enumerate(ema):
        if not batches or per_tensor or (size and size + t.numel() > _SR_CHUNK):
            batches.append([])
            size = 0
        batches[-1].append(i)
        size += t.numel()
    for batch in batches:
        x = torch.cat([ema[i].reshape(-1) for i in batch]).float()
        x.mul_(1.0 - weight).add_(torch.cat([model[i].reshape(-1) for i in batch]), alpha=weight)
        bits = x.view(torch.int32)
        noise = torch.randint(
            0, 1 << 16, bits.shape, dtype=torch.int32, device=bits.device, generator=generator
        )
        bits.add_(noise).bitwise_and_(-(1 << 16))  # now exactly a bfloat16 value
        parts = x.split([ema[i].numel() for i in batch])
        for i, part in zip(batch, parts, strict=True):
            ema[i].copy_(part.view(ema[i].shape))


class ModelEmaV3(AveragedModule):
    """timm's ``ModelEmaV3``: an EMA of a model's parameters and buffers (``.module``).

    Build it after moving the model to its device (and before wrapping it in DDP), call
    ``update(model, step=num_updates)`` after every optimizer step, evaluate ``.module``.

    .. math:: t = \\max(0, \\text{step} - \\text{update\\_after\\_step} - 1),\\quad
       d = \\begin{cases} \\text{decay} & \\text{step is None} \\\\
       0 & t = 0 \\\\
       \\max(\\min(1 - (1 + t/\\text{warmup\\_gamma})^{-\\text{warmup\\_power}},
       \\text{decay}), \\text{min\\_decay}) & \\text{use\\_warmup} \\\\
       \\text{decay} & \\text{otherwise} \\end{cases}

    and every floating tensor of the state dict becomes ``ema.lerp(model, 1 - d)``
    (``min_decay`` acts only with the warm-up); integer buffers are copied. The EMA starts
    as a copy of the model, so the first ``update(model)`` already averages. The numbers
    are timm's, bit for bit, after every update, in every mode: float32 and bfloat16
    models, ``dtype=`` (an EMA in another dtype than the model: timm's ``mul``/``add``
    with ``foreach=True``, a cast then ``lerp_`` without), bfloat16 EMA tensors with
    stochastic rounding (the same random draws from the same seeded generator),
    ``exclude_buffers``, ``device=``.

    Args:
        model: the model to average (DDP and ``torch.compile`` wrappers are unwrapped).
        decay: the decay, in [0, 1]. Default 0.9999.
        min_decay: the floor of the warm-up decay. Default 0.0.
        update_after_step: with ``step`` given, updates at ``step <= update_after_step + 1``
            copy the model. Default 0.
        use_warmup: ramp the decay up (formula above) when ``step`` is given. Default False.
        warmup_gamma: the warm-up's ``gamma``. Default 1.0.
        warmup_power: the warm-up's power. Default 2/3.
        device: keep the EMA on this device. Default None (the model's).
        dtype: keep the EMA's floating tensors in this dtype, e.g. ``torch.float32`` for a
            bfloat16 model. Default None (the model's).
        stochastic_rounding: update bfloat16 EMA tensors with stochastic rounding.
            Default True.
        stochastic_rounding_seed: the seed of the private generator used for it. Default 0.
        foreach: timm's multi-tensor arithmetic (it decides the rounding of a mixed-dtype
            update; off when ``device`` differs from the model's, as in timm). Default True.
        exclude_buffers: average parameters only; copy every buffer. Default False.
        skip_nonfinite: keyword-only, emakit's: skip an update whose model weights hold NaN
            or Inf (decided on the device; see `emakit.EMA`). Not with the float32-batched
            paths (bfloat16 stochastic rounding, or a mixed-dtype ``foreach`` update).
            Default False.

    Differences from timm, none in the numbers:

    * the update runs on emakit's engine: the tensors are paired by name once and updated
      as planned groups (one ``lerp_`` per group, no state-dict walk per call) and nothing
      reads a value back to the host. The two float32-batched modes (bfloat16 stochastic
      rounding, a mixed-dtype ``foreach`` update) run timm's arithmetic on the state
      dicts, as timm does;
    * ``update()``/``set()`` take the model the EMA was built from, or one with the same
      state-dict names (pairing again when it is another object); timm zips the values in
      order, so a model of another structure raises `EMAStateError` here instead of
      mixing up weights;
    * changing the EMA's dtypes after construction (``.module.to(torch.bfloat16)``) does
      not switch between the engine and the float32-batched modes: build a new one;
    * with ``skip_nonfinite`` (emakit's), updates on non-finite weights are skipped.

    Example:
        >>> net = torch.nn.Linear(4, 4)
        >>> ema = ModelEmaV3(net, decay=0.999)
        >>> ema.update(net, step=1)  # after optimizer.step()
        >>> sorted(ema.state_dict())
        ['module.bias', 'module.weight']
    """

    def __init__(
        self,
        model: nn.Module,
        decay: float = 0.9999,
        min_decay: float = 0.0,
        update_after_step: int = 0,
        use_warmup: bool = False,
        warmup_gamma: float = 1.0,
        warmup_power: float = 2 / 3,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        stochastic_rounding: bool = True,
        stochastic_rounding_seed: int = 0,
        foreach: bool = True,
        exclude_buffers: bool = False,
        *,
        skip_nonfinite: bool = False,
    ) -> None:
        super().__init__()
        model = unwrap_model(model)
        self.decay = check.real("decay", decay, low=0.0, high=1.0)
        self.min_decay = check.real("min_decay", min_decay, low=0.0, high=1.0)
        self.update_after_step = check.integer("update_after_step", update_after_step, low=0)
        self.use_warmup = check.boolean("use_warmup", use_warmup)
        self.warmup_gamma = check.real("warmup_gamma", warmup_gamma, low=0.0, low_open=True)
        self.warmup_power = check.real("warmup_power", warmup_power, low=0.0, low_open=True)
        self.device = device
        self.dtype = check.floating_dtype("dtype", dtype)
        self.stochastic_rounding = check.boolean("stochastic_rounding", stochastic_rounding)
        self.stochastic_rounding_seed = check.integer(
            "stochastic_rounding_seed", stochastic_rounding_seed, low=-(2**63)
        )
        self.foreach = check.boolean("foreach", foreach)
        self.exclude_buffers = check.boolean("exclude_buffers", exclude_buffers)
        self.skip_nonfinite = check.boolean("skip_nonfinite", skip_nonfinite)
        self.module = copy.deepcopy(model)
        self.module.eval()
        first = next(model.parameters(), None)
        if first is None:
            raise EMAValueError("model has no parameters: there is nothing to average")
        if device is not None and device != first.device:  # timm's test, a str included
            self.foreach = False
            self.module.to(device=device)
        if self.dtype is not None:
            self.module.to(dtype=self.dtype)
        shadow = next(self.module.parameters())
        self._sr_generator = torch.Generator(device=shadow.device)
        self._sr_generator.manual_seed(self.stochastic_rounding_seed)
        self._build(model)

    def _build(self, model: nn.Module) -> EMA:
        """Pair the EMA copy with ``model`` and choose how updates run."""
        ema_values, model_values = _paired_values(self.module, model)
        floating = [
            (e, m) for e, m in zip(ema_values, model_values, strict=True) if e.is_floating_point()
        ]
        bf16 = self.stochastic_rounding and any(e.dtype == torch.bfloat16 for e, _ in floating)
        mixed = self.foreach and any(e.dtype != m.dtype for e, m in floating)
        #: timm's float32-batched arithmetic, which the engine does not have
        self._batched = bf16 or mixed
        if self._batched and self.skip_nonfinite:
            raise EMAValueError(
                "skip_nonfinite=True runs on emakit's engine, which this EMA cannot use: its "
                "bfloat16 tensors take stochastic rounding, or its dtype differs from the "
                "model's with foreach=True; pass stochastic_rounding=False, or dtype= with "
                "foreach=False, or leave skip_nonfinite=False"
            )
        buffers = {n for n, b in model.named_buffers() if b.is_floating_point()}
        return self.attach_engine(
            model,
            0,  # initialized: the copy is the starting average
            allow_different_devices=self.device is not None,
            coerce_dtype=self.dtype is not None,
            param_or_buffer_names_no_ema=buffers if self.exclude_buffers else (),
            skip_nonfinite=self.skip_nonfinite,
        )

    def _engine_for(self, model: nn.Module) -> EMA:
        model, engine = unwrap_model(model), self._engine
        if engine is None or model is not engine.model:
            engine = self._build(model)
        return engine

    def get_decay(self, step: int | None = None) -> float:
        """The decay of an update at ``step`` (see the formula in the class docstring)."""
        if step is None:
            return self.decay
        t = max(0, step - self.update_after_step - 1)
        if t <= 0:
            return 0.0
        if not self.use_warmup:
            return self.decay
        decay = 1 - (1 + t / self.warmup_gamma) ** -self.warmup_power
        return max(min(decay, self.decay), self.min_decay)

    @torch.no_grad()
    def update(self, model: nn.Module, step: int | None = None) -> None:
        """Average ``model`` into the EMA with the decay of ``step`` (`get_decay()`)."""
        engine = self._engine_for(model)
        weight = 1.0 - self.get_decay(step)
        if self._batched:
            self._batched_update(engine.model, weight)
            return
        tracker = engine.tracker
        tracker.set_counters(step=tracker.step + 1)
        tracker.apply(Action("lerp", (weight,), tracker.step))

    def _batched_update(self, model: nn.Module, weight: float) -> None:
        """timm's arithmetic for bfloat16 stochastic rounding and mixed-dtype updates."""
        if self.exclude_buffers:
            ema_values = [p.detach() for p in self.module.parameters()]
            model_values = [p.detach() for p in model.parameters()]
            for b, mb in zip(self.module.buffers(), model.buffers(), strict=True):
                b.copy_(mb.to(device=self.device))
        else:
            ema_values, model_values = [], []
            for e, m in zip(*_paired_values(self.module, model), strict=True):
                if e.is_floating_point():
                    ema_values.append(e)
                    model_values.append(m)
                else:
                    e.copy_(m.to(device=self.device))
        gen = self._sr_generator
        if not self.foreach:
            for e, m in zip(ema_values, model_values, strict=True):
                m = m.to(device=self.device)
                if self.stochastic_rounding and e.dtype == torch.bfloat16:
                    _stochastic_round_lerp_([e], [m], weight, gen, per_tensor=True)
                else:
                    e.lerp_(m.to(dtype=e.dtype), weight)
            return
        if self.stochastic_rounding:
            sr = [i for i, e in enumerate(ema_values) if e.dtype == torch.bfloat16]
            if sr:
                _stochastic_round_lerp_(
                    [ema_values[i] for i in sr],
                    [model_values[i] for i in sr],
                    weight,
                    gen,
                    per_tensor=False,
                )
            rest = [i for i, e in enumerate(ema_values) if e.dtype != torch.bfloat16]
            ema_values = [ema_values[i] for i in rest]
            model_values = [model_values[i] for i in rest]
        if not ema_values:
            return
        if all(e.dtype == m.dtype for e, m in zip(ema_values, model_values, strict=True)):
            torch._foreach_lerp_(ema_values, model_values, weight)
        else:  # timm's mixed-dtype update: add_ promotes the model's values
            torch._foreach_mul_(ema_values, 1.0 - weight)
            torch._foreach_add_(ema_values, model_values, alpha=weight)

    @torch.no_grad()
    def set(self, model: nn.Module) -> None:
        """Copy every tensor of ``model`` into the EMA."""
        engine = self._engine_for(model)
        if self._batched:
            for e, m in zip(*_paired_values(self.module, engine.model), strict=True):
                e.copy_(m.to(device=self.device))
        else:
            engine.copy_params_from_model_to_ema()


def _averaging_copy(model: nn.Module, device: torch.device | str | None) -> nn.Module:
    """timm's EMA copy of ``model``: a deep copy in eval mode, moved to ``device`` unless
    that is None or ``''`` (the model's device)."""
    ema = copy.deepcopy(model)
    ema.eval()
    if device:
        ema.to(device=device)
    return ema


@torch.no_grad()
def _average_(
    ema: nn.Module, model: nn.Module, decay: float, device: torch.device | str | None
) -> None:
    """``e = decay * e + (1 - decay) * m`` for every state-dict value, paired by name, as
    timm's ``ModelEma`` and ``ModelEmaV2`` compute it: two products and a sum, each rounded
    in ``e``'s dtype, for every value, integer buffers included (the float result is
    truncated into them). ``m`` is moved to ``device`` first, unless that is None or ``''``.
    """
    ema_values, model_values = _paired_values(ema, model)
    if device:
        model_values = [m.to(device=device) for m in model_values]
    floats = [i for i, e in enumerate(ema_values) if e.is_floating_point()]
    others = [i for i, e in enumerate(ema_values) if not e.is_floating_point()]
    if floats:
        shadow = [ema_values[i] for i in floats]
        kept = torch._foreach_mul(shadow, decay)
        torch._foreach_add_(kept, torch._foreach_mul([model_values[i] for i in floats], 1 - decay))
        torch._foreach_copy_(shadow, kept)
    for i in others:
        ema_values[i].copy_(decay * ema_values[i] + (1.0 - decay) * model_values[i])


class ModelEmaV2(nn.Module):
    """timm's ``ModelEmaV2``: an EMA of every state-dict tensor of a model (``.module``).

    .. math:: e \\leftarrow \\text{decay} \\cdot e + (1 - \\text{decay}) \\cdot m

    computed as timm computes it (two products and a sum, each rounded), for every value
    of the state dict, integer buffers included (the result is truncated into them, as in
    timm), so the numbers are timm's bit for bit. The EMA starts as a copy of the model;
    there is no warm-up and no step. ``set(model)`` copies the model.

    Args:
        model: the model to average.
        decay: the decay, in [0, 1]. Default 0.9999.
        device: keep the EMA on this device. Default None (the model's); ``''`` means the
            model's too, as in the V1 `ModelEma` (timm's ``ModelEmaV2`` raises on ``''``).

    Differences from timm: the values are paired by name (a model of another structure
    raises `EMAStateError` instead of being zipped in order), the floating tensors are
    updated with multi-tensor (``foreach``) kernels, and ``device=''`` is accepted. The
    engine's ``lerp_`` would round differently from this formula, so ``ModelEmaV2`` keeps
    timm's arithmetic: for emakit's engine, use `ModelEmaV3`.

    Example:
        >>> net = torch.nn.Linear(4, 4)
        >>> ema = ModelEmaV2(net, decay=0.99)
        >>> ema.update(net)
        >>> sorted(ema.state_dict())
        ['module.bias', 'module.weight']
    """

    def __init__(
        self, model: nn.Module, decay: float = 0.9999, device: torch.device | str | None = None
    ) -> None:
        super().__init__()
        self.decay = check.real("decay", decay, low=0.0, high=1.0)
        self.module = _averaging_copy(unwrap_model(model), device)
        self.device = device

    def update(self, model: nn.Module) -> None:
        """``e = decay * e + (1 - decay) * m`` for every state-dict value."""
        _average_(self.module, unwrap_model(model), self.decay, self.device)

    @torch.no_grad()
    def set(self, model: nn.Module) -> None:
        """Copy every state-dict value of ``model`` into the EMA."""
        for e, m in zip(*_paired_values(self.module, unwrap_model(model)), strict=True):
            e.copy_(m.to(device=self.device) if self.device else m)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run ``.module``."""
        return self.module(*args, **kwargs)


class ModelEma:
    """timm's V1 ``ModelEma`` (deprecated in timm, used by DeiT and older timm scripts): an
    EMA of every state-dict tensor of a model, kept in ``.ema``.

    .. math:: e \\leftarrow e \\cdot \\text{decay} + (1 - \\text{decay}) \\cdot m

    for every value of the state dict, computed as timm computes it (integer buffers
    included, the result truncated into them), so the numbers are timm's bit for bit. The
    EMA starts as a deep copy of the model, in eval mode, its parameters with
    ``requires_grad=False``; the first ``update(model)`` already averages. Build it after
    moving the model to its device and before wrapping it in DDP; ``update(model)`` takes
    the DDP-wrapped model too (its ``.module`` is used when ``.ema`` has none).

    Args:
        model: the model to average (copied as given, a ``DataParallel`` wrapper
            included, as in timm: ``ema_has_module`` then says so).
        decay: the decay, in [0, 1]. Default 0.9999.
        device: keep the EMA on this device; ``''`` (default) keeps the model's.
        resume: a checkpoint to start from, read as `_load_checkpoint()` reads it.
            Default ``''`` (none).

    Attributes:
        ema: the averaged copy of the model.
        decay: the decay.
        device: the device given.
        ema_has_module: whether ``.ema`` has a ``.module`` (a wrapped model was given).

    Differences from timm:

    * a checkpoint that is the EMA model's own state dict, as DeiT's
      ``utils._load_checkpoint_for_ema(model_ema, checkpoint["model_ema"])`` passes it, is
      loaded; timm looks only for a ``state_dict_ema`` entry, so DeiT's ``--resume``
      restarts its EMA from the weights it was built with (facebookresearch/deit#173);
    * a checkpoint without an EMA in it gives a `UserWarning` (timm logs a warning) and
      keeps the EMA as it is, as timm does; ``module.`` prefixes are also stripped when
      ``.ema`` has no ``.module``; a file is read with ``weights_only=True``, with an
      ``argparse.Namespace`` accepted as data, as timm reads it;
    * the values are paired by name strictly (a model of another structure raises
      `EMAStateError` instead of a ``KeyError``, or of ignoring names the EMA lacks);
    * ``state_dict()``/``load_state_dict()`` are those of the EMA model (unwrapped), so
      ``timm.utils.get_state_dict(model_ema)`` gives what it gives for timm's class.

    Example:
        >>> net = torch.nn.Linear(4, 4)
        >>> ema = ModelEma(net, decay=0.99)
        >>> ema.update(net)  # after optimizer.step()
        >>> sorted(ema.state_dict())
        ['bias', 'weight']
    """

    def __init__(
        self,
        model: nn.Module,
        decay: float = 0.9999,
        device: torch.device | str = "",
        resume: str | os.PathLike[str] | IO[bytes] = "",
    ) -> None:
        self.decay = check.real("decay", decay, low=0.0, high=1.0)
        self.ema = _averaging_copy(model, device)
        self.device = device
        self.ema_has_module = hasattr(self.ema, "module")
        if resume:
            self._load_checkpoint(resume)
        for p in self.ema.parameters():
            p.requires_grad_(False)

    def _load_checkpoint(self, checkpoint: str | os.PathLike[str] | IO[bytes]) -> None:
        """Load the EMA weights from ``checkpoint``: a file name or a binary file object
        (DeiT passes an ``io.BytesIO`` holding the EMA model's state dict), read with
        ``weights_only=True``, an ``argparse.Namespace`` accepted as data.

        Its ``state_dict_ema`` entry (timm's ``CheckpointSaver``), or the checkpoint itself
        when it is a state dict (DeiT's), is loaded strictly, with a ``module.`` prefix
        added when ``.ema`` has a ``.module`` (as timm does) or stripped when it has none.
        Without either, a warning says so and the EMA is left as it is.

        Raises:
            EMAStateError: the file is unreadable or holds something else than tensors
                and plain containers, or the state dict is of another model.
        """
        if isinstance(checkpoint, (str, os.PathLike)):
            source = os.fspath(checkpoint)  # the whole path (a Path's .name is its last part)
        else:
            source = getattr(checkpoint, "name", None) or "checkpoint"  # an open file's name
        loaded = read_training_checkpoint(checkpoint, "checkpoint file")
        if not isinstance(loaded, Mapping):
            raise EMAStateError(
                f"{source} holds a {type(loaded).__name__}, not a checkpoint dict with a "
                f"'state_dict_ema' entry or a state dict of the EMA model"
            )
        state = loaded.get("state_dict_ema", loaded)
        if not isinstance(state, Mapping) or not all(
            isinstance(k, str) and isinstance(v, Tensor) for k, v in state.items()
        ):
            warnings.warn(
                f"{source} has no 'state_dict_ema' entry and is not a state dict (keys "
                f"{check.few([str(k) for k in loaded], 8)}): the EMA keeps the weights it "
                f"was built from (timm's ModelEma logs the same and goes on)",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
            return
        if self.ema_has_module:
            names = {k if k.startswith("module") else f"module.{k}": v for k, v in state.items()}
        elif state and all(k.startswith("module.") for k in state):
            names = {k[len("module.") :]: v for k, v in state.items()}
        else:
            names = dict(state)
        try:
            self.ema.load_state_dict(names)
        except RuntimeError as e:
            raise EMAStateError(f"{source} does not hold this model's EMA: {e}") from e

    def update(self, model: nn.Module) -> None:
        """``e = e * decay + (1 - decay) * m`` for every state-dict value of ``model`` (its
        ``.module`` when it is wrapped and ``.ema`` is not)."""
        inner = getattr(model, "module", None)
        if isinstance(inner, nn.Module) and not self.ema_has_module:
            model = inner
        _average_(self.ema, model, self.decay, self.device)

    def state_dict(self) -> dict[str, Any]:
        """The EMA model's state dict (unwrapped: the model's names), as
        ``timm.utils.get_state_dict`` returns it for timm's ``ModelEma``."""
        return unwrap_model(self.ema).state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> Any:
        """Load a `state_dict()` into the EMA model (torch's ``load_state_dict``)."""
        return unwrap_model(self.ema).load_state_dict(state_dict, strict=strict)

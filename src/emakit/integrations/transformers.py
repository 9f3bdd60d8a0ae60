"""Hugging Face Transformers integration: [`EMATrainerCallback`][emakit.integrations.transformers.EMATrainerCallback] for ``Trainer``.

Importing this module imports ``transformers``; ``import emakit`` does not.

Example:
    >>> from transformers import Trainer, TrainingArguments
    >>> from emakit.integrations.transformers import EMATrainerCallback
    >>> ema_cb = EMATrainerCallback(beta=0.999, update_every=1)
    >>> trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=val,
    ...                   callbacks=[ema_cb])  # doctest: +SKIP
    >>> trainer.train()  # doctest: +SKIP
    >>> with ema_cb.ema.swap():  # the raw model, on the EMA weights
    ...     trainer.evaluate()  # doctest: +SKIP
"""

from __future__ import annotations

import itertools
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .. import _validate as check
from .._core.swap import Swap
from .._files.reading import torch_load
from ..bema import BEMA
from ..checkpoint import load_ema_weights, save_checkpoint, save_ema_weights
from ..decay import bema_rule
from ..ema import EMA, unwrap_model
from ..errors import EMATypeError
from ._common import TRAINER_WEIGHTS_NAME, EMAKeywords, ema_keywords, ema_metrics, refuse_zero3

if TYPE_CHECKING:
    from typing_extensions import Unpack

_NEEDS = (
    "emakit.integrations.transformers needs Transformers: pip install transformers "
    "accelerate (emakit's transformers extra; in a clone of emakit: pip install -e "
    "'.[transformers]')"
)
try:
    import transformers
    from transformers.utils import is_torch_available
except ImportError as e:  # pragma: no cover - depends on what is installed
    raise ImportError(_NEEDS) from e
if not is_torch_available():  # Transformers turns its PyTorch part off on a torch it refuses
    raise ImportError(
        f"emakit.integrations.transformers needs Transformers' PyTorch part, which transformers "
        f"{transformers.__version__} turns off beside torch {torch.__version__} (Transformers 5 "
        "needs torch >= 2.6): pip install 'torch>=2.6'"
    )
try:
    from accelerate.utils import send_to_device
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
    from transformers.trainer_pt_utils import find_batch_size
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as e:  # pragma: no cover - depends on what is installed
    raise ImportError(_NEEDS) from e

__all__ = ["BEMA_STATE_NAME", "EMA_WEIGHTS_NAME", "BEMACallback", "EMATrainerCallback"]

#: File name of the EMA weights in every ``checkpoint-N`` folder (and in ``output_dir``).
EMA_WEIGHTS_NAME = TRAINER_WEIGHTS_NAME

#: File name of the BEMA state (``BEMA.state_dict()``) in every ``checkpoint-N`` folder.
BEMA_STATE_NAME = "bema_state.pt"


def _online_loss(model: nn.Module, batches: Any) -> float:
    """The mean of ``model(**batch).loss`` over ``batches``, weighted by batch size (the
    Trainer's ``eval_loss`` rule), in eval mode without grad; summed over every rank when
    ``torch.distributed`` is initialized."""
    device = next(model.parameters()).device
    total = torch.zeros(2, dtype=torch.float64, device=device)
    model.eval()
    with torch.no_grad():
        for batch in batches:
            out = model(**send_to_device(batch, device))
            loss = out["loss"] if isinstance(out, dict) or hasattr(out, "keys") else out[0]
            size = find_batch_size(batch)
            total += torch.stack([loss.detach().double() * size, loss.new_tensor(size).double()])
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(total)
    return float(total[0] / total[1])


def _resume_file(args: TrainingArguments, state: TrainerState, name: str) -> Path | None:
    """The file ``name`` in the checkpoint folder the Trainer resumed from, or None.

    The Trainer hands callbacks no checkpoint path: the folder ``train()`` resolved
    (``resume_from_checkpoint=True`` becomes the last checkpoint) is read from its training
    loop's frame; then ``args.resume_from_checkpoint``; then
    ``output_dir/checkpoint-<global_step>``.
    """
    frames = itertools.islice(traceback.walk_stack(sys._getframe(1)), 8)
    loop = next((f for f, _ in frames if f.f_code.co_name == "_inner_training_loop"), None)
    candidates = [
        None if loop is None else loop.f_locals.get("resume_from_checkpoint"),
        getattr(args, "resume_from_checkpoint", None),
        os.path.join(args.output_dir or "", f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"),
    ]
    for folder in candidates:
        if isinstance(folder, (str, os.PathLike)) and (Path(folder) / name).is_file():
            return Path(folder) / name
    return None


def _save_model(model: nn.Module, ema: EMA, folder: Path) -> None:
    """``model.save_pretrained(folder)``; for a model without it, the EMA weights as
    ``folder/model.safetensors``."""
    save_pretrained = getattr(model, "save_pretrained", None)
    if callable(save_pretrained):
        save_pretrained(folder)
    else:
        save_ema_weights(ema, folder / "model.safetensors")


class EMATrainerCallback(TrainerCallback):
    """Keep an EMA of the model trained by a Hugging Face ``Trainer``; evaluate on it.

    * **Creation:** at ``on_train_begin``, as ``EMA(model, **ema_kwargs)`` from the model
      the Trainer trains (after it loaded a ``resume_from_checkpoint``); ``callback.ema``
      is the [`EMA`][emakit.EMA].
    * **Updates:** one ``ema.update()`` per optimizer step (``on_step_end``, which the
      Trainer calls once per ``gradient_accumulation_steps`` micro-batches), so
      ``update_every``/``update_after_step`` count optimizer steps.
    * **Evaluation** (``eval_with_ema``): during training, the model's evaluation forwards
      (eval mode, no grad: every ``evaluate()`` the Trainer runs, one per eval dataset)
      run on the EMA weights, swapped in by reference ([`emakit.EMA.swap()`][emakit.EMA.swap]) at the
      first such forward and swapped out at ``on_evaluate``, before the Trainer saves a
      checkpoint; a training forward or the next step also swaps them out. Metrics such as
      ``eval_loss`` and ``metric_for_best_model`` are therefore the EMA model's. After
      ``train()`` returns, ``trainer.evaluate()`` uses the raw weights again; wrap it in
      ``with callback.ema.swap():`` for the EMA's.
    * **Checkpoints:** every ``checkpoint-N`` folder gets ``ema.safetensors`` (the EMA
      weights under the model's own names, a tied tensor once as in the model's own
      ``model.safetensors``, step and settings in the header, written atomically by
      [`emakit.checkpoint.save_ema_weights()`][emakit.checkpoint.save_ema_weights]). ``train(
      resume_from_checkpoint=...)`` restores it, so a resumed run ends with the same EMA.
      The Trainer does not tell callbacks which checkpoint it resumed from; the callback
      takes the folder ``train()`` resolved (a path, or the last checkpoint for ``True``),
      else ``args.resume_from_checkpoint``, else ``output_dir/checkpoint-<global_step>``,
      and warns if none holds the file. ``callback.restored_from`` names the file used.
      With ``load_best_model_at_end``, the best checkpoint's EMA is loaded at the end too.
    * **Final model** (``save_final_as_model``): at ``on_train_end`` the EMA weights are
      copied into the model (so a later ``trainer.save_model()``/``push_to_hub()`` ships
      them; the raw final weights stay in the last checkpoint) and the model is saved to
      ``args.output_dir`` (``save_pretrained`` for a ``PreTrainedModel``, else
      ``model.safetensors``).

    * **Online and EMA side by side** (``also_evaluate_online``): after each evaluation
      on the EMA weights, the callback runs the same evaluation data through the raw
      weights and records their mean loss (weighted by batch size, as the Trainer's is) as
      ``<prefix>_online_loss`` (``eval_online_loss``, ``eval_<set>_online_loss``): in the
      metrics ``evaluate()`` returns and as its own entry in ``state.log_history``. The
      Trainer has already logged the EMA's metrics by then, so reporters (TensorBoard,
      W&B) see only the EMA's; read the online loss from ``log_history``. Under several
      processes the loss is averaged over every rank's batches (one all-reduce).
    * **Logging** (``log_stats``): each time the Trainer logs (every ``logging_steps``),
      ``ema/decay``, ``ema/step``, ``ema/bias_weight`` for a BEMA and, with
      ``skip_nonfinite=True``, ``ema/num_skipped_nonfinite`` are added to that log entry:
      to ``state.log_history`` and to the logs the callbacks after this one receive. The
      reporting callbacks ``report_to`` creates (TensorBoard, W&B) come before the ones
      you pass, so for them put this one first:
      ``trainer.callback_handler.callbacks.insert(0, trainer.pop_callback(callback))``.

    Every process keeps an identical EMA under DDP; the process that saves checkpoints
    (``args.should_save``) writes the files; DeepSpeed ZeRO-1 and 2 keep whole weights on
    every process and work the same way. FSDP and DeepSpeed ZeRO-3 shard the weights and
    are refused (ZeRO-3 at ``on_train_begin``, naming the alternative: ``EMA(engine)`` in
    your own loop, see docs/distributed.md).

    Args:
        eval_with_ema: evaluate on the EMA weights during training. Default True.
        save_final_as_model: make the EMA weights the final model (see above). Default False.
        log_stats: keyword-only; add the EMA's decay, step and skip count to the Trainer's
            logs (see above). Default True.
        also_evaluate_online: keyword-only; with ``eval_with_ema``, also record the raw
            weights' evaluation loss (see above). Default False.
        **ema_kwargs: keywords for [`EMA`][emakit.EMA] (``beta``, ``update_every``,
            ``update_after_step``, ``ema_dtype``, ...; typed as
            [`EMAKeywords`][emakit.integrations.lightning.EMAKeywords], so IDEs complete
            them), checked now. Its defaults apply
            (``update_every=10``, ``update_after_step=100``), counted in optimizer steps.

    Raises:
        EMATypeError: a keyword is not one of [`EMA`][emakit.EMA]'s, or a flag is not a bool.

    Example:
        >>> cb = EMATrainerCallback(beta=0.999, update_every=1)
        >>> cb.ema is None  # created when training begins
        True
    """

    #: The file written into every ``checkpoint-N`` folder and read back on resume.
    state_file = EMA_WEIGHTS_NAME

    def __init__(
        self,
        eval_with_ema: bool = True,
        save_final_as_model: bool = False,
        *,
        log_stats: bool = True,
        also_evaluate_online: bool = False,
        **ema_kwargs: Unpack[EMAKeywords],
    ) -> None:
        self.eval_with_ema = check.boolean("eval_with_ema", eval_with_ema)
        self.also_evaluate_online = check.boolean("also_evaluate_online", also_evaluate_online)
        self._online_pass = False  # True while the raw weights are evaluated
        self.log_stats = check.boolean("log_stats", log_stats)
        self.save_final_as_model = check.boolean("save_final_as_model", save_final_as_model)
        # The Trainer saves the model: the EMA's files leave it out.
        self.ema_kwargs = ema_keywords("EMATrainerCallback", ema_kwargs)
        #: The `EMA`, created at ``on_train_begin`` (None before).
        self.ema: EMA | None = None
        #: The file the EMA was restored from at the last resume (None if none).
        self.restored_from: Path | None = None
        self._swap: Swap | None = None
        self._hook: Any = None

    # -- what the EMA kind decides (BEMACallback replaces these) ---------------------------

    def _build(self, model: nn.Module) -> EMA:
        """The EMA of ``model``."""
        return EMA(model, **self.ema_kwargs)

    def _load(self, ema: EMA, path: Path) -> None:
        """Restore ``ema`` from a checkpoint's `state_file`."""
        load_ema_weights(ema, path)

    def _save(self, ema: EMA, path: Path) -> None:
        """Write ``ema`` as a checkpoint's `state_file`: the weights, a tied tensor once (as
        the model's own ``model.safetensors`` stores it)."""
        save_ema_weights(ema, path, tied_once=True)

    # -- creation and resume ------------------------------------------------------------

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Create the EMA of ``model``; on a resumed run load the checkpoint's EMA."""
        owner, model = type(self).__name__, kwargs.get("model")
        if not isinstance(model, nn.Module):
            raise EMATypeError(f"{owner} needs the Trainer's model, got {type(model).__name__}")
        refuse_zero3(model, owner)
        self._stop()
        ema = self.ema = self._build(model)
        self.restored_from = None
        if state.global_step > 0:
            path = _resume_file(args, state, self.state_file)
            if path is None:
                warnings.warn(
                    f"resuming at step {state.global_step} but no {self.state_file} was found "
                    f"in the checkpoint; {owner} restarts its average from the loaded weights",
                    stacklevel=2,
                )
            else:
                self._load(ema, path)
                self.restored_from = path
        if self.eval_with_ema:
            self._hook = model.register_forward_pre_hook(self._before_forward)

    # -- updates --------------------------------------------------------------------------

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Update the EMA after the optimizer step."""
        self._leave_swap()
        if self.ema is not None:
            self.ema.update()

    def on_log(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Add the EMA's values to the entry the Trainer is logging (``logs``; ``log_stats``)."""
        logs = kwargs.get("logs")
        if not self.log_stats or self.ema is None or logs is None:
            return
        values = ema_metrics(self.ema, skips=True)
        logs.update(values)
        history = state.log_history
        if history and history[-1].get("step") == state.global_step:
            history[-1].update(values)  # the Trainer stored a copy of `logs` before this call

    # -- evaluation ---------------------------------------------------------------------

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        if module.training:
            self._leave_swap()  # a training forward never runs on the EMA weights
        elif (
            self._swap is None
            and not self._online_pass
            and not torch.is_grad_enabled()
            and self.ema is not None
        ):
            self._swap = self.ema.swap().enter()

    def _leave_swap(self, *args: Any, **kwargs: Any) -> None:
        """Put the raw weights back (a no-op unless the EMA's are swapped in); also the
        hooks ``on_step_begin`` (a step trains the raw weights), ``on_predict`` (a
        prediction run is over) and ``on_epoch_end`` (something evaluated outside the
        Trainer's loop)."""
        swap, self._swap = self._swap, None
        if swap is not None:
            swap.exit()

    on_step_begin = on_predict = on_epoch_end = _leave_swap

    def _stop(self) -> None:
        """Put the raw weights back and stop watching the model's forwards."""
        self._leave_swap()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Put the raw weights back once an evaluation is over (before any checkpoint);
        with ``also_evaluate_online``, evaluate the raw weights too."""
        self._leave_swap()
        metrics, model, data = (kwargs.get(k) for k in ("metrics", "model", "eval_dataloader"))
        wanted = self.also_evaluate_online and self.eval_with_ema and self.ema is not None
        if not wanted or metrics is None or not isinstance(model, nn.Module) or data is None:
            return
        prefixes = [k[: -len("_loss")] for k in metrics if k.endswith("_loss")]
        if len(prefixes) != 1:
            return  # no loss to pair with (a model that returns none)
        self._online_pass = True
        try:
            value = _online_loss(model, data)
        finally:
            self._online_pass = False
        entry = {f"{prefixes[0]}_online_loss": value}
        metrics.update(entry)
        state.log_history.append({**entry, "epoch": state.epoch, "step": state.global_step})

    # -- checkpoints ----------------------------------------------------------------------

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Write the EMA (`state_file`) into the checkpoint folder the Trainer just saved."""
        if self.ema is None or not args.should_save:
            return
        folder = Path(args.output_dir or "") / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if not folder.is_dir():
            warnings.warn(
                f"checkpoint folder {folder} not found (hyperparameter search runs save "
                f"elsewhere); {self.state_file} was not saved with this checkpoint",
                stacklevel=2,
            )
            return
        self._save(self.ema, folder / self.state_file)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Stop swapping; load the best checkpoint's EMA when the Trainer loaded the best
        model; with ``save_final_as_model``, make the EMA weights the model and save it."""
        self._stop()
        ema = self.ema
        if ema is None:
            return
        best = state.best_model_checkpoint
        if args.load_best_model_at_end and best and (Path(best) / EMA_WEIGHTS_NAME).is_file():
            load_ema_weights(ema, Path(best) / EMA_WEIGHTS_NAME)
        if self.save_final_as_model:
            ema.copy_params_from_ema_to_model()
            if args.should_save and (model := kwargs.get("model")) is not None:
                _save_model(model, ema, Path(args.output_dir or "."))


class BEMACallback(EMATrainerCallback):
    """A drop-in for ``trl.BEMACallback``: BEMA (arXiv:2508.00180) of the Trainer's model,
    with TRL's signature, defaults and numbers, written to ``output_dir/bema`` at the end.

    The BEMA is an [`emakit.BEMA`][emakit.BEMA] (``callback.bema``, also ``callback.ema``),
    created at ``on_train_begin`` and updated at every ``on_step_end`` with
    ``t = state.global_step``, exactly where TRL's callback acts. Beyond TRL's:

    * **Checkpoints:** every ``checkpoint-N`` folder gets ``bema_state.pt`` (the BEMA's
      ``state_dict()``: the evaluated weights, the EMA, ``theta0``, the step and the
      settings), and ``train(resume_from_checkpoint=...)`` restores it, so a resumed run
      ends with the BEMA of the uninterrupted one, bit for bit (TRL restarts from the
      resumed weights).
    * **PEFT and frozen weights:** only trainable tensors are averaged, the EMA model is a
      copy of the model itself (a ``PeftModel`` stays one, so ``bema/`` holds the adapters
      as ``save_pretrained`` writes them), and models with frozen parameters work (TRL's
      strict ``zip`` over trainable against all parameters fails on them).
    * **Evaluation** (``eval_with_bema=True``): the Trainer's evaluations during training
      run on the BEMA weights, as [`EMATrainerCallback`][emakit.integrations.transformers.EMATrainerCallback]
      does for an EMA.

    Args:
        update_freq: steps between BEMA updates. Default 400.
        ema_power: the EMA weight's exponent. Default 0.5.
        bias_power: the bias weight's exponent. Default 0.2.
        lag: the offset of both schedules. Default 10.
        update_after: the burn-in, in optimizer steps. Default 0.
        multiplier: the time scale. Default 1.0.
        min_ema_multiplier: the floor of the EMA weight. Default 0.0.
        device: where the BEMA tensors live. Default ``"cpu"`` (TRL's).
        eval_with_bema: keyword-only; evaluate on the BEMA weights during training.
            Default False (TRL evaluates the raw model).
        **bema_kwargs: keyword-only; other [`BEMA`][emakit.BEMA] keywords
            (``ema_dtype``, ``ignore_names``, ``async_update`` ...).

    Raises:
        EMAValueError, EMATypeError: a setting out of range (checked now, not at fit time).

    Example:
        >>> cb = BEMACallback(update_freq=100)
        >>> cb.bema is None  # created when training begins
        True
    """

    state_file = BEMA_STATE_NAME

    def __init__(
        self,
        update_freq: int = 400,
        ema_power: float = 0.5,
        bias_power: float = 0.2,
        lag: int = 10,
        update_after: int = 0,
        multiplier: float = 1.0,
        min_ema_multiplier: float = 0.0,
        device: str = "cpu",
        *,
        eval_with_bema: bool = False,
        **bema_kwargs: Any,
    ) -> None:
        super().__init__(eval_with_ema=eval_with_bema)
        self.settings: dict[str, Any] = {
            "update_freq": update_freq,
            "ema_power": ema_power,
            "bias_power": bias_power,
            "lag": lag,
            "update_after": update_after,
            "multiplier": multiplier,
            "min_ema_multiplier": min_ema_multiplier,
        }
        bema_rule(**self.settings)  # refuse bad settings now
        self.device = device
        self.bema_kwargs = bema_kwargs
        #: The evaluated weights of the run's last BEMA update, kept when steps follow it.
        self._final: dict[str, Any] | None = None

    @property
    def bema(self) -> BEMA | None:
        """The [`BEMA`][emakit.BEMA] (None before ``on_train_begin``)."""
        return self.ema  # type: ignore[return-value]

    def _build(self, model: nn.Module) -> EMA:
        """The BEMA of the unwrapped ``model``, with TRL's settings."""
        model = unwrap_model(getattr(model, "module", model))
        return BEMA(model, **self.settings, device=self.device, **self.bema_kwargs)

    def _load(self, ema: EMA, path: Path) -> None:
        """Restore the BEMA from a checkpoint's ``bema_state.pt``."""
        ema.load_state_dict(torch_load(path, "BEMA state"))

    def _save(self, ema: EMA, path: Path) -> None:
        """Write the BEMA's whole state (``state_dict()``) as ``bema_state.pt``, atomically."""
        save_checkpoint(ema.state_dict(), path)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Write the BEMA model to ``output_dir/bema`` (``save_pretrained``, as TRL does;
        ``model.safetensors`` for a model without it), from the main process."""
        self._stop()
        bema, final, self._final = self.ema, self._final, None
        if bema is not None and state.is_world_process_zero:
            model = bema.ema_model
            if final is not None:  # TRL's running_model: the last update's, not rebuilt
                model.load_state_dict(final)
            _save_model(model, bema, Path(args.output_dir or ".") / "bema")

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Update the BEMA. After the run's last BEMA update, when steps follow it, keep
        its evaluated weights for ``bema/``: TRL writes those (its ``running_model``), and
        a BEMA read later builds them from the weights of the last step."""
        super().on_step_end(args, state, control, **kwargs)
        bema, end = self.ema, state.max_steps
        if isinstance(bema, BEMA) and isinstance(end, int):
            t, every = int(bema.step), bema.rule.update_freq
            if bema.rule.last_update(t) == t and t < end < t + every:
                self._final = {
                    k: v.detach().clone() for k, v in bema.ema_model.state_dict().items()
                }

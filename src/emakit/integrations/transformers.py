"""Hugging Face Transformers integration: :class:`EMATrainerCallback` for ``Trainer``.

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

import os
import sys
import warnings
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch import nn

from .. import _validate as check
from .._core.swap import Swap
from ..checkpoint import load_ema_weights, save_ema_weights
from ..ema import EMA
from ..errors import EMATypeError
from ._common import check_ema_kwargs

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as e:  # pragma: no cover - depends on what is installed
    raise ImportError(
        "emakit.integrations.transformers needs Transformers: pip install "
        "'emakit[transformers]' (or pip install transformers accelerate)"
    ) from e

__all__ = ["EMA_WEIGHTS_NAME", "EMATrainerCallback"]

#: File name of the EMA weights in every ``checkpoint-N`` folder (and in ``output_dir``).
EMA_WEIGHTS_NAME = "ema.safetensors"


class EMATrainerCallback(TrainerCallback):
    """Keep an EMA of the model trained by a Hugging Face ``Trainer``; evaluate on it.

    * **Creation:** at ``on_train_begin``, as ``EMA(model, **ema_kwargs)`` from the model
      the Trainer trains (after it loaded a ``resume_from_checkpoint``); ``callback.ema``
      is the :class:`~emakit.EMA`.
    * **Updates:** one ``ema.update()`` per optimizer step (``on_step_end``, which the
      Trainer calls once per ``gradient_accumulation_steps`` micro-batches), so
      ``update_every``/``update_after_step`` count optimizer steps.
    * **Evaluation** (``eval_with_ema``): during training, the model's evaluation forwards
      (eval mode, no grad: every ``evaluate()`` the Trainer runs, one per eval dataset)
      run on the EMA weights, swapped in by reference (:meth:`emakit.EMA.swap`) at the
      first such forward and swapped out at ``on_evaluate``, before the Trainer saves a
      checkpoint; a training forward or the next step also swaps them out. Metrics such as
      ``eval_loss`` and ``metric_for_best_model`` are therefore the EMA model's. After
      ``train()`` returns, ``trainer.evaluate()`` uses the raw weights again; wrap it in
      ``with callback.ema.swap():`` for the EMA's.
    * **Checkpoints:** every ``checkpoint-N`` folder gets ``ema.safetensors`` (the EMA
      weights under the model's own names, step and settings in the header, written
      atomically by :func:`emakit.checkpoint.save_ema_weights`). ``train(
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

    Every process keeps an identical EMA under DDP; the process that saves checkpoints
    (``args.should_save``) writes the files. FSDP and DeepSpeed ZeRO-3 shard the weights
    and are not supported.

    Args:
        eval_with_ema: evaluate on the EMA weights during training. Default True.
        save_final_as_model: make the EMA weights the final model (see above). Default False.
        **ema_kwargs: keywords for :class:`~emakit.EMA` (``beta``, ``update_every``,
            ``update_after_step``, ``ema_dtype``, ...), checked now. Its defaults apply
            (``update_every=10``, ``update_after_step=100``), counted in optimizer steps.

    Raises:
        EMATypeError: a keyword is not one of :class:`~emakit.EMA`'s, or a flag is not a bool.

    Example:
        >>> cb = EMATrainerCallback(beta=0.999, update_every=1)
        >>> cb.ema is None  # created when training begins
        True
    """

    def __init__(
        self, eval_with_ema: bool = True, save_final_as_model: bool = False, **ema_kwargs: Any
    ) -> None:
        self.eval_with_ema = check.boolean("eval_with_ema", eval_with_ema)
        self.save_final_as_model = check.boolean("save_final_as_model", save_final_as_model)
        self.ema_kwargs = check_ema_kwargs("EMATrainerCallback", dict(ema_kwargs))
        #: The :class:`~emakit.EMA`, created at ``on_train_begin`` (None before).
        self.ema: EMA | None = None
        #: The file the EMA was restored from at the last resume (None if none).
        self.restored_from: Path | None = None
        self._swap: Swap | None = None
        self._hook: Any = None

    # -- creation and resume ------------------------------------------------------------

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        """Create the EMA of ``model``; on a resumed run load the checkpoint's EMA."""
        if not isinstance(model, nn.Module):
            raise EMATypeError(
                f"EMATrainerCallback needs the Trainer's model, got {type(model).__name__}"
            )
        self._leave_swap()
        # The Trainer saves the model; ema.safetensors holds only the EMA weights.
        self.ema = EMA(model, **{"include_online_model": False, **self.ema_kwargs})
        self.restored_from = None
        if state.global_step > 0:
            path = self._resume_file(args, state)
            if path is None:
                warnings.warn(
                    f"resuming at step {state.global_step} but no {EMA_WEIGHTS_NAME} was found "
                    f"in the checkpoint; the EMA restarts from the loaded weights",
                    stacklevel=2,
                )
            else:
                load_ema_weights(self.ema, path)
                self.restored_from = path
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.eval_with_ema:
            self._hook = model.register_forward_pre_hook(self._before_forward)

    @staticmethod
    def _resume_file(args: TrainingArguments, state: TrainerState) -> Path | None:
        candidates: list[Any] = []
        # The Trainer hands callbacks no checkpoint path: read the one train() resolved
        # (resume_from_checkpoint=True becomes the last checkpoint) from its training loop.
        frame: FrameType | None = sys._getframe(1)
        for _ in range(8):
            if frame is None:
                break
            if frame.f_code.co_name == "_inner_training_loop":
                candidates.append(frame.f_locals.get("resume_from_checkpoint"))
                break
            frame = frame.f_back
        candidates.append(getattr(args, "resume_from_checkpoint", None))
        candidates.append(
            os.path.join(args.output_dir or "", f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        )
        for folder in candidates:
            if isinstance(folder, (str, os.PathLike)):
                path = Path(folder) / EMA_WEIGHTS_NAME
                if path.is_file():
                    return path
        return None

    # -- updates --------------------------------------------------------------------------

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Make sure the step trains the raw weights."""
        self._leave_swap()

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Update the EMA after the optimizer step."""
        self._leave_swap()
        if self.ema is not None:
            self.ema.update()

    # -- evaluation ---------------------------------------------------------------------

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        if module.training:
            self._leave_swap()  # a training forward never runs on the EMA weights
        elif self._swap is None and not torch.is_grad_enabled() and self.ema is not None:
            self._swap = self.ema.swap().enter()

    def _leave_swap(self) -> None:
        swap, self._swap = self._swap, None
        if swap is not None:
            swap.exit()

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Put the raw weights back once an evaluation is over (before any checkpoint)."""
        self._leave_swap()

    def on_predict(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        metrics: Any = None,
        **kwargs: Any,
    ) -> None:
        """Put the raw weights back once a prediction run is over."""
        self._leave_swap()

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Put the raw weights back (a no-op unless something evaluated outside the Trainer's loop)."""
        self._leave_swap()

    # -- checkpoints ----------------------------------------------------------------------

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Write ``ema.safetensors`` into the checkpoint folder the Trainer just saved."""
        if self.ema is None or not args.should_save:
            return
        folder = Path(args.output_dir or "") / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if not folder.is_dir():
            warnings.warn(
                f"checkpoint folder {folder} not found (hyperparameter search runs save "
                f"elsewhere); the EMA was not saved with this checkpoint",
                stacklevel=2,
            )
            return
        save_ema_weights(self.ema, folder / EMA_WEIGHTS_NAME)

    def on_train_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        """Stop swapping; load the best checkpoint's EMA when the Trainer loaded the best
        model; with ``save_final_as_model``, make the EMA weights the model and save it."""
        self._leave_swap()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        ema = self.ema
        if ema is None:
            return
        best = state.best_model_checkpoint
        if args.load_best_model_at_end and best:
            path = Path(best) / EMA_WEIGHTS_NAME
            if path.is_file():
                load_ema_weights(ema, path)
        if not self.save_final_as_model:
            return
        ema.copy_params_from_ema_to_model()
        if not args.should_save or model is None:
            return
        out = Path(args.output_dir or ".")
        save_pretrained = getattr(model, "save_pretrained", None)
        if callable(save_pretrained):
            save_pretrained(out)
        else:
            save_ema_weights(ema, out / "model.safetensors")

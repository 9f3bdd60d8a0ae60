"""Lightning's ``EMAWeightAveraging`` callback, kept by emakit's engine: change one import.

.. code-block:: python

    from emakit.compat.lightning import EMAWeightAveraging
    # was: from lightning.pytorch.callbacks import EMAWeightAveraging

[`EMAWeightAveraging`][emakit.compat.lightning.EMAWeightAveraging] has the signature,
defaults, ``should_update()`` and end-of-fit behaviour of Lightning's (2.6), and reads and
writes its checkpoint entries (``state_dict`` holding the average, ``current_model_state``
the training weights, ``averaging_state`` the update count, and the callback state
``latest_update_step`` under the same ``state_key``), so a run resumes under either
callback. Importing this module imports Lightning (``lightning.pytorch``, or the standalone
``pytorch_lightning``); ``import emakit`` and ``import emakit.compat`` do not.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _validate as check
from .._core.swap import Swap
from ..ema import EMA
from ..errors import EMATypeError
from ..foreign import load_foreign_state
from ..schedules import constant

try:
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
except ImportError:  # pragma: no cover - depends on what is installed
    try:
        import pytorch_lightning as pl  # type: ignore[no-redef]
        from pytorch_lightning.utilities.rank_zero import (  # type: ignore[no-redef]
            rank_zero_info,
            rank_zero_warn,
        )
    except ImportError as e:
        raise ImportError(
            "emakit.compat.lightning needs Lightning: pip install lightning (emakit's "
            "lightning extra; in a clone of emakit: pip install -e '.[lightning]')"
        ) from e

__all__ = ["EMAWeightAveraging"]


class EMAWeightAveraging(pl.Callback):
    """Lightning's EMA callback with emakit underneath: the same arguments, the same
    updates, the same checkpoints.

    * **Updates:** after an optimizer step (``trainer.global_step`` advanced) when
      ``should_update(step_idx=global_step - 1)`` says so, and after a training epoch
      when ``should_update(epoch_idx=epoch)`` does; override ``should_update`` as in
      Lightning. The first update copies the module, every later one averages:

      .. math:: \\text{ema} \\leftarrow \\text{decay} \\cdot \\text{ema}
         + (1 - \\text{decay}) \\cdot \\text{weights}

    * **Validation** runs on the average (swapped in by reference, back afterwards, also
      when the loop raises). **After fit** the module holds the average, as in Lightning.
    * **Checkpoints**, as Lightning writes them: ``checkpoint["state_dict"]`` the average,
      ``checkpoint["current_model_state"]`` the training weights,
      ``checkpoint["averaging_state"] = {"n_averaged": tensor(updates)}``, and
      ``{"latest_update_step": ...}`` as the callback's state.

    Underneath, ``callback.ema`` is an [`EMA`][emakit.EMA] of the module (created when fit
    starts) with ``schedules.constant(decay)``, ``update_after_step=0`` and
    ``update_every=1``, updated with one fused ``lerp_`` per dtype and device.

    Differences from Lightning 2.6, each deliberate:

    * weights within float32 rounding of Lightning's (``decay * ema + (1 - decay) * w``
      against ``lerp_``, which rounds the last bit differently now and then);
    * integer buffers (BatchNorm's ``num_batches_tracked``) are copied from the module;
      Lightning averages them in float and truncates the result back into the integer;
    * ``device="cpu"`` for a GPU module keeps the average in pinned CPU memory and
      averages on a background thread (emakit's ``device=``), where Lightning copies
      every weight to the CPU and averages there in the training loop;
    * a checkpoint saved during validation holds the training weights in
      ``current_model_state`` and the average in ``state_dict``, as at any other time;
      Lightning 2.6's own callback writes the two swapped there.

    Args:
        device: where the average lives. Default None: the module's device.
        use_buffers: average the buffers too; False copies them from the module at
            each update. Default True.
        decay: the decay, in [0, 1]. Default 0.999.
        update_every_n_steps: update at step indices divisible by this (0 never).
            Default 1.
        update_starting_at_step: the first step index that updates. Default None (0).
        update_starting_at_epoch: from this epoch on, also update after every epoch.
            Default None (never).
        ema_dtype: keyword-only, emakit's; keep the average in at least this dtype, e.g.
            ``torch.float32`` for a bf16 module. Default None.
        skip_nonfinite: keyword-only, emakit's; skip an update whose weights hold NaN or
            Inf, decided on the device. Default False.
        **kwargs: Lightning passes these to ``AveragedModel`` (``avg_fn``,
            ``multi_avg_fn``); this callback keeps an EMA, so any keyword raises.

    Example:
        >>> cb = EMAWeightAveraging(decay=0.999)
        >>> cb.should_update(step_idx=0), cb.should_update(epoch_idx=0)
        (True, False)
    """

    def __init__(
        self,
        device: torch.device | str | int | None = None,
        use_buffers: bool = True,
        decay: float = 0.999,
        update_every_n_steps: int = 1,
        update_starting_at_step: int | None = None,
        update_starting_at_epoch: int | None = None,
        *,
        ema_dtype: torch.dtype | None = None,
        skip_nonfinite: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        if kwargs:
            raise EMATypeError(
                f"EMAWeightAveraging got {sorted(kwargs)}: Lightning passes these to "
                f"AveragedModel, and this callback keeps an EMA (its decay is decay=); "
                f"for another average use Lightning's WeightAveraging"
            )
        self._device = torch.device(device) if isinstance(device, (str, int)) else device
        self._use_buffers = check.boolean("use_buffers", use_buffers)
        self.decay = check.real("decay", decay, low=0.0, high=1.0)
        self.update_every_n_steps = check.integer(
            "update_every_n_steps", update_every_n_steps, low=0
        )
        self.update_starting_at_step = check.optional_integer(
            "update_starting_at_step", update_starting_at_step, low=0
        )
        self.update_starting_at_epoch = check.optional_integer(
            "update_starting_at_epoch", update_starting_at_epoch, low=0
        )
        self.ema_dtype = check.floating_dtype("ema_dtype", ema_dtype)
        self.skip_nonfinite = check.boolean("skip_nonfinite", skip_nonfinite)
        #: The [`EMA`][emakit.EMA] of the module, created when fit starts (None before).
        self.ema: EMA | None = None
        self._pending: dict[str, Any] | None = None  # a checkpoint's average, until fit starts
        self._swap: Swap | None = None
        # Lightning's bookkeeping: the global step and the epoch of the last update
        self._latest_update_step = 0
        self._latest_update_epoch = -1

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        """Whether to update after the step (zero-based ``step_idx``) or the epoch
        (``epoch_idx``) that just ended; Lightning's rule, to override as there."""
        if step_idx is not None:
            started = self.update_starting_at_step is None or (
                step_idx >= self.update_starting_at_step
            )
            every = self.update_every_n_steps
            if started and every > 0 and step_idx % every == 0:
                return True
        start_epoch = self.update_starting_at_epoch
        return epoch_idx is not None and start_epoch is not None and epoch_idx >= start_epoch

    # -- the average ---------------------------------------------------------------------

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Create the EMA of the module (on its final device), with a loaded average."""
        self._ensure_ema(pl_module)

    def _ensure_ema(self, pl_module: pl.LightningModule) -> EMA:
        """The EMA of ``pl_module`` (created if missing), with a pending average loaded."""
        ema = self.ema
        if ema is None or ema.model is not pl_module:
            buffers = () if self._use_buffers else {n for n, _ in pl_module.named_buffers()}
            ema = self.ema = EMA(
                pl_module,
                update_after_step=0,
                update_every=1,
                schedule=constant(self.decay),
                param_or_buffer_names_no_ema=buffers,
                include_online_model=False,
                device=self._device,
                ema_dtype=self.ema_dtype,
                skip_nonfinite=self.skip_nonfinite,
            )
        if self._pending is not None:
            pending, self._pending = self._pending, None
            load_foreign_state(ema, pending, format="lightning")
        return ema

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        """Update after an optimizer step that ``should_update`` accepts."""
        step = trainer.global_step
        if step > self._latest_update_step and self.should_update(step_idx=step - 1):
            self._update(pl_module)
            self._latest_update_step = step

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Update after an epoch that ``should_update`` accepts."""
        epoch = trainer.current_epoch
        if epoch > self._latest_update_epoch and self.should_update(epoch_idx=epoch):
            self._update(pl_module)
            self._latest_update_epoch = epoch

    def _update(self, pl_module: pl.LightningModule) -> None:
        self._ensure_ema(pl_module).update()  # created at on_fit_start: a lookup here

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Leave the average in the module, as Lightning does."""
        if self.ema is not None and self.ema.model is pl_module:
            self.ema.copy_params_from_ema_to_model()

    # -- validation on the average -------------------------------------------------------

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Swap the average into the module."""
        if self._swap is None and self.ema is not None and self.ema.model is pl_module:
            self._swap = self.ema.swap().enter()

    def on_validation_epoch_end(self, *args: Any, **kwargs: Any) -> None:
        """Put the training weights back (also ``on_exception``, when a loop raised)."""
        swap, self._swap = self._swap, None
        if swap is not None:
            swap.exit()

    on_exception = on_validation_epoch_end

    # -- checkpoints ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The callback's state, as Lightning's: ``{"latest_update_step": int}``."""
        return {"latest_update_step": self._latest_update_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Read what `state_dict()` (or Lightning's callback) saved."""
        self._latest_update_step = state_dict["latest_update_step"]

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Write Lightning's entries: the average as ``state_dict``, the training weights
        as ``current_model_state``, the update count in ``averaging_state``."""
        ema = self.ema
        if ema is None or ema.model is not pl_module:
            rank_zero_info(
                "EMAWeightAveraging has no average of this module outside fit: the "
                "checkpoint holds the module's weights and no averaging state"
            )
            return
        swap = self._swap
        if swap is not None:  # saved during validation: the module holds the average
            self.on_validation_epoch_end()
            checkpoint["state_dict"] = trainer.strategy.lightning_module_state_dict()
        try:
            checkpoint["current_model_state"] = checkpoint["state_dict"]
            checkpoint["state_dict"] = ema.ema_model.state_dict()
            step = torch.tensor(int(ema.step), dtype=torch.long)
            checkpoint["averaging_state"] = {"n_averaged": step}
        finally:
            if swap is not None:
                self.on_validation_epoch_start(trainer, pl_module)

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Read Lightning's entries: the training weights back into the module, the
        average into the EMA (when fit starts, if it has not yet)."""
        if trainer.state.fn != "fit":
            rank_zero_warn(
                "EMAWeightAveraging keeps an average only during fit: the checkpoint's "
                "state_dict (the average, if it was written with weight averaging) is what "
                "the module holds now"
            )
        elif "current_model_state" in checkpoint and "averaging_state" in checkpoint:
            pl_module.load_state_dict(checkpoint["current_model_state"])
            self._pending = {
                "state_dict": checkpoint["state_dict"],
                "averaging_state": checkpoint["averaging_state"],
            }
            if self.ema is not None and self.ema.model is pl_module:
                self._ensure_ema(pl_module)
        else:
            rank_zero_warn(
                "the checkpoint was not written with weight averaging: the average starts "
                "from its state_dict, as the module does"
            )
            if self.ema is not None and self.ema.model is pl_module:  # the module has it
                self.ema.copy_params_from_model_to_ema()

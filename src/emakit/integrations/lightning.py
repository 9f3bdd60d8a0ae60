"""Lightning integration: [`EMACallback`][emakit.integrations.lightning.EMACallback] keeps an [`EMA`][emakit.EMA] of the
``LightningModule`` during ``Trainer.fit`` and evaluates on it.

Importing this module imports Lightning (``lightning.pytorch``, or the standalone
``pytorch_lightning`` package when only that is installed); ``import emakit`` does not.

Example:
    >>> import lightning.pytorch as pl
    >>> from emakit.integrations.lightning import EMACallback
    >>> ema_cb = EMACallback(beta=0.999, update_after_step=100, update_every=1)
    >>> trainer = pl.Trainer(callbacks=[ema_cb], max_epochs=10)  # doctest: +SKIP
    >>> trainer.fit(module, datamodule)  # doctest: +SKIP
    >>> ema_cb.ema.ema_model  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .. import _validate as check
from .._core.swap import Swap
from .._dist.dtensor import is_dtensor
from ..ema import EMA
from ..errors import EMARuntimeError, EMAStateError, EMATypeError
from ._common import LIGHTNING_CHECKPOINT_KEY, EMAKeywords, ema_keywords, ema_metrics

if TYPE_CHECKING:
    from typing_extensions import Unpack

try:
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn
except ImportError:  # pragma: no cover - depends on what is installed
    try:
        import pytorch_lightning as pl  # type: ignore[no-redef]
        from pytorch_lightning.utilities.rank_zero import rank_zero_warn  # type: ignore[no-redef]
    except ImportError as e:
        raise ImportError(
            "emakit.integrations.lightning needs Lightning: pip install lightning (emakit's "
            "lightning extra; in a clone of emakit: pip install -e '.[lightning]')"
        ) from e

__all__ = [
    "CHECKPOINT_KEY",
    "CHECKPOINT_VERSION",
    "ONLINE_STATE_DICT_KEY",
    "ONLINE_SUFFIX",
    "SHARDED_CHECKPOINT_VERSION",
    "SHARDED_STATE_PREFIX",
    "EMACallback",
    "EMAKeywords",
]

#: Appended to the name of every metric the raw weights' validation logs
#: (``also_validate_online=True``): ``val_loss`` is the EMA's, ``val_loss_online`` the raw's.
ONLINE_SUFFIX = "_online"

#: Top-level checkpoint key holding the EMA (see `EMACallback.on_save_checkpoint()`).
CHECKPOINT_KEY = LIGHTNING_CHECKPOINT_KEY
#: Version of the layout stored under `CHECKPOINT_KEY`.
CHECKPOINT_VERSION = 1
#: Version of the layout for an FSDP2 EMA in a distributed (DCP) checkpoint.
SHARDED_CHECKPOINT_VERSION = 2
#: Prefix of the EMA's shards in the checkpoint's ``state_dict`` (distributed checkpoints).
SHARDED_STATE_PREFIX = "emakit_ema."
#: Where the raw (training) weights go when ``save_ema_weights_as_state_dict=True``.
ONLINE_STATE_DICT_KEY = "emakit_online_state_dict"

# Strategies whose parameters emakit cannot track: FSDP1 flattens them into FlatParameters
# (names and shapes no longer the module's), DeepSpeed partitions them behind its engine.
# ModelParallelStrategy (FSDP2/DTensor through configure_model) is supported.
_REFUSED_STRATEGIES = {
    "FSDPStrategy": "it flattens the parameters (FSDP1), so each rank would average a "
    "fragment under names that do not match the module; use ModelParallelStrategy with "
    "fully_shard in configure_model (FSDP2), or strategy='ddp'",
    "DeepSpeedStrategy": "Lightning runs DeepSpeed on CUDA GPUs only, where emakit's "
    "callback is not tested with it; use ModelParallelStrategy with fully_shard in "
    "configure_model (FSDP2), or strategy='ddp', or DeepSpeed outside Lightning: "
    "ema = emakit.EMA(engine) in the training loop (ZeRO-1, 2 and 3, docs/distributed.md)",
}


class EMACallback(pl.Callback):
    """Keep an EMA of the ``LightningModule``'s weights; validate and test on it.

    * **Creation:** at ``on_fit_start`` (after the strategy has moved the module to its
      device and wrapped it), as ``EMA(pl_module, **ema_kwargs)``; ``callback.ema`` is the
      [`EMA`][emakit.EMA] and ``callback.ema.ema_model`` a copy of the module.
    * **Updates:** one ``ema.update()`` per *optimizer* step: ``on_train_batch_end``
      updates only when ``trainer.global_step`` has advanced, so
      ``accumulate_grad_batches=k`` gives one update per ``k`` batches. ``update_every`` and
      ``update_after_step`` therefore count optimizer steps.
    * **Evaluation:** validation (including the sanity check) and test run inside
      [`emakit.EMA.swap()`][emakit.EMA.swap]: the module holds the EMA weights, by reference, no copy.
      The raw weights are back after ``on_validation_end``/``on_test_end`` and also when
      the loop raises (``on_exception``). Standalone ``trainer.validate``/``test`` use the
      EMA when the callback holds one for that module, or when ``ckpt_path`` names a
      checkpoint with an EMA.
    * **Checkpoints:** the EMA state is saved under ``checkpoint["emakit_ema"]`` and
      restored by ``trainer.fit(ckpt_path=...)``; a resumed fit ends with the same EMA,
      bit for bit, as an uninterrupted one. With ``save_ema_weights_as_state_dict=True``
      the checkpoint's ``state_dict`` holds the EMA weights instead (so
      ``Module.load_from_checkpoint`` gives the EMA model for inference) and the raw
      weights go to ``checkpoint["emakit_online_state_dict"]``, from where a resumed fit
      takes them back.

    Checkpoint layout (version 1)::

        checkpoint["emakit_ema"] = {
            "version": 1,
            "ema": ema.state_dict(include_online_model=False),  # see emakit.EMA.state_dict
        }

    Strategies: single device, DDP and DDP-spawn (every rank keeps an identical EMA; rank
    0 writes the checkpoint; with DDP-spawn the EMA lives in the worker processes, so read
    it from the checkpoint), and ``ModelParallelStrategy`` (FSDP2 or tensor parallelism
    applied in ``configure_model``): each rank keeps the EMA of its own shards, updated
    with no communication. With its default distributed checkpoints the EMA's shards are
    written with the model's, under ``checkpoint["state_dict"]["emakit_ema.<key>"]``
    (layout version 2; the counters stay under ``checkpoint["emakit_ema"]``), and loaded
    back from that folder on resume; with ``save_distributed_checkpoint=False`` the full
    EMA is gathered into the single file (layout version 1). ``FSDPStrategy`` (FSDP1) and
    ``DeepSpeedStrategy`` are refused at ``setup``. Use one ``EMACallback`` per ``Trainer``.

    * **Coming from Lightning's ``EMAWeightAveraging``:** the defaults differ. This
      callback has [`EMA`][emakit.EMA]'s: the inverse-gamma warm-up to ``beta=0.9999``,
      ``update_every=10``, ``update_after_step=100`` (copies until then), the module left
      with its *training* weights after fit, and the EMA under
      ``checkpoint["emakit_ema"]``. ``EMAWeightAveraging`` averages at every step from the
      first with a constant ``decay=0.999``, leaves the *average* in the module after fit,
      and writes ``averaging_state``/``current_model_state``. For the same behaviour pass
      ``beta=0.999, update_every=1, update_after_step=0,
      schedule=emakit.schedules.constant(0.999)``, or use the drop-in
      [`emakit.compat.lightning.EMAWeightAveraging`][emakit.compat.lightning.EMAWeightAveraging]
      (Lightning's signature, checkpoints both ways).
    * **Logging** (``log_stats``), through the module's own ``self.log``, so every Lightning
      logger (CSV, TensorBoard, W&B) gets them: ``ema/decay`` and ``ema/step`` after
      every optimizer step (plain Python numbers, no device read), ``ema/bias_weight`` for
      a BEMA, and with ``skip_nonfinite=True`` ``ema/num_skipped_nonfinite`` once per
      training epoch (reading the count waits for the device once). With
      ``also_validate_online=True`` every validation batch also runs on the raw weights,
      whose metrics are logged under the same names plus ``"_online"`` (``val_loss`` is the
      EMA's, ``val_loss_online`` the raw model's), so both curves sit side by side; it
      doubles the validation time.

    Args:
        validate_with_ema: run validation on the EMA weights. Default True.
        test_with_ema: run test on the EMA weights. Default True.
        save_ema_weights_as_state_dict: write the EMA weights as the checkpoint's
            ``state_dict`` (inference export). Default False.
        log_stats: keyword-only; log the decay, step and skip count (see above).
            Default True.
        also_validate_online: keyword-only; with ``validate_with_ema``, validate the raw
            weights too, their metrics suffixed ``"_online"``. Default False.
        ema_class: keyword-only; the EMA kind to keep, e.g. [`BEMA`][emakit.BEMA] (then
            ``ema_kwargs`` are its keywords: ``update_freq``, ``lag`` ...). Default
            [`EMA`][emakit.EMA].
        **ema_kwargs: keywords for [`EMA`][emakit.EMA] (``beta``, ``update_after_step``,
            ``update_every``, ``ema_dtype``, ...) or for ``ema_class``; typed as
            [`EMAKeywords`][emakit.integrations.lightning.EMAKeywords], so IDEs complete
            them; checked now. Its defaults apply (``update_every=10``,
            ``update_after_step=100``), counted in optimizer steps.

    Raises:
        EMATypeError: a keyword is not one of [`EMA`][emakit.EMA]'s, or a flag is not a bool.

    Example:
        >>> cb = EMACallback(beta=0.999, update_every=1)
        >>> cb.ema is None  # created when fit starts
        True
    """

    def __init__(
        self,
        validate_with_ema: bool = True,
        test_with_ema: bool = True,
        save_ema_weights_as_state_dict: bool = False,
        *,
        log_stats: bool = True,
        also_validate_online: bool = False,
        ema_class: type[EMA] = EMA,
        **ema_kwargs: Unpack[EMAKeywords],
    ) -> None:
        super().__init__()
        self.log_stats = check.boolean("log_stats", log_stats)
        self.also_validate_online = check.boolean("also_validate_online", also_validate_online)
        # The checkpoint holds the module already: the EMA's state leaves it out.
        self.ema_kwargs = ema_keywords("EMACallback", ema_kwargs, ema_class)
        self.ema_class = ema_class
        self.validate_with_ema = check.boolean("validate_with_ema", validate_with_ema)
        self.test_with_ema = check.boolean("test_with_ema", test_with_ema)
        self.save_ema_weights_as_state_dict = check.boolean(
            "save_ema_weights_as_state_dict", save_ema_weights_as_state_dict
        )
        #: The `EMA`, created when fit starts (None before).
        self.ema: EMA | None = None
        self._pending: Mapping[str, Any] | None = None
        self._last_global_step = 0
        self._swap: Swap | None = None

    # -- creation -----------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Refuse sharded strategies and a second ``EMACallback`` before any work is done."""
        name = type(trainer.strategy).__name__
        for cls in type(trainer.strategy).__mro__:
            reason = _REFUSED_STRATEGIES.get(cls.__name__)
            if reason is not None:
                raise EMATypeError(f"EMACallback does not support the {name} strategy: {reason}")
        callbacks = getattr(trainer, "callbacks", ())
        if any(isinstance(cb, EMACallback) and cb is not self for cb in callbacks):
            raise EMATypeError(
                "use one EMACallback per Trainer: both would save under checkpoint['emakit_ema']"
            )

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Create the EMA of ``pl_module`` (on its final device) and apply a loaded state."""
        self._ensure_ema(pl_module)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Remember the optimizer step count the loop starts from (restored on resume)."""
        self._ensure_ema(pl_module)
        self._last_global_step = trainer.global_step

    def _ensure_ema(self, pl_module: pl.LightningModule) -> EMA:
        """The EMA of ``pl_module`` (created if missing), with a pending loaded state applied."""
        ema = self.ema
        if ema is None or ema.model is not pl_module:
            ema = self.ema = self.ema_class(pl_module, **self.ema_kwargs)
        if self._pending is not None:
            state, self._pending = self._pending, None
            self._load_into(ema, _distribute_like(state, ema.state_dict(keep_vars=True)))
        return ema

    def _load_into(self, ema: EMA, values: Mapping[str, Any]) -> None:
        """``ema.load_state_dict(values)``, a mismatch named as the checkpoint's."""
        try:
            ema.load_state_dict(values)
        except EMAStateError as e:
            raise EMAStateError(
                f"the checkpoint's EMA does not fit this module and EMACallback keywords "
                f"({self.ema_kwargs}): {e}"
            ) from e

    # -- updates --------------------------------------------------------------------------

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        """Update the EMA when this batch ended with an optimizer step."""
        step = trainer.global_step
        if step > self._last_global_step:
            self._last_global_step = step
            ema = self._ensure_ema(pl_module)  # created at on_fit_start: a lookup here
            ema.update()
            if self.log_stats:
                pl_module.log_dict(ema_metrics(ema), on_step=True, on_epoch=False)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Log the skip count (``log_stats`` with ``skip_nonfinite=True``)."""
        ema = self.ema
        if self.log_stats and ema is not None and ema.skip_nonfinite:
            count = float(ema.num_skipped_nonfinite)  # waits for the device: once per epoch
            pl_module.log("ema/num_skipped_nonfinite", count, on_step=False, on_epoch=True)

    # -- evaluation ---------------------------------------------------------------------

    def _enter_swap(self, pl_module: pl.LightningModule) -> None:
        """Swap the EMA weights into ``pl_module`` (when the callback holds its EMA)."""
        if self._swap is not None:
            return
        if self._pending is not None:
            self._ensure_ema(pl_module)
        if self.ema is not None and self.ema.model is pl_module:
            self._swap = self.ema.swap().enter()
        else:
            rank_zero_warn(  # once per process: Python shows a warning once per place
                "EMACallback has no EMA of this module (it is created by trainer.fit, or "
                "loaded from a checkpoint passed as ckpt_path=); evaluating the raw weights"
            )

    def _leave_swap(self, *args: Any, **kwargs: Any) -> None:
        """Put the raw weights back (a no-op unless the EMA's are swapped in); also the
        hooks ``on_validation_end``, ``on_test_end``, ``on_exception`` (a loop raised
        inside the swap) and ``teardown``."""
        swap, self._swap = self._swap, None
        if swap is not None:
            swap.exit()

    on_validation_end = on_test_end = on_exception = teardown = _leave_swap

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Swap the EMA weights into the module (``validate_with_ema``)."""
        if self.validate_with_ema:
            self._enter_swap(pl_module)

    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        """With ``also_validate_online``: run the batch again on the raw weights, logging
        each metric under its name plus ``"_online"``."""
        if not self.also_validate_online or self._swap is None:
            return
        args = (
            (batch, batch_idx)
            if trainer.num_val_batches is None or len(trainer.num_val_batches) <= 1
            else (batch, batch_idx, dataloader_idx)
        )
        self._leave_swap()
        try:
            with _renamed_logs(pl_module, ONLINE_SUFFIX), torch.no_grad():
                pl_module.validation_step(*args)
        finally:
            self._enter_swap(pl_module)

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Swap the EMA weights into the module (``test_with_ema``)."""
        if self.test_with_ema:
            self._enter_swap(pl_module)

    # -- checkpoints ----------------------------------------------------------------------

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Store the EMA under ``checkpoint["emakit_ema"]``; optionally export its weights
        as ``checkpoint["state_dict"]``.

        A checkpoint written during validation (module swapped) still gets the raw weights
        as its training state.
        """
        ema = self.ema
        if ema is None or ema.model is not pl_module:
            return
        if self._swap is not None:
            # state_dict was gathered while the module held the EMA weights.
            self._leave_swap()
            try:
                checkpoint["state_dict"] = trainer.strategy.lightning_module_state_dict()
            finally:
                self._enter_swap(pl_module)
        state = ema.state_dict(include_online_model=False)
        sharded = _sharded_keys(state)
        weights = checkpoint.get("state_dict", {})
        distributed = bool(sharded) and any(is_dtensor(v) for v in weights.values())
        if self.save_ema_weights_as_state_dict:
            if distributed:
                raise EMARuntimeError(
                    "save_ema_weights_as_state_dict=True needs a single-file checkpoint for "
                    "a sharded model: use ModelParallelStrategy(save_distributed_checkpoint="
                    "False), or export the EMA with emakit.distributed.save_full_ema_weights"
                )
            checkpoint[ONLINE_STATE_DICT_KEY] = checkpoint["state_dict"]
            with ema.swap() if self._swap is None else contextlib.nullcontext():
                checkpoint["state_dict"] = trainer.strategy.lightning_module_state_dict()
        if distributed:
            # The strategy writes state_dict with DCP, shard by shard, and pickles the rest
            # on rank 0 alone: the EMA's shards go into state_dict, its counters here.
            for key in sharded:
                checkpoint["state_dict"][SHARDED_STATE_PREFIX + key] = state.pop(key)
            checkpoint[CHECKPOINT_KEY] = {
                "version": SHARDED_CHECKPOINT_VERSION,
                "ema": state,
                "shards_in_state_dict": SHARDED_STATE_PREFIX,
            }
            return
        if sharded:
            state = _gather_full(ema, state)  # one file, written by rank 0: the full EMA
        checkpoint[CHECKPOINT_KEY] = {"version": CHECKPOINT_VERSION, "ema": state}

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Take the EMA state from the checkpoint; put the raw weights back into the module
        when the checkpoint's ``state_dict`` holds the EMA weights.

        Lightning calls this before the EMA exists (``on_fit_start``) for most strategies:
        the state is kept and applied when the EMA is created.
        """
        if ONLINE_STATE_DICT_KEY in checkpoint:
            online = checkpoint[ONLINE_STATE_DICT_KEY]
            trainer.strategy.load_model_state_dict(
                {"state_dict": online}, strict=getattr(pl_module, "strict_loading", True)
            )
            checkpoint["state_dict"] = online
        entry = checkpoint.get(CHECKPOINT_KEY)
        if entry is None:
            rank_zero_warn(
                "the checkpoint holds no EMA (it was not written with EMACallback); the EMA "
                "starts from the loaded weights"
            )
            return
        if not isinstance(entry, Mapping) or "ema" not in entry:
            raise EMAStateError(
                f"checkpoint[{CHECKPOINT_KEY!r}] should be a mapping with an 'ema' entry, got "
                f"{type(entry).__name__} with keys {sorted(entry) if isinstance(entry, Mapping) else []}"
            )
        version = int(entry.get("version", CHECKPOINT_VERSION))
        if version > SHARDED_CHECKPOINT_VERSION:
            raise EMAStateError(
                f"checkpoint[{CHECKPOINT_KEY!r}] has version={version}, newer than this "
                f"emakit's {SHARDED_CHECKPOINT_VERSION}; upgrade emakit to load it"
            )
        if self._swap is not None:
            raise EMARuntimeError("cannot load an EMA checkpoint during evaluation")
        if version == SHARDED_CHECKPOINT_VERSION:
            self._load_shards(trainer, pl_module, entry)
            return
        self._pending = entry["ema"]
        if self.ema is not None and self.ema.model is pl_module:
            self._ensure_ema(pl_module)

    def _load_shards(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, entry: Mapping[str, Any]
    ) -> None:
        """Load an FSDP2 EMA from a distributed checkpoint (layout version 2): the shards
        from the checkpoint folder with DCP, the counters from ``entry``."""
        import torch.distributed.checkpoint as dcp

        path = getattr(trainer, "ckpt_path", None)
        if path is None:
            raise EMAStateError(
                f"checkpoint[{CHECKPOINT_KEY!r}] keeps the EMA's shards in the checkpoint "
                f"folder, but the trainer does not say which folder it loaded (ckpt_path); "
                f"pass ckpt_path= to fit, validate or test"
            )
        self._pending = None
        ema = self._ensure_ema(pl_module)  # restored after setup: the module is sharded
        state = ema.state_dict(include_online_model=False)
        prefix = str(entry.get("shards_in_state_dict", SHARDED_STATE_PREFIX))
        shards = {prefix + k: state[k] for k in _sharded_keys(state)}
        try:
            dcp.load({"state_dict": shards}, checkpoint_id=path)  # in place, shard by shard
        except Exception as e:
            raise EMAStateError(
                f"could not load the EMA's shards from ckpt_path={str(path)!r} ({e}); the "
                f"checkpoint's EMA must come from EMACallback on a model with the same "
                f"parameters"
            ) from e
        values = dict(entry["ema"])
        values.update((k[len(prefix) :], v) for k, v in shards.items())
        self._load_into(ema, values)


@contextlib.contextmanager
def _renamed_logs(pl_module: pl.LightningModule, suffix: str) -> Iterator[None]:
    """Inside the block, ``pl_module.log(name, ...)`` (and ``log_dict``, which calls it)
    logs under ``name + suffix``."""
    log = pl_module.log

    def renamed(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        log(name + suffix, value, *args, **kwargs)

    pl_module.log = renamed  # type: ignore[method-assign]
    try:
        yield
    finally:
        del pl_module.log  # the class's method again


# -- sharded (FSDP2) EMAs in Lightning checkpoints -------------------------------------------


def _sharded_keys(state: Mapping[str, Any]) -> list[str]:
    """The keys of ``state`` whose values are DTensors (an FSDP2 EMA's shards)."""
    return [k for k, v in state.items() if is_dtensor(v)]


def _gather_full(ema: EMA, state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` (``ema.state_dict()``) with every DTensor replaced by the full tensor, on
    the CPU of the first rank; the other ranks get the plain entries only.

    A collective (one gather per tensor): call it on every rank.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(ema.ema_model, options=options)
    out = {k: v for k, v in state.items() if not is_dtensor(v)}
    for key in _sharded_keys(state):
        name = key.removeprefix("ema_model.")
        if name in full:
            out[key] = full[name]
    return out


def _distribute_like(values: Mapping[str, Any], live: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` with each full tensor whose ``live`` counterpart is a DTensor cut into
    this rank's shard of that DTensor's layout (``distribute_tensor``: rank 0's values are
    scattered, one collective per tensor; call it on every rank). Without DTensors in
    ``live``, ``values`` as they are."""
    out = dict(values)
    for key in _sharded_keys(live):
        value, like = out.get(key), live[key]
        if isinstance(value, Tensor) and not is_dtensor(value):
            from torch.distributed.tensor import distribute_tensor

            out[key] = distribute_tensor(
                value.to(like.device, like.dtype), like.device_mesh, like.placements
            )
    return out

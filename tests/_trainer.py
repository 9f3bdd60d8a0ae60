"""A small, quiet Transformers ``Trainer`` on the CPU for the integration tests."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

__all__ = ["QUIET", "quiet_trainer"]

#: ``TrainingArguments`` every test run shares: CPU, no logging or progress bars, no
#: evaluation unless asked, checkpoints by steps, seed 0.
QUIET: dict[str, Any] = {
    "lr_scheduler_type": "constant",
    "save_strategy": "steps",
    "eval_strategy": "no",
    "logging_strategy": "no",
    "report_to": "none",
    "disable_tqdm": True,
    "use_cpu": True,
    "dataloader_num_workers": 0,
    "seed": 0,
}


def quiet_trainer(out: Path, callbacks: list, **kw: Any) -> Any:
    """A ``transformers.Trainer`` writing to ``out``: ``kw`` holds the ``Trainer``'s own
    arguments (``model``, ``train_dataset``, ``eval_dataset``) and ``TrainingArguments``
    overriding `QUIET`."""
    import transformers

    trainer_kw = {k: kw.pop(k) for k in ("model", "train_dataset", "eval_dataset") if k in kw}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = transformers.TrainingArguments(output_dir=str(out), **{**QUIET, **kw})
        return transformers.Trainer(args=args, callbacks=callbacks, **trainer_kw)

"""``emakit inspect`` on what the framework integrations write: the EMA inside a Lightning
``.ckpt``, an Accelerate ``save_state`` folder and a Transformers ``checkpoint-N`` folder,
and a plain reason for a file that is no checkpoint at all.

Nothing here imports a framework; the names the integrations write come from
``integrations._common``, which imports none either.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click
import torch

from ..integrations._common import LIGHTNING_CHECKPOINT_KEY, TRAINER_WEIGHTS_NAME

__all__ = [
    "ACCELERATE_FILE",
    "LIGHTNING_KEY",
    "READS",
    "TRAINER_FILE",
    "describe_ema_state",
    "ema_state_in",
    "framework_folder",
    "not_a_checkpoint",
]

#: Where ``EMACallback`` puts the EMA in a Lightning ``.ckpt``.
LIGHTNING_KEY = LIGHTNING_CHECKPOINT_KEY
#: The EMA file ``EMATrainerCallback`` writes into each ``checkpoint-N`` folder.
TRAINER_FILE = TRAINER_WEIGHTS_NAME
#: The files ``accelerator.save_state`` writes for registered objects (``prepare_ema``).
ACCELERATE_FILE = re.compile(r"custom_checkpoint_(\d+)\.pkl")
#: What ``emakit inspect`` reads, for messages about what it does not.
READS = (
    "emakit inspect reads post-hoc snapshot folders, .safetensors files, torch checkpoints "
    "(.pt, .bin, a Lightning .ckpt), Accelerate save_state folders and Transformers "
    "checkpoint-N folders"
)


def _is_ema_state(obj: Any) -> bool:
    return (
        isinstance(obj, Mapping)
        and "step" in obj
        and "initted" in obj
        and any(isinstance(k, str) and k.startswith("ema_model.") for k in obj)
    )


def ema_state_in(obj: Any) -> tuple[str, Mapping[str, Any]] | None:
    """``(what holds it, the EMA's state dict)`` in a loaded torch object, or None.

    A Lightning checkpoint holds ``EMACallback``'s entry under ``"emakit_ema"`` (layout
    version 1: ``{"version": 1, "ema": state}``; version 2 keeps an FSDP2 EMA's shards in
    the checkpoint's distributed ``state_dict``); an Accelerate custom checkpoint or a
    ``torch.save(ema.state_dict())`` is the state itself.
    """
    if not isinstance(obj, Mapping):
        return None
    entry = obj.get(LIGHTNING_KEY)
    if isinstance(entry, Mapping) and isinstance(entry.get("ema"), Mapping):
        where = (
            f"Lightning checkpoint, EMACallback layout version {entry.get('version', 1)} "
            f"(global_step {obj.get('global_step', '?')}, epoch {obj.get('epoch', '?')})"
        )
        if "shards_in_state_dict" in entry:
            where += "; the EMA's shards are in the checkpoint's distributed state_dict"
        return where, entry["ema"]
    if _is_ema_state(obj):
        return "EMA state_dict", obj
    return None


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def describe_ema_state(state: Mapping[str, Any], limit: int = 12) -> list[str]:
    """Lines describing an EMA ``state_dict()``: step, initted, emakit's metadata (layout
    version, skip count), and the EMA's tensors (and the online model's, if saved)."""
    lines = []
    for key in ("step", "initted"):
        value = state.get(key)
        if isinstance(value, torch.Tensor):
            lines.append(f"  {key}: {value.tolist()}")
    meta = getattr(state, "_metadata", None) or {}
    for key, value in sorted((meta.get("") or {}).items()):
        lines.append(f"  {key}: {value}")
    for prefix, label in (("ema_model.", "EMA"), ("online_model.", "online model")):
        tensors = {
            k[len(prefix) :]: v
            for k, v in state.items()
            if isinstance(k, str) and k.startswith(prefix) and isinstance(v, torch.Tensor)
        }
        if not tensors:
            continue
        floats = sum(v.numel() for v in tensors.values() if v.is_floating_point())
        dtypes = ", ".join(sorted({_dtype(v) for v in tensors.values()}))
        lines.append(f"{label}: {len(tensors)} tensors, {floats:,} floating values, {dtypes}")
        if label == "EMA":
            for name, v in list(tensors.items())[:limit]:
                lines.append(f"  {name}  {_dtype(v)}  {list(v.shape)}")
            if len(tensors) > limit:
                lines.append(f"  ... and {len(tensors) - limit} more")
    return lines


def framework_folder(folder: Path) -> tuple[str, list[Path]] | None:
    """``(what the folder is, the files holding an EMA)`` for a Transformers
    ``checkpoint-N`` folder (its ``ema.safetensors``) or an Accelerate ``save_state``
    folder (its ``custom_checkpoint_<i>.pkl`` files), else None."""
    if (folder / TRAINER_FILE).is_file():
        return "Transformers Trainer checkpoint folder", [folder / TRAINER_FILE]
    custom = sorted(
        (p for p in folder.iterdir() if ACCELERATE_FILE.fullmatch(p.name) and p.is_file()),
        key=lambda p: int(ACCELERATE_FILE.fullmatch(p.name).group(1)),  # type: ignore[union-attr]
    )
    if custom:
        return "Accelerate save_state folder", custom
    return None


_ZIP, _PICKLE = b"PK\x03\x04", b"\x80"


def not_a_checkpoint(path: Path) -> click.ClickException | None:
    """An error saying what ``path`` is, when its first bytes show it is neither a torch
    file (a zip archive, or a pickle) nor anything else ``inspect`` reads; else None."""
    with open(path, "rb") as f:
        head = f.read(64)
    if head.startswith(_ZIP) or head.startswith(_PICKLE):
        return None
    text = head.lstrip()
    if text[:1] in (b"{", b"["):
        what = "a JSON file"
        if path.name == "summary.json":
            what += (
                " (the demo's summary.json: its metrics and settings; the demo's "
                "snapshots are in the posthoc-snapshots/ folder beside it)"
            )
    elif not head:
        what = "an empty file"
    else:
        what = f"not a torch file (it starts with {head[:8]!r})"
    return click.ClickException(f"{path} is {what}, not a checkpoint; {READS}")

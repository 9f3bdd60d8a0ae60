"""Snapshot folders converted for other tools: `to_ema_pytorch()`.

ema-pytorch 0.8.3's ``PostHocEMA.synthesize_ema_model`` reads every ``*.pt`` file of its
``checkpoint_folder`` as ``<profile index>.<step>.pt``, a ``KarrasEMA.state_dict()``
(``initted``, ``step``, ``ema_model.<name>``) of the profile ``gammas[index]`` whose
averaging ends at ``step``. emakit's snapshots hold exactly that profile (emakit's
``KarrasEMA`` keeps the power-function profile for any ``update_every``, and a snapshot's
profile ends at its step), so each becomes one such file.
"""

from __future__ import annotations

import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import click
import torch

from .._files.atomic import atomic_paths
from .._files.reading import writable_folder, write_errors
from ..errors import EMAError, EMAStateError, EMAValueError
from .command_line import fail, open_folder
from .math import PostHocWarning
from .snapshots.folder import list_legacy_files, list_snapshots, pick_run
from .snapshots.format import SnapshotInfo
from .snapshots.legacy import LEGACY_NAME, legacy_filename, legacy_state
from .synthesis.weighted_sum import weighted_sums

__all__ = ["convert_cmd", "to_ema_pytorch"]


@dataclass(frozen=True)
class _Whole:
    """One snapshot read whole: weight 1, its own buffers (a `Target` of `weighted_sums`)."""

    weights: tuple[float, ...]
    buffers_from: SnapshotInfo


def to_ema_pytorch(
    folder: str | os.PathLike[str],
    out_folder: str | os.PathLike[str],
    *,
    run: str | None = None,
    force: bool = False,
) -> list[Path]:
    """Write the snapshots of ``folder`` as ema-pytorch's, into ``out_folder``.

    Each emakit snapshot (a whole-model file, a sharded set reassembled, frozen tensors
    joined from their side file) becomes ``<profile>.<step>.pt``: ``torch.save`` of
    ``{"initted", "step", "ema_model.<name>": ...}`` with every tensor in its stored dtype
    (float64 snapshots pass through float32). ema-pytorch's own files in ``folder`` are
    copied as they are. Then, with ema-pytorch::

        PostHocEMA(model, sigma_rels=<the run's sigma_rels, in order>,
                   checkpoint_folder=out_folder).synthesize_ema_model(sigma_rel=0.1)

    gives emakit's ``synthesize(folder, sigma_rel=0.1)`` times the raw sum of the weights
    (ema-pytorch does not normalize them), to float32 rounding; buffers differ: ema-pytorch
    sums them with the weights, emakit takes the latest snapshot's.

    The files are written as one set (temporary files, fsynced, renamed when all are
    complete): a failed conversion leaves ``out_folder`` as it was. ``folder`` is only read.

    Args:
        folder: the emakit snapshot folder.
        out_folder: where to write; created if missing. It must not be ``folder``, and must
            be empty unless ``force``.
        run: keyword-only; the run to convert when ``folder`` holds several (see
            [`plan_synthesis()`][emakit.posthoc.synthesis.plan.plan_synthesis]). Default None.
        force: keyword-only; write into a non-empty ``out_folder``, replacing files of the
            same names (ema-pytorch reads *every* ``*.pt`` there: other ones warn). Default
            False.

    Returns:
        The files written, by step.

    Raises:
        EMAValueError: ``out_folder`` is ``folder``, not a folder, or not empty without
            ``force``; ``folder`` holds no emakit snapshot.
        EMAStateError: snapshots of several runs and no ``run``; two snapshots of one
            profile index with different gammas, or one whose profile ends before its step
            (ema-pytorch's names carry one number for both); an ema-pytorch file of the same
            name as a converted one.
        EMAWriteError: a file could not be written; nothing was replaced.

    Example:
        >>> to_ema_pytorch("runs/exp1/post-hoc-ema", "runs/exp1/ema-pytorch")  # doctest: +SKIP
    """
    src = Path(folder)
    snaps = pick_run(list_snapshots(src), run, src)
    if not snaps:
        raise EMAValueError(
            f"no emakit snapshots in {str(src)!r} to convert; pass the checkpoint_folder "
            f"of an emakit PostHocEMA"
        )
    out = writable_folder("out_folder", out_folder)
    if out.exists() and os.path.samefile(out, src):
        raise EMAValueError(
            f"out_folder={str(out)!r} is the snapshot folder itself; converting never writes "
            f"into its source: pass another folder"
        )
    if out.exists() and any(out.iterdir()) and not force:
        raise EMAValueError(
            f"out_folder={str(out)!r} is not empty, and ema-pytorch reads every *.pt file "
            f"in it; pass an empty or new folder, or force=True (--force) to write into it"
        )
    gammas: dict[int, float] = {}
    for s in snaps:
        if gammas.setdefault(s.profile, s.gamma) != s.gamma or s.t != s.step:
            raise EMAStateError(
                f"{s.path} cannot be written as ema-pytorch's {legacy_filename(s.profile, s.step)}: "
                + (
                    f"profile index {s.profile} has gamma {gammas[s.profile]:.6g} in another "
                    f"snapshot and {s.gamma:.6g} here; convert one run (run=...)"
                    if s.t == s.step
                    else f"its profile ends at step {s.t}, not at its step {s.step}, and "
                    f"ema-pytorch's file name carries one number for both"
                )
            )
    names = {legacy_filename(s.profile, s.step): s for s in snaps}
    theirs = list_legacy_files(src)
    if clash := sorted(names.keys() & {f.path.name for f in theirs}):
        raise EMAStateError(
            f"{str(src)!r} holds both emakit's snapshot and ema-pytorch's file {clash[0]}; "
            f"move one of them out of the folder before converting"
        )
    paths = [out / n for n in names] + [out / f.path.name for f in theirs]
    with write_errors(paths, "ema-pytorch snapshot"), atomic_paths(paths) as tmps:
        for tmp, snap in zip(tmps, names.values(), strict=False):
            tensors = weighted_sums([snap], [_Whole((1.0,), snap)], dtype=None)[0]
            torch.save(legacy_state(tensors, snap.step), tmp)
        for tmp, f in zip(tmps[len(names) :], theirs, strict=True):
            shutil.copyfile(f.path, tmp)
    others = sorted(p.name for p in out.iterdir() if p.suffix == ".pt" and p not in set(paths))
    if others:
        warnings.warn(
            f"{str(out)!r} also holds {len(others)} other .pt file(s) ({', '.join(others[:3])}"
            f"{', ...' if len(others) > 3 else ''}) that ema-pytorch's synthesize_ema_model will "
            f"read as snapshots too"
            + ("" if all(LEGACY_NAME.match(n) for n in others) else " (or fail to parse)"),
            PostHocWarning,
            stacklevel=2,
        )
    return sorted(paths, key=lambda p: (int(p.stem.split(".")[1]), p.name))


# -- emakit convert --------------------------------------------------------------------------


@click.command("convert")
@click.argument("folder", type=click.Path(path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@click.option(
    "--to",
    "to",
    required=True,
    type=click.Choice(["ema-pytorch"]),
    help="The format to write: ema-pytorch's <profile index>.<step>.pt files.",
)
@click.option("--run", metavar="ID", help="The run to convert, when FOLDER holds several.")
@click.option("--force", is_flag=True, help="Write into a non-empty OUT.")
def convert_cmd(folder: Path, out: Path, to: str, run: str | None, force: bool) -> None:
    """Write a post-hoc snapshot FOLDER as another tool's snapshot folder OUT.

    --to ema-pytorch writes each snapshot as <profile index>.<step>.pt, which
    ema-pytorch's PostHocEMA(..., sigma_rels=<the same, in order>,
    checkpoint_folder=OUT).synthesize_ema_model(...) reads. FOLDER is only read; OUT must
    be empty (or new) unless --force; the files appear all at once or not at all.

    \b
    Example:
        emakit convert --to ema-pytorch ./post-hoc-ema ./ema-pytorch-checkpoints
    """
    try:
        folder, _ = open_folder(folder)  # a demo's run folder: its snapshot subfolder
        paths = to_ema_pytorch(folder, out, run=run, force=force)
    except (EMAError, OSError) as e:
        raise fail(e) from e
    steps = sorted({int(p.stem.split(".")[1]) for p in paths})
    click.echo(
        f"wrote {len(paths)} ema-pytorch snapshot file(s) to {out} (steps "
        f"{steps[0]}..{steps[-1]}); read them with ema_pytorch.PostHocEMA(model, "
        f"sigma_rels=<the run's, in order>, checkpoint_folder={str(out)!r})"
    )

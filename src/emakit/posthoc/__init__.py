"""Post-hoc EMA (Karras et al. 2024, arXiv:2312.02696): power-function EMAs, snapshots,
and synthesis of any EMA length after training.

* [`KarrasEMA`][emakit.posthoc.karras.KarrasEMA]: one power-function EMA whose decay honours ``update_every``.
* [`PostHocEMA`][emakit.posthoc.posthoc.PostHocEMA]: several profiles of one model, snapshotted to a folder, and
  `PostHocEMA.synthesize_ema_model()` to reconstruct any ``sigma_rel`` afterwards.
* [`synthesize_state_dict()`][emakit.posthoc.synthesize_state_dict] / [`plan_synthesis()`][emakit.posthoc.plan_synthesis]: the same from a folder alone
  (one process's snapshots, or every rank's of a sharded model, reassembled).
* [`PostHocEMA.sweep()`][emakit.PostHocEMA.sweep] / [`sweep()`][emakit.posthoc.sweep]: synthesize many lengths in one pass over the
  snapshots, score each with your function, plot, pick the best.
* [`list_snapshots()`][emakit.posthoc.list_snapshots] / [`read_snapshot_info()`][emakit.posthoc.read_snapshot_info]: what a snapshot folder holds (the
  headers only); [`find_snapshot_folder()`][emakit.posthoc.find_snapshot_folder]: a folder or its one snapshot subfolder.
* [`LegacyProfiles`][emakit.posthoc.LegacyProfiles]: read ema-pytorch's ``<profile index>.<step>.pt`` snapshots
  (their profiles by index), alone or mixed with emakit's.
* [`collect_frozen_files()`][emakit.posthoc.collect_frozen_files]: remove the side files of frozen
  weights (stored once for many snapshots, see `emakit.posthoc.frozen_files`) that no
  snapshot uses any more.
* [`emakit.posthoc.math`][emakit.posthoc.math]: the float64 math (profiles, ``sigma_rel`` <-> ``gamma``,
  the least-squares weights of Algorithm 3).

The command-line front end (``emakit synthesize``, ``emakit inspect``) lives in
`emakit.posthoc.commands`, imported only by the CLI.
"""

from __future__ import annotations

from .frozen_files import collect_frozen_files
from .karras import KARRAS_STATE_VERSION, KarrasEMA
from .math import (
    GAMMA_MIN,
    SIGMA_REL_MAX,
    PostHocWarning,
    WeightSolution,
    gamma_to_sigma_rel,
    power_function_beta,
    power_function_profile,
    power_function_sample_weights,
    profile_inner_product,
    sigma_rel_to_gamma,
    solve_weights,
)
from .posthoc import POSTHOC_STATE_VERSION, PostHocEMA
from .snapshots import (
    SNAPSHOT_FORMAT,
    SNAPSHOT_FORMAT_VERSION,
    LegacyFile,
    LegacyProfiles,
    SnapshotInfo,
    list_legacy_files,
    list_snapshots,
    read_snapshot_info,
)
from .sweeping import SweepResult, sweep, sweep_lengths
from .synthesis import SynthesisPlan, plan_synthesis, synthesize_state_dict
from .where import find_snapshot_folder

__all__ = [
    "GAMMA_MIN",
    "KARRAS_STATE_VERSION",
    "POSTHOC_STATE_VERSION",
    "SIGMA_REL_MAX",
    "SNAPSHOT_FORMAT",
    "SNAPSHOT_FORMAT_VERSION",
    "KarrasEMA",
    "LegacyFile",
    "LegacyProfiles",
    "PostHocEMA",
    "PostHocWarning",
    "SnapshotInfo",
    "SweepResult",
    "SynthesisPlan",
    "WeightSolution",
    "collect_frozen_files",
    "find_snapshot_folder",
    "gamma_to_sigma_rel",
    "list_legacy_files",
    "list_snapshots",
    "plan_synthesis",
    "power_function_beta",
    "power_function_profile",
    "power_function_sample_weights",
    "profile_inner_product",
    "read_snapshot_info",
    "sigma_rel_to_gamma",
    "solve_weights",
    "sweep",
    "sweep_lengths",
    "synthesize_state_dict",
]

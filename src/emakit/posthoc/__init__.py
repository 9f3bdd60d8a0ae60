"""Post-hoc EMA (Karras et al. 2024, arXiv:2312.02696): power-function EMAs, snapshots,
and synthesis of any EMA length after training.

The trackers:

* [`KarrasEMA`][emakit.posthoc.karras.KarrasEMA]: one power-function EMA whose decay honours ``update_every``.
* [`PostHocEMA`][emakit.posthoc.posthoc_ema.PostHocEMA]: several profiles of one model, snapshotted to a folder;
  `PostHocEMA.synthesize_ema_model()` reconstructs any ``sigma_rel`` afterwards and
  `PostHocEMA.sweep()` scores many.

Synthesis from a folder alone (one process's snapshots, or every rank's of a sharded
model, reassembled), one verb each:

* [`synthesize()`][emakit.posthoc.synthesize]: the EMA of one length as a state dict
  (`synthesize_state_dict()` is its old name); [`plan_synthesis()`][emakit.posthoc.plan_synthesis]
  chooses the snapshots and solves the weights first, for a look before the run.
* [`sweep()`][emakit.posthoc.sweep]: many lengths in one pass over the snapshots, each
  scored by your function, plotted, the best picked (``sigma_rels`` a list or an
  ``"A:B:N"`` spec; `sweep_lengths()` turns a spec into the list).

The folder:

* [`list_snapshots()`][emakit.posthoc.list_snapshots] / [`read_snapshot_info()`][emakit.posthoc.read_snapshot_info]: what a snapshot folder holds (the
  headers only); [`find_snapshot_folder()`][emakit.posthoc.find_snapshot_folder]: a folder or its one snapshot subfolder.
* [`LegacyProfiles`][emakit.posthoc.LegacyProfiles]: read ema-pytorch's ``<profile index>.<step>.pt`` snapshots
  (their profiles by index), alone or mixed with emakit's.
* [`to_ema_pytorch()`][emakit.posthoc.to_ema_pytorch]: write a folder's snapshots as
  ema-pytorch's ``<profile index>.<step>.pt`` files, for its ``synthesize_ema_model``.
* [`collect_frozen_files()`][emakit.posthoc.collect_frozen_files]: remove the side files of frozen
  weights (stored once for many snapshots, see `emakit.posthoc.snapshots.frozen`) that no
  snapshot uses any more.

And [`emakit.posthoc.math`][emakit.posthoc.math]: the float64 math (profiles, ``sigma_rel`` <-> ``gamma``,
the least-squares weights of Algorithm 3, and from the weights ema-pytorch's snapshots
really hold: `solve_weights_stepwise()`).

The layout: `math`; the trackers `karras` and `posthoc_ema`; `snapshots/` (the files on
disk and their folder); `synthesis/` (plan, weighted sum, sweep); `convert` (folders
for ema-pytorch); `commands` (``emakit
synthesize``, ``emakit sweep``, ``emakit inspect``, imported only by the CLI).
"""

from __future__ import annotations

from .convert import to_ema_pytorch
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
    solve_weights_stepwise,
)
from .posthoc_ema import POSTHOC_STATE_VERSION, PostHocEMA
from .snapshots.folder import (
    collect_frozen_files,
    find_snapshot_folder,
    list_legacy_files,
    list_snapshots,
)
from .snapshots.format import (
    SNAPSHOT_FORMAT,
    SNAPSHOT_FORMAT_VERSION,
    SnapshotInfo,
    read_snapshot_info,
)
from .snapshots.legacy import LegacyFile, LegacyProfiles
from .synthesis.plan import SynthesisPlan, plan_synthesis, synthesize, synthesize_state_dict
from .synthesis.sweep import SweepResult, sweep, sweep_lengths

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
    "solve_weights_stepwise",
    "sweep",
    "sweep_lengths",
    "synthesize",
    "synthesize_state_dict",
    "to_ema_pytorch",
]

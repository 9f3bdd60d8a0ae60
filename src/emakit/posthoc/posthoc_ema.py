"""``PostHocEMA``: track power-function EMAs while training, choose the EMA length after.

Karras et al. 2024 (arXiv:2312.02696, §3 and Appendix C): train with a couple of
power-function EMA profiles, save their states (snapshots) every so often, and after
training reconstruct the EMA of *any* length at any saved step as a weighted sum of the
snapshots, the weights coming from a float64 least-squares fit of the profiles
(Algorithm 3, [`solve_weights()`][emakit.posthoc.math.solve_weights]); the synthesis itself lives
in `emakit.posthoc.synthesis`.

Synthesis streams the snapshots: one file is open at a time and its tensors are added,
one by one, into a float32 accumulator, so memory stays at about one model however many
snapshots there are. Buffers (BatchNorm statistics, counters) and other non-averaged
tensors are not summed (a weighted sum with negative weights can make a variance
negative); they come from the latest snapshot at or before the target step.
"""

from __future__ import annotations

import copy
import inspect
import os
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, cast

import torch
from torch import nn

from .._core import state
from .._core.forward import eval_call
from .._core.shadow import unwrap_model
from .._dist.collectives import AGREE_TIMEOUT_S, dist_ready, is_rank_zero
from .._dist.deepspeed import ZeroPartitions
from .._files.reading import writable_folder
from .._validate import boolean, floating_dtype
from ..errors import EMAError, EMARuntimeError, EMAStateError, EMATypeError, EMAValueError
from .karras import KarrasEMA, profile_time, refuse_other_profiles, resolve_profile
from .math import PostHocWarning, check_gamma, check_sigma_rel
from .snapshots.folder import check_run_id, list_snapshots, new_run_id, runs_in
from .snapshots.format import RUN_PATTERN, SnapshotInfo, snapshot_filename
from .snapshots.legacy import LegacyProfiles
from .snapshots.shards import is_sharded
from .snapshots.writer import SnapshotWriter, check_snapshottable
from .synthesis.plan import load_into, pick_snapshots, plan_synthesis, region_args
from .synthesis.sweep import SweepResult, run_sweep

__all__ = ["POSTHOC_STATE_VERSION", "PostHocEMA"]

T = TypeVar("T")

#: Version of the layout `PostHocEMA.state_dict()` writes.
POSTHOC_STATE_VERSION = 2
_CODEC = state.StateCodec(
    POSTHOC_STATE_VERSION,
    [state.reals("gammas", meta=True), state.text("run", RUN_PATTERN)],
    legacy_keys=("gammas",),
    legacy_version_key="version",
)

#: The keywords PostHocEMA passes on to each KarrasEMA: all of KarrasEMA's but those it
#: sets itself.
_OWN = {"model", "sigma_rel", "gamma", "ema_model", "update_every"}
_KARRAS_KWARGS = frozenset(inspect.signature(KarrasEMA).parameters) - _OWN


def resolve_profiles(
    sigma_rels: Sequence[float] | None, gammas: Sequence[float] | None
) -> tuple[tuple[float | None, ...], tuple[float, ...]]:
    """The profiles of a PostHocEMA: ``(sigma_rels, gammas)`` from one of
    ``sigma_rels``/``gammas`` (default ``sigma_rels=(0.05, 0.28)``), validated and
    distinct; the sigma_rels are None when gammas are given (each KarrasEMA then derives
    its own from its gamma)."""
    if sigma_rels is not None and gammas is not None:
        raise EMAValueError(
            f"give sigma_rels or gammas, not both, got {sigma_rels=!r} and {gammas=!r}"
        )
    name, values = ("gammas", gammas) if gammas is not None else ("sigma_rels", sigma_rels)
    values = (0.05, 0.28) if values is None else values
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise EMATypeError(f"{name} must be a tuple of numbers, got {name}={values!r}")
    values = tuple(values)
    if not values:
        raise EMAValueError(f"{name} must hold at least one value, got {name}={values!r}")
    if name == "sigma_rels":
        resolved = [resolve_profile(check_sigma_rel(v, name), None) for v in values]
    else:
        resolved = [resolve_profile(None, check_gamma(v, name)) for v in values]
    gs = tuple(g for _, g in resolved)
    if len(set(gs)) != len(gs) or len({snapshot_filename(0, *p) for p in resolved}) != len(gs):
        raise EMAValueError(
            f"{name} must be distinct (each profile writes its own snapshots), got {name}={values!r}"
        )
    return tuple(s if name == "sigma_rels" else None for s, _ in resolved), gs


class PostHocEMA(nn.Module):
    """Several power-function EMAs of one model, snapshotted for post-hoc synthesis.

    Karras et al. 2024 (arXiv:2312.02696, §3): track a few [`KarrasEMA`][emakit.posthoc.karras.KarrasEMA] profiles
    while training, write their states to ``checkpoint_folder`` every
    ``checkpoint_every_num_steps`` calls, and after training call
    `synthesize_ema_model()` for any ``sigma_rel`` at any saved step.

    Keyword-compatible with ``ema_pytorch.PostHocEMA`` 0.8.3 and fixing its defects:
    the decay honours ``update_every``; synthesis weights are normalized and use only
    snapshots taken at or before the target step; integer buffers are stored exactly
    (not cast to float16); snapshots are self-describing, readably named, atomically
    written and written by rank 0 only; each profile owns its EMA copy.

    A drop-in for a run that used ema-pytorch: its snapshot files
    (``<profile index>.<step>.pt``) in ``checkpoint_folder`` are read as snapshots of this
    PostHocEMA's profiles (``gammas[index]``, see [`legacy_profiles()`][emakit.posthoc.posthoc_ema.PostHocEMA.legacy_profiles]) and used with
    emakit's own.

    Args:
        model: the online (training) module (DDP and ``torch.compile`` wrappers unwrapped).
        ema_model: a module to copy for each profile (deep-copied per profile, never
            shared), or a zero-argument factory called per profile. Default None: copies
            of ``model``.
        sigma_rels: relative EMA lengths to track, each in ``(0, SIGMA_REL_MAX]``
            (~0.30028; above ``1/sqrt(12)`` gamma < 0: more weight on early iterates,
            as in ema-pytorch, which takes the same root). Give this
            or ``gammas``. Default None: ``(0.05, 0.28)`` when neither is given.
        gammas: profile exponents to track, each ``>= GAMMA_MIN`` (~ -0.382).
        checkpoint_every_num_steps: write snapshots every this many ``update()`` calls, or
            ``"manual"`` to write only on [`checkpoint()`][emakit.posthoc.posthoc_ema.PostHocEMA.checkpoint]. Default 1000.
        checkpoint_folder: where snapshots go; created if missing; a resumed run keeps
            writing to it. Default ``"./post-hoc-ema-checkpoints"``.
        checkpoint_dtype: dtype floating tensors are stored in; None keeps the EMA's.
            Integer and bool tensors are always stored exactly. Default ``torch.float16``.
        update_every: keyword-only; each profile averages every this many calls.
            Default 100.
        run_id: keyword-only; the id recorded in every snapshot of this run (1 to 64
            letters, digits, ``.``, ``_``, ``-``), kept across ``load_state_dict``
            resumes. Default None: a fresh random id (see [`emakit.posthoc.snapshots.folder`][emakit.posthoc.snapshots.folder]).
        store_frozen_once: keyword-only; frozen weights shared with the model
            (``share_frozen=True``; copied by default) are written once per distinct value, into
            a side file that the snapshots refer to (see
            [`emakit.posthoc.snapshots.frozen`][emakit.posthoc.snapshots.frozen]), instead of into every
            snapshot; synthesis gives the same weights. ``False`` writes every tensor into
            every snapshot (files that other tools can read alone). Default True.
        **kwargs: passed to each [`KarrasEMA`][emakit.posthoc.karras.KarrasEMA]: ``frozen``,
            ``param_or_buffer_names_no_ema``, ``ignore_names``, ``ignore_startswith_names``,
            ``allow_different_devices``, ``move_ema_to_online_device``, ``use_foreach``,
            ``ema_dtype``, ``skip_nonfinite``, ``device``, ``async_update``,
            ``share_frozen``, ``partition``, ``watch_model``.

    Example:
        >>> net = torch.nn.Linear(4, 4)
        >>> ema = PostHocEMA(net, sigma_rels=(0.05, 0.28), update_every=10,
        ...                  checkpoint_every_num_steps=100, checkpoint_folder=folder)  # doctest: +SKIP
        >>> for _ in range(1000):  # doctest: +SKIP
        ...     train_step(net); ema.update()
        >>> synth = ema.synthesize_ema_model(sigma_rel=0.15)  # doctest: +SKIP
        >>> y = synth(x)  # doctest: +SKIP
    """

    _version = POSTHOC_STATE_VERSION  # torch records it in the state's metadata

    def __init__(
        self,
        model: nn.Module,
        ema_model: nn.Module | Callable[[], nn.Module] | None = None,
        sigma_rels: Sequence[float] | None = None,
        gammas: Sequence[float] | None = None,
        checkpoint_every_num_steps: int | Literal["manual"] = 1000,
        checkpoint_folder: str | os.PathLike[str] = "./post-hoc-ema-checkpoints",
        checkpoint_dtype: torch.dtype | None = torch.float16,
        *,
        update_every: int = 100,
        run_id: str | None = None,
        store_frozen_once: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise EMATypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        unknown = sorted(set(kwargs) - _KARRAS_KWARGS)
        if unknown:
            raise EMATypeError(
                f"PostHocEMA got unknown keyword arguments {unknown}; it accepts those of "
                f"KarrasEMA: {sorted(_KARRAS_KWARGS)}"
            )
        boolean("store_frozen_once", store_frozen_once)
        every = checkpoint_every_num_steps
        if every != "manual" and (
            isinstance(every, bool) or not isinstance(every, int) or every < 1
        ):
            raise EMAValueError(
                f"checkpoint_every_num_steps must be an int >= 1 or 'manual', got "
                f"checkpoint_every_num_steps={every!r}"
            )
        checkpoint_folder = writable_folder("checkpoint_folder", checkpoint_folder)
        srs, gs = resolve_profiles(sigma_rels, gammas)
        model = unwrap_model(model)
        self._model = [model]  # a list keeps it out of the module tree and state_dict
        self._ema_template = [ema_model]
        self._karras_kwargs = dict(kwargs)
        self.ema_models = nn.ModuleList(
            self._new_profile(s, None if s is not None else g, update_every)
            for s, g in zip(srs, gs, strict=True)
        )
        check_snapshottable(self.profiles[0])
        self.update_every = int(self.profiles[0].update_every or 1)
        self.gammas = gs
        self.sigma_rels = tuple(m.sigma_rel for m in self.profiles)
        self.checkpoint_every_num_steps = every
        self.checkpoint_folder = Path(checkpoint_folder)
        self.checkpoint_dtype = floating_dtype("checkpoint_dtype", checkpoint_dtype)
        self.run_id = new_run_id() if run_id is None else check_run_id("run_id", run_id)
        self._writer = SnapshotWriter(store_frozen_once)
        self._loaded_run: str | None = None
        if is_rank_zero():
            self.checkpoint_folder.mkdir(parents=True, exist_ok=True)

    def _new_profile(self, sigma_rel: float | None, gamma: float | None, every: int) -> KarrasEMA:
        """A KarrasEMA of the model with this profile, built as every profile is (from
        ``ema_model`` and the keywords given to PostHocEMA): a tracked profile, or one to
        load a reconstruction into (then sharded like the tracked ones)."""
        template = self._ema_template[0]
        # Each profile needs its own storage: sharing one module would make every profile
        # average into the same tensors.
        ema_model = copy.deepcopy(template) if isinstance(template, nn.Module) else template
        return KarrasEMA(
            self.model,
            sigma_rel=sigma_rel,
            gamma=gamma,
            ema_model=ema_model,
            update_every=every,
            **self._karras_kwargs,
        )

    @property
    def model(self) -> nn.Module:
        """The online (training) model."""
        return self._model[0]

    @property
    def num_ema_models(self) -> int:
        """How many EMA profiles are tracked (one per gamma)."""
        return len(self.gammas)

    @property
    def profiles(self) -> list[KarrasEMA]:
        """The tracked [`KarrasEMA`][emakit.posthoc.karras.KarrasEMA] profiles (``ema_models``, typed)."""
        return cast("list[KarrasEMA]", list(self.ema_models))

    @property
    def step(self) -> Any:
        """``update()`` calls so far: profile 0's step tensor (see [`emakit.EMA.step`][emakit.EMA.step])."""
        return self.profiles[0].step

    @property
    def device(self) -> torch.device:
        """The device of the step counter (CPU: ema-pytorch's ``PostHocEMA.device``)."""
        return self.profiles[0].step.device

    @property
    def maybe_ema_model(self) -> nn.Module | Callable[[], nn.Module] | None:
        """The ``ema_model`` given at construction (ema-pytorch's name)."""
        return self._ema_template[0]

    @property
    def ema_kwargs(self) -> dict[str, Any]:
        """The keywords passed on to each [`KarrasEMA`][emakit.posthoc.karras.KarrasEMA] (ema-pytorch's name)."""
        return dict(self._karras_kwargs)

    def update(self, *model: Any) -> None:
        """Update every profile; write snapshots every ``checkpoint_every_num_steps`` calls.

        Call it after every ``optimizer.step()``. It takes no arguments: the profiles
        follow the model given at construction; ``update(model)`` (timm's habit) raises
        [`EMATypeError`][emakit.errors.EMATypeError] saying so.
        """
        if model:
            given = ", ".join(type(a).__name__ for a in model)
            raise EMATypeError(
                f"PostHocEMA.update() takes no model, got update({given}): every profile "
                f"follows the model given at construction (posthoc.model). Call "
                f"posthoc.update() after each optimizer.step()"
            )
        for ema in self.profiles:
            ema.update()
        every = self.checkpoint_every_num_steps
        if every != "manual" and self.profiles[0].tracker.step % every == 0:
            self.checkpoint()

    def copy_params_from_model_to_ema(self) -> None:
        """Copy the model into every profile."""
        for ema in self.profiles:
            ema.copy_params_from_model_to_ema()

    def copy_params_from_ema_to_model(self) -> None:
        """Copy the EMA weights into the model (ema-pytorch's behaviour: every profile in
        turn, so the last profile's weights remain)."""
        for ema in self.profiles:
            ema.copy_params_from_ema_to_model()

    def snapshots(self) -> list[SnapshotInfo]:
        """The snapshots in `checkpoint_folder`, sorted by step: emakit's and
        ema-pytorch's ``<profile index>.<step>.pt`` files (read with [`legacy_profiles()`][emakit.posthoc.posthoc_ema.PostHocEMA.legacy_profiles]).

        Raises:
            EMAStateError: an ema-pytorch file's profile index is not one of this
                PostHocEMA's profiles.
        """
        return list_snapshots(self.checkpoint_folder, legacy=self.legacy_profiles())

    def legacy_profiles(self) -> LegacyProfiles:
        """How this PostHocEMA reads ema-pytorch's snapshot files: profile index ``i`` is
        ``gammas[i]`` (as in ema-pytorch), with this PostHocEMA's ``update_every``; the
        tensors it takes rather than averages (buffers, integer tensors) and the exact
        dtypes of integer ones come from the EMA model, as for emakit's snapshots."""
        ema = self.profiles[0]
        tensors = cast(nn.Module, ema.ema_model).state_dict()  # KarrasEMA builds it eagerly
        exact = tuple(
            (n, v.dtype)
            for n, v in tensors.items()
            if not (v.is_floating_point() or v.is_complex())
        )
        return LegacyProfiles(
            self.gammas,
            sigma_rels=self.sigma_rels,
            update_every=self.update_every,
            copied=frozenset(tensors) - ema.averaged_names(),
            exact_dtypes=exact,
        )

    # -- snapshots ------------------------------------------------------------------------

    def release_folder(self) -> None:
        """Release the lock on `checkpoint_folder` that this run holds while it
        writes snapshots (also released when the object is garbage-collected or the
        process ends); the next [`checkpoint()`][emakit.posthoc.posthoc_ema.PostHocEMA.checkpoint] takes it again."""
        self._writer.release()

    def checkpoint(self, *, timeout_s: float = AGREE_TIMEOUT_S) -> list[Path]:
        """Write one snapshot per profile for the current step.

        A profile whose last averaging update was before the current step first averages
        in the current weights (exact for the power-function profile), so every snapshot's
        profile ends at its step. The step's files are written as one set, atomically (all
        of them or none, see `write_snapshots()`), named like
        ``step-000001000_sigma_rel-0.05_gamma-16.9722.safetensors``, and record this run's
        id. The first write takes the folder's lock (see [`emakit.posthoc.snapshots.folder`][emakit.posthoc.snapshots.folder]).

        A model held whole on every rank (one process, DDP) is written by rank 0 alone. A
        sharded model (FSDP2, HSDP, FSDP with tensor parallelism, DeepSpeed ZeRO-3,
        ``partition=True``) is written by every rank: each rank its own blocks (or
        partitions) of every tensor, into its own files (``...rank-00003-of-
        00004.safetensors``, see [`emakit.posthoc.snapshots.shards`][emakit.posthoc.snapshots.shards]), so **call it on every
        rank** (``update()`` does); a call on some ranks only raises after ``timeout_s``
        (see `emakit.posthoc.snapshots.writer`).

        Args:
            timeout_s: keyword-only; for a sharded model, seconds a rank waits for the
                others to arrive. Default 30.

        Returns:
            The files this rank wrote (empty on ranks other than 0 for a whole model).

        Raises:
            EMARuntimeError: called before the first [`update()`][emakit.posthoc.posthoc_ema.PostHocEMA.update]; another run is
                writing to the folder; for a sharded model, some ranks did not call it.
            EMAWriteError: a file could not be written (disk full...): an ``OSError``
                naming the files; none of the step's files was written.
        """
        step = self.profiles[0].tracker.step
        if step == 0 or not all(bool(e.initted) for e in self.profiles):
            raise EMARuntimeError(
                "checkpoint() needs at least one update() first: there is no EMA to save yet"
            )
        paths, self.run_id = self._writer.write(  # sharded: rank 0's run id on every rank
            self.profiles,
            self.checkpoint_folder,
            step=step,
            dtype=self.checkpoint_dtype,
            run=self.run_id,
            timeout_s=timeout_s,
        )
        return paths

    # -- synthesis ------------------------------------------------------------------------

    def _on_rank_zero(self, fn: Callable[[], T]) -> T:
        """``fn()``: for a sharded model under ``torch.distributed``, computed by rank 0
        and broadcast (a collective: the folder is listed once, not by every rank, and
        every rank uses the same snapshots; an error raises on every rank)."""
        if not (dist_ready() and is_sharded(self.profiles[0].ema_model)):
            return fn()
        box: list[Any] = [None]
        if torch.distributed.get_rank() == 0:
            try:
                box[0] = fn()
            except EMAError as e:
                box[0] = e
        torch.distributed.broadcast_object_list(box, src=0)
        if isinstance(box[0], BaseException):
            raise box[0]
        return cast(T, box[0])

    def _snapshots(self) -> list[SnapshotInfo]:
        """The snapshots a synthesis uses: this run's when the folder holds any, else the
        folder's only run's, and ema-pytorch's files read as this PostHocEMA's profiles."""
        folder, legacy = self.checkpoint_folder, self.legacy_profiles()
        run = self.run_id if self.run_id in runs_in(list_snapshots(folder)) else None
        return pick_snapshots(folder, legacy, run)

    def synthesize_ema_model(
        self,
        gamma: float | None = None,
        sigma_rel: float | None = None,
        step: int | None = None,
    ) -> KarrasEMA:
        """Reconstruct the power-function EMA with ``gamma`` (or ``sigma_rel``) at ``step``.

        ema-pytorch's name and argument order: ``synthesize_ema_model(7.0)`` is
        ``gamma=7.0``; pass ``sigma_rel=`` by keyword. The same synthesis as
        [`emakit.posthoc.synthesize()`][emakit.posthoc.synthesis.plan.synthesize] from the
        folder alone, into a model.

        Algorithm 3 of arXiv:2312.02696 in float64 (normalized weights, snapshots at or
        before ``step`` only), then a streamed weighted sum of the snapshots (see
        [`SynthesisPlan`][emakit.posthoc.synthesis.plan.SynthesisPlan]): emakit's and, read as this
        PostHocEMA's profiles, ema-pytorch's (see `legacy_profiles()`). Buffers come
        from the latest snapshot at or before ``step``. The snapshots are this run's
        (`run_id`) when the folder holds any, else the folder's only run's; a folder
        of several other runs is refused (build with ``run_id=`` to pick one).

        Args:
            gamma: the target exponent, ``>= GAMMA_MIN`` (~ -0.382). Give this or
                ``sigma_rel``.
            sigma_rel: the target relative EMA length, in ``(0, SIGMA_REL_MAX]`` (~0.30028;
                above ``1/sqrt(12)`` gamma < 0: more weight on early iterates).
            step: the target step. Default None: the latest snapshot's step.

        Returns:
            A [`KarrasEMA`][emakit.posthoc.karras.KarrasEMA] of the model with that profile, whose ``ema_model`` holds
            the reconstruction and whose ``step`` is ``step``; call it (``synth(x)``) or
            use ``synth.ema_model``. For a sharded model it is sharded alike, on every
            rank (call this on every rank): under FSDP2 its ``ema_model`` holds this
            rank's shards; under DeepSpeed ZeRO-3 (or ``partition=True``) this rank's
            partitions, used as an [`EMA`][emakit.EMA]'s are: ``synth(x)`` and
            ``synth.swap()`` run the engine's module on them,
            [`save_full_ema_weights()`][emakit.distributed.save_full_ema_weights] writes
            the whole model. The snapshots may come from any number of ranks.

        Raises:
            EMAValueError: bad target, no snapshots, missing folder, ``step`` before the
                first snapshot.
            EMAStateError: the snapshots do not match the model, or changed since they
                were listed; several runs and none of them this one; an ema-pytorch file
                whose profile index is out of range or that ``torch.load(weights_only=True)``
                refuses.

        Warns:
            PostHocWarning: an integer tensor of an ema-pytorch file overflowed float16
                (its value is lost): the model's current value is kept, as ema-pytorch does.
        """
        plan = self._on_rank_zero(
            lambda: plan_synthesis(
                self.checkpoint_folder,
                sigma_rel=sigma_rel,
                gamma=gamma,
                step=step,
                snapshots=self._snapshots(),
            )
        )
        synth = self._new_profile(sigma_rel, gamma, self.update_every)
        # each rank builds the blocks it holds, from whichever snapshot files overlap them
        model = cast(nn.Module, synth.ema_model)
        load_into(model, plan.run(dtype=torch.float32, **region_args(model)))
        synth.tracker.reset(plan.step)
        return synth

    def sweep(
        self,
        evaluate: Callable[[nn.Module], Any],
        sigma_rels: Sequence[float] | str,
        *,
        step: int | None = None,
        mode: Literal["min", "max"] = "min",
        lengths_per_pass: int = 8,
        plot: str | os.PathLike[str] | None = None,
    ) -> SweepResult:
        """Synthesize the EMA at each of ``sigma_rels`` and score it with ``evaluate``.

        The way the EMA length is chosen (arXiv:2312.02696, Fig. 1 and §3): each snapshot
        is read once per ``lengths_per_pass`` lengths and added into all of them (see
        `emakit.posthoc.synthesis.sweep`), each reconstruction is loaded into one EMA model
        (sharded like the model, for FSDP2: then call it on every rank) and
        ``evaluate(model) -> float`` scores it. Under DeepSpeed ZeRO-3 (or
        ``partition=True``) ``model`` is the engine's module with the reconstruction's
        partitions swapped in (as in ``synth.swap()``), on every rank.

        Args:
            evaluate: scores the synthesized EMA model (in eval mode, under no_grad).
            sigma_rels: the lengths to try, each in ``(0, SIGMA_REL_MAX]``, or a spec
                such as ``"0.05:0.25:9"`` (see [`sweep()`][emakit.posthoc.synthesis.sweep.sweep]).
            step: the step to synthesize at. Default None: the latest snapshot's.
            mode: ``"min"`` if lower scores are better (a loss, FID), else ``"max"``.
                Default ``"min"``.
            lengths_per_pass: lengths held in memory at once (one float32 model each).
                Default 8.
            plot: write the score against ``sigma_rel`` to this PNG, the tracked profiles
                marked (needs matplotlib). Default None.

        Returns:
            A [`SweepResult`][emakit.posthoc.SweepResult]: ``(sigma_rel, score)`` pairs
            in order, ``.best``, ``.plot(path)``, ``.table()``.

        Example:
            >>> result = posthoc.sweep(val_loss, sigma_rels=[0.05, 0.1, 0.15, 0.2])  # doctest: +SKIP
            >>> result.best  # doctest: +SKIP
            (0.1, 0.0123)
        """
        folder = self.checkpoint_folder

        def scorer() -> tuple[Callable[[dict[str, torch.Tensor]], Any], dict[str, Any]]:
            synth = self._new_profile(self.sigma_rels[0], None, self.update_every)
            model = cast(nn.Module, synth.ema_model).eval()

            def score(out: dict[str, torch.Tensor]) -> Any:
                load_into(model, out)
                return _evaluated(synth, evaluate)

            return score, region_args(model)

        return run_sweep(
            folder,
            sigma_rels,
            step=step,
            mode=mode,
            lengths_per_pass=lengths_per_pass,
            plot=plot,
            snapshots=lambda: self._on_rank_zero(self._snapshots),
            scorer=scorer,
            evaluate=evaluate,
        )

    # -- forward --------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Run every profile's EMA model (eval mode, no grad); one output per profile."""
        return tuple(ema(*args, **kwargs) for ema in self.profiles)

    # -- state ----------------------------------------------------------------------------

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        _CODEC.encode({"gammas": self.gammas, "run": self.run_id}, destination, prefix)

    def _load_from_state_dict(
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: dict,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        values = _CODEC.decode(state_dict, prefix, local_metadata, missing_keys)
        self._loaded_run = values.get("run")
        self._refuse_other_profiles(values.get("gammas"), state_dict, prefix, strict)
        before = len(unexpected_keys)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        ours = {prefix + k for k in _CODEC.keys}  # this layout's and earlier ones'
        unexpected_keys[before:] = [k for k in unexpected_keys[before:] if k not in ours]

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Resume from a state written by [`state_dict()`][emakit.posthoc.posthoc_ema.PostHocEMA.state_dict] (or by ema-pytorch 0.8.3).

        Snapshots already in `checkpoint_folder` stay and are used; the resumed run
        keeps writing there under the run id the state records. A state without one (a
        rebuilt dict, ema-pytorch's) continues the folder's run when the folder holds the
        snapshots of exactly one identified run, with a [`PostHocWarning`][emakit.posthoc.math.PostHocWarning].
        """
        state.refuse_load_arguments(state_dict, assign)
        # Other profiles first: told as such, not as the keys a profile count changes.
        meta = getattr(state_dict, "_metadata", None) or {}
        saved = _CODEC.decode(state_dict, "", meta.get("", {}), []).get("gammas")
        self._refuse_other_profiles(saved, state_dict, "", strict)
        state.check_loadable(  # refuse first: a failed load leaves every profile as it was
            self.state_dict(keep_vars=True), state_dict, strict=strict, owned=self._owns
        )
        result = state.load_or_restore(
            lambda: super(PostHocEMA, self).load_state_dict(state_dict, strict=strict),
            [ema.tracker for ema in self.profiles],
        )
        every = self.checkpoint_every_num_steps
        for ema in self.profiles:
            if ema.t_from_step and every != "manual":  # no metadata: snapshots averaged too
                t = ema.tracker
                t.last, t.gap = profile_time(t.step, int(ema.update_every), every)
        self._writer.checked = False
        run, self._loaded_run = self._loaded_run, None
        if run is None:
            run = self._folder_run()
        if run is not None and run != self.run_id:
            self.release_folder()
            self.run_id = run
        return result

    def _refuse_other_profiles(
        self, saved: Any, state_dict: Mapping[str, Any], prefix: str, strict: bool
    ) -> None:
        """Refuse a state of other profiles: the gammas it records (emakit's), or, when it
        records none (ema-pytorch's), another number of profiles (``strict`` only)."""
        refuse_other_profiles("PostHocEMA", saved, self.gammas, several=True)
        if saved is not None or not strict:
            return
        head = prefix + "ema_models."
        found = {k[len(head) :].split(".", 1)[0] for k in state_dict if k.startswith(head)}
        count = sum(1 for i in found if i.isdigit())
        if count and count != len(self.gammas):
            srs = tuple(round(s, 12) for s in self.sigma_rels)
            raise EMAStateError(
                f"state_dict holds {count} profile(s) (ema_models.0 to ema_models."
                f"{count - 1}), but this PostHocEMA has {len(self.gammas)}: sigma_rels={srs!r} "
                f"(gammas={self.gammas!r}). The state does not record its profiles (an "
                f"ema-pytorch state): build the PostHocEMA with the {count} sigma_rels=... "
                f"(or gammas=...) it was trained with"
            )

    def _owns(self, key: str) -> bool:
        for i, ema in enumerate(self.profiles):  # as MultiEMA.owns_state_key
            if key.startswith(head := f"ema_models.{i}."):
                return ema.owns_state_key(key[len(head) :])
        return key in _CODEC.keys

    def _folder_run(self) -> str | None:
        """The run to continue after loading a state without a run id (on rank 0): the
        folder's only identified run, when it is not this one already."""
        if not (is_rank_zero() and self.checkpoint_folder.is_dir()):
            return None
        runs = [r for r in runs_in(list_snapshots(self.checkpoint_folder)) if r]
        if len(runs) != 1 or runs[0] == self.run_id:
            return None
        warnings.warn(
            f"the loaded state_dict records no run id; continuing run {runs[0]!r}, whose "
            f"snapshots are in {str(self.checkpoint_folder)!r} (pass run_id= to PostHocEMA "
            f"to choose the run)",
            PostHocWarning,
            stacklevel=3,
        )
        return runs[0]

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """The state of every profile, versioned; the online model is left out.

        Layout (version 2), for ``PostHocEMA(net, sigma_rels=(0.05, 0.28))``: ema-pytorch's
        keys (each profile's [`KarrasEMA.state_dict()`][emakit.posthoc.karras.KarrasEMA.state_dict] under ``ema_models.<i>.``)::

            {"ema_models.0.initted": tensor(True), "ema_models.0.step": tensor(1000),
             "ema_models.0.ema_model.weight": tensor(...), ..., "ema_models.1.step": ...}

        and emakit's extras in torch's ``state._metadata``: ``""`` holds ``version`` (2),
        ``gammas`` and ``run`` (the run id); ``"ema_models.<i>"`` each profile's ``gamma``,
        ``t`` and ``dt``.

        Snapshots live in `checkpoint_folder`, not in the state.
        """
        return super().state_dict(*args, **kwargs)

    def extra_repr(self) -> str:
        every = self.checkpoint_every_num_steps
        return (
            f"sigma_rels={tuple(round(s, 6) for s in self.sigma_rels)}, "
            f"update_every={self.update_every}, checkpoint_every_num_steps={every!r}, "
            f"checkpoint_folder={str(self.checkpoint_folder)!r}"
        )


def _evaluated(synth: KarrasEMA, fn: Callable[[nn.Module], Any]) -> Any:
    """``fn`` of the module that computes with ``synth``'s weights, in eval mode without
    grad: its EMA model, or for a partitioned EMA (DeepSpeed ZeRO-3, ``partition=True``,
    whose EMA model holds only this rank's partitions) the online model with the EMA
    partitions swapped in (a collective, as ``synth(x)`` is)."""
    model = cast(nn.Module, synth.ema_model)
    if isinstance(model, ZeroPartitions):
        online = synth.model
        return synth.swap().run(eval_call, online, fn, (online,), {})
    with torch.no_grad():
        return fn(model)

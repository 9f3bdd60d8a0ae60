"""The synthesis side of [`PostHocEMA`][emakit.PostHocEMA]: `synthesize_ema_model()` and
`sweep()`, over the run's snapshot folder.

A mixin of [`PostHocEMA`][emakit.PostHocEMA] (kept apart so each file stays readable): the methods
use the PostHocEMA's model, profiles, folder and run id, and build their results as the
PostHocEMA builds its profiles (``_new_ema_model``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, cast

import torch
from torch import nn

from .._core.forward import eval_call
from .._dist.deepspeed import ZeroPartitions
from ..errors import EMAError, EMARuntimeError
from .karras import KarrasEMA
from .runs import runs_in
from .snapshots import LegacyProfiles, list_snapshots
from .sweeping import SweepResult, sweep_module
from .synthesis import pick_snapshots, plan_synthesis, synthesize_into
from .writing import is_sharded

__all__ = ["SynthesisMethods"]

T = TypeVar("T")


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


class SynthesisMethods:
    """`synthesize_ema_model()` and `sweep()` of [`PostHocEMA`][emakit.PostHocEMA]."""

    checkpoint_folder: Path
    run_id: str
    update_every: int
    _karras_kwargs: dict[str, Any]

    @property
    def model(self) -> nn.Module:
        raise NotImplementedError  # pragma: no cover - PostHocEMA's

    def _new_ema_model(self) -> nn.Module | Callable[[], nn.Module] | None:
        raise NotImplementedError  # pragma: no cover - PostHocEMA's

    def legacy_profiles(self) -> LegacyProfiles:
        raise NotImplementedError  # pragma: no cover - PostHocEMA's

    @property
    def profiles(self) -> list[KarrasEMA]:
        raise NotImplementedError  # pragma: no cover - PostHocEMA's

    def _on_rank_zero(self, fn: Callable[[], T]) -> T:
        """``fn()``: for a sharded model under ``torch.distributed``, computed by rank 0
        and broadcast (a collective: the folder is listed once, not by every rank, and
        every rank uses the same snapshots; an error raises on every rank)."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized() and is_sharded(self.profiles[0])):
            return fn()
        box: list[Any] = [None]
        if dist.get_rank() == 0:
            try:
                box[0] = fn()
            except EMAError as e:
                box[0] = e
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], BaseException):
            raise box[0]
        return cast(T, box[0])

    def _run(self) -> str | None:
        """This run's id when the folder holds its snapshots, else None (the only run)."""
        return (
            self.run_id if self.run_id in runs_in(list_snapshots(self.checkpoint_folder)) else None
        )

    def synthesize_ema_model(
        self,
        gamma: float | None = None,
        sigma_rel: float | None = None,
        step: int | None = None,
    ) -> KarrasEMA:
        """Reconstruct the power-function EMA with ``gamma`` (or ``sigma_rel``) at ``step``.

        The arguments are in ema-pytorch's order: ``synthesize_ema_model(7.0)`` is
        ``gamma=7.0``; pass ``sigma_rel=`` by keyword.

        Algorithm 3 of arXiv:2312.02696 in float64 (normalized weights, snapshots at or
        before ``step`` only), then a streamed weighted sum of the snapshots (see
        [`SynthesisPlan`][emakit.posthoc.synthesis.SynthesisPlan]): emakit's and, read as this
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
                legacy=self.legacy_profiles(),
                run=self._run(),
            )
        )
        synth = KarrasEMA(
            self.model,
            sigma_rel=sigma_rel,
            gamma=gamma,
            ema_model=self._new_ema_model(),
            update_every=self.update_every,
            **self._karras_kwargs,
        )
        target = synth.ema_model
        if target is None:  # pragma: no cover - KarrasEMA builds its model eagerly
            raise EMARuntimeError("the synthesized KarrasEMA has no ema_model")
        synthesize_into(target, plan, where=self.checkpoint_folder)
        synth.tracker.reset(plan.step)
        return synth

    def sweep(
        self,
        evaluate: Callable[[nn.Module], Any],
        sigma_rels: Sequence[float],
        *,
        step: int | None = None,
        mode: Literal["min", "max"] = "min",
        lengths_per_pass: int = 8,
        plot: str | os.PathLike[str] | None = None,
    ) -> SweepResult:
        """Synthesize the EMA at each of ``sigma_rels`` and score it with ``evaluate``.

        The way the EMA length is chosen (arXiv:2312.02696, Fig. 1 and §3): each snapshot
        is read once per ``lengths_per_pass`` lengths and added into all of them (see
        `emakit.posthoc.sweeping`), each reconstruction is loaded into one EMA model
        (sharded like the model, for FSDP2: then call it on every rank) and
        ``evaluate(model) -> float`` scores it. Under DeepSpeed ZeRO-3 (or
        ``partition=True``) ``model`` is the engine's module with the reconstruction's
        partitions swapped in (as in ``synth.swap()``), on every rank.

        Args:
            evaluate: scores the synthesized EMA model (in eval mode, under no_grad).
            sigma_rels: the lengths to try, each in ``(0, SIGMA_REL_MAX]``.
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
        first = sigma_rels[0] if isinstance(sigma_rels, Sequence) and sigma_rels else 0.1

        def build() -> tuple[nn.Module, Callable[[Callable[[nn.Module], Any]], Any]]:
            synth = KarrasEMA(
                self.model,
                sigma_rel=first,
                ema_model=self._new_ema_model(),
                update_every=self.update_every,
                **self._karras_kwargs,
            )
            return cast(nn.Module, synth.ema_model), lambda fn: _evaluated(synth, fn)

        folder = self.checkpoint_folder
        return sweep_module(
            folder,
            evaluate,
            sigma_rels,
            build=build,
            step=step,
            mode=mode,
            lengths_per_pass=lengths_per_pass,
            snapshots=lambda: self._on_rank_zero(
                lambda: pick_snapshots(folder, self.legacy_profiles(), self._run())
            ),
            plot=plot,
        )

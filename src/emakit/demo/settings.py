"""What determines an ``emakit demo`` run: `DemoSettings`, `DEFAULTS`, the
model labels and the post-hoc EMA profiles.

This module imports no third-party package (not even torch), so the command line can
show ``emakit demo --help`` with its defaults without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "DEFAULTS",
    "MODEL_LABELS",
    "POSTHOC_SIGMA_REL",
    "POSTHOC_TRACKED",
    "SEED_RANGE",
    "TEST_FRACTION_RANGE",
    "DemoSettings",
]

#: Display names of the evaluated models, in table/plot order. A new model (e.g. a
#: post-hoc EMA) is one more entry here plus one more entry in the evaluators that
#: `train()` builds; the table, the summary keys and the plot follow.
MODEL_LABELS: dict[str, str] = {"online": "online", "ema": "EMA", "posthoc": "post-hoc EMA"}

#: Relative EMA length synthesized after training from the post-hoc snapshots. It lies
#: between the two tracked profiles (0.05 and 0.28), so the column shows a length that was
#: never tracked directly; it is fixed in advance, not picked on the held-out set.
POSTHOC_SIGMA_REL = 0.10
POSTHOC_TRACKED = (0.05, 0.28)

#: The seeds a run takes (both ends included): scikit-learn's ``random_state`` range.
SEED_RANGE = (0, 2**32 - 1)
#: The held-out fractions a run takes (both ends included): a stratified split of the
#: 1,797 digits then keeps at least one image of each of the 10 classes on both sides.
TEST_FRACTION_RANGE = (0.01, 0.99)


@dataclass(frozen=True)
class DemoSettings:
    """Everything that determines a demo run (all of it is written to the summary).

    Attributes:
        steps: optimizer steps. Default 1500.
        seed: seeds the train/test split, the label noise, the initial weights and the
            batch order, in `SEED_RANGE`. Default 0.
        beta: ceiling of the EMA decay. Default 0.995 (a horizon of ~200 steps).
        update_after_step: EMA copies the model until this step. Default 100.
        update_every: EMA averages every this many steps. Default 1.
        power: exponent of the inverse-gamma warm-up. Default 3/4 (the value timm and
            diffusers recommend for short runs).
        lr: constant SGD learning rate (no momentum), high on purpose. Default 0.1.
        batch_size: examples per step, small on purpose. Default 16.
        label_noise: fraction of training labels replaced by a random class. Default 0.2.
        test_fraction: fraction of the digits held out for evaluation, in
            `TEST_FRACTION_RANGE`. Default 0.3.
        eval_every: steps between held-out evaluations. Default 50.
        posthoc_every: steps between post-hoc EMA snapshots (profiles sigma_rel 0.05 and
            0.28, updated every step); after training the demo synthesizes sigma_rel 0.10
            from them. 0 turns the post-hoc column off. Default 100.
        threads: torch CPU threads during the run. Default 1: the model is so small that
            intra-op parallelism costs more in synchronization than it saves, and on a
            busy machine extra threads slow the run down many times over.
    """

    steps: int = 1500
    seed: int = 0
    beta: float = 0.995
    update_after_step: int = 100
    update_every: int = 1
    power: float = 3 / 4
    lr: float = 0.1
    batch_size: int = 16
    label_noise: float = 0.2
    test_fraction: float = 0.3
    eval_every: int = 50
    posthoc_every: int = 100
    threads: int = 1


DEFAULTS = DemoSettings()

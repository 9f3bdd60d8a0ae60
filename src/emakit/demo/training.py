"""Settings, data, model and training loop of the ``emakit demo``.

This module owns how a run trains: the digits split (`load_digits_split()`), the
convnet (`make_model()`), the held-out evaluation (`evaluate()`,
`late_statistics()`) and the noisy-SGD loop that tracks the EMA (`train()`). The
settings (`DemoSettings`, `DEFAULTS`, `MODEL_LABELS` and the post-hoc
profiles) live in the torch-free `emakit.demo.settings` and are re-exported here.
scikit-learn is imported only inside `load_digits_split()`.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ema import EMA
from ..posthoc import PostHocEMA
from .settings import DEFAULTS, MODEL_LABELS, POSTHOC_SIGMA_REL, POSTHOC_TRACKED, DemoSettings

__all__ = [
    "DEFAULTS",
    "MODEL_LABELS",
    "POSTHOC_SIGMA_REL",
    "POSTHOC_TRACKED",
    "DemoSettings",
    "evaluate",
    "held_out_loss",
    "late_statistics",
    "load_digits_split",
    "make_model",
    "train",
]


# -- data and model ------------------------------------------------------------------


def load_digits_split(
    seed: int, test_fraction: float = DEFAULTS.test_fraction, label_noise: float = 0.0
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The digits, scaled to [0, 1], split into train and held-out parts by ``seed``.

    The split is stratified and depends only on ``seed`` and ``test_fraction``. Label
    noise touches the training labels only: each is replaced, with probability
    ``label_noise``, by a uniformly random class (which may be the true one).

    Args:
        seed: seeds the split and the label noise.
        test_fraction: fraction held out. Default 0.3.
        label_noise: probability of replacing a training label. Default 0.0.

    Returns:
        ``(x_train, y_train, x_test, y_test)``; images are ``(N, 1, 8, 8)`` float32,
        labels int64.
    """
    from sklearn.datasets import load_digits  # type: ignore[import-untyped]
    from sklearn.model_selection import train_test_split  # type: ignore[import-untyped]

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    idx_train, idx_test = train_test_split(
        list(range(len(y))), test_size=test_fraction, random_state=seed, stratify=digits.target
    )
    x_train, y_train = x[idx_train], y[idx_train].clone()
    x_test, y_test = x[idx_test], y[idx_test]
    if label_noise > 0:
        g = torch.Generator().manual_seed(seed + 1)
        flip = torch.rand(len(y_train), generator=g) < label_noise
        y_train[flip] = torch.randint(0, 10, (int(flip.sum()),), generator=g)
    return x_train, y_train, x_test, y_test


def make_model() -> nn.Module:
    """A small convnet for 1x8x8 images: two 3x3 convolutions, a max-pool, a linear head.

    Returns:
        The module (about 10k parameters), freshly initialized from torch's global RNG.
    """
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 10),
    )


@torch.no_grad()
def evaluate(forward: Callable[[Tensor], Tensor], x: Tensor, y: Tensor) -> dict[str, float]:
    """Held-out accuracy and mean cross-entropy of ``forward`` on ``(x, y)``.

    Args:
        forward: maps a batch of images to logits (the caller sets eval mode).
        x: images.
        y: labels.

    Returns:
        ``{"accuracy": ..., "loss": ...}`` as Python floats.
    """
    logits = forward(x)
    return {
        "accuracy": int((logits.argmax(1) == y).sum()) / len(y),
        "loss": F.cross_entropy(logits, y).item(),
    }


def held_out_loss(
    state_dict: Mapping[str, Tensor],
    *,
    seed: int = DEFAULTS.seed,
    test_fraction: float = DEFAULTS.test_fraction,
) -> float:
    """The held-out cross-entropy of the demo's model holding ``state_dict``: the score
    ``emakit sweep`` uses on a demo folder without ``--eval`` (the demo writes these
    arguments beside its snapshots; lower is better).

    Args:
        state_dict: weights of `make_model()` (a synthesized EMA, say).
        seed: the run's seed, which fixed its held-out split. Default 0.
        test_fraction: the run's held-out fraction. Default 0.3.

    Returns:
        The mean cross-entropy on the run's held-out digits.
    """
    _, _, x_test, y_test = load_digits_split(seed, test_fraction)
    model = make_model().eval()
    model.load_state_dict(state_dict)
    return evaluate(model, x_test, y_test)["loss"]


# -- training ---------------------------------------------------------------------------


def train(
    settings: DemoSettings,
    data: tuple[Tensor, Tensor, Tensor, Tensor],
    on_eval: Callable[[int, Mapping[str, Mapping[str, float]]], None] | None = None,
    on_step: Callable[[int], None] | None = None,
    posthoc_folder: Path | None = None,
) -> dict[str, Any]:
    """Train the online model with noisy SGD and track its EMA.

    Args:
        settings: the run's settings.
        data: ``(x_train, y_train, x_test, y_test)`` from `load_digits_split()`.
        on_eval: called as ``on_eval(step, metrics)`` after each held-out evaluation,
            ``metrics`` mapping each key of `MODEL_LABELS` to its metrics.
        on_step: called as ``on_step(step)`` after each optimizer step and EMA update.
        posthoc_folder: where the post-hoc EMA writes its snapshots; None (or
            ``settings.posthoc_every == 0``) skips the post-hoc model.

    Returns:
        ``{"final": {model: {"accuracy", "loss"}}, "history": {...}}`` where the
        history holds the evaluation steps, each model's accuracy and loss at those
        steps, and the EMA decay at every step.
    """
    x_train, y_train, x_test, y_test = data
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.seed)
        net = make_model()
    ema = EMA(
        net,
        beta=settings.beta,
        update_after_step=settings.update_after_step,
        update_every=settings.update_every,
        power=settings.power,
    )
    posthoc = None
    if posthoc_folder is not None and settings.posthoc_every > 0:
        posthoc = PostHocEMA(
            net,
            sigma_rels=POSTHOC_TRACKED,
            update_every=1,
            checkpoint_every_num_steps=settings.posthoc_every,
            checkpoint_folder=posthoc_folder,
        )
    opt = torch.optim.SGD(net.parameters(), lr=settings.lr)
    g = torch.Generator().manual_seed(settings.seed + 2)

    # evaluated during training; the post-hoc EMA only at the end
    evaluators: dict[str, Callable[[Tensor], Tensor]] = {"online": net, "ema": ema}
    history: dict[str, list[float]] = {"step": [], "decay": []}
    history.update((f"{key}_{name}", []) for key in evaluators for name in ("accuracy", "loss"))
    n = len(y_train)
    perm = torch.randperm(n, generator=g)
    cursor = 0
    net.train()
    metrics: dict[str, dict[str, float]] = {}
    for step in range(1, settings.steps + 1):
        if cursor + settings.batch_size > n:
            perm, cursor = torch.randperm(n, generator=g), 0
        idx = perm[cursor : cursor + settings.batch_size]
        cursor += settings.batch_size
        loss = F.cross_entropy(net(x_train[idx]), y_train[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        ema.update()
        if posthoc is not None:
            posthoc.update()
        history["decay"].append(ema.get_current_decay())
        if on_step is not None:
            on_step(step)
        if step % settings.eval_every == 0 or step == settings.steps:
            net.eval()  # the online model evaluated as the EMA's is, in eval mode
            metrics = {key: evaluate(f, x_test, y_test) for key, f in evaluators.items()}
            net.train()
            history["step"].append(step)
            for key, m in metrics.items():
                history[f"{key}_accuracy"].append(m["accuracy"])
                history[f"{key}_loss"].append(m["loss"])
            if on_eval is not None:
                on_eval(step, metrics)
    final = {key: {**metrics[key], **late_statistics(history, key)} for key in metrics}
    if posthoc is not None:
        if not any(snap.step == settings.steps for snap in posthoc.snapshots()):
            posthoc.checkpoint()  # the synthesis targets the final step
        synthesized = posthoc.synthesize_ema_model(sigma_rel=POSTHOC_SIGMA_REL)
        final["posthoc"] = evaluate(synthesized, x_test, y_test)
    return {"final": final, "history": history}


def late_statistics(history: Mapping[str, Sequence[float]], key: str) -> dict[str, float]:
    """Mean and standard deviation of a model's held-out accuracy over the second half of
    training: a final accuracy is one noisy sample, these show the level and the jitter.

    Args:
        history: the evaluation history (``step`` and ``<key>_accuracy`` lists).
        key: the model key, e.g. ``"online"``.

    Returns:
        ``{"accuracy_late_mean": ..., "accuracy_late_std": ...}`` over the evaluations at
        steps greater than half the last evaluated step (population std; 0 for one value).
    """
    steps = history["step"]
    half = steps[-1] / 2 if steps else 0
    acc = [a for s, a in zip(steps, history[f"{key}_accuracy"], strict=True) if s > half]
    if not acc:
        return {}
    mean, std = statistics.fmean(acc), statistics.pstdev(acc)
    return {"accuracy_late_mean": mean, "accuracy_late_std": std}

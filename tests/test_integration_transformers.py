"""EMATrainerCallback with the real Hugging Face Trainer on CPU: EMA files in every
checkpoint folder, exact resume, evaluation on the EMA weights, the final EMA as the model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _frameworks import need

transformers = need("transformers")
pytest.importorskip("accelerate")  # the Trainer needs it

from safetensors.torch import load_file  # noqa: E402

from _trainer import quiet_trainer  # noqa: E402
from emakit import EMAError  # noqa: E402
from emakit.integrations.transformers import EMA_WEIGHTS_NAME, EMATrainerCallback  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

EMA_KW: dict[str, Any] = {"beta": 0.8, "update_after_step": 1, "update_every": 2}


class TinyConfig(transformers.PretrainedConfig):
    model_type = "emakit-tiny"

    def __init__(self, hidden: int = 8, **kw: Any) -> None:
        super().__init__(**kw)
        self.hidden = hidden


class TinyModel(transformers.PreTrainedModel):
    """Linear -> LayerNorm -> Tanh -> Linear regression, returning ``loss`` with labels."""

    config_class = TinyConfig

    def __init__(self, config: TinyConfig) -> None:
        super().__init__(config)
        self.net = nn.Sequential(
            nn.Linear(4, config.hidden),
            nn.LayerNorm(config.hidden),
            nn.Tanh(),
            nn.Linear(config.hidden, 1),
        )
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        pass  # keep torch's seeded default init

    def forward(
        self, x: torch.Tensor, labels: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        out = self.net(x)
        result = {"logits": out}
        if labels is not None:
            result["loss"] = F.mse_loss(out, labels)
        return result


def make_model() -> TinyModel:
    torch.manual_seed(0)
    return TinyModel(TinyConfig())


class Rows(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 4, generator=g)
        self.y = self.x.sum(1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


TRAIN, EVAL, EVAL_B = Rows(32, 1), Rows(16, 2), Rows(16, 3)


def make_trainer(out: Path, callbacks: list, eval_dataset: Any = EVAL, **kw: Any) -> Any:
    opts: dict[str, Any] = {
        "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 16,
        "gradient_accumulation_steps": 2,
        "max_steps": 6,
        "learning_rate": 0.1,
        "optim": "sgd",
        "save_steps": 3,
    }
    return quiet_trainer(
        out,
        callbacks,
        model=make_model(),
        train_dataset=TRAIN,
        eval_dataset=eval_dataset,
        **{**opts, **kw},
    )


def ema_weights(cb: EMATrainerCallback) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in cb.ema.ema_model.state_dict().items()}


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_checkpoint_folders_hold_the_ema_and_resume_is_exact(tmp_path: Path):
    cb = EMATrainerCallback(**EMA_KW)
    trainer = make_trainer(tmp_path / "run", [cb])
    trainer.train()
    assert int(cb.ema.step) == 6  # one update per optimizer step (2 micro-batches each)
    assert cb.ema.include_online_model is False  # the Trainer saves the model itself
    for step in (3, 6):
        assert (tmp_path / "run" / f"checkpoint-{step}" / EMA_WEIGHTS_NAME).is_file()
    final = ema_weights(cb)
    assert_same(load_file(tmp_path / "run" / "checkpoint-6" / EMA_WEIGHTS_NAME), final)

    resumed_cb = EMATrainerCallback(**EMA_KW)
    resumed = make_trainer(tmp_path / "elsewhere", [resumed_cb])
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-3"))
    assert resumed_cb.restored_from == tmp_path / "run" / "checkpoint-3" / EMA_WEIGHTS_NAME
    assert int(resumed_cb.ema.step) == 6
    assert_same(ema_weights(resumed_cb), final)
    assert_same(weights(resumed.model), weights(trainer.model))


def test_resume_true_finds_the_last_checkpoint(tmp_path: Path):
    first = make_trainer(tmp_path, [EMATrainerCallback(**EMA_KW)], max_steps=3)
    first.train()
    cb = EMATrainerCallback(**EMA_KW)
    make_trainer(tmp_path, [cb]).train(resume_from_checkpoint=True)
    assert cb.restored_from == tmp_path / "checkpoint-3" / EMA_WEIGHTS_NAME


class Recorder(transformers.TrainerCallback):
    """Keeps each evaluation's metrics and, when given the EMA callback, the losses the EMA
    model has at that moment on each eval set."""

    def __init__(self, ema_cb: EMATrainerCallback | None = None) -> None:
        self.ema_cb = ema_cb
        self.metrics: list[dict[str, float]] = []
        self.ema_losses: list[dict[str, float]] = []

    def on_evaluate(
        self, args: Any, state: Any, control: Any, metrics: Any = None, **kw: Any
    ) -> None:
        self.metrics.append(dict(metrics))
        if self.ema_cb is not None:
            ema_model = self.ema_cb.ema.ema_model
            self.ema_losses.append(
                {n: eval_loss(ema_model, d) for n, d in (("a", EVAL), ("b", EVAL_B))}
            )


def eval_loss(model: nn.Module, data: Rows = EVAL) -> float:
    model.eval()
    with torch.no_grad():
        return float(F.mse_loss(model(data.x)["logits"], data.y))


def test_evaluation_during_training_uses_the_ema(tmp_path: Path):
    cb = EMATrainerCallback(**EMA_KW)
    rec = Recorder(cb)
    trainer = make_trainer(
        tmp_path / "a",
        [cb, rec],
        eval_dataset={"a": EVAL, "b": EVAL_B},  # one evaluate() per set
        eval_strategy="steps",
        eval_steps=3,
        save_strategy="no",
    )
    trainer.train()
    assert len(rec.metrics) == 4  # steps 3 and 6, sets a and b
    for i, (metrics, ema) in enumerate(zip(rec.metrics, rec.ema_losses, strict=True)):
        name = "ab"[i % 2]
        assert metrics[f"eval_{name}_loss"] == pytest.approx(ema[name], rel=1e-5)
    assert rec.ema_losses[0] != rec.ema_losses[2]  # the EMA moved between evaluations
    assert abs(eval_loss(trainer.model) - eval_loss(cb.ema.ema_model)) > 1e-3  # raw differs

    # Evaluating (on the EMA) did not disturb training on the raw weights.
    plain = make_trainer(tmp_path / "b", [EMATrainerCallback(**EMA_KW)], save_strategy="no")
    plain.train()
    assert_same(weights(trainer.model), weights(plain.model))


def test_eval_with_ema_false_evaluates_the_raw_weights(tmp_path: Path):
    cb, rec = EMATrainerCallback(eval_with_ema=False, **EMA_KW), Recorder()
    trainer = make_trainer(
        tmp_path, [cb, rec], eval_strategy="steps", eval_steps=6, save_strategy="no"
    )
    trainer.train()
    assert rec.metrics[0]["eval_loss"] == pytest.approx(eval_loss(trainer.model), rel=1e-5)


def test_save_final_as_model(tmp_path: Path):
    cb = EMATrainerCallback(save_final_as_model=True, **EMA_KW)
    trainer = make_trainer(tmp_path, [cb], save_strategy="no")
    trainer.train()
    assert_same(weights(trainer.model), ema_weights(cb))
    reloaded = TinyModel.from_pretrained(tmp_path)
    assert_same(weights(reloaded), ema_weights(cb))


def test_load_best_model_at_end_loads_the_best_checkpoints_ema(tmp_path: Path):
    cb = EMATrainerCallback(**EMA_KW)
    trainer = make_trainer(
        tmp_path,
        [cb],
        eval_strategy="steps",
        eval_steps=3,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
        greater_is_better=True,  # "best" = the higher loss, i.e. not the last checkpoint
    )
    trainer.train()
    best = Path(trainer.state.best_model_checkpoint)
    assert best.name == "checkpoint-3"
    assert int(cb.ema.step) == 3
    assert_same(ema_weights(cb), load_file(best / EMA_WEIGHTS_NAME))


def test_bad_keywords_are_refused():
    with pytest.raises(EMAError, match="betta"):
        EMATrainerCallback(betta=0.9)
    with pytest.raises(EMAError, match="eval_with_ema"):
        EMATrainerCallback(eval_with_ema=1)


def test_log_history_gets_the_ema_decay_step_and_skips(tmp_path: Path):
    """Each entry the Trainer logs (``logging_steps=2``) carries the EMA's decay (against
    ema-pytorch's closed form at that step), its step and the skip count; with
    ``log_stats=False`` none do."""
    cb = EMATrainerCallback(skip_nonfinite=True, **EMA_KW)
    trainer = make_trainer(
        tmp_path / "run", [cb], logging_strategy="steps", logging_steps=2, save_strategy="no"
    )
    trainer.train()
    entries = [e for e in trainer.state.log_history if "loss" in e]
    assert [e["step"] for e in entries] == [2, 4, 6]
    for e in entries:
        step = int(e["ema/step"])
        assert step == e["step"]  # one update per optimizer step
        t = max(step - 1 - 1, 0)  # ema-pytorch's get_current_decay: update_after_step=1
        expected = 0.0 if t <= 0 else min(0.8, 1 - (1 + t) ** (-2 / 3))
        assert e["ema/decay"] == pytest.approx(expected, rel=1e-6, abs=1e-12)
        assert e["ema/num_skipped_nonfinite"] == 0.0

    quiet = EMATrainerCallback(log_stats=False, **EMA_KW)
    trainer = make_trainer(
        tmp_path / "quiet", [quiet], logging_strategy="steps", logging_steps=2, save_strategy="no"
    )
    trainer.train()
    assert not any(k.startswith("ema/") for e in trainer.state.log_history for k in e)


def test_swap_then_save_pretrained_keeps_tied_weights(tmp_path: Path):
    """``with ema.swap(): model.save_pretrained(d)`` writes the EMA weights, and a model
    with tied input and output embeddings reloads with them still tied."""
    from emakit import EMA

    config = transformers.GPT2Config(
        n_layer=1,
        n_head=2,
        n_embd=16,
        vocab_size=64,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight
    ema = EMA(model, beta=0.5, update_after_step=0, update_every=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(3):
        ids = torch.randint(0, 64, (2, 8))
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        ema.update()
    with ema.swap():
        model.save_pretrained(tmp_path / "ema-model")
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "ema-model")
    assert reloaded.lm_head.weight is reloaded.transformer.wte.weight
    expected = ema.ema_model.state_dict()
    assert_same(weights(reloaded), {k: v.detach().clone() for k, v in expected.items()})
    assert not torch.equal(reloaded.transformer.wte.weight, model.transformer.wte.weight)
    # what EMATrainerCallback writes into checkpoint-N: the tied tensor once, as the
    # model's own model.safetensors stores it (the issue saw 29 keys against 28)
    from safetensors import safe_open

    from emakit import load_ema_weights, save_ema_weights

    with safe_open(tmp_path / "ema-model" / "model.safetensors", "pt") as f:
        model_keys = set(f.keys())
    path = save_ema_weights(ema, tmp_path / EMA_WEIGHTS_NAME, tied_once=True)
    assert set(load_file(path)) == model_keys
    assert (
        len(load_file(save_ema_weights(ema, tmp_path / "all.safetensors"))) == len(model_keys) + 1
    )
    fresh = EMA(transformers.GPT2LMHeadModel(config), update_after_step=0, update_every=1)
    load_ema_weights(fresh, path)  # the tied name is filled in from its twin
    assert_same(weights(fresh.ema_model), {k: v.detach().clone() for k, v in expected.items()})
    assert int(fresh.step) == 3


def test_also_evaluate_online_records_the_raw_weights_loss_beside_the_emas(tmp_path: Path):
    cb = EMATrainerCallback(also_evaluate_online=True, **EMA_KW)
    rec = Recorder(cb)
    trainer = make_trainer(
        tmp_path, [cb, rec], eval_strategy="steps", eval_steps=6, save_strategy="no"
    )
    trainer.train()
    (metrics,) = rec.metrics
    # The Trainer's eval_loss is the EMA's; eval_online_loss is the raw weights' loss.
    assert metrics["eval_loss"] == pytest.approx(eval_loss(cb.ema.ema_model), rel=1e-5)
    assert metrics["eval_online_loss"] == pytest.approx(eval_loss(trainer.model), rel=1e-5)
    assert abs(metrics["eval_online_loss"] - metrics["eval_loss"]) > 1e-4
    entries = [e for e in trainer.state.log_history if "eval_online_loss" in e]
    assert [e["step"] for e in entries] == [6]
    assert entries[0]["eval_online_loss"] == metrics["eval_online_loss"]
    # Evaluating the raw weights did not leave the EMA's swapped in, nor change training.
    plain = make_trainer(tmp_path / "b", [EMATrainerCallback(**EMA_KW)], save_strategy="no")
    plain.train()
    assert_same(weights(trainer.model), weights(plain.model))

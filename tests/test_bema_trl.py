"""emakit's BEMA against TRL's ``BEMACallback`` in the real Hugging Face Trainer (CPU, a
config-built GPT-2, nothing downloaded): the same numbers, the same ``bema/`` output, and
what TRL lacks (exact resume, PEFT models)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from _frameworks import need

transformers = need("transformers")
pytest.importorskip("accelerate")  # the Trainer needs it
trl = need("trl")

from safetensors.torch import load_file  # noqa: E402

from _trainer import quiet_trainer  # noqa: E402
from emakit.decay import bema_alpha, bema_beta  # noqa: E402
from emakit.integrations.transformers import BEMA_STATE_NAME, BEMACallback  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning"
)

VOCAB, LENGTH = 64, 8


def make_model() -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=LENGTH,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.ids = torch.randint(0, VOCAB, (n, LENGTH), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def make_trainer(out: Path, callbacks: list, model: Any = None, **kw: Any) -> Any:
    opts: dict[str, Any] = {
        "per_device_train_batch_size": 4,
        "max_steps": 8,
        "learning_rate": 0.05,
        "save_steps": 4,
    }
    return quiet_trainer(
        out,
        callbacks,
        model=make_model() if model is None else model,
        train_dataset=Tokens(32),
        **{**opts, **kw},
    )


BEMA_KW = {"update_freq": 2, "lag": 10, "update_after": 0}


def test_rule_has_trls_numbers_to_the_bit():
    cb = trl.BEMACallback(
        ema_power=0.4, bias_power=0.3, lag=7, multiplier=0.5, min_ema_multiplier=0.01
    )
    for t in [1, 2, 3, 10, 399, 400, 401, 12345, 10**7]:
        beta = bema_beta(t, lag=7, multiplier=0.5, ema_power=0.4, min_ema_multiplier=0.01)
        assert beta == cb._ema_beta(t)
        assert bema_alpha(t, lag=7, multiplier=0.5, bias_power=0.3) == cb._bema_alpha(t)


def test_signature_and_defaults_are_trls():
    import inspect

    theirs = inspect.signature(trl.BEMACallback.__init__).parameters
    ours = inspect.signature(BEMACallback.__init__).parameters
    for name, p in theirs.items():
        assert name in ours, name
        assert ours[name].default == p.default, name


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, BEMACallback]:
    """One 8-step run with TRL's callback and one with emakit's, in the same folder."""
    root = tmp_path_factory.mktemp("bema-trl")
    make_trainer(root / "trl", [trl.BEMACallback(**BEMA_KW)]).train()
    ours = BEMACallback(**BEMA_KW)
    make_trainer(root / "emakit", [ours]).train()
    return root, ours


def test_bema_folder_agrees_with_trls(runs: tuple, capsys: pytest.CaptureFixture):
    tmp_path, ours = runs
    a = load_file(tmp_path / "trl" / "bema" / "model.safetensors")
    b = load_file(tmp_path / "emakit" / "bema" / "model.safetensors")
    assert a.keys() == b.keys()
    worst = worst_abs = 0.0
    for k in a:
        diff = (a[k] - b[k]).abs().max().item()
        scale = a[k].abs().max().item()
        worst, worst_abs = max(worst, diff / max(scale, 1e-30)), max(worst_abs, diff)
        # float32 rounding: TRL's ema.mul_(1 - beta).add_(theta, alpha=beta) vs one lerp_
        torch.testing.assert_close(b[k], a[k], rtol=1e-6, atol=1e-6)
    with capsys.disabled():
        print(f"\nemakit vs TRL bema/: largest |diff| {worst_abs:.3g}, relative {worst:.3g}")
    assert int(ours.bema.step) == 8
    assert (tmp_path / "emakit" / "checkpoint-4" / BEMA_STATE_NAME).is_file()
    # the BEMA differs from the raw weights (the comparison is not vacuous)
    raw = load_file(tmp_path / "emakit" / "checkpoint-8" / "model.safetensors")
    assert not torch.equal(
        raw["transformer.h.0.attn.c_attn.weight"], b["transformer.h.0.attn.c_attn.weight"]
    )


def test_resume_from_checkpoint_is_exact(runs: tuple, tmp_path: Path):
    full = runs[0] / "emakit" / "bema" / "model.safetensors"  # the uninterrupted run
    make_trainer(tmp_path / "part", [BEMACallback(**BEMA_KW)], max_steps=4).train()
    resumed = BEMACallback(**BEMA_KW)
    trainer = make_trainer(tmp_path / "part", [resumed])
    trainer.train(resume_from_checkpoint=str(tmp_path / "part" / "checkpoint-4"))
    assert resumed.restored_from == tmp_path / "part" / "checkpoint-4" / BEMA_STATE_NAME
    a = load_file(full)
    b = load_file(tmp_path / "part" / "bema" / "model.safetensors")
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_peft_model_writes_the_adapters(tmp_path: Path):
    peft = need("peft")
    model = peft.get_peft_model(
        make_model(), peft.LoraConfig(r=2, target_modules=["c_attn"], lora_dropout=0.0)
    )
    cb = BEMACallback(**BEMA_KW)
    make_trainer(tmp_path / "run", [cb], model=model, learning_rate=0.2).train()
    saved = load_file(tmp_path / "run" / "bema" / "adapter_model.safetensors")
    assert saved and all("lora_" in k for k in saved)
    bema_model = cb.bema.ema_model
    for name, p in bema_model.named_parameters():
        if "lora_B" in name:  # LoRA's B starts at zero: the BEMA of it moved
            assert p.abs().max() > 0, name


def test_a_run_ending_between_updates_writes_trls_bema(tmp_path: Path):
    """The last BEMA update is at step 6 of 7: TRL's ``bema/`` holds that update's
    evaluated weights, not ones rebuilt from step 7's weights; so does emakit's."""
    make_trainer(tmp_path / "trl", [trl.BEMACallback(**BEMA_KW)], max_steps=7).train()
    ours = BEMACallback(**BEMA_KW)
    make_trainer(tmp_path / "emakit", [ours], max_steps=7).train()
    a = load_file(tmp_path / "trl" / "bema" / "model.safetensors")
    b = load_file(tmp_path / "emakit" / "bema" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-6, atol=1e-6)
    # not vacuous: built from the weights of step 7 instead, they differ
    state, key = ours.bema.state_dict(), "transformer.h.0.attn.c_attn.weight"
    theta7 = ours.bema.model.get_parameter(key).detach()
    rebuilt = state[f"bema_ema.{key}"] + ours.bema.bias_weight * (
        theta7 - state[f"bema_theta0.{key}"]
    )
    assert ours.bema.bias_weight == bema_alpha(6, lag=10, multiplier=1.0, bias_power=0.2)
    assert (rebuilt - a[key]).abs().max() > 1e-4

"""``emakit inspect`` on what each framework integration writes (a Lightning ``.ckpt``, an
Accelerate ``save_state`` folder, a Trainer ``checkpoint-N`` folder), on a file that is no
checkpoint (the demo's ``summary.json``), and on a closed pipe."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from _frameworks import need
from emakit.inspection import inspect_cmd

ROOT = Path(__file__).resolve().parents[1]
KW = {"beta": 0.9, "update_after_step": 0, "update_every": 1}


def _inspect(path: Path) -> str:
    result = CliRunner().invoke(inspect_cmd, [str(path)])
    assert result.exit_code == 0, result.output
    return result.output


def test_lightning_checkpoint_shows_its_ema(tmp_path: Path):
    pl = pytest.importorskip("lightning.pytorch")
    from emakit.integrations.lightning import CHECKPOINT_KEY, EMACallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(24, 4)), 8)
    cb = EMACallback(**KW)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(
            max_epochs=1, callbacks=[cb], logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
        )  # fmt: skip
        trainer.fit(Module(), data)
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    assert CHECKPOINT_KEY == "emakit_ema"
    out = _inspect(path)
    assert "Lightning checkpoint, EMACallback layout version 1 (global_step 3" in out
    assert "step: 3" in out and "initted: True" in out
    assert "EMA: 4 tensors, 49 floating values, float32" in out
    assert "net.0.weight  float32  [8, 4]" in out and "net.2.bias  float32  [1]" in out
    assert "0 tensors" not in out  # what it printed before


def test_accelerate_state_folder_shows_its_ema(tmp_path: Path):
    accelerate = pytest.importorskip("accelerate")
    from emakit.integrations.accelerate import prepare_ema

    accelerator = accelerate.Accelerator(cpu=True)
    torch.manual_seed(0)
    model = accelerator.prepare(nn.Linear(4, 2))
    ema = prepare_ema(accelerator, model, **KW)
    for _ in range(2):
        ema.update()
    accelerator.save_state(str(tmp_path / "state"))
    out = _inspect(tmp_path / "state")
    assert f"Accelerate save_state folder {tmp_path / 'state'}" in out
    assert "custom_checkpoint_0.pkl" in out and "step: 2" in out
    assert "EMA: 2 tensors, 10 floating values" in out and "weight  float32  [2, 4]" in out


def test_trainer_checkpoint_folder_shows_its_ema(tmp_path: Path):
    need("transformers")
    from emakit import EMA, save_ema_weights
    from emakit.integrations.transformers import EMA_WEIGHTS_NAME

    folder = tmp_path / "checkpoint-6"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")  # the Trainer's own files beside it
    torch.manual_seed(0)
    ema = EMA(nn.Linear(3, 2), **KW)
    for _ in range(6):
        ema.update()
    assert EMA_WEIGHTS_NAME == "ema.safetensors"
    save_ema_weights(ema, folder / EMA_WEIGHTS_NAME)  # what EMATrainerCallback.on_save does
    out = _inspect(folder)
    assert f"Transformers Trainer checkpoint folder {folder}" in out
    assert "format emakit.ema_weights" in out and "step: 6" in out and "beta: 0.9" in out
    assert "weight  F32  [2, 3]" in out and "bias  F32  [2]" in out


def test_a_json_file_is_named_for_what_it_is(tmp_path: Path):
    path = tmp_path / "summary.json"
    path.write_text(json.dumps({"online": {"accuracy": 0.9}}))
    result = CliRunner().invoke(inspect_cmd, [str(path)])
    assert result.exit_code == 1
    out = " ".join(result.output.split())
    assert "is a JSON file (the demo's summary.json" in out
    assert "could not be read as a torch file" not in out
    assert "emakit inspect reads post-hoc snapshot folders, .safetensors files" in out
    (tmp_path / "notes.txt").write_text("hello")
    result = CliRunner().invoke(inspect_cmd, [str(tmp_path / "notes.txt")])
    assert result.exit_code == 1 and "not a torch file (it starts with b'hello')" in result.output


def test_a_closed_pipe_ends_quietly(tmp_path: Path):
    """``emakit inspect X | head -1``: the reader goes away; no ``Error: [Errno 32]``."""
    from emakit import EMA, save_ema_weights

    ema = EMA(nn.Sequential(*[nn.Linear(2, 2) for _ in range(20)]), **KW)
    save_ema_weights(ema, tmp_path / "ema.safetensors")
    code = "import sys; from emakit.cli import main; sys.exit(main())"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "inspect", str(tmp_path / "ema.safetensors")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT / "src")},
    )
    proc.stdout.close()  # before the child writes a line (its imports take a second)
    err = proc.stderr.read().decode()
    proc.wait(timeout=120)
    proc.stderr.close()
    assert "Broken pipe" not in err and "Error" not in err, err

"""What a user of a built wheel does first, in a clean virtualenv holding only torch and
emakit's declared dependencies (noxfile.py runs it in every session, before the test
extra is installed): import it, ask the CLI its version, save and load an export, write
post-hoc snapshots and synthesize from them. Exits non-zero on any failure.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import warnings
from importlib import metadata
from pathlib import Path

import torch

import emakit
from emakit import EMA, PostHocEMA
from emakit.checkpoint import load_ema_weights, save_ema_weights
from emakit.posthoc import PostHocWarning, list_snapshots, synthesize

warnings.simplefilter("ignore", PostHocWarning)  # a few snapshots on purpose: a rough fit

here = Path(emakit.__file__).resolve()
assert "site-packages" in here.parts, f"emakit comes from {here}, not from the installed wheel"
version = subprocess.run(
    [Path(sys.executable).with_name("emakit"), "--version"],
    capture_output=True,
    text=True,
    check=True,
).stdout
assert emakit.__version__ in version, version
license_files = [str(f) for f in metadata.files("emakit") or [] if f.name == "LICENSE"]
assert license_files, "the wheel carries no LICENSE"

os.chdir(tempfile.mkdtemp())
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
ema = EMA(net, beta=0.9, update_after_step=0)
posthoc = PostHocEMA(net, checkpoint_every_num_steps=5, checkpoint_folder="snapshots")
opt = torch.optim.SGD(net.parameters(), lr=0.1)
for _ in range(20):
    net(torch.randn(16, 8)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    ema.update()
    posthoc.update()

save_ema_weights(ema, "ema.safetensors")
again = EMA(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)))
load_ema_weights(again, "ema.safetensors")
for a, b in zip(
    ema.ema_model.state_dict().values(), again.ema_model.state_dict().values(), strict=True
):
    assert torch.equal(a, b)
assert len(list_snapshots("snapshots")) >= 4
state = synthesize("snapshots", sigma_rel=0.1)
net.load_state_dict(state)
print(f"emakit {emakit.__version__} from the wheel on torch {torch.__version__}: {version.strip()}")
print(f"export and snapshots saved and loaded; license {license_files[0]}")

"""Hugging Face Accelerate: an EMA that counts optimizer steps and rides along in save_state.

``prepare_ema`` builds the EMA of the prepared model, registers it for
``accelerator.save_state``/``load_state``, and returns an EMA whose ``update()`` does
nothing on gradient-accumulation micro-steps (it acts only when
``accelerator.sync_gradients``).

    pip install -e ".[accelerate]"
    python examples/accelerate_ema.py --steps 200
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from emakit.integrations.accelerate import prepare_ema


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="batches (micro-steps)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # a tiny model: more threads only add overhead (and noise)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(4, 16, generator=g) * 1.5
    y = torch.randint(0, 4, (1200,), generator=g)
    x = centers[y] + torch.randn(1200, 16, generator=g) * 1.8
    loader = DataLoader(TensorDataset(x[:1000], y[:1000]), batch_size=32, shuffle=True)

    accelerator = Accelerator(gradient_accumulation_steps=4, cpu=True)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    ema = prepare_ema(accelerator, model, beta=0.99, update_after_step=5, update_every=1)

    batches = 0
    while batches < args.steps:
        for xb, yb in loader:
            with accelerator.accumulate(model):
                accelerator.backward(F.cross_entropy(model(xb), yb))
                opt.step()
                opt.zero_grad()
                ema.update()  # acts once per 4 batches, when the gradients are synced
            batches += 1
            if batches == args.steps:
                break

    with tempfile.TemporaryDirectory() as tmp:
        accelerator.save_state(tmp)  # writes the EMA too (registered for checkpointing)
        step = int(ema.step)
        weight = ema.ema_model[0].weight.clone()
        ema.ema_model[0].weight.data.zero_()  # forget it ...
        accelerator.load_state(tmp)  # ... and get it back
        restored = torch.equal(ema.ema_model[0].weight, weight) and int(ema.step) == step
    x_val, y_val = x[1000:], y[1000:]
    with torch.no_grad():
        online = float((model(x_val).argmax(1) == y_val).float().mean())
        averaged = float((ema(x_val).argmax(1) == y_val).float().mean())
    print(f"{batches} batches, {step} EMA updates (one per optimizer step)")
    print(f"held-out accuracy: online {online:.3f}, EMA {averaged:.3f}")
    print(f"EMA restored by accelerator.load_state: {restored}")
    if not restored:
        raise SystemExit("the EMA was not restored")
    return {"online": online, "ema": averaged, "updates": step}


if __name__ == "__main__":
    main()

"""A plain PyTorch loop with an EMA: evaluate on the EMA weights, save, resume exactly.

Trains a small classifier on synthetic data with noisy SGD, keeps ``EMA(net)``, evaluates
the online and the EMA weights on held-out data, saves a checkpoint halfway, and resumes
from it in a fresh model/optimizer/EMA: the resumed EMA ends bit-identical to the EMA of
the uninterrupted run.

    python examples/plain_loop.py --steps 400
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from emakit import EMA, save_checkpoint


def make_data(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Two Gaussian blobs per class, 4 classes, 16 features; 20% of train labels flipped."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(4, 16, generator=g) * 1.5
    y = torch.randint(0, 4, (2000,), generator=g)
    x = centers[y] + torch.randn(2000, 16, generator=g) * 1.8
    y_train = y[:1500].clone()
    flip = torch.rand(1500, generator=g) < 0.2
    y_train[flip] = torch.randint(0, 4, (int(flip.sum()),), generator=g)
    return x[:1500], y_train, x[1500:], y[1500:]


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))


@torch.no_grad()
def accuracy(forward, x: torch.Tensor, y: torch.Tensor) -> float:
    return (forward(x).argmax(1) == y).float().mean().item()


def train(steps: int, resume_from: Path | None = None, stop_at: int | None = None) -> dict:
    """Train up to ``steps`` (or stop and save at ``stop_at``); return the final state."""
    x_train, y_train, x_test, y_test = make_data()
    torch.manual_seed(0)
    net = make_model()
    opt = torch.optim.SGD(net.parameters(), lr=0.2)
    ema = EMA(net, beta=0.99, update_after_step=20, update_every=1)
    gen = torch.Generator().manual_seed(1)
    start = 0
    if resume_from is not None:
        ckpt = torch.load(resume_from, weights_only=True)  # tensors and containers only
        net.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        ema.load_state_dict(ckpt["ema"])
        gen.set_state(ckpt["gen"])
        start = ckpt["step"]
    for step in range(start + 1, steps + 1):
        idx = torch.randint(0, len(y_train), (32,), generator=gen)
        loss = F.cross_entropy(net(x_train[idx]), y_train[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        ema.update()  # after every optimizer step
        if stop_at is not None and step == stop_at:
            return {
                "model": net.state_dict(),
                "opt": opt.state_dict(),
                "ema": ema.state_dict(),  # save after ema.update(): resume is exact
                "gen": gen.get_state(),
                "step": step,
            }
    net.eval()
    result = {
        "online": accuracy(net, x_test, y_test),
        "ema": accuracy(ema, x_test, y_test),  # ema(x): the EMA model, eval mode, no grad
        "ema_state": {k: v.clone() for k, v in ema.ema_model.state_dict().items()},
    }
    with ema.swap():  # the same evaluation with net holding the EMA weights
        result["ema_swapped"] = accuracy(net, x_test, y_test)
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # a tiny model: more threads only add overhead (and noise)
    full = train(args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ckpt.pt"
        # crash-safe torch.save: a kill mid-write leaves the previous file, never a torn one
        save_checkpoint(train(args.steps, stop_at=args.steps // 2), path)
        resumed = train(args.steps, resume_from=path)
    same = all(torch.equal(full["ema_state"][k], v) for k, v in resumed["ema_state"].items())
    print(f"held-out accuracy: online {full['online']:.3f}, EMA {full['ema']:.3f}")
    print(f"EMA via swap(): {full['ema_swapped']:.3f} (same weights as ema(x))")
    print(f"resumed at step {args.steps // 2}: EMA bit-identical to the uninterrupted run: {same}")
    if not same:
        raise SystemExit("resume was not exact")
    return {**full, "resumed_identical": same}


if __name__ == "__main__":
    main()

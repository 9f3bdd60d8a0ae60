"""``emakit bench``: the cost of one EMA update on your machine, path by path.

Times one averaging ``update()`` of each engine path (reference loop, foreach, the
default flat path, and the flat path after :func:`~emakit.flatten_parameters`) on a
standard model, and compares each with the memory-bandwidth floor: a single ``lerp_``
over one flat tensor holding as many elements. A ratio near 1 means the update costs no
more than streaming the weights through memory once.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from .ema import EMA
from .engine.flat import flatten_parameters
from .errors import EMAValueError

__all__ = ["MODELS", "bench_update", "build_model"]


def _tiny() -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64)) for _ in range(300)])


def _transformer() -> nn.Module:
    layer = nn.TransformerEncoderLayer(384, 6, 1536, batch_first=True)
    return nn.TransformerEncoder(layer, 12, enable_nested_tensor=False)


def _mlp() -> nn.Module:
    return nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(6)])


def _resnet() -> nn.Module:
    try:
        import torchvision
    except ImportError as e:
        raise EMAValueError("--model resnet needs torchvision: pip install torchvision") from e
    return torchvision.models.resnet50()


#: The benchmark models: name -> (description, factory).
MODELS: dict[str, tuple[str, Callable[[], nn.Module]]] = {
    "tiny": ("300 x (Linear(64, 64) + LayerNorm(64)): 1200 tiny tensors", _tiny),
    "transformer": ("TransformerEncoder 12 x (384, 6 heads, 1536): 144 tensors, 21M", _transformer),
    "mlp": ("6 x Linear(2048, 2048): 12 tensors, 25M", _mlp),
    "resnet": ("torchvision ResNet-50: 320 tensors, 25.6M (BatchNorm buffers)", _resnet),
}


def build_model(name: str, device: str | torch.device = "cpu") -> nn.Module:
    """One of :data:`MODELS` on ``device`` (seeded, so runs compare)."""
    if name not in MODELS:
        raise EMAValueError(f"model must be one of {sorted(MODELS)}, got {name=!r}")
    torch.manual_seed(0)
    return MODELS[name][1]().to(device)


def _time(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    sync()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def bench_update(
    model: str = "tiny", device: str = "cpu", repeats: int = 20
) -> list[tuple[str, float, float]]:
    """Median seconds per averaging update of each path, and the ratio to the floor.

    Args:
        model: a key of :data:`MODELS`. Default ``"tiny"``.
        device: ``"cpu"`` or ``"cuda"``. Default ``"cpu"``.
        repeats: timed calls per path (the median is kept). Default 20.

    Returns:
        ``[(path, seconds, seconds / floor), ...]``, the floor first.
    """
    if device not in ("cpu", "cuda"):
        raise EMAValueError(f"device must be 'cpu' or 'cuda', got {device=!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise EMAValueError("device='cuda' was asked for but torch sees no CUDA device")
    if repeats < 1:
        raise EMAValueError(f"repeats must be >= 1, got {repeats=}")
    dev = torch.device(device)
    net = build_model(model, dev)
    numel = sum(t.numel() for t in (*net.parameters(), *net.buffers()) if t.is_floating_point())
    a = torch.randn(numel, device=dev)
    b = torch.randn(numel, device=dev)
    rows = [("floor: one lerp_ over a flat tensor", _time(lambda: a.lerp_(b, 1e-3), dev, repeats))]
    flat_net = copy.deepcopy(net)
    flatten_parameters(flat_net)
    paths = {
        "loop (use_foreach=False)": (net, False),
        "foreach (use_foreach=True)": (net, True),
        "default (use_foreach=None)": (net, None),
        "default after flatten_parameters": (flat_net, None),
    }
    with torch.no_grad():
        for label, (m, use_foreach) in paths.items():
            ema = EMA(m, beta=0.999, update_after_step=0, update_every=1, use_foreach=use_foreach)
            ema.update()
            rows.append((label, _time(ema.update, dev, repeats)))
    floor = rows[0][1]
    return [(label, t, t / floor) for label, t in rows]

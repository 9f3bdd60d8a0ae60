"""Model builders and a reference EMA step shared by the tests.

A plain module rather than ``conftest.py``, so that test files can ``from _models import
...``: ``tests/`` has no ``__init__.py``, so pytest puts it on ``sys.path`` (and
``conftest.py`` makes sure of it under ``--import-mode=importlib`` too).

Every builder seeds torch's global RNG with ``seed`` right before constructing (``seed=None``
leaves the RNG alone, for callers that seed it themselves), so a given seed always gives
the same weights. Parameter and buffer names are part of the contract: tests refer to them
("0.weight", "1.running_var", "bn.num_batches_tracked", "inp.weight", ...).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

M = TypeVar("M", bound=nn.Module)


def seeded(factory: Callable[[], M], seed: int | None = 0) -> M:
    """``factory()`` right after ``torch.manual_seed(seed)`` (not reseeded for ``None``)."""
    if seed is not None:
        torch.manual_seed(seed)
    return factory()


# -- nn.Sequential models (names "0.weight", "1.running_var", ...) ---------------------------


def bn_mlp(
    in_features: int, hidden: int, out_features: int, *, relu: bool = False, seed: int | None = 0
) -> nn.Sequential:
    """``Linear -> BatchNorm1d [-> ReLU] -> Linear``: the BatchNorm is index 1, the last
    Linear index 2 (3 with ``relu``)."""

    def build() -> nn.Sequential:
        return nn.Sequential(
            nn.Linear(in_features, hidden),
            nn.BatchNorm1d(hidden),
            *([nn.ReLU()] if relu else []),
            nn.Linear(hidden, out_features),
        )

    return seeded(build, seed)


def conv_bn_classifier(
    image_size: int, out_features: int, *, dropout: float | None = None, seed: int | None = 0
) -> nn.Sequential:
    """``Conv2d(3, 4, 3) -> BatchNorm2d -> ReLU -> Flatten -> Linear [-> Dropout]`` for
    3-channel ``image_size`` x ``image_size`` inputs (the unpadded conv loses 2 pixels)."""

    def build() -> nn.Sequential:
        side = image_size - 2
        return nn.Sequential(
            nn.Conv2d(3, 4, 3),
            nn.BatchNorm2d(4),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(4 * side * side, out_features),
            *([nn.Dropout(dropout)] if dropout is not None else []),
        )

    return seeded(build, seed)


# -- named-module models ---------------------------------------------------------------------


class ConvBNNet(nn.Module):
    """Conv + BatchNorm (float running stats, integer num_batches_tracked) + Linear.

    Names ``conv``, ``bn``, ``fc``, ``bn_out``; input ``(N, 3, H, W)``, output ``(N, 3)``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 3)
        self.bn_out = nn.BatchNorm1d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.conv(x)))
        return self.bn_out(self.fc(x.mean((2, 3))))


def conv_bn_net(seed: int | None = 0) -> ConvBNNet:
    return seeded(ConvBNNet, seed)


class ConvBNLayerNormNet(nn.Module):
    """Conv + BatchNorm (float and integer buffers) + LayerNorm + Linear layers.

    Names ``conv``, ``bn``, ``lin``, ``norm``, ``bn2``, ``head``; input ``(N, 3, H, W)``,
    output ``(N, 3)``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.lin = nn.Linear(4, 6)
        self.norm = nn.LayerNorm(6)
        self.bn2 = nn.BatchNorm1d(6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.conv(x))).mean((2, 3))
        return self.head(F.relu(self.bn2(self.norm(self.lin(x)))))


def conv_bn_layernorm_net(seed: int | None = 0) -> ConvBNLayerNormNet:
    return seeded(ConvBNLayerNormNet, seed)


class LayerNormMLP(nn.Module):
    """A small MLP without buffers: ``inp`` (8 -> 16), ``norm`` (LayerNorm), ``out`` (16 ->
    5); the head's 5 rows shard unevenly over 2 ranks (3 + 2)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.out = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.norm(self.inp(x))))


def layernorm_mlp(seed: int | None = 0) -> LayerNormMLP:
    return seeded(LayerNormMLP, seed)


# -- the reference EMA -----------------------------------------------------------------------


def reference_ema_step(
    shadow: Mapping[str, torch.Tensor],
    online: Mapping[str, torch.Tensor],
    decay: float,
    *,
    copy_names: frozenset[str] | set[str] = frozenset(),
) -> None:
    """One EMA step written out per tensor, independent of the engine: for every name in
    ``shadow``, ``shadow.lerp_(online.to(shadow.dtype), 1 - decay)`` for a floating online
    tensor, ``shadow.copy_(online)`` for an integer/bool one or a name in ``copy_names``.

    In place, without autograd; the shadow keeps its own dtype (a float64 shadow is a
    float64 reference of a lower-precision model)."""
    with torch.no_grad():
        for name, s in shadow.items():
            o = online[name]
            if not o.is_floating_point() or name in copy_names:
                s.copy_(o)
            else:
                s.lerp_(o.to(s.dtype), 1.0 - decay)


def power_ema(theta: torch.Tensor, gamma: float, upto: int) -> torch.Tensor:
    """The per-step power-function EMA at step ``upto``: beta(t) = (1 - 1/t)^(gamma + 1)."""
    ema = theta[0].clone()
    for t in range(2, upto + 1):
        beta = (1 - 1 / t) ** (gamma + 1)
        ema = beta * ema + (1 - beta) * theta[t - 1]
    return ema


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``||x - ref|| / ||ref||`` in float64."""
    return float((x.double().flatten() - ref).norm() / ref.norm())


def gathered(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of ``model``'s state dict in full, cloned (a collective for DTensors:
    call it on every rank).

    A DTensor with a ``_StridedShard`` placement (FSDP2 with tensor parallelism) is
    assembled from every rank's local shard where its chunk (``__create_chunk_list__``)
    puts it, not by ``DTensor.full_tensor()``: on torch 2.8 and 2.9 that misplaces the
    rows when they do not divide evenly (rewritten after 2.9). ``test_posthoc_sharded`` checks
    the chunks against the data FSDP2 put on each rank."""
    return {n: _full(v).detach().clone() for n, v in model.state_dict().items()}


def _full(v: torch.Tensor) -> torch.Tensor:
    if not hasattr(v, "full_tensor"):
        return v
    strided = any(type(p).__name__ == "_StridedShard" for p in v.placements)
    if not strided or v.device_mesh.size() != torch.distributed.get_world_size():
        return v.full_tensor()
    chunk = v.__create_chunk_list__()[0]
    parts: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, (tuple(chunk.offsets), v.to_local().cpu()))
    out = torch.empty(v.shape, dtype=v.dtype)
    for offsets, local in parts:  # replicas write the same values
        out[tuple(slice(o, o + s) for o, s in zip(offsets, local.shape, strict=True))] = local
    return out.to(v.device)

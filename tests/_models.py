"""Model builders, the training loops and a reference EMA step shared by the tests.

A plain module rather than ``conftest.py``, so that test files can ``from _models import
...``: ``tests/`` has no ``__init__.py``, so pytest puts it on ``sys.path`` (and
``conftest.py`` makes sure of it under ``--import-mode=importlib`` too).

Every builder seeds torch's global RNG with ``seed`` right before constructing (``seed=None``
leaves the RNG alone, for callers that seed it themselves), so a given seed always gives
the same weights. Parameter and buffer names are part of the contract: tests refer to them
("0.weight", "1.running_var", "bn.num_batches_tracked", "inp.weight", ...).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

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


def two_linear(seed: int | None = 0) -> nn.Sequential:
    """``Linear(3, 4) -> Linear(4, 2)`` (names ``0.weight``, ``1.bias``, ...)."""
    return seeded(lambda: nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)), seed)


def frozen_base(seed: int | None = 0) -> nn.Sequential:
    """``Linear(3, 3) -> Linear(3, 2)`` with the first Linear frozen (a frozen base)."""

    def build() -> nn.Sequential:
        net = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
        net[0].requires_grad_(False)
        return net

    return seeded(build, seed)


def float16_overflow_linear() -> nn.Linear:
    """A ``Linear(4, 2)`` whose ``weight[0, 1]`` is 1e5, above float16's largest 65504."""
    net = nn.Linear(4, 2)
    with torch.no_grad():
        net.weight[0, 1] = 1e5
    return net


class TinyLora(nn.Module):
    """A frozen base (``base``, 16 -> 16) and a trainable adapter (``adapter``, 16 -> 2):
    with `TINY_LORA_POSTHOC` its snapshots store the base once, in a side file. Trained
    with ``train(net, [ema], steps, **TINY_LORA_SGD)``."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(16, 16)
        self.adapter = nn.Linear(16, 2)
        self.base.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.adapter(torch.tanh(self.base(x)))


#: `PostHocEMA` keywords of a `TinyLora` run: two profiles, snapshots every 4 steps, and
#: ``share_frozen=True``: the frozen base is shared, so the snapshots store it once in a side
#: file.
TINY_LORA_POSTHOC: dict[str, Any] = dict(
    sigma_rels=(0.05, 0.28), update_every=1, checkpoint_every_num_steps=4, share_frozen=True
)
#: `train()`'s keywords for `TinyLora`: 8 x 16 batches, lr 0.2, step ``i``'s batch drawn
#: from a generator seeded with ``i``.
TINY_LORA_SGD: dict[str, Any] = dict(batch=(8, 16), lr=0.2, seed=lambda i: i)


# -- training loops --------------------------------------------------------------------------


def train(
    net: nn.Module,
    emas: Iterable[Any] = (),
    steps: int | Iterable[int] = 1,
    *,
    batch: tuple[int, ...] = (8, 4),
    lr: float = 0.1,
    seed: int | Callable[[int], int] = 0,
    opt: torch.optim.Optimizer | None = None,
    loss: Callable[[nn.Module, torch.Generator], torch.Tensor] | None = None,
    at: Callable[[int], None] | None = None,
    then: Callable[[int], None] | None = None,
) -> None:
    """Optimizer steps on ``net``, each followed by every EMA's ``update()``.

    For each ``i`` of ``steps`` (``range(steps)`` for an int): ``at(i)``; gradients
    cleared; ``loss(net, g).backward()``, by default ``net(x).pow(2).mean()`` for
    ``x = torch.randn(*batch, generator=g)``; ``opt.step()``; gradients cleared; ``then(i)``;
    ``e.update()`` for each of ``emas``, in order. ``g`` is one generator seeded with
    ``seed`` for the whole call, or, for a callable ``seed``, a fresh one seeded with
    ``seed(i)`` at each step. ``opt`` defaults to plain SGD at ``lr`` over the parameters
    that require gradients when the step begins (plain SGD keeps no state: a parameter that
    ``at`` freezes or unfreezes is simply left out or taken in).
    """
    emas = list(emas)
    one = torch.Generator().manual_seed(seed) if isinstance(seed, int) else None
    for i in range(steps) if isinstance(steps, int) else steps:
        if at is not None:
            at(i)
        g = one if one is not None else torch.Generator().manual_seed(seed(i))  # type: ignore[operator]
        step_opt = opt
        if step_opt is None:
            step_opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=lr)
        step_opt.zero_grad()
        if loss is None:
            net(torch.randn(*batch, generator=g)).pow(2).mean().backward()
        else:
            loss(net, g).backward()
        step_opt.step()
        step_opt.zero_grad()
        if then is not None:
            then(i)
        for e in emas:
            e.update()


def walk(
    net: nn.Module, emas: Iterable[Any] = (), steps: int = 1, *, seed: int = 0, scale: float = 1.0
) -> None:
    """A random walk of the weights: each step adds ``scale`` times standard normal noise
    (one generator seeded with ``seed``) to every parameter, then calls every EMA's
    ``update()``."""
    emas = list(emas)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn(p.shape, generator=g), alpha=scale)
        for e in emas:
            e.update()


def step_weights(net: nn.Module, k: int) -> None:
    """Move every weight by a deterministic amount (an optimizer step): parameter ``i``
    (counted from 0) by ``0.1 * (k + 1) * (i + 1)``."""
    with torch.no_grad():
        for i, p in enumerate(net.parameters()):
            p.add_(0.1 * (k + 1) * (i + 1))


def ema_weights(ema: Any) -> dict[str, torch.Tensor]:
    """A clone of every tensor of ``ema.ema_model``'s state dict."""
    return {k: v.clone() for k, v in ema.ema_model.state_dict().items()}


def same_tensors(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    """Whether ``a`` and ``b`` hold the same names and equal tensors."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


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

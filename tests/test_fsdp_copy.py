"""The EMA copy of FSDP2 models, on 4 gloo ranks where shard shapes matter (issue 15).

* ``ema(x)`` sees the current shards at every step, also when the EMA model comes from an
  ``ema_model=`` factory whose root keeps its gathered weights after a forward
  (``reshard_after_forward=False``, the usual recipe): item 1.
* ``forward_method_names=("generate",)`` works whether or not the model's method was
  registered with ``register_fsdp_forward_method``, on every rank: item 5.
* The copy is built through public torch APIs, and the private FSDP2 state emakit still
  reads is read in one function, checked here against this torch: item 6. So is what
  ``share_frozen`` relies on (issue 21): FSDP2 all-gathers from a shard given to the copy
  through ``load_state_dict(..., assign=True)``.
* FSDP + tensor parallelism is refused by name, once, and works through a factory: item 7.

Every case runs on 4 ranks: the head has 3 rows, so rank 3's shard of it is empty. The
reference is a plain, unsharded model loaded with the gathered EMA weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from _launch import DIST_MARKS, FSDP2_MARK, run_ranks
from emakit import EMA, EMAStateError, EMATypeError
from emakit._core.forward import eval_call
from emakit._core.sharding import adopt_shard, fsdp_layout
from emakit._dist.dtensor import local_tensor, shard_identity, torch_version

pytestmark = [
    *DIST_MARKS,
    FSDP2_MARK,
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

WORLD = 4
EMA_KW: dict[str, Any] = dict(beta=0.9, update_after_step=0, update_every=1)
EVAL_STEPS = (2, 3)  # ema(x) is compared with the reference after these updates
EXACT = dict(rtol=0.0, atol=1e-6)
#: The EMAs with forward_method_names=("generate",): an automatic copy of a model whose
#: generate is registered with FSDP, or not; factories that register it, or not.
GENERATE = ("copy", "factory", "factory_registered", "copy_unregistered")


class Tower(nn.Module):
    """The root owns ``inp``, ``norm`` and ``head`` (3 rows: an empty shard on 4 ranks);
    ``block`` is its own ``fully_shard`` unit. ``generate`` uses the root's layers outside
    ``forward``, so FSDP must gather the root's weights around it."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.block(torch.tanh(self.inp(x)))))

    def generate(self, x: torch.Tensor, steps: int = 2) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for _ in range(steps):
            h = self.norm(self.block(h)) + h
        return self.head(h)


def tower() -> Tower:
    torch.manual_seed(0)
    return Tower()


def inputs() -> torch.Tensor:
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(1))


def full(module: nn.Module) -> dict[str, torch.Tensor]:
    """The gathered weights of a sharded module (a collective)."""
    return {n: p.full_tensor().clone() for n, p in module.named_parameters()}


def plain(weights: dict[str, torch.Tensor], make: Any = tower) -> nn.Module:
    net = make()
    net.load_state_dict(weights)
    return net.eval()


def from_fsdp(value: object) -> bool:
    """Whether ``value`` (or a value of the mapping ``value``) is an object of FSDP's own
    (modules, FSDP-wrapped or not, are not: they are the model's)."""
    values = list(value.values()) if isinstance(value, dict) else [value]
    prefixes = ("torch.distributed.fsdp", "torch.distributed._composable")
    return any(
        type(v).__module__.startswith(prefixes) and not isinstance(v, nn.Module) for v in values
    )


def train(model: nn.Module, opt: torch.optim.Optimizer, rank: int) -> None:
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(100 + rank))
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


# -- 1-D FSDP over 4 ranks ----------------------------------------------------------------


def fsdp_worker(rank: int, out: Path) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        FSDPModule,
        MixedPrecisionPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    import emakit._dist.dtensor

    mesh = init_device_mesh("cpu", (WORLD,))
    policy = MixedPrecisionPolicy(output_dtype=torch.float32)

    def shard(net: Tower, *, register: bool = False) -> Tower:
        fully_shard(net.block, mesh=mesh)
        fully_shard(net, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
        if register:
            register_fsdp_forward_method(net, "generate")
        return net

    res: dict[str, Any] = {}
    model = shard(tower(), register=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    unregistered = shard(tower())  # the same weights, data and steps: the same trajectory
    opt_u = torch.optim.SGD(unregistered.parameters(), lr=0.2)
    factory = lambda: shard(tower())  # noqa: E731
    # ema(x) alone between updates (a forward method would reshard and hide staleness).
    forward_emas = {
        "copy": EMA(model, **EMA_KW),
        "factory": EMA(model, ema_model=factory, **EMA_KW),
    }
    method = dict(forward_method_names=("generate",), **EMA_KW)
    generate_emas = {
        "copy": EMA(model, **method),
        "factory": EMA(model, ema_model=factory, **method),
        "factory_registered": EMA(model, ema_model=lambda: shard(tower(), register=True), **method),
        "copy_unregistered": EMA(unregistered, **method),
    }
    emas = {**{f"fwd/{k}": v for k, v in forward_emas.items()}, **generate_emas}
    side = tower()  # the single-process reference: an EMA of the gathered weights
    side_ema = EMA(side, **EMA_KW)

    # The private reads, against this torch (item 6).
    layout, copy_layout = fsdp_layout(model), fsdp_layout(emas["copy"].ema_model)
    res["groups"] = [g.modules for g in layout.groups]
    res["copy_groups"] = [g.modules for g in copy_layout.groups]
    res["meshes"] = [g.mesh == mesh for g in (*layout.groups, *copy_layout.groups)]
    res["policies"] = [layout.groups[-1].mp_policy, copy_layout.groups[-1].mp_policy]
    res["fsdp_keys"] = [bool(layout.fsdp_keys.get(id(m))) for m in (model, model.block)]
    res["fsdp_hooks"] = sorted(layout.fsdp_hooks.get(id(model), {}))
    res["composable_keys"] = [
        any(k.startswith("__composable_api") for k in layout.fsdp_keys.get(id(m), ()))
        for m in (model, model.block)
    ]
    res["leftover"] = [  # FSDP state in a module's __dict__ that fsdp_layout did not find
        (name, key)
        for name, m in model.named_modules()
        for key, value in m.__dict__.items()
        if key not in layout.fsdp_keys.get(id(m), ()) and from_fsdp(value)
    ]
    copy = emas["copy"].ema_model
    res["hook_counts"] = [  # the copy has FSDP's hooks once: its own, none of the model's
        [len(m.__dict__[registry]) for m in (a, a.block, a.inp)]
        for a in (model, copy)
        for registry in ("_forward_pre_hooks", "_forward_hooks", "_load_state_dict_post_hooks")
    ]
    res["managed"] = [
        sorted(n for n, p in model.named_parameters() if any(p is q for q in g.params))
        for g in layout.groups
    ]
    p = emas["copy"].ema_model.head.weight
    with torch.no_grad():
        inner = getattr(p, p.__tensor_flatten__()[0][0])  # the subclass protocol's name
        res["identity"] = shard_identity(p) is inner and shard_identity(p) is shard_identity(p)
        res["alias"] = local_tensor(p).data_ptr() == inner.data_ptr()
    res["alias_grad_mode"] = local_tensor(p).data_ptr() == inner.data_ptr()
    res["local_shapes"] = {
        n: tuple(local_tensor(t).shape) for n, t in emas["copy"].ema_model.named_parameters()
    }
    res["model_local_shapes"] = {
        n: tuple(local_tensor(t).shape) for n, t in model.named_parameters()
    }

    # Training; at two steps, ema(x) and ema.generate(x) against the reference.
    x = inputs()
    for step in range(1, max(EVAL_STEPS) + 1):
        train(model, opt, rank)
        train(unregistered, opt_u, rank)
        for ema in emas.values():
            ema.update()
        side.load_state_dict(full(model))
        side_ema.update()
        if step not in EVAL_STEPS:
            continue
        with torch.no_grad():
            want, want_generate = side_ema(x), side_ema.ema_model.eval().generate(x)
        for name, ema in forward_emas.items():
            res[f"forward/{name}/{step}"] = (ema(x), want)
        for name, ema in generate_emas.items():
            res[f"generate/{name}/{step}"] = (ema.generate(x), want_generate)
    # At the end, every EMA model is sharded again, and matches a plain model loaded from
    # its gathered weights.
    for name, ema in emas.items():
        y = ema(x)
        res[f"dtensor_after/{name}"] = all(
            type(t).__name__ == "DTensor" for t in ema.ema_model.parameters()
        )
        for m in ema.ema_model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()  # (a no-op unless the EMA left gathered weights behind)
        with torch.no_grad():
            res[f"gathered/{name}"] = (y, plain(full(ema.ema_model))(x))
    # The online model keeps working: its own registered generate, on its own weights.
    ref = plain(full(model))
    with torch.no_grad():
        res["online_generate"] = (model.generate(x), ref.generate(x))
    model.reshard()

    # share_frozen relies on FSDP2 adopting a shard given through the module's
    # load_state_dict(..., assign=True) (its reset_sharded_param post-hook) as the storage
    # it all-gathers from: the copy's forward reads the model's frozen storage.
    frozen = shard(tower()).requires_grad_(False)
    sharing = EMA(frozen, share_frozen=True, **EMA_KW)
    copy_model = sharing.ema_model
    weight, copied = frozen.block[0].weight, copy_model.block[0].weight
    before = sharing(x)
    with torch.no_grad():
        local_tensor(weight).mul_(2.0)  # 16 rows over 4 ranks: an unpadded shard
        want = plain(full(frozen))(x)
    try:  # the EMA refuses to read a shared weight written in place (issue 39) ...
        sharing(x)
        res["refused"] = False
    except EMAStateError:
        res["refused"] = True
    # ... so FSDP2's reading of the adopted shard is checked on the copy itself
    res["adopted"] = (
        local_tensor(copied).data_ptr() == local_tensor(weight).data_ptr(),
        (eval_call(copy_model, copy_model, (x,), {}) - want).abs().max().item(),
        (before - want).abs().max().item(),
    )
    # After FSDP2's lazy init (a forward ran), the same route adopts a new shard at once
    # (what un-sharing does): a clone holding the old values gives the old output back.
    adopt_shard(copy_model, copied, local_tensor(copied).clone().mul_(0.5))
    res["readopted"] = (eval_call(copy_model, copy_model, (x,), {}) - before).abs().max().item()

    # FSDP2 re-creates a model's shards in place (same DTensors) on to_empty(): the guard
    # (DTensor's inner tensor, by identity) sees it and the next update reads the new ones.
    moved = shard(tower())
    ema = EMA(moved, **EMA_KW)
    ema.update()
    plan, before = ema.tracker.plan(), full(ema.ema_model)
    moved.to_empty(device="cpu")
    with torch.no_grad():
        for t in moved.parameters():
            t.fill_(1.0)
    ema.update()
    weight = 1.0 - ema.get_current_decay()
    res["replanned"] = ema.tracker.plan() is not plan
    res["moved"] = (full(ema.ema_model), {n: v + (1.0 - v) * weight for n, v in before.items()})

    # A torch older than the FSDP2 floor refuses FSDP2 models up front.
    saved = emakit._dist.dtensor.torch_version
    emakit._dist.dtensor.torch_version = lambda: (2, 5)
    try:
        EMA(model, **EMA_KW)
        res["old_torch"] = ""
    except EMATypeError as e:
        res["old_torch"] = str(e)
    finally:
        emakit._dist.dtensor.torch_version = saved
    return res


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_ranks(fsdp_worker, tmp_path_factory.mktemp("fsdp4"), world=WORLD)


def test_ema_forward_sees_the_current_shards_at_every_step(fsdp_results: list[dict]) -> None:
    for r in fsdp_results:
        for name in ("copy", "factory"):
            outs = []
            for step in EVAL_STEPS:
                got, want = r[f"forward/{name}/{step}"]
                torch.testing.assert_close(got, want, **EXACT, msg=f"{name} at step {step}")
                outs.append(got)
            # The EMA moved between the two evaluations: stale weights would fail above.
            assert (outs[0] - outs[1]).abs().max() > 1e-3, name
        for name in (*(f"fwd/{n}" for n in ("copy", "factory")), *GENERATE):
            got, want = r[f"gathered/{name}"]
            torch.testing.assert_close(got, want, **EXACT, msg=name)
            assert r[f"dtensor_after/{name}"], name  # no gathered weights left behind


def test_forward_methods_run_on_every_rank_registered_or_not(fsdp_results: list[dict]) -> None:
    for r in fsdp_results:
        for name in GENERATE:
            for step in EVAL_STEPS:
                got, want = r[f"generate/{name}/{step}"]
                torch.testing.assert_close(got, want, **EXACT, msg=f"{name} at step {step}")
        got, want = r["online_generate"]
        torch.testing.assert_close(got, want, **EXACT)


def test_copy_repeats_the_models_sharding_with_empty_shards(fsdp_results: list[dict]) -> None:
    for rank, r in enumerate(fsdp_results):
        assert r["local_shapes"] == r["model_local_shapes"]
        rows = r["local_shapes"]["head.weight"][0]
        assert rows == (0 if rank == WORLD - 1 else 1)  # 3 rows over 4 ranks
    assert sum(r["local_shapes"]["head.bias"][0] for r in fsdp_results) == 3


def test_torch_internals_emakit_reads_are_where_it_expects(fsdp_results: list[dict]) -> None:
    """Fails loudly when a torch release moves what ``fsdp_layout`` or ``shard_identity``
    read (the workers then raise an EMATypeError that says so)."""
    for r in fsdp_results:
        assert r["groups"] == [("block",), ("",)] == r["copy_groups"]
        assert all(r["meshes"])
        model_policy, copy_policy = r["policies"]
        assert model_policy.output_dtype == torch.float32 and copy_policy == model_policy
        assert r["fsdp_keys"] == [True, True] and r["composable_keys"] == [True, True]
        assert r["leftover"] == []
        half = len(r["hook_counts"]) // 2
        assert r["hook_counts"][:half] == r["hook_counts"][half:]
        assert r["hook_counts"][0][:2] == [1, 1]  # root and block: FSDP's pre-forward hook
        assert {"_forward_pre_hooks", "_forward_hooks"} <= set(r["fsdp_hooks"])
        block, root = r["managed"]
        assert block == ["block.0.bias", "block.0.weight"]
        assert root == sorted(
            ["inp.weight", "inp.bias", "norm.weight", "norm.bias", "head.weight", "head.bias"]
        )
        assert r["identity"] and r["alias"] and r["alias_grad_mode"]
        aliases, error, stale = r["adopted"]  # an in-place change of the model's frozen
        assert aliases and error <= 1e-6 and stale > 1e-3  # shard is in the copy's forward
        assert r["refused"]  # which the EMA itself refuses to read (share_frozen=True)
        assert r["readopted"] <= 1e-6


def test_new_shards_after_to_empty_are_followed(fsdp_results: list[dict]) -> None:
    for r in fsdp_results:
        assert r["replanned"]
        got, want = r["moved"]
        for n in want:
            torch.testing.assert_close(got[n], want[n], **EXACT, msg=n)


def test_fsdp_models_are_refused_on_torch_older_than_the_floor(fsdp_results: list[dict]) -> None:
    for r in fsdp_results:
        assert "torch>=2.6" in r["old_torch"] and "upgrade torch" in r["old_torch"]


def test_torch_version_parses_local_and_dev_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    for version, want in (("2.14.1+cu130", (2, 14)), ("2.6.0a0+git1234", (2, 6)), ("3.0", (3, 0))):
        monkeypatch.setattr(torch, "__version__", version)
        assert torch_version() == want


# -- 2x2 meshes: HSDP, and FSDP + tensor parallelism ------------------------------------------


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))) + x


class TPNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def tp_net() -> TPNet:
    torch.manual_seed(0)
    return TPNet()


def mesh_worker(rank: int, out: Path) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    res: dict[str, Any] = {}
    x = inputs()

    # HSDP: replicate over one mesh dimension, shard over the other; copied automatically.
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = tower()
    fully_shard(model.block, mesh=hsdp)
    fully_shard(model, mesh=hsdp, reshard_after_forward=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    ema = EMA(model, **EMA_KW)
    res["hsdp_shapes"] = [
        local_tensor(s).shape == local_tensor(o).shape and s.placements == o.placements
        for s, o in zip(ema.ema_model.parameters(), model.parameters(), strict=True)
    ]
    for step in range(1, max(EVAL_STEPS) + 1):
        train(model, opt, rank)
        ema.update()
        if step in EVAL_STEPS:
            y = ema(x)
            with torch.no_grad():
                res[f"hsdp/{step}"] = (y, plain(full(ema.ema_model))(x))

    # HSDP with a frozen model: the shards (Replicate, Shard(0)) are shared where unpadded,
    # and the copy's forward reads them.
    frozen = tower().requires_grad_(False)
    fully_shard(frozen.block, mesh=hsdp)
    fully_shard(frozen, mesh=hsdp)
    sharing = EMA(frozen, share_frozen=True, **EMA_KW)
    online = dict(frozen.named_parameters())
    res["hsdp_shared"] = sorted(
        n
        for n, q in sharing.ema_model.named_parameters()
        if local_tensor(q).data_ptr() == local_tensor(online[n]).data_ptr()
    )
    copy_model = sharing.ema_model
    with torch.no_grad():
        local_tensor(frozen.inp.weight).mul_(2.0)  # (which the EMA itself refuses to read:
        # checked on the copy, the way FSDP2 reads an adopted shard)
        res["hsdp_frozen"] = (
            eval_call(copy_model, copy_model, (x,), {}),
            plain(full(frozen))(x),
        )

    # FSDP + tensor parallelism: refused by name for a copy; a factory works.
    tp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

    def build() -> TPNet:
        net = tp_net()
        for b in net.blocks:
            parallelize_module(b, tp_mesh["tp"], {"a": ColwiseParallel(), "b": RowwiseParallel()})
            fully_shard(b, mesh=tp_mesh["dp"])
        fully_shard(net, mesh=tp_mesh["dp"], reshard_after_forward=False)
        return net

    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    try:
        EMA(model, **EMA_KW)
        res["tp_refusal"] = ""
    except EMATypeError as e:
        res["tp_refusal"] = str(e)
    ema = EMA(model, ema_model=build, **EMA_KW)
    for step in range(1, max(EVAL_STEPS) + 1):
        train(model, opt, tp_mesh["dp"].get_local_rank())  # one batch per tensor-parallel group
        ema.update()
        if step in EVAL_STEPS:
            y = ema(x)
            with torch.no_grad():
                res[f"tp/{step}"] = (y, plain(full(ema.ema_model), tp_net)(x))
    return res


@pytest.fixture(scope="module")
def mesh_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_ranks(mesh_worker, tmp_path_factory.mktemp("mesh2x2"), world=WORLD)


def test_hsdp_copy_forward_sees_the_current_shards(mesh_results: list[dict]) -> None:
    for r in mesh_results:
        assert r["hsdp_shapes"] and all(r["hsdp_shapes"])
        for step in EVAL_STEPS:
            got, want = r[f"hsdp/{step}"]
            torch.testing.assert_close(got, want, **EXACT, msg=f"step {step}")
        assert (r[f"hsdp/{EVAL_STEPS[0]}"][0] - r[f"hsdp/{EVAL_STEPS[1]}"][0]).abs().max() > 1e-3


def test_hsdp_frozen_shards_are_shared_and_read_by_the_copy(mesh_results: list[dict]) -> None:
    for r in mesh_results:  # head (3 rows over the 2-rank shard dimension): padded, owned
        assert r["hsdp_shared"] == [
            "block.0.bias",
            "block.0.weight",
            "inp.bias",
            "inp.weight",
            "norm.bias",
            "norm.weight",
        ]
        got, want = r["hsdp_frozen"]
        torch.testing.assert_close(got, want, **EXACT)


def test_fsdp_with_tensor_parallelism_is_refused_by_name_once(mesh_results: list[dict]) -> None:
    for r in mesh_results:
        message = r["tp_refusal"]
        assert "'blocks.0.a.weight'" in message and "'blocks.1.b.bias'" in message
        assert "?" not in message and "could not be deep-copied" not in message
        assert message.count("ema_model=") == 1 and "tensor parallelism" in message


def test_fsdp_with_tensor_parallelism_through_a_factory(mesh_results: list[dict]) -> None:
    for r in mesh_results:
        for step in EVAL_STEPS:
            got, want = r[f"tp/{step}"]  # TP reduces in another order: not bit-exact
            torch.testing.assert_close(got, want, rtol=0.0, atol=1e-5, msg=f"step {step}")
        assert (r[f"tp/{EVAL_STEPS[0]}"][0] - r[f"tp/{EVAL_STEPS[1]}"][0]).abs().max() > 1e-3


def _flatten_after_shard_worker(rank: int, out: Path) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from emakit import EMAError, flatten_parameters

    net = tower()
    fully_shard(net, mesh=init_device_mesh("cpu", (2,)))
    try:
        flatten_parameters(net)
    except EMAError as e:
        return f"EMAError: {e}"
    except Exception as e:  # the raw torch error this replaces
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_flatten_parameters_after_fully_shard_says_to_flatten_first(tmp_path: Path) -> None:
    for message in run_ranks(_flatten_after_shard_worker, tmp_path, world=2):
        assert message.startswith("EMAError: flatten_parameters got a sharded model"), message
        assert "before sharding" in message

"""The user's model is the user's (issue 39): with default settings, building, updating,
swapping, reading, saving and loading an EMA leaves every module of the model as torch made
it: its class, its ``_parameters``/``_buffers``/``_modules`` dicts (the same dict objects,
of class ``dict``, holding the same objects), its hook tables and the rest of its
``__dict__``, and every parameter's class and hooks. Checked on a plain model, a partly
frozen one (also with ``share_frozen=True``), a peft LoRA model, a ``torch.compile``d one,
FSDP2 and DeepSpeed ZeRO-3 (2 gloo ranks on the CPU).

Also here: a compiled forward is not recompiled by an EMA attached after its first call
(compiles counted by a custom backend), ``torch.jit.script(model)`` works after building
an EMA, and building and using an EMA imports no part of torch's compiler.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from _deepspeed import DEEPSPEED_MARKS, start_rank
from _launch import DIST_MARKS, FSDP2_MARK, run_ranks
from _models import bn_mlp
from emakit import BEMA, EMA, KarrasEMA, MultiEMA, load_ema_weights, save_ema_weights

KW: dict[str, Any] = {"beta": 0.9, "update_after_step": 1, "update_every": 1}

#: Every hook table torch keeps on a module (those this torch has).
HOOK_TABLES = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)
REGISTRIES = ("_parameters", "_buffers", "_modules")


def anatomy(model: nn.Module) -> dict[str, Any]:
    """What torch made of every module of ``model`` (see the module docstring), by name."""
    out: dict[str, Any] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        state = m.__dict__
        entry: dict[str, Any] = {"class": type(m), "attributes": sorted(state)}
        for r in REGISTRIES:
            d = state[r]
            entry[r] = (id(d), type(d), list(d), [id(v) for v in d.values()])
        for h in HOOK_TABLES:
            if h in state:
                entry[h] = (type(state[h]), list(state[h].items()))
        out[f"module {name!r}"] = entry
    for name, p in model.named_parameters(remove_duplicate=False):
        hooks = getattr(p, "_post_accumulate_grad_hooks", None)
        out[f"parameter {name!r}"] = (type(p), p._backward_hooks, hooks)
    return out


def changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """What differs between two anatomies, as text (empty: nothing)."""
    diffs = [f"{k}: {before.get(k)} -> {after.get(k)}" for k in after if before.get(k) != after[k]]
    return diffs + [f"{k}: removed" for k in before if k not in after]


def step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def exercise(emas: list[Any], model: nn.Module, x: torch.Tensor, tmp: Path) -> None:
    """Train a few steps with every EMA updated, then read, swap, save and load each."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for _ in range(3):
        step(model, opt, x)
        for e in emas:
            e.update()
    readers = [m for e in emas for m in (e if isinstance(e, MultiEMA) else [e])]
    for i, e in enumerate(readers):
        with torch.no_grad():
            e(x)
            with e.swap():
                model(x)
            with e.swap(in_place=True):
                model(x)
        state = e.state_dict()
        e.load_state_dict(state)
        e.copy_params_from_model_to_ema()
        if isinstance(e, EMA) and type(e) is EMA:
            path = save_ema_weights(e, tmp / f"ema{i}.safetensors")
            load_ema_weights(e, path)
    for e in emas:
        e.update()


def partly_frozen() -> nn.Module:
    net = bn_mlp(4, 8, 3, relu=True, seed=0)
    net[0].requires_grad_(False)
    return net


MODELS: dict[str, Callable[[], nn.Module]] = {
    "plain": lambda: bn_mlp(4, 8, 3, relu=True, seed=0),
    "partly frozen": partly_frozen,
}
KINDS: dict[str, Callable[[nn.Module], list[Any]]] = {
    "EMA": lambda m: [EMA(m, **KW)],
    "EMA share_frozen=True": lambda m: [EMA(m, share_frozen=True, **KW)],
    "every kind": lambda m: [
        EMA(m, **KW),
        EMA(m, skip_nonfinite=True, use_foreach=False, **KW),
        MultiEMA(m, betas=(0.9, 0.99), update_after_step=0, update_every=1),
        KarrasEMA(m, sigma_rel=0.1, update_every=1),
        BEMA(m, update_freq=1),
    ],
}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("model", list(MODELS))
def test_the_model_is_left_as_torch_made_it(model: str, kind: str, tmp_path: Path) -> None:
    net = MODELS[model]()
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    before = anatomy(net)
    exercise(KINDS[kind](net), net, x, tmp_path)
    assert changes(before, anatomy(net)) == []
    assert {type(m.__dict__[r]) for m in net.modules() for r in REGISTRIES} == {
        type(nn.Linear(1, 1)._parameters)  # dict (OrderedDict on torch 2.4)
    }


@pytest.mark.parametrize("share_frozen", [False, True])
def test_a_lora_model_is_left_as_torch_made_it(share_frozen: bool, tmp_path: Path) -> None:
    from _frameworks import need

    transformers, peft = need("transformers"), need("peft")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    lora = peft.LoraConfig(r=4, target_modules=["c_attn"], lora_dropout=0.0)
    model = peft.get_peft_model(transformers.GPT2LMHeadModel(config), lora)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    before = anatomy(model)
    ema = EMA(model, share_frozen=share_frozen, **KW)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    for _ in range(3):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        ema.update()
    with torch.no_grad():
        ema(input_ids=ids)
        with ema.swap():
            model(input_ids=ids)
    ema.load_state_dict(ema.state_dict())
    load_ema_weights(ema, save_ema_weights(ema, tmp_path / "lora.safetensors"))
    ema.update()
    assert changes(before, anatomy(model)) == []


class Counter:
    """A ``torch.compile`` backend that counts the graphs it is given (runs them eagerly)."""

    def __init__(self) -> None:
        self.compiles = 0

    def __call__(self, gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Callable:
        self.compiles += 1
        return gm.forward


@pytest.mark.parametrize("kw", [{}, {"share_frozen": True}], ids=["default", "share_frozen"])
def test_a_compiled_model_is_left_alone_and_never_recompiled(kw: dict, tmp_path: Path) -> None:
    """An EMA attached after the first compiled call: no recompile through updates, reads,
    swaps, saves and loads (before, the watched registries recompiled it:
    ``TYPE_MISMATCH(fn._modules)``)."""
    torch._dynamo.reset()
    net = partly_frozen()
    backend = Counter()
    compiled = torch.compile(net, backend=backend)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.1)
    step(compiled, opt, x)
    assert backend.compiles == 1
    before = anatomy(net), sorted(compiled.__dict__)
    ema = EMA(compiled, **kw, **KW)  # unwraps _orig_mod
    assert ema.model is net
    for _ in range(4):
        step(compiled, opt, x)
        ema.update()
    with torch.no_grad():
        ema(x)
    ema.load_state_dict(ema.state_dict())
    load_ema_weights(ema, save_ema_weights(ema, tmp_path / "w.safetensors"))
    step(compiled, opt, x)
    ema.update()
    assert backend.compiles == 1
    assert (anatomy(net), sorted(compiled.__dict__)) == before


@pytest.mark.parametrize(
    "kw", [{}, {"share_frozen": True}, {"watch_model": True}], ids=["default", "share", "watch"]
)
def test_torch_jit_script_works_after_building_an_ema(kw: dict) -> None:
    """Before, the unfreeze hook on a module owning a shared frozen weight made
    ``torch.jit.script`` fail (``'UnfreezeHook' object has no attribute '__name__'``)."""
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    net[0].requires_grad_(False)
    ema = EMA(net, **kw, **KW)
    ema.update()
    scripted = torch.jit.script(net)
    x = torch.randn(3, 4)
    assert torch.equal(scripted(x), net(x))
    ema.update()


_IMPORTS = textwrap.dedent(
    """
    import json, sys, tempfile
    import torch
    from torch import nn
    import emakit
    from emakit import BEMA, EMA, KarrasEMA, MultiEMA, PostHocEMA

    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    net[0].requires_grad_(False)
    emas = [
        EMA(net, update_after_step=0, update_every=1),
        EMA(net, update_after_step=0, update_every=1, share_frozen=True),
        EMA(net, update_after_step=0, update_every=1, use_foreach=False, skip_nonfinite=True),
        MultiEMA(net, betas=(0.9, 0.99)),
        KarrasEMA(net, sigma_rel=0.1, update_every=1),
        BEMA(net, update_freq=1),
        PostHocEMA(net, checkpoint_folder=tempfile.mkdtemp(), checkpoint_every_num_steps=2),
    ]
    x = torch.randn(5, 4)
    for _ in range(4):
        net(x).sum().backward()
        for e in emas:
            e.update()
    for e in emas[:3]:
        e(x)
        with e.swap():
            net(x)
        e.load_state_dict(e.state_dict())
    emakit.save_ema_weights(emas[0], tempfile.mkdtemp() + "/w.safetensors")
    loaded = sorted(
        m for m in sys.modules
        if m == "sympy" or m.startswith(("sympy.", "torch._dynamo", "torch._inductor"))
    )
    print(json.dumps(loaded))
    """
)


def test_building_and_using_an_ema_imports_no_compiler() -> None:
    """Before, the first EMA imported ``torch._dynamo`` (and with it sympy and inductor):
    about 0.9 s and 150 MiB in every process. Only ``compile_update=True`` asks for it."""
    out = subprocess.run(
        [sys.executable, "-c", _IMPORTS], capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


# -- FSDP2 and DeepSpeed ZeRO-3, 2 gloo ranks on the CPU --------------------------------------


def _marked(*marks: Any) -> Callable[[Callable], Callable]:
    def apply(fn: Callable) -> Callable:
        for mark in marks:
            fn = mark(fn)
        return fn

    return apply


def fsdp2_worker(rank: int, out: Path) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from emakit.distributed import load_sharded_ema, save_sharded_ema

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    net[0].requires_grad_(False)
    fully_shard(net[0], mesh=mesh)
    fully_shard(net[2], mesh=mesh)
    fully_shard(net, mesh=mesh)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.1)
    step(net, opt, x)  # FSDP2's lazy initialization, before looking
    before = anatomy(net)
    emas = [EMA(net, **KW), EMA(net, share_frozen=True, **KW)]
    for _ in range(3):
        step(net, opt, x)
        for e in emas:
            e.update()
    readers = [m for e in emas for m in (e if isinstance(e, MultiEMA) else [e])]
    for i, e in enumerate(readers):
        with torch.no_grad():
            e(x)
            with e.swap():
                net(x)
        save_sharded_ema(e, out / f"dcp{i}")
        load_sharded_ema(e, out / f"dcp{i}")
        e.load_state_dict(e.state_dict())
    step(net, opt, x)
    for e in emas:
        e.update()
    return changes(before, anatomy(net))


@_marked(*DIST_MARKS, FSDP2_MARK)
def test_an_fsdp2_model_is_left_as_torch_and_fsdp2_made_it(tmp_path: Path) -> None:
    for diffs in run_ranks(fsdp2_worker, tmp_path, world=2, timeout_s=180):
        assert diffs == []


def deepspeed_worker(rank: int, out: Path, shm: bool) -> list[str]:
    from emakit.distributed import load_full_ema_weights, save_full_ema_weights

    deepspeed = start_rank(rank, 2, shm)
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 10},
        "optimizer": {"type": "Adam", "params": {"lr": 0.05, "torch_adam": True}},
        "zero_allow_untested_optimizer": True,
    }
    engine, *_ = deepspeed.initialize(
        model=nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3)), config=config
    )
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(rank))

    def train() -> None:
        engine.backward(engine(x).pow(2).mean())
        engine.step()

    train()  # DeepSpeed's first step, before looking
    before = anatomy(engine.module)
    ema = EMA(engine, **KW)
    for _ in range(3):
        train()
        ema.update()
    with torch.no_grad():
        ema(x)
        with ema.swap():
            engine(x)
    save_full_ema_weights(ema, out / "ema.safetensors")
    load_full_ema_weights(ema, out / "ema.safetensors")
    ema.load_state_dict(ema.state_dict())
    train()
    ema.update()
    return changes(before, anatomy(engine.module))


@_marked(*DEEPSPEED_MARKS)
def test_a_deepspeed_zero3_model_is_left_as_torch_and_deepspeed_made_it(
    tmp_path: Path, shm_op: bool
) -> None:
    import deepspeed  # noqa: F401  (once here, not per rank: importing takes seconds)

    results = run_ranks(
        lambda rank, o: deepspeed_worker(rank, o, shm_op), tmp_path, world=2, timeout_s=300
    )
    for diffs in results:
        assert diffs == []

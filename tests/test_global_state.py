"""emakit changes only the objects it is handed: after ``import emakit`` and after building
and using every EMA kind, torch's classes and global hook registries are what they were;
by default it attaches nothing to the tracked modules (tests/test_untouched_model.py holds
that in detail), and what ``watch_model=True`` attaches leaves them picklable and loadable
without emakit."""

from __future__ import annotations

import copy
import gc
import json
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from emakit import EMA
from emakit._dist.dtensor import torch_version

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = textwrap.dedent(
    """
    import json, sys, tempfile
    import torch
    from torch import nn
    from torch.nn.modules import module as torch_module
    from torch.optim import optimizer as torch_optimizer

    CLASSES = [nn.Module, nn.Parameter, torch.Tensor, torch.optim.Optimizer, torch.optim.SGD]
    REGISTRIES = [
        (torch_module, name) for name in dir(torch_module) if name.startswith("_global_")
    ] + [
        (torch_optimizer, name) for name in dir(torch_optimizer) if name.startswith("_global_")
    ]

    def state():
        classes = {
            f"{c.__qualname__}.{k}": id(v) for c in CLASSES for k, v in vars(c).items()
        }
        registries = {
            f"{m.__name__}.{name}": repr(list(getattr(m, name).items()))
            if hasattr(getattr(m, name), "items") else repr(getattr(m, name))
            for m, name in REGISTRIES
        }
        return {"classes": classes, "registries": registries}

    # torch wraps an optimizer class's step() at its first instance: do that before looking
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    before = state()
    import emakit
    from emakit import BEMA, EMA, EMAPytree, KarrasEMA, MultiEMA, PostHocEMA
    after_import = state()

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    net[0].requires_grad_(False)  # a frozen weight (copied by default)
    folder = tempfile.mkdtemp()
    kinds = [
        EMA(net, update_after_step=0, update_every=1),
        EMA(net, update_every=1, skip_nonfinite=True, use_foreach=False),
        MultiEMA(net, betas=(0.9, 0.99)),
        KarrasEMA(net, sigma_rel=0.1),
        PostHocEMA(net, sigma_rels=(0.05, 0.1), checkpoint_folder=folder,
                   checkpoint_every_num_steps=3),
        BEMA(net, update_freq=1),
        EMAPytree({"w": torch.zeros(3)}),
    ]
    opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.1)
    for step in range(8):
        if step == 4:
            net[0].requires_grad_(True)
            opt.add_param_group({"params": list(net[0].parameters())})
        net(torch.randn(16, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        for ema in kinds:
            ema.update()
    with kinds[0].swap():
        net(torch.randn(2, 4))
    kinds[0].state_dict()
    emakit.save_ema_weights(kinds[0], folder + "/w.safetensors")
    emakit.load_ema_weights(kinds[0], folder + "/w.safetensors")
    print(json.dumps({"before": before, "after_import": after_import, "after_use": state()}))
    """
)


def test_torch_global_state_is_untouched_by_import_and_use():
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, check=True, cwd=ROOT
    )
    states = json.loads(out.stdout.strip().splitlines()[-1])
    before = states["before"]
    assert before["registries"], "found no global hook registry of torch to compare"
    assert "Module.__delattr__" in before["classes"]
    for when in ("after_import", "after_use"):
        for part in ("classes", "registries"):
            changed = {
                k: (before[part].get(k), v)
                for k, v in states[when][part].items()
                if before[part].get(k) != v
            }
            changed.update(
                {k: (v, None) for k, v in before[part].items() if k not in states[when][part]}
            )
            assert not changed, f"{when}: torch's {part} changed: {changed}"


def _frozen_net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    net[0].requires_grad_(False)
    return net


#: The class torch keeps a module's registries in (``dict``; torch 2.4: ``OrderedDict``).
TORCH_DICT = type(nn.Module()._parameters)

#: The settings that attach anything to the model: ``watch_model=True`` (its registry dicts
#: become a counting subclass), with frozen weights shared; by default nothing is attached.
WATCHED = {"watch_model": True, "share_frozen": True}


@pytest.mark.parametrize("kw", [{}, WATCHED], ids=["default", "watch_model"])
def test_a_tracked_model_saved_whole_loads_where_emakit_is_not_installed(tmp_path, kw):
    net = _frozen_net()
    ema = EMA(net, update_after_step=0, update_every=1, **kw)
    ema.update()
    assert not any(len(m._forward_pre_hooks) for m in net.modules())  # no hook, ever
    x = torch.randn(3, 4)
    net.eval()
    expected = net(x)
    torch.save({"model": net, "x": x}, tmp_path / "model.pt")
    code = textwrap.dedent(
        f"""
        import sys
        sys.modules["emakit"] = None  # `import emakit` fails from here on
        import torch
        saved = torch.load({str(tmp_path / "model.pt")!r}, weights_only=False)
        torch.save(saved["model"](saved["x"]), {str(tmp_path / "out.pt")!r})
        print(sorted({{type(m._parameters).__name__ for m in saved["model"].modules()}}))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"[{TORCH_DICT.__name__!r}]"
    assert torch.equal(torch.load(tmp_path / "out.pt"), expected)


def test_copies_of_a_watched_model_are_plain():
    net = _frozen_net()
    ema = EMA(net, update_after_step=0, update_every=1, **WATCHED)
    ema.update()
    for clone in (copy.deepcopy(net), pickle.loads(pickle.dumps(net))):
        assert {
            type(m.__dict__[r])
            for m in clone.modules()
            for r in ("_parameters", "_buffers", "_modules")
        } == {TORCH_DICT}
        clone[0].requires_grad_(True)
        clone(torch.randn(2, 4))
    assert [p.data_ptr() for p in ema.ema_model[0].parameters()] == [
        p.data_ptr() for p in net[0].parameters()
    ]  # the EMA still shares the original's frozen weights
    other = EMA(net, update_after_step=0, update_every=1)  # copies net
    assert not any(len(m._forward_pre_hooks) for m in other.ema_model.modules())


def test_nothing_is_attached_to_the_model_even_when_sharing_frozen_weights():
    """The hooks that watched shared frozen weights are gone (round 4): the EMA reads the
    weights' flags and version counters before each read instead."""
    net = _frozen_net()
    hooks = [dict(m._forward_pre_hooks) for m in net.modules()]
    ema = EMA(net, update_after_step=0, update_every=1, share_frozen=True)
    ema.update()
    assert [dict(m._forward_pre_hooks) for m in net.modules()] == hooks == [{}] * len(hooks)
    del ema
    gc.collect()
    assert sum(len(m._forward_pre_hooks) for m in net.modules()) == 0


def test_registries_stay_plain_unless_watch_model_and_other_models_are_untouched():
    torch.manual_seed(0)
    net, watched, elsewhere = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
    plain = type(nn.Linear(1, 1)._parameters)  # dict; OrderedDict on torch 2.4
    ema = EMA(net)
    assert not net._forward_pre_hooks
    assert type(net._parameters) is plain  # read, never altered
    assert type(ema.ema_model._parameters) is plain
    opted = EMA(watched, watch_model=True)
    assert type(elsewhere._parameters) is plain  # nothing but the tracked modules is watched
    assert type(watched._parameters) is not plain  # the documented opt-in alters the model
    assert type(opted.ema_model._parameters) is not plain


ema_pytorch = pytest.importorskip("ema_pytorch")


@pytest.mark.skipif(
    torch_version() < (2, 5),
    reason="torch 2.4's dynamo does not run the unfreeze hook inside a compiled forward: "
    "the EMA then differs from ema-pytorch's (a known limitation, CHANGELOG)",
)
def test_unfreezing_inside_a_compiled_model_is_seen_before_the_step():
    """torch.compile traces the unfreeze hook: no graph break while frozen, one eager call
    when a weight is unfrozen; the EMA stays bit-identical to ema-pytorch's."""
    from torch._dynamo.utils import counters

    kw = {"beta": 0.9, "update_after_step": 2, "update_every": 1, "include_online_model": False}
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    net[0].requires_grad_(False)
    ref_net = copy.deepcopy(net)
    ema, ref = EMA(net, **kw), ema_pytorch.EMA(ref_net, **kw)
    compiled = torch.compile(net, backend="eager")
    opts = [
        torch.optim.SGD(m.parameters(), lr=0.1) for m in (net, ref_net)
    ]  # every parameter: unfreezing needs no new group
    torch._dynamo.reset()
    counters.clear()
    for i in range(8):
        if i == 4:
            net[0].requires_grad_(True)
            ref_net[0].requires_grad_(True)
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(i))
        for model, opt, e in ((compiled, opts[0], ema), (ref_net, opts[1], ref)):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            e.update()
        for k, v in ref.state_dict().items():
            if k.startswith("ema_model."):
                assert torch.equal(ema.state_dict()[k], v), (i, k)
        if i < 4:
            assert not counters["graph_break"], dict(counters["graph_break"])
    assert ema.ema_model[0].weight.data_ptr() != net[0].weight.data_ptr()  # un-shared

"""`emakit.compat.mmengine` against mmengine's ``mmengine.model.averaged_model``: the same
numbers after every update (bit for bit), state dicts both ways, writes into ``steps`` seen
as mmengine sees them, no host read per update, and mmengine's own ``Runner`` with
``EMAHook`` run once with mmengine's class and once with ours (one config value changed):
the same EMA weights, validation metrics and checkpoints, and resumes from either's files."""

from __future__ import annotations

import copy
import inspect
import io
import json
import math
import multiprocessing
import os
import pickle
import subprocess
import sys
import textwrap
import uuid
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

mmengine = pytest.importorskip(
    "mmengine",
    reason="mmengine is not installed (pip install mmengine-lite opencv-python-headless, "
    "in the test extra): these tests compare with its averaged models and Runner",
)
theirs = pytest.importorskip("mmengine.model.averaged_model")

import emakit.compat.mmengine as ours  # noqa: E402
from emakit.errors import EMAStateError, EMATypeError, EMAValueError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CLASSES = ("ExponentialMovingAverage", "MomentumAnnealingEMA", "StochasticWeightAverage")


def make_net(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    return net.to(dtype)


def run(module, name, kwargs, steps=20, dtype=torch.float32, after_update=None):
    """Train `make_net()` ``steps`` steps, averaging after each; ``after_update(ema,
    states)`` runs after each update (to write into ``steps``). Returns the averaged model
    and its state dict after every update."""
    net = make_net(dtype)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ema = getattr(module, name)(net, **kwargs)
    states = []
    torch.manual_seed(1)
    for _ in range(steps):
        net.train()(torch.randn(16, 6, dtype=dtype)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        ema.update_parameters(net)
        states.append({k: v.clone() for k, v in ema.state_dict().items()})
        if after_update is not None:
            after_update(ema, states)
    return ema, states


def assert_same_states(expected, got):
    """Each update's state dict, mmengine's against ours: the same keys, bit for bit."""
    assert len(expected) == len(got)
    for step, (a, b) in enumerate(zip(expected, got, strict=True)):
        assert list(a) == list(b), step
        for k in a:
            assert a[k].dtype == b[k].dtype, (step, k)
            assert torch.equal(a[k], b[k]), (step, k)


#: (class, keywords): buffers copied or averaged, interval > 1, the annealed momentum
#: crossing its floor (momentum 0.3 from steps 12 on), SWA
CASES = {
    "ema": ("ExponentialMovingAverage", {"momentum": 0.1, "device": "cpu"}),
    "ema_buffers_interval": (
        "ExponentialMovingAverage",
        {"momentum": 0.1, "interval": 3, "update_buffers": True},
    ),
    "annealing": ("MomentumAnnealingEMA", {"momentum": 0.3, "gamma": 5}),
    "annealing_buffers_interval": (
        "MomentumAnnealingEMA",
        {"momentum": 0.05, "gamma": 4, "interval": 2, "update_buffers": True},
    ),
    "swa": ("StochasticWeightAverage", {}),
    "swa_buffers_interval": ("StochasticWeightAverage", {"interval": 2, "update_buffers": True}),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_same_numbers_as_mmengine_after_every_update(case, dtype):
    name, kwargs = CASES[case]
    _, expected = run(theirs, name, kwargs, dtype=dtype)
    _, got = run(ours, name, kwargs, dtype=dtype)
    assert_same_states(expected, got)
    assert int(got[-1]["steps"]) == 20
    assert not torch.equal(got[-1]["module.0.weight"], got[0]["module.0.weight"])  # averaged


class Counting(nn.Module):
    """A linear layer with a non-persistent float buffer and a persistent integer one,
    both written by every forward."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 3)
        self.register_buffer("last_mean", torch.zeros(3), persistent=False)
        self.register_buffer("calls", torch.tensor(0))

    def forward(self, x):
        out = self.linear(x)
        self.last_mean.copy_(out.detach().mean(0))
        self.calls += 1
        return out


@pytest.mark.parametrize("update_buffers", [False, True])
@pytest.mark.parametrize("name", CLASSES)
def test_buffers_treated_as_mmengine_treats_them(name, update_buffers):
    """Copied at every call (``update_buffers=False``), or: floating persistent ones
    averaged, integer ones copied at the first call only, non-persistent ones never."""
    results = []
    for module in (theirs, ours):
        torch.manual_seed(0)
        net = Counting()
        ema = getattr(module, name)(net, update_buffers=update_buffers, interval=2)
        torch.manual_seed(1)
        seen = []
        for _ in range(7):
            with torch.no_grad():
                net.linear.weight.add_(0.1)
            net(torch.randn(4, 6))
            ema.update_parameters(net)
            seen.append({k: v.clone() for k, v in ema.module.named_buffers()})
            seen.append({k: v.clone() for k, v in ema.state_dict().items()})
        results.append(seen)
    assert_same_states(*results)
    assert int(results[1][-1]["module.calls"]) == (1 if update_buffers else 7)


def test_annealed_momentum_is_mmengines_and_reaches_its_floor():
    ema = ours.MomentumAnnealingEMA(make_net(), momentum=0.3, gamma=5)
    assert [ema.momentum_at(n) for n in (0, 1, 11, 12, 100)] == [
        max(0.3, 5 / (5 + n)) for n in (0, 1, 11, 12, 100)
    ]
    assert ema.momentum_at(11) > 0.3 and ema.momentum_at(12) == 0.3


def test_signatures_match_mmengine():
    for name in ("BaseAveragedModel", *CLASSES):
        for member in ("__init__", "update_parameters", "avg_func", "forward"):
            a = inspect.signature(getattr(getattr(theirs, name), member))
            b = inspect.signature(getattr(getattr(ours, name), member))
            assert [(p.name, p.default) for p in a.parameters.values()] == [
                (p.name, p.default) for p in b.parameters.values()
            ], (name, member)


@pytest.mark.parametrize("name", CLASSES)
def test_state_dicts_load_both_ways(name):
    kwargs = {"update_buffers": True, "interval": 2}
    mm_ema, _ = run(theirs, name, kwargs, steps=5)
    ema = getattr(ours, name)(make_net(), **kwargs)
    ema.load_state_dict(mm_ema.state_dict())  # strict
    assert int(ema.steps) == 5
    back = getattr(theirs, name)(make_net(), **kwargs)
    back.load_state_dict(ema.state_dict())  # strict
    for k, v in back.state_dict().items():
        assert torch.equal(v, mm_ema.state_dict()[k]), k
    net = make_net()  # all continue alike: the loaded steps decide copy or average
    with torch.no_grad():
        net[0].weight.add_(1.0)
    for _ in range(3):
        for averaged in (mm_ema, ema, back):
            averaged.update_parameters(net)
    for k, v in mm_ema.state_dict().items():
        assert torch.equal(v, ema.state_dict()[k]), k
        assert torch.equal(v, back.state_dict()[k]), k


def test_through_a_file_and_the_avg_parameters_attribute():
    ema, _ = run(ours, "ExponentialMovingAverage", {"momentum": 0.1}, steps=4)
    file = io.BytesIO()
    torch.save({"ema_state_dict": ema.state_dict()}, file)
    file.seek(0)
    mm = theirs.ExponentialMovingAverage(make_net(), momentum=0.1)
    mm.load_state_dict(torch.load(file)["ema_state_dict"])
    assert list(mm.avg_parameters) == list(ema.avg_parameters)
    for k, v in mm.avg_parameters.items():
        assert torch.equal(v, ema.avg_parameters[k]), k
    buffers = ours.ExponentialMovingAverage(make_net(), update_buffers=True)
    assert list(buffers.avg_parameters) == list(buffers.module.state_dict())


def exp_momentum_ema(base):
    """A subclass with its own ``avg_func`` (the shape of mmdet's ``ExpMomentumEMA``,
    written here from its formula), on ``base``'s ``ExponentialMovingAverage``."""

    class ExpMomentumEMA(base.ExponentialMovingAverage):
        def __init__(self, model, momentum=0.0002, gamma=2000, **kwargs):
            super().__init__(model, momentum=momentum, **kwargs)
            self.gamma = gamma

        def avg_func(self, averaged_param, source_param, steps):
            m = (1 - self.momentum) * math.exp(-float(1 + steps) / self.gamma) + self.momentum
            averaged_param.mul_(1 - m).add_(source_param, alpha=m)

    return ExpMomentumEMA


@pytest.mark.parametrize("update_buffers", [False, True])
def test_a_subclass_with_its_own_avg_func_runs_it_as_mmengine_does(update_buffers):
    kwargs = {"momentum": 0.01, "gamma": 10, "update_buffers": update_buffers, "interval": 2}
    net_a, net_b = make_net(), make_net()
    a = exp_momentum_ema(theirs)(net_a, **kwargs)
    b = exp_momentum_ema(ours)(net_b, **kwargs)
    torch.manual_seed(1)
    for _ in range(9):
        x = torch.randn(16, 6)
        for net in (net_a, net_b):
            with torch.no_grad():
                for p in net.parameters():
                    p.add_(0.1)
            net.train()(x)
        a.update_parameters(net_a)
        b.update_parameters(net_b)
        for k, v in a.state_dict().items():
            assert torch.equal(v, b.state_dict()[k]), k


@pytest.mark.parametrize("case", list(CASES))
def test_avg_func_called_directly_gives_mmengines_numbers(case):
    """Each class's own ``avg_func`` (which `update_parameters` runs on the engine), called
    as a subclass's ``super().avg_func(...)`` or a user calls it, with ``steps`` as
    mmengine passes it (the ``steps`` buffer)."""
    name, kwargs = CASES[case]
    a, b = getattr(theirs, name)(make_net(), **kwargs), getattr(ours, name)(make_net(), **kwargs)
    torch.manual_seed(2)
    source = torch.randn(5)
    got = []
    for ema in (a, b):
        averaged = torch.zeros(5)
        for steps in range(1, 7):
            ema.steps.fill_(steps)
            ema.avg_func(averaged, source * steps, ema.steps)
        got.append(averaged)
    assert torch.equal(got[0], got[1]) and got[1].abs().sum() > 0


def test_the_base_class_names_the_missing_avg_func():
    class Mine(ours.BaseAveragedModel):
        pass

    with pytest.raises(NotImplementedError) as info:
        Mine(make_net()).avg_func(torch.zeros(1), torch.ones(1), 1)
    assert str(info.value) == "Mine must define avg_func()"


def test_the_tensors_are_paired_once_per_model():
    ema, net = ours.ExponentialMovingAverage(make_net(), momentum=0.1), make_net()
    ema.update_parameters(net)
    engine = ema._engine
    ema.update_parameters(net)
    assert ema._engine is engine
    other = make_net()
    ema.update_parameters(other)
    assert ema._engine is not engine and ema._engine.model is other


def test_another_model_is_refused_naming_the_class_and_the_call():
    ema = ours.MomentumAnnealingEMA(make_net(), momentum=0.1)
    with pytest.raises(EMAStateError) as info:
        ema.update_parameters(nn.Sequential(nn.Linear(6, 8)))
    assert str(info.value).startswith(
        "MomentumAnnealingEMA.update_parameters(model) takes the model it was built from, or "
        "one with the same tensor names (ema_model below is .module): ema_model does not "
        "match the model by name"
    )


def test_an_avg_func_set_on_the_instance_is_called():
    calls = []
    ema = ours.ExponentialMovingAverage(make_net(), momentum=0.1)
    ema.avg_func = lambda avg, src, steps: calls.append(int(steps)) or avg.copy_(src)
    net = make_net()
    for _ in range(3):
        ema.update_parameters(net)
    assert calls == [1] * 6 + [2] * 6  # once per parameter (6), from the second update on


def test_no_host_read_of_steps_per_update(monkeypatch):
    """mmengine reads ``steps`` back at every call (``steps == 0``, ``steps % interval``,
    ``steps.item()``); a tensor's ``__bool__``/``item`` never runs in ours."""
    net = make_net()
    averaged = [
        ours.ExponentialMovingAverage(net, momentum=0.1),
        ours.MomentumAnnealingEMA(net, interval=2, update_buffers=True),
        ours.StochasticWeightAverage(net),
    ]
    for ema in averaged:
        ema.update_parameters(net)  # the first call reads steps once and builds the plan

    def refuse(self, *args):
        raise AssertionError("a host read of a tensor")

    for name in ("__bool__", "item", "__int__", "__index__", "__float__", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    for _ in range(4):
        for ema in averaged:
            ema.update_parameters(net)
    monkeypatch.undo()
    assert [int(ema.steps) for ema in averaged] == [5, 5, 5]


def assign_same_version(ema, states):
    """A new ``steps`` whose version counter equals the replaced one's."""
    new = torch.tensor(0)
    while new._version < ema.steps._version:
        new.add_(0)
    ema.steps = new


#: writes into ``steps`` between two updates: ``(ema, states so far)``
WRITES = {
    "zero_": lambda ema, states: ema.steps.zero_(),
    "fill_": lambda ema, states: ema.steps.fill_(7),
    "iadd": lambda ema, states: ema.steps.__iadd__(3),
    "load_state_dict": lambda ema, states: ema.load_state_dict(states[0]),
    "assignment": lambda ema, states: setattr(ema, "steps", torch.tensor(0)),
    "assignment_same_version": assign_same_version,
    "moved_then_fill_": lambda ema, states: (ema._apply(torch.clone), ema.steps.fill_(0)),
}


@pytest.mark.parametrize("name", CLASSES)
@pytest.mark.parametrize("write", list(WRITES))
def test_writes_into_steps_seen_as_mmengine_sees_them(write, name):
    def after_update(ema, states):
        if len(states) in (3, 6):
            WRITES[write](ema, states)

    kwargs = {"interval": 2} if name == "StochasticWeightAverage" else {"momentum": 0.1}
    _, expected = run(theirs, name, kwargs, steps=9, after_update=after_update)
    _, got = run(ours, name, kwargs, steps=9, after_update=after_update)
    assert_same_states(expected, got)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_continues_alike_without_copying_the_online_model(how):
    ema, _ = run(ours, "MomentumAnnealingEMA", {"gamma": 5}, steps=3)
    clone = copy.deepcopy(ema) if how == "deepcopy" else pickle.loads(pickle.dumps(ema))
    assert clone.__dict__["_engine"] is None  # rebuilt at its next update
    net = make_net()
    ema.update_parameters(net)
    clone.update_parameters(net)
    for k, v in ema.state_dict().items():
        assert torch.equal(v, clone.state_dict()[k]), k


def test_bad_arguments_raise_emakit_errors_naming_them():
    net = make_net()
    for bad in (0.0, 1.0, 1.5, -0.1, float("nan")):
        with pytest.raises(EMAValueError, match="momentum"):
            ours.ExponentialMovingAverage(net, momentum=bad)
    with pytest.raises(EMATypeError, match="momentum"):
        ours.ExponentialMovingAverage(net, momentum="0.1")
    with pytest.raises(EMAValueError, match="gamma"):
        ours.MomentumAnnealingEMA(net, gamma=0)
    with pytest.raises(EMAValueError, match="interval"):
        ours.StochasticWeightAverage(net, interval=0)
    with pytest.raises(EMATypeError, match="interval"):
        ours.StochasticWeightAverage(net, interval=1.5)
    with pytest.raises(EMATypeError, match="update_buffers"):
        ours.ExponentialMovingAverage(net, update_buffers="yes")
    with pytest.raises(EMATypeError, match="device"):
        ours.ExponentialMovingAverage(net, device=[0])
    with pytest.raises(EMATypeError, match="model"):
        ours.StochasticWeightAverage({"weight": torch.zeros(2)})
    with pytest.warns(UserWarning, match="momentum=0.7"):
        ours.ExponentialMovingAverage(net, momentum=0.7)
    ema = ours.ExponentialMovingAverage(net)
    with pytest.raises(
        EMAStateError, match=r"update_parameters\(model\).*not in the model \['1.bias'"
    ):
        ema.update_parameters(nn.Sequential(nn.Linear(6, 8)))
    ema.steps.fill_(-1)
    with pytest.raises(EMAValueError, match="steps=-1"):
        ema.update_parameters(net)


def test_registered_in_mmengines_models_registry():
    from mmengine.registry import MODELS

    net = make_net()
    for name in CLASSES:
        short = MODELS.build(dict(type=f"emakit.{name}", model=net))
        dotted = MODELS.build(dict(type=f"emakit.compat.mmengine.{name}", model=net))
        plain = MODELS.build(dict(type=name, model=net))
        assert type(short) is type(dotted) is getattr(ours, name)
        assert type(plain) is getattr(theirs, name)  # mmengine's own names are untouched
    assert ours.MODELS.scope == ours.SCOPE == "emakit"
    assert MODELS.children["emakit"] is ours.MODELS


_IMPORTS = textwrap.dedent(
    """
    import json, sys
    import emakit, emakit.compat
    from emakit import EMA
    found = {"mmengine_after_import_emakit": sorted(m for m in sys.modules if "mmengine" in m)}
    import torch
    from mmengine.hooks import EMAHook
    from mmengine.registry import MODELS

    class Runner:  # what EMAHook.before_run reads
        model = torch.nn.Linear(2, 2)

    # a dotted ema_type: mmengine imports emakit.compat.mmengine itself
    hook = EMAHook(ema_type="emakit.compat.mmengine.ExponentialMovingAverage", momentum=0.1)
    hook.before_run(Runner)
    found["dotted"] = type(hook.ema_model).__module__
    # OpenMMLab's plugin form: a config's custom_imports, then the short name
    from mmengine.config import Config
    cfg = Config.fromfile(sys.argv[1])
    hook = EMAHook(**{k: v for k, v in cfg.custom_hooks[0].items() if k != "type"})
    hook.before_run(Runner)
    found["short"] = type(hook.ema_model).__module__
    print(json.dumps(found))
    """
)


def test_configs_select_ours_by_one_value_and_emakit_imports_no_mmengine(tmp_path):
    config = tmp_path / "config.py"
    config.write_text(
        "custom_imports = dict(imports=['emakit.compat.mmengine'], allow_failed_imports=False)\n"
        "custom_hooks = [dict(type='EMAHook', ema_type='emakit.ExponentialMovingAverage',"
        " momentum=0.0002)]\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", _IMPORTS, str(config)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found == {
        "mmengine_after_import_emakit": [],
        "dotted": "emakit.compat.mmengine",
        "short": "emakit.compat.mmengine",
    }


# -- mmengine's Runner with EMAHook: mmengine's class, then ours by one config value -------

THEIRS = {name: name for name in CLASSES}  # EMAHook's ema_type, resolved by mmengine
OURS = {name: f"emakit.{name}" for name in CLASSES}
MAX_ITERS, CHECKPOINT_EVERY, VAL_EVERY = 12, 6, 4

#: the EMAHook keywords of each Runner run (``begin_iter`` delays the start)
HOOKS = {
    "ema_buffers_interval": (
        "ExponentialMovingAverage",
        {"momentum": 0.1, "interval": 2, "update_buffers": True},
    ),
    "annealing_begin_iter": (
        "MomentumAnnealingEMA",
        {"momentum": 0.01, "gamma": 10, "begin_iter": 3},
    ),
    "swa": ("StochasticWeightAverage", {}),
}


def train(work_dir, ema_type, ema_kwargs, resume_from=None):
    """Train a tiny BatchNorm model with mmengine's Runner and ``EMAHook``; returns the
    validation metrics (computed on the EMA weights, which EMAHook swaps in)."""
    from mmengine.evaluator import BaseMetric
    from mmengine.hooks import Hook
    from mmengine.model import BaseModel
    from mmengine.runner import Runner

    class Tiny(BaseModel):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))

        def forward(self, inputs, labels, mode="tensor"):
            out = self.net(inputs)
            loss = nn.functional.cross_entropy(out, labels)
            return {"loss": loss} if mode == "loss" else [loss]

    class Loss(BaseMetric):
        def process(self, data_batch, data_samples):
            self.results.extend(float(x) for x in data_samples)

        def compute_metrics(self, results):
            return {"loss": sum(results)}

    class Record(Hook):
        def __init__(self, into):
            self.into = into

        def after_val_epoch(self, runner, metrics=None):
            self.into.append(dict(metrics))

    data = torch.Generator().manual_seed(0)
    x, y = torch.randn(96, 4, generator=data), torch.randint(0, 3, (96,), generator=data)
    dataset = [{"inputs": x[i], "labels": y[i]} for i in range(96)]
    loader = {
        "batch_size": 8,
        "num_workers": 0,
        "sampler": {"type": "DefaultSampler", "shuffle": True},
        "collate_fn": {"type": "default_collate"},
    }
    metrics: list[dict] = []
    torch.manual_seed(0)
    runner = Runner(
        model=Tiny(),
        work_dir=str(work_dir),
        experiment_name=f"emakit-{uuid.uuid4().hex}",  # mmengine's globals are per name
        train_dataloader={**loader, "dataset": dataset[:64]},
        val_dataloader={**loader, "dataset": dataset[64:]},
        val_evaluator=[Loss()],
        train_cfg={"by_epoch": False, "max_iters": MAX_ITERS, "val_interval": VAL_EVERY},
        val_cfg={},
        optim_wrapper={"optimizer": {"type": "SGD", "lr": 0.1, "momentum": 0.9}},
        default_hooks={
            "checkpoint": {
                "type": "CheckpointHook",
                "interval": CHECKPOINT_EVERY,
                "by_epoch": False,
            },
            "logger": {"type": "LoggerHook", "interval": 1000},
        },
        custom_hooks=[{"type": "EMAHook", "ema_type": ema_type, **ema_kwargs}, Record(metrics)],
        randomness={"seed": 0},
        # keep this process's start method (mmengine's default forces "fork")
        env_cfg={"mp_cfg": {"mp_start_method": multiprocessing.get_start_method()}},
        log_level="WARNING",
        load_from=resume_from,
        resume=resume_from is not None,
    )
    runner.train()
    (ema_hook,) = [h for h in runner.hooks if type(h).__name__ == "EMAHook"]
    assert type(ema_hook.ema_model).__module__ == (
        "emakit.compat.mmengine" if ema_type.startswith("emakit.") else theirs.__name__
    )
    return metrics


def checkpoint(work_dir, iteration):
    return torch.load(Path(work_dir) / f"iter_{iteration}.pth", weights_only=False)


def assert_same_checkpoints(a, b):
    """The EMA weights (``state_dict``, as EMAHook saves them), the training weights and
    ``steps`` (``ema_state_dict``) and the optimizer state: bit for bit."""
    for key in ("state_dict", "ema_state_dict"):
        assert list(a[key]) == list(b[key]), key
        for k in a[key]:
            assert torch.equal(a[key][k], b[key][k]), (key, k)
    assert a["meta"]["iter"] == b["meta"]["iter"]
    momenta = a["optimizer"]["state"]
    assert momenta and momenta.keys() == b["optimizer"]["state"].keys()
    for i, state in momenta.items():
        assert torch.equal(state["momentum_buffer"], b["optimizer"]["state"][i]["momentum_buffer"])


@pytest.mark.filterwarnings("ignore:Environment variable TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
@pytest.mark.parametrize("hook", list(HOOKS))
def test_mmengine_runner_with_emahook_gives_mmengines_numbers(hook, tmp_path, monkeypatch):
    pytest.importorskip("mmengine.runner", reason="mmengine's Runner needs OpenCV (cv2)")
    # mmengine 0.10 resumes with torch.load's default, which torch >= 2.6 made weights-only
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    name, kwargs = HOOKS[hook]
    mm_metrics = train(tmp_path / "mmengine", THEIRS[name], kwargs)
    our_metrics = train(tmp_path / "emakit", OURS[name], kwargs)
    assert len(our_metrics) == MAX_ITERS // VAL_EVERY
    assert our_metrics == mm_metrics  # validation ran on the same EMA weights
    for iteration in (CHECKPOINT_EVERY, MAX_ITERS):
        assert_same_checkpoints(
            checkpoint(tmp_path / "mmengine", iteration), checkpoint(tmp_path / "emakit", iteration)
        )
    end = checkpoint(tmp_path / "mmengine", MAX_ITERS)
    assert not torch.equal(
        end["state_dict"]["net.0.weight"], end["ema_state_dict"]["module.net.0.weight"]
    )
    # resume each from the other's checkpoint: the same end as the uninterrupted runs
    for first, then, ema_type in (
        ("mmengine", "ours_from_theirs", OURS[name]),
        ("emakit", "theirs_from_ours", THEIRS[name]),
    ):
        middle = tmp_path / first / f"iter_{CHECKPOINT_EVERY}.pth"
        metrics = train(tmp_path / then, ema_type, kwargs, resume_from=str(middle))
        assert metrics == mm_metrics[CHECKPOINT_EVERY // VAL_EVERY :]
        assert_same_checkpoints(end, checkpoint(tmp_path / then, MAX_ITERS))


@pytest.mark.parametrize("gamma", [0, -1])
def test_momentum_annealing_refuses_a_gamma_at_or_below_0_naming_it(gamma):
    with pytest.raises(EMAValueError) as info:
        ours.MomentumAnnealingEMA(make_net(), gamma=gamma)
    assert str(info.value) == (
        f"gamma must be a finite number in (0, inf), got gamma={gamma}; e.g. gamma=100"
    )
    assert ours.MomentumAnnealingEMA(make_net(), gamma=0.5).gamma == 0.5  # any positive


def test_momentum_annealing_device_puts_the_average_there_as_mmengine():
    for module in (theirs, ours):
        averaged = module.MomentumAnnealingEMA(make_net(), device="meta")
        assert averaged.steps.is_meta, module
        assert all(t.is_meta for t in averaged.module.state_dict().values()), module


def test_a_subclass_avg_func_follows_a_replaced_parameter_as_mmengine_does():
    """The tensors a subclass's own ``avg_func`` gets are listed once per plan: a model
    parameter replaced by a new one between updates is the one averaged next."""
    kwargs = {"momentum": 0.1, "gamma": 10}
    net_a, net_b = make_net(), make_net()
    a = exp_momentum_ema(theirs)(net_a, **kwargs)
    b = exp_momentum_ema(ours)(net_b, **kwargs)
    for step in range(4):
        if step == 2:
            for net in (net_a, net_b):
                first = net[0]
                first.weight = nn.Parameter(torch.full_like(first.weight, 5.0))
        a.update_parameters(net_a)
        b.update_parameters(net_b)
        for k, v in a.state_dict().items():
            assert torch.equal(v, b.state_dict()[k]), (step, k)


def test_a_subclass_avg_func_gets_the_models_tensors_on_the_averages_device():
    """``device="meta"`` stands for another device (``steps`` put back on the CPU, since a
    meta count cannot be read): a subclass's ``avg_func`` gets each model tensor moved to
    the average's device, as mmengine's loop moves it; the same calls as mmengine's."""
    seen: dict = {}
    for module in (theirs, ours):

        class Recorded(module.ExponentialMovingAverage):
            def avg_func(self, averaged_param, source_param, steps):
                calls = seen.setdefault(type(self).__module__ + str(id(type(self))), [])
                calls.append((averaged_param.device.type, source_param.device.type, int(steps)))
                averaged_param.lerp_(source_param, 0.1)

        averaged = Recorded(make_net(), device="meta")
        averaged.steps = torch.tensor(0)
        net = make_net()
        for _ in range(3):
            averaged.update_parameters(net)
        assert all(t.is_meta for t in averaged.module.parameters())
    peers, mine = seen.values()
    assert mine == peers and {c[:2] for c in mine} == {("meta", "meta")}
    assert len(mine) == 2 * len(list(make_net().parameters()))  # updates 2 and 3 average


@pytest.mark.parametrize("momentum", [0, 1, 1.5])
def test_a_momentum_outside_0_1_is_refused_saying_what_it_is(momentum):
    with pytest.raises(EMAValueError) as info:
        ours.ExponentialMovingAverage(make_net(), momentum=momentum)
    assert str(info.value) == (
        f"momentum must be a finite number in (0, 1), got momentum={momentum}; mmengine's "
        f"momentum is the weight of the new value (1 - decay), e.g. 0.0002"
    )


def test_a_momentum_above_one_half_warns_at_the_callers_line():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours.ExponentialMovingAverage(make_net(), momentum=0.5)  # the last value taken silently
        assert caught == []
        ours.ExponentialMovingAverage(make_net(), momentum=0.6)
    (found,) = caught
    assert found.category is UserWarning
    assert str(found.message) == (
        "momentum=0.6 is the weight of the model's new weights in mmengine's EMA (1 - decay), "
        "usually a small number such as 0.0002; check that this is meant"
    )
    if "MUTANT_UNDER_TEST" not in os.environ:  # mutmut's trampolines add stack frames
        assert found.filename == __file__
    with pytest.warns(UserWarning, match="momentum=0.6") as caught:
        ours.MomentumAnnealingEMA(make_net(), momentum=0.6)  # through its super().__init__
    if "MUTANT_UNDER_TEST" not in os.environ:
        assert [w.filename for w in caught] == [__file__]


def test_frozen_weights_are_averaged_as_mmengine_averages_them():
    """mmengine averages every weight, trained or not: a frozen weight that changes (here
    through ``.data``) moves the average by the momentum, as in mmengine's class."""
    net_a, net_b = make_net(), make_net()
    for net in (net_a, net_b):
        net[0].weight.requires_grad_(False)
    a = theirs.ExponentialMovingAverage(net_a, momentum=0.25)
    b = ours.ExponentialMovingAverage(net_b, momentum=0.25)
    for step in range(4):
        for net in (net_a, net_b):
            net[0].weight.data.add_(1.0)
            with torch.no_grad():
                net[3].weight.add_(0.5)
        a.update_parameters(net_a)
        b.update_parameters(net_b)
        for k, v in a.state_dict().items():
            assert torch.equal(v, b.state_dict()[k]), (step, k)

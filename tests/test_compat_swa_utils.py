"""`emakit.compat.swa_utils` against torch's ``torch.optim.swa_utils``: the same numbers
(bit for bit with `get_ema_multi_avg_fn`, float32 rounding for SWA), state dicts both ways,
user functions called as torch calls them, writes into ``n_averaged`` seen as torch sees
them (torchvision's EMA recipe replayed), and no host read of ``n_averaged`` per update
unless it was written."""

from __future__ import annotations

import copy
import inspect
import io
import operator

import pytest
import torch
import torch.optim.swa_utils as theirs
from torch import nn

import emakit.compat.swa_utils as ours
from emakit.errors import EMAStateError, EMAValueError


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))


def run(module, fn_kwargs, use_buffers=False, steps=12, after_update=None):
    """Train `make_net()` ``steps`` steps, averaging after each; ``after_update(averaged,
    states)`` runs after each update (to write into ``n_averaged``)."""
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    averaged = module.AveragedModel(net, use_buffers=use_buffers, **fn_kwargs(module))
    states = []
    torch.manual_seed(1)
    for _ in range(steps):
        net.train()(torch.randn(16, 6)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        averaged.update_parameters(net)
        states.append({k: v.clone() for k, v in averaged.state_dict().items()})
        if after_update is not None:
            after_update(averaged, states)
    return averaged, states


FNS = {
    "ema_multi": lambda m: {"multi_avg_fn": m.get_ema_multi_avg_fn(0.9)},
    "ema_single": lambda m: {"avg_fn": m.get_ema_avg_fn(0.9)},
    "torchs_own_fn": lambda m: {"multi_avg_fn": theirs.get_ema_multi_avg_fn(0.9)},
    "user_lambda": lambda m: {"avg_fn": lambda a, c, n: a + (c - a) / (n + 2)},
    "swa": lambda m: {},
}


def assert_same_states(expected, got, fn, use_buffers):
    """Each update's state dict, torch's against ours: equal, except where documented."""
    for step, (a, b) in enumerate(zip(expected, got, strict=True)):
        assert list(a) == list(b)
        for k in a:
            if k.endswith("num_batches_tracked") and use_buffers and fn in ("ema_multi", "swa"):
                assert int(b[k]) == step + 1  # copied (a documented difference)
            elif fn == "swa" and a[k].is_floating_point():  # torch divides on the CPU
                assert torch.allclose(a[k], b[k], rtol=0, atol=4e-7), (step, k)
            else:
                assert torch.equal(a[k], b[k]), (fn, step, k)


@pytest.mark.parametrize("use_buffers", [False, True])
@pytest.mark.parametrize("fn", list(FNS))
def test_same_numbers_as_torch_after_every_update(fn, use_buffers):
    _, expected = run(theirs, FNS[fn], use_buffers)
    _, got = run(ours, FNS[fn], use_buffers)
    assert_same_states(expected, got, fn, use_buffers)
    assert not torch.equal(got[-1]["module.0.weight"], got[0]["module.0.weight"])


def test_signatures_match_torch():
    for name in ("AveragedModel", "get_ema_multi_avg_fn", "get_ema_avg_fn"):
        a = inspect.signature(getattr(theirs, name))
        b = inspect.signature(getattr(ours, name))
        assert [(p.name, p.default) for p in a.parameters.values()] == [
            (p.name, p.default) for p in b.parameters.values()
        ], name


def test_state_dicts_load_both_ways():
    fn = FNS["ema_multi"]
    torch_avg, _ = run(theirs, fn, steps=4)
    our_avg = ours.AveragedModel(make_net(), **fn(ours))
    our_avg.load_state_dict(torch_avg.state_dict())  # strict
    assert int(our_avg.n_averaged) == 4
    back = theirs.AveragedModel(make_net(), **fn(theirs))
    back.load_state_dict(our_avg.state_dict())  # strict
    for k, v in back.state_dict().items():
        assert torch.equal(v, torch_avg.state_dict()[k]), k
    net = make_net()  # both continue alike (the loaded count decides copy vs average)
    with torch.no_grad():
        net[0].weight.add_(1.0)
    back.update_parameters(net)
    our_avg.update_parameters(net)
    for k, v in back.state_dict().items():
        assert torch.equal(v, our_avg.state_dict()[k]), k


def test_no_host_read_of_n_averaged_per_update(monkeypatch):
    """torch's ``bool(self.n_averaged == 0)`` reads the device tensor back every call; a
    tensor's ``__bool__``/``item`` never runs in ours."""
    averaged = ours.AveragedModel(make_net(), multi_avg_fn=ours.get_ema_multi_avg_fn(0.9))
    net = make_net()
    averaged.update_parameters(net)  # the first call builds the plan

    def refuse(self, *args):
        raise AssertionError("a host read of a tensor")

    for name in ("__bool__", "item", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    for _ in range(3):
        averaged.update_parameters(net)
    monkeypatch.undo()
    assert int(averaged.n_averaged) == 4


def test_bad_arguments_and_other_models():
    with pytest.raises(EMAValueError) as info:
        ours.AveragedModel(
            make_net(), avg_fn=ours.get_ema_avg_fn(), multi_avg_fn=ours.get_ema_multi_avg_fn()
        )
    assert str(info.value) == (
        "pass avg_fn or multi_avg_fn, not both (got both); multi_avg_fn is faster"
    )
    with pytest.raises(EMAValueError, match="decay"):
        ours.get_ema_multi_avg_fn(1.5)
    averaged = ours.AveragedModel(make_net(), multi_avg_fn=ours.get_ema_multi_avg_fn(0.9))
    with pytest.raises(EMAStateError):
        averaged.update_parameters(nn.Sequential(nn.Linear(6, 8)))


def test_a_user_multi_avg_fn_gets_n_averaged_as_torch():
    """torch's own SWA function passed as ``multi_avg_fn``: it reads ``n_averaged``, so the
    numbers are torch's only when it is given the count (torch's function fails on
    integer buffers: ``use_buffers=False`` only)."""

    def fns(module):
        return {"multi_avg_fn": theirs.get_swa_multi_avg_fn()}

    _, expected = run(theirs, fns)
    _, got = run(ours, fns)
    assert_same_states(expected, got, "torchs_swa_fn", use_buffers=False)
    assert not torch.equal(got[-1]["module.0.weight"], got[0]["module.0.weight"])


def shifted_net(by: float) -> nn.Module:
    net = make_net()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(by)
    return net


@pytest.mark.parametrize("fn", ["ema_multi", "swa", "user_lambda"])
def test_update_with_another_model_averages_that_model_as_torch(fn):
    """Updates alternating between two models of one structure: each update averages the
    model it is given, as torch's does."""
    states = []
    for module in (theirs, ours):
        first, second = make_net(), shifted_net(1.0)
        averaged = module.AveragedModel(first, **FNS[fn](module))
        for net in (first, first, second, first, second):
            averaged.update_parameters(net)
        states.append([{k: v.clone() for k, v in averaged.state_dict().items()}])
    assert_same_states(*states, fn, use_buffers=False)
    assert not torch.equal(states[1][0]["module.0.weight"], make_net()[0].weight)


@pytest.mark.parametrize("fn", ["ema_multi", "swa"])
def test_the_tensors_are_paired_once_per_model(fn):
    """The engine that pairs the tensors is built at the first update and kept for the
    next ones with the same model; another model gets its own."""
    net = make_net()
    averaged = ours.AveragedModel(net, **FNS[fn](ours))
    averaged.update_parameters(net)
    engine = averaged._engine
    assert engine is not None and engine.model is net
    for _ in range(2):
        averaged.update_parameters(net)
        assert averaged._engine is engine
    other = shifted_net(1.0)
    averaged.update_parameters(other)
    assert averaged._engine is not engine and averaged._engine.model is other


def test_a_user_function_refuses_a_model_with_other_buffers():
    """With ``avg_fn`` and ``use_buffers=False`` the buffers are copied from the model: a
    model with other buffers (here none) is refused rather than partly copied (torch
    copies as many as the shorter list holds)."""
    averaged = ours.AveragedModel(make_net(), avg_fn=ours.get_ema_avg_fn(0.9))
    other = nn.Sequential(
        nn.Linear(6, 8), nn.BatchNorm1d(8, track_running_stats=False), nn.Linear(8, 3)
    )
    assert len(list(other.parameters())) == len(list(averaged.module.parameters()))
    with pytest.raises(
        EMAStateError,
        match=r"not in the model \['1.num_batches_tracked', '1.running_mean', '1.running_var'\]",
    ):
        averaged.update_parameters(other)


def test_a_frozen_weight_written_in_place_is_averaged_as_torch():
    """A frozen weight is averaged like the others (torch averages every parameter): a
    write into it moves the average by one update's share, and ``.module`` never shares
    the model's tensor."""
    states = []
    for module in (theirs, ours):
        net = make_net()
        net[0].requires_grad_(False)
        averaged = module.AveragedModel(net, multi_avg_fn=module.get_ema_multi_avg_fn(0.9))
        averaged.update_parameters(net)
        averaged.update_parameters(net)
        with torch.no_grad():
            net[0].weight.add_(1.0)
        averaged.update_parameters(net)
        assert averaged.module[0].weight.data_ptr() != net[0].weight.data_ptr()
        states.append(averaged.state_dict())
    assert_same_states([states[0]], [states[1]], "ema_multi", use_buffers=False)


def test_a_user_function_averages_into_a_module_of_another_dtype_as_torch():
    """``.module`` made float64 after construction: a user ``avg_fn`` gets the float64
    average and the float32 weights, as torch gives them (no cast, no refusal)."""
    fn = lambda a, c, n: a + (c - a) / (n + 2)  # noqa: E731
    states = []
    for module in (theirs, ours):
        net = make_net()
        averaged = module.AveragedModel(net, avg_fn=fn)
        averaged.module.double()
        for i in range(3):
            with torch.no_grad():
                for p in net.parameters():
                    p.add_(0.1 * (i + 1))
            averaged.update_parameters(net)
        states.append(averaged.state_dict())
    assert states[1]["module.0.weight"].dtype == torch.float64
    assert_same_states([states[0]], [states[1]], "user_lambda", use_buffers=False)


@pytest.mark.parametrize(
    "fn",
    [{"avg_fn": ours.get_ema_avg_fn(0.9)}, {"multi_avg_fn": ours.get_ema_multi_avg_fn(0.9)}],
    ids=["avg_fn", "multi_avg_fn"],
)
def test_the_tensors_are_paired_by_name_with_every_function(fn):
    """A model of the same shapes under other names, or of one more layer, is refused
    naming the tensors, with a user function as with the engine's (torch zips by position:
    it averages the renamed model, and stops at the shorter list)."""
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    renamed = nn.Sequential()
    renamed.add_module("x", nn.Linear(2, 2))
    renamed.add_module("y", nn.Linear(2, 2))
    longer = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    for other, names in (
        (renamed, "['x.bias', 'x.weight', 'y.bias', 'y.weight']"),
        (longer, "['2.bias', '2.weight']"),
    ):
        averaged = ours.AveragedModel(net, **fn)
        averaged.update_parameters(net)
        before = [t.clone() for t in averaged.module.parameters()]
        with pytest.raises(EMAStateError) as info:
            averaged.update_parameters(other)
        assert "does not match the model by name: missing from " in str(info.value)
        assert names in str(info.value)
        if "avg_fn" in fn:  # the user's function: the message names where the average is
            assert str(info.value).startswith("the averaged model (.module) does not match")
        assert all(
            torch.equal(a, b) for a, b in zip(before, averaged.module.parameters(), strict=True)
        )
    averaged = ours.AveragedModel(net, **fn)
    wrapped = nn.parallel.DataParallel(net)  # unwrapped as the engine unwraps it
    averaged.update_parameters(wrapped)
    averaged.update_parameters(wrapped)
    assert averaged.n_averaged.item() == 2


def assign_same_version(averaged, states):
    """A new ``n_averaged`` whose version counter equals the replaced one's (only its
    identity tells them apart)."""
    new = torch.tensor(0)
    while new._version < averaged.n_averaged._version:
        new.add_(0)
    averaged.n_averaged = new


#: writes into ``n_averaged`` between two updates: ``(averaged, states so far)``
WRITES = {
    "fill_": lambda avg, states: avg.n_averaged.fill_(0),
    "copy_": lambda avg, states: avg.n_averaged.copy_(torch.tensor(7)),
    "zero_": lambda avg, states: avg.n_averaged.zero_(),
    "iadd": lambda avg, states: operator.iadd(avg.n_averaged, 2),
    "load_state_dict": lambda avg, states: avg.load_state_dict(states[0]),
    "load_state_dict_assign": lambda avg, states: avg.load_state_dict(
        {k: v.clone() for k, v in states[0].items()}, assign=True
    ),
    "assignment": lambda avg, states: setattr(avg, "n_averaged", torch.tensor(0)),
    "assignment_same_version": assign_same_version,
    # what .to(device) does to every buffer (a new tensor), then a write into the new one
    "moved_then_fill_": lambda avg, states: (avg._apply(torch.clone), avg.n_averaged.fill_(0)),
}


@pytest.mark.parametrize("use_buffers", [False, True])
@pytest.mark.parametrize("fn", ["ema_multi", "swa", "user_lambda", "torchs_own_fn"])
@pytest.mark.parametrize("write", list(WRITES))
def test_writes_into_n_averaged_seen_as_torch_sees_them(write, fn, use_buffers):
    """Engine functions (``ema_multi``, ``swa``) and user functions alike: a write between
    two updates decides the next update as in torch's class."""

    def after_update(averaged, states):
        if len(states) in (3, 6):
            WRITES[write](averaged, states)

    _, expected = run(theirs, FNS[fn], use_buffers, steps=9, after_update=after_update)
    _, got = run(ours, FNS[fn], use_buffers, steps=9, after_update=after_update)
    assert_same_states(expected, got, fn, use_buffers)


@pytest.mark.parametrize("fn", ["ema_multi", "user_lambda"])
def test_copy_made_after_a_write_sees_it(fn):
    """A deep copy's ``n_averaged`` has a new version counter, which may equal the one seen
    at the last update (torch starts a copy's at 1): the copy reads the value instead."""
    expected, got = [], []
    for module, states in ((theirs, expected), (ours, got)):
        averaged, _ = run(module, FNS[fn], steps=1)
        averaged.n_averaged.fill_(0)
        clone = copy.deepcopy(averaged)
        clone.update_parameters(make_net())
        states.append(clone.state_dict())
    assert_same_states(expected, got, fn, use_buffers=False)


def test_negative_n_averaged_refused():
    averaged = ours.AveragedModel(make_net(), multi_avg_fn=ours.get_ema_multi_avg_fn(0.9))
    averaged.n_averaged.fill_(-1)
    with pytest.raises(EMAValueError, match="n_averaged=-1"):
        averaged.update_parameters(make_net())


@pytest.mark.parametrize("fn", ["ema_multi", "user_lambda"])
def test_n_averaged_read_back_only_after_a_write(fn, monkeypatch):
    """One host read per write into ``n_averaged`` (torchvision's warm-up), none else."""
    averaged = ours.AveragedModel(make_net(), **FNS[fn](ours))
    net = make_net()
    averaged.update_parameters(net)  # the first call reads it once and builds the plan
    reads = []

    def counted(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args):
            reads.append(name)
            return original(self, *args)

        return read

    for name in ("__bool__", "item", "__int__", "__index__", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, counted(name))
    for i in range(6):
        averaged.update_parameters(net)
        if i % 2:
            averaged.n_averaged.fill_(0)
    monkeypatch.undo()
    assert len(reads) == 2  # at the updates after the first two fill_(0)
    assert int(averaged.n_averaged) == 0


# -- torchvision's references/classification/train.py, its EMA lines -----------------------

EPOCHS, BATCHES, BATCH_SIZE = 4, 5, 8
LR_WARMUP_EPOCHS, MODEL_EMA_STEPS, MODEL_EMA_DECAY = 2, 2, 0.95


def torchvision_ema(module):
    """torchvision's ``utils.ExponentialMovingAverage``, on ``module.AveragedModel``."""

    class ExponentialMovingAverage(module.AveragedModel):
        def __init__(self, model, decay, device="cpu"):
            def ema_avg(avg_model_param, model_param, num_averaged):
                return decay * avg_model_param + (1 - decay) * model_param

            super().__init__(model, device, ema_avg, use_buffers=True)

    return ExponentialMovingAverage


def torchvision_setup(module):
    """train.py's model, optimizer and ``model_ema`` (``world_size`` 1)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    adjust = 1 * BATCH_SIZE * MODEL_EMA_STEPS / EPOCHS
    alpha = min(1.0, (1.0 - MODEL_EMA_DECAY) * adjust)
    model_ema = torchvision_ema(module)(model, device="cpu", decay=1.0 - alpha)
    return model, optimizer, model_ema


def torchvision_train(model, optimizer, model_ema, epochs):
    """train.py's ``train_one_epoch`` loop over ``epochs``, with its EMA lines."""
    for epoch in epochs:
        model.train()
        for i in range(BATCHES):
            data = torch.Generator().manual_seed(100 * epoch + i)
            image = torch.randn(BATCH_SIZE, 3, 8, 8, generator=data)
            target = torch.randint(0, 5, (BATCH_SIZE,), generator=data)
            loss = nn.functional.cross_entropy(model(image), target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if model_ema and i % MODEL_EMA_STEPS == 0:
                model_ema.update_parameters(model)
                if epoch < LR_WARMUP_EPOCHS:
                    # Reset ema buffer to keep copying weights during warmup period
                    model_ema.n_averaged.fill_(0)


def replay_torchvision(first, then=None, resume_after=None):
    """The run on ``first``'s class; with ``then``, checkpointed after ``resume_after``
    epochs (through a file) and resumed on ``then``'s. Returns the model's and the EMA's
    state dicts."""
    model, optimizer, model_ema = torchvision_setup(first)
    if then is None:
        torchvision_train(model, optimizer, model_ema, range(EPOCHS))
        return model.state_dict(), model_ema.state_dict()
    torchvision_train(model, optimizer, model_ema, range(resume_after))
    file = io.BytesIO()
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "model_ema": model_ema.state_dict(),
            "epoch": resume_after - 1,
        },
        file,
    )
    file.seek(0)
    checkpoint = torch.load(file)
    model, optimizer, model_ema = torchvision_setup(then)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    model_ema.load_state_dict(checkpoint["model_ema"])
    torchvision_train(model, optimizer, model_ema, range(checkpoint["epoch"] + 1, EPOCHS))
    return model.state_dict(), model_ema.state_dict()


MODULES = {"torch": theirs, "emakit": ours}


@pytest.mark.parametrize(
    ("first", "then", "resume_after"),
    [
        ("emakit", None, None),
        ("torch", "emakit", 1),  # in the warm-up
        ("emakit", "torch", 1),
        ("torch", "emakit", 3),  # after it
        ("emakit", "torch", 3),
        ("emakit", "emakit", 1),
    ],
)
def test_torchvision_ema_recipe_gives_torchs_numbers(first, then, resume_after):
    model, expected = replay_torchvision(theirs)
    _, got = replay_torchvision(MODULES[first], then and MODULES[then], resume_after)
    assert list(got) == list(expected)
    for k in expected:
        assert torch.equal(got[k], expected[k]), k
    assert int(got["n_averaged"]) == (EPOCHS - LR_WARMUP_EPOCHS) * len(
        range(0, BATCHES, MODEL_EMA_STEPS)
    )
    assert not torch.equal(got["module.0.weight"], model["0.weight"])  # an average, not a copy

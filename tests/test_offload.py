"""Offloaded and background (async) EMA updates: same numbers, no race."""

from __future__ import annotations

import copy
import pickle
import threading
from functools import partial

import pytest
import torch

import _models
import emakit
from _models import bn_mlp
from emakit import EMA
from emakit._engine import plan as plan_mod
from emakit._engine.runners import ThreadRunner

make_net = partial(bn_mlp, 6, 16, 3, relu=True)


#: ``train(net, emas, steps=20)``: SGD steps, each followed by every EMA's ``update()``.
train = partial(_models.train, steps=20, batch=(8, 6), seed=3)


@pytest.mark.parametrize("flatten", [False, True])
@pytest.mark.parametrize("ema_dtype", [None, torch.float64])
def test_async_equals_sync_bit_for_bit(flatten, ema_dtype):
    net = make_net()
    if flatten:
        emakit.flatten_parameters(net)
    kw = dict(
        beta=0.95,
        update_after_step=4,
        update_every=2,
        ema_dtype=ema_dtype,
        param_or_buffer_names_no_ema={"3.bias"},
    )
    sync = EMA(net, use_foreach=False, **kw)
    bg = EMA(net, device="cpu", **kw)
    assert bg.async_update and isinstance(bg.tracker.runner, ThreadRunner)
    train(net, [sync, bg])
    for (k, a), (_, b) in zip(
        sync.ema_model.state_dict().items(), bg.ema_model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), k


def test_readers_wait_for_a_slow_background_update(monkeypatch):
    """The worker is held at a gate: update() must return while it is blocked (the update
    is really asynchronous), and every reader must see the finished update, never a
    half-written shadow."""
    net = make_net()
    ema = EMA(net, update_after_step=0, update_every=1, async_update=True, schedule=lambda t: 0.5)
    ema.update()  # first call: synchronous copy
    ref = EMA(net, update_after_step=0, update_every=1, schedule=lambda t: 0.5)
    ref.update()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)
    ref.update()

    gate, entered = threading.Event(), threading.Event()
    original = plan_mod.Plan.finish

    def slow_finish(self, action):
        entered.set()
        assert gate.wait(timeout=30)
        return original(self, action)

    monkeypatch.setattr(plan_mod.Plan, "finish", slow_finish)
    ema.update()  # returns although the worker is held at the gate
    assert entered.wait(timeout=30)
    assert ema.tracker.runner.pending

    readers = {
        "forward": lambda: ema(torch.ones(2, 6)),
        "state_dict": lambda: ema.state_dict()["ema_model.0.weight"],
        "ema_model": lambda: ema.ema_model[0].weight.detach().clone(),
    }
    waiting = {name: threading.Event() for name in readers}
    original_wait = ThreadRunner.wait

    def traced_wait(self):
        event = waiting.get(threading.current_thread().name)
        if event is not None:
            event.set()
        return original_wait(self)

    monkeypatch.setattr(ThreadRunner, "wait", traced_wait)
    results: dict[str, torch.Tensor] = {}

    def read(name):
        results[name] = readers[name]()

    threads = [threading.Thread(target=read, args=(n,), name=n) for n in readers]
    for t in threads:
        t.start()
    for name, event in waiting.items():
        assert event.wait(timeout=30), f"{name} never waited for the runner"
    # Every reader is inside wait(), which cannot return before the gated worker does.
    assert not results
    assert ema.tracker.runner.pending
    gate.set()
    for t in threads:
        t.join(timeout=30)
    expected = ref.ema_model[0].weight
    assert torch.equal(results["state_dict"], expected)
    assert torch.equal(results["ema_model"], expected)
    assert torch.equal(results["forward"], ref(torch.ones(2, 6)))


def test_worker_errors_surface_on_next_read(monkeypatch):
    net = make_net()
    ema = EMA(net, update_after_step=0, update_every=1, async_update=True)
    ema.update()

    def broken(self, action):
        raise RuntimeError("worker failed")

    monkeypatch.setattr(plan_mod.Plan, "finish", broken)
    ema.update()
    with pytest.raises(RuntimeError, match="worker failed"):
        ema.state_dict()


def test_swap_and_copies_wait_and_pickle():
    net = make_net()
    ema = EMA(net, beta=0.9, update_after_step=0, update_every=1, async_update=True)
    ref = EMA(net, beta=0.9, update_after_step=0, update_every=1)
    train(net, [ema, ref], steps=6)
    with ema.swap():
        assert torch.equal(net[0].weight, ref.ema_model[0].weight)
    clone = pickle.loads(pickle.dumps(ema))
    assert torch.equal(clone.ema_model[0].weight, ref.ema_model[0].weight)
    deep = copy.deepcopy(ema)
    train(deep.model, [deep], steps=2)
    assert int(deep.step) == 8
    ema.copy_params_from_ema_to_model()
    assert torch.equal(net[0].weight, ref.ema_model[0].weight)


def test_device_argument_validation():
    with pytest.raises(emakit.EMAError, match="device"):
        EMA(make_net(), device=3)
    with pytest.raises(emakit.EMAError, match="device"):
        EMA(make_net(), device="not-a-device")
    with pytest.raises(emakit.EMAError, match="async_update"):
        EMA(make_net(), async_update="yes")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_model_cpu_shadow_pinned():  # pragma: no cover - runs on GPU machines
    net = make_net().cuda()
    ema = EMA(net, device="cpu", update_after_step=0, update_every=1)
    ref = EMA(net, update_after_step=0, update_every=1)
    assert ema.ema_model[0].weight.device.type == "cpu"
    assert ema.ema_model[0].weight.is_pinned()
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(5):
        net(torch.randn(8, 6, generator=gen).cuda()).sum().backward()
        opt.step()
        opt.zero_grad()
        ema.update()
        ref.update()
    assert torch.equal(ema.ema_model[0].weight, ref.ema_model[0].weight.cpu())


def test_stream_needs_cuda_model():
    with pytest.raises(emakit.EMAValueError, match="stream=True"):
        EMA(make_net(), stream=True)
    with pytest.raises(emakit.EMAValueError, match="stream=True"):
        EMA(make_net(), stream=True, device="cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_stream_update_matches_sync():  # pragma: no cover - runs on GPU machines
    net = make_net().cuda()
    ema = EMA(net, stream=True, update_after_step=2, update_every=1)
    ref = EMA(net, update_after_step=2, update_every=1)
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(8):
        net(torch.randn(8, 6, generator=gen).cuda()).sum().backward()
        opt.step()
        opt.zero_grad()
        ema.update()
        ref.update()
    assert torch.equal(ema.ema_model[0].weight, ref.ema_model[0].weight)


def test_optimizer_hooked_async_reads_live_weights_and_matches_sync(monkeypatch):
    """With the optimizer hooks, background updates take no snapshot of the parameters
    (the staging path is never used) and still give the synchronous EMA bit for bit."""
    torch.manual_seed(0)
    net = make_net()
    ref_net = copy.deepcopy(net)
    bg = EMA(net, beta=0.9, update_after_step=3, update_every=2, async_update=True)
    ref = EMA(ref_net, beta=0.9, update_after_step=3, update_every=2, use_foreach=False)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (net, ref_net)]
    handle = bg.add_to_optimizer_post_step_hook(opts[0])
    staged = []
    original_stage = plan_mod.Plan.stage
    monkeypatch.setattr(
        plan_mod.Plan, "stage", lambda self, **kw: staged.append(1) or original_stage(self, **kw)
    )
    gen = torch.Generator().manual_seed(5)
    for _ in range(15):
        x = torch.randn(8, 6, generator=gen)
        for m, opt in zip((net, ref_net), opts, strict=True):
            m(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        ref.update()
    assert int(bg.step) == int(ref.step) == 15
    assert not staged  # every update after hooking was zero-copy
    for (k, a), (_, b) in zip(
        bg.ema_model.state_dict().items(), ref.ema_model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), k
    handle.remove()
    assert not bg.tracker.runner.live
    opts[0].step()  # no EMA update any more
    assert int(bg.step) == 15


def test_optimizer_step_waits_for_the_background_update(monkeypatch):
    """The worker is held at a gate: the next optimizer.step() must not run (and so must
    not write the weights the worker reads) until the update has finished."""
    net = make_net()
    ema = EMA(net, update_after_step=0, update_every=1, async_update=True, schedule=lambda t: 0.5)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ema.add_to_optimizer_post_step_hook(opt)
    net(torch.randn(4, 6)).sum().backward()
    opt.step()  # first update: synchronous copy
    gate, entered = threading.Event(), threading.Event()
    original = plan_mod.Plan.run

    def slow(self, action):
        if threading.current_thread().name.startswith("emakit-ema"):  # the worker's part
            entered.set()
            assert gate.wait(timeout=30)
        return original(self, action)

    monkeypatch.setattr(plan_mod.Plan, "run", slow)
    before = net[0].weight.detach().clone()
    net(torch.randn(4, 6)).sum().backward()
    opt.step()  # returns: the post-step update is in the background, held at the gate
    assert entered.wait(timeout=30)
    after_first = net[0].weight.detach().clone()
    assert not torch.equal(before, after_first)
    done, waiting = threading.Event(), threading.Event()
    original_wait = ThreadRunner.wait

    def traced_wait(self):
        if threading.current_thread().name == "stepper":
            waiting.set()
        return original_wait(self)

    monkeypatch.setattr(ThreadRunner, "wait", traced_wait)

    def step_again():
        opt.step()
        done.set()

    stepper = threading.Thread(target=step_again, name="stepper")
    stepper.start()
    assert waiting.wait(timeout=30)  # the step's pre-hook waits for the pending update...
    assert not done.is_set()  # ...which cannot finish while the worker is held
    assert torch.equal(net[0].weight, after_first)  # so the step has not written the weights
    gate.set()
    stepper.join(timeout=30)
    assert done.is_set()
    ema.tracker.runner.wait()

"""The drop-ins after ``.to()`` and after a copy: an averaged module converted with
``.to(torch.float64)`` converts ``.module`` and goes on averaging its new tensors as the
peer does; ``device=`` puts the average there (``meta`` stands for another device on a
CPU-only machine, and a CUDA test checks the update's move where there is a GPU); a
saved or copied mmengine model holds no online weights and reads its ``steps`` again."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.optim.swa_utils as torch_swa_utils
from torch import nn

from emakit.compat import swa_utils, timm
from emakit.compat.torch_ema import ExponentialMovingAverage


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def moved(net: nn.Module, by: float) -> None:
    with torch.no_grad():
        for p in net.parameters():
            p.add_(by)


def assert_same_states(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k


def averaged_before_and_after_to_float64(build, update) -> dict:
    """Two updates in float32, ``.to(torch.float64)`` of the average and of the model,
    two more updates: the state dict then."""
    net = make_net()
    averaged = build(net)
    for by in (0.5, 0.25):
        moved(net, by)
        update(averaged, net)
    assert averaged.to(torch.float64) is averaged
    net.to(torch.float64)
    assert all(t.dtype == torch.float64 for t in averaged.module.parameters())
    for by in (1.0, -2.0):
        moved(net, by)
        update(averaged, net)
    return averaged.state_dict()


def test_swa_utils_to_float64_converts_the_average_and_goes_on_as_torch():
    def build(module):
        return lambda net: module.AveragedModel(net, multi_avg_fn=module.get_ema_multi_avg_fn(0.9))

    def update(averaged, net):
        averaged.update_parameters(net)

    theirs = averaged_before_and_after_to_float64(build(torch_swa_utils), update)
    ours = averaged_before_and_after_to_float64(build(swa_utils), update)
    assert_same_states(theirs, ours)


def test_mmengine_to_float64_converts_the_average_and_goes_on_as_mmengine():
    pytest.importorskip("mmengine")
    theirs_module = pytest.importorskip("mmengine.model.averaged_model")
    from emakit.compat import mmengine as ours_module

    def update(averaged, net):
        averaged.update_parameters(net)

    states = [
        averaged_before_and_after_to_float64(
            lambda net, m=module: m.ExponentialMovingAverage(net, momentum=0.1), update
        )
        for module in (theirs_module, ours_module)
    ]
    assert_same_states(*states)


def test_swa_utils_device_puts_the_average_and_n_averaged_there_as_torch():
    """``device=`` moves ``.module`` and makes ``n_averaged`` there, a long, as torch's."""
    for module in (torch_swa_utils, swa_utils):
        averaged = module.AveragedModel(make_net(), device="meta")
        assert averaged.n_averaged.is_meta, module
        assert averaged.n_averaged.dtype == torch.long, module
        assert all(t.is_meta for t in averaged.module.state_dict().values()), module
    assert not swa_utils.AveragedModel(make_net()).n_averaged.is_meta  # no device: the CPU


def recording_functions(seen: list) -> dict:
    """``AveragedModel`` keywords by name; the user functions record the device types of
    what they are given: ``(averaged, current, n_averaged)``."""

    def avg_fn(averaged, current, n):
        seen.append((averaged.device.type, current.device.type, n.device.type))
        return averaged

    def multi_avg_fn(averaged, current, n):
        for a, c in zip(averaged, current, strict=True):
            seen.append((a.device.type, c.device.type, n.device.type))

    return {
        "swa": lambda module: {},
        "get_ema_multi_avg_fn": lambda module: {"multi_avg_fn": module.get_ema_multi_avg_fn(0.9)},
        "avg_fn": lambda module: {"avg_fn": avg_fn},
        "multi_avg_fn": lambda module: {"multi_avg_fn": multi_avg_fn},
    }


@pytest.mark.parametrize("fn", list(recording_functions([])))
def test_swa_utils_an_average_on_another_device_is_updated_there_as_torch(fn):
    """``device="meta"`` for a CPU model (another device without a GPU; ``n_averaged`` put
    back on the CPU, since a meta count cannot be read): every update runs, the engine's
    across the two devices, and a user function gets the model's tensors moved to the
    average's device, as torch's does."""
    seen_by: list[list] = []
    for module in (torch_swa_utils, swa_utils):
        seen: list = []
        seen_by.append(seen)
        net = make_net()
        averaged = module.AveragedModel(net, device="meta", **recording_functions(seen)[fn](module))
        averaged.n_averaged = torch.tensor(0)
        for by in (0.5, -1.0, 2.0):
            moved(net, by)
            averaged.update_parameters(net)
        assert int(averaged.n_averaged) == 3, module
        assert all(t.is_meta for t in averaged.module.state_dict().values()), module
        assert not any(t.is_meta for t in net.state_dict().values()), module
    assert seen_by[1] == seen_by[0]
    if fn in ("avg_fn", "multi_avg_fn"):  # two averaging updates of the 6 parameters
        assert seen_by[1] == [("meta", "meta", "meta")] * 12


def test_swa_utils_to_empty_without_recurse_leaves_the_average_as_torch():
    """``to_empty(recurse=False)`` converts the averaged module's own buffer
    (``n_averaged``) and not ``.module``, as torch's."""
    for module in (torch_swa_utils, swa_utils):
        averaged = module.AveragedModel(make_net())
        assert averaged.to_empty(device="meta", recurse=False) is averaged
        assert averaged.n_averaged.is_meta, module
        assert not any(t.is_meta for t in averaged.module.state_dict().values()), module
    averaged.to_empty(device="meta")
    assert all(t.is_meta for t in averaged.module.state_dict().values())


def test_timm_device_puts_the_average_there():
    """``device=`` moves the copy (``meta``: another device without a GPU)."""
    net = make_net()
    for ema in (timm.ModelEmaV2(net, device="meta"), timm.ModelEmaV2(net, 0.9, "meta")):
        assert ema.device == "meta"
        assert all(t.is_meta for t in ema.module.state_dict().values())
    v1 = timm.ModelEma(net, 0.9, device="meta")
    assert all(t.is_meta for t in v1.ema.state_dict().values())


def test_torch_ema_to_a_device_moves_the_shadow_and_the_stored_tensors():
    for cls in (
        pytest.importorskip("torch_ema").ExponentialMovingAverage,
        ExponentialMovingAverage,
    ):
        params = [torch.zeros(3, requires_grad=True), torch.arange(3)]
        ema = cls(params, decay=0.9)
        ema.store()
        ema.to(device="meta")
        assert [t.device.type for t in ema.shadow_params] == ["meta", "meta"], cls
        assert [t.device.type for t in ema.collected_params] == ["meta", "meta"], cls
        assert [t.dtype for t in ema.shadow_params] == [torch.float32, torch.int64], cls


def updated_alike(emas: list, nets: list) -> tuple[dict, dict]:
    """The state dicts of the peer's EMA and ours after three moves of their models."""
    for by in (0.5, -1.0, 2.0):
        for ema, net in zip(emas, nets, strict=True):
            moved(net, by)
            ema.update(net)
    theirs, ours = (e.state_dict() for e in emas)
    return theirs, ours


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("cls", ["ModelEma", "ModelEmaV2"])
def test_timm_update_moves_the_model_to_the_averages_device_as_timm(cls):
    """A CPU average of a CUDA model: each update moves the model's values to the CPU
    first; timm's numbers bit for bit."""
    timm_ema = pytest.importorskip("timm.utils.model_ema")
    emas, nets = [], []
    for module in (timm_ema, timm):
        net = make_net().cuda()
        emas.append(getattr(module, cls)(net, 0.9, device="cpu"))
        nets.append(net)
    theirs, ours = updated_alike(emas, nets)
    assert all(t.device.type == "cpu" for t in ours.values())
    assert_same_states(theirs, ours)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("device", [None, "cpu"])
def test_timm_v3_stochastic_rounding_of_a_cuda_model_as_timm(device):
    """A bfloat16 CUDA model, its EMA on the GPU (the random bits drawn there, from the
    EMA's generator) or on the CPU (``device="cpu"``: the model's values moved there
    first): timm's numbers bit for bit."""
    timm_ema = pytest.importorskip("timm.utils.model_ema")
    emas, nets = [], []
    for module in (timm_ema, timm):
        net = make_net().to("cuda", torch.bfloat16)
        emas.append(module.ModelEmaV3(net, 0.9, device=device))
        nets.append(net)
    theirs, ours = updated_alike(emas, nets)
    expected = "cuda" if device is None else "cpu"
    assert all(t.device.type == expected for t in ours.values())
    assert_same_states(theirs, ours)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_swa_utils_cpu_average_of_a_cuda_model_as_torch():
    """``device="cpu"`` for a CUDA model: the engine averages across the two devices;
    torch's numbers bit for bit with `get_ema_multi_avg_fn`."""
    states = []
    for module in (torch_swa_utils, swa_utils):
        net = make_net().cuda()
        averaged = module.AveragedModel(
            net, device="cpu", multi_avg_fn=module.get_ema_multi_avg_fn(0.9)
        )
        for by in (0.5, -1.0, 2.0):
            moved(net, by)
            averaged.update_parameters(net)
        states.append(averaged.state_dict())
    assert all(t.device.type == "cpu" for t in states[1].values())
    assert_same_states(*states)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("fn", ["avg_fn", "multi_avg_fn"])
def test_swa_utils_user_functions_get_n_averaged_on_the_tensors_device_as_torch(fn):
    """A CUDA model averaged without ``device=`` keeps ``n_averaged`` on the CPU; a user
    function gets it on the device of the tensors it averages, as torch's does."""
    seen, states = [], []
    for module in (torch_swa_utils, swa_utils):
        devices: list[torch.device] = []
        seen.append(devices)

        def avg_fn(averaged, current, n, devices=devices):
            devices.append(n.device)
            return averaged + (current - averaged) / (n + 1)

        def multi_avg_fn(averaged, current, n, devices=devices):
            devices.append(n.device)
            torch._foreach_lerp_(averaged, current, 0.5)

        net = make_net().cuda()
        averaged = module.AveragedModel(net, **{fn: avg_fn if fn == "avg_fn" else multi_avg_fn})
        assert averaged.n_averaged.device.type == "cpu"
        for by in (0.5, -1.0, 2.0):
            moved(net, by)
            averaged.update_parameters(net)
        states.append(averaged.state_dict())
    assert seen[0] and all(d.type == "cuda" for d in seen[0])
    assert seen[1] == seen[0]
    assert_same_states(*states)


# -- mmengine: what a copy or a saved model holds ------------------------------------------


def test_mmengine_swa_saved_whole_holds_no_online_weights():
    """``torch.save(swa)`` after updates (Ultralytics-style, the whole module) is the size
    of a fresh one: the lists of the model's tensors the SWA update keeps are left out."""
    pytest.importorskip("mmengine")
    from emakit.compat import mmengine as ours

    def saved_size(module: nn.Module) -> int:
        buffer = io.BytesIO()
        torch.save(module, buffer)
        return len(buffer.getvalue())

    net = nn.Linear(128, 128)
    fresh = saved_size(ours.StochasticWeightAverage(net))
    swa = ours.StochasticWeightAverage(net)
    for by in (0.5, 0.25, 1.0):
        moved(net, by)
        swa.update_parameters(net)
    assert saved_size(swa) < fresh + 128 * 128 * 4 // 2  # not a second copy of the weights
    buffer = io.BytesIO()
    torch.save(swa, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    moved(net, -3.0)
    for s in (swa, loaded):
        s.update_parameters(net)
    assert_same_states(swa.state_dict(), loaded.state_dict())


def test_mmengine_copy_after_steps_was_zeroed_copies_the_model_as_mmengine():
    """``steps.fill_(0)`` after one update, then a deep copy: the copy's ``steps`` has a
    new version counter, which may equal the one seen at that update, so the copy reads
    it and its next update copies the model, as mmengine's."""
    pytest.importorskip("mmengine")
    theirs = pytest.importorskip("mmengine.model.averaged_model")
    from emakit.compat import mmengine as ours

    states = []
    for module in (theirs, ours):
        net = make_net()
        ema = module.ExponentialMovingAverage(net, momentum=0.1)
        ema.update_parameters(net)
        ema.steps.fill_(0)
        clone = copy.deepcopy(ema)
        other = make_net()
        moved(other, 1.0)
        clone.update_parameters(other)
        assert torch.equal(clone.module[0].weight, other[0].weight), module
        states.append(clone.state_dict())
    assert_same_states(*states)

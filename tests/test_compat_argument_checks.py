"""The drop-ins' argument checks, to the word: the name in the message, both bounds of a
decay, and the defaults a call without the argument gets (timm's ``ModelEmaV2`` and
``ModelEma``, torch's ``get_ema_avg_fn``, torch_ema's parameter lists)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from emakit.compat import swa_utils, timm
from emakit.compat.diffusers import EMAModel
from emakit.compat.mmengine import ExponentialMovingAverage as MMEngineEMA
from emakit.compat.torch_ema import ExponentialMovingAverage
from emakit.errors import EMATypeError, EMAValueError

DECAYS = {
    "timm.ModelEmaV3": lambda decay: timm.ModelEmaV3(nn.Linear(2, 2), decay=decay),
    "timm.ModelEmaV3.min_decay": lambda decay: timm.ModelEmaV3(
        nn.Linear(2, 2), decay=0.0, min_decay=decay
    ),
    "timm.ModelEmaV2": lambda decay: timm.ModelEmaV2(nn.Linear(2, 2), decay=decay),
    "timm.ModelEma": lambda decay: timm.ModelEma(nn.Linear(2, 2), decay=decay),
    "swa_utils.get_ema_avg_fn": lambda decay: swa_utils.get_ema_avg_fn(decay),
    "swa_utils.get_ema_multi_avg_fn": lambda decay: swa_utils.get_ema_multi_avg_fn(decay),
    "torch_ema": lambda decay: ExponentialMovingAverage([torch.zeros(1)], decay=decay),
}


@pytest.mark.parametrize("make", list(DECAYS))
@pytest.mark.parametrize("decay", [-0.5, 1.5])
def test_a_decay_outside_0_1_is_refused_naming_it(make, decay):
    name = "min_decay" if make.endswith("min_decay") else "decay"
    with pytest.raises(EMAValueError) as caught:
        DECAYS[make](decay)
    assert str(caught.value) == f"{name} must be a finite number in [0, 1], got {name}={decay}"


@pytest.mark.parametrize("make", list(DECAYS))
def test_both_ends_of_the_decay_are_taken(make):
    name = "min_decay" if make.endswith("min_decay") else "decay"
    for decay in (0.0, 1.0):
        assert getattr(DECAYS[make](decay), name) == decay


#: Other arguments refused, each with its message: the argument's name, the interval a
#: number must lie in (warm-up settings exclude 0), the value.
REFUSED = {
    "timm.ModelEmaV3.update_after_step": (
        lambda: timm.ModelEmaV3(nn.Linear(2, 2), update_after_step=-1),
        "update_after_step must be >= 0, got update_after_step=-1",
    ),
    "timm.ModelEmaV3.use_warmup": (
        lambda: timm.ModelEmaV3(nn.Linear(2, 2), use_warmup=1),
        "use_warmup must be True or False, got use_warmup=1 (int)",
    ),
    "timm.ModelEmaV3.warmup_gamma": (
        lambda: timm.ModelEmaV3(nn.Linear(2, 2), warmup_gamma=0.0),
        "warmup_gamma must be a finite number in (0, inf), got warmup_gamma=0.0",
    ),
    "timm.ModelEmaV3.warmup_power_0": (
        lambda: timm.ModelEmaV3(nn.Linear(2, 2), warmup_power=0.0),
        "warmup_power must be a finite number in (0, inf), got warmup_power=0.0",
    ),
    "timm.ModelEmaV3.warmup_power_negative": (
        lambda: timm.ModelEmaV3(nn.Linear(2, 2), warmup_power=-1.0),
        "warmup_power must be a finite number in (0, inf), got warmup_power=-1.0",
    ),
    "timm.ModelEmaV3.exclude_buffers": (
        lambda: timm.ModelEmaV3(nn.Linear(2, 2), exclude_buffers=1),
        "exclude_buffers must be True or False, got exclude_buffers=1 (int)",
    ),
    "timm.ModelEmaV3.dtype": (
        lambda: timm.ModelEmaV3(nn.Linear(2, 2), dtype=torch.int32),
        "dtype must be a floating torch.dtype such as torch.float32, got dtype=torch.int32",
    ),
    "timm.ModelEmaV3.stochastic_rounding": (
        lambda: timm.ModelEmaV3(nn.Linear(2, 2), stochastic_rounding=1),
        "stochastic_rounding must be True or False, got stochastic_rounding=1 (int)",
    ),
    "timm.ModelEmaV3.stochastic_rounding_seed": (
        lambda: timm.ModelEmaV3(nn.Linear(2, 2), stochastic_rounding_seed=1.5),
        "stochastic_rounding_seed must be an int, got stochastic_rounding_seed=1.5 (float)",
    ),
    "timm.ModelEmaV3.foreach": (
        lambda: timm.ModelEmaV3(nn.Linear(2, 2), foreach=1),
        "foreach must be True or False, got foreach=1 (int)",
    ),
    "timm.ModelEmaV3.skip_nonfinite": (
        lambda: timm.ModelEmaV3(nn.Linear(2, 2), skip_nonfinite=1),
        "skip_nonfinite must be True or False, got skip_nonfinite=1 (int)",
    ),
    "timm.ModelEmaV3.model_without_parameters": (
        lambda: timm.ModelEmaV3(nn.ReLU()),
        "model has no parameters: there is nothing to average",
    ),
    "diffusers.EMAModel.power": (
        lambda: EMAModel([torch.zeros(1)], power=0),
        "power must be a finite number in (0, inf), got power=0",
    ),
    "diffusers.EMAModel.inv_gamma": (
        lambda: EMAModel([torch.zeros(1)], inv_gamma=0),
        "inv_gamma must be a finite number in (0, inf), got inv_gamma=0",
    ),
    "diffusers.EMAModel.update_after_step": (
        lambda: EMAModel([torch.zeros(1)], update_after_step=1.5),
        "update_after_step must be an int, got update_after_step=1.5 (float)",
    ),
    "diffusers.EMAModel.optimization_step": (
        lambda: EMAModel([torch.zeros(1)]).load_state_dict({"optimization_step": -1}),
        "optimization_step must be >= 0, got optimization_step=-1",
    ),
    "diffusers.EMAModel.use_ema_warmup": (
        lambda: EMAModel([torch.zeros(1)], use_ema_warmup=1),
        "use_ema_warmup must be True or False, got use_ema_warmup=1 (int)",
    ),
    "diffusers.EMAModel.foreach": (
        lambda: EMAModel([torch.zeros(1)], foreach=1),
        "foreach must be True or False, got foreach=1 (int)",
    ),
    "diffusers.EMAModel.ema_dtype": (
        lambda: EMAModel([torch.zeros(1)], ema_dtype=torch.int32),
        "ema_dtype must be a floating torch.dtype such as torch.float32, got ema_dtype=torch.int32",
    ),
    "diffusers.EMAModel.skip_nonfinite": (
        lambda: EMAModel([torch.zeros(1)], skip_nonfinite=1),
        "skip_nonfinite must be True or False, got skip_nonfinite=1 (int)",
    ),
    "diffusers.EMAModel.parameters_a_tensor": (
        lambda: EMAModel(torch.zeros(2)),
        "parameters must be an iterable of tensors (model.parameters()), got Tensor",
    ),
    "diffusers.EMAModel.parameters_not_tensors": (
        lambda: EMAModel([torch.zeros(1), *range(6)]),
        "parameters must be a non-empty iterable of tensors (model.parameters()), got "
        "['Tensor', 'int', 'int', 'int', 'int']",
    ),
    "mmengine.model": (
        lambda: MMEngineEMA(object()),
        "model must be a torch.nn.Module (the model to average), got object",
    ),
    "mmengine.interval": (
        lambda: MMEngineEMA(nn.Linear(2, 2), interval=0),
        "interval must be >= 1, got interval=0",
    ),
    "mmengine.update_buffers": (
        lambda: MMEngineEMA(nn.Linear(2, 2), update_buffers=1),
        "update_buffers must be True or False, got update_buffers=1 (int)",
    ),
    "swa_utils.AveragedModel.use_buffers": (
        lambda: swa_utils.AveragedModel(nn.Linear(2, 2), use_buffers=1),
        "use_buffers must be True or False, got use_buffers=1 (int)",
    ),
    "torch_ema.use_num_updates": (
        lambda: ExponentialMovingAverage([torch.zeros(1)], 0.9, use_num_updates=1),
        "use_num_updates must be True or False, got use_num_updates=1 (int)",
    ),
    "torch_ema.skip_nonfinite": (
        lambda: ExponentialMovingAverage([torch.zeros(1)], 0.9, skip_nonfinite=1),
        "skip_nonfinite must be True or False, got skip_nonfinite=1 (int)",
    ),
    "torch_ema.parameters": (
        lambda: ExponentialMovingAverage([1, 2], 0.9),
        "parameters must be an iterable of tensors (e.g. model.parameters()), got ['int', 'int']",
    ),
    "torch_ema.parameters_many": (  # the first 5 types named
        lambda: ExponentialMovingAverage([1, 2.0, "3", None, b"5", 6, 7], 0.9),
        "parameters must be an iterable of tensors (e.g. model.parameters()), got "
        "['int', 'float', 'str', 'NoneType', 'bytes']",
    ),
    "torch_ema.parameters_empty": (
        lambda: ExponentialMovingAverage([], 0.9),
        "parameters must be an iterable of tensors (e.g. model.parameters()), got nothing",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_other_arguments_are_refused_naming_them(case):
    call, message = REFUSED[case]
    with pytest.raises((EMAValueError, EMATypeError)) as caught:
        call()
    assert str(caught.value) == message


def test_timm_default_decays_are_timms():
    """The defaults apply when the argument is left out (timm's 0.9999 for both)."""
    net = nn.Linear(2, 2)
    assert timm.ModelEmaV2(net).decay == 0.9999
    assert timm.ModelEma(net).decay == 0.9999
    assert swa_utils.get_ema_avg_fn().decay == 0.999


def test_timm_v3_keeps_the_settings_it_was_given():
    """The settings stay readable as timm's attributes, the seed as an int (numpy's too)."""
    import numpy as np

    ema = timm.ModelEmaV3(nn.Linear(2, 2), device="cpu", stochastic_rounding_seed=np.int64(7))
    assert ema.device == "cpu" and ema.stochastic_rounding_seed == 7
    assert type(ema.stochastic_rounding_seed) is int
    assert timm.ModelEmaV3(nn.Linear(2, 2)).stochastic_rounding_seed == 0


def test_diffusers_defaults_and_deprecated_forms_said_as_diffusers_says_them():
    ema = EMAModel([torch.zeros(1)])
    assert ema.foreach is False and ema.skip_nonfinite is False
    with pytest.warns(FutureWarning) as caught:
        EMAModel([torch.zeros(1)], max_value=0.9, min_value=0.1)
    assert [(w.category, str(w.message)) for w in caught] == [
        (FutureWarning, "EMAModel(max_value=...) is deprecated in diffusers; use decay"),
        (FutureWarning, "EMAModel(min_value=...) is deprecated in diffusers; use min_decay"),
    ]
    with pytest.warns(FutureWarning) as caught:
        EMAModel(nn.Linear(2, 2))
    assert [(w.category, str(w.message)) for w in caught] == [
        (
            FutureWarning,
            "passing a module to EMAModel() is deprecated in diffusers; pass module.parameters()",
        ),
    ]


def test_diffusers_starts_with_nothing_stored_and_takes_the_deprecated_device():
    with pytest.warns(FutureWarning, match="device"):
        ema = EMAModel([torch.zeros(2)], device="cpu")
    assert ema.cur_decay_value is None and ema.temp_stored_params is None
    assert ema.shadow_params[0].device == torch.device("cpu")


def test_diffusers_skip_nonfinite_leaves_the_shadow():
    p = nn.Parameter(torch.zeros(2))
    ema = EMAModel([p], skip_nonfinite=True)
    with torch.no_grad():
        p.fill_(float("nan"))
    with pytest.warns(RuntimeWarning, match="skipped an EMA update at step 1"):
        ema.step([p])
    assert ema.shadow_params[0].tolist() == [0.0, 0.0]


def test_mmengine_average_is_not_trained():
    """``.module`` does not require grad (mmengine's ``requires_grad_(False)``)."""
    ema = MMEngineEMA(nn.Linear(2, 2))
    assert [p.requires_grad for p in ema.module.parameters()] == [False, False]


def test_diffusers_load_with_a_bad_step_changes_nothing():
    """The step is checked with the other settings, before the shadow is written."""
    ema = EMAModel([torch.zeros(2)])
    with pytest.raises(EMAValueError, match="optimization_step=-1"):
        ema.load_state_dict({"shadow_params": [torch.ones(2)], "optimization_step": -1})
    assert ema.shadow_params[0].tolist() == [0.0, 0.0] and ema.optimization_step == 0


def test_torch_ema_other_parameters_are_checked_naming_them():
    """``copy_to``/``store``/``update`` with parameters given check them as the constructor
    does: an iterable of tensors, named ``parameters`` in the message."""
    params = [torch.zeros(2, requires_grad=True)]
    ema = ExponentialMovingAverage(params, decay=0.9)
    for method in ("copy_to", "store", "update"):
        with pytest.raises(EMATypeError) as caught:
            getattr(ema, method)([1, 2])
        assert str(caught.value) == (
            "parameters must be an iterable of tensors (e.g. model.parameters()), got "
            "['int', 'int']"
        ), method

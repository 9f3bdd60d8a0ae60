"""How the drop-ins read and write checkpoints, to the word: timm's V1 ``ModelEma``
(``_load_checkpoint``: what a file holds, where it came from, ``module.`` prefixes; its
``load_state_dict``), diffusers' ``EMAModel`` (``save_pretrained`` without a model class
or config, ``from_pretrained``'s settings and warning) and Lightning's
``EMAWeightAveraging.on_load_checkpoint`` called as the Trainer calls it. The timm and
Lightning comparisons run where the peer is installed; the rest needs no peer."""

from __future__ import annotations

import io
import os
import warnings
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from emakit.compat import timm as compat_timm
from emakit.compat.diffusers import EMAModel
from emakit.errors import EMAStateError, EMATypeError, EMAValueError

#: Under mutmut every emakit function is called through a trampoline, one frame more: the
#: tests of where a warning points skip there.
needs_plain_frames = pytest.mark.skipif(
    "MUTANT_UNDER_TEST" in os.environ, reason="mutmut's trampolines add stack frames"
)


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def moved(net: nn.Module, by: float = 1.0) -> nn.Module:
    with torch.no_grad():
        for p in net.parameters():
            p.add_(by)
    return net


def same_state(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


# -- timm's V1 ModelEma: _load_checkpoint -----------------------------------------------------

NOT_A_DICT = (
    "{} holds a list, not a checkpoint dict with a 'state_dict_ema' entry or a state dict "
    "of the EMA model"
)


def test_model_ema_v1_a_file_of_something_else_is_named_in_the_error(tmp_path):
    """The message names the file: a str as given, an open file by its ``name``, a file
    object without a name as ``checkpoint``; and says what it holds."""
    path = tmp_path / "list.pth"
    torch.save([1, 2], path)
    with pytest.raises(EMAStateError) as caught:
        compat_timm.ModelEma(make_net(), resume=str(path))
    assert str(caught.value) == NOT_A_DICT.format(path)
    with pytest.raises(EMAStateError) as caught:  # a Path: the whole path, not its .name
        compat_timm.ModelEma(make_net(), resume=path)
    assert str(caught.value) == NOT_A_DICT.format(path)
    with open(path, "rb") as f, pytest.raises(EMAStateError) as caught:
        compat_timm.ModelEma(make_net(), resume=f)
    assert str(caught.value) == NOT_A_DICT.format(path)
    unnamed = io.BytesIO(path.read_bytes())
    with pytest.raises(EMAStateError) as caught:
        compat_timm.ModelEma(make_net(), resume=unnamed)
    assert str(caught.value) == NOT_A_DICT.format("checkpoint")


def test_model_ema_v1_an_unreadable_file_object_is_called_a_checkpoint_file():
    with pytest.raises(EMAStateError) as caught:
        compat_timm.ModelEma(make_net(), resume=io.BytesIO(b"not a torch file"))
    assert str(caught.value).startswith(
        "the checkpoint file given as a file object could not be read as a torch file"
    )


def test_model_ema_v1_no_ema_in_the_file_warns_listing_its_first_8_keys(tmp_path):
    """The warning's text, checked where stack frames differ too (where it points: the
    next test): the file, its first 8 keys and how many there are."""
    path = tmp_path / "settings.pth"
    torch.save({f"k{i}": i for i in range(10)}, path)
    ema = compat_timm.ModelEma(make_net(), 0.9)
    with pytest.warns(UserWarning, match="has no 'state_dict_ema' entry") as caught:
        ema._load_checkpoint(str(path))
    assert len(caught) == 1
    keys = [f"k{i}" for i in range(8)]
    assert str(caught[0].message) == (
        f"{path} has no 'state_dict_ema' entry and is not a state dict (keys {keys} ... "
        f"(10)): the EMA keeps the weights it was built from (timm's ModelEma logs the same "
        f"and goes on)"
    )


@needs_plain_frames
def test_model_ema_v1_no_ema_in_the_file_warns_at_the_callers_line_listing_8_keys(tmp_path):
    """DeiT calls ``model_ema._load_checkpoint(file)`` itself: the warning points at that
    line, as does ``resume=``, and lists the checkpoint's first 8 keys and how many there are."""
    path = tmp_path / "settings.pth"
    torch.save({f"k{i}": i for i in range(10)}, path)
    ema = compat_timm.ModelEma(make_net(), 0.9)
    before = {k: v.clone() for k, v in ema.state_dict().items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ema._load_checkpoint(str(path))
    assert len(caught) == 1 and caught[0].category is UserWarning
    keys = [f"k{i}" for i in range(8)]
    assert str(caught[0].message) == (
        f"{path} has no 'state_dict_ema' entry and is not a state dict (keys {keys} ... "
        f"(10)): the EMA keeps the weights it was built from (timm's ModelEma logs the same "
        f"and goes on)"
    )
    assert caught[0].filename == __file__
    assert same_state(ema.state_dict(), before)
    with warnings.catch_warnings(record=True) as caught:  # resume=: the user's line too
        warnings.simplefilter("always")
        compat_timm.ModelEma(make_net(), 0.9, resume=str(path))
    assert [w.filename for w in caught] == [__file__]


def test_model_ema_v1_prefixed_names_into_a_wrapped_model_as_timm(tmp_path):
    """An EMA of a ``DataParallel`` model (``.ema.module``) reads a ``state_dict_ema`` whose
    names already carry ``module.``: kept as they are (timm adds the prefix only to names
    without it)."""
    trained = nn.DataParallel(moved(make_net()))
    path = tmp_path / "wrapped.pth"
    torch.save({"state_dict_ema": trained.state_dict()}, path)
    assert all(k.startswith("module.") for k in trained.state_dict())
    ours = compat_timm.ModelEma(nn.DataParallel(make_net()), 0.9, resume=str(path))
    assert ours.ema_has_module
    assert same_state(ours.ema.state_dict(), trained.state_dict())
    pytest.importorskip("timm")
    from timm.utils.model_ema import ModelEma as Theirs

    theirs = Theirs(nn.DataParallel(make_net()), 0.9, resume=str(path))
    assert same_state(theirs.ema.state_dict(), ours.ema.state_dict())


def test_model_ema_v1_prefixed_names_into_a_plain_model_are_stripped(tmp_path):
    """A checkpoint of a ``DataParallel`` EMA read into an EMA of the bare model: the
    ``module.`` prefixes are stripped (timm would fail on them; a documented extra)."""
    trained = moved(make_net())
    path = tmp_path / "wrapped.pth"
    torch.save({"state_dict_ema": nn.DataParallel(trained).state_dict()}, path)
    ours = compat_timm.ModelEma(make_net(), 0.9, resume=str(path))
    assert not ours.ema_has_module
    assert same_state(ours.ema.state_dict(), trained.state_dict())


def test_model_ema_v1_load_state_dict_is_strict_unless_told():
    ema = compat_timm.ModelEma(make_net(), 0.9)
    trained = moved(make_net(), 2.0)
    partial = {"0.weight": trained[0].weight.detach().clone()}
    for kwargs in ({}, {"strict": True}):
        with pytest.raises(RuntimeError, match=r"Missing key\(s\)"):
            ema.load_state_dict(partial, **kwargs)
    result = ema.load_state_dict(partial, strict=False)
    assert "0.bias" in result.missing_keys and not result.unexpected_keys
    assert torch.equal(ema.ema[0].weight, trained[0].weight)


# -- diffusers' EMAModel: save_pretrained and from_pretrained ----------------------------------


def test_diffusers_save_pretrained_names_what_is_missing():
    net = make_net()
    cases = [
        ({}, "model_cls"),
        ({"model_config": {"width": 4}}, "model_cls"),
        ({"model_cls": object}, "model_config"),  # object has no from_config: not reached
    ]
    for kwargs, missing in cases:
        ema = EMAModel(net.parameters(), **kwargs)
        with pytest.raises(EMAValueError) as caught:
            ema.save_pretrained("unused")
        assert str(caught.value) == (
            f"save_pretrained needs {missing}= at construction (e.g. model_cls=UNet2DModel, "
            f"model_config=unet.config), got {missing}=None"
        ), kwargs


@needs_plain_frames
def test_diffusers_deprecated_keywords_warn_at_the_callers_line():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        EMAModel([torch.zeros(1)], max_value=0.9)
    assert [(w.category, w.filename) for w in caught] == [(FutureWarning, __file__)]


@needs_plain_frames
def test_diffusers_a_module_passed_to_any_method_warns_at_the_callers_line():
    """Also through the methods under ``@torch.no_grad()`` (``step``, ``copy_to``,
    ``restore``), whose wrapper adds a frame of torch's."""
    net = nn.Linear(2, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ema = EMAModel(net)
        ema.step(net)
        ema.copy_to(net)
        ema.store(net)
        ema.restore(net)
    said = [(str(w.message).split(" is ")[0], w.filename) for w in caught]
    assert said == [
        (f"passing a module to EMAModel{method}", __file__)
        for method in ("()", ".step()", ".copy_to()", ".store()", ".restore()")
    ]


def test_diffusers_store_of_a_module_names_the_method():
    net = make_net()
    ema = EMAModel(net.parameters())
    with pytest.warns(FutureWarning) as caught:
        ema.store(net)
    assert [str(w.message) for w in caught] == [
        "passing a module to EMAModel.store() is deprecated in diffusers; pass module.parameters()"
    ]
    assert [t.tolist() for t in ema.temp_stored_params] == [p.tolist() for p in net.parameters()]


@pytest.fixture(scope="module")
def tiny_model_cls():
    """A two-layer ``ModelMixin`` (much lighter to save and read than a UNet)."""
    from _frameworks import need

    modeling_utils = need("diffusers.models.modeling_utils")
    configuration_utils = need("diffusers.configuration_utils")

    class Tiny(modeling_utils.ModelMixin, configuration_utils.ConfigMixin):
        @configuration_utils.register_to_config
        def __init__(self, width: int = 4) -> None:
            super().__init__()
            self.first = nn.Linear(width, width)
            self.second = nn.Linear(width, 2)

    return Tiny


def test_diffusers_from_pretrained_of_an_ema_folder(tmp_path, tiny_model_cls):
    """A folder ``save_pretrained`` wrote reads back silently, ``foreach`` as given
    (False by default, checked), and with the model's config, so it can be saved again."""
    model = tiny_model_cls()
    ema = EMAModel(model.parameters(), model_cls=tiny_model_cls, model_config=model.config)
    moved(model, 0.5)
    for _ in range(3):
        ema.step(model.parameters())
    ema.save_pretrained(tmp_path / "ema")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an EMA folder has its optimization_step
        back = EMAModel.from_pretrained(tmp_path / "ema", tiny_model_cls)
    assert back.foreach is False and back.optimization_step == 3
    assert EMAModel.from_pretrained(tmp_path / "ema", tiny_model_cls, foreach=True).foreach
    with pytest.raises(EMATypeError) as caught:
        EMAModel.from_pretrained(tmp_path / "ema", tiny_model_cls, foreach="yes")
    assert str(caught.value) == "foreach must be True or False, got foreach='yes' (str)"
    assert back.model_config["width"] == 4
    back.save_pretrained(tmp_path / "again")  # needs the config from_pretrained kept
    again = EMAModel.from_pretrained(tmp_path / "again", tiny_model_cls)
    assert again.optimization_step == 3
    assert all(
        torch.equal(a, b) for a, b in zip(again.shadow_params, ema.shadow_params, strict=True)
    )


@needs_plain_frames
def test_diffusers_from_pretrained_of_a_model_folder_warns_at_the_callers_line(
    tmp_path, tiny_model_cls
):
    tiny_model_cls().save_pretrained(tmp_path / "plain")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ema = EMAModel.from_pretrained(tmp_path / "plain", tiny_model_cls)
    said = [w for w in caught if "optimization_step" in str(w.message)]
    assert len(said) == 1 and said[0].category is UserWarning
    assert said[0].filename == __file__
    assert ema.optimization_step == 0


# -- Lightning's EMAWeightAveraging.on_load_checkpoint, called as the Trainer calls it ----------


def lightning_parts():
    """Our callback class, a module and a Trainer stand-in in the fit stage."""
    from _frameworks import need

    pl = need("lightning.pytorch")
    from emakit.compat.lightning import EMAWeightAveraging

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_net()

    return EMAWeightAveraging, Module, SimpleNamespace(state=SimpleNamespace(fn="fit"))


def averaged_checkpoint(callback_cls, module_cls, trainer) -> tuple[dict, nn.Module]:
    """A checkpoint the callback wrote after 3 updates (the average differs from the
    training weights), and the module it was written from."""
    module, callback = module_cls(), callback_cls(decay=0.5)
    callback.on_fit_start(trainer, module)
    for _ in range(3):
        moved(module)
        callback.ema.update()
    checkpoint = {"state_dict": {k: v.clone() for k, v in module.state_dict().items()}}
    callback.on_save_checkpoint(trainer, module, checkpoint)
    assert int(checkpoint["averaging_state"]["n_averaged"]) == 3
    return checkpoint, module


def test_lightning_a_checkpoint_read_after_fit_started_loads_the_average_at_once():
    """``on_load_checkpoint`` after the EMA of this module exists (a second ``fit`` with the
    same callback): the training weights go back into the module and the average into the
    EMA right away, count included."""
    callback_cls, module_cls, trainer = lightning_parts()
    checkpoint, trained = averaged_checkpoint(callback_cls, module_cls, trainer)
    module, callback = module_cls(), callback_cls(decay=0.5)
    callback.on_fit_start(trainer, module)
    ema = callback.ema
    callback.on_load_checkpoint(trainer, module, checkpoint)
    assert callback.ema is ema and ema.model is module
    assert int(ema.step) == 3
    assert same_state(ema.ema_model.state_dict(), checkpoint["state_dict"])
    assert same_state(module.state_dict(), trained.state_dict())


def test_lightning_a_checkpoint_without_both_averaging_entries_is_a_plain_one():
    """Only one of ``current_model_state`` and ``averaging_state``: not read as averaged (a
    warning), and the existing average restarts from the module's weights."""
    callback_cls, module_cls, trainer = lightning_parts()
    checkpoint, _ = averaged_checkpoint(callback_cls, module_cls, trainer)
    for kept in ("current_model_state", "averaging_state"):
        partial = {"state_dict": checkpoint["state_dict"], kept: checkpoint[kept]}
        module, callback = module_cls(), callback_cls(decay=0.5)
        callback.on_fit_start(trainer, module)
        moved(callback.ema.ema_model, 3.0)  # the average is not the module's weights now
        module.load_state_dict(partial["state_dict"])  # what Lightning restores first
        with pytest.warns(UserWarning, match="not written with") as caught:
            callback.on_load_checkpoint(trainer, module, partial)
        assert [str(w.message) for w in caught] == [
            "the checkpoint was not written with weight averaging: the average starts from "
            "its state_dict, as the module does"
        ], kept
        assert same_state(callback.ema.ema_model.state_dict(), module.state_dict()), kept
        assert same_state(module.state_dict(), checkpoint["state_dict"]), kept


def test_lightning_outside_fit_the_warning_says_what_the_module_holds():
    callback_cls, module_cls, trainer = lightning_parts()
    checkpoint, _ = averaged_checkpoint(callback_cls, module_cls, trainer)
    module, callback = module_cls(), callback_cls(decay=0.5)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    validating = SimpleNamespace(state=SimpleNamespace(fn="validate"))
    with pytest.warns(UserWarning, match="only during fit") as caught:
        callback.on_load_checkpoint(validating, module, checkpoint)
    assert [str(w.message) for w in caught] == [
        "EMAWeightAveraging keeps an average only during fit: the checkpoint's state_dict "
        "(the average, if it was written with weight averaging) is what the module holds now"
    ]
    assert callback.ema is None and same_state(module.state_dict(), before)

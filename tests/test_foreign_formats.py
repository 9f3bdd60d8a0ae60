"""`emakit.foreign`: which format a checkpoint is read as, where an EMA state nested in a
training checkpoint is looked for, what a diffusers ``EMAModel`` folder (single file or
shards with an index) must hold, and the messages of the refusals (Lightning checkpoints
without an average, Ultralytics states, unknown layouts, unreadable files). Each
checkpoint is built by hand as the library that writes it lays it out, so every case runs
without the peer installed; the round trips with the peers themselves are in
``test_foreign_training_checkpoints.py``, ``test_migration_peers.py`` and
``test_compat_*.py``."""

from __future__ import annotations

import argparse
import io
import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from emakit import EMA, EMAPytree, EMAStateError
from emakit.errors import EMAFileNotFoundError
from emakit.foreign import detect_format, load_foreign_state, read_training_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

#: Under mutmut every emakit function is called through a trampoline, one frame more: a
#: warning's ``stacklevel`` then points elsewhere, so the tests of where it points skip.
needs_plain_frames = pytest.mark.skipif(
    "MUTANT_UNDER_TEST" in os.environ, reason="mutmut's trampolines add stack frames"
)

ACCEPTED = "emakit, ema_pytorch, timm, torch_ema, averaged_model, diffusers, lightning, state_dict"
INDEX = "diffusion_pytorch_model.safetensors.index.json"
EXPECTED_FOLDER = (
    "expected what diffusers' EMAModel.save_pretrained(path) writes: config.json with "
    "the EMA's optimization_step, and diffusion_pytorch_model.safetensors (or .bin, or "
    "shards with an .index.json)"
)


def net_with_norms(norms: int = 1) -> nn.Module:
    """A Linear followed by ``norms`` BatchNorm layers (two floating buffers each)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), *(nn.BatchNorm1d(4) for _ in range(norms)))


def torch_ema_state(net: nn.Module, num_updates: int = 3) -> dict[str, Any]:
    """``torch_ema.ExponentialMovingAverage.state_dict()`` (torch_ema 0.3) of ``net``."""
    return {
        "decay": 0.99,
        "num_updates": num_updates,
        "shadow_params": [p.detach().clone() + 1 for p in net.parameters()],
        "collected_params": None,
    }


def raised(fn: Any, *args: Any, **kwargs: Any) -> str:
    """The message of the `EMAStateError` ``fn(*args, **kwargs)`` raises."""
    with pytest.raises(EMAStateError) as info:
        fn(*args, **kwargs)
    return str(info.value)


# -- format detection -------------------------------------------------------------------------


def test_torch_ema_is_told_by_either_of_its_own_keys():
    t = [torch.zeros(2)]
    assert detect_format({"shadow_params": t, "num_updates": 3}) == "torch_ema"
    assert detect_format({"shadow_params": t, "collected_params": None}) == "torch_ema"
    assert detect_format({"shadow_params": t, "optimization_step": 3}) == "diffusers"
    assert detect_format({"shadow_params": t}) is None  # a list alone says nothing


def test_ema_pytorch_is_told_by_initted_or_step_beside_ema_model_keys():
    """A state rebuilt as a plain dict (no torch ``_metadata``) reads as ema-pytorch's."""
    w, one = torch.zeros(2), torch.tensor(1)
    assert detect_format({"step": one, "ema_model.w": w}) == "ema_pytorch"
    assert detect_format({"initted": torch.tensor(True), "ema_model.w": w}) == "ema_pytorch"
    assert detect_format({"initted": torch.tensor(True), "step": one, "ema_model.w": w}) == (
        "ema_pytorch"
    )
    # a "step" entry beside weights of no EMA is a plain state dict of a model
    assert detect_format({"step": one, "w": w}) == "state_dict"


def test_emakit_layout_one_is_told_by_its_version_key():
    """Layout 1 wrote a ``version`` key (later layouts keep it in torch's ``_metadata``)."""
    w, one = torch.zeros(2), torch.tensor(1)
    state = {"version": one, "initted": torch.tensor(True), "step": one, "ema_model.w": w}
    assert detect_format(state) == "emakit"
    assert detect_format({k: v for k, v in state.items() if k != "version"}) == "ema_pytorch"


def test_an_ema_pytree_state_is_emakits_and_loads_into_an_ema_pytree():
    """Its leaves are ``ema.<path>``, with no ``ema_model.`` key."""
    pytree = {"w": torch.ones(2)}
    source = EMAPytree(pytree, update_after_step=0, update_every=1)
    source.update()
    pytree["w"].fill_(3.0)
    source.update()
    state = source.state_dict()
    assert all(not k.startswith("ema_model.") for k in state)
    assert detect_format(state) == "emakit"
    target = EMAPytree({"w": torch.zeros(2)}, update_after_step=0, update_every=1)
    assert load_foreign_state(target, state) == "emakit"
    assert int(target.step) == int(source.step)


# -- EMA states nested in training checkpoints ------------------------------------------------


def test_a_state_three_levels_down_is_found_and_four_levels_down_is_not():
    net = net_with_norms(0)
    state = torch_ema_state(net)
    three = {"train": {"averaging": {"ema": state}}}
    ema = EMA(net, update_after_step=0)
    with pytest.warns(UserWarning, match=r"torch_ema EMA state at \['train'\]\['averaging'\]"):
        assert load_foreign_state(ema, three) == "torch_ema"
    assert int(ema.step) == 3 + 1
    four = {"run": three}
    message = raised(load_foreign_state, EMA(net, update_after_step=0), four)
    assert message == (
        "the checkpoint is not a checkpoint format emakit knows: found a mapping with keys "
        f"['run'] (1); accepted formats: {ACCEPTED} (pass format= to choose one)"
    )


def test_several_nested_states_name_the_first_one_to_pass():
    net = net_with_norms(0)
    state = torch_ema_state(net)
    message = raised(load_foreign_state, EMA(net), {"ema": state, "train": {"slow": state}})
    assert message.endswith("pass the one to load, e.g. checkpoint['ema']")


@needs_plain_frames
def test_the_nested_state_warning_points_at_the_callers_line():
    net = net_with_norms(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_foreign_state(EMA(net, update_after_step=0), {"ema": torch_ema_state(net)})
    (found,) = [w for w in caught if "EMA state at ['ema']" in str(w.message)]
    assert found.category is UserWarning
    assert found.filename == __file__


# -- torch_ema's positional list --------------------------------------------------------------


def test_shadow_params_holding_a_non_tensor_are_refused():
    net = net_with_norms(0)  # two parameters
    state = {"num_updates": 2, "shadow_params": [torch.zeros(4, 3), 1.0]}
    message = raised(load_foreign_state, EMA(net, update_after_step=0), state)
    assert message == "the checkpoint (torch_ema): shadow_params must be a list of tensors"


def unaveraged_buffers_warning(ema: EMA, state: dict[str, Any]) -> warnings.WarningMessage:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_foreign_state(ema, state)
    (found,) = [w for w in caught if "torch_ema averages parameters only" in str(w.message)]
    return found


def test_the_unaveraged_buffers_warning_skips_ignored_prefixes():
    """torch_ema leaves buffers alone: the warning names the floating buffers this EMA
    averages, not those it ignores (``ignore_startswith_names``)."""
    net = net_with_norms(2)  # buffers 1.* and 2.*
    ema = EMA(net, update_after_step=0, ignore_startswith_names={"1."})
    found = unaveraged_buffers_warning(ema, torch_ema_state(net))
    assert "floating buffers ['2.running_mean', '2.running_var'] (2) (e.g." in str(found.message)
    assert str(found.message).startswith("the checkpoint (torch_ema): torch_ema averages")


@needs_plain_frames
def test_the_unaveraged_buffers_warning_points_at_the_callers_line():
    net = net_with_norms(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_foreign_state(EMA(net, update_after_step=0), torch_ema_state(net))
    (found,) = [w for w in caught if "torch_ema averages parameters only" in str(w.message)]
    assert found.filename == __file__  # the test that called, not emakit


def test_the_unaveraged_buffers_warning_lists_four_names_and_the_count():
    net = net_with_norms(3)  # six floating buffers
    with pytest.warns(UserWarning, match="torch_ema averages parameters only") as caught:
        load_foreign_state(EMA(net, update_after_step=0), torch_ema_state(net))
    text = " ".join(str(w.message) for w in caught)
    names = "['1.running_mean', '1.running_var', '2.running_mean', '2.running_var'] ... (6)"
    assert f"floating buffers {names} (e.g. BatchNorm statistics)" in text


def test_no_unaveraged_buffers_warning_when_every_buffer_is_ignored():
    net = net_with_norms(1)
    ema = EMA(net, update_after_step=0, ignore_startswith_names={"1."})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_foreign_state(ema, torch_ema_state(net)) == "torch_ema"


# -- plain state dicts: the warm-up refusal ---------------------------------------------------


def test_a_plain_state_dict_is_refused_inside_the_warm_up():
    net = net_with_norms(0)
    ema = EMA(net, update_after_step=10, update_every=1)
    for _ in range(5):
        ema.update()
    message = raised(load_foreign_state, ema, net.state_dict())
    assert "this EMA is at step 5 <= update_after_step=10" in message


def test_a_plain_state_dict_loads_past_a_zero_warm_up():
    net = net_with_norms(0)
    ema = EMA(net, update_after_step=0, update_every=1)
    ema.update()  # step 1 > update_after_step=0
    weights = {k: v + 1 for k, v in net.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_foreign_state(ema, weights) == "state_dict"
    assert int(ema.step) == 1
    assert torch.equal(ema.ema_model.state_dict()["0.weight"], weights["0.weight"])


# -- refusals and their messages --------------------------------------------------------------


def test_an_unknown_object_is_named_by_its_type():
    message = raised(load_foreign_state, EMA(net_with_norms(0)), ["updates", "ema"])
    assert message == (
        "the checkpoint is not a checkpoint format emakit knows: found a list; accepted "
        f"formats: {ACCEPTED} (pass format= to choose one)"
    )


def test_an_unknown_mapping_lists_twelve_keys_and_the_count():
    checkpoint = {f"k{i:02d}": i for i in range(13)}
    message = raised(load_foreign_state, EMA(net_with_norms(0)), checkpoint)
    keys = [f"k{i:02d}" for i in range(12)]
    assert f"found a mapping with keys {keys} ... (13); accepted formats" in message


LIGHTNING = {"pytorch-lightning_version": "2.6.0", "global_step": 5, "epoch": 0}


def test_a_lightning_checkpoint_without_averaging_says_what_to_pass():
    net = net_with_norms(0)
    checkpoint = {**LIGHTNING, "state_dict": net.state_dict()}
    message = raised(load_foreign_state, EMA(net), checkpoint)
    assert message == (
        "the checkpoint is a Lightning checkpoint without weight averaging (no "
        "'averaging_state' entry, as EMAWeightAveraging writes): its state_dict holds the "
        "training weights; to start an EMA from them, pass checkpoint['state_dict'] with "
        "step=checkpoint['global_step']"
    )


def test_a_lightning_checkpoint_of_emakits_callback_is_not_searched():
    """Its ``emakit_ema`` entry holds an emakit state, which may be one rank's part: the
    message says to resume with the callback instead of loading what it finds."""
    net = net_with_norms(0)
    checkpoint = {
        **LIGHTNING,
        "state_dict": net.state_dict(),
        "emakit_ema": {"ema": EMA(net).state_dict()},
    }
    message = raised(load_foreign_state, EMA(net), checkpoint)
    assert message.endswith(
        "without weight averaging (no 'averaging_state' entry, as EMAWeightAveraging "
        "writes): it was written by emakit's EMACallback: resume with that callback, or "
        "load checkpoint['emakit_ema']['ema'] with ema.load_state_dict()"
    )


# -- files --------------------------------------------------------------------------------------


def test_a_missing_file_is_named_as_a_checkpoint_file(tmp_path):
    path = tmp_path / "missing.pt"
    with pytest.raises(
        EMAFileNotFoundError, match=r"^checkpoint file .*missing\.pt does not exist"
    ):
        load_foreign_state(EMA(net_with_norms(0)), path)
    with pytest.raises(
        EMAFileNotFoundError, match=r"^checkpoint file .*missing\.pt does not exist"
    ):
        read_training_checkpoint(path)
    with pytest.raises(EMAStateError, match=r"^the checkpoint file given as a file object"):
        read_training_checkpoint(io.BytesIO(b"not a torch file"))


class NotData:
    """A class no checkpoint reader should build."""


def test_a_file_object_is_read_with_weights_only_even_when_torch_is_told_otherwise(monkeypatch):
    """``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` only changes loads that leave weights_only out."""
    buffer = io.BytesIO()
    torch.save({"obj": NotData()}, buffer)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's note about the variable
        with pytest.raises(EMAStateError, match=r"file object.*NotData"):
            read_training_checkpoint(io.BytesIO(buffer.getvalue()))


def test_a_file_object_saved_on_a_gpu_loads_on_the_cpu(monkeypatch):
    """Tensors saved from ``cuda:0`` are mapped to the CPU."""
    buffer = io.BytesIO()
    with monkeypatch.context() as m:  # what torch.save records for a CUDA tensor
        m.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        torch.save({"w": torch.arange(3.0)}, buffer)
    assert b"cuda:0" in buffer.getvalue()
    loaded = read_training_checkpoint(io.BytesIO(buffer.getvalue()))
    assert loaded["w"].device == torch.device("cpu")
    assert torch.equal(loaded["w"], torch.arange(3.0))


def test_without_torchs_safe_globals_context_plain_files_still_load(tmp_path, monkeypatch):
    """torch 2.4 has no ``safe_globals`` context: plain files load, a Namespace is refused."""
    path = tmp_path / "ckpt.pt"
    torch.save({"w": torch.ones(2)}, path)
    monkeypatch.delattr(torch.serialization, "safe_globals", raising=False)
    assert torch.equal(read_training_checkpoint(path)["w"], torch.ones(2))
    torch.save({"args": argparse.Namespace(lr=0.1)}, path)
    with pytest.raises(EMAStateError, match="Namespace"):
        read_training_checkpoint(path)


# -- diffusers EMAModel.save_pretrained folders ------------------------------------------------


def load_folder(folder: Path) -> str:
    """The message `load_foreign_state` gives for ``folder``."""
    return raised(load_foreign_state, EMA(nn.Linear(2, 2)), folder)


def write_config(folder: Path, config: Any) -> None:
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")


def test_a_folder_without_config_lists_files_and_folders(tmp_path):
    folder = tmp_path / "ema"
    folder.mkdir()
    (folder / "weights.bin").write_bytes(b"x")
    (folder / "logs").mkdir()
    assert load_folder(folder) == (
        f"{folder} is not a diffusers EMAModel folder: it has no config.json (found "
        f"['logs/', 'weights.bin'] (2)); {EXPECTED_FOLDER}"
    )


def test_a_folder_listing_is_cut_at_twelve_names(tmp_path):
    folder = tmp_path / "ema"
    folder.mkdir()
    for i in range(13):
        (folder / f"f{i:02d}").write_bytes(b"")
    names = [f"f{i:02d}" for i in range(12)]
    assert f"(found {names} ... (13));" in load_folder(folder)


def test_a_config_without_optimization_step_says_what_it_holds(tmp_path):
    folder = tmp_path / "model"
    write_config(folder, {f"k{i:02d}": i for i in range(13)})
    keys = [f"k{i:02d}" for i in range(12)]
    assert f"has no 'optimization_step' (found keys {keys}), so it is a plain" in (
        load_folder(folder)
    )
    write_config(folder, [1, 2])
    assert "has no 'optimization_step' (found a list), so it is a plain" in load_folder(folder)


def test_a_config_that_is_not_json_names_the_decoder_error(tmp_path):
    folder = tmp_path / "ema"
    write_config(folder, {})
    (folder / "config.json").write_text("{not json", encoding="utf-8")
    assert f"{folder / 'config.json'} is not a readable JSON file (JSONDecodeError: " in (
        load_folder(folder)
    )
    (folder / "config.json").write_bytes(b'{"optimization_step": 1, "name": "\xff"}')
    assert "is not a readable JSON file (UnicodeDecodeError: " in load_folder(folder)


def test_a_negative_optimization_step_names_the_config_file(tmp_path):
    folder = tmp_path / "ema"
    write_config(folder, {"optimization_step": -1})
    assert load_folder(folder).startswith(
        f"{folder / 'config.json'}: optimization_step must be a whole number in [0, 2**53], "
        f"got optimization_step=-1"
    )


def test_a_weights_file_that_is_not_a_tensor_mapping_is_named(tmp_path):
    folder = tmp_path / "ema"
    write_config(folder, {"optimization_step": 3})
    torch.save([torch.zeros(2)], folder / "diffusion_pytorch_model.bin")
    assert load_folder(folder) == (
        f"{folder / 'diffusion_pytorch_model.bin'} (diffusers EMAModel folder) holds a list, "
        f"not a mapping of parameter names to tensors"
    )


def sharded(tmp_path: Path, index: Any) -> Path:
    folder = tmp_path / "ema"
    write_config(folder, {"optimization_step": 3})
    (folder / INDEX).write_text(json.dumps(index), encoding="utf-8")
    return folder


@pytest.mark.parametrize(
    "index",
    [[1, 2], {"metadata": {}}, {"weight_map": {"weight": 1}}],
    ids=["a list", "no weight_map", "a shard that is not a name"],
)
def test_an_index_without_a_weight_map_of_names_is_refused(tmp_path, index):
    folder = sharded(tmp_path, index)
    assert (
        load_folder(folder)
        == f"{folder / INDEX} has no 'weight_map' of tensor names to shard files"
    )


def test_an_index_naming_the_parent_folder_as_a_shard_is_refused(tmp_path):
    folder = sharded(tmp_path, {"weight_map": {"weight": ".."}})
    assert load_folder(folder) == (
        f"{folder / INDEX} names the shard '..', which is not a file name inside {folder}"
    )


def test_a_shard_that_is_not_a_tensor_mapping_is_named(tmp_path):
    folder = sharded(tmp_path, {"weight_map": {"weight": "part-1.bin"}})
    torch.save({"weight": [1, 2]}, folder / "part-1.bin")
    assert load_folder(folder) == (
        f"{folder / 'part-1.bin'} (diffusers EMAModel folder) holds a mapping with keys "
        f"['weight'] (1), not a mapping of parameter names to tensors"
    )


def five_names(prefix: str) -> list[str]:
    return [f"{prefix}{i}" for i in range(5)]


def test_a_shard_missing_tensors_lists_four_and_the_count(tmp_path):
    shard = "part-1.safetensors"
    folder = sharded(tmp_path, {"weight_map": dict.fromkeys([*five_names("a"), "z"], shard)})
    save_file({"z": torch.zeros(1)}, folder / shard)
    missing = five_names("a")
    assert (
        f"{folder / shard} has no tensor 'a0', which {INDEX} maps to '{shard}' (missing: "
        f"{missing[:4]} ... (5)); the folder mixes files of different saves"
    ) in load_folder(folder)


def test_a_shard_with_unlisted_tensors_lists_four_and_the_count(tmp_path):
    shard = "part-1.safetensors"
    folder = sharded(tmp_path, {"weight_map": {"z": shard}})
    tensors: dict[str, Tensor] = {n: torch.zeros(1) for n in ["z", *five_names("x")]}
    save_file(tensors, folder / shard)
    extra = five_names("x")
    assert load_folder(folder) == (
        f"{folder / shard} holds the tensor 'x0', but {INDEX} does not list it (not mapped "
        f"to it: {extra[:4]} ... (5)); the folder mixes files of different saves"
    )


def test_a_folder_of_shards_loads_by_name(tmp_path):
    """The positive case beside the refusals: two shards, each tensor where the index says."""
    net = nn.Linear(2, 2)
    folder = sharded(
        tmp_path, {"weight_map": {"weight": "part-1.safetensors", "bias": "part-2.safetensors"}}
    )
    save_file({"weight": torch.full((2, 2), 2.0)}, folder / "part-1.safetensors")
    save_file({"bias": torch.full((2,), 3.0)}, folder / "part-2.safetensors")
    ema = EMA(net, update_after_step=0)
    assert load_foreign_state(ema, folder) == "diffusers"
    assert int(ema.step) == 3
    assert torch.equal(ema.ema_model.weight, torch.full((2, 2), 2.0))
    assert torch.equal(ema.ema_model.bias, torch.full((2,), 3.0))


# -- a format named by the caller, its keys missing -------------------------------------------


@pytest.mark.parametrize(
    ("obj", "fmt", "message"),
    [
        ([1, 2], "timm", "format='timm' needs the keys [], but the checkpoint is a list"),
        (
            {"epoch": 1},  # neither of timm's EMA keys: the first named
            "timm",
            "format='timm' needs the keys ['state_dict_ema'], but the checkpoint is a mapping "
            "with keys ['epoch'] (1)",
        ),
        (
            {"state_dict": {}},
            "lightning",
            "format='lightning' needs the keys ['state_dict', 'averaging_state'], but the "
            "checkpoint is a mapping with keys ['state_dict'] (1)",
        ),
        (
            {"state_dict": {}, "averaging_state": 5},
            "lightning",
            "the checkpoint['state_dict'] (Lightning weight averaging): averaging_state is an int",
        ),
        (
            {"state_dict": {}, "averaging_state": None},
            "lightning",
            "the checkpoint['state_dict'] (Lightning weight averaging): averaging_state is None",
        ),
        (
            {"state_dict": {}, "averaging_state": {"n_averaged": -1}},
            "lightning",
            "the checkpoint['state_dict'] (Lightning weight averaging): n_averaged must be a "
            "whole number in [0, 2**53], got n_averaged=-1 (outside [0, 2**53]); the file or "
            "state is corrupt or was not written by an EMA library",
        ),
    ],
)
def test_a_named_format_without_its_keys_is_refused_naming_them(obj, fmt, message):
    ema = EMA(nn.Linear(2, 2))
    before = {k: v.clone() for k, v in ema.state_dict().items()}
    with pytest.raises(EMAStateError) as info:
        load_foreign_state(ema, obj, fmt)
    assert str(info.value) == message
    assert all(torch.equal(v, before[k]) for k, v in ema.state_dict().items())


def test_a_lightning_state_without_a_count_loads_without_a_step():
    """Lightning's ``averaging_state`` may lack ``n_averaged``: the weights load, the step
    stays where it was (with a warning that says to pass ``step=``)."""
    net = nn.Linear(2, 2)
    ema = EMA(nn.Linear(2, 2))
    state = {"state_dict": net.state_dict(), "averaging_state": {}}
    with pytest.warns(UserWarning, match="pass step= with the training step"):
        assert load_foreign_state(ema, state, "lightning") == "lightning"
    assert ema.step == 0
    assert torch.equal(ema.ema_model.weight, net.weight)
    load_foreign_state(ema, state, "lightning", step=700)
    assert ema.step == 700


@pytest.mark.parametrize(
    ("state", "message"),
    [
        (
            {"num_updates": 1},
            "format='torch_ema' needs the keys ['shadow_params'], but the checkpoint is a "
            "mapping with keys ['num_updates'] (1)",
        ),
        (
            {"shadow_params": [torch.zeros(2, 2), torch.zeros(2)], "num_updates": -1},
            "the checkpoint (torch_ema): num_updates must be a whole number in [0, 2**53], got "
            "num_updates=-1 (outside [0, 2**53]); the file or state is corrupt or was not "
            "written by an EMA library",
        ),
    ],
)
def test_a_torch_ema_state_without_its_list_or_with_a_bad_count_is_refused(state, message):
    with pytest.raises(EMAStateError) as info:
        load_foreign_state(EMA(nn.Linear(2, 2)), state, "torch_ema")
    assert str(info.value) == message


def test_a_torch_ema_state_without_a_count_loads_its_weights():
    net = nn.Linear(2, 2)
    ema = EMA(nn.Linear(2, 2))
    state = {"shadow_params": [p.detach().clone() for p in net.parameters()]}
    with pytest.warns(UserWarning, match=r"after loading the checkpoint \(torch_ema\)"):
        assert load_foreign_state(ema, state, "torch_ema") == "torch_ema"
    assert ema.step == 0
    assert torch.equal(ema.ema_model.weight, net.weight)


def test_step_and_strict_are_checked_by_name():
    ema, state = EMA(nn.Linear(2, 2)), nn.Linear(2, 2).state_dict()
    with pytest.raises(TypeError, match=r"^step must be an int, got step='x' \(str\)$"):
        load_foreign_state(ema, state, step="x")
    with pytest.raises(TypeError, match=r"^strict must be True or False, got strict='yes'"):
        load_foreign_state(ema, state, strict="yes")


def test_a_module_passed_is_named_by_its_class(tmp_path: Path):
    with pytest.raises(
        EMAStateError, match=r"^Linear\.state_dict\(\) \(state_dict\) holds weights"
    ):
        load_foreign_state(EMA(nn.Linear(2, 2)), nn.Linear(2, 2))


def test_a_damaged_emakit_header_is_refused_naming_the_file(tmp_path: Path):
    path = tmp_path / "w.safetensors"
    save_file(nn.Linear(2, 2).state_dict(), path, {"format": "x", "format_version": "1"})
    with pytest.raises(EMAStateError) as info:
        load_foreign_state(EMA(nn.Linear(2, 2)), path)
    assert str(info.value).startswith(
        f"{path}: the header has emakit's entries ['format_version'] but format='x'"
    )


def test_a_format_told_at_the_top_wins_over_a_state_nested_inside():
    """A Lightning weight-averaging checkpoint that also keeps a torch_ema state deeper down
    loads Lightning's average: only a checkpoint of no known format is searched."""
    net, other = nn.Linear(2, 2), nn.Linear(2, 2)
    checkpoint = {
        "state_dict": net.state_dict(),
        "averaging_state": {"n_averaged": torch.tensor(5)},
        "callbacks": {"x": torch_ema_state(other)},
    }
    ema = EMA(nn.Linear(2, 2), update_after_step=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "found the ... EMA state at" warning
        assert load_foreign_state(ema, checkpoint) == "lightning"
    assert torch.equal(ema.ema_model.weight, net.weight)
    assert ema.step == 5


def test_an_emakit_state_without_its_step_is_refused_naming_the_format():
    with pytest.raises(EMAStateError) as info:
        load_foreign_state(EMA(nn.Linear(2, 2)), {"weight": torch.zeros(2, 2)}, "emakit")
    assert str(info.value) == (
        "format='emakit' needs the keys ['step'], but the checkpoint is a mapping with keys "
        "['weight'] (1)"
    )


def test_an_emakit_state_loads_with_strict_false():
    ema, other = EMA(nn.Linear(2, 2)), EMA(nn.Linear(2, 2))
    state = {k: v for k, v in other.state_dict().items() if k != "ema_model.bias"}
    bias = ema.ema_model.bias.clone()
    with pytest.raises(EMAStateError):
        load_foreign_state(ema, state, "emakit")
    assert load_foreign_state(ema, state, "emakit", strict=False) == "emakit"
    assert torch.equal(ema.ema_model.weight, other.ema_model.weight)
    assert torch.equal(ema.ema_model.bias, bias)


def test_a_lazy_ema_is_built_before_a_foreign_state_loads():
    net = nn.Linear(2, 2)
    ema = EMA(nn.Linear(2, 2), lazy_init_ema=True, update_after_step=0)
    assert ema.ema_model is None
    state = torch_ema_state(net)
    assert load_foreign_state(ema, state) == "torch_ema"
    assert torch.equal(ema.ema_model.weight, state["shadow_params"][0])


def test_a_partial_load_keeps_the_ema_values_it_does_not_name():
    """``strict=False``: what the checkpoint lacks keeps the EMA's value, not the model's
    (the EMA model is not rebuilt from the model before a load)."""
    model = nn.Linear(2, 2)
    ema = EMA(model, update_after_step=0, beta=0.5)
    ema.update()
    with torch.no_grad():
        model.bias.add_(1.0)
    ema.update()
    bias = ema.ema_model.bias.clone()
    assert not torch.equal(bias, model.bias)
    weight = torch.full((2, 2), 3.0)
    with pytest.warns(UserWarning, match=r"keep their values \['bias'\] \(1\)"):
        load_foreign_state(ema, {"weight": weight}, "state_dict", step=9, strict=False)
    assert torch.equal(ema.ema_model.weight, weight)
    assert torch.equal(ema.ema_model.bias, bias)


def test_an_entry_that_is_not_a_state_dict_is_refused_naming_it():
    with pytest.raises(EMAStateError) as info:
        load_foreign_state(EMA(nn.Linear(2, 2)), {"state_dict_ema": 5}, "timm")
    assert (
        str(info.value) == "the checkpoint['state_dict_ema'] (timm) holds an int, not a state dict"
    )


@needs_plain_frames
def test_the_warm_up_warning_points_at_the_callers_line():
    net = net_with_norms(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_foreign_state(EMA(net), torch_ema_state(net))  # update_after_step=100
    (found,) = [w for w in caught if "the next update() calls copy the model" in str(w.message)]
    assert found.filename == __file__


def test_an_ema_module_without_updates_is_not_taken_for_ultralytics():
    """Ultralytics' checkpoint is told by ``"ema"`` beside ``"updates"``: a dict holding a
    whole model under ``"ema"`` alone is a format emakit does not know, said as such."""
    ema = EMA(nn.Linear(2, 2))
    with pytest.raises(EMAStateError) as info:
        load_foreign_state(ema, {"ema": nn.Linear(2, 2)})
    assert "is not a checkpoint format emakit knows" in str(info.value)
    assert "Ultralytics" not in str(info.value)

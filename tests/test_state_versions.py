"""State-dict layouts: today's keys are exactly ema-pytorch's (emakit's extras live in torch's
per-module metadata), states go both ways between emakit and ema-pytorch 0.8.3, and the
version-1 layout (with ``version``, ``gamma``, ``t``, ``dt``, ``gammas`` keys) still loads.

The ``*_v1.pt`` fixtures were written by emakit at commit 5d7d85a (the version-1 layout).
"""

from __future__ import annotations

import copy
import io
from functools import partial
from pathlib import Path

import ema_pytorch
import pytest
import torch
from torch import nn

import _models
from _models import bn_mlp
from emakit import EMA, STATE_VERSION, EMAStateError, KarrasEMA, PostHocEMA

FIXTURES = Path(__file__).parent / "fixtures"


# seed 123: deliberately not the weights the fixture was saved from
make_net = partial(bn_mlp, 3, 4, 2, seed=123)


#: ``train(net, emas, steps=5)``: SGD steps, each followed by every EMA's ``update()``.
train = partial(_models.train, steps=5, batch=(8, 3), seed=0)


def roundtrip(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


# -- version 1 keeps loading --------------------------------------------------------------


def test_version_1_fixture_loads_and_continues():
    state = torch.load(FIXTURES / "ema_state_v1.pt", weights_only=True)
    assert int(state["version"]) == 1 < STATE_VERSION
    net = make_net()
    net.load_state_dict(torch.load(FIXTURES / "ema_state_v1_online.pt", weights_only=True))
    ema = EMA(net, beta=0.9, update_after_step=1, update_every=1)
    ema.load_state_dict(state)
    assert int(ema.step) == 5
    assert bool(ema.initted)
    for key, value in state.items():
        if key.startswith("ema_model."):
            assert torch.equal(ema.ema_model.state_dict()[key.removeprefix("ema_model.")], value), (
                key
            )
    # continuing averages toward the online weights with the step-6 decay
    before = ema.ema_model[0].weight.detach().clone()
    ema.update()
    decay = ema.get_current_decay()
    assert 0.0 < decay <= 0.9
    assert torch.allclose(ema.ema_model[0].weight, before.lerp(net[0].weight.detach(), 1 - decay))


def test_version_1_karras_and_posthoc_fixtures_load(tmp_path):
    state = torch.load(FIXTURES / "karras_state_v1.pt", weights_only=True)
    assert {"karras_version", "gamma", "t", "dt", "version"} <= set(state)
    net = bn_mlp(3, 4, 2, seed=7)
    karras = KarrasEMA(net, sigma_rel=0.1, update_every=2)
    karras.load_state_dict(state)
    assert (int(karras.step), karras.t, karras.tracker.gap) == (
        7,
        int(state["t"]),
        int(state["dt"]),
    )
    with pytest.raises(EMAStateError, match="gamma"):
        KarrasEMA(net, sigma_rel=0.2, update_every=2).load_state_dict(state)
    posthoc_state = torch.load(FIXTURES / "posthoc_state_v1.pt", weights_only=True)
    posthoc = PostHocEMA(
        net,
        sigma_rels=(0.05, 0.2),
        update_every=1,
        checkpoint_every_num_steps="manual",
        checkpoint_folder=tmp_path,
    )
    posthoc.load_state_dict(posthoc_state)
    assert int(posthoc.step) == 4
    with pytest.raises(EMAStateError, match="gammas"):
        PostHocEMA(
            net,
            sigma_rels=(0.05, 0.1),
            checkpoint_every_num_steps="manual",
            checkpoint_folder=tmp_path,
        ).load_state_dict(posthoc_state)


# -- version 2: ema-pytorch's keys, emakit's extras in the metadata -------------------------


def test_keys_are_exactly_ema_pytorch_keys():
    net = make_net()
    ours = EMA(net, skip_nonfinite=True, include_online_model=False).state_dict()
    theirs = ema_pytorch.EMA(copy.deepcopy(net), include_online_model=False).state_dict()
    assert set(ours) == set(theirs)
    assert ours._metadata[""]["version"] == STATE_VERSION == 2
    assert ours._metadata[""]["num_skipped_nonfinite"] == 0
    with_online = EMA(net).state_dict()  # both default to include_online_model=True
    theirs_online = ema_pytorch.EMA(copy.deepcopy(net)).state_dict()
    assert set(with_online) == set(theirs_online)


def test_metadata_survives_torch_save_and_restores_the_extras():
    net = make_net()
    ema = EMA(net, skip_nonfinite=True, update_after_step=0, update_every=1)
    ema.update()
    with torch.no_grad():
        net[0].weight[0, 0] = float("nan")
    ema.update()
    with pytest.warns(RuntimeWarning):  # given when the count is read back (state_dict)
        ema.state_dict()
    with torch.no_grad():
        net[0].weight[0, 0] = 0.0
    state = roundtrip(ema.state_dict())
    fresh = EMA(make_net(), skip_nonfinite=True)
    fresh.load_state_dict(state)
    assert fresh.num_skipped_nonfinite == 1 and int(fresh.step) == 2
    karras = KarrasEMA(net, gamma=5.0, update_every=3)
    train(net, [karras], steps=8)
    karras.catch_up()  # t no longer follows from step alone
    kstate = roundtrip(karras.state_dict())
    assert set(kstate) == {"initted", "step", *(f"ema_model.{k}" for k in net.state_dict())}
    loaded = KarrasEMA(make_net(), gamma=5.0, update_every=3)
    loaded.load_state_dict(kstate)
    assert (loaded.t, loaded.tracker.gap) == (karras.t, karras.tracker.gap) == (8, 1)
    with pytest.raises(EMAStateError, match="gamma"):
        KarrasEMA(make_net(), gamma=6.0, update_every=3).load_state_dict(kstate)


def test_a_newer_layout_is_refused():
    state = EMA(make_net()).state_dict()
    state._metadata[""]["version"] = STATE_VERSION + 1
    with pytest.raises(EMAStateError, match="upgrade emakit"):
        EMA(make_net()).load_state_dict(state)


def test_parent_module_state_has_no_emakit_keys():
    class Trainer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_net()
            self.ema = EMA(self.net)

    keys = set(Trainer().state_dict())
    tensors = ("ema.ema_model.", "ema.online_model.")
    assert {k for k in keys if k.startswith("ema.") and not k.startswith(tensors)} == {
        "ema.initted",
        "ema.step",
    }


def test_inference_loader_strips_prefix_and_counters():
    """A common loader: keep ``ema_model.*``, strip the prefix, drop the counters, load
    strictly into the model class."""
    net = make_net()
    ema = EMA(net, update_after_step=0, update_every=1)
    train(net, [ema])
    state = {
        k.removeprefix("ema_model."): v
        for k, v in ema.state_dict().items()
        if k.startswith("ema_model.")
    }
    fresh = make_net()
    fresh.load_state_dict(state, strict=True)
    assert torch.equal(fresh[0].weight, ema.ema_model[0].weight)


@pytest.mark.parametrize("ours_online", [False, True])
@pytest.mark.parametrize("theirs_online", [False, True])
def test_emakit_state_loads_into_ema_pytorch(ours_online, theirs_online):
    net = make_net()
    ema = EMA(net, update_after_step=1, update_every=1, include_online_model=ours_online)
    train(net, [ema], steps=6)
    theirs = ema_pytorch.EMA(copy.deepcopy(net), include_online_model=theirs_online)
    result = theirs.load_state_dict(ema.state_dict(), strict=ours_online == theirs_online)
    # Only ema-pytorch's own online_model.* keys can differ, by its include_online_model.
    assert all(
        k.startswith("online_model.") for k in (*result.missing_keys, *result.unexpected_keys)
    )
    assert int(theirs.step.item()) == 6 and bool(theirs.initted)
    for (k, a), (_, b) in zip(
        ema.ema_model.state_dict().items(), theirs.ema_model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), k


def test_ema_pytorch_state_loads_into_emakit_and_continues_bit_identically():
    net = make_net()
    theirs = ema_pytorch.EMA(copy.deepcopy(net), beta=0.9, update_after_step=2, update_every=1)
    train(theirs.online_model, [theirs])
    ours = EMA(copy.deepcopy(theirs.online_model), beta=0.9, update_after_step=2, update_every=1)
    ours.load_state_dict(theirs.state_dict())
    assert int(ours.step) == int(theirs.step.item())
    for _ in range(3):
        theirs.update()
        ours.update()
    for (k, a), (_, b) in zip(
        ours.ema_model.state_dict().items(), theirs.ema_model.state_dict().items(), strict=True
    ):
        if a.is_floating_point():  # integer buffers: emakit copies them, ema-pytorch does not
            assert torch.equal(a, b), k


@pytest.mark.parametrize(("update_every", "every"), [(1, 5), (3, 10), (4, 6), (7, 7)])
def test_profile_time_derived_from_the_step_matches_a_real_run(tmp_path, update_every, every):
    """Without metadata (ema-pytorch's states, or a rebuilt dict) a profile's t and dt are
    derived from the step, the update cadence and the snapshot cadence: exactly the
    values a real run has."""
    from emakit.posthoc.karras import profile_time

    net = make_net()
    posthoc = PostHocEMA(
        net,
        sigma_rels=(0.05, 0.2),
        update_every=update_every,
        checkpoint_every_num_steps=every,
        checkpoint_folder=tmp_path,
    )
    gen = torch.Generator().manual_seed(0)
    for _ in range(40):
        with torch.no_grad():
            net[0].weight.add_(torch.randn(net[0].weight.shape, generator=gen))
        posthoc.update()
        t = posthoc.profiles[0].tracker
        assert (t.last, t.gap) == profile_time(t.step, update_every, every), t.step

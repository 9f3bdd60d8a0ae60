"""Old state-dict layouts keep loading: a fixture saved by emakit's version-1 layout."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from _models import bn_mlp
from emakit import EMA, STATE_VERSION

FIXTURES = Path(__file__).parent / "fixtures"


# seed 123: deliberately not the weights the fixture was saved from
make_net = partial(bn_mlp, 3, 4, 2, seed=123)


def test_version_1_fixture_loads_and_continues():
    state = torch.load(FIXTURES / "ema_state_v1.pt", weights_only=True)
    assert int(state["version"]) == 1 <= STATE_VERSION
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


def test_current_layout_keys_are_stable():
    """The version-1 key set; a change here must bump STATE_VERSION and add a fixture."""
    state = EMA(make_net()).state_dict()
    fixture = torch.load(FIXTURES / "ema_state_v1.pt", weights_only=True)
    assert set(state) == set(fixture)

"""`emakit.compat.mmengine._register()`, which runs at import: the node ``emakit`` of
mmengine's ``MODELS`` registry, created when missing, found again when present (a second
import, a reload), its three classes registered under mmengine's names and replacing
whatever held those names. Each test puts mmengine's registry back as it found it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip(
    "mmengine", reason="mmengine is not installed (pip install mmengine-lite, in the test extra)"
)
from mmengine import registry

import emakit.compat.mmengine as ours

CLASSES = {
    "ExponentialMovingAverage": ours.ExponentialMovingAverage,
    "MomentumAnnealingEMA": ours.MomentumAnnealingEMA,
    "StochasticWeightAverage": ours.StochasticWeightAverage,
}


def assert_holds_ours(node) -> None:
    assert node.name == "model"
    assert node.scope == ours.SCOPE == "emakit"
    assert node.parent is registry.MODELS
    assert registry.MODELS.children["emakit"] is node
    assert dict(node.module_dict) == CLASSES
    net = nn.Linear(2, 2)
    built = registry.MODELS.build(dict(type="emakit.StochasticWeightAverage", model=net))
    assert type(built) is ours.StochasticWeightAverage
    built.update_parameters(net)
    assert torch.equal(built.module.weight, net.weight)


def test_register_creates_the_node_where_there_is_none(monkeypatch):
    monkeypatch.delitem(registry.MODELS.children, "emakit")  # put back at teardown
    node = ours._register()
    assert node is not ours.MODELS  # a new node
    assert_holds_ours(node)


def test_register_again_finds_the_node_and_replaces_its_own(monkeypatch):
    """A second run (a reload of the module) neither adds a second ``emakit`` child, which
    mmengine refuses, nor fails on names already registered: it registers the classes
    again over whatever holds their names."""
    node = ours.MODELS
    monkeypatch.setitem(node._module_dict, "ExponentialMovingAverage", nn.Linear)
    assert node.get("ExponentialMovingAverage") is nn.Linear
    assert ours._register() is node
    assert_holds_ours(node)
    assert ours._register() is node  # and once more, with its own classes in place
    assert_holds_ours(node)

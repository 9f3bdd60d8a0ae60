"""Layouts an EMA cannot average (issue 30, item 9): a sparse (COO or CSR) buffer or
parameter, a sparse pytree leaf, a sparse tensor in a given ``ema_model`` are refused with an
``EMATypeError`` naming the tensor, its layout and the way out (``ignore_names``), which
then works."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from emakit import EMA, EMAPytree, EMATypeError


@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr"])
@pytest.mark.parametrize("kind", ["buffer", "parameter"])
def test_a_sparse_tensor_is_refused_naming_it_and_the_keyword(layout, kind):
    """A sparse buffer or parameter raised a raw NotImplementedError from the shadow's
    layout (a sparse parameter: a raw error from torch's deepcopy). Now: an EMATypeError
    naming the tensor, its layout and ``ignore_names``, which then works."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: sparse CSR is in beta
        sparse = (
            torch.eye(3).to_sparse() if layout == "sparse_coo" else torch.eye(3).to_sparse_csr()
        )
    net = nn.Linear(3, 3)
    if kind == "buffer":
        net.register_buffer("sp", sparse)
    else:
        net.sp = nn.Parameter(sparse, requires_grad=False)
    with pytest.raises(
        EMATypeError, match=rf"'sp' has layout torch.{layout}.*ignore_names=\{{'sp'\}}"
    ):
        EMA(net)
    ema = EMA(net, ignore_names={"sp"}, beta=0.5, update_after_step=0, update_every=1)
    with torch.no_grad():
        net.weight.add_(1.0)
    ema.update()
    ema.update()
    assert ema.ema_model.sp.layout == sparse.layout
    assert torch.equal(ema.ema_model.sp.to_dense(), torch.eye(3))
    with ema.swap():
        assert torch.equal(net.weight, ema.ema_model.weight)


def test_a_sparse_leaf_of_a_pytree_is_refused():
    with pytest.raises(EMATypeError, match=r"leaf 'a' has layout torch.sparse_coo.*pytree"):
        EMAPytree({"a": torch.eye(3).to_sparse(), "b": torch.ones(2)})


def test_a_sparse_tensor_given_in_ema_model_is_refused():
    net = nn.Linear(3, 3)
    other = nn.Linear(3, 3)
    other.register_buffer("sp", torch.eye(3).to_sparse())
    net.register_buffer("sp", torch.eye(3))
    with pytest.raises(EMATypeError, match=r"'sp' has layout torch\.sparse_coo"):
        EMA(net, ema_model=other)

"""The device-side non-finite guard (issue 15, item 2), in one process.

``skip_nonfinite=True`` decides on the device: the kernels select on a 0-dim flag, and the
skip count stays on the device until it is read. Checked here: the guarded kernels are bit
for bit the plain ``lerp_`` when the flag is true (a weight multiplied by the flag would
not be: ``0 * NaN`` is NaN) and leave every bit alone when it is false, on every engine
path, in chunks, across dtypes; ``update()`` reads nothing back from a tensor; the
warning comes when the count is read.
"""

from __future__ import annotations

import warnings
from functools import partial

import pytest
import torch

import _models
import emakit
import emakit._engine.finite as finite
from _models import bn_mlp
from emakit import EMA

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def guarded_lerp_(dsts, srcs, weight: float, ok: torch.Tensor) -> None:
    """``dst.lerp_(src, weight)`` where ``ok`` holds: one-off ``Guarded`` kernels."""
    with torch.no_grad():
        finite.Guarded(dsts, srcs).update(ok, weight)


def guarded_copy_(dsts, srcs, ok: torch.Tensor) -> None:
    with torch.no_grad():
        finite.Guarded(dsts, srcs).update(ok)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t`` (NaN == NaN, -0.0 != +0.0)."""
    return t.contiguous().view(_INTS[t.element_size()])


def tensors(dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(5, 3), (0,), (17,), (4, 4, 2), (1,)]
    out = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    out.append(torch.randn(6, 5, generator=g).to(dtype).t())  # not contiguous
    return out


@pytest.mark.parametrize("chunk", [finite.GUARD_CHUNK, 7])
@pytest.mark.parametrize("src_dtype", DTYPES)
@pytest.mark.parametrize("dst_dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_guarded_lerp_is_lerp_bit_for_bit(dst_dtype, src_dtype, chunk, monkeypatch):
    monkeypatch.setattr(finite, "GUARD_CHUNK", chunk)  # 7: every tensor over 7 in chunks
    dsts, srcs = tensors(dst_dtype, 0), tensors(src_dtype, 1)
    want = [d.clone() for d in dsts]
    for w, s in zip(want, srcs, strict=True):
        w.lerp_(s.to(w.dtype), 0.37)
    guarded_lerp_(dsts, srcs, 0.37, torch.tensor(True))
    for got, ref in zip(dsts, want, strict=True):
        assert got.dtype == ref.dtype and got.shape == ref.shape
        assert torch.equal(bits(got), bits(ref))


@pytest.mark.parametrize("chunk", [finite.GUARD_CHUNK, 7])
def test_guarded_kernels_leave_every_bit_when_false(chunk, monkeypatch):
    monkeypatch.setattr(finite, "GUARD_CHUNK", chunk)
    dsts = tensors(torch.float32, 0)
    dsts[0][0, 0] = -0.0  # lerp_(s, s, w) would turn -0.0 into +0.0; the select does not
    srcs = tensors(torch.float32, 1)
    srcs[0][0, 0] = float("nan")
    srcs[2][3] = float("inf")
    before = [d.clone() for d in dsts]
    guarded_lerp_(dsts, srcs, 0.5, torch.tensor(False))
    guarded_copy_(dsts, srcs, torch.tensor(False))
    for got, ref in zip(dsts, before, strict=True):
        assert torch.equal(bits(got), bits(ref))  # every bit, -0.0 kept
    ints, bools = torch.arange(4), torch.tensor([True, False])
    guarded_copy_([ints, bools], [torch.zeros(4, dtype=torch.long), ~bools], torch.tensor(True))
    assert ints.tolist() == [0, 0, 0, 0] and bools.tolist() == [False, True]


#: ``train(net, emas, calls)``: SGD steps, each followed by every EMA's ``update()``.
train = partial(_models.train, batch=(8, 4), seed=3)


class NaNWhileUpdating:
    """For `train`'s list of EMAs: updates ``emas`` with ``net[0].weight[0, 0]`` NaN, then
    puts the weight back, so that only the EMAs see the NaN."""

    def __init__(self, net: torch.nn.Module, *emas: EMA) -> None:
        self.net, self.emas = net, emas

    def update(self) -> None:
        weight = self.net[0].weight
        saved = weight[0, 0].item()
        with torch.no_grad():
            weight[0, 0] = float("nan")
        for e in self.emas:
            e.update()
        with torch.no_grad():
            weight[0, 0] = saved


@pytest.mark.parametrize("ema_dtype", [None, torch.float64])
@pytest.mark.parametrize("use_foreach", [False, True, None])
def test_guarded_ema_equals_the_unguarded_one_bit_for_bit(use_foreach, ema_dtype):
    """Finite weights: with the guard on, the EMA is the plain EMA's, every bit, on each
    path; and with NaN at some calls it keeps exactly its bits through them."""
    net = bn_mlp(4, 8, 3, relu=True, seed=0)
    kw = dict(beta=0.9, update_after_step=2, update_every=1, use_foreach=use_foreach)
    guarded = EMA(net, skip_nonfinite=True, ema_dtype=ema_dtype, **kw)
    plain = EMA(net, ema_dtype=ema_dtype, **{**kw, "use_foreach": False})  # the reference loop
    train(net, [guarded, plain], 8)
    for (k, a), b in zip(guarded.state_dict().items(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    assert guarded.num_skipped_nonfinite == 0
    before = {k: v.clone() for k, v in guarded.ema_model.state_dict().items()}
    train(net, [NaNWhileUpdating(net, guarded)], 2)
    for k, v in guarded.ema_model.state_dict().items():
        assert torch.equal(v, before[k]), k
    with pytest.warns(RuntimeWarning, match="skipped an EMA update at step 9"):
        assert guarded.num_skipped_nonfinite == 2


def test_update_reads_nothing_back_from_a_tensor(monkeypatch):
    """After the first call (which reads the flag once, so a first call on NaN weights
    leaves the EMA uninitialized), ``update()`` with the guard makes no host read: every
    way of turning a tensor into a Python value raises inside it."""
    net = bn_mlp(4, 8, 3, relu=True, seed=0)
    emas = [
        EMA(net, skip_nonfinite=True, update_after_step=1, update_every=1, use_foreach=f)
        for f in (False, True, None)
    ]
    for _ in range(3):  # the first call, the warm-up copy, the first average (which
        for e in emas:  # also runs the decay schedule's one-time CPU self-check)
            e.update()

    def no_read(*_args, **_kwargs):
        raise AssertionError("update() read a tensor's value on the host")

    with monkeypatch.context() as m:
        for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
            m.setattr(torch.Tensor, name, no_read)
        for _ in range(2):  # two more averaging calls
            for e in emas:
                e.update()
        with torch.no_grad():
            net[0].weight.fill_(float("nan"))
        for e in emas:
            e.update()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert [e.num_skipped_nonfinite for e in emas] == [1, 1, 1]
    assert len(caught) == 3 and "skipped an EMA update at step 6" in str(caught[0].message)


def test_a_first_call_on_nan_weights_leaves_the_ema_uninitialized():
    net = bn_mlp(4, 8, 3, relu=True, seed=0)
    ema = EMA(net, skip_nonfinite=True, update_after_step=0, update_every=1)
    with torch.no_grad():
        net[0].weight[0, 0] = float("nan")
    with pytest.warns(RuntimeWarning, match="skipped an EMA update at step 1"):
        ema.update()  # the first call reads its flag on the host
    assert not bool(ema.initted) and ema.num_skipped_nonfinite == 1
    with torch.no_grad():
        net[0].weight[0, 0] = 0.5
    ema.update()
    assert bool(ema.initted) and torch.equal(ema.ema_model[0].weight, net[0].weight)


def test_the_guard_selects_a_whole_shadow_with_one_kernel():
    """emakit lays a shadow out as one run of memory (not in the model's order): the guard
    sorts the pairs by address, so the averaged tensors are selected by one kernel (an
    ``index_select`` of the new or the old row into the shadow's span)."""
    net = bn_mlp(4, 8, 3, relu=True, seed=0)
    # The shadow follows the online tensors' addresses: put them in one buffer, last
    # parameter first, so that the shadow is certainly not in the model's order (separate
    # allocations are in whatever order the allocator returns)
    params = list(net.parameters())
    pool = torch.empty(sum(p.numel() for p in params) + 64 * len(params))
    offset = 0
    with torch.no_grad():
        for p in reversed(params):
            p.data = pool[offset : offset + p.numel()].view_as(p).copy_(p)
            offset += p.numel() + 64  # gaps: no two parameters adjacent (no span across them)
    ema = EMA(net, skip_nonfinite=True, update_after_step=0, update_every=1)
    ema.update()
    ema.update()
    offsets = [p.storage_offset() for p in ema.ema_model.parameters()]
    assert offsets != sorted(offsets)  # the shadow is not in the model's order
    guarded = [k for pair in ema.tracker.plan().guarded().kernels for k in pair]
    floats = [g for g in guarded if g.batches and g.batches[0].key[1] == torch.float32]
    averaged = sum(t.numel() for t in ema.ema_model.state_dict().values() if t.is_floating_point())
    assert len(floats) == 1 and len(floats[0].batches) == 1
    batch = floats[0].batches[0]
    assert sum(d.numel() for d in batch.dsts) == averaged
    assert batch.run  # one select for the whole shadow, in place
    assert batch.numel == batch.out.numel() > averaged  # the alignment padding too


@pytest.mark.parametrize("chunk", [finite.GUARD_CHUNK, 16])
@pytest.mark.parametrize("flatten", [False, True])
@pytest.mark.parametrize("use_foreach", [False, True, None])
def test_the_guard_follows_parameter_data_swaps(use_foreach, flatten, chunk, monkeypatch):
    """The guard reads the weights through views made once (one ``cat``, or the weights'
    own span for a flattened model or a large tensor, chunk 16); a ``.data`` swap is seen
    at the next update (the views are remade), and a ``.data`` of another shape is named
    as without the guard."""
    monkeypatch.setattr(finite, "GUARD_CHUNK", chunk)
    net = bn_mlp(4, 8, 3, relu=True, seed=0)
    if flatten:
        emakit.flatten_parameters(net)
    kw = dict(beta=0.9, update_after_step=0, update_every=1, use_foreach=use_foreach)
    guarded = EMA(net, skip_nonfinite=True, **kw)
    plain = EMA(net, **{**kw, "use_foreach": False})
    train(net, [guarded, plain], 3)
    with torch.no_grad():
        net[0].weight.data = net[0].weight.data * 2 + 1  # a new storage, same shape
    train(net, [guarded, plain], 3)
    for (k, a), b in zip(guarded.state_dict().items(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    net[0].weight.data = torch.zeros(3, 4)
    with pytest.raises(emakit.EMAStateError, match=r"'0\.weight' has shape"):
        guarded.update()


@pytest.mark.parametrize("use_foreach", [False, None])
def test_a_model_larger_than_the_scratch_is_guarded_batch_by_batch(use_foreach, monkeypatch):
    """Batches of a few elements, so each device and dtype has many that share one scratch:
    the flag's gather is redone for the update, bit for bit the plain EMA; NaN skips."""
    monkeypatch.setattr(finite, "GUARD_CHUNK", 16)
    net = bn_mlp(4, 8, 3, relu=True, seed=0)
    kw = dict(beta=0.9, update_after_step=1, update_every=1, use_foreach=use_foreach)
    guarded = EMA(net, skip_nonfinite=True, **kw)
    plain = EMA(net, **{**kw, "use_foreach": False})
    train(net, [guarded, plain], 5)
    batches = [b for lerp, _ in guarded.tracker.plan().guarded().kernels for b in lerp.batches]
    assert len(batches) > 4 and not any(b.alone for b in batches)
    for (k, a), b in zip(guarded.state_dict().items(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    before = {k: v.clone() for k, v in guarded.ema_model.state_dict().items()}
    train(net, [NaNWhileUpdating(net, guarded)], 1)
    for k, v in guarded.ema_model.state_dict().items():
        assert torch.equal(v, before[k]), k
    with pytest.warns(RuntimeWarning, match="skipped an EMA update"):
        assert guarded.num_skipped_nonfinite == 1

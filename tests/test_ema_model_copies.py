"""Copies of the EMA model (docs/resume.md): ``torch.save``, ``copy.deepcopy`` and
``state_dict()`` store each of the EMA's flat buffers once; plain ``pickle`` writes the
shared buffer once per tensor (torch's limitation for views of one storage), as the page
says. Should torch or emakit change that, this test says the page must change too."""

from __future__ import annotations

import copy
import io
import pickle

import torch
from torch import nn

from emakit import EMA


def test_torch_save_and_deepcopy_keep_one_copy_plain_pickle_one_per_tensor():
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(64, 64) for _ in range(10)])
    ema = EMA(net, update_after_step=0, update_every=1)
    ema.update()
    model_bytes = sum(t.numel() * t.element_size() for t in net.state_dict().values())

    buffer = io.BytesIO()
    torch.save(ema.ema_model, buffer)
    assert len(buffer.getvalue()) < 1.5 * model_bytes
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    clone = copy.deepcopy(ema.ema_model)
    for copied in (loaded, clone):
        storages = {
            t.untyped_storage().data_ptr(): t.untyped_storage()
            for t in copied.state_dict().values()
        }
        held = sum(storage.nbytes() for storage in storages.values())
        assert held < 1.5 * model_bytes, (len(storages), held)
        for k, v in copied.state_dict().items():
            assert torch.equal(v, ema.ema_model.state_dict()[k]), k

    pickled = pickle.dumps(ema.ema_model)
    assert len(pickled) > 10 * model_bytes  # 20 tensors, the whole buffer each: the trap
    assert len(pickle.dumps(net)) < 1.5 * model_bytes  # the model's own tensors: no trap

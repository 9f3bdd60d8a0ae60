"""EMA of a PEFT LoRA model (a config-built GPT-2, nothing downloaded): with
``share_frozen=True`` the frozen base is shared, only the adapters are copied and averaged
(by default the base is copied too); swap() around generate(); the EMA of the adapters
alone exported as PEFT's save_pretrained writes it; peft's merges never move the EMA's
output (copied base) or are refused by name (shared base)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from _frameworks import need

transformers = need("transformers")
peft = need("peft")

from safetensors.torch import load_file  # noqa: E402

from emakit import BEMA, EMA, EMAStateError  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
VOCAB = 64
KW = {"beta": 0.9, "update_after_step": 0, "update_every": 1}


def base_model() -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2
    )
    return transformers.GPT2LMHeadModel(config).eval()


def lora_model() -> Any:
    config = peft.LoraConfig(r=4, target_modules=["c_attn", "c_proj"], lora_dropout=0.0)
    return peft.get_peft_model(base_model(), config)


def train(model: Any, ema: EMA, steps: int = 4) -> None:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    g = torch.Generator().manual_seed(1)
    model.train()
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (4, 8), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        ema.update()
    model.eval()


def nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_only_the_adapters_are_copied_and_averaged():
    model = lora_model()
    ema = EMA(model, share_frozen=True, **KW)
    online = dict(model.named_parameters())
    trainable = {n for n, p in online.items() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    own = {n for n, p in ema.ema_model.named_parameters() if p.data_ptr() != online[n].data_ptr()}
    assert own == trainable  # the frozen base is the model's own storage
    averaged = {p.name for p in ema.tracker.plan().pairs if p.average}
    assert averaged == trainable
    copied = nbytes(p for n, p in ema.ema_model.named_parameters() if n in own)
    assert copied == nbytes(online[n] for n in trainable)


def test_swap_around_generate():
    model = lora_model()
    ema = EMA(model, **KW)
    train(model, ema)
    raw = {k: v.clone() for k, v in model.state_dict().items()}
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(3))
    opts = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        online_out = model.generate(input_ids=prompt, **opts)
        with ema.swap():
            swapped_out = model.generate(input_ids=prompt, **opts)
            swapped_logits = model(input_ids=prompt).logits
        ema_logits = ema(input_ids=prompt).logits
        copy_out = ema.ema_model.generate(input_ids=prompt, **opts)
    assert torch.equal(swapped_out, copy_out)
    assert torch.equal(swapped_logits, ema_logits)
    assert not torch.equal(swapped_logits, model(input_ids=prompt).logits)
    assert online_out.shape == swapped_out.shape
    for k, v in model.state_dict().items():
        assert torch.equal(v, raw[k]), k


@pytest.mark.parametrize("kind", ["ema", "bema"])
def test_export_of_the_adapters_alone(tmp_path: Path, kind: str):
    model = lora_model()
    ema = EMA(model, **KW) if kind == "ema" else BEMA(model, update_freq=1)
    train(model, ema)
    ema.ema_model.save_pretrained(tmp_path / "ema")
    model.save_pretrained(tmp_path / "online")
    saved = load_file(tmp_path / "ema" / "adapter_model.safetensors")
    online = load_file(tmp_path / "online" / "adapter_model.safetensors")
    assert saved.keys() == online.keys() and all("lora_" in k for k in saved)
    state = peft.get_peft_model_state_dict(ema.ema_model)
    for k, v in saved.items():
        assert torch.equal(v, state[k]), k
    assert any(not torch.equal(saved[k], online[k]) for k in saved)  # the EMA, not the model
    reloaded = peft.PeftModel.from_pretrained(base_model(), tmp_path / "ema")
    for name, p in reloaded.named_parameters():
        if "lora_" in name:
            assert torch.equal(p, dict(ema.ema_model.named_parameters())[name]), name


# -- issue 39: peft's merges write the adapters into the base weights in place ---------------


def test_merge_adapter_never_moves_the_output_of_an_ema_that_copies_the_base():
    """The default copies the frozen base: peft's ``merge_adapter()`` (the model's adapters
    added into its base weights, through ``.data``) leaves the EMA's output where it was.
    Before, the base was shared and the EMA applied both deltas."""
    model = lora_model()
    ema = EMA(model, **KW)
    train(model, ema)
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = ema(input_ids=prompt).logits
        model.merge_adapter()
        merged = ema(input_ids=prompt).logits
        model.unmerge_adapter()
    assert torch.equal(merged, before)
    merged_model = model.merge_and_unload()  # irreversible: the LoRA layers leave the model
    with torch.no_grad():
        assert torch.equal(ema(input_ids=prompt).logits, before)
    with pytest.raises(EMAStateError, match="lora_A"):  # the model no longer pairs
        ema.update()
    assert merged_model is not None


def test_merge_adapter_is_refused_by_an_ema_that_shares_the_base_until_unmerged():
    model = lora_model()
    ema = EMA(model, share_frozen=True, **KW)
    train(model, ema)
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = ema(input_ids=prompt).logits
    step = int(ema.step)
    model.merge_adapter()
    reads = {
        "ema(x)": lambda: ema(input_ids=prompt),
        "update()": ema.update,
        "swap()": lambda: ema.swap().enter(),
        "state_dict()": ema.state_dict,
        "ema_model": lambda: ema.ema_model,
    }
    for what, read in reads.items():
        with pytest.raises(EMAStateError, match=r"merge_adapter.*unmerge_adapter\(\)") as e:
            read()
        assert "share_frozen=False" in str(e.value), what
    assert int(ema.step) == step  # the refused update counted nothing
    model.unmerge_adapter()
    with torch.no_grad():  # the base is back (up to the rounding of adding and subtracting)
        torch.testing.assert_close(ema(input_ids=prompt).logits, before)
    ema.update()
    model.merge_and_unload()
    with pytest.raises(EMAStateError, match="unmerge_adapter"):
        ema(input_ids=prompt)

"""``EMA(engine)`` under DeepSpeed ZeRO-3 and ZeRO-2, with the real deepspeed on 2 CPU ranks.

One launch runs every check (a DeepSpeed engine takes seconds to build on the CPU): the
EMA of ZeRO-3 partitions against a full-weight reference EMA fed the gathered weights
(bit for bit), ``EMA(engine.module)``, MultiEMA, KarrasEMA and BEMA, the keywords users pass,
``swap()`` evaluation, ``ema(x)``, the streamed full export, resume through
``client_state``, refusals (another world size, a step mismatch at save), the non-finite
guard's agreement, and ZeRO-2 (an ordinary EMA, identical on every rank).

DeepSpeed builds a small shared-memory op the first time a process group starts (minutes
of compiling on a busy machine, cached after). A session fixture builds it once, in one
process, under a deadline; if that fails the ranks run without it (DeepSpeed then uses
torch.distributed for everything, which the EMA does not notice).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from torch import nn

from _deepspeed import DEEPSPEED_MARKS, start_rank
from _launch import run_ranks
from emakit import BEMA, EMA, EMAStateError, EMATypeError, KarrasEMA, MultiEMA
from emakit.distributed import load_full_ema_weights, save_full_ema_weights
from emakit.integrations._common import refuse_zero3

pytestmark = DEEPSPEED_MARKS

WORLD = 2
STEPS = 4
JOB_TIMEOUT_S = 300
KW: dict[str, Any] = dict(beta=0.9, update_after_step=1, update_every=1)


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))


def config(stage: int) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 10  # the biases persist, the weights not
    return {
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": zero,
        "optimizer": {"type": "Adam", "params": {"lr": 0.05, "torch_adam": True}},
        "zero_allow_untested_optimizer": True,
    }


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)) for _ in range(STEPS)]


# -- the job -------------------------------------------------------------------------------


def gathered(engine: Any) -> dict[str, torch.Tensor]:
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return {n: p.data.clone() for n, p in engine.module.named_parameters()}


def full_ema(ema: EMA) -> dict[str, torch.Tensor]:
    model = ema.ema_model
    return {n: model.full(n, None).clone() for n in model.layout()}


def _state(ema: EMA) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in ema.ema_model.state_dict().items()}


def zero3_checks(rank: int, out: Path, deepspeed: Any) -> dict[str, Any]:
    engine, *_ = deepspeed.initialize(model=make_net(), config=config(3))
    side = make_net()
    variants: dict[str, Any] = {
        "ema": lambda m: EMA(m, **KW, skip_nonfinite=True),
        "module": lambda m: EMA(m.module if hasattr(m, "module") else m, **KW),
        "keywords": lambda m: EMA(
            m,
            beta=0.9,
            update_after_step=0,
            update_every=2,
            ema_dtype=torch.float64,
            device="cpu",
            decay_groups={"0.*": 0.5},
        ),
        "multi": lambda m: MultiEMA(m, betas=(0.5, 0.9), update_after_step=0, update_every=1),
        "karras": lambda m: KarrasEMA(m, sigma_rel=0.2, update_every=1),
        "bema": lambda m: BEMA(m, update_freq=1, lag=1),
    }
    emas = {k: make(engine) for k, make in variants.items()}
    refs = {k: make(side) for k, make in variants.items()}
    for x, y in batches():
        xr, yr = x[rank * 2 : rank * 2 + 2], y[rank * 2 : rank * 2 + 2]
        engine.backward(nn.functional.mse_loss(engine(xr), yr))
        engine.step()
        side.load_state_dict(gathered(engine))
        for k in emas:
            emas[k].update()
            refs[k].update()
    r: dict[str, Any] = {}
    ema, ref = emas["ema"], refs["ema"]
    r["exact"] = {k: full_ema(emas[k] if k != "multi" else emas[k].emas[1]) for k in emas}
    r["ref"] = {k: _state(refs[k].emas[1] if k == "multi" else refs[k]) for k in refs}
    r["local_numel"] = sum(p.numel() for p in ema.ema_model.parameters())
    r["total_numel"] = sum(p.numel() for p in side.parameters())
    # Evaluation: swap() (engine's own gather), ema(x); the online weights come back.
    x = batches()[0][0]
    online = gathered(engine)
    with torch.no_grad():
        r["online_out"] = engine(x)
        with ema.swap():
            r["swap_out"] = engine(x)
        r["call_out"] = ema(x)
    r["ref_out"] = ref(x)
    r["restored"] = all(torch.equal(v, online[n]) for n, v in gathered(engine).items())
    # The streamed full export, loadable into the model class.
    path = out / "ema.safetensors"
    save_full_ema_weights(ema, path)
    r["file"] = safetensors.torch.load_file(path) if rank == 0 else None
    # Resume through DeepSpeed's own checkpoint into a fresh engine and EMA.
    engine.save_checkpoint(str(out / "ckpt"), client_state={"ema": ema.state_dict()})
    engine2, *_ = deepspeed.initialize(model=make_net(), config=config(3))
    ema2 = EMA(engine2, **KW, skip_nonfinite=True)
    _, client = engine2.load_checkpoint(str(out / "ckpt"))
    ema2.load_state_dict(client["ema"])
    mine, theirs = ema.state_dict(), ema2.state_dict()
    r["resumed"] = mine.keys() == theirs.keys() and all(
        torch.equal(mine[k], theirs[k]) for k in mine
    )
    # Another world size: refused, naming the way that works; the full file loads.
    other = dict(mine, **{"ema_model.partition_layout": torch.tensor([4, rank])})
    try:
        ema2.load_state_dict(other)
    except EMAStateError as e:
        r["world_refusal"] = str(e)
    ema3 = EMA(engine2, **KW)
    load_full_ema_weights(ema3, path)
    r["from_file"] = all(
        torch.equal(a, b)
        for a, b in zip(ema3.ema_model.parameters(), ema.ema_model.parameters(), strict=True)
    ) and int(ema3.step) == int(ema.step)
    # Integrations that write the EMA from one process refuse ZeRO-3, naming the way.
    try:
        refuse_zero3(engine.module, "EMATrainerCallback")
    except EMATypeError as e:
        r["integration_refusal"] = str(e)
    # A step mismatch across ranks is refused at save, on every rank.
    if rank == 1:
        ema.step = int(ema.step) + 1
    try:
        ema.state_dict()
    except EMAStateError as e:
        r["step_refusal"] = str(e)
    ema.step = STEPS
    # The non-finite guard: rank 0's partition poisoned, every rank skips.
    before = [p.clone() for p in ema.ema_model.parameters()]
    part = engine.module[0].weight.ds_tensor
    saved = part.clone()
    if rank == 0:
        part[0] = float("nan")
    ema.update()
    part.copy_(saved)
    r["skipped"] = ema.num_skipped_nonfinite
    r["unchanged"] = all(
        torch.equal(a, b) for a, b in zip(before, ema.ema_model.parameters(), strict=True)
    )
    return r


def zero2_checks(rank: int, out: Path, deepspeed: Any) -> dict[str, Any]:
    engine, *_ = deepspeed.initialize(model=make_net(), config=config(2))
    side = make_net()
    ema, ref = EMA(engine, **KW), EMA(side, **KW)
    parted = EMA(engine, **KW, partition=True, skip_nonfinite=True)  # 1/world of the EMA
    for x, y in batches():
        xr, yr = x[rank * 2 : rank * 2 + 2], y[rank * 2 : rank * 2 + 2]
        engine.backward(nn.functional.mse_loss(engine(xr), yr))
        engine.step()
        side.load_state_dict(engine.module.state_dict())
        for e in (ema, ref, parted):
            e.update()
    x = batches()[0][0]
    online = {n: t.clone() for n, t in engine.module.state_dict().items()}
    with torch.no_grad():
        with ema.swap():
            swap_out = engine(x)
        with parted.swap():
            parted_swap_out = engine(x)
        parted_call_out = parted(x)
    restored = all(torch.equal(v, online[n]) for n, v in engine.module.state_dict().items())
    path = out / "ema2.safetensors"
    save_full_ema_weights(ema, path)
    parted_path = out / "parted.safetensors"
    save_full_ema_weights(parted, parted_path)
    state = {"ema": ema.state_dict(), "parted": parted.state_dict()}
    engine.save_checkpoint(str(out / "ckpt2"), client_state=state)
    engine2, *_ = deepspeed.initialize(model=make_net(), config=config(2))
    ema2, parted2 = EMA(engine2, **KW), EMA(engine2, **KW, partition=True, skip_nonfinite=True)
    _, client = engine2.load_checkpoint(str(out / "ckpt2"))
    ema2.load_state_dict(client["ema"])
    # ZeRO-2 checkpoints keep rank 0's client_state only: another rank's part is refused,
    # and rank 0 (whose state it is) raises too, so no rank trains on alone (issue 30);
    # the partitioned EMA resumes from the full file (any world size).
    rank_refusal = ""
    try:
        parted2.load_state_dict(client["parted"])
    except EMAStateError as e:
        rank_refusal = str(e)
    load_full_ema_weights(parted2, parted_path)
    return {
        "ema": _state(ema),
        "ref": _state(ref),
        "parted": full_ema(parted),
        "parted_numel": sum(p.numel() for p in parted.ema_model.parameters()),
        "total_numel": sum(p.numel() for p in side.parameters()),
        "swap_out": swap_out,
        "parted_outs": (parted_swap_out, parted_call_out),
        "restored": restored,
        "ref_out": ref(x),
        "file": safetensors.torch.load_file(path) if rank == 0 else None,
        "parted_file": safetensors.torch.load_file(parted_path) if rank == 0 else None,
        "resumed": _state(ema2),
        "parted_resumed": full_ema(parted2),
        "rank_refusal": rank_refusal,
    }


def worker(rank: int, out: Path, shm: bool) -> dict[str, Any]:
    deepspeed = start_rank(rank, WORLD, shm)
    return {
        "zero3": zero3_checks(rank, out, deepspeed),
        "zero2": zero2_checks(rank, out, deepspeed),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory, shm_op: bool) -> list[dict[str, Any]]:
    import deepspeed  # noqa: F401  (once here, not per rank: importing takes seconds)

    out = tmp_path_factory.mktemp("deepspeed")
    return run_ranks(
        lambda rank, o: worker(rank, o, shm_op), out, world=WORLD, timeout_s=JOB_TIMEOUT_S
    )


# -- ZeRO-3 --------------------------------------------------------------------------------


def test_zero3_ema_is_the_reference_ema_of_the_gathered_weights(results: list) -> None:
    for r in results:
        z = r["zero3"]
        for kind, ref in z["ref"].items():
            got = z["exact"][kind]
            assert got.keys() == ref.keys(), kind
            for n, v in ref.items():
                assert torch.equal(got[n], v), (kind, n)
        assert z["exact"]["keywords"]["0.weight"].dtype == torch.float64
        assert z["local_numel"] <= z["total_numel"] // WORLD + 2  # its partitions only


def test_zero3_swap_and_call_evaluate_the_ema_and_restore_the_model(results: list) -> None:
    for r in results:
        z = r["zero3"]
        assert torch.equal(z["swap_out"], z["ref_out"])
        assert torch.equal(z["call_out"], z["ref_out"])
        assert not torch.equal(z["online_out"], z["ref_out"])  # the EMA is not the model
        assert z["restored"]


def test_zero3_full_export_loads_into_the_model_class(results: list) -> None:
    z = results[0]["zero3"]
    net = make_net()
    net.load_state_dict(z["file"])
    for n, v in z["ref"]["ema"].items():
        assert torch.equal(net.state_dict()[n], v), n


def test_zero3_resume_through_client_state(results: list) -> None:
    for r in results:
        z = r["zero3"]
        assert z["resumed"]
        assert z["from_file"]
        assert "partitions of 2 ranks" in z["world_refusal"]
        assert "load_full_ema_weights" in z["world_refusal"]


def test_zero3_refusals_and_nonfinite_agreement(results: list) -> None:
    for r in results:
        z = r["zero3"]
        assert "step" in z["step_refusal"] and "rank" in z["step_refusal"]
        assert "ZeRO-3" in z["integration_refusal"]
        assert "emakit.EMA(engine)" in z["integration_refusal"]
        assert z["skipped"] == 1 and z["unchanged"]


# -- ZeRO-2 --------------------------------------------------------------------------------


def test_zero2_ema_is_identical_on_every_rank_and_resumes(results: list) -> None:
    first = results[0]["zero2"]
    for r in results:
        z = r["zero2"]
        for n, v in z["ref"].items():
            assert torch.equal(z["ema"][n], v), n
            assert torch.equal(z["ema"][n], first["ema"][n]), n
            assert torch.equal(z["resumed"][n], v), n
        assert torch.equal(z["swap_out"], z["ref_out"])
    net = make_net()
    net.load_state_dict(first["file"])
    for n, v in first["ref"].items():
        assert torch.equal(net.state_dict()[n], v), n


def test_zero2_partitioned_ema_keeps_a_slice_and_gathers_on_demand(results: list) -> None:
    first = results[0]["zero2"]
    for r in results:
        z = r["zero2"]
        assert z["parted_numel"] <= z["total_numel"] // WORLD + 4  # its slices only
        for n, v in z["ref"].items():
            assert torch.equal(z["parted"][n], v), n
            assert torch.equal(z["parted_resumed"][n], v), n
        for out in z["parted_outs"]:
            assert torch.equal(out, z["ref_out"])
        assert z["restored"]
    # every rank raises: rank 1 its own reason, rank 0 (its own state) naming rank 1
    assert "'refused (EMAStateError)' on rank 1" in results[0]["zero2"]["rank_refusal"]
    assert "rank 0's EMA partitions, and this is rank 1" in results[1]["zero2"]["rank_refusal"]
    net = make_net()
    net.load_state_dict(first["parted_file"])
    for n, v in first["ref"].items():
        assert torch.equal(net.state_dict()[n], v), n

"""Frozen FSDP2 shards cost nothing (issue 21, point 1), on 2 gloo ranks, in one launch.

The EMA copy of an FSDP2 model holds, for each frozen parameter whose shards FSDP2 does
not pad, a DTensor whose local shard *is* the model's (FSDP2 all-gathers from it); the
reference everywhere is the same EMA built with ``share_frozen=False``, which copies and
averages every shard as ema-pytorch would, and must agree bit for bit:

The EMAs under test are built with ``share_frozen=True`` (the default copies frozen weights).

* sharing: the shard aliases the online one, the plan leaves it out, the EMA's memory is
  the trained (and the padded frozen) shards only;
* N updates, ``ema(x)``, ``swap()``, ``state_dict()`` keys and values: equal to the reference;
* unfreezing mid-run: a read of the EMA before the next step un-shares, training moves the
  weight, the EMA averages it and still equals the reference;
* new values written into a shared shard in place: the next update is refused by name;
* loads (``load_state_dict``, ``load_sharded_ema``) that change a frozen value give the EMA
  its own shard first and never write into the model; equal values keep the sharing;
* an uneven frozen parameter (3 rows over 2 ranks: rank 1's shard is padded) is owned and
  averaged on every rank; FSDP2 would copy a padded shard it is asked to adopt;
* tied frozen weights are shared in every place; ``skip_nonfinite`` agrees as before, also
  when a load un-shares a frozen shard on one rank only;
* ``MultiEMA`` shares and equals its ``share_frozen=False`` EMAs; ``KarrasEMA`` and ``BEMA``
  share; ``PostHocEMA``'s snapshots of shared shards synthesize as a plain twin's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from _launch import DIST_MARKS, FSDP2_MARK, run_ranks
from _models import gathered
from emakit import BEMA, EMA, EMAStateError, KarrasEMA, MultiEMA, PostHocEMA
from emakit._core.sharding import adopt_shard
from emakit._dist.dtensor import local_tensor
from emakit.distributed import load_sharded_ema, save_sharded_ema

pytestmark = [*DIST_MARKS, FSDP2_MARK, pytest.mark.filterwarnings("ignore::UserWarning")]

KW: dict[str, Any] = dict(beta=0.9, update_after_step=0, update_every=1)
#: The EMAs under test share frozen shards (the default copies them, as the references do).
SHARE: dict[str, Any] = dict(share_frozen=True)
STEPS = 3


class LoRALike(nn.Module):
    """A frozen base (``base``: 16 rows, even over 2 ranks; ``odd``: 3 rows, rank 1's shard
    padded) and a small trained adapter."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(8, 16)
        self.odd = nn.Linear(16, 3)
        self.adapter = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.adapter(torch.tanh(self.odd(torch.tanh(self.base(x)))))


class Tied(nn.Module):
    """A frozen embedding tied to the output layer, and a trained middle layer."""

    def __init__(self, mesh: Any) -> None:
        from torch.distributed.fsdp import fully_shard

        super().__init__()
        torch.manual_seed(1)
        self.emb = nn.Embedding(16, 8)
        self.mid = nn.Linear(8, 8)
        self.out = nn.Linear(8, 16, bias=False)
        self.out.weight = self.emb.weight
        self.emb.requires_grad_(False)
        fully_shard(self, mesh=mesh)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(self.emb(ids))))


SHARED = ["base.bias", "base.weight"]  # odd.*: padded on rank 1, so owned on both


def lora_like(mesh: Any) -> LoRALike:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    net = LoRALike()
    net.base.requires_grad_(False)
    net.odd.requires_grad_(False)
    fully_shard(net.base, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def shared(ema: EMA, net: nn.Module) -> list[str]:
    online = dict(net.named_parameters())
    return sorted(
        n
        for n, p in ema.ema_model.named_parameters()
        if local_tensor(p).numel()
        and local_tensor(p).data_ptr() == local_tensor(online[n]).data_ptr()
    )


def weights(ema: EMA) -> dict[str, torch.Tensor]:
    """This rank's shards of the EMA's state (the ``ema_model.*`` keys), cloned."""
    return {
        k: local_tensor(v).clone()
        for k, v in ema.state_dict().items()
        if k.startswith("ema_model.")
    }


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def extra_bytes(ema: EMA, net: nn.Module) -> int:
    """Bytes of the EMA copy's parameter storages that the model does not hold."""
    own = {local_tensor(p).untyped_storage().data_ptr() for p in net.parameters()}
    seen: dict[int, int] = {}
    for p in ema.ema_model.parameters():
        storage = local_tensor(p).untyped_storage()
        if storage.data_ptr() not in own:
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def train(net: nn.Module, opt: torch.optim.Optimizer, rank: int, i: int) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * i + rank))
    net(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def run(emas: list[Any], net: nn.Module, opt: torch.optim.Optimizer, rank: int, at: int) -> None:
    for i in range(at, at + STEPS):
        train(net, opt, rank, i)
        for e in emas:
            e.update()


def worker(rank: int, out: Path) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    res: dict[str, Any] = {}
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(99))
    net = lora_like(mesh)
    ema, ref = EMA(net, **SHARE, **KW), EMA(net, share_frozen=False, **KW)
    guarded = EMA(net, skip_nonfinite=True, **SHARE, **KW)  # one all-reduce per update
    karras = KarrasEMA(net, sigma_rel=0.1, update_every=1, **SHARE)
    bema = BEMA(net, update_freq=1, **SHARE)
    multi = MultiEMA(net, betas=(0.9, 0.99), update_after_step=0, update_every=1, **SHARE)
    multi_ref = [
        EMA(net, beta=b, share_frozen=False, update_after_step=0, update_every=1)
        for b in (0.9, 0.99)
    ]
    res["shared"] = shared(ema, net)
    res["ref_shared"] = shared(ref, net)
    res["karras_shared"] = shared(karras, net)
    res["bema_shared"] = (shared(bema, net), sorted(p.name for p in bema.tracker.plan().pairs))
    res["multi_shared"] = [shared(e, net) for e in multi]
    res["plan"] = sorted(p.name for p in ema.tracker.plan().pairs)
    res["bytes"] = (extra_bytes(ema, net), extra_bytes(ref, net))
    res["adapter_and_odd_bytes"] = sum(
        local_tensor(p).untyped_storage().nbytes()
        for n, p in ref.ema_model.named_parameters()
        if not n.startswith("base.")
    )
    adapter = [p for p in net.parameters() if p.requires_grad]
    run([ema, ref, guarded, multi, *multi_ref], net, torch.optim.SGD(adapter, lr=0.2), rank, 0)
    res["after_updates"] = equal(weights(ema), weights(ref)) and equal(
        weights(guarded), weights(ref)
    )
    res["multi"] = [equal(weights(e), weights(c)) for e, c in zip(multi, multi_ref, strict=True)]
    res["keys"] = sorted(ema.state_dict()) == sorted(ref.state_dict())
    res["forward"] = (ema(x), ref(x))
    with ema.swap():
        swapped = net(x).detach()
    with ref.swap():
        res["swap"] = (swapped, net(x).detach())
    ema.copy_params_from_model_to_ema()
    ref.copy_params_from_model_to_ema()
    res["copied"] = (equal(weights(ema), weights(ref)), shared(ema, net))
    before = {n: local_tensor(p).clone() for n, p in net.named_parameters()}

    # A save, then new base weights in the model (in place: the shared EMA refuses to go
    # on, its value was that storage), then the old state loaded back: the EMA owns the
    # loaded base, the model keeps its new one.
    folder = out / "dcp"
    save_sharded_ema(ema, folder)
    saved = weights(ema)
    with torch.no_grad():
        local_tensor(net.base.weight).add_(1.0)
    try:
        ema.update()
        res["written_refused"] = ""
    except EMAStateError as e:
        res["written_refused"] = str(e)
    new_base = local_tensor(net.base.weight).clone()
    load_sharded_ema(ema, folder)
    res["dcp_loaded"] = equal(weights(ema), saved)
    res["dcp_model_kept"] = torch.equal(local_tensor(net.base.weight), new_base)
    res["dcp_shared"] = shared(ema, net)
    with torch.no_grad():
        local_tensor(net.base.weight).copy_(before["base.weight"])  # back to the old base

    # load_state_dict of the reference's state (equal values): sharing kept; then of a
    # state whose frozen bias differs: the EMA owns it, the model is untouched.
    fresh = EMA(net, **SHARE, **KW)
    fresh.load_state_dict(ref.state_dict())
    res["equal_load"] = (equal(weights(fresh), weights(ref)), shared(fresh, net))
    state = ref.state_dict()
    state["ema_model.base.bias"] = state["ema_model.base.bias"] + 1.0
    fresh.load_state_dict(state)
    res["changed_load"] = (
        torch.equal(
            local_tensor(fresh.ema_model.base.bias), local_tensor(state["ema_model.base.bias"])
        ),
        all(torch.equal(local_tensor(p), before[n]) for n, p in net.named_parameters()),
        shared(fresh, net),
    )

    # Unfreezing mid-run: a read before the next step un-shares base.*, training moves it,
    # the EMA averages.
    net.base.requires_grad_(True)
    ema(x)
    run([ema, ref], net, torch.optim.SGD(net.parameters(), lr=0.2), rank, STEPS)
    res["unfrozen"] = (equal(weights(ema), weights(ref)), shared(ema, net))
    res["base_moved"] = not torch.equal(local_tensor(net.base.weight), before["base.weight"])
    res["base_averaged"] = not torch.equal(
        local_tensor(ema.ema_model.base.weight), local_tensor(net.base.weight)
    )
    res["forward_unfrozen"] = (ema(x), ref(x))

    # Tied frozen weights (an embedding and its output layer): shared in both places.
    tied = Tied(mesh)
    tied_ema, tied_ref = EMA(tied, **SHARE, **KW), EMA(tied, share_frozen=False, **KW)
    ids = torch.tensor([[1, 5, 9]])
    res["tied"] = (
        shared(tied_ema, tied),
        tied_ema.ema_model.emb.weight is tied_ema.ema_model.out.weight,
        sorted(tied_ema.state_dict()) == sorted(tied_ref.state_dict()),
        torch.equal(tied_ema(ids), tied_ref(ids)),
    )

    # A load that changes one rank's frozen shard only: that rank owns it, the other still
    # shares it, and skip_nonfinite's all-reduce runs on both (a rank that counted only
    # its owned pairs would skip it, and the other would wait in it).
    base = nn.Linear(8, 16).requires_grad_(False)
    from torch.distributed.fsdp import fully_shard

    fully_shard(base, mesh=mesh)
    lone = EMA(base, skip_nonfinite=True, **SHARE, **KW)
    lone.update()
    state = lone.state_dict()
    state["ema_model.weight"] = state["ema_model.weight"].clone()
    if rank == 0:
        with torch.no_grad():
            local_tensor(state["ema_model.weight"]).add_(1.0)
    lone.load_state_dict(state)
    loaded = torch.equal(
        local_tensor(lone.ema_model.weight), local_tensor(state["ema_model.weight"])
    )
    for _ in range(2):
        lone.update()
    res["one_rank_load"] = (shared(lone, base), loaded, lone.num_skipped_nonfinite)

    # PostHocEMA's snapshots read the shared shards: synthesis equals that of a plain twin.
    res["posthoc"] = posthoc_part(rank, out, mesh)

    # What FSDP2 does with a padded shard it is asked to adopt (why odd.* is not shared).
    probe = lora_like(mesh)
    local = local_tensor(net.odd.weight)
    adopted = adopt_shard(probe, probe.odd.weight, local)
    res["padded_adopt_aliases"] = local_tensor(adopted).data_ptr() == local.data_ptr()
    return res


def posthoc_part(rank: int, out: Path, mesh: Any) -> dict[str, float] | None:
    """The largest difference, per tensor, between a PostHocEMA of the sharded model (frozen
    shards shared) and one of a plain twin fed the gathered weights (rank 0)."""
    net = lora_like(mesh)
    torch.manual_seed(0)
    twin = LoRALike()
    twin.base.requires_grad_(False)
    twin.odd.requires_grad_(False)
    kw: dict[str, Any] = dict(
        sigma_rels=(0.05, 0.28), update_every=1, checkpoint_every_num_steps=3, **SHARE
    )
    ema = PostHocEMA(net, checkpoint_folder=out / "posthoc", **kw)
    ref = PostHocEMA(twin, checkpoint_folder=out / "posthoc-ref", **kw)
    opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.2)
    for i in range(9):
        train(net, opt, rank, i)
        twin.load_state_dict(gathered(net))
        ema.update()
        ref.update()
    got = gathered(ema.synthesize_ema_model(sigma_rel=0.1).ema_model)
    if rank:
        return None  # the plain twin's snapshots are rank 0's
    want = ref.synthesize_ema_model(sigma_rel=0.1).ema_model.state_dict()
    return {k: (got[k] - want[k]).abs().max().item() for k in want}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_ranks(worker, tmp_path_factory.mktemp("fsdp_frozen"), world=2, timeout_s=120)


def test_frozen_shards_are_shared_and_left_out_of_the_plan(results: list[dict]) -> None:
    for r in results:
        assert r["shared"] == SHARED == r["karras_shared"]
        assert r["bema_shared"] == (SHARED, r["plan"])
        assert r["multi_shared"] == [SHARED, SHARED]
        assert r["ref_shared"] == []
        assert r["plan"] == ["adapter.bias", "adapter.weight", "odd.bias", "odd.weight"]


def test_the_ema_costs_only_the_trained_and_padded_shards(results: list[dict]) -> None:
    for r in results:
        mine, copied = r["bytes"]
        assert mine == r["adapter_and_odd_bytes"]
        assert copied > mine  # the reference also holds this rank's base shards


def test_updates_forward_swap_and_state_equal_share_frozen_false(results: list[dict]) -> None:
    for r in results:
        assert r["after_updates"] and r["multi"] == [True, True] and r["keys"]
        for key in ("forward", "swap", "forward_unfrozen"):
            got, want = r[key]
            assert torch.equal(got, want), key
        same, still_shared = r["copied"]
        assert same and still_shared == SHARED


def test_unfreezing_unshares_and_averages_bit_for_bit(results: list[dict]) -> None:
    for r in results:
        same, still_shared = r["unfrozen"]
        assert same and still_shared == []
        assert r["base_moved"] and r["base_averaged"]


def test_loads_copy_on_write_and_never_write_into_the_model(results: list[dict]) -> None:
    for r in results:
        # a frozen value changed in place: the shared EMA refuses (before: took it at once)
        assert "written in place" in r["written_refused"], r["written_refused"]
        assert "share_frozen=False" in r["written_refused"]
        assert r["dcp_loaded"] and r["dcp_model_kept"]
        assert r["dcp_shared"] == ["base.bias"]  # the loaded base.weight differs: owned
        same, still_shared = r["equal_load"]
        assert same and still_shared == SHARED
        loaded, model_untouched, now_shared = r["changed_load"]
        assert loaded and model_untouched and now_shared == ["base.weight"]


def test_a_load_that_changes_one_ranks_shard_keeps_the_ranks_agreeing(
    results: list[dict],
) -> None:
    assert [r["one_rank_load"] for r in results] == [
        (["bias"], True, 0),
        (["bias", "weight"], True, 0),
    ]


def test_posthoc_snapshots_of_shared_shards_synthesize_as_a_plain_twin(
    results: list[dict],
) -> None:
    diffs = results[0]["posthoc"]
    assert set(diffs) == {
        f"{m}.{w}" for m in ("base", "odd", "adapter") for w in ("weight", "bias")
    }
    # Shared on both sides (base) the side files are read once with the summed weights:
    # exact. The padded ``odd`` is shared by the twin only (the sharded EMA averages it):
    # the same sum in another order, float32 rounding.
    assert all(v == 0.0 for k, v in diffs.items() if not k.startswith("odd.")), diffs
    assert max(diffs.values()) <= 1e-6, diffs


def test_tied_frozen_weights_are_shared_in_every_place(results: list[dict]) -> None:
    for r in results:
        assert r["tied"] == (["emb.weight"], True, True, True)


def test_a_padded_shard_is_copied_by_fsdp_so_it_is_owned(results: list[dict]) -> None:
    # 3 rows over 2 ranks: rank 0 holds 2 (unpadded), rank 1 holds 1 padded to 2.
    assert [r["padded_adopt_aliases"] for r in results] == [True, False]

"""The non-finite guard (``skip_nonfinite=True``): one flag on the device, the same on
every rank, and no host sync.

An update is skipped when any online weight holds NaN or Inf. The decision is a 0-dim
bool tensor that never leaves the device:

1. :func:`local_flag`: this process's online tensors are all finite. Their extremes
   (``torch._foreach_norm(..., inf)`` on an accelerator, ``torch.aminmax`` on the CPU: NaN
   and Inf propagate, finite values cannot overflow), stacked and reduced on the device.
2. :class:`Agreement`: for sharded (DTensor) models under ``torch.distributed``, each rank
   sees only its shards, so the flags are combined by **one all-reduce of three int64
   numbers** per update, ``max(bad, call, -call)``, on the process group the shards live
   on (the default group when their meshes cover every rank). Every rank then takes the
   same decision. The call number rides along: if the ranks' calls do not match (one rank
   called ``update()`` more often), the update is skipped everywhere rather than averaged
   from a mismatched flag, and :func:`emakit.distributed` saves report the disagreement.
   DDP and single processes need no agreement: every rank holds the same weights.
3. The kernels (:func:`~emakit._engine.kernels.guarded_lerp_`) select on the flag, so the
   host never reads it; the tracker adds ``not ok`` to a device counter that is read only
   when someone asks for the count.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .._dist.collectives import collective_device
from .._dist.deepspeed import is_partition
from .._dist.dtensor import dist_ready, is_dtensor
from .pairs import TensorPair

__all__ = ["Agreement", "local_flag"]


def local_flag(tensors: Sequence[Tensor]) -> Tensor | None:
    """Whether every tensor in ``tensors`` is free of NaN and Inf, as a 0-dim bool tensor
    on the first tensor's device (None when there is nothing that could be non-finite).

    Integer and empty tensors are left out (always finite; an empty one has no max).
    Exact (no overflow: the extremes are compared, nothing is summed). On an accelerator,
    one ``torch._foreach_norm(..., inf)`` per dtype; on the CPU, where that norm is not
    vectorized (about 15x slower), one ``torch.aminmax`` per tensor.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for t in tensors:
        if (t.is_floating_point() or t.is_complex()) and t.numel():
            if t.is_complex():
                t = torch.view_as_real(t)
            groups.setdefault((t.device, t.dtype), []).append(t)
    flag: Tensor | None = None
    for (device, _), ts in groups.items():
        if device.type == "cpu":
            extremes = [v for t in ts for v in torch.aminmax(t)]
        else:
            extremes = list(torch._foreach_norm(ts, float("inf")))
        f = torch.stack(extremes).isfinite().all()
        flag = f if flag is None else flag & f.to(flag.device, non_blocking=True)
    return flag


def _mesh_ranks(mesh: Any) -> tuple[int, ...]:
    return tuple(int(r) for r in mesh.mesh.flatten().tolist())


class Agreement:
    """How the ranks that hold ``pairs``' shards combine their flags, or None (see
    :meth:`build`).

    Attributes:
        groups: the process groups to all-reduce over, in order (``[None]``: the default
            group, one all-reduce).
        device: where the all-reduced tensor lives (CPU for gloo, the current CUDA device
            for NCCL meshes).
    """

    def __init__(self, groups: list[Any], device: torch.device) -> None:
        self.groups = groups
        self.device = device

    @classmethod
    def build(cls, pairs: Sequence[TensorPair]) -> Agreement | None:
        """The agreement for ``pairs``: None unless some online tensor is a DTensor or a
        DeepSpeed ZeRO-3 partition and a default process group exists.

        One all-reduce on the default group when the meshes of the DTensors cover every
        rank (FSDP, HSDP, FSDP+TP on the whole job), and for ZeRO-3 partitions (cut over
        the data-parallel ranks); otherwise one per dimension of each distinct mesh (e.g.
        FSDP on one pipeline stage's ranks).
        """
        if not dist_ready():
            return None
        meshes: dict[tuple, Any] = {}
        for p in pairs:
            if is_dtensor(p.online):
                mesh = p.online.device_mesh  # type: ignore[attr-defined]
                key = (mesh.device_type, _mesh_ranks(mesh), tuple(mesh.mesh.shape))
                meshes.setdefault(key, mesh)
        if not meshes:
            if any(is_partition(p.online) for p in pairs):
                return cls([None], collective_device())
            return None
        first = next(iter(meshes.values()))
        if first.device_type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device(first.device_type)
        covered = {r for key in meshes for r in key[1]}
        if len(covered) == torch.distributed.get_world_size():
            return cls([None], device)
        groups = [m.get_group(d) for _, m in sorted(meshes.items()) for d in range(m.ndim)]
        return cls(groups, device)

    def combine(self, flag: Tensor | None, call: int) -> Tensor:
        """``flag`` of this rank combined with every other rank's (all-reduce): true only if
        every rank's flag is true and every rank is at the same ``call``."""
        dist = torch.distributed
        vec = torch.full((3,), call, dtype=torch.int64, device=self.device)  # no host copy
        vec[2].neg_()
        if flag is None:  # nothing here can be non-finite (e.g. every local shard empty)
            vec[0].zero_()
        else:
            vec[0].copy_(flag.logical_not(), non_blocking=True)
        for group in self.groups:
            # async: NCCL orders it on the stream, the host never waits for the value
            dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group, async_op=True).wait()
        return (vec[0] == 0) & (vec[1] + vec[2] == 0)

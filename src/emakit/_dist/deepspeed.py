"""DeepSpeed engines and ZeRO-3 partitions, without importing deepspeed (a leaf module).

``EMA(engine)`` tracks ``engine.module`` (`unwrap_engine()`). Under ZeRO-1 and 2 the
module's parameters are whole on every rank, so the EMA is an ordinary one, identical on
every rank. Under ZeRO-3 a parameter's ``.data`` is an empty placeholder and
``param.ds_tensor`` holds this rank's partition: a 1-D slice of the flattened parameter,
padded so that every rank's partition has the same length. Then

* the EMA tracks the partitions (`partition_tensors()`): each rank averages its own,
  with no collective; its EMA copy is a `ZeroPartitions`, a module tree of the
  model's names holding the partitions (its ``state_dict`` is this rank's part);
* `PartitionSwap` lets DeepSpeed's own gather do the evaluation: gathered
  parameters are released, the EMA partitions are copied into ``ds_tensor`` (by the
  caller), and the next forward gathers them; on exit the same dance puts the online
  partitions back, bit for bit;
* [`ZeroPartitions.full()`][emakit._dist.deepspeed.ZeroPartitions.full] assembles one full
  tensor from every rank's partitions (`gather_padded()`, for the streamed full export).

DeepSpeed's classes are looked up in ``sys.modules`` under their import paths; nothing
here imports deepspeed. The attributes read (``ds_tensor``, ``ds_shape``, ``ds_numel``,
``ds_status``, ``ds_process_group``, ``partition()``, ``all_gather()``) are those of
DeepSpeed's ZeRO-3 parameters (``deepspeed.runtime.zero.partition_parameters``);
``tests/test_deepspeed.py`` runs them against the real package.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, cast

import torch
from torch import Tensor, nn

from ..errors import EMAStateError
from .collectives import agree_on, gather_padded

#: The key `ZeroPartitions` adds to its state: ``[world size, rank]`` its
#: partitions were cut for.
WORLD_KEY = "partition_layout"


def unwrap_engine(model: Any) -> Any:
    """``engine.module`` for a DeepSpeed engine (the module that holds the weights; the
    class ``deepspeed.runtime.engine.DeepSpeedEngine`` is looked up, never imported)."""
    cls = getattr(sys.modules.get("deepspeed.runtime.engine"), "DeepSpeedEngine", None)
    if cls is not None and isinstance(model, cls):
        return getattr(model, "module")  # noqa: B009 (isinstance narrowed it to object)
    return model


def is_zero3_param(t: object) -> bool:
    """Whether ``t`` is a ZeRO-3 parameter (its values live in ``t.ds_tensor``)."""
    return getattr(t, "ds_tensor", None) is not None and hasattr(t, "ds_shape")


def is_partition(t: object) -> bool:
    """Whether ``t`` is the tracked view of a partition (see `partition()`)."""
    return slot_of(t) is not None


def zero3_params(model: object) -> list[Tensor]:
    """The ZeRO-3 parameters of ``model`` (``[]`` for any other model)."""
    if not isinstance(model, nn.Module) or "deepspeed" not in sys.modules:
        return []
    return [p for p in model.parameters() if is_zero3_param(p)]


def partition_tensors(
    tensors: dict[str, Tensor], slots: dict[str, Any], *, replicated: bool = False
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """``tensors`` with every ZeRO-3 parameter replaced by its partition, and with
    ``replicated`` every other parameter too by this rank's slice (`partition()`).

    A partition's slot is its `PartitionSlot`, so the plan sees DeepSpeed replace or
    move a partition (or ``.data`` re-pointed) and pairs again.
    """
    if not replicated and (
        "deepspeed" not in sys.modules or not any(map(is_zero3_param, tensors.values()))
    ):
        return tensors, slots
    out, out_slots = dict(tensors), dict(slots)
    for name, t in tensors.items():
        if is_zero3_param(t) or (replicated and _sliceable(t)):
            slot = partition(t)
            out[name] = slot.view
            out_slots[name] = (slot, name, slots[name][2] if name in slots else 0)
    return out, out_slots


def _sliceable(t: Tensor) -> bool:
    """A parameter ``partition=True`` slices: contiguous (its slices are views), not a
    ZeRO-3 one. Buffers stay whole."""
    return isinstance(t, nn.Parameter) and t.is_contiguous() and not is_zero3_param(t)


def own_span(rank: int, size: int, numel: int) -> tuple[int, int]:
    """``(start, length)`` of rank ``rank``'s elements of a flattened tensor of ``numel``
    elements cut into partitions of ``size`` (DeepSpeed's layout: rank ``r`` holds
    ``[r * size, (r + 1) * size)``, the last ranks' padding left out; ``length`` may be 0)."""
    start = min(rank * size, numel)
    return start, max(0, min(size, numel - start))


def _rank_world(group: Any) -> tuple[int, int]:
    dist = torch.distributed
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class PartitionSlot:
    """A parameter's partition as the EMA tracks it.

    Under ZeRO-3 the first ``valid`` elements of ``ds_tensor`` (DeepSpeed pads the last
    ranks' partitions; the padding is never averaged, checked for NaN or exported). For a
    replicated parameter (``EMA(partition=True)``), the same split of its own flattened
    data: chunk ``rank`` of ``ceil(numel / world)`` elements.

    It stands in the plan's identity guards for the registry a plain tensor is watched in
    (`emakit._engine.guards`): ``get()`` returns the view while the sliced tensor is
    the same object at the same address, else None (the plan pairs again).

    Attributes:
        param: the parameter.
        size: the padded partition length (every rank's).
        view: this rank's elements, a view.
    """

    __slots__ = ("__weakref__", "param", "part", "ptr", "size", "view")

    def __init__(self, param: Tensor) -> None:
        zero3 = is_zero3_param(param)
        group = getattr(param, "ds_process_group", None) if zero3 else None
        rank, world = _rank_world(group)
        numel = param.ds_numel if zero3 else param.numel()  # type: ignore[attr-defined]
        part = param.ds_tensor if zero3 else param  # type: ignore[attr-defined]
        self.size = part.numel() if zero3 else -(-numel // world)
        start, valid = own_span(rank, self.size, numel)
        self.param, self.part, self.ptr = param, part, part.data_ptr()
        self.view = part.detach().view(-1).narrow(0, 0 if zero3 else start, valid)

    def get(self, key: str, default: object = None) -> object:
        """The view while the partition has not moved, else ``default``."""
        p = self.param
        part = p.ds_tensor if is_zero3_param(p) else p  # type: ignore[attr-defined]
        if part is self.part and part.data_ptr() == self.ptr:
            return self.view
        return default


#: The current PartitionSlot of each partitioned parameter (the same view object for every
#: pairing, so an unchanged model keeps its plan). Keyed by id: weak containers compare
#: tensors with ``==``, which is elementwise.
_SLOTS: dict[int, tuple[weakref.ref[Tensor], PartitionSlot]] = {}
_VIEWS: dict[int, tuple[weakref.ref[Tensor], PartitionSlot]] = {}


def _drop(table: dict[int, Any], key: int, _: object) -> None:
    """The weakref callback that forgets a dead tensor's entry."""
    table.pop(key, None)


def partition(param: Tensor) -> PartitionSlot:
    """The `PartitionSlot` of a parameter (made again if it moved)."""
    entry = _SLOTS.get(id(param))
    if entry is not None and entry[0]() is param and entry[1].get("") is not None:
        return entry[1]
    slot = PartitionSlot(param)
    # the callbacks hold their table (at interpreter exit, module globals may be None)
    for table, t in ((_SLOTS, param), (_VIEWS, slot.view)):
        table[id(t)] = (weakref.ref(t, partial(_drop, table, id(t))), slot)
    return slot


def slot_of(t: object) -> PartitionSlot | None:
    """The `PartitionSlot` whose view ``t`` is, or None."""
    entry = _VIEWS.get(id(t))
    return entry[1] if entry is not None and entry[0]() is t else None


class ZeroPartitions(nn.Module):
    """The EMA copy of a ZeRO-3 model (or with ``partition=True``) on one rank: the model's
    names, this rank's partitions.

    Submodules are plain ``nn.Module`` containers (it has no forward: ``ema(x)`` and
    ``ema.swap()`` run the online model on the EMA partitions). Each partitioned parameter
    is a 1-D parameter of its partition's length; buffers and parameters that are not
    partitioned have their own shapes. Its state adds ``partition_layout``
    (``[world size, rank]``), so that a state saved on another number of ranks, or another
    rank's state, is refused by name.

    Attributes:
        model_class: the online model's class name (for the export's header).
        shapes: ``name -> (full shape, numel, process group, padded partition size)`` of
            each partition.
        world_size: the number of ranks the partitions were cut for.
        rank: the rank whose partitions these are.
    """

    def __init__(self, model_class: str, world_size: int, rank: int) -> None:
        super().__init__()
        self.model_class = model_class
        self.shapes: dict[str, tuple[torch.Size, int, Any, int]] = {}
        self.world_size = world_size
        self.rank = rank

    def layout_tensor(self) -> Tensor:
        """``[world size, rank]``, as the state holds it."""
        return torch.tensor([self.world_size, self.rank])

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + WORLD_KEY] = self.layout_tensor()

    def _load_from_state_dict(
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: dict,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        if prefix + WORLD_KEY in unexpected_keys:  # checked by refuse_other_world()
            unexpected_keys.remove(prefix + WORLD_KEY)

    def agree(self, tracker: Any) -> None:
        """Every rank's EMA at the same step and skip count before a state is taken (one
        bounded all-gather, `agree_on()`): the ranks' states
        are the parts of one, as DeepSpeed's ``save_checkpoint`` saves them together.

        Raises:
            EMAStateError: the ranks' steps or skip counts differ (on every rank).
            EMARuntimeError: some ranks did not take their state within the timeout.
        """
        if torch.distributed.is_initialized():
            tracker.sync_views()
            agree_on("state_dict of a ZeRO-3 EMA", tracker)

    def agree_to_load(self, tracker: Any, failure: Exception | None) -> None:
        """Every rank loads its state, or every rank raises: one bounded all-gather of each
        rank's verdict on its own state (`agree_on()`), under ``torch.distributed``.

        Raises:
            Exception: ``failure`` (this rank's own refusal), on a rank that refused.
            EMAStateError: on the other ranks when some refused, naming them.
        """
        if torch.distributed.is_initialized():
            verdict = "loads" if failure is None else f"refused ({type(failure).__name__})"
            try:
                agree_on(
                    "load_state_dict of a partitioned EMA",
                    tracker,
                    check_counts=False,
                    settings={"the state check (each rank loads its own state)": verdict},
                )
            except EMAStateError:
                if failure is None:
                    raise
        if failure is not None:
            raise failure

    def refuse_other_world(self, state_dict: Mapping[str, Any], prefix: str) -> None:
        """Raise unless ``state_dict`` holds this rank's partitions for this world size.

        Raises:
            EMAStateError: saved on another number of ranks, by another rank, or not by a
                partitioned EMA; the message says what to use instead.
        """
        saved = state_dict.get(prefix + WORLD_KEY)
        layout = saved.tolist() if isinstance(saved, Tensor) and saved.numel() == 2 else None
        if layout == [self.world_size, self.rank]:
            return
        full = (
            "export the full EMA on the old job with emakit.save_ema_weights(ema, path) and "
            "start this EMA from that file with emakit.load_ema_weights(ema, path) (any world "
            "size; on every rank, as their older names save_full_ema_weights and "
            "load_full_ema_weights)"
        )
        if layout is not None and layout[0] == self.world_size:
            raise EMAStateError(
                f"the state holds rank {layout[1]}'s EMA partitions, and this is rank "
                f"{self.rank}: load each rank's own state (DeepSpeed's save_checkpoint keeps "
                f"every rank's client_state under ZeRO-3 only; under ZeRO-1/2 save each "
                f"rank's with torch.save), or {full}"
            )
        what = (
            f"partitions of {layout[0]} ranks"
            if layout is not None
            else "no partitions (it was not saved by a partitioned EMA)"
        )
        raise EMAStateError(
            f"this EMA holds partitions of {self.world_size} ranks (DeepSpeed ZeRO-3 or "
            f"partition=True), and the state holds {what}: a per-rank EMA state loads "
            f"only on the same number of ranks; to change the world size, {full}"
        )

    def layout(self) -> dict[str, Tensor]:
        """Every tensor of the full EMA as a meta tensor of its full shape and dtype."""
        out = {}
        for name, t in self.state_dict().items():
            if name == WORLD_KEY:
                continue
            shape = self.shapes[name][0] if name in self.shapes else t.shape
            out[name] = torch.empty(shape, dtype=t.dtype, device="meta")
        return out

    def span(self, name: str) -> tuple[int, int] | None:
        """``(start, length)`` of this rank's partition of ``name`` in the flattened full
        tensor (`own_span()`), or None for a tensor that is not partitioned (a buffer)."""
        if name not in self.shapes:
            return None
        _, numel, group, size = self.shapes[name]
        return own_span(_rank_world(group)[0], size, numel)

    def own_part(self, name: str, full: Tensor) -> Tensor:
        """This rank's partition of the full tensor ``full`` of ``name`` (``full`` itself
        for a tensor DeepSpeed does not partition, or of another size, which the caller's
        shape check names)."""
        span = self.span(name)
        if span is None or full.numel() != self.shapes[name][1]:
            return full
        return full.reshape(-1).narrow(0, *span)

    def full(self, name: str, dtype: torch.dtype | None) -> Tensor:
        """The full EMA tensor ``name`` on every rank (a collective for a partition: every
        rank calls it, in the same order), floating values cast to ``dtype`` before the
        gather."""
        return cast(Tensor, self.gathered(name, dtype, to_writer=False))

    def gathered(self, name: str, dtype: torch.dtype | None, *, to_writer: bool) -> Tensor | None:
        """`full()`, or with ``to_writer`` the full tensor gathered to rank 0 alone (None on
        the other ranks of its group, and on the ranks of groups without rank 0), as the
        streamed export wants it."""
        if name not in self.shapes:
            return self.state_dict()[name]
        shape, numel, group, size = self.shapes[name]
        local = self.get_parameter(name).detach()
        if dtype is not None and local.is_floating_point():
            local = local.to(dtype)
        dist = torch.distributed
        if not dist.is_initialized():  # one process: the partition is the whole tensor
            return local[:numel].view(shape)
        # the default group by name: torch < 2.7 refuses None here (``KeyError: None``)
        if to_writer and 0 not in dist.get_process_group_ranks(group or dist.group.WORLD):
            return None  # another replica of the partitions: rank 0's group sends them
        out = gather_padded(local, size, group, to_writer=to_writer)
        return None if out is None else out[:numel].view(shape)


def build_partitions(
    model: nn.Module,
    *,
    tracked: Callable[[str], bool],
    dtype_for: Callable[[Tensor], torch.dtype | None],
    replicated: bool = False,
) -> ZeroPartitions:
    """The `ZeroPartitions` of a ZeRO-3 ``model`` (with ``replicated``, of any model,
    every parameter sliced), with empty placeholders for the tracked tensors (laid out from
    the partitions by the caller)."""
    rank, world = _rank_world(None)
    root = ZeroPartitions(type(model).__name__, world, rank)
    copies: dict[str, nn.Module] = {"": root}
    for name, module in model.named_modules():
        if name:
            parent, _, leaf = name.rpartition(".")
            copies[name] = nn.Module()
            copies[parent].add_module(leaf, copies[name])
        copy = copies[name]
        for key, p in module._parameters.items():
            full = f"{name}.{key}" if name else key
            if p is None or not tracked(full):
                continue
            parted = is_zero3_param(p) or (replicated and _sliceable(p))
            value = partition(p).view if parted else p
            dtype = dtype_for(value) or value.dtype
            placeholder = torch.empty(0, dtype=dtype, device=value.device)
            copy.register_parameter(key, nn.Parameter(placeholder, requires_grad=False))
            if parted:
                group = getattr(p, "ds_process_group", None)
                shape = getattr(p, "ds_shape", p.shape)
                numel = getattr(p, "ds_numel", p.numel())
                root.shapes[full] = (shape, numel, group, partition(p).size)
        for key, b in module._buffers.items():
            full = f"{name}.{key}" if name else key
            if b is not None and tracked(full):
                copy.register_buffer(key, torch.empty(0, dtype=b.dtype, device=b.device))
    return root


class PartitionSwap:
    """What a swap does around its in-place copies into partitions.

    * ZeRO-3: DeepSpeed gathers a parameter from the partitions before the forward of the
      module that uses it, and frees it after, except *persistent* parameters (small ones,
      kept gathered for the whole run). `release()` frees every gathered parameter (no
      collective), so the next forward gathers the partitions as they are then;
      `restore()` gathers the persistent ones again (one collective).
    * ``partition=True`` (replicated parameters): each rank copies only its slice, so
      `spread()` all-gathers every sliced parameter from the ranks' slices (one
      collective per parameter), on entry (the EMA everywhere) and on exit (the online
      weights back, bit for bit).

    Args:
        params: the model's ZeRO-3 parameters.
        pairs: the EMA's pairs (their partition views name the sliced parameters).
    """

    def __init__(self, params: list[Tensor], pairs: Sequence[Any]) -> None:
        self.params = params
        slots = (slot_of(p.online) for p in pairs)
        self.sliced = [s for s in slots if s is not None and not is_zero3_param(s.param)]
        self.gathered: list[Tensor] = []

    @property
    def active(self) -> bool:
        """Whether there is anything to do (copies must then be in place)."""
        return bool(self.params or self.sliced)

    def release(self) -> None:
        """Free the gathered ZeRO-3 parameters (remembering them the first time)."""
        available = [p for p in self.params if _available(p)]
        if not self.gathered:
            self.gathered = available
        for p in available:
            p.partition(has_been_updated=False)  # type: ignore[attr-defined]

    def restore(self) -> None:
        """Gather again the parameters that were gathered before `release()`."""
        gathered, self.gathered = self.gathered, []
        if gathered:
            gathered[0].all_gather(param_list=gathered)  # type: ignore[attr-defined]

    def spread(self) -> None:
        """Every sliced parameter whole again from the ranks' slices (a collective)."""
        if not torch.distributed.is_initialized():
            return  # one process: each slice is its whole parameter
        with torch.no_grad():
            for s in self.sliced:
                p = s.param.detach().view(-1)
                p.copy_(cast(Tensor, gather_padded(s.view, s.size))[: p.numel()])


def _available(p: Tensor) -> bool:
    """Whether DeepSpeed holds ``p`` gathered (``ZeroParamStatus.AVAILABLE``)."""
    status = getattr(p, "ds_status", None)
    return getattr(status, "name", None) == "AVAILABLE"

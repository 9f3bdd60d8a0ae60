"""Pytrees (a tensor, or nested dicts/lists/tuples of tensors) as EMA sources.

Leaves are named by their path (``"a.0.b"`` for ``{"a": [{"b": t}]}``); a lone tensor is
``"leaf"``. Non-tensor leaves are left alone.
"""

from __future__ import annotations

from copy import deepcopy
from typing import Any

from torch import Tensor, nn
from torch.utils import _pytree as tree_utils


def _key_name(path: tuple[Any, ...]) -> str:
    # torch's path entries: MappingKey.key, SequenceKey.idx, GetAttrKey.name
    parts = (getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path)
    return ".".join(map(str, parts)) or "leaf"


def leaves(tree: Any) -> dict[str, Tensor]:
    """The tensor leaves of ``tree`` by path."""
    flat, _ = tree_utils.tree_flatten_with_path(tree)
    return {_key_name(path): leaf for path, leaf in flat if isinstance(leaf, Tensor)}


def tree_copy(tree: Any) -> Any:
    """A deep copy of ``tree`` whose tensors are detached clones."""
    return tree_utils.tree_map(
        lambda x: x.detach().clone() if isinstance(x, Tensor) else deepcopy(x), tree
    )


def named_tensors(model: Any) -> dict[str, Tensor]:
    """A module's parameters and buffers, or a pytree's leaves, by name."""
    if isinstance(model, nn.Module):
        return dict((*model.named_parameters(), *model.named_buffers()))
    return leaves(model)


def all_tensors(model: Any) -> list[Tensor]:
    """A module's parameters and buffers, or a pytree's leaves."""
    return list(named_tensors(model).values())

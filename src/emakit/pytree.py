"""``EMAPytree``: an EMA of a tensor, or of a nested dict/list/tuple of tensors."""

from __future__ import annotations

from collections.abc import Callable
from copy import deepcopy
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as tree_utils

from .ema import _EMABase
from .engine import TensorPair
from .engine.flat import rehome_
from .errors import EMAStateError, EMATypeError

__all__ = ["EMAPytree", "EMATensor"]


def _key_name(path: tuple[Any, ...]) -> str:
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return ".".join(parts) or "leaf"


def _leaves(tree: Any) -> dict[str, Tensor]:
    flat, _ = tree_utils.tree_flatten_with_path(tree)
    return {_key_name(path): leaf for path, leaf in flat if isinstance(leaf, Tensor)}


class EMAPytree(_EMABase):
    """An EMA of a tensor or of a nested dict/list/tuple of tensors (a pytree).

    The same update rules as :class:`~emakit.EMA` (``update_after_step``,
    ``update_every``, warm-up, ``beta == 1`` frozen). Floating leaves are averaged,
    integer and bool leaves copied, non-tensor leaves left alone. Leaves are paired by
    their path (``"a.0.b"`` for ``{"a": [{"b": t}]}``), and the EMA leaves are saved in
    :meth:`state_dict` under ``ema.<path>``.

    The online leaves are bound when the EMA is built, as an optimizer binds its
    parameters: update them in place (``optimizer.step()``, ``copy_``, ``mul_`` ...).

    Args:
        pytree: the online tensor or nested container of tensors.
        ema_pytree: a container with the same structure to hold the EMA, or a
            zero-argument factory. Default None: a copy of ``pytree``.
        beta, update_after_step, update_every, inv_gamma, power, min_value,
        allow_different_devices, coerce_dtype, use_foreach, ema_dtype, schedule:
            as for :class:`~emakit.EMA`.

    Example:
        >>> w = torch.zeros(3)
        >>> ema = EMAPytree(w, update_after_step=0, update_every=1, schedule=lambda t: 0.5)
        >>> ema.update(); _ = w.fill_(1.0); ema.update()
        >>> ema.ema_pytree
        tensor([0.5000, 0.5000, 0.5000])
    """

    def __init__(
        self,
        pytree: Any,
        ema_pytree: Any | Callable[[], Any] | None = None,
        beta: float = 0.9999,
        update_after_step: int = 100,
        update_every: int = 10,
        inv_gamma: float = 1.0,
        power: float = 2 / 3,
        min_value: float = 0.0,
        allow_different_devices: bool = False,
        coerce_dtype: bool = False,
        *,
        use_foreach: bool | None = None,
        ema_dtype: torch.dtype | None = None,
        schedule: Callable[[int], float] | None = None,
    ) -> None:
        super().__init__()
        self._configure(
            beta=beta,
            update_after_step=update_after_step,
            update_every=update_every,
            inv_gamma=inv_gamma,
            power=power,
            min_value=min_value,
            allow_different_devices=allow_different_devices,
            use_foreach=use_foreach,
            coerce_dtype=coerce_dtype,
            ema_dtype=ema_dtype,
            schedule=schedule,
        )
        online = _leaves(pytree)
        if not online:
            raise EMATypeError(
                f"pytree must be a tensor or a nested dict/list/tuple holding tensors, got {type(pytree).__name__}"
            )
        self._online = [pytree]
        if ema_pytree is None:
            ema_pytree = pytree_copy(pytree)
        elif callable(ema_pytree) and not isinstance(ema_pytree, (Tensor, nn.Module)):
            ema_pytree = ema_pytree()
        self.ema_pytree = ema_pytree
        pairs = self._pairs()
        rehome_(
            [p.shadow for p in pairs],
            dtype_for=[
                torch.promote_types(p.shadow.dtype, ema_dtype)
                if (ema_dtype is not None and p.shadow.is_floating_point())
                else None
                for p in pairs
            ],
        )

    @property
    def pytree(self) -> Any:
        """The online pytree."""
        return self._online[0]

    @property
    def ema_model(self) -> Any:
        """The EMA pytree (ema-pytorch's name for it)."""
        return self.ema_pytree

    def _pairs(self) -> list[TensorPair]:
        online, shadow = _leaves(self.pytree), _leaves(self.ema_pytree)
        missing, extra = (
            sorted(online.keys() - shadow.keys()),
            sorted(shadow.keys() - online.keys()),
        )
        if missing or extra:
            raise EMAStateError(
                f"ema_pytree does not match pytree by path: missing {missing[:10]}, extra {extra[:10]}"
            )
        pairs = []
        for name, o in online.items():
            s = shadow[name]
            if s.shape != o.shape:
                raise EMAStateError(
                    f"leaf {name!r} has shape {tuple(s.shape)} in the EMA but {tuple(o.shape)} online"
                )
            if s.device != o.device and not self.allow_different_devices:
                raise EMAStateError(
                    f"leaf {name!r} is on {s.device} in the EMA but on {o.device} online; "
                    f"pass allow_different_devices=True"
                )
            if s.dtype != o.dtype and not (self.coerce_dtype or self.ema_dtype is not None):
                raise EMAStateError(
                    f"leaf {name!r} is {s.dtype} in the EMA but {o.dtype} online; pass coerce_dtype=True"
                )
            pairs.append(TensorPair(name, s, o, o.is_floating_point() or o.is_complex()))
        return pairs

    def copy_params_from_pytree_to_ema(self) -> None:
        """Copy every online leaf into the EMA (ema-pytorch's name)."""
        self.copy_params_from_model_to_ema()

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """``{"version", "step", "initted", "ema.<path>": tensor, ...}`` (see :class:`EMA`)."""
        return super().state_dict(*args, **kwargs)

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name, t in _leaves(self.ema_pytree).items():
            destination[prefix + "ema." + name] = t if keep_vars else t.detach()

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ) -> None:  # type: ignore[no-untyped-def]
        before = len(unexpected_keys)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        leaves = _leaves(self.ema_pytree)
        with torch.no_grad():
            for name, t in leaves.items():
                key = prefix + "ema." + name
                if key in state_dict:
                    value = state_dict[key]
                    if value.shape != t.shape:
                        error_msgs.append(
                            f"size mismatch for {key}: {tuple(value.shape)} vs {tuple(t.shape)}"
                        )
                    else:
                        t.copy_(value)
                elif strict:
                    missing_keys.append(key)
        unexpected_keys[before:] = [
            k for k in unexpected_keys[before:] if not k.startswith(prefix + "ema.")
        ]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Call the EMA pytree if it is callable, else return it."""
        if callable(self.ema_pytree) and not isinstance(self.ema_pytree, Tensor):
            with torch.no_grad():
                return self.ema_pytree(*args, **kwargs)
        return self.ema_pytree


def pytree_copy(tree: Any) -> Any:
    """A deep copy of ``tree`` whose tensors are detached clones."""
    return tree_utils.tree_map(
        lambda x: x.detach().clone() if isinstance(x, Tensor) else deepcopy(x), tree
    )


EMATensor = EMAPytree

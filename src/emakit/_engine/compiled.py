"""The opt-in compiled update (``compile_update=True``): cast and lerp in one fused pass.

Eager torch averages an fp32 shadow of a bf16 model in two kernels per window: a cast
into a small buffer, then ``lerp_`` from it (`emakit._engine.paths.cast_rounds`). Inductor
fuses ``shadow.lerp_(online.to(shadow.dtype), w)`` into one loop that reads each weight
once and reads and writes the shadow once: for a bf16 model with an fp32 shadow, 2 + 4 + 4
= 10 bytes per element, the floor.

`CompiledLerp` compiles one function per group (one decay group, device and dtype pair),
traced over the group's whole list of pairs, so one call per update runs every pair.

* **No recompile per decay.** The lerp weight is a 0-dim tensor of the computation dtype on
  its device, filled before each call: a new decay value is new data, not a new constant.
* **One compiled copy per group.** torch keeps the compiled versions of a function with
  its code object, at most ``torch._dynamo.config.cache_size_limit`` of them (8 by
  default), and falls back to eager past that. Each `CompiledLerp` compiles its own copy
  of the code, so any number of EMAs in one process keep theirs without touching torch's
  global settings.
* **Compiled lazily.** The first averaging update compiles (about 10 s cold for a small
  model on a CPU, 3.5-4.2 s for GPT-2 124M's 148 tensors with Inductor's disk cache warm,
  BENCHMARKS.md). A compile failure raises
  [`EMARuntimeError`][emakit.errors.EMARuntimeError] naming the option, with torch's reason.
* **Bit-identical to eager ``lerp_``** (the reference loop, ema-pytorch's
  ``shadow.lerp_(online.to(shadow.dtype), w)``): the function computes what torch's
  ``lerp_`` kernels compute, in the same precision and order. With ``c = w`` and
  ``b = d`` where ``|w| < 0.5``, else ``c = w - 1`` and ``b = s`` (``s`` cast to the
  computation dtype), ``d <- fma(c, s - d, b)``: one rounding of the product and sum, as
  the eager CPU kernel's fused multiply-add (and, expected, the CUDA kernel's contracted
  one: ``benchmarks/gpu_check.py`` compares the bits on a GPU, not yet run). The
  computation dtype is the shadow's, widened to float32 (bf16 and fp16 shadows computed in
  float32 and rounded once, as eager). Inductor's C++ compile is asked to contract
  ``b + c * (s - d)`` into that fused multiply-add for this function only
  (`FMA_OPTIONS`); its default (no contraction) rounds twice, up to 1 ulp away.

Pairs whose shadow lives on another device than the online tensor, and the copied
(never averaged) pairs, take the eager path.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import FunctionType
from typing import Any

import torch
from torch import Tensor

from .._dist.dtensor import torch_version
from ..errors import EMARuntimeError

#: The oldest torch ``compile_update=True`` accepts. torch 2.4's Inductor turns on
#: flush-to-zero for the whole process when it loads a compiled CPU kernel (denormals read
#: and computed as zero everywhere after, a process-wide side effect); 2.9 and newer do
#: not (checked on 2.9.1, 2.13 and 2.14.1; 2.5-2.8 not checked, so refused too).
COMPILE_MIN_TORCH = (2, 9)


def refusal() -> str | None:
    """Why ``compile_update=True`` cannot run on this torch, or None."""
    if torch_version() < COMPILE_MIN_TORCH:
        return (
            f"compile_update=True needs torch >= {'.'.join(map(str, COMPILE_MIN_TORCH))} "
            f"(got {torch.__version__}: older Inductor turns on flush-to-zero for the whole "
            f"process when it loads a CPU kernel); upgrade torch or pass compile_update=False"
        )
    return None


#: Inductor's per-compile option that lets its C++ compiler contract ``b + c * x`` into one
#: fused multiply-add (``"off"`` by default; a string in torch 2.9 and later). A torch
#: without it refuses the option: `CompiledLerp` then raises, naming it.
FMA_OPTIONS: dict[str, Any] = {"cpp.enable_floating_point_contract_flag": "fast"}


def _lerp_each(dsts: list[Tensor], srcs: list[Tensor], weight: Tensor) -> None:
    # torch's lerp kernels, pair by pair, with start = shadow and end = online weight:
    # fma(w, end - start, start) for |w| < 0.5, else fma(w - 1, end - start, end), in the
    # weight's (computation) dtype, rounded once to the shadow's
    small = weight.abs() < 0.5
    coeff = torch.where(small, weight, weight - 1)
    for d, s in zip(dsts, srcs):  # noqa: B905 - traced: the lists match by construction
        start, end = d.to(weight.dtype), s.to(weight.dtype)
        d.copy_(torch.where(small, start, end) + coeff * (end - start))


class CompiledLerp:
    """``dst.lerp_(src.to(dst.dtype), w)`` for every pair of one group, bit for bit, as one
    compiled function (see the module docstring).

    Args:
        dsts: the shadow tensors, updated in place.
        srcs: the online tensors, on the same device, any floating dtype.
    """

    def __init__(self, dsts: Sequence[Tensor], srcs: Sequence[Tensor]) -> None:
        self.dsts = list(dsts)
        self.srcs = list(srcs)
        ref = self.dsts[0]
        # the computation dtype: the shadow's, widened to float32 (torch's opmath type)
        op = torch.promote_types(ref.dtype, torch.float32)
        self.weight = torch.zeros((), dtype=op, device=ref.device)
        code = _lerp_each.__code__
        own = FunctionType(code.replace(), _lerp_each.__globals__, code.co_name)
        try:
            self.fn = torch.compile(own, fullgraph=True, dynamic=False, options=FMA_OPTIONS)
        except RuntimeError as e:  # an option this torch's Inductor does not know
            raise EMARuntimeError(
                f"compile_update=True needs Inductor's options {FMA_OPTIONS} for the bits of "
                f"eager lerp_ ({e}); pass compile_update=False for the eager update"
            ) from e
        self.compiled = False

    def __call__(self, weight: float) -> None:
        """Average every pair with lerp weight ``weight`` (``1 - decay``)."""
        self.weight.fill_(weight)
        if self.compiled:
            self.fn(self.dsts, self.srcs, self.weight)
            return
        try:
            self.fn(self.dsts, self.srcs, self.weight)
        except Exception as e:  # torch's compile errors have no common base class
            raise EMARuntimeError(
                f"compile_update=True could not compile the fused update of "
                f"{len(self.dsts)} tensors ({type(e).__name__}: {e}); pass "
                f"compile_update=False for the eager update"
            ) from e
        self.compiled = True

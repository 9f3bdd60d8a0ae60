"""Host memory while an EMA's weights file is written: emakit's streamed writer vs safetensors'.

Usage::

    python benchmarks/bench_weights_file.py [--mib 512] [--json OUT]

An ``EMA`` of a stack of ``Linear(1024, 1024)`` layers holding ``--mib`` MiB of float32
weights (its shadow: views into one flat buffer) is saved once per case:

* ``streamed``: ``emakit.save_ema_weights`` (`emakit._files.safetensors_file.write_safetensors`:
  one tensor cast and written at a time);
* ``save_file``: ``safetensors.torch.save_file`` of the EMA's state dict, after the clone it
  needs (it refuses tensors that share storage), cast first for bfloat16;

each with ``dtype=None`` (float32) and ``dtype=torch.bfloat16``. Each case runs in a fresh
process started with ``MALLOC_MMAP_THRESHOLD_=131072`` (every block over 128 KiB is its
own mapping, unmapped when freed), and "peak" is the RSS high-water mark (``VmHWM``, reset
through ``/proc/self/clear_refs`` right before the save) minus the RSS before it. Linux
only. This file is a script, not part of the test suite; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MIB = 1024 * 1024


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def _case(case: str, dtype_name: str, mib: int) -> dict:
    import safetensors.torch
    import torch

    from emakit import EMA, save_ema_weights

    torch.set_num_threads(1)
    layers = max(1, mib * MIB // (4 * 1024 * 1024))
    ema = EMA(
        torch.nn.Sequential(*(torch.nn.Linear(1024, 1024, bias=False) for _ in range(layers)))
    )
    dtype = torch.bfloat16 if dtype_name == "bf16" else None
    path = Path(tempfile.mkdtemp()) / "ema.safetensors"
    before = _status("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    if case == "streamed":
        save_ema_weights(ema, path, dtype=dtype)
    else:
        state = {
            k: v.to(dtype or v.dtype, copy=True) for k, v in ema.ema_model.state_dict().items()
        }
        safetensors.torch.save_file(state, path)
        del state
    peak = _status("VmHWM:") - before
    return {"case": case, "dtype": dtype_name, "mib": mib, "peak_mib": round(peak / MIB, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--case", nargs=2, help=argparse.SUPPRESS)  # a child's case
    args = parser.parse_args()
    if args.case:
        print(json.dumps(_case(*args.case, args.mib)))
        return
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    rows = []
    for dtype in ("f32", "bf16"):
        for case in ("streamed", "save_file"):
            cmd = [sys.executable, __file__, "--mib", str(args.mib), "--case", case, dtype]
            out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"{case:10} {dtype:5} peak +{rows[-1]['peak_mib']} MiB (EMA of {args.mib} MiB)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()

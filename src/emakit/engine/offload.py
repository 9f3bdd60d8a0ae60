"""Background updates: the arithmetic of an EMA update runs on a worker thread.

``update()`` only snapshots the online weights into a reusable staging buffer (a
non-blocking device-to-host copy into pinned memory when the model is on an accelerator,
followed by a CUDA event) and hands the ``lerp_`` to :class:`BackgroundWorker`. The
training loop goes on with the next forward/backward while the worker averages. Anything
that reads the EMA waits for the pending update first (:meth:`BackgroundWorker.wait`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from .plan import Plan

__all__ = ["BackgroundWorker", "StreamWorker"]


def _finish(plan: Plan, weights: Sequence[float] | None, event: Any) -> None:
    if event is not None:
        event.synchronize()  # the snapshot copy has landed; waits on the worker thread only
    plan.finish(weights)


class BackgroundWorker:
    """A single worker thread running EMA updates strictly in order.

    At most one update is pending: :meth:`submit` first waits for the previous one, so the
    staging buffer is never overwritten while it is being read. Exceptions raised on the
    worker re-raise in the caller at the next :meth:`wait`.
    """

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None

    @property
    def pending(self) -> bool:
        """Whether an update has been submitted and not yet waited for."""
        return self._pending is not None

    def wait(self) -> None:
        """Block until the pending update (if any) is done; re-raise its exception."""
        pending = self._pending
        if pending is None:
            return
        try:
            pending.result()  # several threads may wait on the same update
        finally:
            if self._pending is pending:
                self._pending = None

    def submit(self, plan: Plan, weights: Sequence[float] | None) -> None:
        """Snapshot ``plan``'s online tensors now and average (or copy) them in the background."""
        self.wait()
        on_cuda = any(p.online.is_cuda for p in plan.pairs[:1])
        plan.stage(non_blocking=on_cuda)
        event = None
        if on_cuda:
            event = torch.cuda.Event()
            event.record()
        self._run(_finish, plan, weights, event)

    def run(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on the worker after the pending update (no snapshot taken)."""
        self.wait()
        self._run(fn, *args)

    def _run(self, fn: Callable[..., None], *args: Any) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="emakit-ema")
        self._pending = self._pool.submit(fn, *args)

    def close(self) -> None:
        """Wait for the pending update and stop the thread."""
        self.wait()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __getstate__(self) -> dict[str, Any]:
        self.wait()
        return {"_pool": None, "_pending": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


class StreamWorker:
    """Runs EMA updates on a CUDA side stream, ordered by events: no host sync anywhere.

    ``submit`` snapshots the online weights into the staging buffer on the current stream
    (a device-to-device copy, so the next optimizer step may overwrite the weights at
    once), then averages from the snapshot on the side stream. ``wait`` makes the current
    stream wait for that work on the GPU; the host never blocks.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream: Any = None
        self._done: Any = None
        self._pending = False

    @property
    def pending(self) -> bool:
        return self._pending

    def wait(self) -> None:
        """Order the current stream after the pending side-stream update (GPU-side)."""
        if self._pending and self._done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._done)
        self._pending = False

    def submit(self, plan: Plan, weights: Sequence[float] | None) -> None:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
            self._done = torch.cuda.Event()
        current = torch.cuda.current_stream(self.device)
        if self._pending:
            current.wait_event(self._done)  # the staging buffer is free again
        plan.stage(non_blocking=True)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            plan.finish(weights)
            self._done.record(self._stream)
        self._pending = True

    def close(self) -> None:
        self.wait()

    def __getstate__(self) -> dict[str, Any]:
        if self._pending and self._done is not None:
            self._done.synchronize()
        return {"device": self.device, "_stream": None, "_done": None, "_pending": False}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

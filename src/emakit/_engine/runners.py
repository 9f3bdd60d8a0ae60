"""Runners: where and when the arithmetic of an update runs, behind one small interface.

A runner takes *work* (a [`Plan`][emakit._engine.plan.Plan], a `FusedPlan` for several
EMAs of one model, or a `BEMAWork`) and an
[`Action`][emakit.decay.Action], and carries the action out:

* `SyncRunner` at once, on the caller's thread;
* `ThreadRunner` on a background thread: the online tensors are first snapshot into
  the work's staging buffers (a non-blocking copy into pinned memory when they live on an
  accelerator), then the worker averages while training goes on. With ``live=True`` (set
  when an optimizer pre-step hook waits for the worker, so no step can write the weights
  while it reads them) the parameters are averaged straight from the live tensors, with no
  snapshot, and only the buffers, which the next forward may write, are done at once;
* `StreamRunner` on a CUDA side stream, ordered by events: no host sync at all.

Every reader of the EMA (``state_dict``, ``swap``, ``forward``, ``ema_model``, the copy
helpers) calls `wait()` first, explicitly. At most one action is pending at a time:
``submit`` waits for the previous one, so a staging buffer is never overwritten while read.
Exceptions raised on a worker re-raise in the caller at the next `wait()`.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

import torch

from .plan import Plan

if TYPE_CHECKING:
    from ..decay import Action
    from .bema import BEMAWork
    from .fused import FusedPlan

    #: What a runner runs: all at once (``run(action)``), or as a snapshot
    #: (``stage(non_blocking=..., guard=...)``) followed by the arithmetic
    #: (``finish(action)``); ``on_accelerator`` says whether the snapshot may be non-blocking.
    Work: TypeAlias = Plan | FusedPlan | BEMAWork


class Runner(Protocol):
    """The interface every runner has."""

    #: Whether work for this runner must be built with staging buffers.
    staged: bool

    @property
    def pending(self) -> bool:
        """Whether an action was submitted and not yet waited for."""

    def submit(self, work: Work, action: Action) -> None:
        """Carry out ``action`` on ``work`` (now, or later: see `wait()`)."""

    def wait(self) -> None:
        """Block (or order the current CUDA stream) until the pending action is done."""

    def close(self) -> None:
        """Wait, then release threads or streams."""


class SyncRunner:
    """Runs every action at once, on the caller's thread."""

    staged = False
    pending = False

    def submit(self, work: Work, action: Action) -> None:
        """Run ``action`` now."""
        work.run(action)

    def wait(self) -> None:
        """Nothing is ever pending."""

    def close(self) -> None:
        """Nothing to release."""


class ThreadRunner:
    """Runs the arithmetic of each action on one background thread, strictly in order.

    Args:
        live: average parameters straight from the live tensors (see the module
            docstring); only safe while an optimizer pre-step hook calls `wait()`.
            Default False.
    """

    staged = True

    def __init__(self, *, live: bool = False) -> None:
        self.live = live
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None
        # (plan, its parameter plan, its buffer plan) for live updates
        self._split: tuple[Plan, Plan, Plan] | None = None

    @property
    def pending(self) -> bool:
        """Whether an action was submitted and not yet waited for."""
        return self._pending is not None

    def wait(self) -> None:
        """Block until the pending action (if any) is done; re-raise its exception."""
        pending = self._pending
        if pending is None:
            return
        try:
            pending.result()  # several threads may wait on the same action
        finally:
            if self._pending is pending:
                self._pending = None

    def submit(self, work: Work, action: Action) -> None:
        """Snapshot the online tensors now and carry out ``action`` in the background."""
        self.wait()
        if self.live and isinstance(work, Plan):
            self._submit_live(work, action)
            return
        on_accelerator = work.on_accelerator
        work.stage(non_blocking=on_accelerator, guard=action.guard)
        event = None
        if on_accelerator:
            event = torch.cuda.Event()
            event.record()
        self._run(_finish, work, action, event)

    def _submit_live(self, plan: Plan, action: Action) -> None:
        split = self._split
        if split is None or split[0] is not plan:  # the owner rebuilds plans that go stale
            params = [p for p in plan.pairs if not p.buffer]
            buffers = [p for p in plan.pairs if p.buffer]
            split = self._split = (plan, Plan(params, plan.impl), Plan(buffers, plan.impl))
        split[2].run(action)
        self._run(split[1].run, action)

    def _run(self, fn: Any, *args: Any) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="emakit-ema")
        self._pending = self._pool.submit(fn, *args)

    def close(self) -> None:
        """Wait for the pending action and stop the thread."""
        self.wait()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __getstate__(self) -> dict[str, Any]:
        self.wait()
        return {"live": False, "_pool": None, "_pending": None, "_split": None}


def _finish(work: Work, action: Action, event: Any) -> None:
    if event is not None:
        event.synchronize()  # the snapshot copy has landed; waits on the worker thread only
    work.finish(action)


class StreamRunner:
    """Runs each action on a CUDA side stream, ordered by events: no host sync anywhere.

    ``submit`` snapshots the online weights into the staging buffers on the current stream
    (a device-to-device copy, so the next optimizer step may overwrite the weights at
    once), then averages from the snapshot on the side stream. ``wait`` makes the current
    stream wait for that work on the GPU; the host never blocks.

    Args:
        device: the CUDA device of the model.
    """

    staged = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream: Any = None
        self._done: Any = None
        #: Whether an action was submitted and not yet waited for.
        self.pending = False

    def wait(self) -> None:
        """Order the current stream after the pending side-stream action (GPU-side)."""
        if self.pending:
            torch.cuda.current_stream(self.device).wait_event(self._done)
        self.pending = False

    def submit(self, work: Work, action: Action) -> None:
        """Snapshot on the current stream, carry out ``action`` on the side stream."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
            self._done = torch.cuda.Event()
        current = torch.cuda.current_stream(self.device)
        if self.pending:
            current.wait_event(self._done)  # the staging buffer is free again
        work.stage(non_blocking=True, guard=action.guard)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            work.finish(action)
            self._done.record(self._stream)
        self.pending = True

    def close(self) -> None:
        """Order the current stream after the pending action."""
        self.wait()

    def __getstate__(self) -> dict[str, Any]:
        if self.pending:
            self._done.synchronize()
        return {"device": self.device, "_stream": None, "_done": None, "pending": False}


class _LiveHooks:
    """The optimizer hooks of a live `ThreadRunner` (see `hook_optimizer()`): removing them
    waits for the pending update and turns live mode off (back to snapshots)."""

    def __init__(self, runner: ThreadRunner, *handles: Any) -> None:
        self.runner = runner
        self.handles = handles

    def remove(self) -> None:
        """Remove every hook, then wait and leave live mode."""
        for h in self.handles:
            h.remove()
        self.runner.wait()
        self.runner.live = False


def hook_optimizer(
    optimizer: torch.optim.Optimizer,
    update: Callable[[], None],
    runner: Runner,
    *,
    on_accelerator: bool,
) -> Any:
    """Call ``update()`` after every ``optimizer.step()``; returns the handle.

    With a `ThreadRunner` for a CPU model, also wait for the pending update before
    every step, which makes the runner's zero-copy ``live`` mode safe; removing the handle
    turns it off again. On an accelerator the staged path already copies non-blocking.
    """
    post = optimizer.register_step_post_hook(lambda *_: update())
    if not isinstance(runner, ThreadRunner) or on_accelerator:
        return post
    pre = optimizer.register_step_pre_hook(lambda *_: runner.wait())
    runner.live = True
    return _LiveHooks(runner, post, pre)

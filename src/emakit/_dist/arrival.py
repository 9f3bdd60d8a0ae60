"""Whether every rank of a process group reached the same call: a bounded check on the
group's c10d store that names the ranks that did not arrive, on every backend.

Imported by `emakit._dist.collectives` only. The check uses the rendezvous store that
``init_process_group`` built (a ``TCPStore``, or the launcher's store behind a prefix),
which every backend has, and no collective: NCCL, gloo and the rest behave alike, and a
failed check leaves the process group's collectives untouched. One call, under the key
prefix ``emakit/agree/<group>/<seq>`` (``<group>`` a digest of the group's global ranks,
``<seq>`` this process's count of checks on that group, the same on every rank of a
program that makes its collective calls in the same order):

1. every rank sets ``<prefix>/<rank>``;
2. group rank 0 waits for all of them (``store.wait``, bounded by ``timeout_s``); on a
   timeout it asks the store which are absent (``store.check``, one per rank, on the
   failure path only). It then records the verdict, ``<prefix>/go`` = ``v`` plus the
   absent ranks (``v`` alone: everyone came), with ``compare_set``, so that the first
   verdict wins;
3. every other rank waits for the verdict (``timeout_s``). If none comes and rank 0's key
   is absent, rank 0 never arrived: the rank records that verdict itself (the same
   ``compare_set``: if rank 0 was just then deciding, one verdict stands for every rank).
   If rank 0 did arrive (it is waiting for a third rank), the rank waits up to
   ``timeout_s`` more;
4. every rank reads the verdict, deletes its own key and counts itself in
   ``<prefix>/read``; the last of the group's ranks to read deletes the verdict and the
   count. A successful check leaves no key behind (a job that snapshots thousands of
   times does not grow the store); a failed one leaves at most the verdict and the count
   (a rank that never arrived never reads them).

A rank that arrives after the others gave up finds the verdict already there and learns at
once that it was late. Store operations per check: rank 0 six, the others five, plus one
``check`` per rank on rank 0 when some are missing.
"""

from __future__ import annotations

import datetime
import hashlib
from typing import Any

import torch

#: Where the checks' keys live in the store.
KEY_ROOT = "emakit/agree"

_counts: dict[str, int] = {}


def default_store() -> Any | None:
    """The default process group's c10d store, or None where torch does not expose it.

    torch has no public accessor for it: this reads the private
    ``torch.distributed.distributed_c10d._get_default_store()`` (present from torch 1.x to
    at least 2.14), here and nowhere else, so that a torch that renames it costs one
    function; ``tests/test_dist_arrival.py`` pins the name. Where it is missing (or there
    is no default group), `missing_ranks()` is not used and
    [`agree()`][emakit._dist.collectives.agree] falls back to collectives (gloo's
    ``monitored_barrier``, one bounded all-reduce elsewhere).
    """
    c10d = getattr(torch.distributed, "distributed_c10d", None)
    get = getattr(c10d, "_get_default_store", None)
    if get is None:
        return None
    try:
        return get()
    except (RuntimeError, ValueError):  # no default group
        return None


def _prefix(group: Any) -> str:
    """``emakit/agree/<group digest>/<seq>``, counting this call."""
    # the default group by name: torch < 2.7 refuses None here (``KeyError: None``)
    ranks = torch.distributed.get_process_group_ranks(
        torch.distributed.group.WORLD if group is None else group
    )
    digest = hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:12]
    seq = _counts.get(digest, 0)
    _counts[digest] = seq + 1
    return f"{KEY_ROOT}/{digest}/{seq}"


def _arrived(store: Any, keys: list[str], timeout_s: float) -> bool:
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except RuntimeError:  # DistStoreError (a RuntimeError): the wait timed out
        return False
    return True


def _absent(store: Any, prefix: str, world: int) -> list[int]:
    return [r for r in range(world) if not store.check([f"{prefix}/{r}"])]


def _decide(store: Any, go: str, missing: list[int]) -> list[int]:
    """Record ``missing`` as the verdict unless one was recorded first; the verdict."""
    value = store.compare_set(go, "", "v" + ",".join(map(str, missing)))
    return _parse(value)


def _parse(value: bytes | str) -> list[int]:
    text = value.decode() if isinstance(value, bytes) else value
    return [int(r) for r in text[1:].split(",") if r]


def missing_ranks(store: Any, group: Any, timeout_s: float) -> list[int] | None:
    """The ranks of ``group`` (group ranks) that did not arrive within ``timeout_s``, or
    None when every rank did (see the module docstring). The list can hold this rank
    itself: it came after the others stopped waiting.

    Args:
        store: the default group's store (`default_store()`).
        group: the process group (None: the default group).
        timeout_s: seconds to wait for the other ranks.
    """
    dist = torch.distributed
    world = dist.get_world_size(group)
    if world == 1:
        return None
    me = dist.get_rank(group)
    prefix = _prefix(group)
    go = f"{prefix}/go"
    mine = f"{prefix}/{me}"
    store.set(mine, b"")
    if me == 0:
        if store.check([go]):  # the others gave up before this rank came
            missing = _parse(store.get(go))
        else:
            came = _arrived(store, [f"{prefix}/{r}" for r in range(world)], timeout_s)
            missing = _decide(store, go, [] if came else _absent(store, prefix, world))
    elif _arrived(store, [go], timeout_s):
        missing = _parse(store.get(go))
    elif not store.check([f"{prefix}/0"]) and not store.check([go]):
        missing = _decide(store, go, _absent(store, prefix, world))
    elif _arrived(store, [go], timeout_s):  # rank 0 came: it is waiting for someone else
        missing = _parse(store.get(go))
    else:  # rank 0 came but never decided (it died meanwhile?)
        missing = _decide(store, go, _absent(store, prefix, world) or [0])
    store.delete_key(mine)
    if store.add(f"{prefix}/read", 1) == world:
        store.delete_key(go)
        store.delete_key(f"{prefix}/read")
    return missing or None

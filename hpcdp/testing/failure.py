"""Timeout and failure conformance bodies: a late rank, a rank that left.

The contract (``Backend`` docstring): nothing blocks past its timeout, errors name the operation
and the rank, and a peer known to be gone fails the others fast instead of at the deadline.
"""
from __future__ import annotations

import time

import numpy as np

import hpcdp

__all__ = ["body_timeout", "body_finished_peer"]


def body_timeout(rank: int, late: int = 1, sleep: float = 2.0, timeout: float = 0.5) -> list[str]:
    """Rank ``late`` sleeps past the others' ``timeout``: they raise ``CommTimeoutError`` naming
    the call and their rank, the late rank is not left hanging, and the world group still works.

    The timed-out call runs on a group of its own, as a backend whose timeouts poison the group
    (``Backend.timeout_poisons_group``) would leave that group unusable.
    """
    n = hpcdp.world_size()
    fails: list[str] = []
    if n < 2:
        return fails
    sub = hpcdp.new_group(list(range(n)))
    if rank == late:
        time.sleep(sleep)
    try:
        hpcdp.allreduce(np.ones(4), group=sub, timeout=timeout if rank != late else 30.0)
        if rank != late:
            fails.append("allreduce returned although a rank never joined in time")
    except hpcdp.CommTimeoutError as exc:
        text = str(exc)
        if rank == late:
            pass  # joined after the others gave up: a timeout is an allowed answer
        elif "allreduce" not in text or f"rank {rank}" not in text:
            fails.append(f"timeout message does not name the call and rank: {text}")
    except hpcdp.PeerFailureError as exc:
        if rank != late:
            fails.append(f"on time rank got PeerFailureError instead of a timeout: {exc}")
    except Exception as exc:  # noqa: BLE001 - collected and reported
        fails.append(f"raised {type(exc).__name__}: {exc}")
    if hpcdp.allreduce(np.ones(1), timeout=60)[0] != n:  # the world group is still healthy
        fails.append("world allreduce after the timeout wrong")
    return fails


def body_finished_peer(rank: int) -> str:
    """A rank that returned cannot join: a peer waiting on it fails fast, not at the timeout.

    Spawned backends only (under mpirun the process of a returned rank lives on).
    """
    if rank == 0:
        return "done"
    time.sleep(0.2)
    try:
        hpcdp.allreduce(np.ones(2))
    except hpcdp.PeerFailureError as exc:
        # with more ranks the news may come from a peer that failed because of rank 0
        named = (hpcdp.world_size() > 2 or 0 in (getattr(exc, "peers", None) or ())
                 or "rank 0" in str(exc) or "[0]" in str(exc))
        return "peer failure" if named else f"peer failure not naming rank 0: {exc}"
    except hpcdp.CommTimeoutError:
        return "timeout"
    return "no error"

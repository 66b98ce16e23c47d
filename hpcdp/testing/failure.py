"""Timeout and failure conformance bodies: a late rank, a rank that left.

The contract (``Backend`` docstring): nothing blocks past its timeout, errors name the operation
and the rank, and a peer known to be gone fails the others fast instead of at the deadline.
"""
from __future__ import annotations

import time

import numpy as np

import hpcdp

__all__ = ["body_timeout", "body_finished_peer"]


_GAVE_UP = 7301  # the tag of "I gave up on the allreduce" messages to the late rank


def body_timeout(rank: int, late: int = 1, timeout: float = 0.5, wait: float = 60.0) -> list[str]:
    """Rank ``late`` joins an allreduce only after the others gave up on it (``timeout``): they
    raise ``CommTimeoutError`` naming the call and their rank, the late rank is not left
    hanging, and the world group still works.

    The late rank waits for a message from each on-time rank, not a fixed time: on a loaded
    machine on-time ranks reached the call more than the 1.5 s of a fixed sleep apart, the "late"
    rank was on time, and the allreduce succeeded. For the same reason an on-time rank may hear
    first that another on-time rank timed out (``PeerFailureError``): also a correct answer.
    The timed-out call runs on a group of its own, as a backend whose timeouts poison the group
    (``Backend.timeout_poisons_group``) would leave that group unusable.
    """
    n = hpcdp.world_size()
    fails: list[str] = []
    if n < 2:
        return fails
    sub = hpcdp.new_group(list(range(n)))
    if rank == late:
        for r in range(n):
            if r != late:
                hpcdp.recv(np.empty(1), r, tag=_GAVE_UP, timeout=wait)
    try:
        hpcdp.allreduce(np.ones(4), group=sub, timeout=timeout if rank != late else wait)
        if rank != late:
            fails.append("allreduce returned although a rank never joined in time")
    except hpcdp.CommTimeoutError as exc:
        text = str(exc)
        if rank == late:
            pass  # joined after the others gave up: a timeout is an allowed answer
        elif "allreduce" not in text or f"rank {rank}" not in text:
            fails.append(f"timeout message does not name the call and rank: {text}")
    except hpcdp.PeerFailureError as exc:
        # (the late rank has joined nothing yet: only an on-time rank can have left)
        if rank != late and late in tuple(getattr(exc, "peers", None) or ()):
            fails.append(f"on-time rank was told the late rank left, which had not: {exc}")
    except Exception as exc:  # noqa: BLE001 - collected and reported
        fails.append(f"raised {type(exc).__name__}: {exc}")
    if rank != late:  # whatever happened above: the late rank must not wait for us in vain
        hpcdp.send(np.zeros(1), late, tag=_GAVE_UP, timeout=wait)
    if hpcdp.allreduce(np.ones(1), timeout=wait)[0] != n:  # the world group is still healthy
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

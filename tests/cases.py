"""Test bodies beside the conformance suite's (``hpcdp.testing``), which this module re-exports.

Bodies run on every rank and collect failures instead of raising, so one wrong answer never
leaves the other ranks waiting in a collective: the test asserts on the returned lists.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np

import hpcdp
from hpcdp.errors import CommTimeoutError, PeerFailureError

from hpcdp.testing._cases import (  # noqa: F401 - re-exported for the tests
    COLLECTIVES, DTYPES, OPS, REDUCING, SPLITTING, call, close, expected_error, make, reduce_ref,
    reference, shapes,
)
from hpcdp.testing.collective import body_collective  # noqa: F401
from hpcdp.testing.failure import tell_late_rank, wait_until_others_gave_up


def body_late_timeout(rank: int, late: int, timeout: float, per_call: bool = False,
                      wait: float = 60.0) -> dict[str, Any]:
    """Rank ``late`` joins an allreduce only after the others gave up on it: they must raise
    CommTimeoutError, not before ``timeout``.

    Ordered by messages (``hpcdp.testing.failure``), not by a sleep longer than the timeout: on a
    loaded machine an on-time rank can reach the call late enough that a sleeping rank is not
    late any more, and a fixed sleep makes every run as slow as the worst case. An on-time rank
    that comes late to the call may hear first that another on-time rank gave up
    (``peer-failure``, ``peers`` naming it; see ``on_time_ok``): as correct an answer.
    ``per_call``: the group waits 30 s and the call passes ``timeout=`` itself.
    """
    group = hpcdp.new_group(list(range(hpcdp.world_size())), timeout=30.0 if per_call else timeout)
    out: dict[str, Any] = {"rank": rank}
    if rank == late:
        wait_until_others_gave_up(late, wait)
    t0 = time.monotonic()
    try:
        hpcdp.allreduce(np.ones(4), group=group, timeout=timeout if per_call else None)
        out["result"] = "ok"
    except CommTimeoutError as exc:
        out["result"] = "timeout"
        out["message"] = str(exc)
    except PeerFailureError as exc:
        out["result"] = "peer-failure"
        out["message"] = str(exc)
        out["peers"] = list(exc.peers)
    out["elapsed"] = time.monotonic() - t0
    if rank != late:  # whatever happened above: the late rank must not wait for us in vain
        tell_late_rank(late, wait)
    hpcdp.barrier()  # the world group is still healthy
    return out


def on_time_ok(o: dict[str, Any], late: int, timeout: float) -> bool:
    """Whether on-time rank ``o["rank"]``'s answer in ``body_late_timeout`` is right: its own
    timeout, not before ``timeout``, naming the call and itself; or the news that another
    on-time rank gave up after its timeout."""
    if o["result"] == "timeout":
        return (o["elapsed"] >= 0.95 * timeout and "allreduce #" in o["message"]
                and "timed out" in o["message"] and f"(rank {o['rank']} of" in o["message"])
    return (o["result"] == "peer-failure" and late not in o["peers"]
            and ("timed out" in o["message"] or "timeout" in o["message"]))


def body_mismatch(rank: int, group: Any = None) -> str:
    """Ranks disagree on the shape; with HPCDP_DEBUG=detail every rank must raise."""
    x = np.ones(3 + rank)
    try:
        hpcdp.allreduce(x, group=group)
    except hpcdp.CollectiveMismatchError as exc:
        return str(exc)
    return "no error"

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


def body_sleepy_timeout(rank: int, late: int, sleep: float, timeout: float,
                        per_call: bool = False) -> dict[str, Any]:
    """Rank ``late`` sleeps past the others' timeout; they must raise CommTimeoutError in time.

    ``per_call``: the group waits 30 s and the call passes ``timeout=`` itself.
    """
    group = hpcdp.new_group(list(range(hpcdp.world_size())), timeout=30.0 if per_call else timeout)
    out: dict[str, Any] = {"rank": rank}
    if rank == late:
        time.sleep(sleep)
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
    out["elapsed"] = time.monotonic() - t0
    hpcdp.barrier()  # the world group is still healthy
    return out


def body_mismatch(rank: int, group: Any = None) -> str:
    """Ranks disagree on the shape; with HPCDP_DEBUG=detail every rank must raise."""
    x = np.ones(3 + rank)
    try:
        hpcdp.allreduce(x, group=group)
    except hpcdp.CollectiveMismatchError as exc:
        return str(exc)
    return "no error"

"""MPI: a rank that gives up on a collective tells the group's other ranks at once.

Rank 0 times out; rank 1 arrives after it gave up. The late call must raise
``PeerFailureError`` naming rank 0 at once (its own timeout is 60 s, past the job's cap, so
waiting it out would fail the test),
and every later call on that group too. The world group stays usable. Run under mpirun:
``mpirun -n 2 python tests/run_mpi.py tests/backends/test_mpi_late.py`` (and -n 4).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import hpcdp
from conftest import run_mpi


_READY, _GAVE_UP = 7303, 7304


def _late_peer(rank: int, op: str) -> dict[str, Any]:
    n = hpcdp.world_size()
    sub = hpcdp.new_group(list(range(n)))
    call = {
        "barrier": lambda t: sub.barrier(timeout=t),
        "allreduce": lambda t: sub.allreduce(np.ones(3), timeout=t),       # the latency path
        "big allreduce": lambda t: sub.allreduce(np.ones(1 << 18), timeout=t),
        "broadcast": lambda t: sub.broadcast(np.ones(5), root=1, timeout=t),  # from the late rank
        "async all_gather": lambda t: sub.all_gather(np.ones(4), async_op=True, timeout=t).wait(),
    }[op]
    out: dict[str, Any] = {"rank": rank}
    # Messages, not sleeps, order the calls: rank 0 starts once ranks 2.. are about to join
    # (the roll call must find them), rank 1 once rank 0 gave up. A fixed 2 s sleep was not
    # late enough on a loaded machine, and rank 0's call succeeded.
    if rank == 0:
        for r in range(2, n):
            hpcdp.recv(np.empty(1), r, tag=_READY, timeout=60.0)
    elif rank == 1:
        hpcdp.recv(np.empty(1), 0, tag=_GAVE_UP, timeout=60.0)
    else:
        hpcdp.send(np.zeros(1), 0, tag=_READY, timeout=60.0)
    try:
        call(1.0 if rank == 0 else 60.0)
        out["call"] = "ok"
    except hpcdp.HpcdpError as exc:
        out["call"], out["message"] = type(exc).__name__, str(exc)
        out["peers"] = list(getattr(exc, "peers", ()))
    if rank == 0:
        hpcdp.send(np.zeros(1), 1, tag=_GAVE_UP, timeout=60.0)
    try:  # the group is unusable now, on every rank, without waiting
        sub.barrier(timeout=60.0)
        out["next"] = "ok"
    except hpcdp.HpcdpError as exc:
        out["next"], out["next_message"] = type(exc).__name__, str(exc)
    hpcdp.barrier(timeout=60.0)  # the world group is healthy
    return out


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", ["barrier", "allreduce", "big allreduce", "broadcast",
                                "async all_gather"])
def test_late_rank_is_told_at_once(mpi_world, op: str) -> None:
    outs = run_mpi(_late_peer, op)
    first, late = outs[0], outs[1]
    assert first["call"] == "CommTimeoutError", first
    # what did not arrive: the roll call names rank 1 (and, on 4 ranks, that 2 and 3 joined)
    assert "rank(s) [1] of the group have not joined" in first["message"], first
    if mpi_world.size > 2:
        assert "rank(s) [0, 2" in first["message"], first
    assert first["next"] == "HpcdpError" and "timed out" in first["next_message"], first
    assert late["call"] == "PeerFailureError", late
    assert late["peers"] == [0] and "rank 0 left this group" in late["message"], late
    assert "timed out" in late["message"] and "rank 1" in late["message"], late
    for o in outs[1:]:  # ranks that joined in time are told too; nobody waits its own 60 s
        assert o["call"] in ("PeerFailureError", "ok"), o
        assert o["next"] in ("PeerFailureError", "HpcdpError"), o


def _own_root(rank: int) -> dict[str, Any]:
    """Every rank gathers to itself: all join, none completes, all time out at about the same
    time and ask each other at once (a roll call must answer while it waits)."""
    sub = hpcdp.new_group(list(range(hpcdp.world_size())))
    sub.debug = "off"  # the roll call's own diagnosis (the sampled checks catch this call first:
    #                    tests/comm/test_sampled_checks.py)
    out: dict[str, Any] = {"rank": rank}
    try:
        # 3 s: on a loaded machine every rank must have posted before the first one asks
        sub.gather(np.ones(2), root=rank, timeout=3.0)
        out["call"] = "ok"
    except hpcdp.HpcdpError as exc:
        out["call"], out["message"] = type(exc).__name__, str(exc)
    hpcdp.barrier(timeout=60.0)
    return out


@pytest.mark.mpi(min_size=2)
def test_calls_that_differ_time_out_with_a_diagnosis(mpi_world) -> None:
    outs = run_mpi(_own_root)
    timed_out = [o for o in outs if o["call"] == "CommTimeoutError"]
    assert timed_out, outs
    for o in timed_out:  # every rank answered the roll call: the calls themselves differ
        assert "every rank of the group joined gather" in o["message"], o
        assert "calls probably differ" in o["message"], o
    for o in outs:
        assert o["call"] in ("CommTimeoutError", "PeerFailureError"), o

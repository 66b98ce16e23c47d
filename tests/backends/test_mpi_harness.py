"""MPI: one test's failure must not reach the next, and the latency path keeps its deadline.

A multi-rank run once failed every test after the 16th and then crashed: under load a 1 s
allreduce spun 1024 ``MPI_Test`` calls past its deadline (an oversubscribed Open MPI yields the
CPU in each) and succeeded late; the test body took its "no timeout" branch, skipped a world
barrier the other ranks made, and from then on the ranks' world collectives were out of step
(MPI_ERR_TRUNCATE inside libnbc, every later test failing, then a crash inside MPI). These check
each link of that chain. Run under mpirun: ``tests/run_mpi.py tests/backends/test_mpi_harness.py``.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import hpcdp
from hpcdp.testing import run_mpi

_GAVE_UP = 7302


def _raise_on_rank_1(rank: int) -> str:
    if rank == 1:
        raise RuntimeError("only rank 1 fails")
    return "fine"


def _sum(rank: int) -> float:
    return float(hpcdp.allreduce(np.full(3, rank + 1.0), timeout=60)[0])


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
def test_body_raising_on_one_rank_fails_everywhere_and_keeps_ranks_in_step(mpi_world) -> None:
    with pytest.raises(AssertionError, match="rank 1 raised RuntimeError: only rank 1 fails"):
        run_mpi(_raise_on_rank_1)
    n = mpi_world.size
    assert run_mpi(_sum) == [n * (n + 1) / 2] * n  # the next body's collectives line up


def _time_out_on_the_default_group(rank: int) -> str:
    """Every rank but 1 times out in an allreduce on the default group; rank 1 joins only once
    they all gave up (a message from each, not a sleep), so the timeout is certain."""
    n = hpcdp.world_size()
    if rank == 1:
        for r in range(n):
            if r != 1:
                hpcdp.recv(np.empty(1), r, tag=_GAVE_UP, timeout=60)
    try:
        hpcdp.allreduce(np.ones(2), timeout=0.5 if rank != 1 else 60)
        outcome = "ok"
    except (hpcdp.CommTimeoutError, hpcdp.PeerFailureError) as exc:
        outcome = type(exc).__name__
    if rank != 1:
        hpcdp.send(np.zeros(1), 1, tag=_GAVE_UP, timeout=60)
    return outcome


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
def test_collective_timed_out_in_one_body_does_not_poison_the_next(mpi_world) -> None:
    outs = run_mpi(_time_out_on_the_default_group)
    on_time = outs[:1] + outs[2:]  # the first to give up times out; it may tell the others
    assert "CommTimeoutError" in on_time and outs[1] != "ok", outs
    assert set(on_time) <= {"CommTimeoutError", "PeerFailureError"}, outs
    assert mpi_world._broken is None  # the body's own group took the damage
    n = mpi_world.size
    assert run_mpi(_sum) == [n * (n + 1) / 2] * n


class _Clock:
    """A clock that only moves when MPI is tested (1 ms per Test): an oversubscribed MPI whose
    every idle Test yields the CPU, without depending on how loaded this machine is."""

    def __init__(self) -> None:
        self.t = 0.0

    def monotonic(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


class _SlowRequest:
    """Completes at the ``at``-th Test (the peer's late arrival), each Test costing 1 ms."""

    def __init__(self, real: Any, clock: _Clock, at: int) -> None:
        self.real, self.clock, self.at, self.n = real, clock, at, 0

    def Test(self, *status: Any) -> bool:
        self.n += 1
        self.clock.t += 1e-3
        return self.n >= self.at and bool(self.real.Test(*status))

    def Start(self) -> None:  # a persistent request
        self.real.Start()

    def __bool__(self) -> bool:
        return True


class _SlowComm:
    def __init__(self, real: Any, clock: _Clock, at: int) -> None:
        self.real, self.clock, self.at = real, clock, at
        self.posted: list[_SlowRequest] = []

    def Iallreduce(self, *args: Any) -> _SlowRequest:
        req = _SlowRequest(self.real.Iallreduce(*args), self.clock, self.at)
        self.posted.append(req)
        return req


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("road", ["persistent", "iallreduce"])
def test_latency_path_gives_up_at_its_deadline_when_tests_are_slow(
        mpi_world, monkeypatch: pytest.MonkeyPatch, road: str) -> None:
    """1 s timeout, the peer arrives after 1.5 s of 1 ms Tests: the call must report a timeout
    (before the fix its 1024-Test spin ran 1.024 s uncounted, then waited a full second more,
    and returned success at 1.5 s). Both roads: a small call's persistent request, and the
    ``Iallreduce`` of an MPI without them."""
    from hpcdp.backends.mpi import _fastpath, _requests as rq
    from hpcdp.backends import base, mpi
    from hpcdp.ops import ReduceOp

    MPI = mpi.get_mpi()
    be = mpi.MPIBackend(MPI.COMM_SELF.Dup(), [mpi_world.rank])  # this rank alone: no peers
    clock = _Clock()
    real_comm = be.comm
    slow = _SlowComm(real_comm, clock, at=1500)
    x = np.ones(2)
    slot = real_req = None
    if road == "persistent":
        assert be.fastpath.slots is not None
        be.quick_allreduce(x, x, ReduceOp.SUM, 1.0)  # makes the request, on the real comm
        slot = be.fastpath.table[x.dtype][1][ReduceOp.SUM][1][x.size]
        real_req = slot.req
        slot.req = _SlowRequest(real_req, clock, at=1500)
        slow.posted.append(slot.req)
    else:
        be.fastpath.slots = None
    try:
        with monkeypatch.context() as m:
            m.setattr(_fastpath, "_monotonic", clock.monotonic)
            m.setattr(base, "time", clock)
            m.setattr(rq, "time", clock)
            be.comm = be.fastpath.comm = slow
            req = be.quick_allreduce(x, x, ReduceOp.SUM, 1.0)
        assert req is not None, "the allreduce returned success after its deadline"
        assert slow.posted[0].n < slow.at  # it gave up before the peer came
    finally:
        be.comm = be.fastpath.comm = real_comm
        for r in slow.posted:  # let it complete now, so shutdown frees the communicators
            r.at = 0
        rq.drain(rq.pending_of(be), 5.0)
        if slot is not None:
            slot.req = real_req
        be.shutdown()

"""The small-message path's boundaries: it lives in ``backends/mpi/`` behind one switch
(``HPCDP_MPI_FASTPATH``), the groups reach it only through the backend's ``quick_allreduce``, and
they record to the flight recorder through its public ``begin``/``end`` (no private ring layout).
Under mpirun: ``mpirun -n 2 python tests/run_mpi.py tests/backends/test_mpi_fastpath.py``.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import hpcdp
from hpcdp.backends.base import Backend
from hpcdp.ops import ReduceOp


class _SpyRecorder:
    """Only the recorder's public ``begin``/``end``: a caller that reads anything else fails."""

    __slots__ = ("calls",)

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def begin(self, op: str, group: Any, seq: int = 0, shape: Any = None, dtype: Any = None,
              peer: int = -1) -> int:
        self.calls.append(("begin", op, seq, shape, str(dtype)))
        return 100 + seq

    def end(self, token: int, state: str = "completed") -> None:
        self.calls.append(("end", token, state))


def _record_body(rank: int) -> list[tuple[Any, ...]]:
    g = hpcdp.get_default_group()
    spy, real = _SpyRecorder(), g._rec
    g._rec = spy
    try:
        got = g.allreduce(np.ones(3, np.float32))  # blocking, plain host array: the latency lane
        assert np.array_equal(got, np.full(3, g.size, np.float32)), got
        out = np.empty((2, 2))
        g.allreduce(np.ones((2, 2)), "max", out=out)  # the lane with out= and a 2-D array
        assert (out == 1).all(), out
    finally:
        g._rec = real
    return spy.calls


def test_latency_lane_records_through_public_methods(world) -> None:
    for calls in world.run(_record_body):
        assert [c[0] for c in calls] == ["begin", "end", "begin", "end"], calls
        (_, op, seq, shape, dtype), (_, tok, state) = calls[0], calls[1]
        assert (op, shape, dtype, tok, state) == ("allreduce", (3,), "float32", 100 + seq,
                                                  "completed"), calls
        assert calls[2][3] == (2, 2) and calls[3][1] == 100 + calls[2][2], calls


def test_backend_interface_has_no_blocking_allreduce_method() -> None:
    """The fast path sits behind ``allreduce`` and the optional ``quick_allreduce`` capability
    (None on every backend but MPI's), not a second allreduce method every backend inherits."""
    assert not hasattr(Backend, "allreduce_blocking")
    assert Backend.quick_allreduce is None


def _switch_body(rank: int) -> dict[str, Any]:
    from hpcdp.backends.mpi import MPIBackend, get_mpi

    MPI = get_mpi()
    be = MPIBackend(MPI.COMM_SELF.Dup(), [rank])  # made while HPCDP_MPI_FASTPATH=0
    try:
        x = np.arange(4.0)
        req = be.allreduce(x, x.copy(), ReduceOp.SUM)
        return {"fastpath": be.fastpath, "quick": be.quick_allreduce, "done": req.wait(30.0),
                "kind": type(req).__name__}
    finally:
        be.shutdown()


@pytest.mark.mpi(min_size=1)
def test_one_switch_turns_the_small_message_path_off(mpi_world,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPCDP_MPI_FASTPATH", "0")
    out = _switch_body(mpi_world.rank)
    assert out["fastpath"] is None and out["quick"] is None, out
    assert out["done"] and out["kind"] == "MPIRequest", out  # an Iallreduce, not a Start
    monkeypatch.setenv("HPCDP_MPI_FASTPATH", "1")
    on = _switch_body(mpi_world.rank)
    assert on["fastpath"] is not None and on["quick"] is not None, on


def _gather_lanes_body(rank: int) -> dict[str, Any]:
    """all_gather and broadcast with rank 0 in the latency lane (a plain array, blocking) and
    the other ranks on the general path (a view, async_op, a read-only array): the lanes post
    the same requests, so the calls match and the results are the numpy ones. On MPI the lane
    is counted (``quick_all_gather``/``quick_broadcast``); elsewhere there is none."""
    g = hpcdp.get_default_group()
    be = g.backend
    taken = {"all_gather": 0, "broadcast": 0}
    real = {k: getattr(be, f"quick_{k}") for k in taken}

    def counting(k: str) -> Any:
        def quick(*args: Any) -> Any:
            taken[k] += 1
            return real[k](*args)
        return quick

    for k in taken:
        if real[k] is not None:
            setattr(be, f"quick_{k}", counting(k))
    spy, rec = _SpyRecorder(), g._rec
    g._rec = spy
    fails: list[str] = []
    n = g.size
    try:
        for nbytes in (16, 256 << 10, 1 << 20):  # the sizes of the three posting paths
            count = nbytes // 8
            x = np.arange(count, dtype=np.float64) + 1000.0 * rank
            want = np.stack([np.arange(count, dtype=np.float64) + 1000.0 * r for r in range(n)])
            if rank == 0:
                got = g.all_gather(x)
                out = np.empty((n, count))
                got2 = g.all_gather(x, out=out)
            else:
                wide = np.zeros(2 * count)
                wide[::2] = x
                got = g.all_gather(wide[::2])  # not contiguous: the general path
                got2 = g.all_gather(x, async_op=True).wait()
            for what, y in (("all_gather", got), ("all_gather out=", got2)):
                if not np.array_equal(y, want):
                    fails.append(f"{nbytes} B {what}: {y.ravel()[:4]} vs {want.ravel()[:4]}")
            b = np.full(count, float(rank))
            if rank == 0:
                g.broadcast(b, 0)
                z = np.full(count, float(rank))
                z.flags.writeable = False
                z = g.broadcast(z, n - 1)  # read-only: a copy, the general path
            else:
                b = g.broadcast(b, 0, async_op=True).wait()
                z = g.broadcast(np.full(count, float(rank)), n - 1)
            if not (np.all(b == 0.0) and np.all(z == float(n - 1))):
                fails.append(f"{nbytes} B broadcast: {b[:2]} {z[:2]}")
    finally:
        g._rec = rec
        for k in taken:
            if real[k] is not None:
                setattr(be, f"quick_{k}", real[k])
    begins = [c for c in spy.calls if c[0] == "begin"]
    ends = [c for c in spy.calls if c[0] == "end"]
    seqs = [c[2] for c in begins]
    if seqs != sorted(seqs) or len(set(seqs)) != len(seqs) or len(ends) != len(begins):
        fails.append(f"flight record out of order: {spy.calls[:8]}")
    return {"fails": fails, "taken": taken, "mpi": real["all_gather"] is not None}


def test_gather_and_broadcast_lanes_match_the_general_path(world) -> None:
    for rank, out in enumerate(world.run(_gather_lanes_body)):
        assert not out["fails"], out["fails"]
        if out["mpi"]:  # rank 0 took the lane for every blocking plain call, the others not
            want = {"all_gather": 6, "broadcast": 3} if rank == 0 else {"all_gather": 0, "broadcast": 3}
            assert out["taken"] == want, (rank, out["taken"])

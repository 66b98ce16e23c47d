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

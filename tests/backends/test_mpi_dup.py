"""``MPIBackend.dup()``: a communication context of its own over the same ranks (what RPC sends
over). A message on the duplicate never matches a receive posted on the parent, even one from
any source with any tag, and the other way round; the duplicate's point to point runs on another
thread while the parent's collectives run on this one; shutting the parent down ends it.
Run under mpirun: ``mpirun -n 2 python tests/run_mpi.py tests/backends/test_mpi_dup.py`` (and -n 4).
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import hpcdp
from hpcdp.backends.base import ANY_SOURCE, ANY_TAG
from hpcdp.backends.mpi import get_mpi

from conftest import run_mpi

_TAG, _ACK = 5, 6


def _wait(req: Any) -> None:
    assert req.wait(60.0), "a point-to-point call did not complete within 60 s"


def _exchange(first: Any, second: Any, rank: int) -> dict[str, Any]:
    """Rank 0 sends each other rank a message on ``first``, and once that rank has it, one on
    ``second``. The others post a receive from anyone with any tag on ``second`` before either is
    sent: the message on ``first`` must not land in it (nor be seen by ``second``'s probe)."""
    out: dict[str, Any] = {}
    size = first.size
    if rank == 0:
        for r in range(1, size):
            _wait(first.send(np.full(1, 10 + r, np.int64), r, _TAG))
            ack = np.zeros(1, np.int64)
            _wait(first.recv(ack, r, _ACK))
            _wait(second.send(np.full(1, 100 + r, np.int64), r, _TAG))
        return out
    caught = np.full(1, -1, np.int64)
    trap = second.recv(caught, ANY_SOURCE, ANY_TAG)
    while first.probe(ANY_SOURCE, ANY_TAG) is None:
        assert not trap.test(), f"the message sent on one context landed in the other: {caught}"
    out["seen_by_other_probe"] = second.probe(ANY_SOURCE, ANY_TAG)
    out["other_recv_done"] = trap.test()
    got = np.zeros(1, np.int64)
    _wait(first.recv(got, ANY_SOURCE, ANY_TAG))
    out["first"] = int(got[0])
    _wait(first.send(np.zeros(1, np.int64), 0, _ACK))
    _wait(trap)
    out["second"] = int(caught[0])
    return out


def _dup_body(rank: int) -> dict[str, Any]:
    be = hpcdp.get_default_group().backend
    d = be.dup()
    out: dict[str, Any] = {"same": (d.rank, d.size, d.ranks) == (be.rank, be.size, be.ranks),
                           "thread_level": d.thread_level}
    out["dup_then_parent"] = _exchange(d, be, rank)
    hpcdp.barrier(timeout=60.0)  # (so no rank's next phase sends into this one's traps)
    out["parent_then_dup"] = _exchange(be, d, rank)
    hpcdp.barrier(timeout=60.0)
    # The duplicate's p2p on another thread while this one runs the parent's collectives.
    box: dict[str, Any] = {}

    def agent() -> None:
        try:
            box["r"] = _ring(d, rank)
        except BaseException as exc:  # noqa: BLE001 - reported below
            box["r"] = repr(exc)

    t = threading.Thread(target=agent, daemon=True)
    t.start()
    sums = [float(hpcdp.allreduce(np.ones(4) * i, timeout=60.0)[0]) for i in range(50)]
    t.join(60.0)
    out["thread"] = box.get("r", "did not finish")
    out["sums_ok"] = sums == [float(i * be.size) for i in range(50)]
    # Shutting the parent down ends the duplicate (a backend of its own, so the test's group
    # stays usable).
    sub = be.new_group(list(range(be.size)))
    sd = sub.dup()
    sd2 = sd.dup()
    sub.shutdown()
    mpi = get_mpi()
    out["ended"] = [x.comm == mpi.COMM_NULL for x in (sub, sd, sd2)]
    d.shutdown()
    out["parent_alive"] = be.comm != mpi.COMM_NULL
    return out


def _ring(d: Any, rank: int) -> list[int]:
    """Every rank sends its right neighbour 20 messages on ``d``, receives from anyone."""
    size, got = d.size, []
    for i in range(20):
        s = d.send(np.full(1, rank * 1000 + i, np.int64), (rank + 1) % size, _TAG)
        buf = np.zeros(1, np.int64)
        _wait(d.recv(buf, ANY_SOURCE, ANY_TAG))
        _wait(s)
        got.append(int(buf[0]))
    return got


@pytest.mark.mpi(min_size=2)
def test_dup_is_a_context_of_its_own(mpi_world) -> None:
    outs = run_mpi(_dup_body)
    size = mpi_world.size
    for rank, out in enumerate(outs):
        assert out["same"], out
        assert out["thread_level"] == "multiple", out
        assert out["ended"] == [True, True, True], out
        assert out["parent_alive"], out
        assert out["sums_ok"], out
        left = (rank - 1) % size
        assert out["thread"] == [left * 1000 + i for i in range(20)], out
        if rank:
            for key in ("dup_then_parent", "parent_then_dup"):
                ex = out[key]
                assert ex["seen_by_other_probe"] is None, (key, ex)
                assert ex["other_recv_done"] is False, (key, ex)
                assert (ex["first"], ex["second"]) == (10 + rank, 100 + rank), (key, ex)

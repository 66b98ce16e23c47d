"""MPI: errors raised inside MPI during hpcdp operations come out as hpcdp's own errors.

A truncated point-to-point receive, and a group used after it was shut down; run under mpirun
(-n 2 and -n 4). Collectives whose sizes differ run as whole jobs in ``test_mpi_jobs.py``: after
an error inside a collective MPI's state is undefined, so they must not share this session.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import hpcdp
from conftest import run_mpi


def _outcome(fn: Any) -> tuple[str, str]:
    try:
        fn()
        return "ok", ""
    except Exception as exc:  # noqa: BLE001 - reported to the test, which judges it
        return f"{type(exc).__module__}.{type(exc).__name__}", str(exc)


def _recv_too_small(rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {"rank": rank}
    if rank == 0:
        hpcdp.send(np.arange(10.0), 1, tag=7, timeout=60.0)
    elif rank == 1:
        out["recv"] = _outcome(lambda: hpcdp.recv(np.empty(4), 0, tag=7, timeout=60.0))
    hpcdp.barrier(timeout=60.0)  # point to point errors leave the group usable
    return out


@pytest.mark.mpi(min_size=2)
def test_truncated_receive_is_a_mismatch_error(mpi_world) -> None:
    out = run_mpi(_recv_too_small)[1]
    kind, msg = out["recv"]
    assert kind == "hpcdp.errors.CollectiveMismatchError", out
    assert "recv(src=0, tag=7)" in msg and "rank 1" in msg and "MPI_ERR_TRUNCATE" in msg, out


def _shut_sub_group(rank: int) -> list[str]:
    sub = hpcdp.new_group(list(range(hpcdp.world_size())))
    child = sub.new_group([0])
    sub.shutdown()
    kinds = []
    for fn in (lambda: sub.allreduce(np.ones(2)), lambda: sub.all_gather(np.ones(2)),
               lambda: sub.isend(np.ones(2), 0), lambda: child.barrier()):
        kind, msg = _outcome(fn)
        kinds.append(kind if "shut down" in msg else f"{kind}: {msg}")
    return kinds


@pytest.mark.mpi(min_size=2)
def test_group_used_after_shutdown_raises_hpcdp_error(mpi_world) -> None:
    for kinds in run_mpi(_shut_sub_group):
        assert kinds == ["hpcdp.errors.HpcdpError"] * 4, kinds

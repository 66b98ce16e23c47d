"""MPI: errors raised inside MPI during hpcdp operations come out as hpcdp's own errors.

Without ``HPCDP_DEBUG`` a size mismatch gives ``MPI_ERR_TRUNCATE`` on the rank whose buffer was
too small; it must be a ``CollectiveMismatchError`` naming the call and the rank, and the ranks
that did not see it must fail at once (on the call, or the group's next one), never with a raw
``mpi4py.MPI.Exception`` and never after a timeout. Run under mpirun (-n 2 and -n 4).
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


def _size_mismatch(rank: int, count: int) -> dict[str, Any]:
    sub = hpcdp.new_group(list(range(hpcdp.world_size())))
    x = np.ones(count + 5 * rank)  # rank 0 has the smallest buffer
    call = _outcome(lambda: sub.allreduce(x, timeout=60.0))
    after = _outcome(lambda: sub.barrier(timeout=60.0))
    hpcdp.barrier(timeout=60.0)
    return {"rank": rank, "call": call, "after": after}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("count", [3, 1 << 16], ids=["latency-path", "bandwidth-path"])
def test_size_mismatch_is_an_hpcdp_error_on_every_rank(mpi_world, count: int) -> None:
    outs = run_mpi(_size_mismatch, count)
    errors = [o["call"] if o["call"][0] != "ok" else o["after"] for o in outs]
    for o, (kind, msg) in zip(outs, errors):
        assert kind.startswith("hpcdp.errors."), o  # never a raw mpi4py.MPI.Exception
        assert kind != "hpcdp.errors.CommTimeoutError", o
        assert f"rank {o['rank']}" in msg, o
    mismatch = [(k, m) for k, m in errors if k.endswith("CollectiveMismatchError")]
    assert mismatch, outs
    for _kind, msg in mismatch:
        assert "allreduce #" in msg and "different sizes" in msg and "MPI_ERR_TRUNCATE" in msg, msg


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

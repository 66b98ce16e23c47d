"""Ranks that call different collectives raise ``CollectiveMismatchError`` instead of mixing data.

The transports' own checks (``HPCDP_DEBUG=off``: no call checks above them): on TCP every
collective frame carries its call's signature (op, sequence number, dtype, count, root), on sim
the rendezvous compares the calls. The same matrix runs on
both: dtype, op, root, size, two collectives in opposite order, a collective against a barrier.
Every rank must raise, naming both calls; on TCP a rank whose part of the call was only sending
(a broadcast root that thinks it is the only root) may return from it and raises at its next
call, and the group stays failed (messages of the bad call may still be in flight). By default
(``HPCDP_DEBUG=sample``) the sampled checks catch the same calls before they run.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest

import hpcdp
from hpcdp.testing import run_ranks

R = hpcdp.CollectiveMismatchError


def _allreduce_dtype(rank: int) -> Any:
    return hpcdp.allreduce(np.ones(4, np.float32 if rank == 0 else np.int32))


def _allreduce_op(rank: int) -> Any:
    return hpcdp.allreduce(np.ones(4), op="sum" if rank == 0 else "max")


def _allreduce_size(rank: int) -> Any:
    return hpcdp.allreduce(np.ones(3 + rank))


def _allreduce_algorithm(rank: int) -> Any:
    # 80 bytes take recursive doubling, 800 KB the ring: the first message already disagrees
    return hpcdp.allreduce(np.ones(10 if rank == 0 else 100_000))


def _opposite_order(rank: int) -> Any:
    x = np.ones(4)
    if rank == 0:
        hpcdp.allreduce(x)
        return hpcdp.broadcast(x, root=0)
    hpcdp.broadcast(x, root=0)
    return hpcdp.allreduce(x)


def _broadcast_root(rank: int) -> Any:
    return hpcdp.broadcast(np.full(4, float(rank)), root=0 if rank == 0 else 1)


def _reduce_root(rank: int) -> Any:
    return hpcdp.reduce(np.ones(4), root=0 if rank == 0 else 1)


def _gather_root(rank: int) -> Any:
    return hpcdp.gather(np.ones(4), root=0 if rank == 0 else 1)


def _scatter_root(rank: int) -> Any:
    return hpcdp.scatter(np.ones((hpcdp.world_size(), 2)), root=0 if rank == 0 else 1)


def _all_gather_size(rank: int) -> Any:
    return hpcdp.all_gather(np.ones(4 + rank, np.int64))


def _barrier_vs_allreduce(rank: int) -> Any:
    return hpcdp.barrier() if rank == 0 else hpcdp.allreduce(np.ones(1))


#: case -> (body, words both calls' descriptions contain on TCP, whether a rank may return)
CASES: dict[str, tuple[Callable[[int], Any], tuple[str, ...], bool]] = {
    "dtype": (_allreduce_dtype, ("float32", "int32"), False),
    "op": (_allreduce_op, ("op=sum", "op=max"), False),
    "size": (_allreduce_size, ("3 x float64", "4 x float64"), False),
    "size_algorithm": (_allreduce_algorithm, ("10 x float64", "100000 x float64"), False),
    "opposite_order": (_opposite_order, ("allreduce", "broadcast"), False),
    "broadcast_root": (_broadcast_root, ("root=0", "root=1"), True),
    "reduce_root": (_reduce_root, ("root=0", "root=1"), False),
    "gather_root": (_gather_root, ("root=0", "root=1"), False),
    "scatter_root": (_scatter_root, ("root=0", "root=1"), True),
    "all_gather_size": (_all_gather_size, ("4 x int64", "5 x int64"), False),
    "barrier_vs_allreduce": (_barrier_vs_allreduce, ("barrier()", "allreduce"), False),
}


def mismatch_body(rank: int, case: str) -> dict[str, str]:
    """The mismatched call, then a barrier: what each did ("returned" or the error)."""
    out: dict[str, str] = {}
    for step, fn in (("call", CASES[case][0]), ("next", lambda r: hpcdp.barrier())):
        try:
            fn(rank)
            out[step] = "returned"
        except R as exc:
            out[step] = f"mismatch: {exc}"
        except hpcdp.HpcdpError as exc:
            out[step] = f"{type(exc).__name__}: {exc}"
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["sim", "tcp"])
@pytest.mark.parametrize("case", list(CASES))
def test_mismatched_collectives_raise_on_every_rank(backend: str, case: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The transports' own checks, with the sampled call checks (``comm.debug``) off."""
    monkeypatch.setenv("HPCDP_DEBUG", "off")
    _, words, may_return = CASES[case]
    res = run_ranks(backend, 2, mismatch_body, case, timeout=20, join_timeout=90)
    for rank, out in enumerate(res):
        first = out["call"]
        if backend == "sim" or not may_return:  # every rank takes part in receiving: it raises
            assert first.startswith("mismatch"), (rank, res)
        else:
            assert first.startswith("mismatch") or first == "returned", (rank, res)
        if backend == "tcp":  # messages of the bad call may be in flight: the group stays failed
            assert out["next"].startswith("mismatch"), (rank, res)
        else:  # every rank raised at the same rendezvous: the group is still in step
            assert out["next"] == "returned", (rank, res)
        raised = first if first.startswith("mismatch") else out["next"]
        assert "rank 0" in raised and "rank 1" in raised, (rank, raised)
        if backend == "tcp":
            assert all(w in raised for w in words), (rank, raised)


#: case -> what both ranks' calls read as in the sampled check's error (``comm.debug._describe``)
SAMPLED = {
    "dtype": ("allreduce(float32, shape (4,), op=sum) #1", "allreduce(int32, shape (4,), op=sum) #1"),
    "size": ("shape (3,)", "shape (4,)"),
    "op": ("op=sum", "op=max"),
    "opposite_order": ("allreduce(", "broadcast("),
    "broadcast_root": ("root=0", "root=1"),
    "scatter_root": ("root=0", "root=1"),
    "barrier_vs_allreduce": ("barrier() #1", "allreduce(float64, shape (1,), op=sum) #1"),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["sim", "tcp"])
@pytest.mark.parametrize("case", list(SAMPLED))
def test_sampled_checks_catch_mismatches_before_they_run(backend: str, case: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """By default (``HPCDP_DEBUG`` unset: the sampled checks) every rank raises at the first
    mismatched call, naming every rank's call, before any rank posts it: the group stays usable,
    also on TCP (whose own check above leaves it failed)."""
    monkeypatch.delenv("HPCDP_DEBUG", raising=False)
    res = run_ranks(backend, 2, mismatch_body, case, timeout=20, join_timeout=90)
    for rank, out in enumerate(res):
        assert out["call"].startswith("mismatch"), (rank, res)
        assert "every rank checked" in out["call"], (rank, res)
        assert all(w in out["call"] for w in SAMPLED[case]), (rank, out["call"])
        assert "rank 0:" in out["call"] and "rank 1:" in out["call"], (rank, out["call"])
        assert out["next"] == "returned", (rank, res)


def three_rank_body(rank: int) -> dict[str, str]:
    """Only rank 2 swaps two collectives: ranks 0 and 1 agree with each other."""
    out: dict[str, str] = {}
    x = np.arange(4.0)
    try:
        if rank == 2:
            hpcdp.broadcast(x, root=1)
            hpcdp.allreduce(x)
        else:
            hpcdp.allreduce(x)
            hpcdp.broadcast(x, root=1)
        out["call"] = "returned"
    except R as exc:
        out["call"] = f"mismatch: {exc}"
    try:
        hpcdp.barrier()
        out["next"] = "returned"
    except R as exc:
        out["next"] = f"mismatch: {exc}"
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["sim", "tcp"])
def test_one_rank_out_of_order_fails_the_whole_group(backend: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPCDP_DEBUG", "off")  # the transports' own checks
    res = run_ranks(backend, 3, three_rank_body, timeout=20, join_timeout=90)
    for out in res:
        assert out["call"].startswith("mismatch"), res
        if backend == "tcp":
            assert out["next"].startswith("mismatch"), res


def matching_body(rank: int) -> list[float]:
    """Matching calls of every kind still work, including after long waits (probes)."""
    import time

    n = hpcdp.world_size()
    got = []
    if rank == 1:
        time.sleep(2.5)  # the others wait > PROBE_AFTER: their probes find the same call
    got.append(float(hpcdp.reduce(np.ones(3), root=1)[0]) if rank == 1 else
               (hpcdp.reduce(np.ones(3), root=1), 0.0)[1])
    got.append(float(hpcdp.allreduce(np.full(4, rank, np.int32), op="max")[0]))
    got.append(float(hpcdp.broadcast(np.full(2, float(rank)), root=n - 1)[0]))
    g = hpcdp.gather(np.full(2, rank), root=0)
    got.append(float(g.sum()) if rank == 0 else 0.0)
    got.append(float(hpcdp.scatter(np.arange(2.0 * n).reshape(n, 2), root=1).ravel()[0]))
    hpcdp.barrier()
    return got


@pytest.mark.timeout(120)
def test_matching_calls_after_long_waits_are_not_flagged() -> None:
    res = run_ranks("tcp", 3, matching_body, timeout=20, join_timeout=90)
    assert res[0] == [0.0, 2.0, 2.0, 6.0, 0.0]
    assert res[1] == [3.0, 2.0, 2.0, 0.0, 2.0]
    assert res[2] == [0.0, 2.0, 2.0, 0.0, 4.0]

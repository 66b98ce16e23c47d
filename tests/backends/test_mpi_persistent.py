"""MPI: small allreduces on persistent requests (``hpcdp.backends.mpi._fastpath``).

A persistent request's tag is fixed when it is made, so every rank must take it for the same
call whatever it passed locally: blocking or ``async_op``, a view or a fresh array, numpy or
float16. A call whose request still runs queues behind it without blocking the poster, and
requests are retired in call order. Run under mpirun:
``mpirun -n 2 python tests/run_mpi.py tests/backends/test_mpi_persistent.py`` (and -n 4).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import hpcdp
from conftest import run_mpi
from hpcdp.backends.mpi import _fastpath

_TAG = 7311


def _want(n: int, size: int, dtype: Any = np.float64, base: float = 0.0) -> np.ndarray:
    """The sum over ranks r of ``base + r + arange(size)``."""
    return (n * (base + np.arange(size)) + n * (n - 1) / 2).astype(dtype)


def _mine(rank: int, size: int, dtype: Any = np.float64, base: float = 0.0) -> np.ndarray:
    return (base + rank + np.arange(size)).astype(dtype)


def _uses_persistent(rank: int) -> dict[str, Any]:
    g = hpcdp.get_default_group()
    small = getattr(g.backend.fastpath, "slots", None)
    out: dict[str, Any] = {"supported": small is not None}
    if small is None:
        return out
    n = g.size
    before = len(small.order)
    ok = [bool(np.array_equal(g.allreduce(_mine(rank, k)), _want(n, k))) for k in (1, 5, 1023)]
    after_small = len(small.order)
    big = g.allreduce(_mine(rank, 2048))  # 16 KiB: at RING_MIN and above, an Iallreduce
    ok.append(bool(np.array_equal(big, _want(n, 2048))))
    again = g.allreduce(_mine(rank, 5))  # the same request again, not a new one
    ok.append(bool(np.array_equal(again, _want(n, 5))))
    out.update(ok=ok, made=after_small - before, after=len(small.order) - before)
    return out


@pytest.mark.mpi(min_size=2)
def test_small_allreduces_start_persistent_requests(mpi_world) -> None:
    """Open MPI 4.1 (CI's MPI) has ``MPIX_Allreduce_init``: the latency path must use it."""
    for o in run_mpi(_uses_persistent):
        assert o["supported"], o
        assert o["ok"] == [True] * 5 and o["made"] == 3 and o["after"] == 3, o


def _mixed(rank: int) -> list[str]:
    """Each rank reaches the same calls by a different local road."""
    g = hpcdp.get_default_group()
    n, bad = g.size, []
    for size in (1, 3, 64):
        want = _want(n, size)
        x = _mine(rank, size)
        if rank % 2:  # odd ranks: async, then wait
            got = g.allreduce(x, async_op=True).wait()
        else:  # even ranks: blocking, on the latency path
            got = g.allreduce(x)
        bad += [] if np.array_equal(got, want) else [f"async/blocking {size}: {got}"]
        wide = np.zeros((size, 3))
        wide[:, 1] = x
        src = wide[:, 1] if rank % 2 else x.copy()  # a strided view against a fresh array
        got = g.allreduce(src)
        bad += [] if np.array_equal(got, want) else [f"view/fresh {size}: {got}"]
        inplace = x.copy()
        if rank % 2:
            g.allreduce(inplace, out=inplace)
            got = inplace
        else:
            got = g.allreduce(x, out=np.empty_like(x))
        bad += [] if np.array_equal(got, want) else [f"in place/out {size}: {got}"]
        half = g.allreduce(x.astype(np.float16))  # reduced as float32 on every rank
        bad += [] if np.array_equal(half, want.astype(np.float16)) else [f"float16 {size}"]
        mx = g.allreduce(x, op="max")
        bad += [] if np.array_equal(mx, x - rank + n - 1) else [f"max {size}: {mx}"]
    return bad


@pytest.mark.mpi(min_size=2)
def test_ranks_reaching_a_call_by_different_roads_match(mpi_world) -> None:
    """Before the choice was made from dtype, count and op alone, an async call on one rank
    and a blocking one on another would wait for each other until the timeout."""
    assert run_mpi(_mixed, timeout=20.0) == [[]] * mpi_world.size


def _queued(rank: int) -> list[str]:
    g = hpcdp.get_default_group()
    n, bad = g.size, []
    works = [g.allreduce(_mine(rank, 4, base=10.0 * i), async_op=True) for i in range(5)]
    blocking = g.allreduce(_mine(rank, 4, base=100.0))  # queues behind the five
    bad += [] if np.array_equal(blocking, _want(n, 4, base=100.0)) else [f"blocking {blocking}"]
    for i in reversed(range(5)):  # waited on last first: each finished its own call
        got = works[i].wait()
        bad += [] if np.array_equal(got, _want(n, 4, base=10.0 * i)) else [f"#{i}: {got}"]
    # in place, queued: each buffer gets its own result, none another's
    bufs = [_mine(rank, 4, base=float(i)) for i in range(3)]
    ws = [g.allreduce(b, out=b, async_op=True) for b in bufs]
    for w in ws:
        w.wait()
    bad += [f"in place #{i}: {b}" for i, b in enumerate(bufs)
            if not np.array_equal(b, _want(n, 4, base=float(i)))]
    return bad


@pytest.mark.mpi(min_size=2)
def test_calls_of_one_shape_queue_and_each_gets_its_own_result(mpi_world) -> None:
    assert run_mpi(_queued, timeout=20.0) == [[]] * mpi_world.size


def _poster_not_blocked(rank: int) -> list[str]:
    """Rank 0 posts two async calls of one shape, then sends to rank 1, which posts its calls
    only after that message: a post that waited for the call before it would deadlock."""
    g = hpcdp.get_default_group()
    n = g.size
    if rank == 1:
        g.recv(np.empty(1), 0, tag=_TAG, timeout=10.0)
    ws = [g.allreduce(_mine(rank, 2, base=float(i)), async_op=True) for i in range(2)]
    if rank == 0:
        g.send(np.zeros(1), 1, tag=_TAG, timeout=10.0)
    return [f"#{i}" for i, w in enumerate(ws)
            if not np.array_equal(w.wait(), _want(n, 2, base=float(i)))]


@pytest.mark.mpi(min_size=2)
def test_a_queued_call_does_not_block_its_poster(mpi_world) -> None:
    assert run_mpi(_poster_not_blocked, timeout=20.0) == [[]] * mpi_world.size


def _retired(rank: int) -> dict[str, Any]:
    """More shapes than a group keeps: the oldest retire in call order, one still running
    included (freed once it completes), and every result stays right."""
    g = hpcdp.get_default_group()
    small, n = getattr(g.backend.fastpath, "slots", None), g.size
    cap = _fastpath.MAX_SLOTS
    bad: list[str] = []
    g.allreduce(_mine(rank, 1))  # a shape's first call is checked, not run on its requests
    running = g.allreduce(_mine(rank, 1, base=7.0), async_op=True)  # the oldest: retired first
    for rnd in range(2):
        for k in range(2, cap + 10):
            got = g.allreduce(_mine(rank, k, base=float(rnd)))
            if not np.array_equal(got, _want(n, k, base=float(rnd))):
                bad.append(f"round {rnd} size {k}")
        if rnd == 0:
            held = len(small.retired)  # the running one: retired but not freed yet
            if not np.array_equal(running.wait(), _want(n, 1, base=7.0)):
                bad.append("the running call")
    small.free_idle()
    return {"bad": bad, "kept": len(small.order), "held": held, "left": len(small.retired)}


@pytest.mark.mpi(min_size=2)
def test_requests_retire_oldest_first_and_results_stay_right(mpi_world) -> None:
    cap = _fastpath.MAX_SLOTS
    for o in run_mpi(_retired, timeout=30.0):
        assert o == {"bad": [], "kept": cap, "held": 1, "left": 0}, o


def _waited_in_another_order(rank: int) -> list[str]:
    """The same calls, waited on in another order: rank 0 waits for the queued call first,
    rank 1 first makes a blocking call of another shape, during which its queued call must
    start (libnbc would have progressed an ``Iallreduce`` on its own)."""
    g = hpcdp.get_default_group()
    n, bad = g.size, []
    w1 = g.allreduce(_mine(rank, 3, base=1.0), async_op=True)
    w2 = g.allreduce(_mine(rank, 3, base=2.0), async_op=True)  # queued behind w1
    if rank == 0:
        got2 = w2.wait()
        other = g.allreduce(_mine(rank, 7))
    else:
        other = g.allreduce(_mine(rank, 7))
        got2 = w2.wait()
    bad += [] if np.array_equal(got2, _want(n, 3, base=2.0)) else [f"queued: {got2}"]
    bad += [] if np.array_equal(other, _want(n, 7)) else [f"other: {other}"]
    bad += [] if np.array_equal(w1.wait(), _want(n, 3, base=1.0)) else ["first"]
    return bad


@pytest.mark.mpi(min_size=2)
def test_queued_calls_start_while_the_rank_waits_for_another(mpi_world) -> None:
    assert run_mpi(_waited_in_another_order, timeout=20.0) == [[]] * mpi_world.size


class _Tagged(np.ndarray):
    """An ndarray subclass (as memmap and masked arrays are)."""


def _many_and_subclasses(rank: int) -> list[str]:
    """80 async calls of one shape in flight (the pending table reaps while they register),
    then subclass arrays in and out."""
    g = hpcdp.get_default_group()
    n, bad = g.size, []
    works = [g.allreduce(_mine(rank, 2, base=float(i)), async_op=True) for i in range(80)]
    bad += [f"#{i}" for i, w in enumerate(works)
            if not np.array_equal(w.wait(), _want(n, 2, base=float(i)))]
    x = _mine(rank, 5).view(_Tagged)
    got = g.allreduce(x, async_op=True).wait()
    bad += [] if np.array_equal(np.asarray(got), _want(n, 5)) else [f"subclass in: {got}"]
    out = np.zeros(5).view(_Tagged)
    g.allreduce(_mine(rank, 5), out=out)
    bad += [] if np.array_equal(np.asarray(out), _want(n, 5)) else [f"subclass out: {out}"]
    return bad


@pytest.mark.mpi(min_size=2)
def test_many_calls_in_flight_and_array_subclasses(mpi_world) -> None:
    assert run_mpi(_many_and_subclasses, timeout=20.0) == [[]] * mpi_world.size


def _ops_differ_once(rank: int) -> dict[str, Any]:
    """Rank 0 asks for ``sum``, the others for ``max``, on a (dtype, count) new to the group;
    then every rank makes the same calls: on the group, and straight on its backend (whose
    persistent-request tables must still be in step)."""
    from hpcdp.errors import CommTimeoutError, HpcdpError
    from hpcdp.ops import ReduceOp

    g = hpcdp.get_default_group()
    be, n = g.backend, g.size
    out: dict[str, Any] = {"first": "returned", "later": [], "backend": []}
    level, g.debug = g.debug, "off"  # the fast path's own first-call check, not the sampled one
    try:
        g.allreduce(_mine(rank, 3, base=40.0), op="sum" if rank == 0 else "max")
    except HpcdpError as exc:
        out["first"] = f"{type(exc).__name__}: {exc}"
    finally:
        g.debug = level
    for k in range(3):  # identical calls: right, or an error naming the call that differed
        try:
            got = g.allreduce(_mine(rank, 3, base=float(k)))
            out["later"].append("ok" if np.array_equal(got, _want(n, 3, base=float(k)))
                                else f"wrong: {got}")
        except CommTimeoutError as exc:
            out["later"].append(f"timeout: {exc}")
        except HpcdpError as exc:
            out["later"].append(f"{type(exc).__name__}: {exc}")
    for k in range(3):  # the backend itself: blocking (latency path) and async
        recv = np.empty(3)
        try:
            if k % 2:
                req = be.allreduce(_mine(rank, 3, base=float(k)), recv, ReduceOp.SUM)
                done = req.wait(5.0)
            else:
                req = be.quick_allreduce(_mine(rank, 3, base=float(k)), recv, ReduceOp.SUM,
                                         5.0)
                done = req is None
        except HpcdpError as exc:
            out["backend"].append(f"{type(exc).__name__}: {exc}")
            continue
        if not done:
            req.abandon()
            out["backend"].append("timeout")
        else:
            out["backend"].append("ok" if np.array_equal(recv, _want(n, 3, base=float(k)))
                                  else f"wrong: {recv}")
    return out


@pytest.mark.mpi(min_size=2)
def test_ranks_that_pass_different_ops_are_told_and_stay_in_step(mpi_world) -> None:
    """Issue #20 item 10: ``sum`` on rank 0 against ``max`` elsewhere (undefined in MPI) gave
    rank 1 the sum silently, and every later identical call of that dtype and count timed out
    on every rank ("calls probably differ") because the ranks' persistent-request tables had
    gone out of step. Now every rank raises ``CollectiveMismatchError`` naming both ops at that
    call; later identical calls on the group fail at once naming it (an MPI group that failed
    a collective is not reused), and on the backend they work."""
    for rank, o in enumerate(run_mpi(_ops_differ_once, timeout=5.0)):
        first = o["first"]
        assert first.startswith("CollectiveMismatchError"), (rank, o)
        assert "rank 0 op=sum" in first and "rank 1 op=max" in first, (rank, o)
        for text in o["later"]:
            assert text == "ok" or ("CollectiveMismatchError" in text and "earlier allreduce #"
                                    in text), (rank, o)
        assert o["backend"] == ["ok"] * 3, (rank, o)

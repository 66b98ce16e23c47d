"""Task functions and per-rank bodies of the ``hpcdp.rpc.Executor`` tests (sim, TCP and MPI).

Each body runs on every rank, builds an executor (the root submits, the others serve) and
returns the failures the root saw (empty when all is well), so one body serves every backend.
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import time
import uuid
from typing import Any

import numpy as np

import hpcdp
import hpcdp.rpc as rpc
from hpcdp.errors import PeerFailureError


# -- tasks -------------------------------------------------------------------------------------
@rpc.register
def square(x: Any) -> Any:
    return x * x


@rpc.register
def power(x: int, p: int) -> int:
    return x ** p


@rpc.register
def scaled_sum(a: np.ndarray, scale: float = 1.0) -> float:
    return float(a.sum() * scale)


@rpc.register
def where(i: int) -> tuple[int, int]:
    return rpc.get_worker_info().id, i


@rpc.register
def fail_on(i: int, bad: int) -> int:
    if i == bad:
        raise ValueError(f"task {i} is bad")
    return i


_events: dict[str, threading.Event] = {}
_events_lock = threading.Lock()


def _event(key: str) -> threading.Event:
    with _events_lock:
        return _events.setdefault(key, threading.Event())


@rpc.register
def block(key: str, seconds: float) -> int:
    """Wait until ``release(key)`` on this process (at most ``seconds``); this worker's rank."""
    if not _event(key).wait(seconds):
        raise TimeoutError(f"block({key!r}) was never released")
    return rpc.get_worker_info().id


@rpc.register
def release(key: str) -> None:
    _event(key).set()


def _release_everywhere(key: str) -> None:
    for r in range(hpcdp.world_size()):
        rpc.rpc_sync(r, release, args=(key,), timeout=30)


@rpc.register
def exit_on(rank: int, i: int) -> int:
    """Task ``i``; the process of ``rank`` exits the moment it runs one (a worker that dies)."""
    if rpc.get_worker_info().id == rank:
        os._exit(3)
    return i


def _wait_until(pred: Any, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


def check(fails: list[str], cond: bool, msg: str) -> None:
    if not cond:
        fails.append(msg)


# -- bodies ------------------------------------------------------------------------------------
def body_farm(rank: int) -> list[str]:
    """map (in order, unordered, chunks), starmap, submit with kwargs and arrays, as_completed,
    wait, an empty iterable, an error in one task; RPC started and stopped by the executor."""
    fails: list[str] = []
    size = hpcdp.world_size()
    with rpc.Executor() as ex:
        check(fails, (ex is None) == (rank != 0), f"rank {rank}: with gave {ex!r}")
        if ex is not None:
            want = [i * i for i in range(40)]
            check(fails, list(ex.map(square, range(40))) == want, "map order")
            got = list(ex.map(square, range(40), unordered=True))
            check(fails, sorted(got) == want, f"unordered map: {got}")
            check(fails, list(ex.starmap(power, [(i, 3) for i in range(15)])) ==
                  [i ** 3 for i in range(15)], "starmap")
            check(fails, list(ex.map(power, range(6), [2] * 6)) == [i * i for i in range(6)],
                  "map over two iterables")
            check(fails, list(ex.map(square, range(23), chunksize=5)) == want[:23],
                  "map with chunksize 5")
            check(fails, sorted(ex.starmap(power, [(i, 2) for i in range(23)], chunksize=4,
                                           unordered=True)) == want[:23],
                  "unordered starmap with chunksize 4")
            check(fails, list(ex.map(square, [])) == [], "map over nothing")
            check(fails, list(ex.starmap(power, [], chunksize=3)) == [], "chunked starmap of nothing")
            arrays = [np.arange(i, i + 5, dtype=np.float64) for i in range(8)]
            futs = {ex.submit(scaled_sum, a, scale=2.0): i for i, a in enumerate(arrays)}
            seen = {futs[f]: f.result() for f in cf.as_completed(futs, timeout=60)}
            check(fails, seen == {i: float(a.sum() * 2) for i, a in enumerate(arrays)},
                  f"submit + as_completed: {seen}")
            done, not_done = cf.wait([ex.submit(square, 3)], timeout=60)
            check(fails, not not_done and done.pop().result() == 9, "concurrent.futures.wait")
            ranks = {f.result()[0] for f in [ex.submit(where, i) for i in range(6 * size)]}
            workers = set(range(1, size)) if size > 1 else {0}
            check(fails, ranks == workers, f"tasks ran on {ranks}, workers are {workers}")
            # an error in one task: that future raises the remote error, the others are fine
            futs2 = [ex.submit(fail_on, i, 3) for i in range(6)]
            cf.wait(futs2, timeout=60)
            err = futs2[3].exception()
            check(fails, isinstance(err, ValueError) and isinstance(err, rpc.RemoteError),
                  f"error type {type(err)}")
            text = str(err)
            check(fails, "task 3 is bad" in text and "fail_on" in text and
                  "remote traceback" in text and "worker" in text, f"error text: {text}")
            check(fails, [f.result() for i, f in enumerate(futs2) if i != 3] == [0, 1, 2, 4, 5],
                  "the other tasks")
            try:
                list(ex.map(fail_on, range(6), [4] * 6, chunksize=2))
                fails.append("map over a failing task did not raise")
            except ValueError as e:
                check(fails, "task 4 is bad" in str(e), f"map error: {e}")
            try:
                ex.submit(lambda: 1)
                fails.append("an unregistered function was accepted")
            except TypeError as e:
                check(fails, "not registered" in str(e), str(e))
    check(fails, not rpc.is_initialized(), f"rank {rank}: the executor's RPC is still running")
    return fails


def body_balance(rank: int) -> list[str]:
    """A task held on one worker does not hold up the others' tasks (one task in flight per
    worker, the root a worker too); RPC started by the body and left running by the executor."""
    fails: list[str] = []
    rpc.init_rpc(f"worker{rank}", rpc_timeout=60)
    key = f"slow-{uuid.uuid4().hex}"
    with rpc.Executor(include_root=True, max_in_flight=1) as ex:
        if ex is not None:
            check(fails, sorted(ex.workers) == sorted(f"worker{r}" for r in
                                                      range(hpcdp.world_size())), ex.workers)
            slow = ex.submit(block, key, 60.0)
            fast = [ex.submit(where, i) for i in range(8 * hpcdp.world_size())]
            # all of them complete while the slow one is still held: with a static round robin
            # some would be queued behind it and this wait would time out
            _, not_done = cf.wait(fast, timeout=60)
            check(fails, not not_done, f"{len(not_done)} tasks waited behind the held one")
            check(fails, not slow.done(), "the held task completed before it was released")
            _release_everywhere(key)
            held_on = slow.result(60)
            on = {f.result()[0] for f in fast if f.done() and not f.exception()}
            check(fails, held_on not in on, f"tasks ran on rank {held_on} while it was busy: {on}")
    check(fails, rpc.is_initialized(), f"rank {rank}: the executor stopped RPC it did not start")
    rpc.shutdown()
    return fails


def body_timeout_and_cancel(rank: int) -> list[str]:
    """map(timeout=) raises TimeoutError; shutdown(cancel_futures=True) cancels what was
    queued, lets what runs finish, and refuses new tasks."""
    fails: list[str] = []
    size = hpcdp.world_size()
    k1, k2 = f"t-{uuid.uuid4().hex}", f"c-{uuid.uuid4().hex}"
    with rpc.Executor(include_root=True, max_in_flight=1) as ex:
        if ex is not None:
            it = ex.map(block, [k1] * (2 * size), [60.0] * (2 * size), timeout=0.3)
            try:
                next(it)
                fails.append("map(timeout=0.3) over held tasks gave a result")
            except TimeoutError:
                pass
            except BaseException as e:  # noqa: BLE001 - reported
                fails.append(f"map timeout raised {type(e).__name__}: {e}")
            _release_everywhere(k1)
            held = [ex.submit(block, k2, 60.0) for _ in range(size)]
            # sent once the tasks of the map left the workers: one on each of them
            check(fails, _wait_until(lambda: all(f.running() for f in held), 30),
                  "the held tasks did not start")
            queued = [ex.submit(square, i) for i in range(10)]
            ex.shutdown(wait=False, cancel_futures=True)
            check(fails, all(f.cancelled() for f in queued),
                  f"queued tasks not cancelled: {[f._state for f in queued]}")
            try:
                ex.submit(square, 1)
                fails.append("submit after shutdown was accepted")
            except RuntimeError:
                pass
            _release_everywhere(k2)
            check(fails, sorted(f.result(60) for f in held) == list(range(size)),
                  "the running tasks finished on every worker")
    return fails


def body_worker_exits(rank: int, report_dir: str) -> None:
    """TCP: worker rank 2 exits mid-task. Only its tasks fail, naming it; rank 1 runs the rest."""
    with rpc.Executor(max_in_flight=2) as ex:
        if ex is not None:
            fails: list[str] = []
            futs = [ex.submit(exit_on, 2, i) for i in range(20)]
            cf.wait(futs, timeout=60)
            bad = [f.exception() for f in futs if f.exception() is not None]
            good = [f.result() for f in futs if f.exception() is None]
            check(fails, 1 <= len(bad) <= 2, f"{len(bad)} tasks failed (2 at most were on rank 2)")
            check(fails, all(isinstance(e, PeerFailureError) and "worker2 (rank 2)" in str(e)
                             and e.peers == (2,) for e in bad), f"errors: {bad}")
            check(fails, len(good) + len(bad) == 20, "every task completed")
            check(fails, ex.workers == ["worker1"], f"workers left: {ex.workers}")
            more = list(ex.map(exit_on, [2] * 10, range(10)))
            check(fails, more == list(range(10)), f"the farm went on on rank 1: {more}")
            with open(os.path.join(report_dir, "rank0"), "w") as fh:
                fh.write(repr(fails))


@rpc.register
def signal_on(rank: int, key: str, i: int) -> int:
    """Task ``i``; on ``rank`` it sets ``key`` (its rank's thread then raises) and hangs."""
    if rpc.get_worker_info().id == rank:
        _event(key).set()
        _event(key + "-end").wait(30)
        raise RuntimeError("never answered")
    return i


def body_sim_worker_dies(rank: int, report: dict, key: str) -> None:
    """Simulated ranks: rank 2's thread raises while it holds tasks. Only they fail, naming it."""
    rpc.init_rpc(f"worker{rank}", rpc_timeout=30)
    ex = rpc.Executor(max_in_flight=2)
    if rank == 2:
        _event(key).wait(30)
        raise RuntimeError("rank 2 crashes")
    if rank == 1:
        ex.serve()
        rpc.shutdown()
        return
    fails: list[str] = []
    with ex:
        futs = [ex.submit(signal_on, 2, key, i) for i in range(20)]
        cf.wait(futs, timeout=60)
        bad = [f.exception() for f in futs if f.done() and f.exception() is not None]
        check(fails, all(f.done() for f in futs), "tasks left pending")
        check(fails, 1 <= len(bad) <= 2, f"{len(bad)} tasks failed (2 at most were on rank 2)")
        check(fails, all(isinstance(e, PeerFailureError) and "worker2 (rank 2)" in str(e)
                         for e in bad), f"errors: {bad}")
        check(fails, ex.workers == ["worker1"], f"workers left: {ex.workers}")
        check(fails, list(ex.map(signal_on, [2] * 5, [key] * 5, range(5))) == list(range(5)),
              "the farm went on on rank 1")
    _event(key + "-end").set()  # the callee threads rank 2 left behind
    rpc.shutdown()
    report[rank] = fails


def body_worker_gives_up(rank: int) -> list[str]:
    """Rank 2 serves with ``serve_timeout=0.5`` and gives up on a farm that lasts longer; rank 1
    serves through several heartbeats (the test makes them frequent) to the end."""
    from hpcdp.errors import CommTimeoutError

    fails: list[str] = []
    rpc.init_rpc(f"worker{rank}", rpc_timeout=30)
    ex = rpc.Executor(serve_timeout=0.5 if rank == 2 else None)
    if rank == 0:
        with ex:
            time.sleep(1.5)
            check(fails, sorted(ex.map(square, range(10))) == [i * i for i in range(10)],
                  "tasks after a worker stopped waiting for the farm to end")
    elif rank == 2:
        try:
            ex.serve()
            fails.append("serve_timeout=0.5 returned in a farm of 1.5 s")
        except CommTimeoutError as e:
            check(fails, "worker0 (rank 0)" in str(e) and "0.5 s" in str(e), str(e))
    else:
        try:
            ex.submit(square, 1)
            fails.append("a worker's executor accepted a task")
        except hpcdp.HpcdpError as e:
            check(fails, "only the root (rank 0) submits" in str(e), str(e))
        ex.serve()
    rpc.shutdown()
    return fails

"""``P2PBackend``: a backend whose collectives are ``_algorithms`` run over its own point-to-point.

A subclass provides ``self._p2p``, the algorithms' communicator (``rank``, ``size``, ``isend``,
``irecv``, ``wait``) plus the hooks below, and ``self._runner = Runner(self._p2p, name)``:

    p2p.check_usable(what)      # raise now if the group is already known to be broken
    p2p.begin(seq, call)        # before a collective; seq numbers the group's collectives 1, 2, ...
    p2p.end(ok)                 # after it; may still raise (e.g. mismatched messages left over)
    p2p.pending() -> str        # what the running collective waits for (timeout messages)
    p2p.abort(why)              # after a timeout: fail the group so peers stop waiting

``call`` is ``(name, dtype, count, op, root)``, what a transport needs to tell mismatched calls
apart (the TCP backend puts it and ``seq`` in every frame header). The runner runs one collective
at a time per group, in submission order, on a worker thread, so the methods return a ``Request``
at once as the ``Backend`` contract asks.
"""
from __future__ import annotations

import collections
import threading
from typing import Any, Callable

import numpy as np

from ..errors import HpcdpError
from ..ops import ReduceOp
from . import _algorithms as algo
from .base import Backend, Request

__all__ = ["P2PBackend", "Runner", "FutureRequest"]


class FutureRequest(Request):
    """Completed by the worker thread; waiting blocks on a lock, not a poll loop."""

    def __init__(self, runner: "Runner", what: str) -> None:
        self._runner = runner
        self.what = what
        self._lock = threading.Lock()
        self._lock.acquire()
        self._done = False
        self._error: BaseException | None = None

    def _set(self, error: BaseException | None) -> None:
        self._error = error
        self._done = True
        self._lock.release()

    def _check(self) -> bool:
        if self._done and self._error is not None:
            raise self._error
        return self._done

    def test(self) -> bool:
        return self._check()

    def wait(self, timeout: float | None) -> bool:
        if self._done:
            return self._check()
        got = self._lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout))
        if got:
            self._lock.release()
        return self._check()

    def pending(self) -> str:
        return self._runner.pending_text(self)

    def abandon(self) -> None:
        self._runner.abort(f"{self.what} was abandoned after a timeout")


class Runner:
    """One worker thread per group runs queued collectives in order (started lazily)."""

    def __init__(self, comm: Any, name: str) -> None:
        self.comm = comm
        self.name = name
        self._q: collections.deque[tuple[Callable[[], None], FutureRequest, int, tuple]] = (
            collections.deque())
        self._seq = 0
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.current: FutureRequest | None = None

    def submit(self, what: str, fn: Callable[[], None], call: tuple = ()) -> FutureRequest:
        """Queue ``fn``; ``call`` describes it for ``comm.begin`` (see the module docstring)."""
        req = FutureRequest(self, what)
        with self._cv:
            if self._stopped:
                raise HpcdpError(f"{what}: the backend has been shut down")
            self._seq += 1  # under the lock: sequence numbers follow the queue order
            self._q.append((fn, req, self._seq, call or (what, None, 0, None, 0)))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=f"hpcdp-{self.name}",
                                                daemon=True)
                self._thread.start()
            self._cv.notify()
        return req

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._q:
                    if self._stopped or not self._cv.wait(timeout=30.0):
                        if not self._q:
                            self._thread = None
                            return
                fn, req, seq, call = self._q.popleft()
                self.current = req
            err: BaseException | None = None
            comm, running = self.comm, False
            try:
                comm.begin(seq, call)
                running = True
                fn()
                running = False
                comm.end(True)  # may find the call mismatched after all (messages left over)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                err = exc
                if running:
                    comm.end(False)
            self.current = None
            # drop the task before waiting for the next one: its closure holds the call's
            # buffers (a broadcast's whole send buffer), which must not outlive the collective
            fn = call = None  # type: ignore[assignment]
            req._set(err)
            req = err = None  # type: ignore[assignment]

    def pending_text(self, req: FutureRequest) -> str:
        if self.current is req:
            return f"{req.what} is running; {self.comm.pending()}"
        return f"{req.what} is queued behind another collective of this group"

    def abort(self, why: str) -> None:
        self.comm.abort(why)

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()


class P2PBackend(Backend):
    """Every collective of the ``Backend`` contract, from ``_algorithms`` over ``self._p2p``.

    The algorithm is looked up on the module at call time, so tests can wrap or tune it.
    """

    _p2p: Any
    _runner: Runner

    def _go(self, name: str, like: Any, op: Any, root: int, *args: Any) -> Request:
        """Queue ``_algorithms.<name>(comm, *args)``; ``like`` (the buffer every rank holds
        alike: the send buffer, or the receive buffer of scatter), ``op`` and ``root`` describe
        the call."""
        c = self._p2p
        c.check_usable(name)
        call = (name, like.dtype, like.size, op, root) if like is not None else (name, None, 0,
                                                                                 None, 0)
        fn = getattr(algo, name)
        return self._runner.submit(name, lambda: fn(c, *args), call)

    def allreduce(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: ReduceOp) -> Request:
        return self._go("allreduce", sendbuf, op, 0, sendbuf, recvbuf, op)

    def broadcast(self, buf: np.ndarray, root: int) -> Request:
        return self._go("broadcast", buf, None, root, buf, root)

    def reduce(self, sendbuf: np.ndarray, recvbuf: np.ndarray | None, op: ReduceOp,
               root: int) -> Request:
        return self._go("reduce", sendbuf, op, root, sendbuf, recvbuf, op, root)

    def all_gather(self, sendbuf: np.ndarray, recvbuf: np.ndarray) -> Request:
        return self._go("all_gather", sendbuf, None, 0, sendbuf, recvbuf)

    def gather(self, sendbuf: np.ndarray, recvbuf: np.ndarray | None, root: int) -> Request:
        return self._go("gather", sendbuf, None, root, sendbuf, recvbuf, root)

    def scatter(self, sendbuf: np.ndarray | None, recvbuf: np.ndarray, root: int) -> Request:
        return self._go("scatter", recvbuf, None, root, sendbuf, recvbuf, root)

    def reduce_scatter(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: ReduceOp) -> Request:
        return self._go("reduce_scatter", sendbuf, op, 0, sendbuf, recvbuf, op)

    def all_to_all(self, sendbuf: np.ndarray, recvbuf: np.ndarray) -> Request:
        return self._go("all_to_all", sendbuf, None, 0, sendbuf, recvbuf)

    def barrier(self) -> Request:
        return self._go("barrier", None, None, 0)

    def shutdown(self) -> None:
        self._runner.stop()

"""``Future``: the result of ``rpc_async`` and of internal requests.

Every RPC future completes by itself (result, remote error, its own deadline or the peer's
failure), so ``wait()`` without a timeout cannot hang past the call's ``timeout``. User callbacks
(``then``, ``add_done_callback``) run on one process-wide callback thread, never on a transport
thread, so a callback may itself make blocking RPCs.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable

from ..comm.validation import check_timeout
from ..errors import CommTimeoutError
from ._duty import before_blocking

__all__ = ["Future", "callbacks_idle"]

_PENDING = object()
#: at most this long a waiting thread reads its reply itself; then the transport's own
#: threads deliver it (a long wait should not keep them from serving requests)
DIRECT_BUDGET = 0.02


class _CallbackRunner:
    """One daemon thread running user callbacks in order, each with its agent as the current one."""

    def __init__(self) -> None:
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.busy = 0
        self.thread: threading.Thread | None = None

    def submit(self, fn: Callable[[], None]) -> None:
        with self.lock:
            self.busy += 1
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="hpcdp-rpc-callbacks",
                                               daemon=True)
                self.thread.start()
        self.q.put(fn)

    def _run(self) -> None:
        while True:
            fn = self.q.get()
            try:
                fn()
            finally:
                with self.lock:
                    self.busy -= 1


_runner = _CallbackRunner()


def callbacks_idle() -> bool:
    return _runner.busy == 0


_state_lock = threading.Lock()  # guards every future's outcome and callback lists (short holds)


class Future:
    """A value that arrives later: ``wait()``, ``done()``, ``then(cb)``, ``value()``."""

    __slots__ = ("_gate", "_value", "_error", "_callbacks", "_internal", "what", "_context",
                 "_direct", "_deadline", "_mid")

    def __init__(self, what: str = "rpc", context: Any = None) -> None:
        # held until the outcome is in: waiters block on it, then pass it on
        self._gate = threading.Lock()
        self._gate.acquire()
        self._value: Any = _PENDING
        self._error: BaseException | None = None
        self._callbacks: list[Callable[["Future"], Any]] | None = None
        self._internal: list[Callable[["Future"], Any]] | None = None
        self.what = what
        self._context = context  # the agent whose calls user callbacks may make
        #: ``direct(fut, until)``: make the transport's progress on the waiting thread (our
        #: reply is then read here, with no hand-off) until the future completes or ``until``
        self._direct: Callable[["Future", float], None] | None = None
        #: the call's deadline (monotonic) and id: a waiter expires the call itself at the
        #: deadline, so a timeout fires even while the agent's timer thread is held up
        self._deadline: float | None = None
        self._mid = 0

    def done(self) -> bool:
        """Whether the result (or error) is in."""
        return self._value is not _PENDING

    def wait(self, timeout: float | None = None) -> Any:
        """The result, raising the call's error (``RemoteError``, ``CommTimeoutError``, ...).

        Args:
            timeout: seconds to wait here (None: until the call itself completes or times out);
                running out raises ``CommTimeoutError`` and leaves the call running.
        """
        if timeout is not None:
            check_timeout(f"{self.what}: Future.wait(): timeout={timeout!r}", timeout, named=True)
        if self._value is _PENDING:
            self._block(timeout)
        if self._error is not None:
            try:
                raise self._error
            finally:
                # the traceback will hold this frame: it must not hold the future (whose
                # error holds the traceback), or the call's arguments live until a GC cycle
                self = None  # noqa: PLW0642
        return self._value

    result = wait

    def _timed_out(self, timeout: float | None) -> None:
        raise CommTimeoutError(f"{self.what}: not complete after waiting {timeout:g} s (the "
                               "call goes on)")

    def _block(self, timeout: float | None) -> None:
        before_blocking()  # a serving duty this thread holds goes to another thread first
        now = time.monotonic()
        until = None if timeout is None else now + max(0.0, timeout)
        deadline = self._deadline
        direct = self._direct
        if direct is not None:
            stop = now + DIRECT_BUDGET
            if until is not None and until < stop:
                stop = until
            if deadline is not None and deadline < stop:
                stop = deadline
            direct(self, stop)
        while self._value is _PENDING:
            limit = until
            if deadline is not None and (limit is None or deadline < limit):
                limit = deadline
            left = -1 if limit is None else max(0.0, limit - time.monotonic())
            if self._gate.acquire(timeout=left):
                self._gate.release()  # the next waiter passes too
                return
            if self._value is not _PENDING:
                return
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                if self._context is not None:
                    self._context.expire_call(self._mid)  # fails this future, unless whoever
                deadline = None  # took the call off the books is completing it right now
                continue
            if until is not None and now >= until:
                self._timed_out(timeout)

    def _sleep(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for the outcome (a polling transport's pause); True if in."""
        if self._gate.acquire(timeout=seconds):
            self._gate.release()
            return True
        return self._value is not _PENDING

    def value(self) -> Any:
        """The result of a completed future (raises its error; ``ValueError`` if not done)."""
        if self._value is _PENDING:
            raise ValueError(f"{self.what}: value() called before the future completed")
        return self.wait()

    def exception(self) -> BaseException | None:
        return self._error if self.done() else None

    def set_result(self, value: Any) -> bool:
        return self._complete(value, None)

    def set_exception(self, error: BaseException) -> bool:
        return self._complete(None, error)

    def _complete(self, value: Any, error: BaseException | None) -> bool:
        with _state_lock:
            if self._value is not _PENDING:
                return False  # first outcome wins (a reply racing its deadline)
            self._error = error
            self._value = value
            internal, self._internal = self._internal, None
            callbacks, self._callbacks = self._callbacks, None
        self._gate.release()
        for fn in internal or ():
            fn(self)
        for fn in callbacks or ():
            self._schedule(fn)
        return True

    def _schedule(self, fn: Callable[["Future"], Any]) -> None:
        ctx = self._context

        def run() -> None:
            from ._context import using

            try:
                with using(ctx):
                    fn(self)
            except BaseException:  # noqa: BLE001 - a failing callback must not kill the thread
                import logging

                logging.getLogger("hpcdp.rpc").exception("%s: a done-callback raised", self.what)

        _runner.submit(run)

    def add_done_callback(self, fn: Callable[["Future"], Any]) -> None:
        """Run ``fn(self)`` on the callback thread once complete (at once if already)."""
        with _state_lock:
            if self._value is _PENDING:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(fn)
                return
        self._schedule(fn)

    def _on_done(self, fn: Callable[["Future"], Any]) -> None:
        """Internal: run ``fn(self)`` on the completing thread (must be quick, must not block)."""
        with _state_lock:
            if self._value is _PENDING:
                if self._internal is None:
                    self._internal = []
                self._internal.append(fn)
                return
        fn(self)

    def then(self, callback: Callable[["Future"], Any]) -> "Future":
        """A new future holding ``callback(self)``'s return value (or what it raised)."""
        nxt = Future(f"{self.what}.then", self._context)

        def chain(f: "Future") -> None:
            try:
                nxt.set_result(callback(f))
            except BaseException as exc:  # noqa: BLE001 - delivered through the new future
                nxt.set_exception(exc)

        self.add_done_callback(chain)
        return nxt

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._error else "done")
        return f"<rpc.Future {self.what} {state}>"

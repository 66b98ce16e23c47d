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

from ..errors import CommTimeoutError

__all__ = ["Future", "callbacks_idle"]

_PENDING = object()


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
                 "_progress")

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
        self._progress: Any = None  # a polled transport: the waiting thread polls it

    def done(self) -> bool:
        """Whether the result (or error) is in."""
        return self._value is not _PENDING

    def wait(self, timeout: float | None = None) -> Any:
        """The result, raising the call's error (``RemoteError``, ``CommTimeoutError``, ...).

        Args:
            timeout: seconds to wait here (None: until the call itself completes or times out);
                running out raises ``CommTimeoutError`` and leaves the call running.
        """
        if self._value is _PENDING:
            if self._progress is not None:
                self._wait_polling(timeout)
            elif not self._gate.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
                self._timed_out(timeout)
            else:
                self._gate.release()  # the next waiter passes too
        if self._error is not None:
            raise self._error
        return self._value

    result = wait

    def _timed_out(self, timeout: float | None) -> None:
        raise CommTimeoutError(f"{self.what}: not complete after waiting {timeout:g} s (the "
                               "call goes on)")

    def _wait_polling(self, timeout: float | None) -> None:
        """Make the transport's progress ourselves while waiting (our reply is then delivered
        on this thread, with no handoff); if another thread holds the progress token, block
        on the gate briefly instead."""
        from ._pool import idle_pause

        progress = self._progress
        now = time.monotonic()
        deadline = None if timeout is None else now + timeout
        last = now
        progress.waiting(1)
        try:
            while self._value is _PENDING:
                busy = progress.poll()
                if self._value is not _PENDING:
                    break
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    self._timed_out(timeout)
                if busy:
                    last = now
                elif busy is None or now - last > 0.05:  # someone else polls / a long wait
                    if self._gate.acquire(timeout=1e-3):
                        self._gate.release()
                        break
                else:
                    idle_pause(now - last)
        finally:
            progress.waiting(-1)

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

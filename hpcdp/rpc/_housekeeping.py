"""The agent's two helper threads: the control thread and the timer.

* control: runs protocol work in order (RRef forks, accepts and deletes, their replies, the
  shutdown coordination's handlers). It may block in a send; ``RRef.__del__`` only queues work
  for it, lock-free.
* timer: never sends and never blocks. It fails calls whose deadline passed (a waiting caller
  also does this itself, see ``Future``), hands off the duty of an inline callee that runs long
  (``_duty``), polls a polled transport when no thread does.
  It ticks every few milliseconds while callees run inline or the transport is polled, else
  sleeps until the next deadline (at most ``_LONG``), and the first inline callee after a quiet
  spell wakes it.
"""
from __future__ import annotations

import heapq
import logging
import queue
import threading
import time
from typing import Any, Callable, Hashable

from ..errors import CommTimeoutError
from ._context import using
from ._duty import GRACE, InlinePolicy, Lent

__all__ = ["Housekeeping"]

LOG = logging.getLogger("hpcdp.rpc")
_STOP = object()
_TICK = GRACE
_LONG = 0.05
_QUIET = 1.0  # seconds without inline callees before the timer sleeps long


class Housekeeping:
    """Mixin of ``Agent``: the control queue, the timer, and the bookkeeping of inline callees."""

    def _start_housekeeping(self) -> None:
        self._control_q: queue.SimpleQueue = queue.SimpleQueue()
        self._control_busy = False
        self._lent: dict[int, Lent] = {}
        self._last_lent = 0.0
        self._timer_cv = threading.Condition()
        self._timer_long = False
        self._timer_stop = False
        self.policy = InlinePolicy()
        self._control_thread = threading.Thread(target=self._control_loop, daemon=True,
                                                name=f"hpcdp-rpc{self.rank}-control")
        self._timer_thread = threading.Thread(target=self._timer_loop, daemon=True,
                                              name=f"hpcdp-rpc{self.rank}-timer")

    # -- the control thread -----------------------------------------------------------------
    def control(self, fn: Callable[[], None], quiet: bool = False) -> None:
        """Run ``fn`` on the control thread (lock-free: safe from ``__del__``)."""
        self._control_q.put(fn)

    def _control_loop(self) -> None:
        with using(self):
            while True:
                fn = self._control_q.get()
                if fn is _STOP:
                    return
                self._control_busy = True
                try:
                    fn()
                except Exception:  # noqa: BLE001 - one failed task never stops the thread
                    LOG.exception("hpcdp.rpc: rank %d: control task failed", self.rank)
                finally:
                    self._control_busy = False

    def control_idle(self) -> bool:
        return self._control_q.empty() and not self._control_busy

    # -- inline callees (``_duty``) ----------------------------------------------------------
    def inline_or_pool(self, src: int, mid: int, job: Callable[[], None], key: Hashable,
                       may_inline: bool, force: bool = False, frame: Any = None) -> Lent | None:
        """A ``Lent`` task for the serving thread when ``job`` may run there, else queue it."""
        if may_inline and self.policy.allows(key):
            return Lent(self, job, key)
        self.submit(src, mid, self._timed(job, key), force=force, frame=frame)
        return None

    def _timed(self, job: Callable[[], None], key: Hashable) -> Callable[[], None]:
        def run() -> None:
            t0 = time.monotonic()
            try:
                job()
            finally:
                self.policy.record(key, time.monotonic() - t0, False)

        return run

    def lent_started(self, lent: Lent) -> None:
        self._lent[id(lent)] = lent
        self._last_lent = lent.start
        if self._timer_long:  # the timer sleeps long: have it watch this callee
            with self._timer_cv:
                self._timer_long = False
                self._timer_cv.notify()

    def lent_ended(self, lent: Lent, seconds: float) -> None:
        self._lent.pop(id(lent), None)
        self.pool.end_inline()
        self.policy.record(lent.key, seconds, lent.handed)

    def requeue(self, lent: Lent) -> None:
        """An inline task its serving thread will not run after all: to the pool."""
        self.pool.submit(self._timed(lent.fn, lent.key), force=True)

    # -- the timer ---------------------------------------------------------------------------
    def _timer_loop(self) -> None:
        polled = self._polled
        with using(self):
            while not self._timer_stop:
                now = time.monotonic()
                busy = polled is not None or self._lent or now - self._last_lent < _QUIET
                wait = _TICK if busy else _LONG
                with self._lock:
                    if self._deadlines:
                        wait = min(wait, max(0.0, self._deadlines[0][0] - now))
                with self._timer_cv:
                    self._timer_long = wait > _TICK
                    if not self._timer_stop:
                        self._timer_cv.wait(wait)
                    self._timer_long = False
                try:
                    now = time.monotonic()
                    self._expire(now)
                    for lent in list(self._lent.values()):
                        if lent.overdue(now):
                            lent.hand_off()
                    if polled is not None and not self.pool.leading and not polled.pumpers:
                        polled.poll()  # progress even while every pool thread is busy
                except Exception:  # noqa: BLE001 - the timer must keep going
                    LOG.exception("hpcdp.rpc: rank %d: timer task failed", self.rank)

    def _expire(self, now: float) -> None:
        expired = []
        with self._lock:
            heap = self._deadlines
            while heap and heap[0][0] <= now:
                p = self._pending.pop(heapq.heappop(heap)[1], None)
                if p is not None:
                    expired.append(p)
            if len(heap) > 2 * len(self._pending) + 4096:  # drop entries of answered requests
                self._deadlines = [(d, m) for d, m in heap if m in self._pending]
                heapq.heapify(self._deadlines)
        for p in expired:
            p.fut.set_exception(CommTimeoutError(
                f"{p.what} did not complete within {p.timeout:g} s"))

    def expire_call(self, mid: int) -> None:
        """A caller waited until its call's deadline: fail the call now (the timer may be late)."""
        with self._lock:
            p = self._pending.pop(mid, None)
        if p is not None:
            p.fut.set_exception(CommTimeoutError(
                f"{p.what} did not complete within {p.timeout:g} s"))

    def _stop_housekeeping(self) -> None:
        self._control_q.put(_STOP)
        with self._timer_cv:
            self._timer_stop = True
            self._timer_cv.notify()

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

Both threads live in one component because the timer's rhythm depends on the inline callees
it watches; the agent holds it (``agent.house``) and the threads reach the agent only through
the reference given to ``Housekeeping``, so what they touch is listed in one place.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Hashable

from ._context import using
from ._duty import GRACE, InlinePolicy, Lent

if TYPE_CHECKING:
    from ._agent import Agent

__all__ = ["Housekeeping"]

LOG = logging.getLogger("hpcdp.rpc")
_STOP = object()
_TICK = GRACE
_LONG = 0.05
_QUIET = 1.0  # seconds without inline callees before the timer sleeps long


class Housekeeping:
    """The control queue, the timer, and the bookkeeping of inline callees of one ``Agent``.

    Built before the agent's transport (whose threads may queue control work at once) and
    started by ``start`` once the agent has its pool. Of the agent it uses: ``rank`` (thread
    names, logs), ``pool`` (read when used: inline callees count against it, long ones go
    back to it), ``next_deadline``/``expire`` (its pending calls), and the agent itself as the
    current one on both threads (their work may make RPC calls)."""

    __slots__ = ("_agent", "_rank", "_control_q", "_control_busy", "_lent", "_last_lent",
                 "_timer_cv", "_timer_long", "_timer_stop", "policy", "_polled",
                 "_control_thread", "_timer_thread")

    def __init__(self, agent: "Agent") -> None:
        self._agent = agent
        self._rank = agent.rank
        self._control_q: queue.SimpleQueue = queue.SimpleQueue()
        self._control_busy = False
        self._lent: dict[int, Lent] = {}
        self._last_lent = 0.0
        self._timer_cv = threading.Condition()
        self._timer_long = False
        self._timer_stop = False
        #: which callees may run inline (``_duty``): each callee's recent durations
        self.policy = InlinePolicy()
        self._polled: Any = None
        self._control_thread = threading.Thread(target=self._control_loop, daemon=True,
                                                name=f"hpcdp-rpc{self._rank}-control")
        self._timer_thread = threading.Thread(target=self._timer_loop, daemon=True,
                                              name=f"hpcdp-rpc{self._rank}-timer")

    def start(self, polled: Any) -> None:
        """Start both threads; the timer polls ``polled`` (a transport) when no thread does."""
        self._polled = polled
        self._control_thread.start()
        self._timer_thread.start()

    def stop(self) -> None:
        """Both threads end: the control thread after the work queued before this."""
        self._control_q.put(_STOP)
        with self._timer_cv:
            self._timer_stop = True
            self._timer_cv.notify()

    # -- the control thread -----------------------------------------------------------------
    def control(self, fn: Callable[[], None], quiet: bool = False) -> None:
        """Run ``fn`` on the control thread (lock-free: safe from ``__del__``)."""
        self._control_q.put(fn)

    def _control_loop(self) -> None:
        with using(self._agent):
            while True:
                fn = self._control_q.get()
                if fn is _STOP:
                    return
                self._control_busy = True
                try:
                    fn()
                except Exception:  # noqa: BLE001 - one failed task never stops the thread
                    LOG.exception("hpcdp.rpc: rank %d: control task failed", self._rank)
                finally:
                    self._control_busy = False

    def control_idle(self) -> bool:
        """Nothing queued for the control thread and nothing running on it."""
        return self._control_q.empty() and not self._control_busy

    def control_queue_empty(self) -> bool:
        """Nothing queued (for a task on the control thread, which is itself running)."""
        return self._control_q.empty()

    # -- inline callees (``_duty``) ----------------------------------------------------------
    def timed(self, job: Callable[[], None], key: Hashable) -> Callable[[], None]:
        """``job`` for the pool, its duration recorded for ``key`` (so it may run inline again)."""
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
        self._agent.pool.end_inline()
        self.policy.record(lent.key, seconds, lent.handed)

    def requeue(self, lent: Lent) -> None:
        """An inline task its serving thread will not run after all: to the pool."""
        self._agent.pool.submit(self.timed(lent.fn, lent.key), force=True)

    # -- the timer ---------------------------------------------------------------------------
    def _timer_loop(self) -> None:
        agent, polled = self._agent, self._polled
        with using(agent):
            while not self._timer_stop:
                now = time.monotonic()
                busy = polled is not None or self._lent or now - self._last_lent < _QUIET
                wait = _TICK if busy else _LONG
                deadline = agent.next_deadline()
                if deadline is not None:
                    wait = min(wait, max(0.0, deadline - now))
                with self._timer_cv:
                    self._timer_long = wait > _TICK
                    if not self._timer_stop:
                        self._timer_cv.wait(wait)
                    self._timer_long = False
                try:
                    now = time.monotonic()
                    agent.expire(now)
                    for lent in list(self._lent.values()):
                        if lent.overdue(now):
                            lent.hand_off()
                    if polled is not None and not agent.pool.leading and not polled.pumpers:
                        polled.poll()  # progress even while every pool thread is busy
                except Exception:  # noqa: BLE001 - the timer must keep going
                    LOG.exception("hpcdp.rpc: rank %d: timer task failed", self._rank)

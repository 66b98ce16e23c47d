"""Running a short callee on the thread that read its request, without losing progress.

A *duty* is a role one thread holds: reading one TCP peer's socket, leading the MPI progress, or
dispatching a simulated rank's inbox. Handing each request to a pool thread costs a wake-up and
a pass of the GIL (most of a small call's cost on a loaded machine), so
the holder runs the callee itself ("inline", a ``Lent`` task). While it does, nobody serves the
duty, which is safe only because the duty moves to another thread whenever the callee could
hold it up:

* before this thread blocks in RPC (``Future.wait``, an RRef's fork or value, a send that would
  block) it hands the duty off first (``before_blocking``), so a nested call never waits for a
  message that only it could read;
* the agent's timer hands off the duty of a callee that has run past ``GRACE`` (one that sleeps
  or waits on a lock); the old holder finishes its callee and leaves the duty to the new one;
* a function that ran long on average, or had to hand its duty off, runs on the pool instead
  (``InlinePolicy``), until its calls are short again.

Inline callees count against the pool's ``num_worker_threads`` like pooled ones, from the moment
they start (a serving thread may hold several found by one poll, and runs them in turn).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Hashable

from . import _context

__all__ = ["Lent", "InlinePolicy", "before_blocking", "lent_here", "GRACE"]

LOG = logging.getLogger("hpcdp.rpc")

#: a callee that runs inline longer than this (wall clock: generous, since a loaded machine
#: preempts threads for milliseconds) hands its duty to another thread
GRACE = 0.01
#: functions whose calls average more than this run on the pool
INLINE_MAX = 0.001
_ALPHA = 0.2
_tls = threading.local()


def lent_here() -> "Lent | None":
    """The inline task this thread is running, if any."""
    return getattr(_tls, "lent", None)


def before_blocking() -> None:
    """Called where this thread may block in RPC: a duty it holds goes to another thread first."""
    lent = getattr(_tls, "lent", None)
    if lent is not None:
        lent.hand_off()


class InlinePolicy:
    """Which callees may run inline: a moving average of each one's duration."""

    def __init__(self) -> None:
        self.avg: dict[Hashable, float] = {}

    def allows(self, key: Hashable) -> bool:
        return self.avg.get(key, 0.0) <= INLINE_MAX

    def record(self, key: Hashable, seconds: float, handed: bool) -> None:
        if len(self.avg) > 4096 and key not in self.avg:
            self.avg.clear()  # many distinct keys (method names are the peer's): start over
        old = self.avg.get(key)
        if handed:
            seconds = max(seconds, 10 * INLINE_MAX)  # off the inline path for a while
        elif old is None:
            seconds = min(seconds, 2 * INLINE_MAX)  # a cold first call says little
        self.avg[key] = seconds if old is None else old + _ALPHA * (seconds - old)


class Lent:
    """A callee run by the holder of a duty; ``run`` says whether the duty was handed off.

    Of its agent it uses ``rank``, ``pool`` (``try_inline``), ``lent_started``,
    ``lent_ended`` and ``requeue`` (the agent's ``Housekeeping`` does the bookkeeping), and
    makes the agent the current one while the callee runs."""

    __slots__ = ("agent", "fn", "key", "start", "_handoff", "handed", "_lock")

    def __init__(self, agent: Any, fn: Callable[[], None], key: Hashable) -> None:
        self.agent, self.fn, self.key = agent, fn, key
        self.start = 0.0
        self._handoff: Callable[[], None] | None = None
        self.handed = False
        self._lock = threading.Lock()

    def run(self, handoff: Callable[[], None]) -> bool:
        """Run the callee here; ``handoff()`` gives the duty to another thread if it must.

        A callee that would exceed the agent's bound on running callees goes to its pool.
        """
        agent = self.agent
        if not agent.pool.try_inline():
            agent.requeue(self)
            return False
        self._handoff = handoff
        self.start = t0 = time.monotonic()
        prev = getattr(_tls, "lent", None)
        _tls.lent = self
        ctx = _context._tls
        prev_agent = getattr(ctx, "agent", None)
        ctx.agent = agent  # the callee's own calls go through this agent
        agent.lent_started(self)
        try:
            self.fn()
        except BaseException:  # noqa: BLE001 - tasks report their own errors
            LOG.exception("hpcdp.rpc: rank %d: an inline task failed", agent.rank)
        finally:
            ctx.agent = prev_agent
            _tls.lent = prev
            agent.lent_ended(self, time.monotonic() - t0)
        return self.handed

    def overdue(self, now: float) -> bool:
        return not self.handed and now - self.start > GRACE

    def hand_off(self) -> None:
        """Give the duty to another thread (once; from this thread or the agent's timer)."""
        with self._lock:
            if self.handed or self._handoff is None:
                return
            self.handed = True
        try:
            self._handoff()
        except Exception:  # noqa: BLE001 - a failed hand-off leaves the duty here; say so
            LOG.exception("hpcdp.rpc: rank %d: could not hand a serving duty off",
                          self.agent.rank)

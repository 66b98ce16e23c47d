"""A bounded pool for callee functions: at most ``threads`` run at once, ``queue_cap`` wait.

Threads start on demand and stay; ``submit`` never blocks (a transport thread calls it) and
returns False when the queue is full, so the agent can answer "busy" instead of piling up work.
Callees run inline by a transport's serving thread (``_duty``) count against the same bound
(``try_inline``).

The pool also makes the channel's progress (``_channel``), leader/follower style: one idle
thread, the leader, polls and runs the short callees its polls find itself (the leader's duty
is lent to them, see ``_duty``); when a poll queues work for the pool it hands the lead to
another idle thread (or starts one) and runs the work itself, so a request goes from the wire to
its function on one thread. While a caller polls for its own reply, the leader parks.
"""
from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from typing import Any, Callable

from ._context import using

__all__ = ["Pool", "idle_pause"]

LOG = logging.getLogger("hpcdp.rpc")

_SPIN = 2e-3  # seconds of back-to-back polls after the last activity
_NAP = 0.05   # then polls with a yield between them; after that, one per millisecond


def idle_pause(idle: float, others: bool = False) -> None:
    """Wait between polls that found nothing, by how long nothing has been found.

    Like ``backends.base.poll_until``: back to back at first (latency), then yielding, then
    millisecond sleeps. ``others``: another thread of ours needs the interpreter (a callee
    running), so really sleep; a thread that only drops the GIL around each MPI call gets it
    straight back, and the other waits for the interpreter's 5 ms switch interval.
    """
    if others:
        time.sleep(1e-5 if idle < _NAP else 1e-3)
    elif idle >= _SPIN:
        time.sleep(0 if idle < _NAP else 1e-3)


class Pool:
    def __init__(self, name: str, threads: int, queue_cap: int, agent: Any,
                 progress: Any = None) -> None:
        if threads < 1:
            raise ValueError(f"rpc: num_worker_threads must be >= 1, got {threads}")
        self.name, self.max_threads, self.queue_cap, self.agent = name, threads, queue_cap, agent
        self.progress = progress  # a transport with poll(), parked() and pumpers, or None
        self._mutex = threading.Lock()
        self.cv = threading.Condition(self._mutex)
        self.tasks: collections.deque[Callable[[], None]] = collections.deque()
        self.threads: list[threading.Thread] = []
        self.idle_threads = 0
        self.running = 0
        self.inline = 0
        self.leading = False
        self._lead_token: object | None = None
        self._batch: collections.deque[Any] = collections.deque()  # found by the leader's poll
        self.closed = False
        self._n = 0
        if progress is not None:
            with self.cv:
                self._spawn()  # the first leader

    def _spawn(self) -> None:
        self._n += 1
        t = threading.Thread(target=self._work, daemon=True, name=f"{self.name}-{self._n}")
        self.threads.append(t)
        t.start()

    def _cap(self) -> int:
        """Threads at most: one per callee, plus the leader of a polled transport."""
        self.threads = [t for t in self.threads if t.is_alive()]
        return self.max_threads + (self.progress is not None)

    def submit(self, fn: Callable[[], None], *, force: bool = False) -> bool:
        """Queue ``fn``; False if the queue is full (``force`` ignores the cap) or closed."""
        with self.cv:
            if self.closed or (len(self.tasks) >= self.queue_cap and not force):
                return False
            self.tasks.append(fn)
            self.cv.notify()
            # idle threads count until they wake and take a task: start one more if too few
            if len(self.tasks) > self.idle_threads and len(self.threads) < self._cap():
                self._spawn()
        return True

    def try_inline(self) -> bool:
        """Count one callee run inline by a serving thread, if the bound allows it."""
        with self._mutex:
            if self.closed or self.tasks or self.running + self.inline >= self.max_threads:
                return False
            self.inline += 1
            return True

    def end_inline(self) -> None:
        with self._mutex:
            self.inline -= 1
            if self.closed:
                self.cv.notify_all()

    def idle(self) -> bool:
        with self.cv:
            return not self.tasks and not self._batch and self.running == 0 and \
                self.inline == 0

    def _work(self) -> None:
        with using(self.agent):
            while True:
                with self.cv:
                    lead = False
                    self.idle_threads += 1
                    while not self.tasks and not self.closed:
                        if self.progress is not None and not self.leading:
                            self.leading = lead = True
                            break
                        self.cv.wait()
                    self.idle_threads -= 1
                    if not lead:
                        if not self.tasks:
                            return  # closed
                        fn = self.tasks.popleft()
                        self.running += 1
                if lead:
                    try:
                        self._lead()
                    except BaseException:  # noqa: BLE001 - a bug must not leave nobody leading
                        LOG.exception("%s: progress failed", self.name)
                        time.sleep(0.05)  # a bug that fails every poll logs 20 times a second
                    continue
                try:
                    fn()
                except BaseException:  # noqa: BLE001 - tasks report their own errors
                    LOG.exception("%s: task failed", self.name)
                finally:
                    with self.cv:
                        self.running -= 1
                        self.cv.notify_all()

    def _pass_lead(self, token: object) -> None:
        """The leader's duty goes to an idle thread (or a new one): the inline callee of the
        leadership ``token`` runs long. The callees its poll found after that one go to the
        pool now, not once the long one is done."""
        with self.cv:
            if self._lead_token is not token:
                return  # that leadership has ended already
            self._lead_token = None
            self.leading = False
            rest, self._batch = list(self._batch), collections.deque()
            if not self.closed:
                if self.idle_threads:
                    self.cv.notify()
                else:
                    self._spawn()
        for task in rest:
            self.agent.requeue(task)

    def _lead(self) -> None:
        """Poll and run the short callees found, until a poll queues work for the pool, the
        lead is handed off, or the pool closes."""
        progress, last = self.progress, time.monotonic()
        token = object()
        handoff = functools.partial(self._pass_lead, token)
        with self.cv:
            self._lead_token = token
        try:
            while True:
                if progress.parked():  # a caller polls for its own reply: it serves everything
                    last = time.monotonic()
                else:
                    busy = self._poll_into_batch(progress)
                    while True:
                        with self.cv:
                            if self._lead_token is not token or not self._batch:
                                break
                            task = self._batch.popleft()
                        if task.run(handoff):
                            return  # another thread leads now; the rest went to the pool
                        # transfers in flight move on between callees, not only between batches
                        self._poll_into_batch(progress)
                    if busy:
                        last = time.monotonic()
                with self.cv:
                    # queued work takes this thread only while a callee may start: with every
                    # worker busy it leads on, or nobody would poll until a callee ends
                    if self.closed or self.tasks and \
                            self.running + self.inline < self.max_threads:
                        if self._lead_token is token:
                            self._lead_token = None
                            self.leading = False
                            if self.idle_threads:
                                self.cv.notify()  # an idle follower takes the lead (or a task)
                            elif len(self.threads) < self._cap() and not self.closed:
                                self._spawn()
                        return
                    others = self.running > 0 or self.inline > 0
                progress.idle_pause(time.monotonic() - last, others)
        finally:
            with self.cv:
                rest, self._batch = (list(self._batch), collections.deque()) \
                    if self._lead_token is token else ([], self._batch)
                if self._lead_token is token:
                    self._lead_token = None
                    self.leading = False
            for task in rest:  # only after an error: nothing is left behind
                self.agent.requeue(task)

    def _poll_into_batch(self, progress: Any) -> bool:
        found: list[Any] = []
        busy = progress.poll(found)
        if found:
            with self.cv:
                self._batch.extend(found)
        return bool(busy) or bool(found)

    def close(self, wait: float = 0.0) -> None:
        """Stop taking work; let queued tasks finish for up to ``wait`` seconds."""
        with self.cv:
            self.closed = True
            self.cv.notify_all()
            deadline = time.monotonic() + wait
            while (self.tasks or self.running or self.inline) and time.monotonic() < deadline:
                self.cv.wait(deadline - time.monotonic())
            self.tasks.clear()
            self.cv.notify_all()

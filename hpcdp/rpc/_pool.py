"""A bounded pool for callee functions: at most ``threads`` run at once, ``queue_cap`` wait.

Threads start on demand and stay; ``submit`` never blocks (a transport thread calls it) and
returns False when the queue is full, so the agent can answer "busy" instead of piling up work.

With a polled transport (MPI) the pool also makes progress, leader/follower style: one idle
thread, the leader, polls; when its poll queues work it hands the lead to another idle thread
(or starts one) and runs the work itself, so a request goes from the wire to its function on
one thread. While some thread waits for its own reply and polls for it, the leader steps back.
"""
from __future__ import annotations

import collections
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
        self.progress = progress  # a transport with poll() and pumpers, or None
        self.cv = threading.Condition()
        self.tasks: collections.deque[Callable[[], None]] = collections.deque()
        self.threads: list[threading.Thread] = []
        self.idle_threads = 0
        self.running = 0
        self.leading = False
        self.closed = False
        if progress is not None:
            with self.cv:
                self._spawn()  # the first leader

    def _spawn(self) -> None:
        t = threading.Thread(target=self._work, daemon=True, name=f"{self.name}-{len(self.threads)}")
        self.threads.append(t)
        t.start()

    def submit(self, fn: Callable[[], None], *, force: bool = False) -> bool:
        """Queue ``fn``; False if the queue is full (``force`` ignores the cap) or closed."""
        with self.cv:
            if self.closed or (len(self.tasks) >= self.queue_cap and not force):
                return False
            self.tasks.append(fn)
            self.cv.notify()
            # idle threads count until they wake and take a task: start one more if too few
            if len(self.tasks) > self.idle_threads and len(self.threads) < self.max_threads:
                self._spawn()
        return True

    def idle(self) -> bool:
        with self.cv:
            return not self.tasks and self.running == 0

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
                    self._lead()
                    continue
                try:
                    fn()
                except BaseException:  # noqa: BLE001 - tasks report their own errors
                    LOG.exception("%s: task failed", self.name)
                finally:
                    with self.cv:
                        self.running -= 1
                        self.cv.notify_all()

    def _lead(self) -> None:
        """Poll until the poll queued work (or the pool closes), then pass the lead on."""
        progress, last = self.progress, time.monotonic()
        while True:
            if progress.pumpers:
                time.sleep(1e-4)  # a waiting caller polls; look again now and then
            busy = progress.poll()
            with self.cv:
                if self.tasks or self.closed:
                    self.leading = False
                    if self.idle_threads:
                        self.cv.notify()  # an idle follower takes the lead (or a task)
                    elif len(self.threads) < self.max_threads and not self.closed:
                        self._spawn()
                    return
            now = time.monotonic()
            if busy:
                last = now
            else:
                idle_pause(now - last, others=self.running > 0)

    def close(self, wait: float = 0.0) -> None:
        """Stop taking work; let queued tasks finish for up to ``wait`` seconds."""
        with self.cv:
            self.closed = True
            self.cv.notify_all()
            deadline = time.monotonic() + wait
            while (self.tasks or self.running) and time.monotonic() < deadline:
                self.cv.wait(deadline - time.monotonic())
            self.tasks.clear()
            self.cv.notify_all()

"""The MPI backend's ``Chain`` (a request, then host-side work): once only, never after it was
given up on. Pure Python with stand-in requests: no MPI needed."""
from __future__ import annotations

import threading

import pytest

from hpcdp.backends.mpi._requests import Chain
from hpcdp.backends.base import Request


class _Req(Request):
    """A stand-in request: completes when told; ``tested`` is set by the thread named ``spy``."""

    def __init__(self) -> None:
        self.complete = False
        self.tested = threading.Event()

    def test(self) -> bool:
        if threading.current_thread().name == "spy":
            self.tested.set()
        return self.complete

    def wait(self, timeout: float | None) -> bool:
        return self.complete

    def pending(self) -> str:
        return "stand-in did not complete"

    def abandon(self) -> bool | None:
        return True if self.complete else None


def test_work_after_completion_runs_once_when_two_threads_see_it() -> None:
    """DDP's progress thread and a ``wait`` may both see the request complete: staging's
    ``then`` gives pinned buffers back to a pool, and twice would hand one to two operations."""
    req = _Req()
    req.complete = True
    calls: list[str] = []
    inside, release = threading.Event(), threading.Event()

    def then() -> None:
        calls.append(threading.current_thread().name)
        inside.set()
        release.wait(30)

    chain = Chain(req, then)
    first = threading.Thread(target=chain.test, name="first", daemon=True)
    first.start()
    assert inside.wait(30)
    second = threading.Thread(target=chain.test, name="spy", daemon=True)
    second.start()
    assert req.tested.wait(30)  # the second thread saw the request complete
    release.set()
    first.join(30)
    second.join(30)
    assert not first.is_alive() and not second.is_alive()
    assert calls == ["first"] and chain.done


def test_work_never_runs_after_the_request_was_given_up() -> None:
    """A receive given up on must not copy into the caller's array when it completes later
    (float16's chain copied late before)."""
    req = _Req()
    ran: list[str] = []
    chain = Chain(req, lambda: ran.append("then"))
    assert chain.abandon() is None
    req.complete = True  # the late message arrives
    chain.test()
    chain.wait(1.0)
    assert ran == []

"""MPI requests and their lifetime: memory that MPI may still write is never freed under it.

MPI owns a nonblocking call's buffers until the request completes, and a collective cannot be
cancelled. So every pending request sits in one table (``_PENDING``) until MPI says it completed,
whoever let go of it: a ``Work`` dropped without ``wait()``, a call given up on after its timeout,
a group finalized, an interpreter exiting. ``hpcdp.finalize`` and the exit handler (a Python
``atexit`` function, which runs before mpi4py's ``MPI_Finalize``) wait a short grace period for
them, withdraw pending receives, tell the group's other ranks what this rank left unfinished, and
keep the buffers of whatever is still in flight alive through ``MPI_Finalize``: a peer arriving
late then completes it into live memory instead of freed memory (a segfault before).

``Test`` on a request that two threads share (DDP's progress thread, the reaper, the exit handler)
runs under one lock: MPI frees a request when a ``Test`` sees it complete, so two threads testing
it at once could free it twice.
"""
from __future__ import annotations

import atexit
import ctypes
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from ...errors import HpcdpError
from .._staging import Chain
from ..base import Request, poll_until
from . import _tuning

if TYPE_CHECKING:
    from ._backend import MPIBackend

__all__ = ["MPIRequest", "Chain", "bind", "drain", "reap", "pending_of", "register_backend",
           "unregister_backend", "keep_forever", "serve_all", "EXIT_GRACE"]

#: seconds ``finalize`` and interpreter exit wait for operations still in flight
EXIT_GRACE = 2.0

_MPI: Any = None
_LOCK = threading.RLock()  # re-entrant: a Test may answer a peer's question, which registers a send
_PENDING: dict[int, "MPIRequest"] = {}
_reap_at = 64
#: every MPI backend not shut down. Strong references: a backend has a receive posted into a
#: buffer of its own (its notice channel), which must not be freed when its group is dropped.
_LIVE: "set[MPIBackend]" = set()
_KEPT: list[Any] = []  # made immortal at exit: what MPI may still write after the interpreter ends


def bind(mpi: Any) -> None:
    """Called once mpi4py's MPI is imported; registers the exit handler."""
    global _MPI
    if _MPI is None:
        _MPI = mpi
        atexit.register(_at_exit)


def register_backend(be: "MPIBackend") -> None:
    _LIVE.add(be)


def unregister_backend(be: "MPIBackend") -> None:
    _LIVE.discard(be)


def _settled(r: Any) -> bool:
    """A sub-request that completed or failed (a failed one stays failed: MPI will not touch it)."""
    try:
        return bool(r.Test())
    except _MPI.Exception:
        return True


class MPIRequest(Request):
    """One or more MPI requests of one operation; ``index`` > 0 for collectives (their number on
    the backend, the same on every rank), 0 for point to point."""

    __slots__ = ("reqs", "done", "what", "keep", "cancellable", "be", "index", "error", "watch",
                 "_due")

    def __init__(self, be: "MPIBackend", reqs: list[Any], what: str, index: int = 0) -> None:
        self.reqs = reqs
        self.done = False
        self.what = what
        self.keep: Any = ()  # mpi4py does not hold the buffers of nonblocking calls: we do
        self.cancellable = False  # receives may be withdrawn when given up on; the rest may not
        self.be = be
        self.index = index
        self.error: HpcdpError | None = None
        #: a receive on a group that carries dtypes in its tags: ``(fn, ...)``, ``fn(self)``
        #: run now and then while this request is waited on (``_meta.scan``); None otherwise
        self.watch: tuple | None = None
        self._due = 0.0  # when ``watch`` runs next (0: not waited on yet)
        _register(self)

    def _poll(self) -> None:
        """Under ``_LOCK``: test, and once every sub-request settled, let go of the buffers."""
        reqs = self.reqs
        try:
            ok = reqs[0].Test() if len(reqs) == 1 else _MPI.Request.Testall(reqs)
        except _MPI.Exception as exc:
            if self.error is None:
                self.error = self.be.notices.mpi_error(exc, self.what, self.index)
            ok = all(_settled(r) for r in reqs)
        if ok:
            self.keep = ()
            _PENDING.pop(id(self), None)
            self.done = True

    def test(self) -> bool:
        if not self.done:
            with _LOCK:
                if not self.done:
                    self._poll()
        if self.error is not None:
            raise self.error
        notices = self.be.notices
        if notices.waiting():
            notices.check(self.index, not self.done)  # (a p2p wait fails if a peer died)
        return self.done

    def wait(self, timeout: float | None) -> bool:
        if self.test():
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        idle = serve_all if self.watch is None else self._watching
        return poll_until(self.test, deadline, idle, _TESTS_PER_CLOCK)  # answering others

    def _watching(self) -> None:
        """``wait``'s idle step with a ``watch``: ``serve_all``, and the watch first after
        ``_WATCH_FIRST`` s of waiting, then every ``_WATCH_EVERY`` s."""
        serve_all()
        now = time.monotonic()
        due = self._due
        if not due:
            self._due = now + _WATCH_FIRST
        elif now >= due:
            self._due = now + _WATCH_EVERY
            watch = self.watch
            if watch is not None and not self.done:
                watch[0](self)

    def pending(self) -> str:
        if self.index:
            try:
                return self.be.notices.roll_call(self.index, self.what)
            except _MPI.Exception as exc:  # the side channel failed too: say so, not less
                return f"{self.what} did not complete (the roll call failed: {exc})"
        return f"{self.what} did not complete: the peer has not made the matching call"

    def cancel(self) -> None:
        """Withdraw a receive given up on, so a late message does not land in its buffer
        (collectives and sends cannot be cancelled: for them this does nothing). Once only:
        Open MPI 4 crashes on a second ``MPI_Cancel`` of a receive it already withdrew."""
        if self.cancellable and not self.done:
            with _LOCK:
                if not self.cancellable or self.done:
                    return
                self.cancellable = False
                for r in self.reqs:
                    if r:
                        try:
                            r.Cancel()
                        except _MPI.Exception:
                            pass
                self._poll()  # a withdrawn receive completes at once: let go of it

    def abandon(self) -> bool | None:
        try:
            if self.test():
                return True  # its last bytes came in as the deadline passed
        except HpcdpError:
            return None
        self.cancel()
        if self.index:  # the other ranks must not wait a full timeout of their own
            self.be.notices.announce(self.index, f"timed out in {self.what}")
        return None


#: seconds a receive waits before it first looks for a message of another dtype or shape
#: (``watch``), and between looks
_WATCH_FIRST, _WATCH_EVERY = 1e-3, 0.02

#: Tests between two reads of the clock while waiting. ``base.poll_until`` reads it every 64,
#: but an oversubscribed Open MPI yields the CPU in every idle Test (about 5 ms each with 4
#: ranks on a loaded 2-core machine), so 64 could outlast a deadline by a second.
_TESTS_PER_CLOCK = 8



def _register(r: MPIRequest) -> None:
    global _reap_at
    _PENDING[id(r)] = r
    if len(_PENDING) >= _reap_at and not _reaping:  # requests dropped without wait()
        reap()
        _reap_at = max(64, 2 * len(_PENDING))


_reaping = False


def reap() -> None:
    """Test every pending request once, so those MPI finished release their buffers."""
    global _reaping
    if _MPI is None or _MPI.Is_finalized():
        return
    with _LOCK:
        _reaping = True  # a failure found here sends notices, which register requests
        try:
            for r in list(_PENDING.values()):
                if not r.done:
                    r._poll()
        finally:
            _reaping = False


def pending_of(be: "MPIBackend | None") -> list[MPIRequest]:
    return [r for r in list(_PENDING.values()) if be is None or r.be is be]


def drain(reqs: list[MPIRequest], grace: float) -> list[MPIRequest]:
    """Withdraw pending receives, then wait up to ``grace`` s for ``reqs``; what is left."""
    for r in reqs:
        r.cancel()
    deadline = time.monotonic() + grace
    left = reqs
    while True:
        with _LOCK:
            for r in left:
                if not r.done:
                    r._poll()
        left = [r for r in left if not r.done]
        if not left or time.monotonic() >= deadline:
            return left
        serve_all()  # peers waiting on us may ask what we are doing
        time.sleep(1e-4)


def keep_forever(objs: Any) -> None:
    """Keep ``objs`` alive past interpreter shutdown (MPI_Finalize may still write into them)."""
    _KEPT.append(objs)
    if len(_KEPT) == 1:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(_KEPT))


_served = 0.0


def serve_all() -> None:
    """While waiting (at most every millisecond): answer other groups' questions, take their
    notices: a rank blocked in one group still tells another group's roll call it is alive."""
    global _served
    now = time.monotonic()
    if now - _served < 1e-3:
        return
    _served = now
    for be in list(_LIVE):
        if be.notices.waiting():
            be.notices.check(0)
        fast = be.fastpath
        if fast is not None and fast.queued():
            with _LOCK:
                fast.advance()


def _at_exit() -> None:
    """Before mpi4py's MPI_Finalize: finish, or make safe, whatever MPI may still touch."""
    if _MPI is None or _MPI.Is_finalized():
        return
    try:
        for be in list(_LIVE):  # lean point-to-point requests still held bare: drained too
            lane = be.quick_p2p
            if lane is not None:
                lane.adopt_all()
        left = drain(pending_of(None), EXIT_GRACE)
        for be in {r.be for r in left}:
            first = min((r for r in left if r.be is be and r.index), key=lambda r: r.index,
                        default=None)
            if first is not None:
                be.notices.announce(first.index, f"exited with {first.what} unfinished")
        for be in list(_LIVE):
            be.before_finalize()
        left = drain(pending_of(None), 0.05)  # the notices just sent
        if left:
            keep_forever(left)
            names = sorted({r.what for r in left})
            print(f"hpcdp: rank {_MPI.COMM_WORLD.Get_rank()} exits with {len(left)} MPI "
                  f"operation(s) unfinished ({', '.join(names)}); their buffers are kept for "
                  "MPI_Finalize", file=sys.stderr, flush=True)
    except Exception as exc:  # noqa: BLE001 - an exit handler must not hide the real exit
        print(f"hpcdp: exit handler failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    _tuning.release()

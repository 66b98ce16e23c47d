"""The quick lane of point-to-point, behind the same switch as the allreduce one
(``HPCDP_MPI_FASTPATH``).

A halo exchange or a ping-pong is latency-bound: mpi4py's ``Send``/``Recv`` cost well under a
microsecond each, and the general path (a registered ``MPIRequest`` with its description, a
deadline-checked wait that reads the clock every few tests) costs several. A blocking call needs
none of that while it completes quickly, so the quick lane posts the MPI request, ``Test``s it in
a short spin, and only a call still running after the spin becomes a registered request and
waits with its deadline like any other (so every call keeps its timeout and its peer-failure
checks). ``sendrecv`` posts both halves and spins on the pair; ``Lane.post`` is the
nonblocking post for ``isend``/``irecv``, whose ``Request`` is registered at once (a caller may
drop it) but skips the general path's per-call wrapper.

Messages over the backend's element limit, and calls made while a peer is known to be gone, go
the general way (``MPIBackend.send``/``recv``), which splits them and says who left.
"""
from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from ..base import Request
from . import _requests as _rq
from ._notices import Notices

if TYPE_CHECKING:
    from ._backend import MPIBackend

__all__ = ["Lane"]

#: Tests between clock reads, and how long the spin lasts before the registered wait takes
#: over: as the allreduce lane's (``_fastpath._SPIN``), for the same reasons.
_SPIN, _SPIN_S = 16, 1e-4
_monotonic = time.monotonic
_WHATS = 4096  # descriptions kept per group (tags are many; a program uses few)


class Lane:
    """One group's quick point-to-point: ``send``/``recv``/``sendrecv`` (blocking, a deadline)
    and ``post`` (nonblocking). Each blocking call returns None once complete, else the
    registered request still pending at its deadline (the caller turns it into a timeout)."""

    __slots__ = ("owner", "comm", "types", "limit", "notices", "_view", "_whats")

    def __init__(self, owner: "MPIBackend", comm: Any, types: dict[np.dtype, Any],
                 notices: Notices, limit: list[int]) -> None:
        self.owner, self.comm, self.types, self.limit = owner, comm, types, limit
        self.notices = notices
        self._view = notices.view
        self._whats: dict[tuple[str, int, int], str] = {}

    def send(self, buf: np.ndarray, dst: int, tag: int, timeout: float) -> Request | None:
        if buf.size > self.limit[0] or self.notices.left is not None:  # the general way
            return _wait(self.owner.send(buf, dst, tag), timeout)
        try:
            req = self.comm.Isend([buf, self.types[buf.dtype]], dst, tag)
        except _rq._MPI.Exception as exc:
            raise self.notices.mpi_error(exc, "send", 0) from None
        return self._spin(req, buf, timeout, "send", dst, tag)

    def recv(self, buf: np.ndarray, src: int, tag: int, timeout: float) -> Request | None:
        if buf.size > self.limit[0] or self.notices.left is not None:  # the general way
            return _wait(self.owner.recv(buf, src, tag), timeout)
        try:
            req = self.comm.Irecv([buf, self.types[buf.dtype]], src, tag)
        except _rq._MPI.Exception as exc:
            raise self.notices.mpi_error(exc, "recv", 0) from None
        return self._spin(req, buf, timeout, "recv", src, tag)

    def _general(self, buf: np.ndarray) -> bool:
        """Whether a call on ``buf`` takes the general path (split messages, a peer gone)."""
        return buf.size > self.limit[0] or self.notices.left is not None

    def sendrecv(self, sbuf: np.ndarray, dst: int, stag: int, rbuf: np.ndarray, src: int,
                 rtag: int, timeout: float) -> Request | None:
        """Both halves posted at once (receive first), so neither can wait for the other: the
        deadlock-free exchange ``MPI_Sendrecv`` is, with a deadline."""
        if self._general(sbuf) or self._general(rbuf):
            r = self.owner.recv(rbuf, src, rtag)
            s = self.owner.send(sbuf, dst, stag)
            deadline = _monotonic() + timeout
            if not r.wait(timeout):
                return r
            return _wait(s, max(0.0, deadline - _monotonic()))
        try:
            types, comm = self.types, self.comm
            r = comm.Irecv([rbuf, types[rbuf.dtype]], src, rtag)
            s = comm.Isend([sbuf, types[sbuf.dtype]], dst, stag)
        except _rq._MPI.Exception as exc:
            raise self.notices.mpi_error(exc, "sendrecv", 0) from None
        return self._spin(_Pair(r, s), (sbuf, rbuf), timeout, "sendrecv", src, rtag)

    def post(self, send: bool, buf: np.ndarray, peer: int, tag: int) -> Request:
        """``isend``/``irecv``: one MPI request, registered (its buffer kept with it)."""
        if buf.size > self.limit[0] or self.notices.left is not None:  # the general way
            return self.owner.send(buf, peer, tag) if send else self.owner.recv(buf, peer, tag)
        try:
            t = self.types[buf.dtype]
            req = self.comm.Isend([buf, t], peer, tag) if send else self.comm.Irecv([buf, t], peer, tag)
        except _rq._MPI.Exception as exc:
            raise self.notices.mpi_error(exc, "send" if send else "recv", 0) from None
        return self._registered(req, buf, "send" if send else "recv", peer, tag)

    def _registered(self, req: Any, keep: Any, op: str, peer: int, tag: int) -> Request:
        key = (op, peer, tag)
        what = self._whats.get(key)
        if what is None:  # the description, made once per (op, peer, tag): a halo repeats them
            ranks = self.owner.ranks
            what = (f"send to rank {ranks[peer]} (tag {tag})" if op == "send"
                    else f"{op} with rank {ranks[peer]} (tag {tag})" if op == "sendrecv"
                    else f"recv from rank {ranks[peer]} (tag {tag})")
            if len(self._whats) < _WHATS:
                self._whats[key] = what
        slow = _rq.MPIRequest(self.owner, req.reqs if type(req) is _Pair else [req], what)
        slow.keep = keep  # MPI owns the buffers until the request completes
        slow.cancellable = op == "recv"
        return slow

    def _spin(self, req: Any, keep: Any, timeout: float, op: str, peer: int,
              tag: int) -> Request | None:
        """Test ``req`` for up to ``_SPIN_S``; then the registered wait, to the deadline."""
        view = self._view
        stop = deadline = None
        test = req.Test
        try:
            while True:
                k = _SPIN  # (a while loop on Test() measured faster than for/range)
                while not test():
                    k -= 1
                    if not k:
                        break
                else:
                    if view[0]:  # a notice landed: take it (a finished p2p call never fails)
                        self.notices.check(0)
                    return None
                now = _monotonic()
                if stop is None:
                    deadline, stop = now + timeout, now + min(_SPIN_S, timeout)
                elif now >= stop or view[0]:  # a notice goes to the registered wait
                    break
        except _rq._MPI.Exception as exc:
            raise self.notices.mpi_error(exc, op, 0) from None
        except BaseException:  # KeyboardInterrupt in the spin: MPI may still use the buffers
            self._registered(req, keep, op, peer, tag)
            raise
        slow = self._registered(req, keep, op, peer, tag)
        return None if slow.wait(max(0.0, deadline - _monotonic())) else slow


class _Pair:
    """The two requests of a ``sendrecv``, tested together (``Test``: one ``Testall``)."""

    __slots__ = ("reqs", "Test")

    def __init__(self, r: Any, s: Any) -> None:
        self.reqs = [r, s]
        self.Test = functools.partial(_rq._MPI.Request.Testall, self.reqs)  # mpi4py's spelling


def _wait(req: Request, timeout: float) -> Request | None:
    return None if req.wait(timeout) else req

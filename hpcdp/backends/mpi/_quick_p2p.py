"""The quick lane of point-to-point, behind the same switch as the allreduce one
(``HPCDP_MPI_FASTPATH``).

A halo exchange or a ping-pong is latency-bound: mpi4py's ``Send``/``Recv`` cost well under a
microsecond each, and the general path (a registered ``MPIRequest`` with its description, a
deadline-checked wait that reads the clock every few tests) costs several. A blocking call needs
none of that while it completes quickly, so the quick lane posts the MPI request, ``Test``s it in
a short spin, and only a call still running after the spin becomes a registered request and
waits with its deadline like any other (so every call keeps its timeout and its peer-failure
checks). ``sendrecv`` posts both halves and spins on the pair. ``isend``/``irecv`` of a 1-D
array take ``Lane.start``: a bare MPI request the caller (``comm.work.QuickWork``) holds with its
buffer and tests, and hands to ``Lane.adopt`` (registered, as any other) only when it must wait,
fails or is dropped pending; ``Lane.post`` registers at once (the calls ``start`` declines).

Messages over the backend's element limit, and calls made while a peer is known to be gone, go
the general way (``MPIBackend.send``/``recv``), which splits them and says who left.

Where the group carries dtypes in its tags (``_meta``), the lane posts on the wire tag (a few
integer operations), an n-D array with its dims message, and a receive still waiting after the
spin watches for a message of another dtype or shape (``_meta.scan``).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import HpcdpError
from ..base import DTYPE_CODES, SPIN_SECONDS, Request, spin
from . import _requests as _rq
from ._meta import SHIFT, scan
from ._notices import Notices

if TYPE_CHECKING:
    from ._backend import MPIBackend
    from ._meta import TagMeta

__all__ = ["Lane"]

#: how long the spin lasts before the registered wait takes over (``base.SPIN_SECONDS``)
_SPIN_S = SPIN_SECONDS
_monotonic = time.monotonic
_WHATS = 4096  # descriptions kept per group (tags are many; a program uses few)
_LOW = (1 << SHIFT) - 1  # a wire tag's class and dtype code


class Lane:
    """One group's quick point-to-point: ``send``/``recv``/``sendrecv`` (blocking, a deadline)
    and ``post`` (nonblocking). Each blocking call returns None once complete, else the
    registered request still pending at its deadline (the caller turns it into a timeout)."""

    __slots__ = ("owner", "comm", "types", "limit", "notices", "_view", "_whats", "meta",
                 "_tc", "alert", "testall", "live")

    def __init__(self, owner: "MPIBackend", comm: Any, types: dict[np.dtype, Any],
                 notices: Notices, limit: list[int], meta: "TagMeta | None" = None) -> None:
        self.owner, self.comm, self.types, self.limit = owner, comm, types, limit
        self.notices = notices
        self._view = notices.view
        self._whats: dict[tuple[str, int, int], str] = {}
        #: the group's wire tags (``_meta``), None where it keeps plain tags
        self.meta = meta
        #: dtype -> (MPI type, dtype code): one lookup per call
        self._tc = {dt: (t, DTYPE_CODES[dt]) for dt, t in types.items()}
        #: non-zero in ``alert[0]`` once a notice landed (``take_notices``)
        self.alert = notices.view
        #: the bare requests of ``start`` not yet completed or adopted, by id: what the exit
        #: handler registers (``adopt_all``) so that it drains them like any other
        self.live: dict[int, tuple[Any, ...]] = {}
        #: ``testall(requests)``: whether every request of ``start`` in the list completed
        self.testall = _rq._MPI.Request.Testall

    def send(self, buf: np.ndarray, dst: int, tag: int, timeout: float) -> Request | None:
        if buf.size > self.limit[0] or self.notices.left is not None:  # the general way
            return _wait(self.owner.send(buf, dst, tag), timeout)
        try:
            t, code = self._tc[buf.dtype]
            if self.meta is None:
                req = self.comm.Isend([buf, t], dst, tag)
            else:
                nd = buf.ndim
                w = (tag << SHIFT) | (16 if nd == 1 else 32 if nd else 0) | code
                req = self.comm.Isend([buf, t], dst, w)
                if nd > 1:  # its dims follow
                    r, dims = self.meta.send_dims(buf, dst, w)
                    return self._spin(_Pair(req, r), (buf, dims), timeout, "send", dst, tag)
            if req.Test():  # a small send is done at once: no spin (a call less)
                if self._view[0]:
                    self.notices.check(0)
                return None
        except _rq._MPI.Exception as exc:
            raise self.notices.mpi_error(exc, "send", 0) from None
        return self._spin(req, buf, timeout, "send", dst, tag)

    def recv(self, buf: np.ndarray, src: int, tag: int, timeout: float) -> Request | None:
        if buf.size > self.limit[0] or self.notices.left is not None:  # the general way
            return _wait(self.owner.recv(buf, src, tag), timeout)
        try:
            t, code = self._tc[buf.dtype]
            if self.meta is None:
                req = self.comm.Irecv([buf, t], src, tag)
            else:
                nd = buf.ndim
                w = (tag << SHIFT) | (16 if nd == 1 else 32 if nd else 0) | code
                req = self.comm.Irecv([buf, t], src, w)
                if nd > 1:
                    return self._recv_nd(req, buf, src, tag, w, timeout)
                if req.Test():  # the message was there: no spin
                    if self._view[0]:
                        self.notices.check(0)
                    return None
                return self._spin(req, buf, timeout, "recv", src, tag, w)
        except _rq._MPI.Exception as exc:
            raise self.notices.mpi_error(exc, "recv", 0) from None
        return self._spin(req, buf, timeout, "recv", src, tag)

    def _recv_nd(self, req: Any, buf: np.ndarray, src: int, tag: int, w: int,
                 timeout: float) -> Request | None:
        """An n-D receive: its data and (unless a probe took them) its dims message."""
        got = self.meta.recv_dims(src, w)
        if got is None:
            return self._spin(req, buf, timeout, "recv", src, tag, w)
        return self._spin(_Pair(req, got[0]), (buf, got[1]), timeout, "recv", src, tag, w, 1)

    def sendrecv(self, sbuf: np.ndarray, dst: int, stag: int, rbuf: np.ndarray, src: int,
                 rtag: int, timeout: float) -> Request | None:
        """Both halves posted at once (receive first), so neither can wait for the other: the
        deadlock-free exchange ``MPI_Sendrecv`` is, with a deadline."""
        limit = self.limit[0]
        if sbuf.size > limit or rbuf.size > limit or self.notices.left is not None:
            r = self.owner.recv(rbuf, src, rtag)
            s = self.owner.send(sbuf, dst, stag)
            deadline = _monotonic() + timeout
            if not r.wait(timeout):
                return r
            return _wait(s, max(0.0, deadline - _monotonic()))
        try:
            tc, comm, meta = self._tc, self.comm, self.meta
            rt, rcode = tc[rbuf.dtype]
            st, scode = tc[sbuf.dtype]
            if meta is None:
                r = comm.Irecv([rbuf, rt], src, rtag)
                s = comm.Isend([sbuf, st], dst, stag)
                if r.Test() and s.Test():  # both done at once (the message was there)
                    if self._view[0]:
                        self.notices.check(0)
                    return None
                return self._spin(_Pair(r, s), (sbuf, rbuf), timeout, "sendrecv", src, rtag)
            rn, nd = rbuf.ndim, sbuf.ndim
            if rn == 1 and nd == 1:  # a 1-D halo: as lean as without wire tags
                rw = (rtag << SHIFT) | 16 | rcode
                r = comm.Irecv([rbuf, rt], src, rw)
                s = comm.Isend([sbuf, st], dst, (stag << SHIFT) | 16 | scode)
                if r.Test() and s.Test():  # (as above)
                    if self._view[0]:
                        self.notices.check(0)
                    return None
                return self._spin(_Pair(r, s), (rbuf, sbuf), timeout, "sendrecv", src, rtag, rw)
            rw = (rtag << SHIFT) | (16 if rn == 1 else 32 if rn else 0) | rcode
            sw = (stag << SHIFT) | (16 if nd == 1 else 32 if nd else 0) | scode
            reqs = [comm.Irecv([rbuf, rt], src, rw)]
            j = rdims = sdims = None
            if rbuf.ndim > 1 and (got := meta.recv_dims(src, rw)) is not None:
                j, rdims = len(reqs), got[1]
                reqs.append(got[0])
            reqs.append(comm.Isend([sbuf, st], dst, sw))
            if nd > 1:
                r, sdims = meta.send_dims(sbuf, dst, sw)
                reqs.append(r)
            # (the receive's buffer and dims first: ``_registered`` reads them)
            keep = (rbuf, rdims, sbuf, sdims)
        except _rq._MPI.Exception as exc:
            raise self.notices.mpi_error(exc, "sendrecv", 0) from None
        return self._spin(_Pair.of(reqs), keep, timeout, "sendrecv", src, rtag, rw, j)

    def peek(self, src: int, buf: np.ndarray, timeout: float) -> tuple[int, int] | None:
        """(source, tag) of the next message from ``src`` (-1: any source) with any tag, if
        within ``timeout`` of back-to-back probes it arrives as one ``recv(buf, source, tag)``
        takes as it is (``buf``'s dtype, 0-d or 1-D, and size); else None: nothing came yet,
        or another kind of message, which the caller's general probe names. (``sendrecv``
        with mpi4py's default any receive tag: the message's own tag, then its receive by
        that tag, as ``probe`` does, without a ``Probed``, the group's checks of a second
        call or a frame per layer. ``buf.ndim`` <= 1: an n-D message's dims travel apart.)"""
        if buf.size > self.limit[0] or self.notices.left is not None:
            return None  # (a message split in pieces, or a peer gone: the general way)
        MPI = _rq._MPI
        st = MPI.Status()  # (one per call: threads share the lane)
        iprobe, source, any_tag = self.comm.Iprobe, MPI.ANY_SOURCE if src < 0 else src, MPI.ANY_TAG
        try:
            if not (iprobe(source, any_tag, st)
                    or spin(lambda: iprobe(source, any_tag, st), self._view, timeout)):
                return None
        except _rq._MPI.Exception as exc:
            raise self.notices.mpi_error(exc, f"probe(src={src}, tag=-1)", 0) from None
        w = st.Get_tag()
        if st.Get_count(MPI.BYTE) != buf.nbytes:
            return None
        if self.meta is None:
            return st.Get_source(), w
        if w & _LOW != (16 if buf.ndim else 0) | self._tc[buf.dtype][1]:
            return None
        return st.Get_source(), w >> SHIFT

    def start(self, send: bool, buf: np.ndarray, peer: int, tag: int) -> Any:
        """``isend``/``irecv`` as a bare MPI request, not registered: the caller (a lean
        ``comm.work.QuickWork``) holds it with its buffer, ``Test``s it, and hands it to
        ``adopt`` before it lets go of it pending. None: the call goes the ``post`` way
        (split messages, a peer gone, an n-D array whose dims travel apart)."""
        if buf.size > self.limit[0] or self.notices.left is not None:
            return None
        meta = self.meta
        try:
            t, code = self._tc[buf.dtype]
            if meta is None:
                w = tag
            else:
                nd = buf.ndim
                if nd > 1:
                    return None
                w = (tag << SHIFT) | (16 if nd else 0) | code
            req = self.comm.Isend([buf, t], peer, w) if send else self.comm.Irecv([buf, t], peer, w)
        except _rq._MPI.Exception as exc:
            raise self.notices.mpi_error(exc, "send" if send else "recv", 0) from None
        self.live[id(req)] = (req, buf, send, peer, tag)
        return req

    def start_all(self, items: list[tuple[Any, np.ndarray, int, int, bool]], raws: list[Any]) -> None:
        """``start`` for many calls at once (``batch_isend_irecv``): each of ``items``
        (``(caller's key, buf, peer, tag, send)``), in order, started and its bare request
        appended to ``raws``, the lane's state read once for all of them. Stops at the first
        one ``start`` would decline (the caller posts it and those after it one by one, in
        order: matching is in posting order); an MPI error is raised with the requests
        started before it in ``raws``."""
        if self.notices.left is not None:
            return
        limit, tc, live, meta, comm = self.limit[0], self._tc, self.live, self.meta, self.comm
        isend, irecv, put = comm.Isend, comm.Irecv, raws.append
        send = False
        try:
            for _, buf, peer, tag, send in items:
                if buf.size > limit:
                    return
                t, code = tc[buf.dtype]
                if meta is None:
                    w = tag
                else:
                    nd = buf.ndim
                    if nd > 1:
                        return
                    w = (tag << SHIFT) | (16 if nd else 0) | code
                req = isend([buf, t], peer, w) if send else irecv([buf, t], peer, w)
                live[id(req)] = (req, buf, send, peer, tag)
                put(req)
        except _rq._MPI.Exception as exc:
            raise self.notices.mpi_error(exc, "send" if send else "recv", 0) from None

    def adopt(self, req: Any, buf: np.ndarray, send: bool, peer: int, tag: int) -> Request:
        """A request of ``start`` as a registered one (its buffer kept until MPI is done with
        it, a receive watching for another dtype or shape), for the general wait."""
        self.live.pop(id(req), None)
        slow = self._registered(req, buf, "send" if send else "recv", peer, tag)
        meta = self.meta
        if not send and meta is not None:
            t, code = self._tc[buf.dtype]
            w = (tag << SHIFT) | (16 if buf.ndim else 0) | code
            slow.watch = (scan, meta, buf, t, peer, tag, w, None, None)
        return slow

    def adopt_all(self) -> None:
        """Register every request of ``start`` still held bare (a lean ``Work`` kept pending
        to the end of the program): the exit handler then drains them with the rest."""
        for req, buf, send, peer, tag in list(self.live.values()):
            self.adopt(req, buf, send, peer, tag)

    def failure(self, exc: Exception, send: bool) -> HpcdpError:
        """The error of a bare request whose ``Test`` raised (MPI may have freed it: it must
        not be tested again to find out)."""
        return self.notices.mpi_error(exc, "send" if send else "recv", 0)

    def take_notices(self) -> None:
        """Take the notices that landed (``alert[0]`` non-zero) after a call completed."""
        self.notices.check(0)

    def post(self, send: bool, buf: np.ndarray, peer: int, tag: int) -> Request:
        """``isend``/``irecv``: one MPI request, registered (its buffer kept with it)."""
        if buf.size > self.limit[0] or self.notices.left is not None:  # the general way
            return self.owner.send(buf, peer, tag) if send else self.owner.recv(buf, peer, tag)
        meta = self.meta
        if meta is not None and buf.ndim > 1:  # with a dims message: the general way
            return self.owner.send(buf, peer, tag) if send else self.owner.recv(buf, peer, tag)
        try:
            t, code = self._tc[buf.dtype]
            if meta is None:
                w = tag
            else:
                w = (tag << SHIFT) | (16 if buf.ndim == 1 else 0) | code
            req = self.comm.Isend([buf, t], peer, w) if send else self.comm.Irecv([buf, t], peer, w)
        except _rq._MPI.Exception as exc:
            raise self.notices.mpi_error(exc, "send" if send else "recv", 0) from None
        slow = self._registered(req, buf, "send" if send else "recv", peer, tag)
        if not send and meta is not None:  # (``_meta.watch``'s tuple: built here, every irecv)
            slow.watch = (scan, meta, buf, t, peer, tag, w, None, None)
        return slow

    def _registered(self, req: Any, keep: Any, op: str, peer: int, tag: int,
                    w: int = -1, j: int | None = None) -> Request:
        """``req`` as a registered request; ``w`` >= 0: a receive on wire tag ``w`` (its buffer
        ``keep``, or ``keep[0]`` where ``keep`` is a tuple, with its dims buffer ``keep[1]``
        where ``j``, the dims receive's place in the requests, is given), which watches for
        another dtype or shape while it waits (``_meta.scan``)."""
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
        if w >= 0 and self.meta is not None:
            buf, dims = ((keep, None) if type(keep) is not tuple
                         else (keep[0], keep[1] if j is not None else None))
            # (``_meta.watch``'s tuple, built here: this runs for every ``irecv``)
            slow.watch = (scan, self.meta, buf, self.types[buf.dtype], peer, tag, w, j, dims)
        return slow

    def _spin(self, req: Any, keep: Any, timeout: float, op: str, peer: int,
              tag: int, w: int = -1, j: int | None = None) -> Request | None:
        """Test ``req`` for up to ``_SPIN_S``; then the registered wait, to the deadline."""
        view = self._view
        try:
            if spin(req.Test, view, min(_SPIN_S, timeout)):
                if view[0]:  # a notice landed: take it (a finished p2p call never fails)
                    self.notices.check(0)
                return None
            deadline = _monotonic() + timeout  # (a notice goes to the registered wait)
        except _rq._MPI.Exception as exc:
            raise self.notices.mpi_error(exc, op, 0) from None
        except BaseException:  # KeyboardInterrupt in the spin: MPI may still use the buffers
            self._registered(req, keep, op, peer, tag)
            raise
        slow = self._registered(req, keep, op, peer, tag, w, j)
        return None if slow.wait(max(0.0, deadline - _monotonic())) else slow


class _Pair:
    """The requests of a ``sendrecv`` (or of an n-D message and its dims), tested together
    (``Test``: one ``Testall``)."""

    __slots__ = ("reqs",)

    def __init__(self, r: Any, s: Any) -> None:
        self.reqs = [r, s]

    def Test(self) -> bool:  # noqa: N802 - mpi4py's spelling, as ``_spin`` calls a request's
        return _rq._MPI.Request.Testall(self.reqs)  # type: ignore[no-any-return]

    @classmethod
    def of(cls, reqs: list[Any]) -> "_Pair":
        """More than two requests (n-D arrays' dims messages with them)."""
        p = cls(None, None)
        p.reqs[:] = reqs
        return p


def _wait(req: Request, timeout: float) -> Request | None:
    return None if req.wait(timeout) else req

"""Point-to-point calls of ``ProcessGroup``: tag-matched, nonblocking underneath, with deadlines.

The group holds a ``PointToPoint`` and delegates its point-to-point methods to it; the
module-level ``hpcdp.probe``/``iprobe``/``recv_any`` (``p2p``) call the same.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from ..trace.hooks import count_p2p, on_error
from .._arrays import SUPPORTED_SET, contiguous, xp_of
from ._debug_p2p import p2p_receiver, p2p_sender, payload_nbytes
from ._status import Status
from .._tensors import tensor_call
from ._buffers import finish_into, via_tensors
from .validation import check_array, check_rank, check_tag
from ..backends.base import ANY_SOURCE, ANY_TAG, PROC_NULL, Probed, Request
from ..errors import HpcdpError, public, public_error
from .work import (QUICK_SPIN_S, WATCH_AFTER, CompletedWork, Polled, QuickWork, Work, annotate,
                   finish_wait, p2p_name, wait_for, work_where)

if TYPE_CHECKING:
    from .group import ProcessGroup

__all__ = ["PointToPoint"]

_ndarray = np.ndarray


def _none() -> None:
    return None


_name = p2p_name


def _probe_spin(look: Any, src: int, tag: int, seconds: float) -> Probed | None:
    """``look(src, tag)`` (a backend's ``probe_meta``) until it finds a message or ``seconds``
    pass: the probe before a waited one, for a message that arrives within a moment."""
    hit = look(src, tag)
    if hit is None:
        until = time.monotonic() + seconds
        while (hit := look(src, tag)) is None and time.monotonic() < until:
            pass
    return hit


def _sr_name(dst: int, stag: int, ks: int, src: int, rtag: int, kr: int) -> str:
    """A ``sendrecv``'s name in errors: both halves, each as the call it pairs with."""
    return f"sendrecv: {_name('send', 'dst', dst, stag, ks)} and {_name('recv', 'src', src, rtag, kr)}"


class _Both(Request):
    """The receive and the send of a ``sendrecv`` as one request (on a backend without a quick
    lane): done when both are; what is missing is the receive while it is pending."""

    __slots__ = ("_r", "_s")

    def __init__(self, r: Request, s: Request) -> None:
        self._r, self._s = r, s

    def test(self) -> bool:
        r = self._r.test()  # both progressed on every test
        return self._s.test() and r

    def wait(self, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._r.wait(timeout):
            return False
        return self._s.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def pending(self) -> str:
        return self._r.pending() if not self._r.test() else self._s.pending()

    def abandon(self) -> bool | None:
        done_r = self._r.abandon()
        done_s = self._s.abandon()
        return bool(done_r) and bool(done_s) or None


class PointToPoint:
    """The point-to-point calls of one ``ProcessGroup``: the group holds one (``group._p2p``)
    and its ``send``, ``recv``, ``isend``, ``irecv``, ``sendrecv``, ``probe`` and ``iprobe``
    are these bound methods; ``hpcdp.recv_any`` comes here too. It owns the per-(op, peer, tag)
    message counters that name each message, and posts through the group it is given (its
    checks, deadlines, flight recorder and transport).

    The flight recorder and the quick lane: a call on the backend's quick lane (MPI) that
    completes within the lane's spin is counted (``counts``: the dump lists them per pair) but
    takes no row of the recorder's ring, whose rows name the calls that a hang is about (the
    collectives, and the point-to-point calls still waiting); a call still waiting after the
    spin is recorded from then on, as started. With source lines or a timeline on
    (``HPCDP_TRACE``, ``HPCDP_TRACE_LINES``) every call is recorded."""

    __slots__ = ("_g", "_counts", "_peers", "_ranks", "_lane", "_max_tag", "__weakref__")

    def __init__(self, group: "ProcessGroup") -> None:
        self._g = group
        self._counts: dict[tuple[str, int, int], Any] = {}  # (op, peer, tag) -> counter
        #: the group ranks a blocking call may name (not this rank): one set lookup in the
        #: quick check where three comparisons and two attribute reads were
        self._peers = frozenset(range(group.size)) - {group.rank}
        #: the same with this rank: nonblocking calls and ``sendrecv`` may name themselves
        #: (a periodic grid one rank wide), as MPI allows
        self._ranks = frozenset(range(group.size))
        be = group.backend
        #: the backend's quick lane (``Backend.quick_p2p``), None where it has none
        self._lane = be.quick_p2p if be is not None else None
        self._max_tag = group._max_tag
        if be is not None:  # its flight record lists these counts (``counts``)
            count_p2p(group.ranks[group.rank], self)

    @property
    def group(self) -> "ProcessGroup":
        return self._g

    def counts(self) -> dict[tuple[str, int, int], int]:
        """Messages so far by ``(op, peer, tag)`` (``op``: "send" or "recv"; a ``sendrecv``
        counts one of each): what the flight record lists per pair, so a hang names how many
        messages each pair exchanged. A snapshot, safe while other threads post; empty once
        the group is shut down (a record lists the groups in use)."""
        out: dict[tuple[str, int, int], int] = {}
        if self._g._closed:
            return out
        for key, c in list(self._counts.items()):
            n = int(repr(c)[6:-1]) - 1  # "count(k)": k is the next number
            if n:
                out[key] = n
        return out

    def _check_p2p(self, op: str, x: Any, peer_name: str, peer: int, tag: int) -> tuple[str, int, int]:
        where = self._g._where(op)
        self._g._usable(op)
        peer = check_rank(where, peer_name, peer, self._g.size)
        tag = check_tag(where, tag, self._g._max_tag)
        check_array(where, x)
        return where, peer, tag

    def _p2p_name(self, op: str, peer_name: str, peer: int, tag: int) -> str:
        """``send(dst=1, tag=3) #k``: the k-th message of this pair with this tag. Matching is
        non-overtaking per (source, tag), so the receive that takes it is ``recv(...) #k`` too:
        errors and traces pair sends with receives."""
        return _name(op, peer_name, peer, tag, self._count(op, peer, tag))

    def _count(self, op: str, peer: int, tag: int) -> int:
        """The number of this ``op`` to ``peer`` with ``tag`` (from 1): ``_p2p_name``'s ``#k``,
        without the string, which the quick lane makes only for an error."""
        c = self._counts.get((op, peer, tag))
        if c is None:  # (setdefault: atomic, threads share the group)
            c = self._counts.setdefault((op, peer, tag), itertools.count(1))
        return next(c)

    def isend(self, x: Any, dst: int, tag: int = 0) -> Work:
        """Start sending ``x`` to group rank ``dst``; do not modify ``x`` until ``wait()``.
        ``dst=PROC_NULL``: nothing is sent (a Work already complete)."""
        try:  # (errors.public's trimming, without its wrapper's frame: a halo posts many;
            # to oneself too, as MPI allows: a periodic grid one rank wide)
            if (type(x) is _ndarray and type(dst) is int and type(tag) is int and self._g._fast
                    and dst in self._ranks and 0 <= tag <= self._max_tag
                    and x.dtype in SUPPORTED_SET and x.flags.c_contiguous):
                c = self._counts.get(("send", dst, tag))
                if c is None:
                    c = self._counts.setdefault(("send", dst, tag), itertools.count(1))
                k = next(c)
                lane = self._lane
                if lane is not None:  # a lean Work: named, registered and recorded if it must wait
                    try:
                        raw = lane.start(True, x, dst, tag)
                    except HpcdpError as exc:
                        raise self._failed("send", x, dst, tag, k, -1, exc) from exc
                    if raw is not None:
                        rec = self._g._rec
                        return QuickWork(self._g, lane, raw, x, True, dst, tag, k,
                                         rec.begin("send", self._g, 0, x.shape, x.dtype, dst)
                                         if rec is not None and rec.lines else 0)
                return self._post_quick(True, x, dst, tag, "dst", None, k)
            return self._isend(x, dst, tag)
        except HpcdpError as exc:
            raise public_error(exc)  # noqa: B904 - exc is its __context__

    def _isend(self, x: Any, dst: int, tag: int) -> Work:
        """``isend`` of anything else than a plain array."""
        if self._p2p_fast(x, dst, tag, True):  # a tensor's array
            return self._post_quick(True, x, dst, tag, "dst", None)
        if type(x) is not _ndarray and (tc := tensor_call(self._g._where("send"), x)):
            return via_tensors(tc, self._isend(tc.read(x), dst, tag))
        if dst == PROC_NULL:
            return self._null("send", x, tag, None)
        _, dst, tag = self._check_p2p("send", x, "dst", dst, tag)
        buf = contiguous(x)
        name = self._p2p_name("send", "dst", dst, tag)
        rec = self._g._rec
        tok = rec.begin("send", self._g, 0, x.shape, x.dtype, dst) if rec is not None else 0
        # HPCDP_DEBUG: the message carries a header its receive checks (_debug_p2p)
        send = self._g._transport(x).send if self._g._debug != "detail" else p2p_sender(self._g, name, x.shape)
        # shaped (a transport that ``carries_meta`` sends the shape); flat for the debug header's
        req = self._g._post(name, 0, send, buf if self._g._debug != "detail" else buf.reshape(-1),
                            dst, tag, tok=tok)
        return Work(self._g, name, 0, req, _none, None, tok)

    def irecv(self, buf: Any, src: int, tag: int = 0) -> Work:
        """Start receiving into ``buf`` from group rank ``src``; ``wait()`` returns ``buf``.
        ``src=PROC_NULL``: nothing is received (a Work already complete, ``buf`` untouched)."""
        try:  # (as ``isend``)
            if (type(buf) is _ndarray and type(src) is int and type(tag) is int and self._g._fast
                    and src in self._ranks and 0 <= tag <= self._max_tag
                    and buf.dtype in SUPPORTED_SET and buf.flags.c_contiguous
                    and buf.flags.writeable):
                c = self._counts.get(("recv", src, tag))
                if c is None:
                    c = self._counts.setdefault(("recv", src, tag), itertools.count(1))
                k = next(c)
                lane = self._lane
                if lane is not None:  # (as ``isend``)
                    try:
                        raw = lane.start(False, buf, src, tag)
                    except HpcdpError as exc:
                        raise self._failed("recv", buf, src, tag, k, -1, exc) from exc
                    if raw is not None:
                        rec = self._g._rec
                        return QuickWork(self._g, lane, raw, buf, False, src, tag, k,
                                         rec.begin("recv", self._g, 0, buf.shape, buf.dtype, src)
                                         if rec is not None and rec.lines else 0)
                return self._post_quick(False, buf, src, tag, "src", buf, k)
            return self._irecv_any_kind(buf, src, tag)
        except HpcdpError as exc:
            raise public_error(exc)  # noqa: B904 - exc is its __context__

    def _irecv_any_kind(self, buf: Any, src: int, tag: int) -> Work:
        """``irecv`` of anything else than a plain array."""
        if self._p2p_fast(buf, src, tag, True) and buf.flags.writeable:  # a tensor's array
            return self._post_quick(False, buf, src, tag, "src", buf)
        if type(buf) is not _ndarray and (tc := tensor_call(self._g._where("recv"), buf)):
            return via_tensors(tc, self._irecv_any_kind(tc.write(buf, "the receive buffer"), src, tag))
        return self._irecv(buf, src, tag, "full")

    def _post_quick(self, send: bool, x: np.ndarray, peer: int, tag: int, key: str,
                    result: Any, k: int = 0) -> Work:
        """``isend``/``irecv`` of a plain contiguous host array that passed ``_p2p_fast``: the
        same bookkeeping as the general path, posted through the backend's quick lane (``k``:
        the message's number, where the caller counted it already)."""
        g = self._g
        op = "send" if send else "recv"
        name = _name(op, key, peer, tag, k) if k else self._p2p_name(op, key, peer, tag)
        rec = g._rec
        tok = rec.begin(op, g, 0, x.shape, x.dtype, peer) if rec is not None else 0
        be = g.backend
        lane = be.quick_p2p
        try:  # the array as it is: a transport that ``carries_meta`` sends its shape
            if lane is not None:
                req = lane.post(send, x, peer, tag)
            else:
                req = (be.send if send else be.recv)(x, peer, tag)
        except HpcdpError as exc:  # as ``group._post`` reports a failed post
            err = annotate(exc, work_where(g, name, 0))
            on_error(rec, tok, err)
            raise err from exc
        return Work(g, name, 0, req, _none if result is None else (lambda: result), None, tok)

    def _null(self, op: str, x: Any, tag: int, result: Any) -> Work:
        """A send to, or receive from, ``PROC_NULL``: checked like any call, then done."""
        self._check_null(op, x, tag)
        return CompletedWork(self._g, f"{op}({'dst' if op == 'send' else 'src'}=PROC_NULL, tag={tag})",
                             0, result)

    def _check_null(self, op: str, x: Any, tag: int) -> None:
        where = self._g._where(op)
        self._g._usable(op)
        if not (op == "recv" and tag == ANY_TAG):
            check_tag(where, tag, self._g._max_tag)
        if x is not None:
            check_array(where, x)

    def _check_op(self, send: bool, x: Any, peer: Any, tag: Any) -> tuple[Any, Any]:
        """What ``isend``/``irecv`` would refuse of this call, refused with the same error,
        without posting or counting anything (``post_batch`` checks every op before it posts
        one). ``(array, tensor call)``: what to post (a tensor's view, made once) and the
        ``TensorCall`` that hands it back (None for an array)."""
        op = "send" if send else "recv"
        tc = None
        if x is not None and type(x) is not _ndarray and (tc := tensor_call(self._g._where(op), x)):
            x = tc.read(x) if send else tc.write(x, "the receive buffer")
        if peer == PROC_NULL:
            self._check_null(op, x, tag)
        else:
            where, _, _ = self._check_p2p(op, x, "dst" if send else "src", peer, tag)
            if not send and isinstance(x, np.ndarray) and not x.flags.writeable:
                raise ValueError(f"{where}: the receive buffer is read-only")
        return x, tc

    def _post_checked(self, send: bool, x: Any, peer: int, tag: int, tc: Any) -> Work:
        """An op ``_check_op`` passed, posted as ``isend``/``irecv`` post it (a tensor's view
        as they post it after converting the tensor)."""
        if tc is None:
            return self.isend(x, peer, tag) if send else self.irecv(x, peer, tag)
        return via_tensors(tc, self._isend(x, peer, tag) if send else self._irecv_any_kind(x, peer, tag))

    def _irecv(self, buf: Any, src: int, tag: int, check: str,
               on_meta: Any = None) -> Work:
        """``irecv``; ``check`` says what ``HPCDP_DEBUG`` compares with the sender's call, and
        ``on_meta(dtype, shape)`` hears what its header says was sent."""
        if src == PROC_NULL:
            return self._null("recv", buf, tag, buf)
        where, src, tag = self._check_p2p("recv", buf, "src", src, tag)
        if isinstance(buf, np.ndarray) and not buf.flags.writeable:
            raise ValueError(f"{where}: the receive buffer is read-only")
        tmp = buf if buf.flags.c_contiguous else xp_of(buf).empty(buf.shape, buf.dtype)
        name = self._p2p_name("recv", "src", src, tag)
        rec = self._g._rec
        tok = rec.begin("recv", self._g, 0, buf.shape, buf.dtype, src) if rec is not None else 0
        if self._g._debug != "detail":
            recv, into = self._g._transport(buf).recv, tmp
        else:
            recv, into = p2p_receiver(self._g, name, buf.shape, check, on_meta), tmp.reshape(-1)
        req = self._g._post(name, 0, recv, into, src, tag, tok=tok)
        return Work(self._g, name, 0, req, finish_into(buf, tmp), None, tok)

    def _check_probe(self, op: str, src: int, tag: int) -> tuple[str, int, int]:
        g = self._g
        where = g._where(op)
        g._usable(op)
        if src != ANY_SOURCE and src != PROC_NULL:
            src = check_rank(where, "src", src, g.size)
        if tag != ANY_TAG:
            tag = check_tag(where, tag, g._max_tag)
        return where, src, tag

    def _status(self, found: Probed) -> Status:
        """The ``Status`` of a probed message; under ``HPCDP_DEBUG`` its size without the header
        (and no dtype or shape: they are in the header, read when the message is received)."""
        s, t, nbytes, dtype, shape = found
        if self._g._debug == "detail":
            return Status(s, t, payload_nbytes(nbytes))
        return Status(s, t, nbytes, dtype, shape)

    @public
    def iprobe(self, src: int = ANY_SOURCE, tag: int = ANY_TAG) -> Status | None:
        """The ``Status`` of a message ``recv(src, tag)`` would take now, else None."""
        _, src, tag = self._check_probe("iprobe", src, tag)
        if src == PROC_NULL:  # as MPI's: at once, an empty message from nobody
            return Status(PROC_NULL, ANY_TAG, 0)
        found = self._g.backend.probe_meta(src, tag)
        return self._status(found) if found is not None else None

    @public
    def probe(self, src: int = ANY_SOURCE, tag: int = ANY_TAG, *,
              timeout: float | None = None) -> Status:
        """Block until a message from ``src`` (-1: any) with ``tag`` (-1: any) can be received;
        its ``Status`` (source, tag, nbytes, the sender's dtype and shape). Raises ``CommTimeoutError`` after ``timeout``
        (default: the group's), ``PeerFailureError`` when every rank it could come from is gone.
        """
        g = self._g
        _, src, tag = self._check_probe("probe", src, tag)
        if src == PROC_NULL:
            return Status(PROC_NULL, ANY_TAG, 0)
        t = g.timeout if timeout is None else g._timeout_of("probe", timeout)
        # a message already there, or there within a short spin: no waiting, so nothing to
        # record (as in the quick lanes)
        hit = _probe_spin(g.backend.probe_meta, src, tag, t if t < QUICK_SPIN_S else QUICK_SPIN_S)
        if hit is not None:
            return self._status(hit)
        box: list[Any] = []

        def found() -> bool:
            hit = g.backend.probe_meta(src, tag)
            if hit is not None:
                box.append(hit)
            return hit is not None

        rec = g._rec  # recorded, so a rank stuck waiting for any sender shows where in its dump
        tok = rec.begin("probe", g, 0, None, None, src) if rec is not None else 0
        what = (f"no message from {'any rank' if src == ANY_SOURCE else f'rank {src}'} with "
                f"{'any tag' if tag == ANY_TAG else f'tag {tag}'}")
        try:  # through wait_for: after a moment the watchdog waits (and names a deadlock)
            wait_for(g, f"probe(src={src}, tag={tag})", 0, Polled(found, what), t)
        except HpcdpError as exc:
            on_error(rec, tok, exc)
            raise
        if rec is not None:
            rec.end(tok)
        return self._status(box[0])

    @public
    def recv_any(self, buf: Any = None, src: int = ANY_SOURCE, tag: int = ANY_TAG, *,
                 dtype: Any = None, timeout: float | None = None) -> tuple[Any, Status]:
        """Receive the next message from ``src`` (any rank by default) with ``tag``.

        With ``buf=None`` a numpy array of the sender's dtype and shape is allocated (what the
        probe reports: a message that has been sent; a torch tensor arrives as the numpy array
        it was sent as). ``dtype`` that is not the sender's reinterprets the bytes as a 1-D
        array of ``dtype``. Where the dtype is not known (a transport that does not carry it),
        a 1-D array of ``dtype`` (default uint8). Returns ``(array, status)``.
        """
        g = self._g
        if buf is not None and type(buf) is not _ndarray and (tc := tensor_call(g._where("recv"), buf)):
            return via_tensors(tc, self.recv_any(tc.write(buf, "the receive buffer"), src, tag, dtype=dtype,
                                                 timeout=timeout))
        t = g.timeout if timeout is None else g._timeout_of("recv", timeout)
        deadline = time.monotonic() + t
        st = self.probe(src, tag, timeout=t)
        given = buf is not None
        out = None  # what is returned, where it is not the buffer received into
        if buf is None:
            dt = None if dtype is None else np.dtype(dtype)
            if st.dtype is not None:  # as sent; then viewed as ``dtype`` if another was asked
                buf = np.empty(st.shape, st.dtype)
                if dt is not None and dt != st.dtype:
                    out = self._viewed(buf, dt, st)
            else:
                dt = np.dtype(np.uint8) if dt is None else dt
                buf = np.empty(self._whole(st, dt), dt)
        elif dtype is not None and np.dtype(dtype) != buf.dtype:
            raise TypeError(f"{g._where('recv')}: dtype={np.dtype(dtype)} but buf is {buf.dtype}")
        left = max(1e-3, deadline - time.monotonic())
        if g._debug == "detail":  # a buffer made here is compared by what the caller chose of it
            check = "full" if given else "size" if dtype is None else "dtype"
            sent: list[Any] = []
            got = self._irecv(buf, st.source, st.tag, check, sent.append if not given else None
                              ).wait(left)
            if sent and sent[0] is not None:  # the header said what was sent (on receipt)
                sdt, shape = sent[0]
                st = dataclasses.replace(st, dtype=sdt, shape=shape)
                if dtype is None:
                    got = got.view(sdt).reshape(shape)
            return got, st
        if st.source == g.rank:  # a message to oneself: the blocking path refuses self-receives
            got = self.irecv(buf, st.source, st.tag).wait(left)
        else:
            got = self.recv(buf, st.source, st.tag, timeout=left)
        return (got if out is None else out), st

    def _whole(self, st: Status, dt: np.dtype) -> int:
        """Elements of ``dt`` in the message ``st``; a ``ValueError`` if it is not a whole number."""
        if st.nbytes % dt.itemsize:
            raise ValueError(f"{self._g._where('recv')}: the message from rank {st.source} (tag "
                             f"{st.tag}) has {st.nbytes} bytes, not a whole number of {dt}")
        return st.nbytes // dt.itemsize

    def _viewed(self, buf: np.ndarray, dt: np.dtype, st: Status) -> np.ndarray:
        """``buf`` (the sender's dtype and shape) as a 1-D array of ``dt``: ``recv(dtype=...)``
        of another dtype than the sender's reads the bytes as that dtype, as before messages
        carried their dtype."""
        return buf.reshape(-1).view(np.uint8)[:self._whole(st, dt) * dt.itemsize].view(dt)

    def _p2p_fast(self, x: Any, peer: int, tag: int, self_ok: bool = False) -> bool:
        """Whether a call may take the quick lane: the same checks as ``_check_p2p`` for the
        common case (contiguous numpy, plain ints), because halo exchanges are latency-bound.
        A blocking send or receive may not name this rank (it would wait for itself)."""
        g = self._g
        return (g._fast and type(x) is _ndarray and type(peer) is int and type(tag) is int
                and peer in (self._ranks if self_ok else self._peers) and 0 <= tag <= g._max_tag
                and x.dtype in SUPPORTED_SET and x.flags.c_contiguous)

    def _recv_fast(self, buf: Any, src: int, tag: int) -> bool:
        """``_p2p_fast`` for the receiving half of a ``sendrecv``: also any source and any tag
        where the backend's quick lane matches them itself (MPI does)."""
        g = self._g
        return (g._fast and type(buf) is _ndarray and type(src) is int and type(tag) is int
                and (src in self._ranks or (src == ANY_SOURCE and self._wild()))
                and (0 <= tag <= g._max_tag or (tag == ANY_TAG and self._wild()))
                and buf.dtype in SUPPORTED_SET and buf.flags.c_contiguous and buf.flags.writeable)

    def _wild(self) -> bool:
        """Whether the backend's quick lane matches any source and any tag itself: MPI's does,
        unless it carries dtypes in the tag (a wildcard receive goes through a probe then)."""
        be = self._g.backend
        return be is not None and be.quick_p2p is not None and not be.carries_meta

    def _p2p_blocking(self, send: bool, x: np.ndarray, peer: int, tag: int,
                      timeout: float | None, k: int = 0) -> None:
        """A blocking send/recv that passed the quick checks (``k``: its number, where the
        caller counted it): the backend's quick lane where it has one, else posted and waited
        on without ``Work``. Its name (``send(dst=1, tag=0) #k``) is spelled out only for an
        error. (``send``/``recv`` inline the lane's case where nothing is recorded.)"""
        g = self._g
        op = "send" if send else "recv"
        t = g._timeout if timeout is None else g._timeout_of(op, timeout)
        if not k:
            k = self._count(op, peer, tag)
        rec = g._rec
        lane = self._lane
        if lane is not None and (rec is None or not rec.lines):
            spun = t if t < QUICK_SPIN_S else QUICK_SPIN_S
            try:
                req = (lane.send if send else lane.recv)(x, peer, tag, spun)
            except HpcdpError as exc:
                raise self._failed(op, x, peer, tag, k, -1, exc) from exc
            if req is not None:
                self._waited(op, x, peer, tag, k, t, spun, req)
            return None
        tok = rec.begin(op, g, 0, x.shape, x.dtype, peer) if rec is not None else 0
        be = g.backend
        first = t if t < WATCH_AFTER else WATCH_AFTER  # then the watchdog waits (work.finish_wait)
        try:  # the array as it is: a transport that ``carries_meta`` sends its shape
            if lane is not None:
                req = (lane.send if send else lane.recv)(x, peer, tag, first)
            elif (req := (be.send if send else be.recv)(x, peer, tag)).wait(first):
                req = None
        except HpcdpError as exc:
            raise self._failed(op, x, peer, tag, k, tok, exc) from exc
        if req is not None and (err := finish_wait(g, _name(op, "dst" if send else "src", peer,
                                                            tag, k), 0, req, t, first)):
            on_error(rec, tok, err)
            raise err
        if rec is not None:
            rec.end(tok)
        return None

    def _failed(self, op: str, x: np.ndarray, peer: int, tag: int, k: int, tok: int,
                exc: HpcdpError) -> HpcdpError:
        """The error of a blocking call whose transport failed, named, in the flight recorder
        (``tok`` < 0: not recorded yet)."""
        g = self._g
        rec = g._rec
        if tok < 0:
            tok = rec.begin(op, g, 0, x.shape, x.dtype, peer) if rec is not None else 0
        err = annotate(exc, work_where(g, _name(op, "dst" if op == "send" else "src", peer, tag, k), 0))
        on_error(rec, tok, err)
        return err

    def _waited(self, op: str, x: np.ndarray, peer: int, tag: int, k: int, t: float,
                spun: float, req: Request) -> None:
        """The rest of a quick blocking call still pending after the lane's spin: recorded
        from now on (as started), waited on to ``WATCH_AFTER``, then under the watchdog."""
        g = self._g
        rec = g._rec
        tok = rec.begin(op, g, 0, x.shape, x.dtype, peer) if rec is not None else 0
        first = t if t < WATCH_AFTER else WATCH_AFTER
        try:
            done = req.wait(first - spun)
        except HpcdpError as exc:
            raise self._failed(op, x, peer, tag, k, tok, exc) from exc
        if not done and (err := finish_wait(g, _name(op, "dst" if op == "send" else "src", peer,
                                                     tag, k), 0, req, t, first)):
            on_error(rec, tok, err)
            raise err
        if rec is not None:
            rec.end(tok)

    def send(self, x: Any, dst: int, tag: int = 0, *, timeout: float | None = None) -> None:
        """Send ``x`` to ``dst`` and return once the buffer may be reused."""
        try:  # free on success; an HpcdpError is raised from here (errors.public)
            if (type(x) is _ndarray and type(dst) is int and type(tag) is int and self._g._fast
                    and dst in self._peers and 0 <= tag <= self._max_tag
                    and x.dtype in SUPPORTED_SET and x.flags.c_contiguous):  # (``_p2p_fast``)
                c = self._counts.get(("send", dst, tag))
                if c is None:
                    c = self._counts.setdefault(("send", dst, tag), itertools.count(1))
                k = next(c)
                lane = self._lane
                if (lane is None or timeout is not None
                        or ((rec := self._g._rec) is not None and rec.lines)):
                    return self._p2p_blocking(True, x, dst, tag, timeout, k)
                try:  # (``_p2p_blocking``'s quick case, inlined: no frame)
                    req = lane.send(x, dst, tag, QUICK_SPIN_S)
                except HpcdpError as exc:
                    raise self._failed("send", x, dst, tag, k, -1, exc) from exc
                if req is not None:
                    self._waited("send", x, dst, tag, k, self._g._timeout, QUICK_SPIN_S, req)
                return None
            if type(x) is not _ndarray and (tc := tensor_call(self._g._where("send"), x)):
                return via_tensors(tc, self.send(tc.read(x), dst, tag, timeout=timeout))
            if dst == PROC_NULL:
                self._null("send", x, tag, None)
                return None
            if dst == self._g.rank:
                raise ValueError(f"{self._g._where('send')}: a blocking send to oneself would deadlock; use isend")
            self.isend(x, dst, tag).wait(timeout)
        except HpcdpError as exc:
            raise public_error(exc)  # noqa: B904 - exc is its __context__

    def recv(self, buf: Any = None, src: int | None = -1, tag: int = 0, *, dtype: Any = None,
             return_status: bool = False, timeout: float | None = None) -> Any:
        """``ProcessGroup.recv`` (its docstring is the contract)."""
        try:  # free on success; an HpcdpError is raised from here (errors.public)
            if (type(buf) is _ndarray and type(src) is int and type(tag) is int and self._g._fast
                    and src in self._peers and 0 <= tag <= self._max_tag
                    and buf.dtype in SUPPORTED_SET and buf.flags.c_contiguous
                    and buf.flags.writeable and not return_status):  # (``_p2p_fast``)
                c = self._counts.get(("recv", src, tag))
                if c is None:
                    c = self._counts.setdefault(("recv", src, tag), itertools.count(1))
                k = next(c)
                lane = self._lane
                if (lane is None or timeout is not None
                        or ((rec := self._g._rec) is not None and rec.lines)):
                    self._p2p_blocking(False, buf, src, tag, timeout, k)
                    return buf
                try:  # (as ``send``)
                    req = lane.recv(buf, src, tag, QUICK_SPIN_S)
                except HpcdpError as exc:
                    raise self._failed("recv", buf, src, tag, k, -1, exc) from exc
                if req is not None:
                    self._waited("recv", buf, src, tag, k, self._g._timeout, QUICK_SPIN_S, req)
                return buf
            if buf is not None and type(buf) is not _ndarray and (tc := tensor_call(self._g._where("recv"), buf)):
                return via_tensors(tc, self.recv(tc.write(buf, "the receive buffer"), src, tag, dtype=dtype,
                                                 return_status=return_status, timeout=timeout))
            if src == PROC_NULL:  # nothing arrives: buf untouched (None without one), as MPI's
                self._null("recv", buf, tag, buf)
                return (buf, Status(PROC_NULL, ANY_TAG, 0)) if return_status else buf
            if src is None:  # torch's spelling of "any source"
                src = -1
            if buf is None or src == -1 or tag == -1 or return_status:
                got, status = self.recv_any(buf, src, tag, dtype=dtype, timeout=timeout)
                return (got, status) if return_status else got
            if src == self._g.rank:
                raise ValueError(f"{self._g._where('recv')}: a blocking recv from oneself would deadlock; use irecv")
            return self.irecv(buf, src, tag).wait(timeout)
        except HpcdpError as exc:
            raise public_error(exc)  # noqa: B904 - exc is its __context__

    def sendrecv(self, sendbuf: Any, dst: int, recvbuf: Any = None, src: int = ANY_SOURCE, *,
                 sendtag: int = 0, recvtag: int = ANY_TAG, dtype: Any = None,
                 return_status: bool = False, timeout: float | None = None) -> Any:
        """``ProcessGroup.sendrecv`` (its docstring is the contract)."""
        g = self._g
        try:  # free on success; an HpcdpError is raised from here (errors.public)
            if (type(sendbuf) is _ndarray and type(recvbuf) is _ndarray and not return_status
                    and type(dst) is int and type(sendtag) is int and g._fast
                    and dst in self._ranks and 0 <= sendtag <= self._max_tag
                    and sendbuf.dtype in SUPPORTED_SET and sendbuf.flags.c_contiguous
                    and ((type(src) is int and src in self._ranks and type(recvtag) is int
                          and 0 <= recvtag <= self._max_tag and recvbuf.dtype in SUPPORTED_SET
                          and (f := recvbuf.flags).c_contiguous and f.writeable)
                         or self._recv_fast(recvbuf, src, recvtag))  # (wildcards)
                    and ((sendbuf.base is None and recvbuf.base is None and sendbuf is not recvbuf)
                         or not np.may_share_memory(sendbuf, recvbuf))):
                self._sendrecv_quick(sendbuf, dst, sendtag, recvbuf, src, recvtag, timeout)
                return recvbuf
            if (recvtag == ANY_TAG and type(recvbuf) is _ndarray and type(src) is int
                    and (src in self._ranks or src == ANY_SOURCE) and not return_status and dtype is None
                    and self._p2p_fast(sendbuf, dst, sendtag, True) and recvbuf.dtype in SUPPORTED_SET
                    and (f := recvbuf.flags).c_contiguous and f.writeable
                    and ((sendbuf.base is None and recvbuf.base is None and sendbuf is not recvbuf)
                         or not np.may_share_memory(sendbuf, recvbuf))):
                return self._sendrecv_any_tag(sendbuf, dst, sendtag, recvbuf, src, timeout)
            if (type(sendbuf) is not _ndarray or type(recvbuf) is not _ndarray) and (
                    tc := tensor_call(g._where("sendrecv"), sendbuf, recvbuf)):
                return via_tensors(tc, self.sendrecv(
                    tc.read(sendbuf), dst, tc.write(recvbuf, "the receive buffer"), src, sendtag=sendtag,
                    recvtag=recvtag, dtype=dtype, return_status=return_status, timeout=timeout))
            if (isinstance(recvbuf, np.ndarray) and isinstance(sendbuf, np.ndarray)
                    and np.may_share_memory(sendbuf, recvbuf)):
                raise ValueError(f"{g._where('sendrecv')}: the send and receive buffers overlap "
                                 "(MPI's Sendrecv_replace is not offered: pass a copy)")
            t = g.timeout if timeout is None else g._timeout_of("sendrecv", timeout)
            deadline = time.monotonic() + t
            sent = self.isend(sendbuf, dst, sendtag)  # posted first: the receive cannot block it
            try:
                if src == g.rank and recvbuf is not None and recvtag != ANY_TAG and not return_status:
                    got = self.irecv(recvbuf, src, recvtag).wait(t)  # (to oneself: as MPI allows)
                else:
                    got = self.recv(recvbuf, src, recvtag, dtype=dtype,
                                    return_status=return_status, timeout=t)
            except BaseException:
                sent.is_completed()  # progress it; the timeout of the receive is what is raised
                raise
            sent.wait(max(1e-3, deadline - time.monotonic()))
            return got
        except HpcdpError as exc:
            raise public_error(exc)  # noqa: B904 - exc is its __context__

    def _sendrecv_any_tag(self, sbuf: np.ndarray, dst: int, stag: int, rbuf: np.ndarray, src: int,
                          timeout: float | None) -> np.ndarray:
        """``sendrecv`` with any tag (mpi4py's default ``recvtag``), from one source or any,
        where the lane cannot post a wildcard receive itself (MPI carrying dtypes in its tags):
        the send posted first (so the peer's sendrecv can complete), then the next message
        found by a short spin of probes and received by its source and tag, on the quick lane
        where there is one (``_sendrecv_peeked``, the common case). A message not there within
        the spin, or not one the buffer takes as it is, is waited for and received by
        ``probe`` and ``recv`` (its deadline, the watchdog, the flight record, the mismatch)."""
        g = self._g
        t = g._timeout if timeout is None else g._timeout_of("sendrecv", timeout)
        deadline = time.monotonic() + t
        lane = self._lane
        if lane is not None and rbuf.ndim <= 1 and ((rec := g._rec) is None or not rec.lines):
            sent = self._sendrecv_peeked(lane, sbuf, dst, stag, rbuf, src, deadline)
            if sent is None:
                return rbuf
        else:
            sent = self.isend(sbuf, dst, stag)
        try:
            # its own short spin: ``probe`` would first redo this call's checks
            hit = _probe_spin(g.backend.probe_meta, src, ANY_TAG, QUICK_SPIN_S)
            if hit is None:
                hit = self.probe(src, ANY_TAG, timeout=max(1e-3, deadline - time.monotonic()))
            left = max(1e-3, deadline - time.monotonic())
            if hit.source == g.rank:  # to oneself (any source): the blocking path refuses it
                self.irecv(rbuf, hit.source, hit.tag).wait(left)
            else:
                self.recv(rbuf, hit.source, hit.tag, timeout=left)
        except BaseException:
            sent.is_completed()  # progress it; the receive's error is what is raised
            raise
        sent.wait(max(1e-3, deadline - time.monotonic()))
        return rbuf

    def _sendrecv_peeked(self, lane: Any, sbuf: np.ndarray, dst: int, stag: int, rbuf: np.ndarray,
                         src: int, deadline: float) -> Work | None:
        """``_sendrecv_any_tag``'s common case on MPI: the send posted bare, the next message
        seen by the lane's probe within its spin and, when it fits ``rbuf``, received by its
        own tag as ``recv``'s quick case does; None once both halves are done. Else the send,
        as the ``Work`` the general way goes on with (nothing came yet, another kind of
        message, or a send the lane declined)."""
        g = self._g
        ks = self._count("send", dst, stag)
        try:
            raw = lane.start(True, sbuf, dst, stag)
        except HpcdpError as exc:
            raise self._failed("send", sbuf, dst, stag, ks, -1, exc) from exc
        if raw is None:
            return self._post_quick(True, sbuf, dst, stag, "dst", None, ks)
        try:
            hit = lane.peek(src, rbuf, QUICK_SPIN_S)
            if hit is None:
                return QuickWork(g, lane, raw, sbuf, True, dst, stag, ks)
            peer, tag = hit  # (this rank too: its send is posted, the receive cannot wait for it)
            k = self._count("recv", peer, tag)
            try:
                req = lane.recv(rbuf, peer, tag, QUICK_SPIN_S)
            except HpcdpError as exc:
                raise self._failed("recv", rbuf, peer, tag, k, -1, exc) from exc
            if req is not None:  # (the time left is measured after the spin: none to take off)
                self._waited("recv", rbuf, peer, tag, k, max(1e-3, deadline - time.monotonic()),
                             0.0, req)
        except BaseException:
            # progress the send; the receive's error is what is raised
            QuickWork(g, lane, raw, sbuf, True, dst, stag, ks).is_completed()
            raise
        # the send: a small one is done by now (no ``Work`` made), else waited on as one
        try:
            if raw.Test():
                lane.live.pop(id(raw), None)
                if lane.alert[0]:  # a notice landed: take it (a finished p2p call never fails)
                    lane.take_notices()
                return None
        except Exception as exc:  # noqa: BLE001 - MPI's error: the send's (never tested again)
            sent = QuickWork(g, lane, raw, sbuf, True, dst, stag, ks)
            sent._raise(sent._failed(exc))
        except BaseException:  # KeyboardInterrupt: MPI may still read the buffer (registered)
            if id(raw) in lane.live:
                QuickWork(g, lane, raw, sbuf, True, dst, stag, ks)._adopt()
            raise
        sent = QuickWork(g, lane, raw, sbuf, True, dst, stag, ks)
        sent._wait(max(1e-3, deadline - time.monotonic()))
        return None

    def _sendrecv_quick(self, sbuf: np.ndarray, dst: int, stag: int, rbuf: np.ndarray, src: int,
                        rtag: int, timeout: float | None) -> None:
        """A ``sendrecv`` whose two halves passed ``_p2p_fast``: both posted at once, receive
        first; the backend's quick lane where it has one (recorded as ``_p2p_blocking`` is).
        Each half counts as the send and the receive it pairs with (``send(dst=1, tag=0)
        #k``), so errors name both."""
        g = self._g
        t = g._timeout if timeout is None else g._timeout_of("sendrecv", timeout)
        counts = self._counts  # (``_count`` inlined: named on error)
        c = counts.get(("send", dst, stag))
        if c is None:
            c = counts.setdefault(("send", dst, stag), itertools.count(1))
        ks = next(c)
        c = counts.get(("recv", src, rtag))
        if c is None:
            c = counts.setdefault(("recv", src, rtag), itertools.count(1))
        kr = next(c)
        rec = g._rec
        be = g.backend
        lane = self._lane
        first = t if t < WATCH_AFTER else WATCH_AFTER  # then the watchdog waits (work.finish_wait)
        tok = -1  # not recorded yet
        try:
            if lane is not None and (rec is None or not rec.lines):
                spun = t if t < QUICK_SPIN_S else QUICK_SPIN_S
                req = lane.sendrecv(sbuf, dst, stag, rbuf, src, rtag, spun)
                if req is None:
                    return None
                tok = rec.begin("sendrecv", g, 0, rbuf.shape, rbuf.dtype, src) if rec is not None else 0
                if req.wait(first - spun):
                    req = None
            else:
                tok = rec.begin("sendrecv", g, 0, rbuf.shape, rbuf.dtype, src) if rec is not None else 0
                if lane is not None:  # both halves as one request, spun for ``first``
                    req = lane.sendrecv(sbuf, dst, stag, rbuf, src, rtag, first)
                elif (req := _Both(be.recv(rbuf, src, rtag), be.send(sbuf, dst, stag))).wait(first):
                    req = None
        except HpcdpError as exc:
            if tok < 0:
                tok = rec.begin("sendrecv", g, 0, rbuf.shape, rbuf.dtype, src) if rec is not None else 0
            err = annotate(exc, work_where(g, _sr_name(dst, stag, ks, src, rtag, kr), 0))
            on_error(rec, tok, err)
            raise err from exc
        if req is not None and (err := finish_wait(g, _sr_name(dst, stag, ks, src, rtag, kr), 0,
                                                   req, t, first)):
            on_error(rec, tok, err)
            raise err
        if rec is not None and tok:
            rec.end(tok)
        return None

"""Point-to-point calls of ``ProcessGroup``: tag-matched, nonblocking underneath, with deadlines.

The group holds a ``PointToPoint`` and delegates its point-to-point methods to it; the
module-level ``hpcdp.probe``/``iprobe``/``recv_any`` (``p2p``) call the same.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..trace.hooks import on_error
from .._arrays import SUPPORTED_SET, contiguous, xp_of
from ._debug_p2p import p2p_receiver, p2p_sender, payload_nbytes
from ._buffers import finish_into
from .validation import check_array, check_rank, check_tag
from ..backends.base import ANY_SOURCE, ANY_TAG, poll_until
from ..errors import CommTimeoutError, HpcdpError, public, public_error
from .work import Work, wait_for

if TYPE_CHECKING:
    from ..backends.base import Request
    from .group import ProcessGroup

__all__ = ["PointToPoint", "Status"]


@dataclass(frozen=True)
class Status:
    """What a probe or an any-source receive matched: group rank, tag and size in bytes."""

    source: int
    tag: int
    nbytes: int

    def count(self, dtype: Any = np.uint8) -> int:
        """How many elements of ``dtype`` the message holds."""
        return self.nbytes // np.dtype(dtype).itemsize




class PointToPoint:
    """The point-to-point calls of one ``ProcessGroup``: the group holds one (``group._p2p``)
    and its ``send``, ``recv``, ``isend``, ``irecv``, ``probe`` and ``iprobe`` delegate here;
    ``hpcdp.recv_any`` comes here too. It owns the per-(op, peer, tag) message counters that
    name each message, and posts through the group it is given (its checks, deadlines,
    flight recorder and transport)."""

    __slots__ = ("_g", "_counts")

    def __init__(self, group: "ProcessGroup") -> None:
        self._g = group
        self._counts: dict[tuple[str, int, int], Any] = {}  # (op, peer, tag) -> counter

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
        counts = self._counts
        key = (op, peer, tag)
        c = counts.get(key)
        if c is None:
            c = counts.setdefault(key, itertools.count(1))  # atomic: threads share the group
        return f"{op}({peer_name}={peer}, tag={tag}) #{next(c)}"

    @public
    def isend(self, x: Any, dst: int, tag: int = 0) -> Work:
        """Start sending ``x`` to group rank ``dst``; do not modify ``x`` until ``wait()``."""
        _, dst, tag = self._check_p2p("send", x, "dst", dst, tag)
        buf = contiguous(x)
        name = self._p2p_name("send", "dst", dst, tag)
        rec = self._g._rec
        tok = rec.begin("send", self._g, 0, x.shape, x.dtype, dst) if rec is not None else 0
        # HPCDP_DEBUG: the message carries a header its receive checks (_debug_p2p)
        send = self._g._transport(x).send if self._g._debug == "off" else p2p_sender(self._g, name, x.shape)
        req = self._g._post(name, 0, send, buf.reshape(-1), dst, tag, tok=tok)
        return Work(self._g, name, 0, req, lambda: None, None, tok)

    @public
    def irecv(self, buf: Any, src: int, tag: int = 0) -> Work:
        """Start receiving into ``buf`` from group rank ``src``; ``wait()`` returns ``buf``."""
        return self._irecv(buf, src, tag, "full")

    def _irecv(self, buf: Any, src: int, tag: int, check: str) -> Work:
        """``irecv``; ``check`` says what ``HPCDP_DEBUG`` compares with the sender's call."""
        where, src, tag = self._check_p2p("recv", buf, "src", src, tag)
        if isinstance(buf, np.ndarray) and not buf.flags.writeable:
            raise ValueError(f"{where}: the receive buffer is read-only")
        tmp = buf if buf.flags.c_contiguous else xp_of(buf).empty(buf.shape, buf.dtype)
        name = self._p2p_name("recv", "src", src, tag)
        rec = self._g._rec
        tok = rec.begin("recv", self._g, 0, buf.shape, buf.dtype, src) if rec is not None else 0
        recv = (self._g._transport(buf).recv if self._g._debug == "off"
                else p2p_receiver(self._g, name, buf.shape, check))
        req = self._g._post(name, 0, recv, tmp.reshape(-1), src, tag, tok=tok)
        return Work(self._g, name, 0, req, finish_into(buf, tmp), None, tok)

    def _check_probe(self, op: str, src: int, tag: int) -> tuple[str, int, int]:
        g = self._g
        where = g._where(op)
        g._usable(op)
        if src != ANY_SOURCE:
            src = check_rank(where, "src", src, g.size)
        if tag != ANY_TAG:
            tag = check_tag(where, tag, g._max_tag)
        return where, src, tag

    def _status(self, found: tuple[int, int, int]) -> Status:
        """The ``Status`` of a probed message; under ``HPCDP_DEBUG`` its size without the header."""
        s, t, nbytes = found
        return Status(s, t, nbytes if self._g._debug == "off" else payload_nbytes(nbytes))

    @public
    def iprobe(self, src: int = ANY_SOURCE, tag: int = ANY_TAG) -> Status | None:
        """The ``Status`` of a message ``recv(src, tag)`` would take now, else None."""
        _, src, tag = self._check_probe("iprobe", src, tag)
        found = self._g.backend.probe(src, tag)
        return self._status(found) if found is not None else None

    @public
    def probe(self, src: int = ANY_SOURCE, tag: int = ANY_TAG, *,
              timeout: float | None = None) -> Status:
        """Block until a message from ``src`` (-1: any) with ``tag`` (-1: any) can be received;
        its ``Status`` (source, tag, nbytes). Raises ``CommTimeoutError`` after ``timeout``
        (default: the group's), ``PeerFailureError`` when every rank it could come from is gone.
        """
        g = self._g
        where, src, tag = self._check_probe("probe", src, tag)
        t = g.timeout if timeout is None else g._timeout_of("probe", timeout)
        box: list[Any] = []

        def found() -> bool:
            hit = g.backend.probe(src, tag)
            if hit is not None:
                box.append(hit)
            return hit is not None

        rec = g._rec  # recorded, so a rank stuck waiting for any sender shows where in its dump
        tok = rec.begin("probe", g, 0, None, None, src) if rec is not None else 0
        try:
            if not poll_until(found, time.monotonic() + t):
                raise CommTimeoutError(f"{where}: no message from "
                                       f"{'any rank' if src == ANY_SOURCE else f'rank {src}'} with "
                                       f"{'any tag' if tag == ANY_TAG else f'tag {tag}'} within {t:g} s")
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

        With ``buf=None`` a 1-D numpy array of ``dtype`` (default uint8) is allocated at the size
        the probe reports, which is the size of a message that has been sent. Returns
        ``(array, status)``.
        """
        g = self._g
        t = g.timeout if timeout is None else g._timeout_of("recv", timeout)
        deadline = time.monotonic() + t
        st = self.probe(src, tag, timeout=t)
        given = buf is not None
        if buf is None:
            dt = np.dtype(np.uint8 if dtype is None else dtype)
            if st.nbytes % dt.itemsize:
                raise ValueError(f"{g._where('recv')}: the message from rank {st.source} (tag "
                                 f"{st.tag}) has {st.nbytes} bytes, not a whole number of {dt}")
            buf = np.empty(st.nbytes // dt.itemsize, dt)
        elif dtype is not None and np.dtype(dtype) != buf.dtype:
            raise TypeError(f"{g._where('recv')}: dtype={np.dtype(dtype)} but buf is {buf.dtype}")
        left = max(1e-3, deadline - time.monotonic())
        if g._debug != "off":  # a buffer made here is compared by what the caller chose of it
            check = "full" if given else "size" if dtype is None else "dtype"
            return self._irecv(buf, st.source, st.tag, check).wait(left), st
        if st.source == g.rank:  # a message to oneself: the blocking path refuses self-receives
            return self.irecv(buf, st.source, st.tag).wait(left), st
        return self.recv(buf, st.source, st.tag, timeout=left), st

    def _wait_recorded(self, name: str, req: "Request", t: float, rec: Any, tok: int) -> None:
        """``wait_for`` of a blocking send/recv, ending its flight-recorder entry either way."""
        try:
            wait_for(self._g, name, 0, req, t)
        except HpcdpError as exc:
            on_error(rec, tok, exc)
            raise
        if rec is not None:
            rec.end(tok)

    def _p2p_fast(self, x: Any, peer: int, tag: int) -> bool:
        """Whether a blocking send/recv may skip ``Work``: the same checks as ``_check_p2p``
        for the common case (contiguous numpy, plain ints), because ping-pongs are latency-bound."""
        return (self._g._fast and type(x) is np.ndarray and type(peer) is int and type(tag) is int
                and 0 <= peer < self._g.size and peer != self._g.rank and 0 <= tag <= self._g._max_tag
                and x.dtype in SUPPORTED_SET and x.flags.c_contiguous)

    def _p2p_blocking(self, op: str, key: str, post: Any, x: np.ndarray, peer: int, tag: int,
                      timeout: float | None) -> None:
        """A blocking send/recv that passed ``_p2p_fast``: posted and waited on without ``Work``."""
        t = self._g._timeout if timeout is None else self._g._timeout_of(op, timeout)
        name = self._p2p_name(op, key, peer, tag)
        rec = self._g._rec
        tok = rec.begin(op, self._g, 0, x.shape, x.dtype, peer) if rec is not None else 0
        req = self._g._post(name, 0, post, x if x.ndim == 1 else x.reshape(-1), peer, tag, tok=tok)
        self._wait_recorded(name, req, t, rec, tok)

    def send(self, x: Any, dst: int, tag: int = 0, *, timeout: float | None = None) -> None:
        """Send ``x`` to ``dst`` and return once the buffer may be reused."""
        try:  # free on success; an HpcdpError is raised from here (errors.public)
            if self._p2p_fast(x, dst, tag):
                self._p2p_blocking("send", "dst", self._g.backend.send, x, dst, tag, timeout)
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
            if self._p2p_fast(buf, src, tag) and buf.flags.writeable and not return_status:
                self._p2p_blocking("recv", "src", self._g.backend.recv, buf, src, tag, timeout)
                return buf
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

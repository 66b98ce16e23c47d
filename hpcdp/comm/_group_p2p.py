"""Point-to-point calls of ``ProcessGroup``: tag-matched, nonblocking underneath, with deadlines."""
from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from .. import trace
from .._arrays import _SUPPORTED, contiguous, xp_of
from ._debug_p2p import p2p_receiver, p2p_sender
from ._buffers import finish_into
from .validation import check_array, check_rank, check_tag
from ..errors import HpcdpError, public, public_error
from .work import Work, wait_for

if TYPE_CHECKING:
    from ..backends.base import Backend, Request

__all__ = ["PointToPoint"]


class PointToPoint:
    """Mixin of ``ProcessGroup`` (which provides the attributes declared here)."""

    backend: "Backend"
    size: int
    rank: int
    _fast: bool
    _debug: str
    _rec: Any
    _max_tag: int
    _p2p_counts: dict[tuple[str, int, int], Any]
    _timeout: float
    _where: Callable[[str], str]
    _usable: Callable[[str], None]
    _transport: Callable[[Any], Any]
    _timeout_of: Callable[[str, Any], float]
    _post: Callable[..., "Request"]

    def _check_p2p(self, op: str, x: Any, peer_name: str, peer: int, tag: int) -> tuple[str, int, int]:
        where = self._where(op)
        self._usable(op)
        peer = check_rank(where, peer_name, peer, self.size)
        tag = check_tag(where, tag, self._max_tag)
        check_array(where, x)
        return where, peer, tag

    def _p2p_name(self, op: str, peer_name: str, peer: int, tag: int) -> str:
        """``send(dst=1, tag=3) #k``: the k-th message of this pair with this tag. Matching is
        non-overtaking per (source, tag), so the receive that takes it is ``recv(...) #k`` too:
        errors and traces pair sends with receives."""
        counts = self._p2p_counts
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
        rec = self._rec
        tok = rec.begin("send", self, 0, x.shape, x.dtype, dst) if rec is not None else 0
        # HPCDP_DEBUG: the message carries a header its receive checks (_debug_p2p)
        send = self._transport(x).send if self._debug == "off" else p2p_sender(self, name, x.shape)
        req = self._post(name, 0, send, buf.reshape(-1), dst, tag, tok=tok)
        return Work(self, name, 0, req, lambda: None, None, tok)

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
        rec = self._rec
        tok = rec.begin("recv", self, 0, buf.shape, buf.dtype, src) if rec is not None else 0
        recv = (self._transport(buf).recv if self._debug == "off"
                else p2p_receiver(self, name, buf.shape, check))
        req = self._post(name, 0, recv, tmp.reshape(-1), src, tag, tok=tok)
        return Work(self, name, 0, req, finish_into(buf, tmp), None, tok)

    @public
    def probe(self, src: int = -1, tag: int = -1, *, timeout: float | None = None) -> Any:
        """Block until a message from ``src`` (-1: any) with ``tag`` (-1: any) can be received;
        its ``Status`` (source, tag, nbytes). See ``hpcdp.probe``."""
        from .p2p import probe

        return probe(src, tag, group=self, timeout=timeout)

    @public
    def iprobe(self, src: int = -1, tag: int = -1) -> Any:
        """The ``Status`` of a message ``recv(src, tag)`` would take now, else None."""
        from .p2p import iprobe

        return iprobe(src, tag, group=self)

    def _wait_recorded(self, name: str, req: "Request", t: float, rec: Any, tok: int) -> None:
        """``wait_for`` of a blocking send/recv, ending its flight-recorder entry either way."""
        try:
            wait_for(self, name, 0, req, t)  # type: ignore[arg-type]
        except HpcdpError as exc:
            trace.on_error(rec, tok, exc)
            raise
        if rec is not None:
            rec.end(tok)

    def _p2p_fast(self, x: Any, peer: int, tag: int) -> bool:
        """Whether a blocking send/recv may skip ``Work``: the same checks as ``_check_p2p``
        for the common case (contiguous numpy, plain ints), because ping-pongs are latency-bound."""
        return (self._fast and type(x) is np.ndarray and type(peer) is int and type(tag) is int
                and 0 <= peer < self.size and peer != self.rank and 0 <= tag <= self._max_tag
                and x.dtype in _SUPPORTED and x.flags.c_contiguous)

    def _p2p_blocking(self, op: str, key: str, post: Any, x: np.ndarray, peer: int, tag: int,
                      timeout: float | None) -> None:
        """A blocking send/recv that passed ``_p2p_fast``: posted and waited on without ``Work``."""
        t = self._timeout if timeout is None else self._timeout_of(op, timeout)
        name = self._p2p_name(op, key, peer, tag)
        rec = self._rec
        tok = rec.begin(op, self, 0, x.shape, x.dtype, peer) if rec is not None else 0
        req = self._post(name, 0, post, x if x.ndim == 1 else x.reshape(-1), peer, tag, tok=tok)
        self._wait_recorded(name, req, t, rec, tok)

    def send(self, x: Any, dst: int, tag: int = 0, *, timeout: float | None = None) -> None:
        """Send ``x`` to ``dst`` and return once the buffer may be reused."""
        try:  # free on success; an HpcdpError is raised from here (errors.public)
            if self._p2p_fast(x, dst, tag):
                self._p2p_blocking("send", "dst", self.backend.send, x, dst, tag, timeout)
                return None
            if dst == self.rank:
                raise ValueError(f"{self._where('send')}: a blocking send to oneself would deadlock; use isend")
            self.isend(x, dst, tag).wait(timeout)
        except HpcdpError as exc:
            raise public_error(exc)  # noqa: B904 - exc is its __context__

    def recv(self, buf: Any = None, src: int | None = -1, tag: int = 0, *, dtype: Any = None,
             return_status: bool = False, timeout: float | None = None) -> Any:
        """Receive into ``buf`` from ``src``; returns ``buf`` (torch's returns the sender's rank:
        ``return_status=True`` gives it as ``Status.source``).

        ``src=ANY_SOURCE`` (-1, the default) takes the next message from any rank, ``tag=ANY_TAG``
        any tag; ``buf=None`` allocates a 1-D array of ``dtype`` (default uint8) at the size the
        sender sent (``hpcdp.probe``). ``return_status=True`` returns ``(buf, Status)``.
        """
        try:  # free on success; an HpcdpError is raised from here (errors.public)
            if self._p2p_fast(buf, src, tag) and buf.flags.writeable and not return_status:
                self._p2p_blocking("recv", "src", self.backend.recv, buf, src, tag, timeout)
                return buf
            if src is None:  # torch's spelling of "any source"
                src = -1
            if buf is None or src == -1 or tag == -1 or return_status:
                from .p2p import recv_any

                got, status = recv_any(buf, src, tag, dtype=dtype, group=self, timeout=timeout)
                return (got, status) if return_status else got
            if src == self.rank:
                raise ValueError(f"{self._where('recv')}: a blocking recv from oneself would deadlock; use irecv")
            return self.irecv(buf, src, tag).wait(timeout)
        except HpcdpError as exc:
            raise public_error(exc)  # noqa: B904 - exc is its __context__

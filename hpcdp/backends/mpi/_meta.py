"""The dtype and shape of a point-to-point message on MPI, carried in its tag.

``recv(None)`` must return what was sent, and a send into a given buffer must cost what it did
(a header in the message would be a copy on each side, a second message a second MPI call).
So the dtype and the number of dimensions ride in the low bits of the MPI tag, which MPI
matches anyway::

    wire tag = user tag << 6 | class << 4 | dtype code      (class: 0 = 0-d, 1 = 1-D, 2 = n-D)

(dtype code: the place in ``SUPPORTED_DTYPES``, ``base.DTYPE_CODES``). A 0-d or 1-D message needs
nothing else; an n-D one (``ndim >= 2``) is followed by its dimensions (int64[ndim]) on the
group's check communicator (``MPIBackend._checks``, where no user message goes), on the same
wire tag. User tags therefore go up to ``TAG_UB >> 6`` (33554431 on Open MPI); an MPI whose
``TAG_UB`` leaves fewer than 32767 user tags keeps plain tags and does not carry the dtype
(``TagMeta.on`` False: ``recv(None)`` then returns bytes, as ``carries_meta`` says).

What follows from matching on the wire tag:

- A receive into a buffer is posted on its own dtype and class: as fast as before. If the
  next message of its (source, tag) has another class but the same dtype and size (a 0-d
  array into a buffer of one element, (2, 3) into (6,)), the receive notices it while waiting
  (a probe now and then), withdraws itself and takes that message: MPI allows
  any shape of the same elements. Another dtype or size: it withdraws and raises
  ``CollectiveMismatchError`` naming both, the message left for a receive that fits. A
  receive that MPI had already matched cannot be withdrawn (``Cancel`` fails): it completes.
  The look (``scan``) runs only while a receive is waited on (``MPIRequest.watch``), so a
  receive whose message is there costs nothing more.
- Order is kept per (source, tag, dtype, class), not per (source, tag): messages of one tag
  and several dtypes are each taken by the receive of their own dtype, and ``recv(None)`` of
  a tag with messages of several dtypes waiting takes one of them (the first code found).
- A probe of one tag looks at the oldest message of the source first (one ``Iprobe``), and only
  if that belongs to another tag at each code of the tag (42 probes).
- A receive from any source or with any tag at the backend level (the API's go through a
  probe) matches its message with ``Improbe`` when tested (``Matched``), not when posted.
- ``probe`` of an n-D message receives its dimensions (a dims message cannot be read without
  being received) and keeps them for the receive that takes the message (``stash``).
"""
from __future__ import annotations

import collections
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from ..._arrays import SUPPORTED_DTYPES
from ...errors import CollectiveMismatchError
from ..base import DTYPE_CODES, Probed, Request, meta_of, poll_until
from . import _requests as _rq

if TYPE_CHECKING:
    from ._backend import MPIBackend

__all__ = ["TagMeta", "Matched", "SHIFT", "wire", "watch", "scan"]

SHIFT = 6
_CLASS = (0, 16, 32)  # 0-d, 1-D, n-D, already shifted
_ND = 32
#: the largest user tag needs this TAG_UB (32767 user tags, as MPI guarantees without us)
_MIN_UB = (32767 << SHIFT) | ((1 << SHIFT) - 1)
#: numpy's most dimensions: the receive buffer of a dims message
_MAX_DIMS = 64
#: every (class, dtype) code, in the order probes try them
_CODES = tuple(c | d for c in _CLASS for d in range(len(SUPPORTED_DTYPES)))
_monotonic = time.monotonic


def wire(tag: int, buf: np.ndarray) -> int:
    nd = buf.ndim
    return (tag << SHIFT) | (16 if nd == 1 else _ND if nd else 0) | DTYPE_CODES[buf.dtype]


def _describe(code: int, nbytes: int) -> str:
    dt = SUPPORTED_DTYPES[code & 15] if (code & 15) < len(SUPPORTED_DTYPES) else "?"
    cls = code & 48
    shape = "0-d" if cls == 0 else "1-D" if cls == 16 else "n-D"
    return f"{dt} ({shape}, {nbytes} bytes)"


class TagMeta:
    """One group's wire tags: encode, decode, probe; the dims of probed n-D messages."""

    __slots__ = ("on", "max_tag", "comm", "dims_comm", "int64", "stash", "lock", "_mpi")

    def __init__(self, mpi: Any, comm: Any, dims_comm: Any, tag_ub: int, on: bool) -> None:
        self._mpi = mpi
        self.on = on and tag_ub >= _MIN_UB
        self.max_tag = tag_ub >> SHIFT if self.on else tag_ub
        self.comm, self.dims_comm = comm, dims_comm
        self.int64 = mpi.INT64_T
        #: (source, wire tag) -> dims of n-D messages received by a probe before their data
        self.stash: dict[tuple[int, int], collections.deque[tuple[int, ...]]] = {}
        self.lock = threading.Lock()

    # -- sending -----------------------------------------------------------------------------
    def send_dims(self, buf: np.ndarray, dst: int, w: int) -> tuple[Any, np.ndarray]:
        """The dims message of an n-D send (its request, and the array MPI reads until done)."""
        dims = np.array(buf.shape, np.int64)
        return self.dims_comm.Isend([dims, self.int64], dst, w), dims

    # -- receiving ---------------------------------------------------------------------------
    def recv_dims(self, src: int, w: int) -> tuple[Any, np.ndarray] | None:
        """The receive of an n-D message's dims: None where a probe already took them."""
        with self.lock:
            box = self.stash.get((src, w))
            if box:
                box.popleft()
                if not box:
                    del self.stash[(src, w)]
                return None
            scratch = np.empty(_MAX_DIMS, np.int64)
            return self.dims_comm.Irecv([scratch, self.int64], src, w), scratch

    def _peek_dims(self, src: int, w: int) -> tuple[int, ...] | None:
        """The dims of the oldest n-D message from ``src`` on ``w`` not yet received, taking
        its dims message into ``stash`` if no probe did; None while it has not arrived."""
        MPI = self._mpi
        with self.lock:
            box = self.stash.get((src, w))
            if box:
                return box[0]
            st = MPI.Status()
            msg = self.dims_comm.Improbe(src, w, st)
            if msg is None:
                return None
            n = st.Get_count(MPI.BYTE)
            if n % 8 or n > 8 * _MAX_DIMS:  # not one of ours: take it off and say nothing
                msg.Recv([np.empty(max(n, 1), np.uint8), MPI.BYTE])
                return None
            dims = np.empty(n // 8, np.int64)
            msg.Recv([dims, self.int64])
            shape = tuple(int(d) for d in dims)
            self.stash.setdefault((src, w), collections.deque()).append(shape)
            return shape

    def unpeek(self, src: int, w: int, shape: tuple[int, ...]) -> None:
        """Put back dims a withdrawn receive had taken: the oldest of their (source, tag)."""
        with self.lock:
            self.stash.setdefault((src, w), collections.deque()).appendleft(shape)

    # -- probing -----------------------------------------------------------------------------
    def find(self, src: int, tag: int, st: Any, skip: int = -1) -> int | None:
        """The wire tag of the message ``probe(src, tag)`` reports (``st`` filled), else None;
        ``tag`` -1: any. ``skip``: a wire tag not to report (a receive's own)."""
        MPI = self._mpi
        comm = self.comm
        if not comm.Iprobe(src, MPI.ANY_TAG, st):
            return None  # nothing from ``src`` at all: one probe
        w = st.Get_tag()
        if tag < 0 or (w >> SHIFT == tag and w != skip):
            return w
        base = tag << SHIFT
        for c in _CODES:
            if base | c != skip and comm.Iprobe(src, base | c, st):
                return base | c
        return None

    def probe(self, src: int, tag: int) -> Probed | None:
        MPI = self._mpi
        st = MPI.Status()
        w = self.find(MPI.ANY_SOURCE if src < 0 else src, tag, st)
        if w is None:
            return None
        source, nbytes = st.Get_source(), st.Get_count(MPI.BYTE)
        code, cls = w & 15, w & 48
        shape: tuple[int, ...] | None
        if cls == 0:
            shape = ()
        elif cls == 16:
            shape = None
        else:
            shape = self._peek_dims(source, w)
            if shape is None:  # its dims are on their way: not receivable as a whole yet
                return None
        return Probed(source, w >> SHIFT, nbytes, *meta_of(nbytes, code, shape))


def watch(meta: TagMeta, buf: np.ndarray, mpi_type: Any, src: int, tag: int, w: int,
          j: int | None = None, dims: Any = None) -> tuple:
    """What ``MPIRequest.watch`` holds for a receive posted on its own wire tag ``w`` (its data
    receive ``reqs[0]``, its dims receive ``reqs[j]`` if any): ``scan`` runs on it now and then
    while the request is waited on. A tuple: made for every receive, so it must cost little."""
    return (scan, meta, buf, mpi_type, src, tag, w, j, dims)


def scan(req: _rq.MPIRequest) -> None:
    """Look for a message of the receive's (source, tag) with another dtype or class: the same
    dtype and size in another shape is taken instead, anything else withdraws the receive and
    fails it with ``CollectiveMismatchError`` (see the module docstring). ``req.watch``'s
    fields: see ``watch``."""
    _fn, meta, buf, mpi_type, src, tag, w, j, dims = req.watch
    MPI = meta._mpi
    st = MPI.Status()
    with _rq._LOCK:
        if req.done:
            return
        other = meta.find(src, tag, st, skip=w)
        if other is None:
            return
        nbytes = st.Get_count(MPI.BYTE)
        if not _withdraw(meta, req, src, w, j, dims):
            return  # MPI had matched it already: its own message is coming in
        if (other & 15) == (w & 15) and nbytes == buf.nbytes:
            _take(meta, req, buf, mpi_type, src, tag, other, j)
            return
        ranks = req.be.ranks
        req.watch = None
        req.error = CollectiveMismatchError(
            f"recv on rank {ranks[req.be.rank]}: the message from rank {ranks[src]} "
            f"(tag {tag}) is {_describe(other, nbytes)}, the receive buffer "
            f"{buf.dtype} {buf.shape} ({buf.nbytes} bytes): a send and its receive must have "
            f"the same dtype and size")
        req._poll()  # (every part withdrawn: it completes, failed, and lets go of the buffers)
    raise req.error


def _withdraw(meta: TagMeta, req: _rq.MPIRequest, src: int, w: int, j: int | None,
              dims: Any) -> bool:
    """Cancel the data receive (and the dims one); False where MPI had matched it."""
    MPI = meta._mpi
    reqs = req.reqs
    if not _cancelled(MPI, reqs[0]):
        return False
    if j is not None and reqs[j]:
        st = MPI.Status()
        r = reqs[j]
        r.Cancel()
        r.Wait(st)
        if not st.Is_cancelled():  # it took dims of a message of ours still to come
            n = st.Get_count(MPI.BYTE) // 8
            meta.unpeek(src, w, tuple(int(d) for d in dims[:n]))
    return True


def _take(meta: TagMeta, req: _rq.MPIRequest, buf: np.ndarray, mpi_type: Any, src: int,
          tag: int, w: int, j: int | None) -> None:
    """Post the receive again on wire tag ``w`` (the same dtype, another class)."""
    reqs = req.reqs
    reqs[0] = meta.comm.Irecv([buf, mpi_type], src, w)
    dims = None
    got = meta.recv_dims(src, w) if w & 48 == _ND else None
    if got is not None:
        if j is None:
            j = len(reqs)
            reqs.append(got[0])
        else:
            reqs[j] = got[0]
        dims = got[1]
        req.keep = (req.keep, dims)
    elif j is not None:
        reqs[j] = meta._mpi.REQUEST_NULL
        j = None
    req.watch = (scan, meta, buf, mpi_type, src, tag, w, j, dims)


def _cancelled(MPI: Any, r: Any) -> bool:
    """Cancel ``r`` and wait for it; whether it was withdrawn (False: it had been matched)."""
    if not r:
        return False
    st = MPI.Status()
    r.Cancel()
    r.Wait(st)
    return bool(st.Is_cancelled())


class Matched(Request):
    """A receive from any source or with any tag (``MPIBackend.recv``): no wire tag can be
    posted for it (the dtype is part of the tag), so each test looks for its message with a
    matched probe (``Improbe``: no other receive can take it then), checks its dtype, and
    receives it (and an n-D message's dims). A message of another dtype is taken off and
    raises ``CollectiveMismatchError``. Until matched, nothing is posted."""

    __slots__ = ("be", "meta", "buf", "mpi_type", "src", "tag", "what", "inner", "keep")

    def __init__(self, be: "MPIBackend", meta: TagMeta, buf: np.ndarray, mpi_type: Any,
                 src: int, tag: int, what: str) -> None:
        self.be, self.meta, self.buf, self.mpi_type = be, meta, buf, mpi_type
        self.src, self.tag, self.what = src, tag, what
        self.inner: _rq.MPIRequest | None = None
        self.keep: Any = ()

    def _match(self) -> bool:
        MPI = self.meta._mpi
        st = MPI.Status()
        t = MPI.ANY_TAG if self.tag < 0 else wire(self.tag, self.buf)
        msg = self.meta.comm.Improbe(self.src, t, st)
        if msg is None:
            notices = self.be.notices
            if notices.waiting():
                notices.check(0, True)  # a peer that left fails this wait
            return False
        w, source, nbytes = st.Get_tag(), st.Get_source(), st.Get_count(MPI.BYTE)
        if (w & 15) != DTYPE_CODES[self.buf.dtype]:
            msg.Recv([np.empty(max(nbytes, 1), np.uint8), MPI.BYTE])  # taken off: it was ours
            if w & 48 == _ND:
                got = self.meta.recv_dims(source, w)
                if got is not None:
                    got[0].Wait()
            ranks = self.be.ranks
            raise CollectiveMismatchError(
                f"{self.what} on rank {ranks[self.be.rank]}: the message from rank "
                f"{ranks[source]} (tag {w >> SHIFT}) is {_describe(w, nbytes)}, the receive "
                f"buffer {self.buf.dtype} {self.buf.shape}: a send and its receive must have the "
                f"same dtype")
        reqs = [msg.Irecv([self.buf, self.mpi_type])]
        keep: Any = self.buf
        if w & 48 == _ND:
            got = self.meta.recv_dims(source, w)
            if got is not None:
                reqs.append(got[0])
                keep = (self.buf, got[1])
        self.inner = _rq.MPIRequest(self.be, reqs, self.what)
        self.inner.keep = keep
        return True

    def test(self) -> bool:
        if self.inner is None:
            try:
                if not self._match():
                    return False
            except self.meta._mpi.Exception as exc:
                raise self.be.notices.mpi_error(exc, self.what, 0) from None
        return self.inner.test()

    def wait(self, timeout: float | None) -> bool:
        if self.test():
            return True
        deadline = None if timeout is None else _monotonic() + timeout
        return poll_until(self.test, deadline, _rq.serve_all, 8)

    def pending(self) -> str:
        if self.inner is None:
            return f"{self.what} did not complete: no message has come"
        return self.inner.pending()

    def abandon(self) -> bool | None:
        return None if self.inner is None else self.inner.abandon()

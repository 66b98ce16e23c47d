"""Small allreduces on persistent MPI requests: the schedule is built once, each call starts it.

Why: measured on 2 ranks bound to cores (Open MPI 4.1, libnbc), one 8 B allreduce took 1.3 us as
``Allreduce``, 1.9 us as ``Iallreduce`` + ``Test`` and 1.0 us as ``Start`` + ``Test`` of a
persistent request (``MPI_Allreduce_init``; ``MPIX_Allreduce_init`` in Open MPI 4). A persistent
request is bound to its buffers, so a call copies in and out: 1.33 us against 2.23 us for the
copy + ``Iallreduce`` it replaces at 8 B, 1.71 against 2.65 us at 1 KiB. Still nonblocking, so
every wait keeps its deadline and a late rank still gets an exception, not an abort.

Matching. libnbc gives a persistent request its tag when the request is made, and an
``Iallreduce`` takes the next tag when it is posted: a ``Start`` on one rank never matches an
``Iallreduce`` on another. So every rank must choose alike for the same call, and the choice
depends only on what the collective contract makes equal on every rank (dtype, element count,
op, the order of calls), never on blocking or ``async_op``, memory layout or array module.
Requests are made on first use and retired oldest first, both in call order, so every rank makes
and retires the same ones at the same call. A call whose request is still running (an async call
not completed yet) queues behind it and starts once it completes: every rank starts the k-th call
of a request after its (k-1)-th, and the k-th calls match.
"""
from __future__ import annotations

import ctypes
import os
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ..errors import HpcdpError
from . import _mpi_requests as _rq

if TYPE_CHECKING:
    from .mpi import MPIBackend

__all__ = ["Slot", "Slots", "SmallRequest", "initializer", "MAX_SLOTS"]

#: persistent requests a group keeps (each holds two buffers of under ``RING_MIN_BYTES``)
MAX_SLOTS = 32

Init = Callable[[Any, np.ndarray, np.ndarray, Any, Any], Any]


_probed: list[Init | None] = []


def initializer(MPI: Any) -> Init | None:
    """``init(comm, send, recv, mpi_type, mpi_op) -> Prequest``, or None where MPI has none;
    probed once per process. ``HPCDP_MPI_PERSISTENT=0`` turns the path off (set it alike on
    every rank: the choice must be the same on all)."""
    if not _probed:
        _probed.append(_probe(MPI))
    return _probed[0]


def _probe(MPI: Any) -> Init | None:
    if os.environ.get("HPCDP_MPI_PERSISTENT", "1").strip() == "0":
        return None
    try:
        probe = np.zeros(1, np.int32)
        MPI.COMM_SELF.Allreduce_init([probe, MPI.INT32_T], [probe.copy(), MPI.INT32_T],
                                     MPI.SUM).Free()
    except (NotImplementedError, MPI.Exception):
        return _openmpi4(MPI)

    def mpi4(comm: Any, send: np.ndarray, recv: np.ndarray, t: Any, op: Any) -> Any:
        return comm.Allreduce_init([send, t], [recv, t], op)

    return mpi4


def _openmpi4(MPI: Any) -> Init | None:
    """Open MPI 4's ``MPIX_Allreduce_init`` (its MPI-4 preview), called through ctypes."""
    if not MPI.Get_library_version().startswith("Open MPI") or not hasattr(MPI.Prequest,
                                                                           "fromhandle"):
        return None
    try:
        fn = ctypes.CDLL(None).MPIX_Allreduce_init  # libmpi is loaded by mpi4py's MPI module
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 5
    info = MPI.INFO_NULL.handle

    def ompi(comm: Any, send: np.ndarray, recv: np.ndarray, t: Any, op: Any) -> Any:
        h = ctypes.c_void_p()
        rc = fn(send.ctypes.data, recv.ctypes.data, recv.size, t.handle, op.handle,
                comm.handle, info, ctypes.byref(h))
        if rc != 0 or not h.value:
            raise MPI.Exception(rc or MPI.ERR_OTHER)
        return MPI.Prequest.fromhandle(h.value)

    return ompi


def copy_in(dst: np.ndarray, src: Any) -> None:
    if type(src) is np.ndarray:
        dst[...] = src
    else:  # a cupy array handed to CUDA-aware MPI: small, so through the host like the rest
        src.get(out=dst)


def copy_out(dst: Any, src: np.ndarray) -> None:
    if type(dst) is np.ndarray:
        dst[...] = src
    else:
        dst.set(src)


class Slot:
    """One persistent allreduce: the request, its two buffers, and the last call queued on it
    (None when idle; else running, or waiting for the call before it)."""

    __slots__ = ("req", "sbuf", "rbuf", "tail", "broken")

    def __init__(self, req: Any, sbuf: np.ndarray, rbuf: np.ndarray) -> None:
        self.req, self.sbuf, self.rbuf = req, sbuf, rbuf
        self.tail: SmallRequest | None = None
        self.broken: str | None = None  # a call on it was given up on: it may never complete


class Slots:
    """A group's persistent allreduces by (dtype, count, op), made and retired in call order."""

    def __init__(self, be: "MPIBackend", init: Init) -> None:
        self.be, self.init = be, init
        #: dtype -> op -> count -> Slot (plain ints and dicts: the hit path hashes no tuple)
        self.by: dict[Any, dict[Any, dict[int, Slot]]] = {}
        self.order: list[tuple[dict[int, Slot], int]] = []  # creation order, for retiring
        self.retired: list[Slot] = []  # retired while a call still ran on them

    def make(self, table: dict[int, Slot], n: int, dtype: np.dtype, t: Any, mop: Any) -> Slot:
        """A new slot for ``n`` elements (the miss path; the same call on every rank)."""
        if len(self.order) >= MAX_SLOTS:
            old_table, old_n = self.order.pop(0)
            self.retire(old_table.pop(old_n))
        sbuf, rbuf = np.zeros(n, dtype), np.zeros(n, dtype)
        be = self.be
        nb = be._nbc
        if nb is None:
            req = self.init(be.comm, sbuf, rbuf, t, mop)
        else:
            with nb.lock:  # libnbc reads the algorithm variable while it builds the schedule
                if nb.current:
                    nb.set(0)
                req = self.init(be.comm, sbuf, rbuf, t, mop)
        slot = table[n] = Slot(req, sbuf, rbuf)
        self.order.append((table, n))
        return slot

    def retire(self, slot: Slot) -> None:
        """Free ``slot``'s request once idle; one still running waits in ``retired``."""
        self.retired.append(slot)
        self.free_idle()

    def free_idle(self) -> None:
        keep = []
        for s in self.retired:
            tail = s.tail
            if tail is None or tail.done:
                _free(s)
            else:
                keep.append(s)
        self.retired = keep

    def close(self) -> list[Slot]:
        """Free every idle request (before the communicator); the busy ones, kept alive."""
        for table, n in self.order:
            self.retired.append(table.pop(n))
        self.order.clear()
        self.free_idle()
        busy, self.retired = self.retired, []
        return busy


def _free(slot: Slot) -> None:
    try:
        slot.req.Free()
    except _rq._MPI.Exception:
        pass  # a request that failed: MPI has let go of it already


class SmallRequest(_rq.MPIRequest):
    """An allreduce on a slot: started at once when the slot is idle, else queued behind the
    slot's last call and started when that completes. Completion copies the result out before
    it says done, so a thread that sees ``done`` reads a finished array."""

    __slots__ = ("slot", "send", "recv", "started", "prev", "next")

    def __init__(self, be: "MPIBackend", slot: Slot, send: Any, recv: Any, index: int,
                 started: bool = False) -> None:
        super().__init__(be, [slot.req], "allreduce", index)
        self.slot, self.send, self.recv = slot, send, recv
        self.started = started
        self.prev: SmallRequest | None = None
        self.next: SmallRequest | None = None

    @classmethod
    def post(cls, be: "MPIBackend", slot: Slot, send: Any, recv: Any, index: int
             ) -> "SmallRequest":
        with _rq._LOCK:
            if slot.broken:
                raise HpcdpError(f"allreduce #{index}: {slot.broken}")
            r = cls(be, slot, send, recv, index)
            prev = slot.tail
            slot.tail = r
            if prev is None or prev.done:
                r._launch()
            else:
                r.prev, prev.next = prev, r
        return r

    def _launch(self) -> None:
        slot = self.slot
        copy_in(slot.sbuf, self.send)
        self.send = None
        slot.req.Start()
        self.started = True

    def _poll(self) -> None:
        """Under ``_LOCK``: test; on completion copy out, then start the next call queued."""
        if not self.started:
            prev = self.prev
            if prev is not None and not prev.done:
                prev._poll()  # it starts this one when it completes
            if not self.started:
                return
        try:
            ok = self.reqs[0].Test()
        except _rq._MPI.Exception as exc:
            if self.error is None:
                self.error = self.be.mpi_error(exc, self.what, self.index)
            ok = True
        if not ok:
            return
        slot = self.slot
        if self.error is None and self.recv is not None:
            copy_out(self.recv, slot.rbuf)
        self.recv = None
        nxt, self.next = self.next, None
        if slot.tail is self:
            slot.tail = None
        if nxt is not None:
            nxt.prev = None
            if self.error is not None or slot.broken:
                slot.broken = slot.broken or f"an earlier allreduce on this group failed ({self.error})"
                nxt.error = self.error or HpcdpError(f"allreduce #{nxt.index}: {slot.broken}")
                nxt._fail_queue()
            else:
                try:
                    nxt._launch()
                except _rq._MPI.Exception as exc:
                    nxt.error = self.be.mpi_error(exc, nxt.what, nxt.index)
                    nxt._fail_queue()
        self.keep = ()
        _rq._PENDING.pop(id(self), None)
        self.done = True

    def _fail_queue(self) -> None:
        """This call failed before it started: it and every call queued after it are done."""
        r: SmallRequest | None = self
        while r is not None:
            r.error = r.error or self.error
            r.recv = r.send = None
            r.keep = ()
            _rq._PENDING.pop(id(r), None)
            if r.slot.tail is r:
                r.slot.tail = None
            r.done = True
            nxt, r.next = r.next, None
            r = nxt

    def abandon(self) -> bool | None:
        done = super().abandon()
        if done is None:
            with _rq._LOCK:
                if not self.done:
                    self.recv = self.send = None  # given up on: never copy in or out late
                    self.slot.broken = (f"allreduce #{self.index} on this group was given up "
                                        "on and may never complete")
        return done

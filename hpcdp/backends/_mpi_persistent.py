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
    if isinstance(src, np.ndarray):  # subclasses too (memmap, masked arrays)
        dst[...] = src
    else:  # a cupy array handed to CUDA-aware MPI: small, so through the host like the rest
        src.get(out=dst)


def copy_out(dst: Any, src: np.ndarray) -> None:
    if isinstance(dst, np.ndarray):
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
        self.be, self.init = be, init  # (the slots live in MPIBackend._fast: dtype, op, count)
        self.order: list[tuple[dict[int, Slot], int]] = []  # creation order, for retiring
        self.retired: list[Slot] = []  # retired while a call still ran on them
        self.waiting: set[Slot] = set()  # slots with a call queued behind a running one

    def advance(self) -> None:
        """Under ``_LOCK``: test each running call that has one queued behind it, so queued
        calls start even while this rank waits for something else."""
        for slot in list(self.waiting):
            tail = slot.tail
            if tail is None or tail.started:
                self.waiting.discard(slot)
            else:
                tail._poll()

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
    it says done, so a thread that sees ``done`` reads a finished array.

    A queued call starts only when this rank sees the call before it complete, which libnbc
    would have done on its own for an ``Iallreduce``: every wait of this process (``serve_all``
    in ``poll_until``) therefore also advances the queues (``Slots.advance``), so a rank blocked
    in another call still starts the calls its peers wait for."""

    __slots__ = ("slot", "send", "recv", "started", "prev", "next")

    def __init__(self, be: "MPIBackend", slot: Slot, send: Any, recv: Any, index: int,
                 started: bool = False) -> None:
        # (set before registering: registering may reap, which polls this request)
        self.slot, self.send, self.recv = slot, send, recv
        self.started = started
        self.prev: SmallRequest | None = None
        self.next: SmallRequest | None = None
        super().__init__(be, [slot.req], "allreduce", index)

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
                try:
                    r._launch()
                except Exception as exc:
                    r._fail(exc)
                    raise r.error from None
                except BaseException as exc:  # KeyboardInterrupt: the call never started
                    r._fail(exc)
                    raise
            else:
                r.prev, prev.next = prev, r
                be._small.waiting.add(slot)
        return r

    def _launch(self) -> None:
        slot = self.slot
        copy_in(slot.sbuf, self.send)
        self.send = None
        slot.req.Start()
        self.started = True

    def _fail(self, exc: BaseException) -> None:
        """Starting failed: this call and those queued behind it end with an error."""
        if isinstance(exc, _rq._MPI.Exception):
            self.error = self.be.mpi_error(exc, self.what, self.index)
        else:
            self.error = HpcdpError(f"allreduce #{self.index}: could not start "
                                    f"({type(exc).__name__}: {exc})")
        self.slot.broken = f"allreduce #{self.index} could not start"
        self._fail_queue()

    def _poll(self) -> None:
        """Under ``_LOCK``: test; on completion copy out, then start the next call queued."""
        if not self.started:
            head = self.prev
            while head is not None and head.prev is not None:
                head = head.prev
            if head is not None and not head.done:
                head._poll()  # the running call: on completion it starts the one after it
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
        elif self.error is not None:
            slot.broken = f"allreduce #{self.index} on this group failed"
        self.recv = None
        nxt, self.next = self.next, None
        if slot.tail is self:
            slot.tail = None
        if nxt is not None:
            nxt.prev = None
            if slot.broken:
                nxt.error = HpcdpError(f"allreduce #{nxt.index}: {slot.broken}")
                nxt._fail_queue()
            else:
                try:
                    nxt._launch()
                except Exception as exc:  # noqa: BLE001 - ends that call, not this one
                    nxt._fail(exc)
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

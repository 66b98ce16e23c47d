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

Ranks that pass different ops. The op is bound to a request when it is made, but it is the one
argument the ranks may get wrong without MPI noticing (dtype and count decide the bytes moved).
Were requests made per (dtype, count, op), ranks passing ``sum`` and ``max`` to their first
call of a shape would each make a request of their own op: made at the same call, they share a
tag and silently match (one rank gets the other's reduction), and the tables are out of step
for good: the next identical ``sum`` starts the existing request on one rank and makes a new
one on the other, and every later call of that shape timed out on every rank. So a shape's
requests are made together, one per op (a *family*: every rank makes the same ones, whatever
op it passed), and the first call of a shape runs as an ``Iallreduce`` (which matches whatever
the op) beside an exchange of the calls' (op, dtype, count) on the group's internal
communicator (``FirstCall``): ranks that differ there raise ``CollectiveMismatchError`` naming
every rank's call, on every rank, and the tables stay in step. Later calls of the shape cost
nothing more; ranks that pass different ops to one of them wait for each other's requests
until the timeout (whose roll call says the calls probably differ), as other mismatched MPI
collectives do outside ``HPCDP_DEBUG``.
"""
from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ..._config import setting
from ...errors import CollectiveMismatchError, HpcdpError
from ...ops import ReduceOp
from . import _requests as _rq

if TYPE_CHECKING:
    from . import MPIBackend

__all__ = ["Slot", "Slots", "SmallRequest", "FirstCall", "initializer", "MAX_SLOTS"]

#: shapes (dtype, count) a group keeps persistent requests for: one request per op (four; two
#: for bool), each holding two buffers of under ``RING_MIN_BYTES`` (at most 2 MiB a group)
MAX_SLOTS = 32
#: ops in the order a family's requests are made (the same on every rank), and their codes
_OP_LIST = tuple(ReduceOp)
#: ops MPI does not define on a dtype kind (no order on complex numbers): no request for them
_UNDEFINED = {"c": (ReduceOp.MAX, ReduceOp.MIN)}

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
    if not setting("HPCDP_MPI_PERSISTENT"):
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
    """A group's persistent allreduces by (dtype, count, op), made and retired in call order,
    one family (every op of a dtype and count) at a time."""

    def __init__(self, be: "MPIBackend", init: Init) -> None:
        self.be, self.init = be, init  # (the slots live in MPIBackend._fast: dtype, op, count)
        #: families in creation order, for retiring: each the (table, count) of its ops
        self.order: list[list[tuple[dict[int, Slot], int]]] = []
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

    def first(self, send: Any, recv: np.ndarray, op: ReduceOp, index: int) -> "FirstCall":
        """The first call of a shape (the miss path, the same call on every rank): make the
        shape's family, and run this call as a checked ``Iallreduce`` (see the module)."""
        be, MPI = self.be, _rq._MPI
        dtype, n = recv.dtype, recv.size
        t, ops = be._fast[dtype]
        # (an op MPI does not define on the dtype makes nothing: its Iallreduce fails)
        family = [] if op in _UNDEFINED.get(dtype.kind, ()) else self.make(ops, n, dtype, t)
        mine = np.array([_OP_LIST.index(op), list(be._types).index(dtype), n], np.int64)
        every = np.zeros((be.size, 3), np.int64)
        s = MPI.IN_PLACE if send is recv else [send, t]
        reqs = [be._iallreduce(s, [recv, t], ops[op][0], recv.nbytes)]
        # (the internal communicator: its collectives never take one of ``comm``'s tags)
        reqs.append(be._p2p.Iallgather([mine, MPI.INT64_T], [every, MPI.INT64_T]))
        return FirstCall(be, reqs, index, (mine, every, family))

    def make(self, ops: dict[Any, tuple[Any, dict[int, Slot]]], n: int, dtype: np.dtype,
             t: Any) -> list[Slot]:
        """The family of ``n`` elements of ``dtype``: a slot per op in ``ops`` (op -> (MPI op,
        its table)), ops that share an MPI op (bool) sharing it; in ``ops``' order."""
        if len(self.order) >= MAX_SLOTS:
            self.retire(self.order.pop(0))
        made: dict[int, Slot] = {}
        entries: list[tuple[dict[int, Slot], int]] = []
        undefined = _UNDEFINED.get(dtype.kind, ())
        be, nb = self.be, self.be._nbc
        if nb is not None:  # libnbc reads the algorithm variable while it builds a schedule
            nb.lock.acquire()
        try:
            if nb is not None and nb.current:
                nb.set(0)
            for op, (mop, table) in ops.items():
                if op in undefined:
                    continue
                slot = made.get(id(mop))
                if slot is None:
                    sbuf, rbuf = np.zeros(n, dtype), np.zeros(n, dtype)
                    req = self.init(be.comm, sbuf, rbuf, t, mop)
                    slot = made[id(mop)] = Slot(req, sbuf, rbuf)
                table[n] = slot
                entries.append((table, n))
        except BaseException:
            self.retire(entries)  # a failed family leaves no half behind
            raise
        finally:
            if nb is not None:
                nb.lock.release()
        self.order.append(entries)
        return list(made.values())

    def retire(self, family: list[tuple[dict[int, Slot], int]]) -> None:
        """Free a family's requests once idle; one still running waits in ``retired``."""
        for table, n in family:
            slot = table.pop(n, None)
            if slot is not None and slot not in self.retired:
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
        for family in self.order:
            self.retire(family)
        self.order.clear()
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


class FirstCall(_rq.MPIRequest):
    """The first allreduce of a shape: an ``Iallreduce`` and the exchange of every rank's
    (op, dtype, count); completes with ``CollectiveMismatchError`` on every rank when they
    differ (the result is then undefined: MPI leaves mixed ops so)."""

    __slots__ = ("check",)

    def __init__(self, be: "MPIBackend", reqs: list[Any], index: int,
                 check: tuple[np.ndarray, np.ndarray, list[Slot]]) -> None:
        self.check = check  # before registering: registering may reap, which polls this
        super().__init__(be, reqs, "allreduce", index)

    def _poll(self) -> None:
        """Under ``_LOCK``: test both; once settled, compare the calls, then say done."""
        try:
            ok = _rq._MPI.Request.Testall(self.reqs)
        except _rq._MPI.Exception as exc:
            if self.error is None:
                self.error = self.be.mpi_error(exc, self.what, self.index)
            ok = all(_rq._settled(r) for r in self.reqs)
        if not ok:
            return
        if self.error is None:
            self.error = self._differ()
        self.keep = ()
        _rq._PENDING.pop(id(self), None)
        self.done = True

    def _differ(self) -> HpcdpError | None:
        mine, every, family = self.check
        if (every == mine).all():
            return None
        be = self.be
        kinds = list(be._types)

        def call(row: np.ndarray) -> str:
            op, dt, n = (int(v) for v in row)
            name = _OP_LIST[op].value if 0 <= op < len(_OP_LIST) else f"op code {op}"
            dtn = kinds[dt].name if 0 <= dt < len(kinds) else f"dtype code {dt}"
            return f"op={name}, {n} x {dtn}"

        calls = "; ".join(f"rank {be.ranks[r]} {call(row)}" for r, row in enumerate(every))
        if not (every[:, 1:] == mine[1:]).all():
            # another shape on some rank: its tables may now differ from this rank's, so the
            # family made for this call is not used again (later calls fail naming this one)
            for slot in family:
                slot.broken = (f"allreduce #{self.index} on this group was called with "
                               f"different sizes or dtypes ({calls})")
        return CollectiveMismatchError(
            f"allreduce #{self.index} on rank {be.ranks[be.rank]}: the ranks passed different "
            f"arguments ({calls}); the result is undefined, and every rank raises this")

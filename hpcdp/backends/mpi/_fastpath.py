"""The MPI backend's small-message path, behind one switch (``HPCDP_MPI_FASTPATH``).

Two tricks, for the latency of small allreduces, which a training loop's scalars (losses,
counters, norms) and DDP's small buckets are:

1. Persistent requests. A small allreduce (under ``RING_MIN_BYTES``) starts a persistent MPI
   request made once per dtype and count (``MPI_Allreduce_init``; ``MPIX_Allreduce_init`` in
   Open MPI 4, called through ctypes) instead of posting an ``Iallreduce``, whose schedule
   libnbc builds afresh on every call. It is still nonblocking, so every wait keeps its
   deadline and a late rank still gets an exception, not an abort. A persistent request is bound
   to its buffers, so a call copies in and out.
2. The quick lane (``FastPath.allreduce``, the backend's ``quick_allreduce``): a blocking call
   starts its request and ``Test``s it in a short spin, without the request object and registry
   that only asynchronous callers need; only a call still running after the spin becomes a
   registered request (``SmallRequest``/``MPIRequest``) and waits like any other.

With the switch off (alike on every rank) neither exists: small allreduces are ``Iallreduce``s
and blocking ones wait on their request like the rest.

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
import functools
import time
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ..._config import setting
from ...errors import CollectiveMismatchError, HpcdpError
from ...ops import ReduceOp
from ..base import SPIN_SECONDS, Request, spin
from . import _requests as _rq
from . import _tuning
from ._notices import Notices

if TYPE_CHECKING:
    from ._backend import MPIBackend

__all__ = ["FastPath", "fast_path", "Slot", "Slots", "SmallRequest", "FirstCall", "MAX_SLOTS"]

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
    probed once per process."""
    if not _probed:
        _probed.append(_probe(MPI))
    return _probed[0]


def _probe(MPI: Any) -> Init | None:
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

    def __init__(self, fp: "FastPath", init: Init) -> None:
        self.fp, self.init = fp, init  # (the slots live in FastPath.table: dtype, op, count)
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
        fp, MPI = self.fp, _rq._MPI
        dtype, n = recv.dtype, recv.size
        t, ops = fp.table[dtype]
        # (an op MPI does not define on the dtype makes nothing: its Iallreduce fails)
        family = [] if op in _UNDEFINED.get(dtype.kind, ()) else self.make(ops, n, dtype, t)
        mine = np.array([_OP_LIST.index(op), list(fp.types).index(dtype), n], np.int64)
        every = np.zeros((fp.notices.size, 3), np.int64)
        s = MPI.IN_PLACE if send is recv else [send, t]
        reqs = [_tuning.post(fp.tuner, fp.comm, s, [recv, t], ops[op][0], recv.nbytes)]
        # (the internal communicator: its collectives never take one of ``comm``'s tags)
        reqs.append(fp.internal.Iallgather([mine, MPI.INT64_T], [every, MPI.INT64_T]))
        return FirstCall(fp, reqs, index, (mine, every, family))

    def make(self, ops: dict[Any, tuple[Any, dict[int, Slot]]], n: int, dtype: np.dtype,
             t: Any) -> list[Slot]:
        """The family of ``n`` elements of ``dtype``: a slot per op in ``ops`` (op -> (MPI op,
        its table)), ops that share an MPI op (bool) sharing it; in ``ops``' order."""
        if len(self.order) >= MAX_SLOTS:
            self.retire(self.order.pop(0))
        made: dict[int, Slot] = {}
        entries: list[tuple[dict[int, Slot], int]] = []
        undefined = _UNDEFINED.get(dtype.kind, ())
        fp, nb = self.fp, self.fp.tuner
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
                    req = self.init(fp.comm, sbuf, rbuf, t, mop)
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

    def __init__(self, fp: "FastPath", slot: Slot, send: Any, recv: Any, index: int,
                 started: bool = False) -> None:
        # (set before registering: registering may reap, which polls this request)
        self.slot, self.send, self.recv = slot, send, recv
        self.started = started
        self.prev: SmallRequest | None = None
        self.next: SmallRequest | None = None
        super().__init__(fp.owner, [slot.req], "allreduce", index)

    @classmethod
    def post(cls, fp: "FastPath", slot: Slot, send: Any, recv: Any, index: int
             ) -> "SmallRequest":
        with _rq._LOCK:
            if slot.broken:
                raise HpcdpError(f"allreduce #{index}: {slot.broken}")
            r = cls(fp, slot, send, recv, index)
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
                fp.slots.waiting.add(slot)  # type: ignore[union-attr]
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
            self.error = self.be.notices.mpi_error(exc, self.what, self.index)
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
                self.error = self.be.notices.mpi_error(exc, self.what, self.index)
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

    __slots__ = ("check", "types")

    def __init__(self, fp: "FastPath", reqs: list[Any], index: int,
                 check: tuple[np.ndarray, np.ndarray, list[Slot]]) -> None:
        self.check = check  # before registering: registering may reap, which polls this
        self.types = list(fp.types)
        super().__init__(fp.owner, reqs, "allreduce", index)

    def _poll(self) -> None:
        """Under ``_LOCK``: test both; once settled, compare the calls, then say done."""
        try:
            ok = _rq._MPI.Request.Testall(self.reqs)
        except _rq._MPI.Exception as exc:
            if self.error is None:
                self.error = self.be.notices.mpi_error(exc, self.what, self.index)
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
        ranks = self.be.ranks
        kinds = self.types

        def call(row: np.ndarray) -> str:
            op, dt, n = (int(v) for v in row)
            name = _OP_LIST[op].value if 0 <= op < len(_OP_LIST) else f"op code {op}"
            dtn = kinds[dt].name if 0 <= dt < len(kinds) else f"dtype code {dt}"
            return f"op={name}, {n} x {dtn}"

        calls = "; ".join(f"rank {ranks[r]} {call(row)}" for r, row in enumerate(every))
        if not (every[:, 1:] == mine[1:]).all():
            # another shape on some rank: its tables may now differ from this rank's, so the
            # family made for this call is not used again (later calls fail naming this one)
            for slot in family:
                slot.broken = (f"allreduce #{self.index} on this group was called with "
                               f"different sizes or dtypes ({calls})")
        return CollectiveMismatchError(
            f"allreduce #{self.index} on rank {ranks[self.be.rank]}: the ranks passed different "
            f"arguments ({calls}); the result is undefined, and every rank raises this")


#: The quick lane Tests (``base.spin``) for up to ``SPIN_SECONDS`` before it hands the call to
#: the slower deadline-checked wait (with 64 Tests and no second spin the early rank of a
#: barrier fell into the slower wait every few calls).
_SPIN_S = SPIN_SECONDS
_RING_MIN_BYTES = _tuning.RING_MIN_BYTES
#: a larger collective's lane spins as long as its bytes take at this rate (a registered wait
#: polls as busily for its first milliseconds, at the cost of the request bookkeeping), capped
_SPIN_BPS, _SPIN_MAX_S = 2e9, 2e-3
_monotonic = time.monotonic


def fast_path(owner: "MPIBackend", comm: Any, internal: Any, types: dict[np.dtype, Any],
              mpi_op: Callable[[ReduceOp, np.dtype], Any], notices: Notices,
              tuner: "_tuning.Tuner | None", limit: list[int]) -> "FastPath | None":
    """The group's small-message path, or None where the switch (``HPCDP_MPI_FASTPATH``, alike
    on every rank) turns it off."""
    if not setting("HPCDP_MPI_FASTPATH"):
        return None
    return FastPath(owner, comm, internal, types, mpi_op, notices, tuner, limit,
                    initializer(_rq._MPI))


class FastPath:
    """One group's small allreduces: the persistent requests (``slots``, None where MPI has
    none) and the quick lane of blocking calls (``allreduce``).

    Args:
        owner: the backend; requests are registered under it and fail through its notices.
        comm, internal: the group's communicator, and its internal one (first-call checks).
        types: numpy dtype -> MPI datatype; ``mpi_op(op, dtype)``: the MPI op.
        limit: a one-element list, the backend's largest element count per message.
    """

    def __init__(self, owner: "MPIBackend", comm: Any, internal: Any,
                 types: dict[np.dtype, Any], mpi_op: Callable[[ReduceOp, np.dtype], Any],
                 notices: Notices, tuner: "_tuning.Tuner | None", limit: list[int],
                 init: Init | None) -> None:
        self.owner, self.comm, self.internal = owner, comm, internal
        self.types, self.notices, self.tuner, self.limit = types, notices, tuner, limit
        self._view = notices.view
        #: dtype -> (MPI datatype, op -> (MPI op, count -> persistent request)); float16 is
        #: absent (the backend reduces it as float32)
        self.table = {dt: (t, {op: (mpi_op(op, dt), {}) for op in _OPS})
                      for dt, t in types.items() if dt != np.float16}
        self.slots = None if init is None else Slots(self, init)

    def post(self, send: Any, recv: np.ndarray, op: ReduceOp, index: int) -> Request | None:
        """Collective ``index`` on a persistent request when it is small (every small
        allreduce, blocking or not: the choice must be the same on all ranks), else None."""
        n = recv.size
        if self.slots is None or not 0 < n <= self.limit[0] or recv.nbytes >= _RING_MIN_BYTES:
            return None
        slot = self.table[recv.dtype][1][op][1].get(n)
        if slot is None:  # the shape's first call: checked
            return self.slots.first(send, recv, op, index)
        return SmallRequest.post(self, slot, send, recv, index)

    def queued(self) -> bool:
        return self.slots is not None and bool(self.slots.waiting)

    def advance(self) -> None:
        if self.slots is not None:
            self.slots.advance()

    def close(self) -> list[Slot]:
        """Free the idle persistent requests; those still running, for the caller to keep."""
        return [] if self.slots is None else self.slots.close()

    def allreduce(self, send: np.ndarray, recv: np.ndarray, op: ReduceOp,
                  timeout: float) -> Request | None:
        """The quick lane (the backend's ``quick_allreduce``): a blocking allreduce of host
        arrays, None once complete, else the request still pending at the deadline. Under
        ``RING_MIN_BYTES`` a persistent request started, else one ``Iallreduce``; then a
        short ``Test`` spin. What it does not handle (float16, messages over the element
        limit) goes to the backend's ``allreduce`` and waits there."""
        fast = self.table.get(recv.dtype)
        n = recv.size
        if fast is None or n > self.limit[0]:
            req = self.owner.allreduce(send, recv, op)
            return None if req.wait(timeout) else req
        mop, table = fast[1][op]
        notices = self.notices
        notices.index = index = notices.index + 1
        if notices.left is not None:  # a peer already left this group: fail before posting
            notices.check(index)
        small, nbytes, view = self.slots, recv.nbytes, self._view
        out = None  # the persistent request's result buffer, once started
        try:
            if small is not None and n and nbytes < _RING_MIN_BYTES:
                slot = table.get(n)
                if slot is None:  # the shape's first call: checked
                    first = small.first(send, recv, op, index)
                    first.keep = (send, recv)
                    return None if first.wait(timeout) else first
                if slot.tail is not None or slot.broken:  # an async call runs on it: queue
                    slow = SmallRequest.post(self, slot, send, recv, index)
                    slow.keep = (send, recv)
                    return None if slow.wait(timeout) else slow
                slot.sbuf[...] = send
                req = slot.req
                req.Start()
                out = slot.rbuf
            else:
                t = fast[0]
                s = _rq._MPI.IN_PLACE if send is recv else [send, t]
                req = _tuning.post(self.tuner, self.comm, s, [recv, t], mop, nbytes)
            # a short spin (``base.spin``), after one test that a peer already there passes;
            # the deadline counts from its end
            if req.Test() or spin(req.Test, view, _SPIN_S if timeout > _SPIN_S else timeout):
                if out is not None:
                    recv[...] = out
                if view[0]:  # a notice landed: answer it, or fail if a peer left
                    notices.check(index)
                return None
            deadline = _monotonic() + timeout
        except _rq._MPI.Exception as exc:
            raise notices.mpi_error(exc, "allreduce", index) from None
        except BaseException:  # KeyboardInterrupt in the spin: the request may still run
            if out is not None and slot.tail is None:
                slot.tail = SmallRequest(self, slot, None, None, index, started=True)
            raise
        if out is None:
            slow = _rq.MPIRequest(self.owner, [req], "allreduce", index)
        else:
            slow = slot.tail = SmallRequest(self, slot, None, recv, index, started=True)
        slow.keep = (send, recv)  # MPI owns them until the request completes
        return None if slow.wait(max(0.0, deadline - _monotonic())) else slow

    def collective(self, what: str, post: Callable[..., list[Any]], args: tuple[Any, ...],
                   nbytes: int, timeout: float) -> Request | None:
        """The quick lane of a blocking collective other than allreduce (the backend's
        ``quick_all_gather``/``quick_broadcast``): ``post(*args)`` posts the same MPI requests
        the backend's nonblocking call posts (so ranks in either lane match), then a ``Test``
        spin as long as moving ``nbytes`` takes at ``_SPIN_BPS`` (at least ``_SPIN_S``, at most
        ``_SPIN_MAX_S``); None once complete, else the registered request still pending at the
        deadline. Numbered like every collective (the roll call names it)."""
        notices = self.notices
        notices.index = index = notices.index + 1
        if notices.left is not None:  # a peer already left this group: fail before posting
            notices.check(index)
        reqs: list[Any] = []
        try:
            reqs = post(*args)
            test = (reqs[0].Test if len(reqs) == 1
                    else functools.partial(_rq._MPI.Request.Testall, reqs))
            deadline = _spun(test, self._view, timeout,
                             min(_SPIN_MAX_S, max(_SPIN_S, nbytes / _SPIN_BPS)))
        except _rq._MPI.Exception as exc:
            raise notices.mpi_error(exc, what, index) from None
        except BaseException:  # KeyboardInterrupt in the spin: MPI may still use the buffers
            if reqs:
                _rq.MPIRequest(self.owner, reqs, what, index).keep = args
            raise
        if deadline is None:
            if self._view[0]:  # a notice landed: answer it, or fail if a peer left
                notices.check(index)
            return None
        slow = _rq.MPIRequest(self.owner, reqs, what, index)
        slow.keep = args  # MPI owns them until the request completes
        return None if slow.wait(max(0.0, deadline - _monotonic())) else slow


def _spun(test: Callable[[], bool], view: Any, timeout: float, spin_s: float) -> float | None:
    """None once ``test`` turned true within ``spin_s`` (``base.spin``), else the call's
    deadline, ``timeout`` from the spin's end."""
    if spin(test, view, min(spin_s, timeout)):
        return None
    return _monotonic() + timeout


#: ops a family has requests for, in the order they are made (the same on every rank)
_OPS = (ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MAX, ReduceOp.MIN)

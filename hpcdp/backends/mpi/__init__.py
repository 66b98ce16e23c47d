"""MPI backend: mpi4py buffer calls only, nonblocking underneath so every wait has a deadline.

Arrays travel zero-copy with their native MPI datatype (never pickled); ``sendbuf is recvbuf``
becomes ``MPI.IN_PLACE``. float16, which Open MPI 4 has no type for, moves as raw 16-bit words
and is reduced in float32. Messages over ``max_message_elements`` are cut into chunks so arrays
past MPI's 2**31-1 count limit work. cupy arrays go to MPI directly when it is CUDA-aware and are
staged through reused pinned host buffers otherwise.

Why nonblocking calls polled against a deadline, and not blocking MPI calls guarded by a watchdog
thread that aborts the job at the deadline (PyTorch's NCCL watchdog): a ``CommTimeoutError`` the
caller can catch, naming the call and the ranks that did not arrive (asked in a roll call on a
side communicator), the group's other ranks told at once that this rank left (``announce``), and
late ranks failing at once instead of a second timeout. What it costs, measured on 2 ranks bound
to cores: small allreduces start persistent requests (``_mpi_persistent``), 1.0 us against
``Allreduce``'s 1.3 us at 8 B (an ``Iallreduce`` + ``Test`` took 1.9 us); from 8 KiB up libnbc's
ring (``_mpi_tuning``) beats ``Allreduce`` by 0.5-0.8x of its time at 1-16 MiB.

The side channel (notices, roll calls) is ``_mpi_notices``; request lifetime, finalize and
interpreter exit are ``_mpi_requests`` (``Lifetime``: shutdown); libnbc's algorithm choice is
``_mpi_tuning``.
"""
from __future__ import annotations

import _thread
import functools
import sys
import time
import warnings
from typing import Any, Callable, Sequence

import numpy as np

from ..._arrays import is_cupy
from ..._config import setting
from ...errors import BackendUnavailableError, HpcdpError
from ...ops import ReduceOp
from . import _requests as _rq
from . import _tuning as _mpi_tuning
from ._persistent import Slots, SmallRequest, initializer
from ._notices import Notices
from ._staging import Staging, cuda_aware, staged
from ..base import Backend, Request

__all__ = ["MPIBackend", "create_world", "cuda_aware", "set_max_message_elements", "get_mpi"]

_MPI: Any = None
_modules = sys.modules


_MAX_COUNT = setting("HPCDP_MAX_MESSAGE_ELEMENTS")  # once per process, as MPI's count limit is


def set_max_message_elements(n: int | None) -> int:
    """Split messages above ``n`` elements (None: MPI's limit); returns the previous value."""
    global _MAX_COUNT
    old, _MAX_COUNT = _MAX_COUNT, (2**31 - 1 if n is None else int(n))
    if _MAX_COUNT < 1:
        _MAX_COUNT = old
        raise ValueError(f"max message elements must be >= 1, got {n}")
    return old


def get_mpi() -> Any:
    """Import mpi4py's MPI with MPI_THREAD_MULTIPLE (RPC and async work need threads)."""
    global _MPI
    if _MPI is None:
        try:
            import mpi4py
        except ImportError as exc:
            raise BackendUnavailableError(f"the MPI backend needs mpi4py: {exc}") from exc
        mpi4py.rc.thread_level = "multiple"
        from mpi4py import MPI

        _MPI = MPI
        _rq.bind(MPI)
    return _MPI


def _datatypes() -> dict[np.dtype, Any]:
    MPI = get_mpi()
    t = {
        "bool": MPI.C_BOOL, "int8": MPI.INT8_T, "int16": MPI.INT16_T, "int32": MPI.INT32_T,
        "int64": MPI.INT64_T, "uint8": MPI.UINT8_T, "uint16": MPI.UINT16_T,
        "uint32": MPI.UINT32_T, "uint64": MPI.UINT64_T, "float16": MPI.UINT16_T,
        "float32": MPI.FLOAT, "float64": MPI.DOUBLE, "complex64": MPI.C_FLOAT_COMPLEX,
        "complex128": MPI.C_DOUBLE_COMPLEX,
    }
    return {np.dtype(k): v for k, v in t.items()}


def _posting(collective: bool = True) -> Callable[[Callable[..., Request]], Callable[..., Request]]:
    """Number collectives, turn MPI errors into hpcdp's, keep the buffers with the request, and
    run on host copies of cupy arguments when MPI cannot read device memory (which arguments a
    call writes: ``_staging.RECV_ROLES``)."""

    def deco(method: Callable[..., Request]) -> Callable[..., Request]:
        names = method.__code__.co_varnames[1 : method.__code__.co_argcount]
        what = method.__name__

        @functools.wraps(method)
        def wrapper(self: "MPIBackend", *args: Any) -> Request:
            index = 0
            if collective:
                self._index = index = self._index + 1
            try:
                if "cupy" not in _modules or not any(is_cupy(a) for a in args):
                    req = method(self, *args)
                    req.keep = (args, req.keep)  # (float16 staging keeps its own copies)
                    return req
                return staged(self, method, names, args)
            except _MPI.Exception as exc:
                raise self.mpi_error(exc, what, index) from None

        return wrapper

    return deco


#: all_gather results of this many bytes go point to point (see ``MPIBackend.all_gather``);
#: the tag is far from the chunk indices that the split paths use on the same communicator
_P2P_GATHER_MIN, _P2P_GATHER_MAX = 64 << 10, 8 << 20
_GATHER_TAG = 32766  # MPI guarantees tags up to 32767
_RING_MIN = _mpi_tuning.RING_MIN_BYTES
#: The latency path Tests ``_SPIN`` times between clock reads, for up to ``_SPIN_S`` seconds,
#: before it sets up the slower deadline-checked wait: a peer that leaves the barrier a few
#: microseconds later (the usual skew) costs no more than that skew (with 64 Tests and no
#: second spin the early rank fell into the slower wait every few calls). Bounded by the clock,
#: not by a count: an oversubscribed Open MPI yields the CPU in every idle Test, and 1024 Tests
#: took up to 5 s on 4 ranks of a loaded 2-core machine, so a 2 s allreduce outlived its
#: deadline (and then succeeded, where the caller had to see a timeout).
_SPIN, _SPIN_S = 16, 1e-4
_monotonic = time.monotonic
#: Threads started through ``_thread`` (every ``threading.Thread``), the main thread excluded.
_other_threads = _thread._count


def _chunks(n: int) -> list[tuple[int, int]]:
    step = _MAX_COUNT
    return [(a, min(a + step, n)) for a in range(0, n, step)] or [(0, 0)]


class MPIBackend(Notices, _rq.Lifetime, Backend):
    """A group of ranks on one MPI communicator (a private duplicate, never the user's)."""

    name = "mpi"
    accepts_cupy = True
    #: MPI cannot cancel a collective: one that timed out leaves the group out of step
    timeout_poisons_group = True
    #: nonblocking MPI operations advance only inside MPI calls
    needs_progress_thread = True

    def __init__(self, comm: Any, ranks: Sequence[int]) -> None:
        MPI = get_mpi()
        self.comm = comm
        self._p2p = comm.Dup()  # internal traffic of split big messages never meets user tags
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.ranks = tuple(ranks)
        self.max_tag = int(comm.Get_attr(MPI.TAG_UB) or 32767)
        self.thread_level = {MPI.THREAD_MULTIPLE: "multiple", MPI.THREAD_SERIALIZED: "serialized"
                             }.get(MPI.Query_thread(), "single")
        self._types = _datatypes()
        self._staging = Staging()
        #: whether MPI reads device memory: None until the first cupy call asks (``_mpi_staging``)
        self.cuda_aware: bool | None = None
        self._ops = {
            ReduceOp.SUM: MPI.SUM, ReduceOp.PROD: MPI.PROD, ReduceOp.MAX: MPI.MAX,
            ReduceOp.MIN: MPI.MIN,
        }
        self._bool_ops = {
            ReduceOp.SUM: MPI.LOR, ReduceOp.MAX: MPI.LOR, ReduceOp.PROD: MPI.LAND,
            ReduceOp.MIN: MPI.LAND,
        }
        #: dtype -> (MPI datatype, op -> (MPI op, count -> persistent request)) for small
        #: allreduces (``_mpi_persistent``); float16 is absent (reduced as float32)
        self._fast = {dt: (t, {op: (self._op(op, dt), {}) for op in self._ops})
                      for dt, t in self._types.items() if dt != np.float16}
        self._nbc = _mpi_tuning.tuner()
        init = initializer(MPI)
        self._small = None if init is None else Slots(self, init)
        self._index = 0  # collectives posted on this group: the same count on every rank
        self._open_notices(MPI)  # "left" notices and roll calls on a third communicator
        _rq.register_backend(self)

    # -- helpers ----------------------------------------------------------------------------
    def _op(self, op: ReduceOp, dtype: np.dtype) -> Any:
        return (self._bool_ops if dtype.kind == "b" else self._ops)[op]

    def _coll(self, reqs: list[Any], what: str) -> _rq.MPIRequest:
        return _rq.MPIRequest(self, reqs, what, self._index)

    def _half_staged(self, fn: Callable[..., Request], send: np.ndarray, recv: np.ndarray | None,
                     *rest: Any) -> Request:
        """Reduce float16 in float32 (MPI has no half type here), round once at the end."""
        s32 = send.astype(np.float32)
        r32 = s32 if send is recv else (None if recv is None else np.empty(recv.shape, np.float32))
        req = fn(s32, r32, *rest)
        req.keep = (s32, r32)  # MPI owns these until the request completes
        if recv is None:
            return req
        return _rq.Chain(req, lambda: np.copyto(recv, r32, casting="unsafe"))

    def _buf(self, a: np.ndarray, lo: int = 0, hi: int | None = None) -> list[Any]:
        if hi is None and lo == 0:
            return [a, self._types[a.dtype]]
        return [a.reshape(-1)[lo:hi], self._types[a.dtype]]

    def _iallreduce(self, s: Any, r: list[Any], mop: Any, nbytes: int) -> Any:
        nb = self._nbc
        ring = nbytes >= _RING_MIN
        if nb is None or not (ring or nb.current or _other_threads()):
            # Untuned, or a small call from the only thread, with the variable at its default:
            # no thread can be between a set and its post (the lock costs 0.3-0.4 us here).
            return self.comm.Iallreduce(s, r, mop)
        nb.lock.acquire()  # the algorithm libnbc reads while posting (see _mpi_tuning)
        try:
            if ring:
                nb.set(1)  # for this post only: back to the default right after it
            elif nb.current:
                nb.set(0)
            return self.comm.Iallreduce(s, r, mop)
        finally:
            if ring:
                nb.set(0)
            nb.lock.release()

    # -- collectives ------------------------------------------------------------------------
    @_posting()
    def allreduce(self, sendbuf, recvbuf, op):
        return self._allreduce(sendbuf, recvbuf, op)

    def _allreduce(self, sendbuf, recvbuf, op):
        if sendbuf.dtype == np.float16:
            return self._half_staged(self._allreduce, sendbuf, recvbuf, op)
        n = recvbuf.size
        if self._small is not None and 0 < n <= _MAX_COUNT and recvbuf.nbytes < _RING_MIN:
            # every small allreduce, blocking or not: the choice must be the same on all ranks
            slot = self._fast[recvbuf.dtype][1][op][1].get(n)
            if slot is None:  # the shape's first call: checked (``_mpi_persistent``)
                return self._small.first(sendbuf, recvbuf, op, self._index)
            return SmallRequest.post(self, slot, sendbuf, recvbuf, self._index)
        mop = self._op(op, sendbuf.dtype)
        inplace = sendbuf is recvbuf
        reqs = []
        for lo, hi in _chunks(recvbuf.size):
            s = _MPI.IN_PLACE if inplace else self._buf(sendbuf, lo, hi)
            reqs.append(self._iallreduce(s, self._buf(recvbuf, lo, hi), mop,
                                         (hi - lo) * recvbuf.itemsize))
        return self._coll(reqs, "allreduce")

    def allreduce_blocking(self, sendbuf, recvbuf, op, timeout):
        # Latency-bound: under RING_MIN a persistent request started (``_mpi_persistent``),
        # else one Iallreduce, then a short Test spin; without the wrappers (cupy staging,
        # chunking, float16) that the callers of this path exclude.
        fast = self._fast.get(recvbuf.dtype)
        n = recvbuf.size
        if fast is None or n > _MAX_COUNT:
            return super().allreduce_blocking(sendbuf, recvbuf, op, timeout)
        mop, table = fast[1][op]
        self._index = index = self._index + 1
        if self._left is not None:  # a peer already left this group: fail before posting
            self.check_notices(index)
        small, nbytes = self._small, recvbuf.nbytes
        out = None  # the persistent request's result buffer, once started
        try:
            if small is not None and n and nbytes < _RING_MIN:
                slot = table.get(n)
                if slot is None:  # the shape's first call: checked (``_mpi_persistent``)
                    first = small.first(sendbuf, recvbuf, op, index)
                    first.keep = (sendbuf, recvbuf)
                    return None if first.wait(timeout) else first
                if slot.tail is not None or slot.broken:  # an async call runs on it: queue
                    slow = SmallRequest.post(self, slot, sendbuf, recvbuf, index)
                    slow.keep = (sendbuf, recvbuf)
                    return None if slow.wait(timeout) else slow
                slot.sbuf[...] = sendbuf
                req = slot.req
                req.Start()
                out = slot.rbuf
            else:
                t = fast[0]
                s = _MPI.IN_PLACE if sendbuf is recvbuf else [sendbuf, t]
                req = self._iallreduce(s, [recvbuf, t], mop, nbytes)
            # Spins of _SPIN Tests until done, a notice lands, or _SPIN_S passed. The deadline
            # counts from the first spin's end: its Tests took microseconds (tens of
            # milliseconds at worst, when every Test yields the CPU).
            stop = None
            while True:
                n = _SPIN  # (a while loop on req.Test() was 0.3-0.6 us faster than for/range)
                while not req.Test():
                    n -= 1
                    if not n:
                        break
                else:
                    if out is not None:
                        recvbuf[...] = out
                    if self._nview[0]:  # a notice landed: answer it, or fail if a peer left
                        self.check_notices(index)
                    return None
                now = _monotonic()
                if stop is None:
                    deadline, stop = now + timeout, now + min(_SPIN_S, timeout)
                elif now >= stop:
                    break
                if self._nview[0]:  # a notice goes to the slow path, which handles it
                    break
        except _MPI.Exception as exc:
            raise self.mpi_error(exc, "allreduce", index) from None
        except BaseException:  # KeyboardInterrupt in the spin: the request may still run
            if out is not None and slot.tail is None:
                slot.tail = SmallRequest(self, slot, None, None, index, started=True)
            raise
        if out is None:
            slow = _rq.MPIRequest(self, [req], "allreduce", index)
        else:
            slow = slot.tail = SmallRequest(self, slot, None, recvbuf, index, started=True)
        slow.keep = (sendbuf, recvbuf)  # MPI owns them until the request completes
        return None if slow.wait(max(0.0, deadline - _monotonic())) else slow

    @_posting()
    def broadcast(self, buf, root):
        reqs = [self.comm.Ibcast(self._buf(buf, lo, hi), root) for lo, hi in _chunks(buf.size)]
        return self._coll(reqs, "broadcast")

    @_posting()
    def reduce(self, sendbuf, recvbuf, op, root):
        return self._reduce(sendbuf, recvbuf, op, root)

    def _reduce(self, sendbuf, recvbuf, op, root):
        if sendbuf.dtype == np.float16:
            return self._half_staged(self._reduce, sendbuf, recvbuf, op, root)
        mop = self._op(op, sendbuf.dtype)
        me = self.rank == root
        reqs = []
        for lo, hi in _chunks(sendbuf.size):
            s = _MPI.IN_PLACE if me and sendbuf is recvbuf else self._buf(sendbuf, lo, hi)
            r = self._buf(recvbuf, lo, hi) if me else None
            reqs.append(self.comm.Ireduce(s, r, mop, root))
        return self._coll(reqs, "reduce")

    @_posting()
    def all_gather(self, sendbuf, recvbuf):
        # (chosen by size alone, so every rank takes the same path whatever its array module)
        if _P2P_GATHER_MIN <= recvbuf.nbytes < _P2P_GATHER_MAX and sendbuf.size <= _MAX_COUNT:
            # Open MPI 4's libnbc Iallgather copies this rank's block before it sends anything
            # and then moves the rest round by round: 1.5-2x the blocking Allgather's time at
            # 0.5-2 MiB on 2 ranks here. Posting every transfer at once and copying our own
            # block while they run matches Allgather; from 8 MiB on libnbc is as fast.
            t, me = self._types[sendbuf.dtype], self.rank
            reqs = [self._p2p.Irecv([recvbuf[j], t], j, _GATHER_TAG)
                    for j in range(self.size) if j != me]
            reqs += [self._p2p.Isend([sendbuf, t], j, _GATHER_TAG)
                     for j in range(self.size) if j != me]
            recvbuf[me] = sendbuf
            return self._coll(reqs or [_MPI.REQUEST_NULL], "all_gather")
        if sendbuf.size <= _MAX_COUNT:
            return self._coll([self.comm.Iallgather(self._buf(sendbuf), self._buf(recvbuf))],
                              "all_gather")
        # Too big for one count: every rank broadcasts its block, in chunks.
        recvbuf[self.rank] = sendbuf
        reqs = [self.comm.Ibcast(self._buf(recvbuf[r], lo, hi), r)
                for r in range(self.size) for lo, hi in _chunks(sendbuf.size)]
        return self._coll(reqs, "all_gather")

    @_posting()
    def gather(self, sendbuf, recvbuf, root):
        me = self.rank == root
        if sendbuf.size <= _MAX_COUNT:
            r = self._buf(recvbuf) if me else None
            return self._coll([self.comm.Igather(self._buf(sendbuf), r, root)], "gather")
        reqs = []
        if me:
            recvbuf[root] = sendbuf
            for src in range(self.size):
                if src != root:
                    reqs += [self._p2p.Irecv(self._buf(recvbuf[src], lo, hi), src, i)
                             for i, (lo, hi) in enumerate(_chunks(sendbuf.size))]
        else:
            reqs = [self._p2p.Isend(self._buf(sendbuf, lo, hi), root, i)
                    for i, (lo, hi) in enumerate(_chunks(sendbuf.size))]
        return self._coll(reqs or [_MPI.REQUEST_NULL], "gather")

    @_posting()
    def scatter(self, sendbuf, recvbuf, root):
        me = self.rank == root
        if recvbuf.size <= _MAX_COUNT:
            s = self._buf(sendbuf) if me else None
            return self._coll([self.comm.Iscatter(s, self._buf(recvbuf), root)], "scatter")
        reqs = []
        if me:
            recvbuf[...] = sendbuf[root]
            for dst in range(self.size):
                if dst != root:
                    reqs += [self._p2p.Isend(self._buf(sendbuf[dst], lo, hi), dst, i)
                             for i, (lo, hi) in enumerate(_chunks(recvbuf.size))]
        else:
            reqs = [self._p2p.Irecv(self._buf(recvbuf, lo, hi), root, i)
                    for i, (lo, hi) in enumerate(_chunks(recvbuf.size))]
        return self._coll(reqs or [_MPI.REQUEST_NULL], "scatter")

    @_posting()
    def reduce_scatter(self, sendbuf, recvbuf, op):
        return self._reduce_scatter(sendbuf, recvbuf, op)

    def _reduce_scatter(self, sendbuf, recvbuf, op):
        if sendbuf.dtype == np.float16:
            return self._half_staged(self._reduce_scatter, sendbuf, recvbuf, op)
        mop = self._op(op, sendbuf.dtype)
        if recvbuf.size <= _MAX_COUNT:
            req = self.comm.Ireduce_scatter_block(self._buf(sendbuf), self._buf(recvbuf), mop)
            return self._coll([req], "reduce_scatter")
        reqs = []
        for r in range(self.size):
            for lo, hi in _chunks(recvbuf.size):
                rb = self._buf(recvbuf, lo, hi) if r == self.rank else None
                reqs.append(self.comm.Ireduce(self._buf(sendbuf[r], lo, hi), rb, mop, r))
        return self._coll(reqs, "reduce_scatter")

    @_posting()
    def all_to_all(self, sendbuf, recvbuf):
        m = sendbuf.shape[1] if sendbuf.ndim == 2 else 0
        if m <= _MAX_COUNT:
            req = self.comm.Ialltoall(self._buf(sendbuf), self._buf(recvbuf))
            return self._coll([req], "all_to_all")
        recvbuf[self.rank] = sendbuf[self.rank]
        reqs = []
        for peer in range(self.size):
            if peer == self.rank:
                continue
            for i, (lo, hi) in enumerate(_chunks(m)):
                reqs.append(self._p2p.Isend(self._buf(sendbuf[peer], lo, hi), peer, i))
                reqs.append(self._p2p.Irecv(self._buf(recvbuf[peer], lo, hi), peer, i))
        return self._coll(reqs or [_MPI.REQUEST_NULL], "all_to_all")

    @_posting()
    def barrier(self):
        return self._coll([self.comm.Ibarrier()], "barrier")

    # -- point to point ---------------------------------------------------------------------
    @_posting(collective=False)
    def send(self, buf, dst, tag):
        reqs = [self.comm.Isend(self._buf(buf, lo, hi), dst, tag) for lo, hi in _chunks(buf.size)]
        return _rq.MPIRequest(self, reqs, f"send to rank {self.ranks[dst]} (tag {tag})")

    @_posting(collective=False)
    def recv(self, buf, src, tag):
        reqs = [self.comm.Irecv(self._buf(buf, lo, hi), src, tag) for lo, hi in _chunks(buf.size)]
        req = _rq.MPIRequest(self, reqs, f"recv from rank {self.ranks[src]} (tag {tag})")
        req.cancellable = True
        return req

    def probe(self, src: int, tag: int) -> tuple[int, int, int] | None:
        """(source group rank, tag, bytes) of a message waiting for this rank, else None; -1 for
        ``src``/``tag`` matches any (``hpcdp._p2p`` builds probe/recv_any on this).  A message of
        more than ``_MAX_COUNT`` elements travels as several; the probe reports the first's size."""
        MPI = _MPI
        st = MPI.Status()
        try:
            if not self.comm.Iprobe(MPI.ANY_SOURCE if src < 0 else src,
                                    MPI.ANY_TAG if tag < 0 else tag, st):
                return None
        except MPI.Exception as exc:
            raise self.mpi_error(exc, f"probe(src={src}, tag={tag})", 0) from None
        return st.Get_source(), st.Get_tag(), st.Get_count(MPI.BYTE)

    def native_comm(self) -> Any:
        return self.comm

    # -- groups -----------------------------------------------------------------------------
    def new_group(self, ranks):
        MPI = get_mpi()
        member = self.rank in ranks
        color = 0 if member else MPI.UNDEFINED
        key = list(ranks).index(self.rank) if member else 0
        try:
            sub = self.comm.Split(color, key)
            if sub == MPI.COMM_NULL:
                return None
            return MPIBackend(sub, [self.ranks[r] for r in ranks])
        except MPI.Exception as exc:
            raise self.mpi_error(exc, "new_group", 0) from None


def create_world() -> MPIBackend:
    """The world group on a private duplicate of ``COMM_WORLD``."""
    MPI = get_mpi()
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        warnings.warn("MPI was initialised without MPI_THREAD_MULTIPLE; keep hpcdp calls on one thread",
                      RuntimeWarning, stacklevel=3)
    world = MPI.COMM_WORLD.Dup()
    return MPIBackend(world, range(world.Get_size()))

"""MPI backend: mpi4py buffer calls only, nonblocking underneath so every wait has a deadline.

Arrays travel zero-copy with their native MPI datatype (never pickled); ``sendbuf is recvbuf``
becomes ``MPI.IN_PLACE``. float16, which Open MPI 4 has no type for, moves as raw 16-bit words
and is reduced in float32. Messages over ``max_message_elements`` are cut into chunks so arrays
past MPI's 2**31-1 count limit work. cupy arrays go to MPI directly when it is CUDA-aware and are
staged through reused pinned host buffers otherwise.
"""
from __future__ import annotations

import ctypes
import functools
import os
import sys
import time
from typing import Any, Callable, Sequence

import numpy as np

from .._arrays import is_cupy
from ..errors import BackendUnavailableError
from ..ops import ReduceOp
from .base import Backend, Request, poll_until

__all__ = ["MPIBackend", "create_world", "cuda_aware", "set_max_message_elements", "get_mpi"]

_MPI: Any = None
_modules = sys.modules


def _env_max_count() -> int:
    raw = os.environ.get("HPCDP_MAX_MESSAGE_ELEMENTS", "")
    if not raw:
        return 2**31 - 1
    if not raw.strip().isdigit() or int(raw) < 1:
        raise ValueError(f"HPCDP_MAX_MESSAGE_ELEMENTS={raw!r}: expected a whole number >= 1")
    return int(raw)


_MAX_COUNT = _env_max_count()


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
        if "mpi4py.MPI" not in sys.modules:
            # hpcdp's blocking allreduce is Iallreduce polled against a deadline. Open MPI 4's
            # libnbc picks a tree for it by default, which measured 6-15% slower than the
            # blocking Allreduce at 1-16 MiB on 2 ranks; its ring measured 1.6-1.9x faster
            # (and +0.5 us at 8 B). A user's own setting wins.
            os.environ.setdefault("OMPI_MCA_coll_libnbc_iallreduce_algorithm", "1")
        from mpi4py import MPI

        _MPI = MPI
    return _MPI


def cuda_aware() -> bool:
    """Whether the MPI library takes device pointers (``HPCDP_CUDA_AWARE=0/1`` overrides)."""
    env = os.environ.get("HPCDP_CUDA_AWARE")
    if env is not None:
        return env.strip() not in ("0", "false", "no", "")
    return _query_cuda_support()


@functools.lru_cache(maxsize=1)
def _query_cuda_support() -> bool:
    MPI = get_mpi()
    q = getattr(MPI, "Query_cuda_support", None)
    if q is not None:
        try:
            return bool(q())
        except Exception:  # noqa: BLE001 - not implemented by this MPI
            pass
    try:  # Open MPI's extension, found in the already-loaded libmpi
        fn = ctypes.CDLL(None).MPIX_Query_cuda_support
        fn.restype = ctypes.c_int
        return bool(fn())
    except (AttributeError, OSError):
        return False


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


#: Requests given up on (timed out, or dropped while pending). MPI cannot cancel a collective,
#: so it may still write into their buffers when a late peer arrives: keep them alive here
#: until MPI says they completed, instead of letting their memory be freed under MPI.
_GRAVEYARD: list[Request] = []


def _bury(req: Request) -> None:
    _GRAVEYARD.append(req)
    _reap()


def _reap() -> None:
    if _MPI is None or _MPI.Is_finalized():
        return
    alive = []
    for r in _GRAVEYARD:
        try:
            if not r.test():
                alive.append(r)
        except Exception:  # noqa: BLE001 - a failed request holds nothing MPI will touch
            pass
    _GRAVEYARD[:] = alive


class _MPIRequest(Request):
    """One or more MPI requests plus host-side work to run once they all completed."""

    __slots__ = ("reqs", "post", "done", "what", "keep", "cancellable")

    def __init__(self, reqs: list[Any], post: Callable[[], None] | None = None, what: str = "") -> None:
        self.reqs = reqs
        self.post = post
        self.done = False
        self.what = what
        self.keep: tuple[Any, ...] = ()  # mpi4py does not hold buffers of nonblocking calls
        #: receives may be cancelled when given up on; collectives and sends may not
        self.cancellable = False

    def test(self) -> bool:
        if self.done:
            return True
        reqs = self.reqs
        ok = reqs[0].Test() if len(reqs) == 1 else _MPI.Request.Testall(reqs)
        if ok:
            self.done = True
            if self.post is not None:
                self.post()
            self.keep = ()
        return ok

    def wait(self, timeout: float | None) -> bool:
        if self.done:
            return True
        reqs = self.reqs
        if len(reqs) == 1 and self.post is None:  # small messages finish in this spin
            r = reqs[0]
            for _ in range(32):
                if r.Test():
                    self.done = True
                    self.keep = ()
                    return True
        return poll_until(self.test, None if timeout is None else time.monotonic() + timeout)

    def pending(self) -> str:
        return (f"{self.what or 'the MPI operation'} did not complete: at least one rank of the "
                "group has not made the matching call")

    def cancel(self) -> None:
        """Withdraw a receive given up on, so a late message does not land in its buffer
        (collectives and sends cannot be cancelled: for them this does nothing)."""
        if self.cancellable and not self.done:
            for r in self.reqs:
                r.Cancel()

    def abandon(self) -> None:
        if not self.done:
            self.cancel()
            _bury(self)

    def __del__(self) -> None:
        if not self.done and self.keep and _GRAVEYARD is not None:  # None at interpreter exit
            _GRAVEYARD.append(self)  # an async Work dropped without wait(): keep its buffers


class _Staging:
    """Pinned host copies of cupy buffers for an MPI that is not CUDA-aware.

    Each request takes buffers out of the pool and gives them back when it completes, so
    operations in flight at once (DDP buckets) never share one; sizes repeat, so they are reused.
    """

    def __init__(self) -> None:
        self.pool: dict[tuple[int, str], list[np.ndarray]] = {}

    def take(self, dev: Any) -> np.ndarray:
        free = self.pool.get((dev.size, dev.dtype.str))
        if free:
            return free.pop().reshape(dev.shape)
        import cupyx  # type: ignore[import-not-found]

        return cupyx.empty_pinned(dev.shape, dev.dtype)

    def give(self, host: np.ndarray) -> None:
        self.pool.setdefault((host.size, host.dtype.str), []).append(host)


def _gpu(recv: Sequence[str]) -> Callable[[Callable[..., Request]], Callable[..., Request]]:
    """Run a method on host copies of cupy arguments when MPI cannot read device memory."""

    def deco(method: Callable[..., Request]) -> Callable[..., Request]:
        names = method.__code__.co_varnames[1 : method.__code__.co_argcount]

        @functools.wraps(method)
        def wrapper(self: "MPIBackend", *args: Any) -> Request:
            if "cupy" not in _modules or not any(is_cupy(a) for a in args):
                req = method(self, *args)
                req.keep = args
                return req
            import cupy  # type: ignore[import-not-found]

            cupy.cuda.get_current_stream().synchronize()  # MPI must see finished kernels
            if self.cuda_aware:
                req = method(self, *args)
                req.keep = args
                return req
            host: list[Any] = []
            staged: dict[int, tuple[Any, np.ndarray]] = {}
            written: set[int] = set()  # device arrays some receive-role argument names
            for name, a in zip(names, args):
                if not is_cupy(a):
                    host.append(a)
                    continue
                if id(a) not in staged:
                    h = self._staging.take(a)
                    a.get(out=h)
                    staged[id(a)] = (a, h)
                if name in recv:
                    written.add(id(a))  # also when the same array came first as sendbuf
                host.append(staged[id(a)][1])
            req = method(self, *host)
            req.keep = (args, host)

            def copy_back() -> None:
                for key, (dev, h) in staged.items():
                    if key in written:
                        dev.set(h)
                    self._staging.give(h)

            def release() -> None:  # given up on: the device arrays are the user's again
                for _dev, h in staged.values():
                    self._staging.give(h)

            return _Chain(req, copy_back, on_abandon=release)

        return wrapper

    return deco


class _Chain(Request):
    """``req``, then host-side work (``then``) once it completed; ``on_abandon`` replaces that
    work when the request is given up on (a staged receive must not copy back late)."""

    def __init__(self, req: Request, then: Callable[[], None],
                 on_abandon: Callable[[], None] | None = None) -> None:
        self.req, self.then, self.done = req, then, False
        self.on_abandon = on_abandon
        self.keep: Any = ()

    def test(self) -> bool:
        if not self.done and self.req.test():
            self.then()
            self.done = True
        return self.done

    def wait(self, timeout: float | None) -> bool:
        if not self.done and self.req.wait(timeout):
            self.then()
            self.done = True
        return self.done

    def pending(self) -> str:
        return self.req.pending()

    def abandon(self) -> None:
        if not self.done:
            if self.on_abandon is not None:
                self.then = self.on_abandon
                if isinstance(self.req, _MPIRequest):
                    self.req.cancel()  # a staged receive is withdrawn as an unstaged one is
            _bury(self)  # holds the inner request and the staging buffers its callback uses

    def __del__(self) -> None:
        if not self.done and _GRAVEYARD is not None:
            _GRAVEYARD.append(self)


#: all_gather results of this many bytes go point to point (see ``MPIBackend.all_gather``);
#: the tag is far from the chunk indices that the split paths use on the same communicator
_P2P_GATHER_MIN, _P2P_GATHER_MAX = 64 << 10, 8 << 20
_GATHER_TAG = 32766  # MPI guarantees tags up to 32767


def _chunks(n: int) -> list[tuple[int, int]]:
    step = _MAX_COUNT
    return [(a, min(a + step, n)) for a in range(0, n, step)] or [(0, 0)]


class MPIBackend(Backend):
    """A group of ranks on one MPI communicator (a private duplicate, never the user's)."""

    name = "mpi"
    accepts_cupy = True

    def __init__(self, comm: Any, ranks: Sequence[int]) -> None:
        MPI = get_mpi()
        self.comm = comm
        self._p2p = comm.Dup()  # internal traffic of split big messages never meets user tags
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.ranks = tuple(ranks)
        self.max_tag = int(comm.Get_attr(MPI.TAG_UB) or 32767)
        self._types = _datatypes()
        self._staging = _Staging()
        self.cuda_aware = cuda_aware() if _cupy_loaded() else False
        self._ops = {
            ReduceOp.SUM: MPI.SUM, ReduceOp.PROD: MPI.PROD, ReduceOp.MAX: MPI.MAX,
            ReduceOp.MIN: MPI.MIN,
        }
        self._bool_ops = {
            ReduceOp.SUM: MPI.LOR, ReduceOp.MAX: MPI.LOR, ReduceOp.PROD: MPI.LAND,
            ReduceOp.MIN: MPI.LAND,
        }
        #: (dtype, op) -> (MPI datatype, MPI op) for ``allreduce_blocking``; float16 is absent
        self._fast = {(dt, op): (t, self._op(op, dt)) for dt, t in self._types.items()
                      if dt != np.float16 for op in self._ops}

    # -- helpers ----------------------------------------------------------------------------
    def _op(self, op: ReduceOp, dtype: np.dtype) -> Any:
        return (self._bool_ops if dtype.kind == "b" else self._ops)[op]

    def _half_staged(self, fn: Callable[..., Request], send: np.ndarray, recv: np.ndarray | None,
                     *rest: Any) -> Request:
        """Reduce float16 in float32 (MPI has no half type here), round once at the end."""
        s32 = send.astype(np.float32)
        r32 = s32 if send is recv else (None if recv is None else np.empty(recv.shape, np.float32))
        req = fn(s32, r32, *rest)
        if recv is None:
            return req

        def post() -> None:
            np.copyto(recv, r32, casting="unsafe")
            keep.clear()

        keep = [s32, r32]  # MPI owns these until the request completes
        return _Chain(req, post)

    def _buf(self, a: np.ndarray, lo: int = 0, hi: int | None = None) -> list[Any]:
        if hi is None and lo == 0:
            return [a, self._types[a.dtype]]
        return [a.reshape(-1)[lo:hi], self._types[a.dtype]]

    # -- collectives ------------------------------------------------------------------------
    @_gpu(recv=("recvbuf",))
    def allreduce(self, sendbuf, recvbuf, op):
        if sendbuf.dtype == np.float16:
            return self._half_staged(lambda s, r, o: self.allreduce(s, r, o), sendbuf, recvbuf, op)
        mop = self._op(op, sendbuf.dtype)
        inplace = sendbuf is recvbuf
        if recvbuf.size <= _MAX_COUNT:
            t = self._types[recvbuf.dtype]
            s = _MPI.IN_PLACE if inplace else [sendbuf, t]
            return _MPIRequest([self.comm.Iallreduce(s, [recvbuf, t], mop)], None, "allreduce")
        reqs = []
        for lo, hi in _chunks(recvbuf.size):
            s = _MPI.IN_PLACE if inplace else self._buf(sendbuf, lo, hi)
            reqs.append(self.comm.Iallreduce(s, self._buf(recvbuf, lo, hi), mop))
        return _MPIRequest(reqs, what="allreduce")

    def allreduce_blocking(self, sendbuf, recvbuf, op, timeout):
        # Small allreduces are latency-bound: one Iallreduce and a short Test spin, without
        # the wrappers (cupy staging, chunking, float16) that the callers of this path exclude.
        fast = self._fast.get((recvbuf.dtype, op))
        if fast is None or recvbuf.size > _MAX_COUNT:
            return super().allreduce_blocking(sendbuf, recvbuf, op, timeout)
        t, mop = fast
        req = self.comm.Iallreduce(_MPI.IN_PLACE if sendbuf is recvbuf else [sendbuf, t],
                                   [recvbuf, t], mop)
        test = req.Test
        for _ in range(64):
            if test():
                return None
        slow = _MPIRequest([req], None, "allreduce")
        slow.keep = (sendbuf, recvbuf)  # MPI owns them until the request completes
        return None if slow.wait(timeout) else slow

    @_gpu(recv=("buf",))
    def broadcast(self, buf, root):
        if buf.size <= _MAX_COUNT:
            return _MPIRequest([self.comm.Ibcast([buf, self._types[buf.dtype]], root)], None, "broadcast")
        reqs = [self.comm.Ibcast(self._buf(buf, lo, hi), root) for lo, hi in _chunks(buf.size)]
        return _MPIRequest(reqs, what="broadcast")

    @_gpu(recv=("recvbuf",))
    def reduce(self, sendbuf, recvbuf, op, root):
        if sendbuf.dtype == np.float16:
            return self._half_staged(lambda s, r, o, rt: self.reduce(s, r, o, rt),
                                     sendbuf, recvbuf, op, root)
        mop = self._op(op, sendbuf.dtype)
        me = self.rank == root
        reqs = []
        for lo, hi in _chunks(sendbuf.size):
            if me and sendbuf is recvbuf:
                s: Any = _MPI.IN_PLACE
            else:
                s = self._buf(sendbuf, lo, hi)
            r = self._buf(recvbuf, lo, hi) if me else None
            reqs.append(self.comm.Ireduce(s, r, mop, root))
        return _MPIRequest(reqs, what="reduce")

    @_gpu(recv=("recvbuf",))
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
            return _MPIRequest(reqs or [_MPI.REQUEST_NULL], what="all_gather")
        if sendbuf.size <= _MAX_COUNT:
            req = self.comm.Iallgather(self._buf(sendbuf), self._buf(recvbuf))
            return _MPIRequest([req], what="all_gather")
        # Too big for one count: every rank broadcasts its block, in chunks.
        recvbuf[self.rank] = sendbuf
        reqs = [self.comm.Ibcast(self._buf(recvbuf[r], lo, hi), r)
                for r in range(self.size) for lo, hi in _chunks(sendbuf.size)]
        return _MPIRequest(reqs, what="all_gather")

    @_gpu(recv=("recvbuf",))
    def gather(self, sendbuf, recvbuf, root):
        me = self.rank == root
        if sendbuf.size <= _MAX_COUNT:
            r = self._buf(recvbuf) if me else None
            return _MPIRequest([self.comm.Igather(self._buf(sendbuf), r, root)], what="gather")
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
        return _MPIRequest(reqs or [_MPI.REQUEST_NULL], what="gather")

    @_gpu(recv=("recvbuf",))
    def scatter(self, sendbuf, recvbuf, root):
        me = self.rank == root
        if recvbuf.size <= _MAX_COUNT:
            s = self._buf(sendbuf) if me else None
            return _MPIRequest([self.comm.Iscatter(s, self._buf(recvbuf), root)], what="scatter")
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
        return _MPIRequest(reqs or [_MPI.REQUEST_NULL], what="scatter")

    @_gpu(recv=("recvbuf",))
    def reduce_scatter(self, sendbuf, recvbuf, op):
        if sendbuf.dtype == np.float16:
            return self._half_staged(lambda s, r, o: self.reduce_scatter(s, r, o), sendbuf, recvbuf, op)
        mop = self._op(op, sendbuf.dtype)
        if recvbuf.size <= _MAX_COUNT:
            req = self.comm.Ireduce_scatter_block(self._buf(sendbuf), self._buf(recvbuf), mop)
            return _MPIRequest([req], what="reduce_scatter")
        reqs = []
        for r in range(self.size):
            for lo, hi in _chunks(recvbuf.size):
                rb = self._buf(recvbuf, lo, hi) if r == self.rank else None
                reqs.append(self.comm.Ireduce(self._buf(sendbuf[r], lo, hi), rb, mop, r))
        return _MPIRequest(reqs, what="reduce_scatter")

    @_gpu(recv=("recvbuf",))
    def all_to_all(self, sendbuf, recvbuf):
        m = sendbuf.shape[1] if sendbuf.ndim == 2 else 0
        if m <= _MAX_COUNT:
            req = self.comm.Ialltoall(self._buf(sendbuf), self._buf(recvbuf))
            return _MPIRequest([req], what="all_to_all")
        recvbuf[self.rank] = sendbuf[self.rank]
        reqs = []
        for peer in range(self.size):
            if peer == self.rank:
                continue
            for i, (lo, hi) in enumerate(_chunks(m)):
                reqs.append(self._p2p.Isend(self._buf(sendbuf[peer], lo, hi), peer, i))
                reqs.append(self._p2p.Irecv(self._buf(recvbuf[peer], lo, hi), peer, i))
        return _MPIRequest(reqs or [_MPI.REQUEST_NULL], what="all_to_all")

    def barrier(self):
        return _MPIRequest([self.comm.Ibarrier()], what="barrier")  # no buffers to keep

    # -- point to point ---------------------------------------------------------------------
    @_gpu(recv=())
    def send(self, buf, dst, tag):
        reqs = [self.comm.Isend(self._buf(buf, lo, hi), dst, tag) for lo, hi in _chunks(buf.size)]
        return _MPIRequest(reqs, what=f"send to rank {dst} (tag {tag})")

    @_gpu(recv=("buf",))
    def recv(self, buf, src, tag):
        reqs = [self.comm.Irecv(self._buf(buf, lo, hi), src, tag) for lo, hi in _chunks(buf.size)]
        req = _MPIRequest(reqs, what=f"recv from rank {src} (tag {tag})")
        req.cancellable = True
        return req

    # -- groups -----------------------------------------------------------------------------
    def new_group(self, ranks):
        MPI = get_mpi()
        member = self.rank in ranks
        color = 0 if member else MPI.UNDEFINED
        key = list(ranks).index(self.rank) if member else 0
        sub = self.comm.Split(color, key)
        if sub == MPI.COMM_NULL:
            return None
        return MPIBackend(sub, [self.ranks[r] for r in ranks])

    def shutdown(self) -> None:
        MPI = get_mpi()
        if MPI.Is_finalized():
            return
        _reap()
        for c in (self._p2p, self.comm):
            if c != MPI.COMM_NULL:
                c.Free()
        self.comm = self._p2p = MPI.COMM_NULL


def _cupy_loaded() -> bool:
    import sys

    return "cupy" in sys.modules


def create_world(**_: Any) -> MPIBackend:
    """The world group on a private duplicate of ``COMM_WORLD``."""
    MPI = get_mpi()
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        import warnings

        warnings.warn("MPI was initialised without MPI_THREAD_MULTIPLE; keep hpcdp calls on one thread",
                      RuntimeWarning, stacklevel=3)
    world = MPI.COMM_WORLD.Dup()
    return MPIBackend(world, range(world.Get_size()))

"""``MPIBackend``: one group of ranks on a private MPI communicator, nonblocking underneath.

Arrays travel zero-copy with their native MPI datatype (never pickled); ``sendbuf is recvbuf``
becomes ``MPI.IN_PLACE``. float16, which Open MPI 4 has no type for, moves as raw 16-bit words
and is reduced in float32. Messages over the element limit (``set_max_message_elements``) are cut
into chunks so arrays past MPI's 2**31-1 count limit work. cupy arrays go to MPI directly when it
is CUDA-aware and are staged through reused pinned host buffers otherwise (``_staging``).

Why nonblocking calls polled against a deadline, and not blocking MPI calls guarded by a watchdog
thread that aborts the job at the deadline (PyTorch's NCCL watchdog): a ``CommTimeoutError`` the
caller can catch, naming the call and the ranks that did not arrive (asked in a roll call on the
side channel, ``_notices``), the group's other ranks told at once that this rank left, and late
ranks failing at once instead of a second timeout. What that costs small messages, the
small-message path (``_fastpath``) wins back; libnbc's algorithm for large ones is ``_tuning``'s.

Each group owns three communicators, all duplicates of the one it was made on (never the
user's): ``comm`` for the calls, an internal one for the split paths' own traffic, and the
notices' (``Notices``); a fourth, ``_checks``, carries the sampled call checks and the dims of
n-D point-to-point messages, whose dtype and number of dimensions ride in the tag (``_meta``). Its parts are members: ``notices``, ``fastpath`` (None when switched
off); what MPI may still write after a group is let go of is ``_requests``' business.
"""
from __future__ import annotations

import functools
import sys
import warnings
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..._arrays import is_cupy
from ..._config import setting
from ...errors import BackendUnavailableError, HpcdpError
from ...ops import ReduceOp
from . import _notices
from . import _requests as _rq
from . import _tuning
from ._fastpath import fast_path
from ._meta import Matched, TagMeta, watch, wire
from ._notices import Notices
from ._quick_p2p import Lane
from ._staging import Staging, staged
from ..base import Backend, Probed, Request

__all__ = ["MPIBackend", "create_world", "set_max_message_elements", "get_mpi"]

_MPI: Any = None
_modules = sys.modules

#: the largest element count of one message (a cell: the small-message path reads it too);
#: read once per process, as MPI's count limit is
_MAX_COUNT = [setting("HPCDP_MAX_MESSAGE_ELEMENTS")]


def set_max_message_elements(n: int | None) -> int:
    """Split messages above ``n`` elements (None: MPI's limit); returns the previous value."""
    old = _MAX_COUNT[0]
    new = 2**31 - 1 if n is None else int(n)
    if new < 1:
        raise ValueError(f"max message elements must be >= 1, got {n}")
    _MAX_COUNT[0] = new
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
            notices = self.notices
            if collective:
                notices.index = index = notices.index + 1
            try:
                if "cupy" not in _modules or not any(is_cupy(a) for a in args):
                    req = method(self, *args)
                    req.keep = (args, req.keep)  # (float16 staging keeps its own copies)
                    return req
                return staged(self, method, names, args)
            except _MPI.Exception as exc:
                raise notices.mpi_error(exc, what, index) from None

        return wrapper

    return deco


#: all_gather results of this many bytes go point to point (see ``MPIBackend.all_gather``);
#: the tag is far from the chunk indices that the split paths use on the same communicator
_P2P_GATHER_MIN, _P2P_GATHER_MAX = 64 << 10, 8 << 20
_GATHER_TAG = 32766  # MPI guarantees tags up to 32767


def _chunks(n: int) -> list[tuple[int, int]]:
    step = _MAX_COUNT[0]
    return [(a, min(a + step, n)) for a in range(0, n, step)] or [(0, 0)]


class MPIBackend(Backend):
    """A group of ranks on one MPI communicator (a private duplicate, never the user's)."""

    name = "mpi"
    accepts_cupy = True
    #: MPI cannot cancel a collective: one that timed out leaves the group out of step
    timeout_poisons_group = True
    broken_advice = _notices.BROKEN_ADVICE
    #: nonblocking MPI operations advance only inside MPI calls
    needs_progress_thread = True

    def __init__(self, comm: Any, ranks: Sequence[int], meta: bool = True) -> None:
        """``meta``: carry each p2p message's dtype and shape in its tag (``_meta``); off for
        a ``dup`` (RPC's: bytes only, tags up to ``TAG_UB``)."""
        MPI = get_mpi()
        self.comm = comm
        self._internal = comm.Dup()  # the split paths' own messages never meet user tags
        self._checks = comm.Dup()  # the sampled call checks (comm.debug): never met by a collective
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.ranks = tuple(ranks)
        self._others = [j for j in range(self.size) if j != self.rank]  # in rank order
        #: p2p dtype and shape in the tag (``_meta``); user tags up to ``TAG_UB >> 6`` then
        # (TAG_UB is an attribute of COMM_WORLD: a communicator made by Split may not carry it)
        ub = comm.Get_attr(MPI.TAG_UB) or MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) or 32767
        self.meta = TagMeta(MPI, comm, self._checks, int(ub), meta)
        self.max_tag = self.meta.max_tag
        self.carries_meta = self.meta.on
        self.thread_level = {MPI.THREAD_MULTIPLE: "multiple", MPI.THREAD_SERIALIZED: "serialized"
                             }.get(MPI.Query_thread(), "single")
        self._types = _datatypes()
        self._staging = Staging()
        #: whether MPI reads device memory: None until the first cupy call asks (``_staging``)
        self.cuda_aware: bool | None = None
        self._ops = {
            ReduceOp.SUM: MPI.SUM, ReduceOp.PROD: MPI.PROD, ReduceOp.MAX: MPI.MAX,
            ReduceOp.MIN: MPI.MIN,
        }
        self._bool_ops = {
            ReduceOp.SUM: MPI.LOR, ReduceOp.MAX: MPI.LOR, ReduceOp.PROD: MPI.LAND,
            ReduceOp.MIN: MPI.LAND,
        }
        self._nbc = _tuning.tuner()
        #: "left" notices and roll calls on a third communicator; counts the collectives
        self.notices = Notices(comm, self.rank, self.size, self.ranks, self)
        self.fastpath = fast_path(self, comm, self._internal, self._types, self._op,
                                  self.notices, self._nbc, _MAX_COUNT)
        self.quick_allreduce = None if self.fastpath is None else self.fastpath.allreduce
        fast = self.fastpath
        if fast is not None:  # host arrays only: the lane in comm/_lane.py sends no cupy here
            self.quick_all_gather = lambda s, r, t: fast.collective(
                "all_gather", self._all_gather_reqs, (s, r), r.nbytes, t)
            self.quick_broadcast = lambda b, root, t: fast.collective(
                "broadcast", self._broadcast_reqs, (b, root), b.nbytes, t)
        self.quick_p2p = (None if self.fastpath is None
                          else Lane(self, comm, self._types, self.notices, _MAX_COUNT,
                                    self.meta if self.meta.on else None))
        self._dups: list[MPIBackend] = []  # ``dup()``s of this group: shut down with it
        _rq.register_backend(self)

    # -- helpers ----------------------------------------------------------------------------
    def _op(self, op: ReduceOp, dtype: np.dtype) -> Any:
        return (self._bool_ops if dtype.kind == "b" else self._ops)[op]

    def _coll(self, reqs: list[Any], what: str) -> _rq.MPIRequest:
        return _rq.MPIRequest(self, reqs, what, self.notices.index)

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

    # -- collectives ------------------------------------------------------------------------
    @_posting()
    def allreduce(self, sendbuf, recvbuf, op):
        return self._allreduce(sendbuf, recvbuf, op)

    def _allreduce(self, sendbuf, recvbuf, op):
        if sendbuf.dtype == np.float16:
            return self._half_staged(self._allreduce, sendbuf, recvbuf, op)
        fast = self.fastpath
        if fast is not None:
            req = fast.post(sendbuf, recvbuf, op, self.notices.index)
            if req is not None:
                return req
        mop = self._op(op, sendbuf.dtype)
        inplace = sendbuf is recvbuf
        reqs = []
        for lo, hi in _chunks(recvbuf.size):
            s = _MPI.IN_PLACE if inplace else self._buf(sendbuf, lo, hi)
            reqs.append(_tuning.post(self._nbc, self.comm, s, self._buf(recvbuf, lo, hi), mop,
                                     (hi - lo) * recvbuf.itemsize))
        return self._coll(reqs, "allreduce")

    @_posting()
    def broadcast(self, buf, root):
        return self._coll(self._broadcast_reqs(buf, root), "broadcast")

    def _broadcast_reqs(self, buf: Any, root: int) -> list[Any]:
        """The MPI requests of a broadcast (both lanes post these: ranks in either match)."""
        return [self.comm.Ibcast(self._buf(buf, lo, hi), root) for lo, hi in _chunks(buf.size)]

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
        return self._coll(self._all_gather_reqs(sendbuf, recvbuf), "all_gather")

    def _all_gather_reqs(self, sendbuf: Any, recvbuf: Any) -> list[Any]:
        """The MPI requests of an all_gather (both lanes post these: ranks in either match)."""
        # (chosen by size alone, so every rank takes the same path whatever its array module)
        if _P2P_GATHER_MIN <= recvbuf.nbytes < _P2P_GATHER_MAX and sendbuf.size <= _MAX_COUNT[0]:
            # Open MPI 4's libnbc Iallgather copies this rank's block before it sends anything
            # and then moves the rest round by round: 1.5-2x the blocking Allgather's time at
            # 0.5-2 MiB on 2 ranks here. Posting every transfer at once and copying our own
            # block while they run matches Allgather; from 8 MiB on libnbc is as fast.
            t, c, others = self._types[sendbuf.dtype], self._internal, self._others
            reqs = [c.Irecv([recvbuf[j], t], j, _GATHER_TAG) for j in others]
            reqs += [c.Isend([sendbuf, t], j, _GATHER_TAG) for j in others]
            recvbuf[self.rank] = sendbuf
            return reqs or [_MPI.REQUEST_NULL]
        if sendbuf.size <= _MAX_COUNT[0]:
            return [self.comm.Iallgather(self._buf(sendbuf), self._buf(recvbuf))]
        # Too big for one count: every rank broadcasts its block, in chunks.
        recvbuf[self.rank] = sendbuf
        return [self.comm.Ibcast(self._buf(recvbuf[r], lo, hi), r)
                for r in range(self.size) for lo, hi in _chunks(sendbuf.size)]

    @_posting()
    def gather(self, sendbuf, recvbuf, root):
        me = self.rank == root
        if sendbuf.size <= _MAX_COUNT[0]:
            r = self._buf(recvbuf) if me else None
            return self._coll([self.comm.Igather(self._buf(sendbuf), r, root)], "gather")
        reqs = []
        if me:
            recvbuf[root] = sendbuf
            for src in range(self.size):
                if src != root:
                    reqs += [self._internal.Irecv(self._buf(recvbuf[src], lo, hi), src, i)
                             for i, (lo, hi) in enumerate(_chunks(sendbuf.size))]
        else:
            reqs = [self._internal.Isend(self._buf(sendbuf, lo, hi), root, i)
                    for i, (lo, hi) in enumerate(_chunks(sendbuf.size))]
        return self._coll(reqs or [_MPI.REQUEST_NULL], "gather")

    @_posting()
    def scatter(self, sendbuf, recvbuf, root):
        me = self.rank == root
        if recvbuf.size <= _MAX_COUNT[0]:
            s = self._buf(sendbuf) if me else None
            return self._coll([self.comm.Iscatter(s, self._buf(recvbuf), root)], "scatter")
        reqs = []
        if me:
            recvbuf[...] = sendbuf[root]
            for dst in range(self.size):
                if dst != root:
                    reqs += [self._internal.Isend(self._buf(sendbuf[dst], lo, hi), dst, i)
                             for i, (lo, hi) in enumerate(_chunks(recvbuf.size))]
        else:
            reqs = [self._internal.Irecv(self._buf(recvbuf, lo, hi), root, i)
                    for i, (lo, hi) in enumerate(_chunks(recvbuf.size))]
        return self._coll(reqs or [_MPI.REQUEST_NULL], "scatter")

    @_posting()
    def reduce_scatter(self, sendbuf, recvbuf, op):
        return self._reduce_scatter(sendbuf, recvbuf, op)

    def _reduce_scatter(self, sendbuf, recvbuf, op):
        if sendbuf.dtype == np.float16:
            return self._half_staged(self._reduce_scatter, sendbuf, recvbuf, op)
        mop = self._op(op, sendbuf.dtype)
        if recvbuf.size <= _MAX_COUNT[0]:
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
        if m <= _MAX_COUNT[0]:
            req = self.comm.Ialltoall(self._buf(sendbuf), self._buf(recvbuf))
            return self._coll([req], "all_to_all")
        recvbuf[self.rank] = sendbuf[self.rank]
        reqs = []
        for peer in range(self.size):
            if peer == self.rank:
                continue
            for i, (lo, hi) in enumerate(_chunks(m)):
                reqs.append(self._internal.Isend(self._buf(sendbuf[peer], lo, hi), peer, i))
                reqs.append(self._internal.Irecv(self._buf(recvbuf[peer], lo, hi), peer, i))
        return self._coll(reqs or [_MPI.REQUEST_NULL], "all_to_all")

    @_posting()  # numbered like a collective: a rank that times out in it is named by the roll
    def check_all_gather(self, sendbuf, recvbuf):  # call, and the late ones are told at once
        req = self._checks.Iallgather(self._buf(sendbuf), self._buf(recvbuf))
        return self._coll([req], "the check of the ranks' calls (an all_gather)")

    @_posting()
    def barrier(self):
        return self._coll([self.comm.Ibarrier()], "barrier")

    # -- point to point ---------------------------------------------------------------------
    @_posting(collective=False)
    def send(self, buf, dst, tag):
        meta = self.meta
        w = wire(tag, buf) if meta.on else tag
        reqs = [self.comm.Isend(self._buf(buf, lo, hi), dst, w) for lo, hi in _chunks(buf.size)]
        keep = None
        if meta.on and buf.ndim > 1:  # n-D: its dims follow (``_meta``)
            r, keep = meta.send_dims(buf, dst, w)
            reqs.append(r)
        req = _rq.MPIRequest(self, reqs, f"send to rank {self.ranks[dst]} (tag {tag})")
        if keep is not None:
            req.keep = keep
        return req

    @_posting(collective=False)
    def recv(self, buf, src, tag):
        # (-1: any source / any tag, ``base.ANY_SOURCE``; a split message needs a source)
        meta = self.meta
        who = "any rank" if src < 0 else f"rank {self.ranks[src]}"
        what = f"recv from {who} (tag {'any' if tag < 0 else tag})"
        s, t = (_MPI.ANY_SOURCE if src < 0 else src), (_MPI.ANY_TAG if tag < 0 else tag)
        if meta.on and (src < 0 or tag < 0):  # no wire tag to post: matched when tested
            return Matched(self, meta, buf, self._types[buf.dtype], s, tag, what)
        w = wire(t, buf) if meta.on else t
        reqs = [self.comm.Irecv(self._buf(buf, lo, hi), s, w) for lo, hi in _chunks(buf.size)]
        dims = got = None
        if meta.on and buf.ndim > 1:  # n-D: its dims too (``_meta``)
            got = meta.recv_dims(s, w)
            if got is not None:
                reqs.append(got[0])
                dims = got[1]
        req = _rq.MPIRequest(self, reqs, what)
        req.cancellable = True
        if dims is not None:
            req.keep = (buf, dims)
        if meta.on and len(reqs) - (got is not None) == 1:  # (not one split in pieces)
            req.watch = watch(meta, buf, self._types[buf.dtype], s, t, w,
                              1 if got is not None else None, dims)
        return req

    def probe(self, src: int, tag: int) -> tuple[int, int, int] | None:
        """(source group rank, tag, bytes) of a message waiting for this rank, else None; -1 for
        ``src``/``tag`` matches any (``comm.p2p`` builds probe/recv_any on this). A message of
        more than the element limit travels as several; the probe reports the first's size."""
        found = self.probe_meta(src, tag)
        return None if found is None else found[:3]

    def probe_meta(self, src: int, tag: int) -> Probed | None:
        """``probe`` with the dtype and shape the message was sent with, read from its tag
        (``_meta``; None for both where this group does not carry them)."""
        MPI = _MPI
        try:
            if self.meta.on:
                return self.meta.probe(src, tag)
            st = MPI.Status()
            if not self.comm.Iprobe(MPI.ANY_SOURCE if src < 0 else src,
                                    MPI.ANY_TAG if tag < 0 else tag, st):
                return None
        except MPI.Exception as exc:
            raise self.notices.mpi_error(exc, f"probe(src={src}, tag={tag})", 0) from None
        return Probed(st.Get_source(), st.Get_tag(), st.Get_count(MPI.BYTE))

    def native_comm(self) -> Any:
        return self.comm

    # -- groups -----------------------------------------------------------------------------
    def dup(self) -> "MPIBackend":
        """Collective: this group again on a ``Comm.Dup()`` of its communicator, so no message
        of the duplicate matches a receive of this one (RPC's agent thread uses it beside the
        user's calls; MPI allows that only at ``MPI_THREAD_MULTIPLE``, which ``get_mpi`` asks
        for: ``thread_level`` says what MPI gave). The duplicate shares this group's settings
        and ends when this group shuts down (``shutdown``)."""
        MPI = get_mpi()
        try:
            comm = self.comm.Dup()
        except MPI.Exception as exc:
            raise self.notices.mpi_error(exc, "dup", 0) from None
        self._dups = [d for d in self._dups if d.comm != MPI.COMM_NULL]  # (shut down alone)
        child = MPIBackend(comm, self.ranks, meta=False)  # RPC's: bytes, plain tags
        child.cuda_aware = self.cuda_aware
        self._dups.append(child)
        return child

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
            raise self.notices.mpi_error(exc, "new_group", 0) from None

    def split(self, color: int | None, key: int,
              layout: Mapping[int, Sequence[int]]) -> "MPIBackend | None":
        """One ``Comm.Split(color, key)`` for every color at once; ``layout`` (the caller's
        same ordering, by key then rank) names the world ranks of this rank's new group."""
        MPI = get_mpi()
        try:
            sub = self.comm.Split(MPI.UNDEFINED if color is None else color, key)
        except MPI.Exception as exc:
            raise self.notices.mpi_error(exc, "split", 0) from None
        if sub == MPI.COMM_NULL:
            return None
        members = list(layout[color])
        want = (members.index(self.rank), len(members))
        got = (sub.Get_rank(), sub.Get_size())
        if got != want:  # the API orders ranks as MPI does; a difference is a bug here
            sub.Free()
            raise HpcdpError(f"split (rank {self.rank}): MPI made this rank {got[0]} of "
                             f"{got[1]}, expected {want[0]} of {want[1]}")
        return MPIBackend(sub, [self.ranks[r] for r in members])

    def tell_waiting(self, peers: Sequence[int], note: str) -> None:
        """A "waiting" notice to each of ``peers`` on this group's side channel (``_notices``)."""
        self.notices.tell_waiting(peers, note)

    def waiting_notes(self) -> dict[int, tuple[float, str]]:
        return dict(_notices.WAITING)  # process-wide: a notice may come on any group's channel

    # -- lifetime ---------------------------------------------------------------------------
    def report_death(self, why: str) -> None:
        """Tell the other ranks of every live MPI group of this process that it is dying of
        ``why`` (an uncaught exception; ``comm.world``'s excepthook calls it)."""
        _notices.report_death(why)

    def before_finalize(self) -> None:
        """Withdraw the notice receive and free idle persistent requests; what still runs is
        kept alive (MPI may write into it until it completes, or through MPI_Finalize)."""
        self.notices.close()
        if self.fastpath is not None:
            busy = self.fastpath.close()
            if busy:
                _rq.keep_forever(busy)

    def shutdown(self) -> None:
        """Finish (or hand to the exit handler) what is in flight, then free the communicators.

        A communicator with a collective still in flight is not freed: libnbc would progress it
        on freed state (a segfault). Its requests stay registered, so their buffers stay alive.
        Nor is one whose peer left: the peer's abandoned calls may still send to this rank, and
        Open MPI hands messages for a freed communicator to the next one given its context id
        (a late rank crashed in its next ``Comm_dup``). Duplicates (``dup``) end first.
        """
        MPI = _MPI
        if self.comm == MPI.COMM_NULL:
            return
        dups, self._dups = self._dups, []
        for d in dups:  # a duplicate lives no longer than its parent
            d.shutdown()
        notices = self.notices
        comms = (notices.comm, self._checks, self._internal, self.comm)
        if not MPI.Is_finalized():
            left = _rq.drain(_rq.pending_of(self), _rq.EXIT_GRACE)
            first = min((r for r in left if r.index), key=lambda r: r.index, default=None)
            if first is not None:
                notices.announce(first.index, f"finalized with {first.what} unfinished")
            peer_left = notices.waiting()
            self.before_finalize()
            if left or peer_left:
                _rq.keep_forever(comms)
            if left:
                warnings.warn(f"hpcdp.finalize (rank {self.ranks[self.rank]}): "
                              f"{len(left)} MPI operation(s) still in flight "
                              f"({', '.join(sorted({r.what for r in left}))})",
                              RuntimeWarning, stacklevel=3)
            elif not peer_left:
                for c in comms:
                    c.Free()
        self.comm = self._internal = self._checks = notices.comm = MPI.COMM_NULL
        _rq.unregister_backend(self)


def create_world() -> MPIBackend:
    """The world group on a private duplicate of ``COMM_WORLD``."""
    MPI = get_mpi()
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        warnings.warn("MPI was initialised without MPI_THREAD_MULTIPLE; keep hpcdp calls on one thread",
                      RuntimeWarning, stacklevel=3)
    world = MPI.COMM_WORLD.Dup()
    return MPIBackend(world, range(world.Get_size()))

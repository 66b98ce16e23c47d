"""``ProcessGroup``: validated, numpy-style collectives over one ``Backend``.

Every call validates its arguments on the calling rank, takes the group's next sequence number,
optionally checks the call across ranks (``HPCDP_DEBUG=detail``), hands contiguous buffers to the
backend and waits with a deadline. Results follow numpy: each call returns a new array, or writes
into ``out=`` (in place when ``out is x``).
"""
from __future__ import annotations

import itertools
import os
import pickle
import threading
from typing import Any, Callable, Sequence

import numpy as np

from . import _debug
from ._arrays import _SUPPORTED, is_cupy, xp_of
from ._validate import check_array, check_divisible, check_out, check_rank, check_tag
from .backends.base import Backend, Request
from .errors import CollectiveMismatchError, HpcdpError
from .ops import ReduceOp, as_op, check_op_dtype
from .work import CompletedWork, Work, annotate, timeout_error, wait_for, work_where

__all__ = ["ProcessGroup", "default_timeout"]

DEFAULT_TIMEOUT = 1800.0


def default_timeout() -> float:
    """``HPCDP_TIMEOUT`` seconds if set, else 30 minutes."""
    raw = os.environ.get("HPCDP_TIMEOUT")
    if not raw:
        return DEFAULT_TIMEOUT
    try:
        t = float(raw)
    except ValueError:
        raise ValueError(f"HPCDP_TIMEOUT={raw!r} is not a number of seconds") from None
    if t <= 0:
        raise ValueError(f"HPCDP_TIMEOUT={raw!r} must be positive")
    return t


#: dtypes and ops for which the allreduce fast path needs no further checks
_FAST_DTYPES = frozenset(np.dtype(t) for t in (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float32", "float64"))
_FAST_OPS: dict[Any, ReduceOp] = {}
for _o in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PROD):
    _FAST_OPS[_o] = _o
    _FAST_OPS[_o.value] = _o


def _reduction_plan(x: Any, buf: Any, rop: ReduceOp, n: int, xp: Any,
                    inplace: bool) -> tuple[Any, Any, ReduceOp, Callable[[Any], None] | None]:
    """(send, receive buffer for the backend, backend op, post-step) of a reduction.

    ``mean`` is a sum then a division; on float16 both happen in float32 and round once, so a
    sum that overflows half precision still averages to what numpy's ``mean`` gives.
    """
    if rop is not ReduceOp.MEAN:
        return (buf if inplace else _contig(x)), buf, rop, None
    if x.dtype != np.float16:
        return ((buf if inplace else _contig(x)), buf, ReduceOp.SUM,
                lambda b: xp.divide(b, n, out=b, casting="unsafe"))
    wide = xp.empty(buf.shape, np.float32) if buf is not None else None

    def post(b: Any) -> None:
        xp.divide(wide, n, out=wide)
        b[...] = wide

    return x.astype(np.float32), wide, ReduceOp.SUM, post


def _overlaps(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return bool(np.may_share_memory(a, b))
    ptr = lambda v: v.data.ptr  # noqa: E731 - cupy: compare device ranges
    try:
        return ptr(a) < ptr(b) + b.nbytes and ptr(b) < ptr(a) + a.nbytes
    except AttributeError:
        return False


def _contig(x: Any) -> Any:
    xp = xp_of(x)
    return x if x.flags.c_contiguous else xp.ascontiguousarray(x)


class ProcessGroup:
    """A set of ranks that run collectives together. Ranks in arguments are group ranks."""

    def __init__(
        self,
        backend: Backend | None,
        *,
        name: str = "world",
        timeout: float | None = None,
        members: Sequence[int] = (),
    ) -> None:
        self.backend = backend
        self.name = name
        self.timeout = default_timeout() if timeout is None else float(timeout)
        if self.timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        self._seq = itertools.count(1)
        self._lock = threading.Lock()
        self._groups = itertools.count(1)
        self._broken: str | None = None
        self._members = tuple(backend.ranks) if backend is not None else tuple(members)
        self._max_tag = getattr(backend, "max_tag", 2**31 - 1)
        self._debug = _debug.debug_level()
        self._fast = False  # whether blocking allreduces may take the latency path
        self._refresh_fast()

    @property
    def debug(self) -> str:
        """"off" or "detail"; read from ``HPCDP_DEBUG`` when the group is made, settable."""
        return self._debug

    @debug.setter
    def debug(self, level: str) -> None:
        if level not in _debug.LEVELS:
            raise ValueError(f"debug level must be one of {sorted(_debug.LEVELS)}, got {level!r}")
        self._debug = level
        self._refresh_fast()

    def _refresh_fast(self) -> None:
        self._fast = self._debug == "off" and self.backend is not None and self._broken is None

    # -- identity ---------------------------------------------------------------------------
    @property
    def is_member(self) -> bool:
        return self.backend is not None

    @property
    def rank(self) -> int:
        return self.backend.rank if self.backend is not None else -1

    @property
    def size(self) -> int:
        return len(self._members)

    @property
    def ranks(self) -> tuple[int, ...]:
        """Global rank of each group rank."""
        return self._members

    def __repr__(self) -> str:
        kind = self.backend.name if self.backend else "non-member"
        return f"<ProcessGroup {self.name} {kind} rank {self.rank} of {self.size} {list(self.ranks)}>"

    # -- machinery --------------------------------------------------------------------------
    def _begin(self, opname: str, timeout: float | None = None, **call: Any) -> int:
        if self.backend is None:
            raise ValueError(
                f"{opname}: this rank is not a member of group {self.name} (ranks {list(self.ranks)})"
            )
        if self._broken:
            raise HpcdpError(f"{opname} on group {self.name} (rank {self.rank}): {self._broken}")
        seq = next(self._seq)  # itertools.count is atomic under the GIL
        if self.debug == "detail":
            _debug.check_across(self, opname, seq, self.timeout if timeout is None else timeout, **call)
        return seq

    def _note_timeout(self, op: str, seq: int) -> None:
        """A timed-out collective leaves the transport out of step: later calls must not reuse it."""
        if self.backend is not None and self.backend.name == "mpi":
            self._broken = f"an earlier {op} #{seq} timed out; create a new group to continue"
            self._refresh_fast()

    def _run(
        self,
        op: str,
        seq: int,
        req: Request,
        finish: Callable[[], Any],
        async_op: bool,
        timeout: float | None,
    ) -> Any:
        work = Work(self, op, seq, req, finish)
        if async_op:
            return work
        return work.wait(timeout)

    def _done(self, op: str, seq: int, result: Any, async_op: bool) -> Any:
        return CompletedWork(self, op, seq, result) if async_op else result

    def _where(self, op: str) -> str:
        return f"{op} (rank {self.rank} of group {self.name})"

    def _check_module(self, where: str, x: Any) -> None:
        if self.backend is not None and not self.backend.accepts_cupy and is_cupy(x):
            raise TypeError(f"{where}: the {self.backend.name} backend takes numpy arrays; "
                            "move cupy arrays to the host (x.get()) or use the MPI backend")

    def _result_buffer(self, where: str, out: Any, shape: tuple, dtype: np.dtype, xp: Any,
                       x: Any = None) -> tuple[Any, Any]:
        """(user-visible result, contiguous buffer the backend writes).

        ``out`` that overlaps ``x`` without being ``x`` itself gets a separate buffer: MPI
        rejects aliased buffers and other transports would read half-written input.
        """
        if out is None:
            buf = xp.empty(shape, dtype)
            return buf, buf
        check_out(where, out, shape, dtype, xp)
        aliased = x is not None and out is not x and _overlaps(out, x)
        return out, (out if out.flags.c_contiguous and not aliased else xp.empty(shape, dtype))

    @staticmethod
    def _finish_into(result: Any, buf: Any, post: Callable[[Any], None] | None = None) -> Callable[[], Any]:
        def finish() -> Any:
            if post is not None:
                post(buf)
            if buf is not result:
                result[...] = buf
            return result

        return finish

    # -- collectives ------------------------------------------------------------------------
    def allreduce(self, x: Any, op: ReduceOp | str = "sum", *, out: Any = None,
                  async_op: bool = False, timeout: float | None = None) -> Any:
        """Reduce ``x`` elementwise across ranks; every rank gets the result."""
        # Fast path for the common case (blocking, contiguous numpy, a plain op): the same
        # checks as below, in fewer Python operations, because small allreduces are latency-bound.
        try:
            rop = _FAST_OPS.get(op)
        except TypeError:  # unhashable: the general path says what is wrong with it
            rop = None
        if (rop is not None and self._fast and not async_op and type(x) is np.ndarray
                and x.dtype in _FAST_DTYPES and x.flags.c_contiguous and (out is None or (
                    type(out) is np.ndarray and out.shape == x.shape and out.dtype == x.dtype
                    and (out is x or not np.may_share_memory(out, x))
                    and (f := out.flags).c_contiguous and f.writeable))):
            if out is None:
                out = np.empty_like(x)
            seq = next(self._seq)
            t = self.timeout if timeout is None else timeout
            try:
                if x.ndim == 1:
                    req = self.backend.allreduce_blocking(x, out, rop, t)
                else:
                    rflat = out.reshape(-1)
                    req = self.backend.allreduce_blocking(rflat if out is x else x.reshape(-1),
                                                          rflat, rop, t)
            except HpcdpError as exc:
                raise annotate(exc, work_where(self, "allreduce", seq)) from exc
            if req is not None and (err := timeout_error(self, "allreduce", seq, req, t)):
                raise err
            return out
        where = self._where("allreduce")
        rop = as_op(op, where)
        check_array(where, x)
        self._check_module(where, x)
        check_op_dtype(rop, x.dtype, where)
        xp = xp_of(x)
        result, buf = self._result_buffer(where, out, x.shape, x.dtype, xp, x)
        seq = self._begin("allreduce", timeout, op=rop.value, shape=x.shape, dtype=x.dtype)
        send, rbuf, bop, post = _reduction_plan(x, buf, rop, self.size, xp, out is x and buf is x)
        rflat = rbuf.reshape(-1)
        req = self.backend.allreduce(rflat if send is rbuf else send.reshape(-1), rflat, bop)
        return self._run("allreduce", seq, req, self._finish_into(result, buf, post), async_op, timeout)

    # torch spelling
    all_reduce = allreduce

    def broadcast(self, x: Any, root: int = 0, *, out: Any = None,
                  async_op: bool = False, timeout: float | None = None) -> Any:
        """Every rank gets root's ``x``; fills ``x`` (or ``out=``) in place when it can."""
        where = self._where("broadcast")
        root = check_rank(where, "root", root, self.size)
        check_array(where, x)
        self._check_module(where, x)
        xp = xp_of(x)
        if out is not None:
            target = check_out(where, out, x.shape, x.dtype, xp)
        elif isinstance(x, np.ndarray) and not x.flags.writeable:
            target = xp.array(x, copy=True)
        else:
            target = x
        seq = self._begin("broadcast", timeout, root=root, shape=x.shape, dtype=x.dtype)
        if self.rank == root and target is not x:
            target[...] = x
        buf = target if target.flags.c_contiguous else xp.ascontiguousarray(target)
        req = self.backend.broadcast(buf.reshape(-1), root)
        return self._run("broadcast", seq, req, self._finish_into(target, buf), async_op, timeout)

    def reduce(self, x: Any, op: ReduceOp | str = "sum", root: int = 0, *, out: Any = None,
               async_op: bool = False, timeout: float | None = None) -> Any:
        """Reduce ``x`` across ranks onto ``root``; other ranks get None."""
        where = self._where("reduce")
        rop = as_op(op, where)
        root = check_rank(where, "root", root, self.size)
        check_array(where, x)
        self._check_module(where, x)
        check_op_dtype(rop, x.dtype, where)
        xp = xp_of(x)
        is_root = self.rank == root
        if is_root:
            result, buf = self._result_buffer(where, out, x.shape, x.dtype, xp, x)
        else:  # checked here too: a bad out= must not leave only the root raising
            if out is not None:
                check_out(where, out, x.shape, x.dtype, xp)
            result = buf = None
        seq = self._begin("reduce", timeout, op=rop.value, root=root, shape=x.shape, dtype=x.dtype)
        send, rbuf, bop, post = _reduction_plan(x, buf, rop, self.size, xp,
                                                is_root and out is x and buf is x)
        rflat = None if rbuf is None else rbuf.reshape(-1)
        sflat = rflat if (send is rbuf and rbuf is not None) else send.reshape(-1)
        req = self.backend.reduce(sflat, rflat, bop, root)
        finish = self._finish_into(result, buf, post) if is_root else (lambda: None)
        return self._run("reduce", seq, req, finish, async_op, timeout)

    def all_gather(self, x: Any, *, out: Any = None, async_op: bool = False,
                   timeout: float | None = None) -> Any:
        """Stack every rank's ``x``: shape ``(size, *x.shape)``."""
        where = self._where("all_gather")
        check_array(where, x)
        self._check_module(where, x)
        xp = xp_of(x)
        result, buf = self._result_buffer(where, out, (self.size, *x.shape), x.dtype, xp, x)
        seq = self._begin("all_gather", timeout, shape=x.shape, dtype=x.dtype)
        req = self.backend.all_gather(_contig(x).reshape(-1), buf.reshape(self.size, -1))
        return self._run("all_gather", seq, req, self._finish_into(result, buf), async_op, timeout)

    allgather = all_gather

    def gather(self, x: Any, root: int = 0, *, out: Any = None, async_op: bool = False,
               timeout: float | None = None) -> Any:
        """Stack every rank's ``x`` on ``root``; other ranks get None."""
        where = self._where("gather")
        root = check_rank(where, "root", root, self.size)
        check_array(where, x)
        self._check_module(where, x)
        xp = xp_of(x)
        is_root = self.rank == root
        if is_root:
            result, buf = self._result_buffer(where, out, (self.size, *x.shape), x.dtype, xp, x)
        else:  # checked here too: a bad out= must not leave only the root raising
            if out is not None:
                check_out(where, out, (self.size, *x.shape), x.dtype, xp)
            result = buf = None
        seq = self._begin("gather", timeout, root=root, shape=x.shape, dtype=x.dtype)
        rbuf = buf.reshape(self.size, -1) if is_root else None
        req = self.backend.gather(_contig(x).reshape(-1), rbuf, root)
        finish = self._finish_into(result, buf) if is_root else (lambda: None)
        return self._run("gather", seq, req, finish, async_op, timeout)

    def scatter(self, x: Any, root: int = 0, *, out: Any = None, async_op: bool = False,
                timeout: float | None = None) -> Any:
        """Split root's ``x`` along axis 0 into ``size`` parts; rank i gets part i.

        Non-root ranks pass an array shaped like root's (its values are ignored) or ``out=``.
        """
        where = self._where("scatter")
        root = check_rank(where, "root", root, self.size)
        is_root = self.rank == root
        if x is None:
            if is_root or out is None:
                raise ValueError(f"{where}: root must pass x; other ranks pass x or out=")
            check_array(where, out)
            shape, dtype, xp = tuple(out.shape), out.dtype, xp_of(out)
            full = (self.size * shape[0], *shape[1:]) if shape else None
            if full is None:
                raise ValueError(f"{where}: out= must have at least one axis")
        else:
            check_array(where, x)
            self._check_module(where, x)
            part = check_divisible(where, x, self.size)
            shape, dtype, xp, full = (part, *x.shape[1:]), x.dtype, xp_of(x), tuple(x.shape)
        result, buf = self._result_buffer(where, out, shape, dtype, xp, x)
        seq = self._begin("scatter", timeout, root=root, shape=full, dtype=dtype)
        send = _contig(x).reshape(self.size, -1) if is_root else None
        req = self.backend.scatter(send, buf.reshape(-1), root)
        return self._run("scatter", seq, req, self._finish_into(result, buf), async_op, timeout)

    def reduce_scatter(self, x: Any, op: ReduceOp | str = "sum", *, out: Any = None,
                       async_op: bool = False, timeout: float | None = None) -> Any:
        """Reduce ``x`` across ranks and give rank i part i of axis 0."""
        where = self._where("reduce_scatter")
        rop = as_op(op, where)
        check_array(where, x)
        self._check_module(where, x)
        check_op_dtype(rop, x.dtype, where)
        part = check_divisible(where, x, self.size)
        xp = xp_of(x)
        result, buf = self._result_buffer(where, out, (part, *x.shape[1:]), x.dtype, xp, x)
        seq = self._begin("reduce_scatter", timeout, op=rop.value, shape=x.shape, dtype=x.dtype)
        n = self.size
        send, rbuf, bop, post = _reduction_plan(x, buf, rop, n, xp, False)
        req = self.backend.reduce_scatter(send.reshape(n, -1), rbuf.reshape(-1), bop)
        return self._run("reduce_scatter", seq, req, self._finish_into(result, buf, post), async_op, timeout)

    def all_to_all(self, x: Any, *, out: Any = None, async_op: bool = False,
                   timeout: float | None = None) -> Any:
        """Part j of ``x`` (axis 0) goes to rank j; part i of the result came from rank i."""
        where = self._where("all_to_all")
        check_array(where, x)
        self._check_module(where, x)
        check_divisible(where, x, self.size)
        xp = xp_of(x)
        result, buf = self._result_buffer(where, out, x.shape, x.dtype, xp, x)
        if buf is x:  # the transport needs distinct send and receive memory
            buf = xp.empty(x.shape, x.dtype)
        seq = self._begin("all_to_all", timeout, shape=x.shape, dtype=x.dtype)
        n = self.size
        req = self.backend.all_to_all(_contig(x).reshape(n, -1), buf.reshape(n, -1))
        return self._run("all_to_all", seq, req, self._finish_into(result, buf), async_op, timeout)

    alltoall = all_to_all

    def barrier(self, *, async_op: bool = False, timeout: float | None = None) -> Any:
        """Return once every rank of the group has called ``barrier``."""
        seq = self._begin("barrier", timeout)
        return self._run("barrier", seq, self.backend.barrier(), lambda: None, async_op, timeout)

    # -- point to point ---------------------------------------------------------------------
    def _check_p2p(self, op: str, x: Any, peer_name: str, peer: int, tag: int) -> tuple[str, int, int]:
        where = self._where(op)
        if self.backend is None:
            self._begin(op)  # raises: not a member
        peer = check_rank(where, peer_name, peer, self.size)
        tag = check_tag(where, tag, self._max_tag)
        check_array(where, x)
        self._check_module(where, x)
        return where, peer, tag

    def isend(self, x: Any, dst: int, tag: int = 0) -> Work:
        """Start sending ``x`` to group rank ``dst``; do not modify ``x`` until ``wait()``."""
        _, dst, tag = self._check_p2p("send", x, "dst", dst, tag)
        buf = _contig(x)
        req = self.backend.send(buf.reshape(-1), dst, tag)
        return Work(self, f"send(dst={dst}, tag={tag})", 0, req, lambda: None)

    def irecv(self, buf: Any, src: int, tag: int = 0) -> Work:
        """Start receiving into ``buf`` from group rank ``src``; ``wait()`` returns ``buf``."""
        where, src, tag = self._check_p2p("recv", buf, "src", src, tag)
        if isinstance(buf, np.ndarray) and not buf.flags.writeable:
            raise ValueError(f"{where}: the receive buffer is read-only")
        tmp = buf if buf.flags.c_contiguous else xp_of(buf).empty(buf.shape, buf.dtype)
        req = self.backend.recv(tmp.reshape(-1), src, tag)
        return Work(self, f"recv(src={src}, tag={tag})", 0, req, self._finish_into(buf, tmp))

    def _p2p_fast(self, x: Any, peer: int, tag: int) -> bool:
        """Whether a blocking send/recv may skip ``Work``: the same checks as ``_check_p2p``
        for the common case (contiguous numpy, plain ints), because ping-pongs are latency-bound."""
        return (self._fast and type(x) is np.ndarray and type(peer) is int and type(tag) is int
                and 0 <= peer < self.size and peer != self.rank and 0 <= tag <= self._max_tag
                and x.dtype in _SUPPORTED and x.flags.c_contiguous)

    def send(self, x: Any, dst: int, tag: int = 0, *, timeout: float | None = None) -> None:
        """Send ``x`` to ``dst`` and return once the buffer may be reused."""
        if self._p2p_fast(x, dst, tag):
            req = self.backend.send(x if x.ndim == 1 else x.reshape(-1), dst, tag)
            return wait_for(self, f"send(dst={dst}, tag={tag})", 0, req,
                            self.timeout if timeout is None else timeout)
        if dst == self.rank:
            raise ValueError(f"{self._where('send')}: a blocking send to oneself would deadlock; use isend")
        self.isend(x, dst, tag).wait(timeout)

    def recv(self, buf: Any, src: int, tag: int = 0, *, timeout: float | None = None) -> Any:
        """Receive into ``buf`` from ``src``; returns ``buf``."""
        if self._p2p_fast(buf, src, tag) and buf.flags.writeable:
            req = self.backend.recv(buf if buf.ndim == 1 else buf.reshape(-1), src, tag)
            wait_for(self, f"recv(src={src}, tag={tag})", 0, req,
                     self.timeout if timeout is None else timeout)
            return buf
        if src == self.rank:
            raise ValueError(f"{self._where('recv')}: a blocking recv from oneself would deadlock; use irecv")
        return self.irecv(buf, src, tag).wait(timeout)

    # -- Python objects (pickled: only between authenticated peers of one job) -------------
    def broadcast_object(self, obj: Any = None, root: int = 0, *, timeout: float | None = None) -> Any:
        """Every rank gets root's ``obj``."""
        where = self._where("broadcast_object")
        root = check_rank(where, "root", root, self.size)
        failure: BaseException | None = None
        if self.rank == root:
            try:
                data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
                n = np.array([data.size], np.int64)
            except Exception as exc:  # noqa: BLE001 - told to every rank below
                failure, data, n = exc, None, np.array([-1], np.int64)
        else:
            data, n = None, np.zeros(1, np.int64)
        self.broadcast(n, root, timeout=timeout)
        if n[0] < 0:
            raise TypeError(f"{where}: root {root} could not pickle its object"
                            + (f": {failure}" if failure else "")) from failure
        if self.rank != root:
            data = np.empty(int(n[0]), np.uint8)
        self.broadcast(data, root, timeout=timeout)
        return obj if self.rank == root else pickle.loads(data.tobytes())

    def all_gather_object(self, obj: Any, *, timeout: float | None = None) -> list[Any]:
        """A list of every rank's ``obj``, in rank order."""
        failure: BaseException | None = None
        try:
            data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
        except Exception as exc:  # noqa: BLE001 - told to every rank below
            failure, data = exc, np.zeros(0, np.uint8)
        mine = np.array([-1 if failure else data.size], np.int64)
        sizes = self.all_gather(mine, timeout=timeout).reshape(-1)
        if (sizes < 0).any():
            bad = [int(i) for i in np.flatnonzero(sizes < 0)]
            raise TypeError(f"{self._where('all_gather_object')}: rank(s) {bad} could not pickle "
                            "their object" + (f": {failure}" if failure else "")) from failure
        padded = np.zeros(int(sizes.max()), np.uint8)
        padded[: data.size] = data
        rows = self.all_gather(padded, timeout=timeout)
        return [pickle.loads(rows[i, : int(sizes[i])].tobytes()) for i in range(self.size)]

    def gather_object(self, obj: Any, root: int = 0, *, timeout: float | None = None) -> list[Any] | None:
        """Like ``all_gather_object`` but only ``root`` gets the list."""
        objs = self.all_gather_object(obj, timeout=timeout)
        return objs if self.rank == root else None

    # -- sub-groups -------------------------------------------------------------------------
    def new_group(self, ranks: Sequence[int], *, name: str | None = None,
                  timeout: float | None = None) -> "ProcessGroup":
        """Collective over this group: a group of ``ranks`` (ranks of this group, in that order).

        Non-members get a group object too; its collectives raise ``ValueError``.
        """
        where = self._where("new_group")
        if self.backend is None:
            self._begin("new_group")
        try:
            mine: Any = [int(r) if isinstance(r, (int, np.integer)) and not isinstance(r, bool)
                         else repr(r) for r in ranks]
        except TypeError:
            mine = repr(ranks)
        # Exchange before judging, so a bad list on one rank makes every rank raise together.
        seen = self.all_gather_object(mine, timeout=timeout)
        for i, s in enumerate(seen):
            if not isinstance(s, list) or any(not isinstance(r, int) for r in s):
                raise TypeError(f"{where}: rank {i} passed ranks that are not ints: {s}")
            if not s:
                raise ValueError(f"{where}: a group needs at least one rank (rank {i} passed [])")
            if len(set(s)) != len(s):
                raise ValueError(f"{where}: duplicate ranks in {s} (passed by rank {i})")
            for r in s:
                check_rank(where + f" (list of rank {i})", "rank", r, self.size)
        ranks = seen[self.rank]
        if any(s != ranks for s in seen):
            detail = "; ".join(f"rank {i}: {s}" for i, s in enumerate(seen))
            raise CollectiveMismatchError(f"{where}: ranks passed different lists ({detail})")
        gname = name or f"{self.name}.{next(self._groups)}{ranks}"
        sub = self.backend.new_group(ranks)
        members = [self.ranks[r] for r in ranks]
        child = ProcessGroup(sub, name=gname, timeout=self.timeout if timeout is None else timeout,
                             members=members)
        if self.debug == "detail":
            child.debug = "detail"
        return child

    def shutdown(self) -> None:
        if self.backend is not None:
            self.backend.shutdown()

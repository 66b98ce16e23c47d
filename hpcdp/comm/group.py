"""``ProcessGroup``: validated, numpy-style collectives over one ``Backend``.

Every call validates its arguments on the calling rank, takes the group's next sequence number,
optionally checks the call across ranks (``HPCDP_DEBUG=detail``), hands contiguous buffers to the
backend and waits with a deadline. Results follow numpy: each call returns a new array, or writes
into ``out=`` (in place when ``out is x``).
"""
from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any, Callable, Sequence

import numpy as np

from . import debug as _debug
from .._arrays import contiguous, is_cupy, xp_of
from ..backends import HostStaged
from ._buffers import finish_into, reduction_plan, result_buffer, via_tensors
from ._objects import ObjectCollectives
from ._group_p2p import PointToPoint
from ._torch_names import TorchSpellings
from .._config import SETTINGS, setting
from .._tensors import tensor_call
from .validation import check_array, check_divisible, check_out, check_rank, check_timeout
from ..backends.base import Backend, Request
from ..errors import HpcdpError, public, public_error
from ..ops import ReduceOp, as_op, check_op_dtype
from ..trace import hooks as trace  # the recording hooks (on_error, active_recorder)
from .work import CompletedWork, Work, annotate, work_where
from .topology import CartGroup, cart_create, group_payload, group_ranks, split_layout, split_payload
from . import reproducible
from ._lane import all_gather_now, allreduce_now, broadcast_now

__all__ = ["ProcessGroup", "default_timeout"]

DEFAULT_TIMEOUT = SETTINGS["HPCDP_TIMEOUT"].default


def default_timeout() -> float:
    """``HPCDP_TIMEOUT`` seconds if set, else 30 minutes (nan, inf, 0 and negatives refused)."""
    return setting("HPCDP_TIMEOUT")


_ndarray = np.ndarray



class ProcessGroup:
    """A set of ranks that run collectives together. Ranks in arguments are group ranks.

    Collectives are numpy style (return the result, or fill ``out=``); torch.distributed's
    spellings (``all_reduce``, ``broadcast(x, src=)``, ...) work in place as torch's do
    (``_torch_names``). An ``HpcdpError`` is raised from the public call, its internal frames
    kept in ``__context__`` (``errors.public``).

    torch tensors are taken wherever arrays are, as zero-copy numpy (CPU) or cupy (CUDA) views,
    and results come back as tensors (``_tensors``: the rules for grad, strides and bfloat16).

    Point to point, the Python-object collectives and the torch spellings are components the
    group holds (``_p2p``, ``_objects``, ``_torch``), each given the group it serves; the
    group's methods of their names delegate to them.
    """

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
        self._timeout = default_timeout() if timeout is None else check_timeout(
            f"group {name}", timeout)
        self._seq = itertools.count(1)
        self._lock = threading.Lock()
        self._groups = itertools.count(1)
        self._broken: str | None = None
        self._closed: str | None = None
        self._children: list[weakref.ref[ProcessGroup]] = []
        self._members = tuple(backend.ranks) if backend is not None else tuple(members)
        self._max_tag = backend.max_tag if backend is not None else 0
        self._debug = _debug.debug_level()
        self._deterministic = bool(setting("HPCDP_DETERMINISTIC"))
        # the flight recorder of this rank (None when HPCDP_FLIGHT_RECORDER=0 or not a member)
        self._rec = (trace.active_recorder(self._members[backend.rank])
                     if backend is not None else None)
        self._fast = False  # whether blocking allreduces may take the latency path
        self._sample = False
        #: the sampled checks of asynchronous calls, posted and not yet handed to their Work
        self._unjudged: dict[int, tuple[Any, Any]] = {}
        self._host_staged: HostStaged | None = None  # made at the first cupy call (_transport)
        self._refresh_fast()
        self._p2p = p2p = PointToPoint(self)
        # point to point as the component's bound methods: one call, not two (halo exchanges
        # are latency-bound); the methods below document them
        self.send, self.recv, self.sendrecv = p2p.send, p2p.recv, p2p.sendrecv
        self.isend, self.irecv = p2p.isend, p2p.irecv
        self._objects = ObjectCollectives(self)
        self._torch = TorchSpellings(self)

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

    @property
    def deterministic(self) -> bool:
        """Whether float ``sum``/``mean`` reductions are exact and bit-reproducible
        (``comm.reproducible``); from ``init(deterministic=)`` or ``HPCDP_DETERMINISTIC``,
        inherited by sub-groups, settable (the same on every rank)."""
        return self._deterministic

    @deterministic.setter
    def deterministic(self, on: bool) -> None:
        self._deterministic = bool(on)
        self._refresh_fast()

    def _refresh_fast(self) -> None:
        self._sample = self._debug == "sample"  # the sampled signature checks (comm.debug)
        self._fast = (self._debug != "detail" and self.backend is not None and self._broken is None
                      and self._closed is None and not self._deterministic)

    @property
    def timeout(self) -> float:
        """Seconds a blocking call waits by default; settable (finite and > 0)."""
        return self._timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        self._timeout = check_timeout(f"group {self.name}", value)

    def _timeout_of(self, op: str, timeout: Any) -> float:
        """A call's ``timeout=``, checked, or the group's."""
        if timeout is None:
            return self._timeout
        return check_timeout(self._where(op), timeout)

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
    def _usable(self, opname: str) -> None:
        if self._closed:
            raise HpcdpError(f"{opname} on group {self.name} (rank {self.rank}): {self._closed}")
        if self.backend is None:
            raise ValueError(
                f"{opname}: this rank is not a member of group {self.name} (ranks {list(self.ranks)})"
            )

    def _begin(self, opname: str, timeout: float, blocking: bool = True,
               **call: Any) -> tuple[int, int]:
        """(sequence number, flight-recorder token) of a collective about to be posted; checked
        across ranks first where ``HPCDP_DEBUG`` says (``comm.debug``). An asynchronous call's
        sampled check is posted here and judged by its ``Work`` (``_run``): it must not block."""
        self._usable(opname)
        if self._broken:
            raise HpcdpError(f"{opname} on group {self.name} (rank {self.rank}): {self._broken}")
        seq = next(self._seq)  # itertools.count is atomic under the GIL
        rec = self._rec
        tok = rec.begin(opname, self, seq, call.get("shape"), call.get("dtype"),
                        call.get("root", -1)) if rec is not None else 0
        if self._debug == "detail" or (self._debug == "sample" and _debug.sampled(seq)):
            try:
                if self._debug == "detail":
                    _debug.check_across(self, opname, seq, timeout, **call)
                elif blocking:
                    _debug.check_sampled(self, opname, seq, timeout, **call)
                else:
                    self._unjudged[seq] = _debug.post_sampled(self, opname, seq, **call)
            except Exception as exc:
                trace.on_error(rec, tok, exc)
                raise
        return seq, tok

    def _note_failure(self, op: str, seq: int, what: str) -> None:
        """A collective that timed out or failed leaves an MPI group out of step (MPI cannot
        cancel it): later calls must not reuse the group. Point to point (seq 0) is unaffected."""
        if seq and self.backend is not None and self.backend.timeout_poisons_group and not self._broken:
            self._broken = f"an earlier {op} #{seq} {what}; {self.backend.broken_advice}"
            self._refresh_fast()

    def _post(self, op: str, seq: int, fn: Callable[..., Request], *args: Any, tok: int = 0) -> Request:
        """``fn(*args)``: a transport error while posting names the call, like one while waiting."""
        try:
            return fn(*args)
        except HpcdpError as exc:
            self._note_failure(op, seq, f"failed ({type(exc).__name__})")
            err = annotate(exc, work_where(self, op, seq))
            trace.on_error(self._rec, tok, err)
            raise err from exc

    def _run(
        self,
        op: str,
        seq: int,
        req: Request,
        finish: Callable[[], Any],
        async_op: bool,
        timeout: float,
        tok: int = 0,
    ) -> Any:
        if self._unjudged:
            check = self._unjudged.pop(seq, None)
            if check is not None:
                req = _debug.CheckedRequest(self, op, seq, check[0], check[1], req)
        work = Work(self, op, seq, req, finish, timeout, tok)
        if async_op:
            return work
        return work._wait()

    def _done(self, op: str, seq: int, result: Any, async_op: bool) -> Any:
        return CompletedWork(self, op, seq, result) if async_op else result

    def _where(self, op: str) -> str:
        return f"{op} (rank {self.rank} of group {self.name})"

    def _transport(self, x: Any) -> Any:
        """The backend to post ``x`` on: the group's own, or, for a cupy array on a backend
        that reads host memory only (TCP, simulated ranks), a view of it that stages device
        arrays through pinned host buffers (``backends._staging``)."""
        be = self.backend
        if be is None or be.accepts_cupy or not is_cupy(x):
            return be
        staged = self._host_staged
        if staged is None:
            staged = self._host_staged = HostStaged(be)
        return staged

    # -- collectives ------------------------------------------------------------------------
    def allreduce(self, x: Any, op: ReduceOp | str = "sum", *, out: Any = None,
                  async_op: bool = False, timeout: float | None = None) -> Any:
        """Reduce ``x`` elementwise across ranks; every rank gets the result."""
        try:
            if self._fast and not async_op:
                done = allreduce_now(self, x, op, out, timeout)
                if done is not None:
                    return done
            where = self._where("allreduce")
            if (type(x) is not _ndarray or out is not None) and (tc := tensor_call(where, x, out, reduce=True)):
                return via_tensors(tc, self.allreduce(tc.read(x), op, out=tc.out(out), async_op=async_op,
                                                      timeout=timeout))
            rop = as_op(op, where)
            check_array(where, x)
            be = self._transport(x)
            check_op_dtype(rop, x.dtype, where)
            if self._deterministic and reproducible.takes(rop, x.dtype, where):
                return reproducible.run(self, "allreduce", x, rop, out, async_op, timeout, "all")
            xp = xp_of(x)
            result, buf = result_buffer(where, out, x.shape, x.dtype, xp, x)
            t = self._timeout_of("allreduce", timeout)
            seq, tok = self._begin("allreduce", t, not async_op, op=rop.value, shape=x.shape, dtype=x.dtype)
            send, rbuf, bop, post = reduction_plan(x, buf, rop, self.size, xp, out is x and buf is x)
            rflat = rbuf.reshape(-1)
            req = self._post("allreduce", seq, be.allreduce, rflat if send is rbuf else send.reshape(-1), rflat, bop, tok=tok)
            return self._run("allreduce", seq, req, finish_into(result, buf, post), async_op, t, tok)
        except HpcdpError as exc:  # raised from here, not from a dozen frames below
            raise public_error(exc)  # noqa: B904 - exc is its __context__

    @public
    def broadcast(self, x: Any, root: int = 0, *, out: Any = None, async_op: bool = False,
                  timeout: float | None = None, src: int | None = None) -> Any:
        """Every rank gets root's ``x``; fills ``x`` (or ``out=``) in place when it can.

        ``src=`` is torch's spelling of ``root``: with it the call is torch's (``x`` in place,
        returns None or a Work).
        """
        if src is not None:
            if out is not None:
                raise TypeError(f"{self._where('broadcast')}: torch's form (src=) takes no out=")
            return self._torch.broadcast(x, src, async_op, timeout)
        if self._fast and not async_op and out is None:
            done = broadcast_now(self, x, root, timeout)
            if done is not None:
                return done
        where = self._where("broadcast")
        if (type(x) is not _ndarray or out is not None) and (tc := tensor_call(where, x, out)):
            x = tc.write(x, strict=False)  # in place when it can be, as for a read-only array
            return via_tensors(tc, self.broadcast(x, root, out=tc.out(out), async_op=async_op, timeout=timeout))
        root = check_rank(where, "root", root, self.size)
        check_array(where, x)
        be = self._transport(x)
        xp = xp_of(x)
        if out is not None:
            target = check_out(where, out, x.shape, x.dtype, xp)
        elif isinstance(x, np.ndarray) and not x.flags.writeable:
            target = xp.array(x, copy=True)
        else:
            target = x
        t = self._timeout_of("broadcast", timeout)
        seq, tok = self._begin("broadcast", t, not async_op, root=root, shape=x.shape, dtype=x.dtype)
        if self.rank == root and target is not x:
            target[...] = x
        buf = target if target.flags.c_contiguous else xp.ascontiguousarray(target)
        req = self._post("broadcast", seq, be.broadcast, buf.reshape(-1), root, tok=tok)
        return self._run("broadcast", seq, req, finish_into(target, buf), async_op, t, tok)

    @public
    def reduce(self, x: Any, op: ReduceOp | str = "sum", root: int = 0, *, out: Any = None,
               async_op: bool = False, timeout: float | None = None, dst: int | None = None) -> Any:
        """Reduce ``x`` across ranks onto ``root``; other ranks get None.

        torch's form, ``reduce(x, dst=0, op=...)`` or ``reduce(x, 0)``, reduces into ``x`` on
        ``dst`` in place and returns None (or a Work).
        """
        if dst is not None or (isinstance(op, (int, np.integer)) and not isinstance(op, bool)):
            if out is not None:
                raise TypeError(f"{self._where('reduce')}: torch's form (dst=) takes no out=")
            if dst is None:  # torch's positional order: reduce(tensor, dst, op)
                dst, op = int(op), (root if isinstance(root, (str, ReduceOp)) else "sum")
            return self._torch.reduce(x, dst, op, async_op, timeout)
        where = self._where("reduce")
        if (type(x) is not _ndarray or out is not None) and (tc := tensor_call(where, x, out, reduce=True)):
            return via_tensors(tc, self.reduce(tc.read(x), op, root, out=tc.out(out), async_op=async_op, timeout=timeout))
        rop = as_op(op, where)
        root = check_rank(where, "root", root, self.size)
        check_array(where, x)
        be = self._transport(x)
        check_op_dtype(rop, x.dtype, where)
        if self._deterministic and reproducible.takes(rop, x.dtype, where):
            return reproducible.run(self, "reduce", x, rop, out, async_op, timeout, "root", root)
        xp = xp_of(x)
        is_root = self.rank == root
        if is_root:
            result, buf = result_buffer(where, out, x.shape, x.dtype, xp, x)
        else:  # checked here too: a bad out= must not leave only the root raising
            if out is not None:
                check_out(where, out, x.shape, x.dtype, xp)
            result = buf = None
        t = self._timeout_of("reduce", timeout)
        seq, tok = self._begin("reduce", t, not async_op, op=rop.value, root=root, shape=x.shape, dtype=x.dtype)
        send, rbuf, bop, post = reduction_plan(x, buf, rop, self.size, xp,
                                                is_root and out is x and buf is x)
        rflat = None if rbuf is None else rbuf.reshape(-1)
        sflat = rflat if (send is rbuf and rbuf is not None) else send.reshape(-1)
        req = self._post("reduce", seq, be.reduce, sflat, rflat, bop, root, tok=tok)
        finish = finish_into(result, buf, post) if is_root else (lambda: None)
        return self._run("reduce", seq, req, finish, async_op, t, tok)

    @public
    def all_gather(self, x: Any, tensor: Any = None, *, out: Any = None, async_op: bool = False,
                   timeout: float | None = None) -> Any:
        """Stack every rank's ``x``: shape ``(size, *x.shape)``.

        torch's form ``all_gather(tensor_list, tensor)`` fills ``tensor_list[i]`` with rank i's
        ``tensor`` and returns None (or a Work).
        """
        if tensor is not None:
            if out is not None:
                raise TypeError(f"{self._where('all_gather')}: torch's form takes no out=")
            return self._torch.all_gather(x, tensor, async_op, timeout)
        if self._fast and not async_op:
            done = all_gather_now(self, x, out, timeout)
            if done is not None:
                return done
        where = self._where("all_gather")
        if (type(x) is not _ndarray or out is not None) and (tc := tensor_call(where, x, out)):
            return via_tensors(tc, self.all_gather(tc.read(x), out=tc.out(out), async_op=async_op, timeout=timeout))
        check_array(where, x)
        be = self._transport(x)
        xp = xp_of(x)
        result, buf = result_buffer(where, out, (self.size, *x.shape), x.dtype, xp, x)
        t = self._timeout_of("all_gather", timeout)
        seq, tok = self._begin("all_gather", t, not async_op, shape=x.shape, dtype=x.dtype)
        req = self._post("all_gather", seq, be.all_gather, contiguous(x).reshape(-1), buf.reshape(self.size, -1), tok=tok)
        return self._run("all_gather", seq, req, finish_into(result, buf), async_op, t, tok)

    allgather = all_gather

    @public
    def gather(self, x: Any, root: int = 0, *, out: Any = None, async_op: bool = False,
               timeout: float | None = None, gather_list: Any = None,
               dst: int | None = None) -> Any:
        """Stack every rank's ``x`` on ``root``; other ranks get None.

        torch's form ``gather(x, gather_list, dst=0)`` fills ``gather_list`` on ``dst`` and
        returns None (or a Work).
        """
        if dst is not None or gather_list is not None or isinstance(root, (list, tuple)):
            if out is not None:
                raise TypeError(f"{self._where('gather')}: torch's form takes no out=")
            if gather_list is None and not isinstance(root, (int, np.integer)):
                gather_list = root  # positional: gather(tensor, gather_list, dst)
            if dst is None:
                dst = root if isinstance(root, (int, np.integer)) else 0
            return self._torch.gather(x, gather_list, dst, async_op, timeout)
        where = self._where("gather")
        if (type(x) is not _ndarray or out is not None) and (tc := tensor_call(where, x, out)):
            return via_tensors(tc, self.gather(tc.read(x), root, out=tc.out(out), async_op=async_op, timeout=timeout))
        root = check_rank(where, "root", root, self.size)
        check_array(where, x)
        be = self._transport(x)
        xp = xp_of(x)
        is_root = self.rank == root
        if is_root:
            result, buf = result_buffer(where, out, (self.size, *x.shape), x.dtype, xp, x)
        else:  # checked here too: a bad out= must not leave only the root raising
            if out is not None:
                check_out(where, out, (self.size, *x.shape), x.dtype, xp)
            result = buf = None
        t = self._timeout_of("gather", timeout)
        seq, tok = self._begin("gather", t, not async_op, root=root, shape=x.shape, dtype=x.dtype)
        rbuf = buf.reshape(self.size, -1) if is_root else None
        req = self._post("gather", seq, be.gather, contiguous(x).reshape(-1), rbuf, root, tok=tok)
        finish = finish_into(result, buf) if is_root else (lambda: None)
        return self._run("gather", seq, req, finish, async_op, t, tok)

    @public
    def scatter(self, x: Any, root: int = 0, *, out: Any = None, async_op: bool = False,
                timeout: float | None = None, scatter_list: Any = None,
                src: int | None = None) -> Any:
        """Split root's ``x`` along axis 0 into ``size`` parts; rank i gets part i.

        Non-root ranks pass an array shaped like root's (its values are ignored) or ``out=``.
        torch's form ``scatter(x, scatter_list, src=0)`` fills ``x`` with ``scatter_list[i]``
        on rank i and returns None (or a Work).
        """
        if src is not None or scatter_list is not None or isinstance(root, (list, tuple)):
            if out is not None:
                raise TypeError(f"{self._where('scatter')}: torch's form takes no out=")
            if scatter_list is None and not isinstance(root, (int, np.integer)):
                scatter_list = root  # positional: scatter(tensor, scatter_list, src)
            if src is None:
                src = root if isinstance(root, (int, np.integer)) else 0
            return self._torch.scatter(x, scatter_list, src, async_op, timeout)
        where = self._where("scatter")
        if (type(x) is not _ndarray or out is not None) and (tc := tensor_call(where, x, out)):
            return via_tensors(tc, self.scatter(tc.read(x), root, out=tc.out(out), async_op=async_op, timeout=timeout))
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
            part = check_divisible(where, x, self.size)
            shape, dtype, xp, full = (part, *x.shape[1:]), x.dtype, xp_of(x), tuple(x.shape)
        be = self._transport(x if x is not None else out)
        result, buf = result_buffer(where, out, shape, dtype, xp, x)
        t = self._timeout_of("scatter", timeout)
        seq, tok = self._begin("scatter", t, not async_op, root=root, shape=full, dtype=dtype)
        send = contiguous(x).reshape(self.size, -1) if is_root else None
        req = self._post("scatter", seq, be.scatter, send, buf.reshape(-1), root, tok=tok)
        return self._run("scatter", seq, req, finish_into(result, buf), async_op, t, tok)

    @public
    def reduce_scatter(self, x: Any, op: ReduceOp | str = "sum", *, out: Any = None,
                       async_op: bool = False, timeout: float | None = None) -> Any:
        """Reduce ``x`` across ranks and give rank i part i of axis 0.

        torch's list form ``reduce_scatter(output, input_list)`` is not offered (a TypeError
        says so): use ``reduce_scatter_tensor(output, input)``, torch's own successor.
        """
        if isinstance(op, (list, tuple)):
            raise TypeError(f"{self._where('reduce_scatter')}: torch's list form reduce_scatter("
                            "output, input_list) is not offered; call reduce_scatter_tensor("
                            "output, np.concatenate(input_list)) (in place, as torch's), or "
                            "reduce_scatter(x) for the result")
        where = self._where("reduce_scatter")
        if (type(x) is not _ndarray or out is not None) and (tc := tensor_call(where, x, out, reduce=True)):
            return via_tensors(tc, self.reduce_scatter(tc.read(x), op, out=tc.out(out), async_op=async_op,
                                                       timeout=timeout))
        rop = as_op(op, where)
        check_array(where, x)
        be = self._transport(x)
        check_op_dtype(rop, x.dtype, where)
        part = check_divisible(where, x, self.size)
        if self._deterministic and reproducible.takes(rop, x.dtype, where):
            return reproducible.run(self, "reduce_scatter", x, rop, out, async_op, timeout, "scatter")
        xp = xp_of(x)
        result, buf = result_buffer(where, out, (part, *x.shape[1:]), x.dtype, xp, x)
        t = self._timeout_of("reduce_scatter", timeout)
        seq, tok = self._begin("reduce_scatter", t, not async_op, op=rop.value, shape=x.shape, dtype=x.dtype)
        n = self.size
        send, rbuf, bop, post = reduction_plan(x, buf, rop, n, xp, False)
        req = self._post("reduce_scatter", seq, be.reduce_scatter, send.reshape(n, -1), rbuf.reshape(-1), bop, tok=tok)
        return self._run("reduce_scatter", seq, req, finish_into(result, buf, post), async_op, t, tok)

    @public
    def all_to_all(self, x: Any, input_list: Any = None, *, out: Any = None,
                   async_op: bool = False, timeout: float | None = None) -> Any:
        """Part j of ``x`` (axis 0) goes to rank j; part i of the result came from rank i.

        torch's form ``all_to_all(output_list, input_list)`` fills ``output_list[i]`` with what
        rank i sent this rank and returns None (or a Work).
        """
        if input_list is not None:
            if out is not None:
                raise TypeError(f"{self._where('all_to_all')}: torch's form takes no out=")
            return self._torch.all_to_all(x, input_list, async_op, timeout)
        where = self._where("all_to_all")
        if (type(x) is not _ndarray or out is not None) and (tc := tensor_call(where, x, out)):
            return via_tensors(tc, self.all_to_all(tc.read(x), out=tc.out(out), async_op=async_op, timeout=timeout))
        check_array(where, x)
        be = self._transport(x)
        check_divisible(where, x, self.size)
        xp = xp_of(x)
        result, buf = result_buffer(where, out, x.shape, x.dtype, xp, x)
        if buf is x:  # the transport needs distinct send and receive memory
            buf = xp.empty(x.shape, x.dtype)
        t = self._timeout_of("all_to_all", timeout)
        seq, tok = self._begin("all_to_all", t, not async_op, shape=x.shape, dtype=x.dtype)
        n = self.size
        req = self._post("all_to_all", seq, be.all_to_all, contiguous(x).reshape(n, -1), buf.reshape(n, -1), tok=tok)
        return self._run("all_to_all", seq, req, finish_into(result, buf), async_op, t, tok)

    alltoall = all_to_all

    @public
    def barrier(self, *, async_op: bool = False, timeout: float | None = None) -> Any:
        """Return once every rank of the group has called ``barrier``."""
        t = self._timeout_of("barrier", timeout)
        seq, tok = self._begin("barrier", t, not async_op)
        req = self._post("barrier", seq, self.backend.barrier, tok=tok)
        return self._run("barrier", seq, req, lambda: None, async_op, t, tok)

    # -- point to point (``_group_p2p.PointToPoint``) -----------------------------------------
    def isend(self, x: Any, dst: int, tag: int = 0) -> Work:
        """Start sending ``x`` to group rank ``dst``; do not modify ``x`` until ``wait()``."""
        return self._p2p.isend(x, dst, tag)

    def irecv(self, buf: Any, src: int, tag: int = 0) -> Work:
        """Start receiving into ``buf`` from group rank ``src``; ``wait()`` returns ``buf``."""
        return self._p2p.irecv(buf, src, tag)

    def probe(self, src: int = -1, tag: int = -1, *, timeout: float | None = None) -> Any:
        """Block until a message from ``src`` (-1: any) with ``tag`` (-1: any) can be received;
        its ``Status`` (source, tag, nbytes). See ``hpcdp.probe``."""
        return self._p2p.probe(src, tag, timeout=timeout)

    def iprobe(self, src: int = -1, tag: int = -1) -> Any:
        """The ``Status`` of a message ``recv(src, tag)`` would take now, else None."""
        return self._p2p.iprobe(src, tag)

    def send(self, x: Any, dst: int, tag: int = 0, *, timeout: float | None = None) -> None:
        """Send ``x`` to ``dst`` and return once the buffer may be reused."""
        return self._p2p.send(x, dst, tag, timeout=timeout)

    def recv(self, buf: Any = None, src: int | None = -1, tag: int = 0, *, dtype: Any = None,
             return_status: bool = False, timeout: float | None = None) -> Any:
        """Receive into ``buf`` from ``src``; returns ``buf`` (torch's returns the sender's rank:
        ``return_status=True`` gives it as ``Status.source``).

        ``src=ANY_SOURCE`` (-1, the default) takes the next message from any rank, ``tag=ANY_TAG``
        any tag; ``buf=None`` returns a new array of the sender's dtype and shape, as mpi4py's
        ``comm.recv()`` does (``hpcdp.probe``; a ``dtype`` other than the sender's: the bytes as a
        1-D array of ``dtype``). A buffer of another dtype than the sender's raises
        ``CollectiveMismatchError``. ``return_status=True`` returns ``(buf, Status)``.
        """
        return self._p2p.recv(buf, src, tag, dtype=dtype, return_status=return_status,
                              timeout=timeout)

    def sendrecv(self, sendbuf: Any, dst: int, recvbuf: Any = None, src: int = -1, *,
                 sendtag: int = 0, recvtag: int = -1, dtype: Any = None,
                 return_status: bool = False, timeout: float | None = None) -> Any:
        """Send ``sendbuf`` to ``dst`` and receive from ``src`` in one call that cannot deadlock
        (mpi4py's ``Sendrecv``): both halves are in flight together, so a ring where every
        rank sends right and receives from the left completes. Returns ``recvbuf``.

        ``src``/``recvtag`` default to any rank / any tag, as mpi4py's; ``recvbuf=None``
        allocates as ``recv`` does; ``PROC_NULL`` for either peer skips that half (an edge of a
        non-periodic grid), leaving ``recvbuf`` untouched. The buffers must not overlap.
        """
        return self._p2p.sendrecv(sendbuf, dst, recvbuf, src, sendtag=sendtag, recvtag=recvtag,
                                  dtype=dtype, return_status=return_status, timeout=timeout)

    # -- Python objects (``_objects.ObjectCollectives``) --------------------------------------
    def broadcast_object(self, obj: Any = None, root: int = 0, *, timeout: float | None = None) -> Any:
        """Every rank gets root's ``obj``."""
        return self._objects.broadcast_object(obj, root, timeout=timeout)

    def all_gather_object(self, obj: Any, *args: Any, timeout: float | None = None) -> Any:
        """A list of every rank's ``obj``, in rank order.

        torch's form ``all_gather_object(object_list, obj)`` fills ``object_list`` and returns
        None.
        """
        return self._objects.all_gather_object(obj, *args, timeout=timeout)

    def gather_object(self, obj: Any, root: Any = 0, *, timeout: float | None = None,
                      object_gather_list: list[Any] | None = None,
                      dst: int | None = None) -> list[Any] | None:
        """Like ``all_gather_object`` but only ``root`` gets the list.

        torch's form ``gather_object(obj, object_gather_list, dst=0)`` fills the list on ``dst``
        and returns None.
        """
        return self._objects.gather_object(obj, root, timeout=timeout,
                                           object_gather_list=object_gather_list, dst=dst)

    # -- torch.distributed's spellings (``_torch_names.TorchSpellings``) ----------------------
    def all_reduce(self, tensor: Any, op: "ReduceOp | str" = "sum", *, async_op: bool = False,
                   timeout: float | None = None) -> Work | None:
        """torch's ``all_reduce``: reduce ``tensor`` across ranks *in place*; None (or a Work).

        hpcdp's ``allreduce(x)`` returns the result instead and leaves ``x`` alone.
        """
        return self._torch.all_reduce(tensor, op, async_op=async_op, timeout=timeout)

    def all_gather_into_tensor(self, output_tensor: Any, input_tensor: Any, *,
                               async_op: bool = False, timeout: float | None = None) -> Work | None:
        """torch's ``all_gather_into_tensor``: rank i's input fills part i of ``output_tensor``
        (shaped ``(size * n, ...)`` or ``(size, n, ...)``); None (or a Work)."""
        return self._torch.all_gather_into_tensor(output_tensor, input_tensor, async_op=async_op,
                                                  timeout=timeout)

    def reduce_scatter_tensor(self, output: Any, input: Any, op: "ReduceOp | str" = "sum", *,
                              async_op: bool = False, timeout: float | None = None) -> Work | None:
        """torch's ``reduce_scatter_tensor``: reduce ``input`` (``size`` parts along axis 0)
        across ranks; part i lands in rank i's ``output``; None (or a Work)."""
        return self._torch.reduce_scatter_tensor(output, input, op, async_op=async_op,
                                                 timeout=timeout)

    def all_to_all_single(self, output: Any, input: Any, output_split_sizes: Any = None,
                          input_split_sizes: Any = None, *, async_op: bool = False,
                          timeout: float | None = None) -> Work | None:
        """torch's ``all_to_all_single`` with even splits: part j of ``input`` goes to rank j,
        part i of ``output`` came from rank i; None (or a Work). Uneven splits are not offered."""
        return self._torch.all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                             async_op=async_op, timeout=timeout)

    def broadcast_object_list(self, object_list: list[Any], src: int = 0, *,
                              timeout: float | None = None) -> None:
        """torch's ``broadcast_object_list``: every rank's ``object_list`` becomes ``src``'s."""
        return self._torch.broadcast_object_list(object_list, src, timeout=timeout)

    # -- sub-groups -------------------------------------------------------------------------
    @public
    def new_group(self, ranks: Sequence[int], *, name: str | None = None,
                  timeout: float | None = None) -> "ProcessGroup":
        """Collective over this group: a group of ``ranks`` (ranks of this group, in that order).

        Non-members get a group object too; its collectives raise ``ValueError``.
        """
        where = self._where("new_group")
        self._usable("new_group")
        # Exchange before judging, so a bad list on one rank makes every rank raise together.
        seen = self.all_gather_object(group_payload(ranks), timeout=timeout)
        ranks = group_ranks(seen, where, self.size)
        gname = name or f"{self.name}.{next(self._groups)}{ranks}"
        sub = self.backend.new_group(ranks)
        members = [self.ranks[r] for r in ranks]
        child = ProcessGroup(sub, name=gname, timeout=self.timeout if timeout is None else timeout,
                             members=members)
        return self._adopt(child)

    def _adopt(self, child: "ProcessGroup") -> "ProcessGroup":
        """A sub-group made here takes this group's checks and mode, and is shut down with it."""
        if self.debug == "detail":
            child.debug = "detail"
        child.deterministic = self._deterministic
        self._children = [c for c in self._children if c() is not None] + [weakref.ref(child)]
        return child

    @public
    def split(self, color: int | None, key: int | None = None, *, name: str | None = None,
              timeout: float | None = None) -> "ProcessGroup | None":
        """Collective over this group: one new group per ``color`` (mpi4py's ``Comm.Split``).

        Ranks that pass the same color form one group, ordered by ``key``, then by rank here.
        One exchange of every rank's ``(color, key)`` makes all the groups at once (MPI: one
        ``Comm.Split``), and every rank judges every rank's input, so a bad color or key on
        any rank raises on every rank.

        Args:
            color: an int >= 0; None (or ``hpcdp.UNDEFINED``, MPI's spelling): no group.
            key: this rank's place in its new group (default: its rank here).
            name: the new group's name; where several colors are in use, each group's name is
                ``f"{name}.{color}"`` (flight records tell groups apart by name).
            timeout: for the exchange and the new group (default: this group's).

        Returns:
            This rank's new group; None where ``color`` is None, as mpi4py returns
            ``COMM_NULL``. (``new_group`` gives its non-members a non-member group of the one
            group it makes; a rank without a color is in none of the groups ``split`` makes.)
        """
        where = self._where("split")
        self._usable("split")
        # Exchange before judging, so bad input on one rank makes every rank raise together.
        seen = self.all_gather_object(split_payload(color, key, self.rank), timeout=timeout)
        colors, keys, layout = split_layout(seen, where)
        n = next(self._groups)
        mine = colors[self.rank]
        sub = self.backend.split(mine, keys[self.rank], layout)
        if mine is None:
            return None
        ranks = layout[mine]
        if name is None:
            gname = f"{self.name}.{n}{ranks}"
        else:
            gname = f"{name}.{mine}" if len(layout) > 1 else name
        child = ProcessGroup(sub, name=gname, timeout=self.timeout if timeout is None else timeout,
                             members=[self.ranks[r] for r in ranks])
        return self._adopt(child)

    @public
    def cart(self, dims: Sequence[int], periods: bool | Sequence[bool] = False, *,
             reorder: bool = False, name: str | None = None,
             timeout: float | None = None) -> "CartGroup | None":
        """Collective over this group: its first ``prod(dims)`` ranks as a cartesian grid
        (mpi4py's ``Comm.Create_cart``), None on the others; see ``topology.cart_create``.

        Args:
            dims: ranks along each dim; ``hpcdp.dims_create(group.size, ndim)`` balances them.
            periods: whether each dim wraps around (one bool: all of them).
            reorder: accepted for mpi4py's signature; grid rank r is group rank r.
            name: the grid group's name.
            timeout: for the exchange and the grid group (default: this group's).
        """
        return cart_create(self, dims, periods, reorder=reorder, name=name, timeout=timeout)

    def shutdown(self) -> None:
        """Release the transport, sub-groups first; later calls raise ``HpcdpError``."""
        if self._closed:
            return
        for ref in self._children:
            child = ref()
            if child is not None:
                child.shutdown()
        self._closed = ("the group was shut down (hpcdp.finalize(), or its parent group's "
                        "shutdown); after hpcdp.init() make the group again")
        self._refresh_fast()
        if self.backend is not None:
            self.backend.shutdown()

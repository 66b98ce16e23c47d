"""``torch.distributed.init_process_group("hpcdp")``: torch's own DDP and FSDP2 over hpcdp.

Importing this module registers a ``torch.distributed`` backend named "hpcdp" (and an
``hpcdp://`` rendezvous, so no ``MASTER_ADDR`` is needed)::

    import torch.distributed as dist
    import hpcdp.torch_backend                      # registers "hpcdp"
    dist.init_process_group("hpcdp", init_method="hpcdp://")   # under mpirun or hpcdp-run
    model = torch.nn.parallel.DistributedDataParallel(model)

Each torch collective runs on hpcdp's default group (MPI under ``mpirun``, TCP under
``hpcdp-run``/``hpcdp.spawn``), so torch programs get hpcdp's per-call timeouts, its mismatch
checks (``HPCDP_DEBUG``) and its flight recorder. When hpcdp is already initialised with the
rank and size torch was given, its group is used; otherwise ``hpcdp.init()`` picks the backend
from the environment. torch's ``timeout=`` becomes the ``timeout=`` of every call on the group.

How torch is served, and what is not public in torch 2.13 (the version tested):

- The group is a Python subclass of ``torch.distributed.ProcessGroup`` registered with
  ``Backend.register_backend(..., extended_api=True)``, the way torch's own test suites plug
  in Python groups; torch then calls its methods from C++ as well as from Python. Names torch
  calls that are not public API, which a Python group must still define: ``_allgather_base`` and
  ``_reduce_scatter_base`` (C++'s names for all_gather_into_tensor / reduce_scatter_tensor; torch
  2.13's Python layer calls ``all_gather_single`` / ``reduce_scatter_single``), and
  ``_set_group_name``/``group_name``: torch keeps a group's name in its C++ backends, which a
  Python group has none of, so ``init_device_mesh`` (FSDP2) fails with "ProcessGroup name not
  set" unless the group keeps it itself.
- Each call returns a Python ``torch.distributed.Work`` subclass (public). The hpcdp call is
  posted at once (``async_op=True``) on the caller's thread, and one thread per torch group
  waits for the calls in the order they were posted and completes their futures: torch's DDP
  asks for a bucket's future as soon as it posts the allreduce and blocks on it (in C++) only at
  the end of backward, so nothing else would complete it, and this is what lets the buckets'
  allreduces overlap the rest of backward. ``destroy_process_group`` stops the thread.
- Tensors reach hpcdp as numpy views (``t.detach().numpy()``), so nothing is copied; in-place
  results land in the tensors torch passed. A non-contiguous tensor is reduced through a
  contiguous copy that is written back at ``wait()``. dtypes numpy lacks (bfloat16) go through
  hpcdp's tensor rules (``hpcdp._tensors``). CUDA tensors are refused (this backend serves CPU).
- Ops: SUM, AVG, PRODUCT, MIN, MAX (``hpcdp.ReduceOp``); the bitwise ops and PREMUL_SUM raise
  ``ValueError``. A sub-group (``new_group``) of every rank works; a sub-group of only some ranks
  raises ``NotImplementedError``: torch asks only the members to build it, while an hpcdp
  sub-group is made by every rank of its parent.
"""
from __future__ import annotations

import atexit
import datetime
import queue
import threading
import warnings
from typing import Any, Callable, Iterator, Sequence
from urllib.parse import parse_qs, urlparse

import numpy as np

try:
    import torch
    import torch.distributed as dist
    from torch.distributed.rendezvous import register_rendezvous_handler
except ImportError as _exc:  # torch is an optional extra (pip install hpcdp[torch])
    raise ImportError("hpcdp.torch_backend serves torch.distributed and needs torch "
                      "(pip install hpcdp[torch])") from _exc

from .comm.world import get_default_group, init, is_initialized
from .comm.group import ProcessGroup as HpcdpGroup
from .comm.work import Work as HpcdpWork
from .errors import CommTimeoutError, HpcdpError

__all__ = [
    "BACKEND_NAME", "TorchProcessGroup", "HpcdpTorchWork", "create_process_group", "register",
]

#: the name ``torch.distributed.init_process_group`` takes
BACKEND_NAME = "hpcdp"

_registered = False
_register_lock = threading.Lock()


def _seconds(timeout: Any) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return float(timeout)


def _op_name(op: Any, where: str) -> str:
    """hpcdp's name for a ``torch.distributed.ReduceOp``."""
    table = ((dist.ReduceOp.SUM, "sum"), (dist.ReduceOp.AVG, "mean"),
             (dist.ReduceOp.PRODUCT, "prod"), (dist.ReduceOp.MIN, "min"),
             (dist.ReduceOp.MAX, "max"))
    for top, name in table:
        if op == top:
            return name
    raise ValueError(f"{where}: torch.distributed.ReduceOp {op} is not offered by the hpcdp "
                     "backend (SUM, AVG, PRODUCT, MIN, MAX are)")


class _Pending:
    """One tensor's part of a call: the hpcdp Work in flight and what to do once it is done
    (copy a contiguous stand-in back into a non-contiguous tensor)."""

    __slots__ = ("work", "after")

    def __init__(self, work: HpcdpWork, after: Callable[[], None] | None = None) -> None:
        self.work, self.after = work, after

    def finish(self) -> None:
        self.work.wait()  # the call's own timeout= (torch's), else the group's
        if self.after is not None:
            self.after()


class _Completer:
    """The thread that completes a torch group's calls, in the order they were posted.

    torch's DDP asks for a call's future as soon as it is posted and later blocks in C++ on a
    future chained to it; nothing in torch would tell a Python group when to complete it, so
    this thread waits for each hpcdp call (with its timeout) and then completes its future.
    The user's thread meanwhile goes on (DDP: the rest of backward), which is how the buckets'
    allreduces overlap the backward pass. Started at the first call, stopped by ``close``.

    ``close`` waits for the thread (at most ``JOIN_SECONDS``), and so does an ``atexit`` hook
    for groups never destroyed: completing a future runs torch's callbacks inside torch's C++,
    and a daemon thread still there when the interpreter finalises is killed mid-C++, which
    aborts the whole process ("terminate called without an active exception") after the
    program has finished. Calls still queued at ``close`` fail at once rather than each
    waiting out its timeout (the group is gone; nobody can wait for them)."""

    #: how long ``close`` waits for the call the thread is completing
    JOIN_SECONDS = 10.0
    #: completers with a running thread (``close_all`` at exit, registered at the first start:
    #: after ``hpcdp.init``'s own exit handler, so it runs before hpcdp finalises)
    _live: "set[_Completer]" = set()
    _atexit_registered = False

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        #: the running thread, its queue and its stop flag; each thread has its own, so one
        #: still finishing after ``close`` never takes a later thread's calls
        self._thread: threading.Thread | None = None
        self._queue: queue.SimpleQueue[HpcdpTorchWork | None] = queue.SimpleQueue()
        self._stop = threading.Event()

    def submit(self, work: "HpcdpTorchWork") -> None:
        with self._lock:
            if self._thread is None:
                self._queue, self._stop = queue.SimpleQueue(), threading.Event()
                self._thread = threading.Thread(target=self._loop, args=(self._queue, self._stop),
                                                daemon=True, name=f"hpcdp-torch {self._name}")
                self._thread.start()
                with _register_lock:
                    _Completer._live.add(self)
                    if not _Completer._atexit_registered:
                        atexit.register(_Completer.close_all)
                        _Completer._atexit_registered = True
            self._queue.put(work)

    def on_thread(self) -> bool:
        """Whether the caller is this thread: a future's callbacks run here (torch runs them
        where the future is completed), and one that posts a call and waits for it (as
        PowerSGD's hook does) must not wait for this thread, which is busy running it."""
        return threading.current_thread() is self._thread

    @staticmethod
    def _loop(q: "queue.SimpleQueue[HpcdpTorchWork | None]", stop: threading.Event) -> None:
        while (work := q.get()) is not None:
            if stop.is_set():
                work._abandon(f"destroy_process_group() while {work._where} was in flight")
            else:
                work._complete()

    def close(self) -> None:
        with self._lock:
            thread, self._thread = self._thread, None  # a later call starts a new thread
            if thread is None:
                return
            self._stop.set()
            self._queue.put(None)
        with _register_lock:
            _Completer._live.discard(self)
        if thread is threading.current_thread():
            return  # destroyed from a future's callback: the loop ends after it
        thread.join(self.JOIN_SECONDS)
        if thread.is_alive():
            warnings.warn(f"hpcdp torch backend: {thread.name} is still completing a call "
                          f"{self.JOIN_SECONDS:g} s after destroy_process_group(); exiting now "
                          "may abort the process", RuntimeWarning, stacklevel=3)

    @staticmethod
    def close_all() -> None:
        """``atexit``: stop the threads of groups the program never destroyed."""
        with _register_lock:
            live = list(_Completer._live)
        for completer in live:
            completer.close()


class HpcdpTorchWork(dist.Work):
    """torch's ``Work`` for one call on the hpcdp backend, completed by its group's
    ``_Completer``: ``wait()`` returns once every hpcdp call it holds is done, or raises what
    one raised (a ``CommTimeoutError`` after the call's timeout, naming it); ``get_future()``
    is completed (or failed) then."""

    def __init__(self, parts: Sequence[_Pending], result: Any, op: str, where: str) -> None:
        super().__init__()
        self._parts = list(parts)
        self._result = result
        self._op, self._where = op, where
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._future: torch.futures.Future = torch.futures.Future()

    def _complete(self) -> None:
        if self._done.is_set():  # completed early, on the completer thread (``_work``)
            return
        try:
            for part in self._parts:
                part.finish()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter and to the future
            self._error = exc
            self._done.set()
            self._future.set_exception(exc)
            return
        finally:
            self._parts = []
        self._done.set()
        self._future.set_result(self._result)

    def _abandon(self, why: str) -> None:
        """Fail the call without waiting for it (its group was destroyed)."""
        if self._done.is_set():
            return
        self._parts = []
        self._error = HpcdpError(f"{self._where}: {why}; the call was abandoned")
        self._done.set()
        self._future.set_exception(self._error)

    def wait(self, timeout: Any = None) -> bool:
        """Block until done; raise what the call raised. ``timeout``: torch's ``Work.wait``
        argument, at most this long (else ``CommTimeoutError``; the call stays in flight)."""
        t = _seconds(timeout)
        if not self._done.wait(t if t else None):
            raise CommTimeoutError(f"{self._where}: wait(timeout={t:g} s) returned before the "
                                   "call completed (it stays in flight)")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> Any:
        return self._error

    def result(self) -> Any:
        self.wait()
        return self._result

    def get_future(self) -> Any:
        return self._future

    def __repr__(self) -> str:
        state = "failed" if self._error else ("done" if self._done.is_set() else "pending")
        return f"<HpcdpTorchWork {self._where} {state}>"


class TorchProcessGroup(dist.ProcessGroup):
    """A ``torch.distributed.ProcessGroup`` whose collectives are an hpcdp group's.

    Args:
        group: the hpcdp group (its rank and size are torch's).
        timeout: seconds each call may wait (torch's ``timeout=``); None: the group's.
    """

    def __init__(self, group: HpcdpGroup, timeout: float | None = None) -> None:
        super().__init__(group.rank, group.size)
        self.hpcdp_group = group
        self.timeout_s = timeout
        self._completer = _Completer(f"{group.name} rank {group.rank}")

    # -- identity --------------------------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND_NAME

    # torch keeps a group's name and description in its C++ backends, which a Python
    # group has none of; they are kept here instead (torch's own Python test groups do so)
    def _set_group_name(self, name: str) -> None:
        self._torch_name = name

    @property
    def group_name(self) -> str:
        return getattr(self, "_torch_name", self.hpcdp_group.name)

    def _set_group_desc(self, desc: str) -> None:
        self._torch_desc = desc

    @property
    def group_desc(self) -> str:
        return getattr(self, "_torch_desc", "")

    def __repr__(self) -> str:
        return f"<hpcdp TorchProcessGroup over {self.hpcdp_group!r}>"

    # -- helpers ---------------------------------------------------------------------------
    def _where(self, op: str) -> str:
        g = self.hpcdp_group
        return f"torch {op} on the hpcdp backend (rank {g.rank} of group {g.name})"

    def _kw(self) -> dict[str, Any]:
        return {"async_op": True, "timeout": self.timeout_s}

    def _view(self, t: Any, op: str) -> Any:
        """``t`` as hpcdp takes it: a numpy view when numpy has its dtype, else the
        tensor itself (hpcdp's tensor rules: bfloat16)."""
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{self._where(op)}: expected a torch.Tensor, got {type(t).__name__}")
        if t.device.type != "cpu":
            raise TypeError(f"{self._where(op)}: the hpcdp torch backend serves CPU tensors; "
                            f"got one on {t.device}")
        try:
            return t.detach().numpy()
        except (TypeError, RuntimeError):
            return t

    def _inplace(self, t: Any, op: str, call: Callable[[Any], Any]) -> _Pending:
        """``call(buf)`` posts an in-place hpcdp call on ``buf``, a contiguous view of ``t``
        or a stand-in written back into ``t`` when the call completes."""
        v = self._view(t, op)
        if isinstance(v, np.ndarray) and not v.flags.c_contiguous:
            buf = np.ascontiguousarray(v)

            def back() -> None:
                v[...] = buf
            return _Pending(call(buf), back)
        if not isinstance(v, np.ndarray) and not t.is_contiguous():
            tbuf = t.detach().contiguous()

            def back_t() -> None:
                with torch.no_grad():
                    t.copy_(tbuf)
            return _Pending(call(tbuf), back_t)
        return _Pending(call(v))

    def _work(self, op: str, parts: Sequence[_Pending], result: Any) -> HpcdpTorchWork:
        """The torch Work of ``parts``, posted already, handed to the completer thread."""
        work = HpcdpTorchWork(parts, result, op, self._where(op))
        if self._completer.on_thread():
            work._complete()  # posted by a future's callback: completed here, now
        else:
            self._completer.submit(work)
        return work

    def _op(self, opts: Any, op: str) -> str:
        return _op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, self._where(op))

    # -- collectives torch's DDP and FSDP2 call ---------------------------------------------
    def allreduce(self, tensors: Any, opts: Any = None) -> Any:
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        op, g = self._op(opts, "allreduce"), self.hpcdp_group
        return self._work("allreduce", [
            self._inplace(t, "allreduce", lambda b: g.allreduce(b, op, out=b, **self._kw()))
            for t in tensors], tensors)

    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> Any:
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: Any, opts: Any = None) -> Any:
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        root, g = (opts.rootRank if opts is not None else 0), self.hpcdp_group
        return self._work("broadcast", [
            self._inplace(t, "broadcast", lambda b: g.broadcast(b, root, out=b, **self._kw()))
            for t in tensors], tensors)

    def allgather(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> Any:
        """torch's list form: ``output_tensors[0][i]`` gets rank i's ``input_tensors[0]``."""
        where, g = self._where("allgather"), self.hpcdp_group
        if len(input_tensors) != 1 or len(output_tensors) != 1:
            raise ValueError(f"{where}: one input tensor per rank (got {len(input_tensors)} "
                             f"inputs, {len(output_tensors)} output lists)")
        outs, x = list(output_tensors[0]), input_tensors[0]
        if len(outs) != g.size:
            raise ValueError(f"{where}: output list has {len(outs)} tensors for {g.size} ranks")
        for o in outs:
            if o.shape != x.shape or o.dtype != x.dtype:
                raise ValueError(f"{where}: output {tuple(o.shape)} {o.dtype} differs from "
                                 f"input {tuple(x.shape)} {x.dtype}")
        stacked = torch.empty((g.size, *x.shape), dtype=x.dtype)

        def scatter_back() -> None:
            with torch.no_grad():
                for i, o in enumerate(outs):
                    o.copy_(stacked[i])
        w = g.all_gather(self._view(x, "allgather"), out=self._view(stacked, "allgather"),
                         **self._kw())
        return self._work("allgather", [_Pending(w, scatter_back)], output_tensors)

    def _post_all_gather(self, output: Any, input: Any) -> _Pending:  # noqa: A002
        g, op = self.hpcdp_group, "all_gather_into_tensor"
        n = input.numel()
        if output.numel() != n * g.size or output.dtype != input.dtype:
            raise ValueError(f"{self._where(op)}: output {tuple(output.shape)} {output.dtype} "
                             f"is not {g.size} x input {tuple(input.shape)} {input.dtype}")
        x = self._view(input.reshape(-1), op)
        return self._inplace(output, op, lambda b: g.all_gather(x, out=b.reshape(g.size, n),
                                                                 **self._kw()))

    def _post_reduce_scatter(self, output: Any, input: Any, opts: Any) -> _Pending:  # noqa: A002
        g, op = self.hpcdp_group, "reduce_scatter_tensor"
        n = output.numel()
        if input.numel() != n * g.size or output.dtype != input.dtype:
            raise ValueError(f"{self._where(op)}: input {tuple(input.shape)} {input.dtype} is "
                             f"not {g.size} x output {tuple(output.shape)} {output.dtype}")
        rop = self._op(opts, op)
        x = self._view(input.reshape(g.size, n), op)
        return self._inplace(output, op, lambda b: g.reduce_scatter(x, rop, out=b.reshape(1, n),
                                                                     **self._kw()))

    def _allgather_base(self, output: Any, input: Any, opts: Any = None) -> Any:  # noqa: A002
        """torch's ``all_gather_into_tensor``: rank i's input fills part i of ``output``."""
        return self._work("all_gather_into_tensor", [self._post_all_gather(output, input)], output)

    def _reduce_scatter_base(self, output: Any, input: Any, opts: Any = None) -> Any:  # noqa: A002
        """torch's ``reduce_scatter_tensor``: part i of the reduced ``input`` lands in
        rank i's ``output``."""
        return self._work("reduce_scatter_tensor",
                          [self._post_reduce_scatter(output, input, opts)], output)

    def allgather_into_tensor_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        return self._work("all_gather_into_tensor_coalesced", [
            self._post_all_gather(o, i) for o, i in zip(outputs, inputs, strict=True)], outputs)

    def reduce_scatter_tensor_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        return self._work("reduce_scatter_tensor_coalesced", [
            self._post_reduce_scatter(o, i, opts) for o, i in zip(outputs, inputs, strict=True)],
            outputs)

    # the names torch 2.13's Python layer calls; the underscored ones are its C++ names
    all_gather_single = _allgather_base
    reduce_scatter_single = _reduce_scatter_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def barrier(self, opts: Any = None) -> Any:
        return self._work("barrier", [_Pending(self.hpcdp_group.barrier(**self._kw()))], [])

    def shutdown(self) -> None:
        """Stop the completer thread (torch's ``destroy_process_group``); hpcdp's group stays:
        it is hpcdp's, not torch's."""
        self._completer.close()


def _hpcdp_group(rank: int, size: int, global_ranks: Sequence[int], where: str) -> HpcdpGroup:
    """The hpcdp group torch's ``rank``/``size`` describe: hpcdp's default group (started from
    the environment if need be) or, for a sub-group of every rank, a new one."""
    if not is_initialized():
        init()
    g = get_default_group()
    ranks = list(global_ranks) if global_ranks else list(range(size))
    if len(ranks) != g.size:
        raise NotImplementedError(
            f"{where}: a torch sub-group of {len(ranks)} of {g.size} ranks ({ranks}) is not "
            "offered by the hpcdp backend: torch asks only its members to build it, while an "
            "hpcdp sub-group is made by every rank of its parent (hpcdp.new_group)")
    if rank != (ranks.index(g.rank) if g.rank in ranks else -1) or size != g.size:
        raise HpcdpError(
            f"{where}: torch's rank {rank} of {size} is not hpcdp's rank {g.rank} of {g.size} "
            f"({g.backend.describe() if g.backend is not None else 'no backend'}); start torch "
            "with init_method='hpcdp://' or the same RANK/WORLD_SIZE hpcdp was started with")
    if ranks != list(range(g.size)):
        # every rank of the world in another order: a group of its own, made by all of them
        g = g.new_group(ranks)
    return g


def create_process_group(options: Any, backend_options: Any = None) -> Any:
    """torch's backend factory for "hpcdp" (``register_backend(..., extended_api=True)``):
    a ``TorchProcessGroup`` over hpcdp's group of the same ranks."""
    where = "init_process_group(backend='hpcdp')"
    timeout = _seconds(getattr(options, "timeout", None))
    g = _hpcdp_group(options.group_rank, options.group_size,
                     list(getattr(options, "global_ranks_in_group", []) or []), where)
    return TorchProcessGroup(g, timeout)


def _rendezvous(url: str, timeout: Any = None, **kwargs: Any) -> Iterator[tuple[Any, int, int]]:
    """``init_method="hpcdp://"``: rank and size from hpcdp (initialised from the environment
    if need be) and a process-local store: the hpcdp backend never reads torch's store."""
    if not is_initialized():
        init()
    g = get_default_group()
    query = {k: v[0] for k, v in parse_qs(urlparse(url).query).items()}
    for key, mine in (("rank", g.rank), ("world_size", g.size)):
        if key in query and int(query[key]) != mine:
            raise HpcdpError(f"init_method={url!r}: {key}={query[key]} but hpcdp's is {mine}")
    yield dist.HashStore(), g.rank, g.size
    raise RuntimeError("hpcdp:// rendezvous does not restart (hpcdp's group is fixed)")


def register() -> None:
    """Register the "hpcdp" backend and the ``hpcdp://`` rendezvous with torch (idempotent;
    importing this module does it)."""
    global _registered
    with _register_lock:
        if _registered:
            return
        dist.Backend.register_backend(BACKEND_NAME, create_process_group, extended_api=True,
                                      devices=["cpu"])
        register_rendezvous_handler("hpcdp", _rendezvous)
        _registered = True


register()

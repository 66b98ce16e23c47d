"""``Executor``: a map-style task farm over RPC, the ``concurrent.futures`` way.

Who calls what, in which order (as mpi4py's ``MPICommExecutor``, whose shape it copies):

1. every rank: ``Executor(root=0, ...)``. Collective when RPC is not running yet: it then starts
   RPC as ``worker{rank}`` (and ``hpcdp.init()`` first if needed) and stops it again at the end.
   With RPC already running it uses it and leaves it running. Every rank but the root builds its
   executors in the same order as the root does.
2. the root: ``with`` gives the executor; ``submit``/``map``/``starmap`` from any thread; leaving
   the block (or ``shutdown()``) waits for the tasks, then tells the other ranks the farm is over.
3. every other rank: ``with`` serves tasks until the root has shut the farm down and gives None
   (``serve()`` outside a ``with``). Serving needs nothing of the rank's main thread: RPC runs
   tasks on its own threads; the main thread only waits, and checks now and then that the root
   still answers.

Tasks are registered functions (``@rpc.register``) named on the wire by their registered name,
with msgpack-and-array arguments: a peer can only run what it exposed, and nothing is unpickled;
a lambda or closure is refused at ``submit`` with the reason. The farm's own functions
(``hpcdp.rpc.Executor.*``) run a registered function by name, which a plain RPC call could do
too: they add no power. Each worker rank runs one task at a time (as an MPI process would; a
task may release the GIL and use threads of its own) and holds at most ``max_in_flight`` (default
2), so the next task's arguments are already there when one ends but a slow worker never
collects a backlog: the root sends each task to whichever worker has fewest in flight as results
come back (load balancing, not a static round robin). A task sent behind a slow one waits for it.

Futures are ``concurrent.futures.Future``: their done-callbacks run on the executor's dispatcher
thread (keep them short; a callback may submit more tasks).

Errors: a task's exception comes back as its future's exception, a ``RemoteError`` (also an
instance of the builtin type it was: ``except ValueError`` works) with the remote traceback. A
worker that fails (noticed on simulated and TCP ranks; under MPI a dead rank is not noticed and
its tasks fail with their timeout, and ``mpirun`` ends the job anyway) fails only the tasks it
held, with ``PeerFailureError`` naming it; the farm goes on on the others.
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import itertools
import logging
import threading
import time
import weakref
from typing import Any, Callable, Iterable, Iterator

from ..comm import world as _world
from ..comm.validation import check_timeout
from ..errors import CommTimeoutError, HpcdpError, PeerFailureError
from . import _api, _context, _registry
from ._duty import before_blocking
from ._errors import RemoteError, remote_error
from ._future import Future as _RpcFuture

__all__ = ["Executor"]

LOG = logging.getLogger("hpcdp.rpc")

#: seconds between a serving worker's checks that the root still answers
HEARTBEAT = 5.0
#: how often a serving worker looks whether the root has left (simulated and TCP ranks)
_POLL = 0.2
_PREFIX = "hpcdp.rpc.Executor."
_MAX_NAME = 256


# -- what one rank keeps for its farms --------------------------------------------------------
class _Side:
    """Per agent: the lock that runs one task at a time, and which farms have ended."""

    __slots__ = ("turn", "cond", "led", "served", "done")

    def __init__(self) -> None:
        self.turn = threading.Lock()
        self.cond = threading.Condition()
        self.led = 0                       # farms this rank was the root of
        self.served: dict[int, int] = {}   # root -> farms this rank served for it
        self.done: dict[int, int] = {}     # root -> the last farm of that root that ended


_sides: "weakref.WeakKeyDictionary[Any, _Side]" = weakref.WeakKeyDictionary()
_sides_lock = threading.Lock()


def _side(agent: Any) -> _Side:
    with _sides_lock:
        side = _sides.get(agent)
        if side is None:
            side = _sides[agent] = _Side()
        return side


# -- what the root calls on the workers -------------------------------------------------------
def _target(name: Any) -> Callable[..., Any]:
    """The registered function a task names (what a plain RPC call could run, nothing more)."""
    if type(name) is not str or not name or len(name) > _MAX_NAME or name.startswith(_PREFIX):
        raise LookupError(f"Executor: {str(name)[:80]!r} does not name a task function")
    entry = _registry.lookup(name)
    if entry is None:
        raise LookupError(f"Executor: no function registered as {name!r} on this worker "
                          "(use @hpcdp.rpc.register)")
    return entry.obj


@contextlib.contextmanager
def _turn(wait: Any) -> Iterator[None]:
    """This rank's one task at a time; a task queued behind another waits at most ``wait`` s."""
    if not isinstance(wait, (int, float)) or isinstance(wait, bool) or not 0 < wait < 1e9:
        raise ValueError(f"Executor: bad wait {wait!r}")
    agent = _context.current("Executor")
    lock = _side(agent).turn
    if not lock.acquire(blocking=False):
        before_blocking()  # a serving duty this thread holds goes to another thread first
        if not lock.acquire(timeout=wait):
            raise CommTimeoutError(f"Executor: the task before this one on rank {agent.rank} "
                                   f"still ran after {wait:g} s; this one never started")
    try:
        yield
    finally:
        lock.release()


@_registry.register(name=_PREFIX + "run")
def _run(name: str, args: Any, kwargs: Any, wait: float) -> Any:
    fn = _target(name)
    if type(args) not in (tuple, list) or type(kwargs) is not dict or \
            any(type(k) is not str for k in kwargs):
        raise TypeError("Executor: malformed task arguments")
    with _turn(wait):
        return fn(*args, **kwargs)


@_registry.register(name=_PREFIX + "run_chunk")
def _run_chunk(name: str, arglists: Any, wait: float) -> list:
    fn = _target(name)
    if type(arglists) not in (tuple, list) or any(type(a) not in (tuple, list) for a in arglists):
        raise TypeError("Executor: malformed chunk")
    with _turn(wait):
        return [fn(*a) for a in arglists]


@_registry.register(name=_PREFIX + "done")
def _done(root: Any, seq: Any) -> None:
    """The root's farm ``seq`` is over: its workers stop serving it."""
    agent = _context.current("Executor")
    if type(root) is not int or not 0 <= root < agent.size or type(seq) is not int or seq < 1:
        raise ValueError("Executor: malformed end of farm")
    side = _side(agent)
    with side.cond:
        if seq > side.done.get(root, 0):
            side.done[root] = seq
        side.cond.notify_all()


@_registry.register(name=_PREFIX + "ping")
def _ping() -> bool:
    return True


class _Task:
    __slots__ = ("future", "name", "args", "kwargs", "chunk", "worker")

    def __init__(self, name: str, args: Any, kwargs: dict, chunk: bool) -> None:
        self.future: cf.Future = cf.Future()
        self.name, self.args, self.kwargs, self.chunk = name, args, kwargs, chunk
        self.worker = -1


class Executor(cf.Executor):
    """A pool of the other ranks' RPC workers for map-style task farms (``MPICommExecutor``).

    Every rank runs the same lines; the root gets the executor, the others serve until the
    root leaves its ``with`` block and get None::

        import hpcdp.rpc as rpc                        # from mpi4py import MPI
                                                       # from mpi4py.futures import MPICommExecutor
        @rpc.register                                  # (mpi4py: any picklable function)
        def simulate(k, seed): ...

        with rpc.Executor() as ex:                     # with MPICommExecutor(MPI.COMM_WORLD, root=0) as ex:
            if ex is not None:                         #     if ex is not None:
                out = list(ex.starmap(simulate, params))   #     out = list(ex.starmap(simulate, params))

    ``submit(fn, *args, **kwargs)`` returns a ``concurrent.futures.Future`` (``wait`` and
    ``as_completed`` work); ``map``/``starmap`` take ``timeout``, ``chunksize`` and
    ``unordered`` as mpi4py's do; ``shutdown(wait=True, cancel_futures=False)``.

    Args:
        root: the rank (or RPC worker name) that submits tasks; every other rank serves.
        include_root: the root runs tasks too (on its RPC threads, one at a time). A world of
            one rank always does: then the root is the only worker.
        max_in_flight: tasks a worker holds at once (one runs, the rest wait there); >= 1, and
            below ``init_rpc``'s ``num_worker_threads`` (16), whose threads the waiting ones hold.
        task_timeout: seconds from sending a task to its result (it may wait there behind the
            task before it) before its future fails with ``CommTimeoutError``; default: RPC's
            timeout (``init_rpc(rpc_timeout=)``, ``HPCDP_RPC_TIMEOUT``). Raise it for long tasks.
        serve_timeout: seconds a worker serves before giving up on the root
            (``CommTimeoutError``); default: for as long as the root answers (checked every
            ``HEARTBEAT`` seconds, each check waiting at most RPC's timeout).
    """

    def __init__(self, root: int | str = 0, *, include_root: bool = False,
                 max_in_flight: int = 2, task_timeout: float | None = None,
                 serve_timeout: float | None = None) -> None:
        if type(max_in_flight) is not int or max_in_flight < 1:
            raise ValueError(f"Executor: max_in_flight must be an int >= 1, got {max_in_flight!r}")
        if serve_timeout is not None:
            serve_timeout = check_timeout("Executor: serve_timeout", serve_timeout)
        if task_timeout is not None:
            task_timeout = check_timeout("Executor: task_timeout", task_timeout)
        self._owns = not _api.is_initialized()
        if self._owns:
            group = _world.group_or_default(None)  # hpcdp.init() unless done
            _api.init_rpc(f"worker{group.rank}")
        agent = _context.current("Executor")
        self._agent = agent
        try:
            self._root = agent.resolve(root, "Executor")
        except BaseException:
            if self._owns:
                _api.shutdown(graceful=False)
            raise
        self._is_root = agent.rank == self._root
        self._task_timeout = agent.timeout_of(task_timeout, "Executor: task_timeout")
        self._serve_timeout = serve_timeout
        self._max = max_in_flight
        side = _side(agent)
        with side.cond:
            if self._is_root:
                side.led += 1
                self._seq = side.led
            else:
                self._seq = side.served[self._root] = side.served.get(self._root, 0) + 1
        others = [r for r in range(agent.size) if r != self._root]
        self._workers = others + [self._root] if include_root or not others else others
        self._cv = threading.Condition()
        self._queue: collections.deque[_Task] = collections.deque()
        self._arrived: list[tuple[_Task, _RpcFuture]] = []
        self._live = list(self._workers)
        self._inflight = {w: 0 for w in self._workers}
        self._next = 0
        self._closing = False
        self._rpc_on_thread = False
        self._ended = False      # the workers were told, RPC stopped if ours
        self._end_error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if self._is_root:
            self._thread = threading.Thread(target=self._loop, daemon=True,
                                            name=f"hpcdp-rpc{agent.rank}-executor")
            self._thread.start()

    # -- the context manager --------------------------------------------------------------------
    def __enter__(self) -> Any:
        """The executor on the root; on the other ranks serve until the farm ends, then None."""
        if self._is_root:
            return self
        self.serve()
        return None

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if self._is_root:
            # an error in the block should surface now, not after every queued task has run
            self.shutdown(wait=True, cancel_futures=exc_type is not None)
        return False

    @property
    def is_root(self) -> bool:
        return self._is_root

    @property
    def workers(self) -> list[str]:
        """The RPC names of the workers still taking tasks."""
        with self._cv:
            return [self._agent.names[w] for w in self._live]

    # -- the root's side ------------------------------------------------------------------------
    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> cf.Future:
        """Run registered ``fn(*args, **kwargs)`` on a worker; a ``concurrent.futures.Future``."""
        name = self._name_of(fn, "submit")
        return self._put(_Task(name, args, kwargs, False))

    def map(self, fn: Any, *iterables: Iterable[Any], timeout: float | None = None,
            chunksize: int = 1, unordered: bool = False) -> Iterator[Any]:
        """``fn(*args)`` for ``args`` in ``zip(*iterables)``, results in order (``unordered``:
        as they complete), like ``MPIPoolExecutor.map``.

        Args:
            timeout: seconds from this call after which the next result not yet in raises
                ``TimeoutError`` (the tasks not started are cancelled).
            chunksize: tasks sent to a worker in one message (fewer round trips for short
                tasks); an error in one fails its chunk.
            unordered: yield results as they arrive rather than in input order.
        """
        return self.starmap(fn, zip(*iterables), timeout=timeout, chunksize=chunksize,
                            unordered=unordered)

    def starmap(self, fn: Any, iterable: Iterable[Any], timeout: float | None = None,
                chunksize: int = 1, unordered: bool = False) -> Iterator[Any]:
        """``fn(*args)`` for ``args`` in ``iterable`` (``MPIPoolExecutor.starmap``); see ``map``."""
        name = self._name_of(fn, "starmap")
        if type(chunksize) is not int or chunksize < 1:
            raise ValueError(f"Executor.starmap: chunksize must be an int >= 1, got {chunksize!r}")
        end = None if timeout is None else time.monotonic() + timeout
        if chunksize == 1:
            tasks = [_Task(name, tuple(args), {}, False) for args in iterable]
        else:
            it = iter(iterable)
            tasks = []
            while chunk := [tuple(a) for a in itertools.islice(it, chunksize)]:
                tasks.append(_Task(name, chunk, {}, True))
        futs = [self._put(t) for t in tasks]
        return _results(futs, end, chunksize > 1, unordered)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """End the farm: no more tasks; the queued ones run unless ``cancel_futures``.

        Once the last task is done the workers stop serving (and RPC stops if the executor
        started it). ``wait``: return only then; else at once. A no-op on the other ranks.
        """
        if not self._is_root:
            return
        if threading.current_thread() is self._thread:
            wait = False  # from a done-callback: the dispatcher cannot wait for itself
        with self._cv:
            if not self._closing:
                self._rpc_on_thread = not wait
            self._closing = True
            dropped = list(self._queue) if cancel_futures else []
            if cancel_futures:
                self._queue.clear()
            self._cv.notify_all()
        for t in dropped:
            t.future.cancel()
        if not wait:
            return
        assert self._thread is not None
        self._thread.join()
        if self._owns and not self._rpc_on_thread and self._agent.state != "closed":
            with _context.using(self._agent):
                _api.shutdown()
        if self._end_error is not None:
            err, self._end_error = self._end_error, None
            raise err

    def _name_of(self, fn: Any, op: str) -> str:
        if not self._is_root:
            raise HpcdpError(f"Executor.{op} on rank {self._agent.rank}: only the root (rank "
                             f"{self._root}) submits tasks; here the executor serves them")
        if isinstance(fn, str):
            if not fn or len(fn) > _MAX_NAME or fn.startswith(_PREFIX):
                raise ValueError(f"Executor.{op}: bad function name {fn[:60]!r}")
            return fn
        name = _registry.name_of(fn)
        if name is None:
            raise TypeError(f"Executor.{op}: {getattr(fn, '__qualname__', repr(fn))} is not "
                            "registered; define it at module level and decorate it with "
                            "@hpcdp.rpc.register (tasks travel by name, never pickled)")
        return name

    def _put(self, task: _Task) -> cf.Future:
        with self._cv:
            if self._closing:
                raise RuntimeError("cannot schedule new futures after shutdown")
            if self._live:
                self._queue.append(task)
                self._cv.notify_all()
                return task.future
        task.future.set_exception(self._no_workers())
        return task.future

    def _no_workers(self) -> PeerFailureError:
        return PeerFailureError(f"Executor on rank {self._agent.rank}: no worker is left (all of "
                                f"{[self._agent.names[w] for w in self._workers]} failed)",
                                peers=self._workers)

    # -- the dispatcher thread ------------------------------------------------------------------
    def _loop(self) -> None:
        with _context.using(self._agent):
            try:
                while True:
                    with self._cv:
                        while True:
                            arrived, self._arrived = self._arrived, []
                            sends = self._pick()
                            drained = (self._closing and not self._queue
                                       and not any(self._inflight.values()))
                            if arrived or sends or drained:
                                break
                            self._cv.wait()
                    for task, rfut in arrived:
                        self._complete(task, rfut)
                    for task in sends:
                        self._send(task)
                    if drained and not arrived and not sends:
                        break
            except BaseException as exc:  # noqa: BLE001 - a bug: fail what is left, then end
                LOG.exception("hpcdp.rpc: Executor on rank %d: dispatcher failed",
                              self._agent.rank)
                self._fail_queued(HpcdpError(f"Executor on rank {self._agent.rank}: its "
                                             f"dispatcher failed: {exc!r}"))
            finally:
                self._end()

    def _pick(self) -> list[_Task]:
        """Under the lock: queued tasks for workers with a free slot (fewest in flight first)."""
        out = []
        live, n = self._live, len(self._live)
        while self._queue and n:
            best = -1
            for i in range(n):
                w = live[(self._next + i) % n]
                if self._inflight[w] < self._max and \
                        (best < 0 or self._inflight[w] < self._inflight[best]):
                    best = w
            if best < 0:
                break
            task = self._queue.popleft()
            if task.future.cancelled():
                continue
            self._next = (live.index(best) + 1) % n
            task.worker = best
            self._inflight[best] += 1
            out.append(task)
        return out

    def _send(self, task: _Task) -> None:
        if not task.future.set_running_or_notify_cancel():
            self._release(task, lost=False)
            return
        wait = self._task_timeout
        try:
            if task.chunk:
                call, body = _run_chunk, (task.name, task.args, wait)
            else:
                call, body = _run, (task.name, task.args, task.kwargs, wait)
            rfut = self._agent.calls.call("rpc_async", task.worker, call, body, None, wait)
        except BaseException as exc:  # noqa: BLE001 - the task's outcome
            self._release(task, lost=False)
            task.future.set_exception(self._error(task, exc, False))
            return
        rfut._on_done(lambda f, t=task: self._arrive(t, f))

    def _arrive(self, task: _Task, rfut: _RpcFuture) -> None:
        """On the thread that completed the call (quick, no blocking): to the dispatcher."""
        with self._cv:
            self._arrived.append((task, rfut))
            self._cv.notify_all()

    def _release(self, task: _Task, lost: bool) -> list[_Task]:
        """The task's worker slot is free again; tasks orphaned if no worker is left."""
        with self._cv:
            self._inflight[task.worker] -= 1
            if lost and task.worker in self._live:
                self._live.remove(task.worker)
                self._next = 0
            orphans = list(self._queue) if not self._live else []
            if orphans:
                self._queue.clear()
            return orphans

    def _complete(self, task: _Task, rfut: _RpcFuture) -> None:
        err = rfut.exception()
        lost = isinstance(err, PeerFailureError) and task.worker in self._agent.lost
        orphans = self._release(task, lost)
        if err is None:
            task.future.set_result(rfut.value())
        else:
            task.future.set_exception(self._error(task, err, lost))
        task.args = task.kwargs = None
        if orphans:
            self._fail_tasks(orphans, self._no_workers())

    def _fail_queued(self, err: BaseException) -> None:
        with self._cv:
            tasks = list(self._queue)
            self._queue.clear()
            self._closing = True
        self._fail_tasks(tasks, err)

    @staticmethod
    def _fail_tasks(tasks: list[_Task], err: BaseException) -> None:
        for t in tasks:
            if t.future.set_running_or_notify_cancel():
                t.future.set_exception(err)

    def _error(self, task: _Task, err: BaseException, lost: bool) -> BaseException:
        """The task's exception, saying which task and which worker."""
        w = task.worker
        where = f"{self._agent.names[w]} (rank {w})"
        what = (f"Executor task {task.name}()" if not task.chunk else
                f"Executor chunk of {len(task.args)} {task.name}() tasks")
        if isinstance(err, RemoteError):
            msg = str(err.args[0]) if err.args else ""
            i = msg.find(": remote ")
            return remote_error(f"{what} on {where}: {msg[i + 2:] if i >= 0 else msg}",
                                err.remote_type, err.remote_traceback)
        if lost:
            return PeerFailureError(f"{what} was running on {where}, which failed "
                                    f"({self._agent.lost.get(w, err)}); the farm goes on "
                                    "without it", peers=[w])
        if isinstance(err, PeerFailureError):
            return PeerFailureError(f"{what} on {where}: {err}", peers=list(err.peers))
        if isinstance(err, CommTimeoutError):
            return CommTimeoutError(f"{what} on {where}: {err}")
        return err

    def _end(self) -> None:
        """Tell the other ranks the farm is over (and stop RPC if ours and no one waits)."""
        if self._ended:
            return
        self._ended = True
        a = self._agent
        try:
            futs = [a.calls.call("rpc_async", r, _done, (self._root, self._seq), None, None)
                    for r in range(a.size) if r != self._root and r not in a.lost]
            for f in futs:
                try:
                    f.wait()
                except PeerFailureError:
                    pass  # a worker that is gone needs no telling
            if self._owns and self._rpc_on_thread:
                _api.shutdown()
        except BaseException as exc:  # noqa: BLE001 - raised by shutdown(wait=True)
            if self._rpc_on_thread:
                LOG.error("hpcdp.rpc: Executor on rank %d: ending the farm failed: %s",
                          a.rank, exc)
            self._end_error = exc

    # -- the workers' side ----------------------------------------------------------------------
    def serve(self) -> None:
        """On a rank other than the root: serve tasks until the root ends this farm.

        Raises ``PeerFailureError`` if the root fails (simulated and TCP ranks notice at once)
        and ``CommTimeoutError`` if it stops answering (checked every ``HEARTBEAT`` s, each
        check waiting at most RPC's timeout) or past this executor's ``serve_timeout``.
        """
        if self._is_root:
            raise HpcdpError(f"Executor.serve on rank {self._agent.rank}: this is the root; "
                             "submit tasks here instead")
        a, root = self._agent, self._root
        name = f"{a.names[root]} (rank {root})"
        side = _side(a)
        t0 = time.monotonic()
        ping_at = t0 + HEARTBEAT
        ok = False
        try:
            while True:
                with side.cond:
                    if side.done.get(root, 0) >= self._seq:
                        break
                    side.cond.wait(_POLL)
                    if side.done.get(root, 0) >= self._seq:
                        break
                now = time.monotonic()
                if root in a.lost:
                    raise PeerFailureError(f"Executor on rank {a.rank}: the root {name} failed "
                                           f"while this rank served its farm: {a.lost[root]}",
                                           peers=[root])
                if self._serve_timeout is not None and now - t0 > self._serve_timeout:
                    raise CommTimeoutError(f"Executor on rank {a.rank}: the farm of {name} "
                                           f"did not end within serve_timeout="
                                           f"{self._serve_timeout:g} s")
                if now >= ping_at:
                    self._ping(name)
                    ping_at = time.monotonic() + HEARTBEAT
            ok = True
        finally:
            if self._owns and a.state != "closed":
                with _context.using(a):
                    _api.shutdown(graceful=ok)

    def _ping(self, name: str) -> None:
        try:
            self._agent.calls.call("rpc_sync", self._root, _ping, None, None, None)
        except CommTimeoutError as exc:
            raise CommTimeoutError(f"Executor on rank {self._agent.rank}: the root {name} no "
                                   f"longer answers while this rank serves its farm "
                                   f"({exc})") from None

    def __repr__(self) -> str:
        role = "root" if self._is_root else f"worker of rank {self._root}"
        return f"<hpcdp.rpc.Executor {role}, workers {self._workers}>"


def _results(futs: list[cf.Future], end: float | None, chunked: bool,
             unordered: bool) -> Iterator[Any]:
    """``map``'s iterator: results in order (or as completed); cancels the rest when left."""
    def left() -> float | None:
        return None if end is None else end - time.monotonic()

    try:
        if unordered:
            for f in cf.as_completed(futs, timeout=left()):
                if chunked:
                    yield from f.result()
                else:
                    yield f.result()
        else:
            futs.reverse()  # popped as they are yielded: results are not kept twice
            while futs:
                r = futs[-1].result(left())
                futs.pop()
                if chunked:
                    yield from r
                else:
                    yield r
                del r
    finally:
        for f in futs:
            f.cancel()

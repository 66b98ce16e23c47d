"""The RPC agent of one worker: names, requests and replies, serving, timeouts, failures.

Threads and what they may do:

* transport threads call ``_deliver``: they decode replies and complete futures, update RRef
  state, and hand everything else to the pool or the control thread, except that a thread
  holding a serving duty runs short callees itself (``_duty``: no hand-off on a small call's
  path). They never block in a send while holding their duty.
* the pool (``num_worker_threads``) runs the other callee functions and sends their replies;
* the control thread sends protocol messages and small replies, in order; the timer expires
  deadlines and watches inline callees (``_housekeeping``). ``RRef.__del__`` only queues work.
* a caller waiting for a reply reads it itself where the transport allows (``Future``).

The agent keeps what every side shares: names, the table of pending calls and their deadlines,
message counts, the queue budget, sending and dispatch. It holds one component per concern,
each given the agent in its constructor and listing what it uses of it: ``calls``
(``_calls.Calls``: the caller's side), ``serving`` (``_serve.Serving``: the request handlers),
``house`` (``_housekeeping.Housekeeping``: the control thread, the timer, inline callees),
``rrefs`` (``_rref.RRefManager``) and ``coord`` (``_shutdown.Coordinator``).
"""
from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
import traceback
from typing import Any, Callable, NamedTuple, Sequence

import msgpack
import numpy as np

from ..errors import CommTimeoutError, HpcdpError, PeerFailureError, ProtocolError
from .._config import SETTINGS, setting
from ..comm.validation import check_timeout
from . import _protocol as P
from ._calls import Calls
from ._channel import Channel
from ._codec import Limits, decode, encode
from ._duty import Lent
from ._errors import remote_error
from ._future import Future
from ._housekeeping import Housekeeping
from ._pool import Pool
from ._rref import RRefManager
from ._serve import Serving
from ._shutdown import Coordinator
from ._wire import MAX_ENVELOPE, Frame, pack_envelope, unpack_envelope

__all__ = ["Agent", "WorkerInfo"]

LOG = logging.getLogger("hpcdp.rpc")

#: default byte budget of the requests a worker holds (``HPCDP_RPC_QUEUE_BYTES``)
QUEUE_BYTES = SETTINGS["HPCDP_RPC_QUEUE_BYTES"].default
#: what a request costs beyond its message (its task, closures and bookkeeping)
QUEUE_OVERHEAD = 512


class WorkerInfo(NamedTuple):
    """A worker's name and id (its rank in the RPC group)."""

    name: str
    id: int


class _Pending:
    __slots__ = ("fut", "dst", "what", "timeout", "control")

    def __init__(self, fut: Future, dst: int, what: str, timeout: float, control: bool) -> None:
        self.fut, self.dst, self.what, self.timeout, self.control = fut, dst, what, timeout, control


class Agent:
    """One worker's RPC endpoint; see the module docstring for its threads and components."""

    def __init__(self, name: str, group: Any, *, timeout: float, num_worker_threads: int,
                 limits: Limits, init_timeout: float) -> None:
        self.group, self.rank, self.size = group, group.rank, group.size
        self.name, self.limits, self.default_timeout = name, limits, timeout
        rows = exchange_bytes(group, msgpack.packb([name, limits.as_list()]), init_timeout)
        self.names: list[str] = []
        self.peer_limits: list[Limits] = []
        for r, raw in enumerate(rows):
            n, lim = msgpack.unpackb(raw)
            self.names.append(n)
            self.peer_limits.append(Limits.from_list(lim))
        dups = sorted({n for n in self.names if self.names.count(n) > 1})
        if dups:
            raise ValueError(f"init_rpc (rank {self.rank}): worker names must be unique; "
                             f"{dups} used by ranks "
                             f"{[r for r, n in enumerate(self.names) if n in dups]}")
        self.index = {n: r for r, n in enumerate(self.names)}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._deadlines: list[tuple[float, int]] = []
        self.sent = [0] * self.size
        self.recv = [0] * self.size
        self.lost: dict[int, str] = {}
        # requests received and not yet answered hold their messages: a byte budget bounds
        # them (a count alone would let 1024 calls of 1 GiB in); past it, "overloaded"
        self.queue_budget = setting("HPCDP_RPC_QUEUE_BYTES")
        self._qlock = threading.Lock()
        self.queued_bytes = 0
        self.queued_peak = 0  # the most ever held at once: for tests and debugging
        self.state = "running"  # running -> closing (GO seen) -> closed
        self.rrefs = RRefManager(self)
        self._enc_hooks = [self.rrefs.encode_hook(r) for r in range(self.size)]
        self._dec_hooks = [self.rrefs.decode_hook(r) for r in range(self.size)]
        self.house = Housekeeping(self)  # before the transport: its threads may queue work
        self.serving = Serving(self)
        self.calls = Calls(self)
        srv = self.serving
        self._handlers: dict[int, Callable[[int, int, list, Frame, bool], Any]] = {
            P.RESULT: self._on_reply, P.ERROR: self._on_reply, P.CRESULT: self._on_reply,
            P.CALL: srv.on_call, P.REMOTE: srv.on_remote, P.RCALL: srv.on_rcall,
            P.FETCH: srv.on_fetch, P.FORK: self._on_fork, P.ACCEPT: self._on_accept,
            P.DELETE: self._on_delete, P.READY: self._on_coord, P.PROBE: self._on_coord,
            P.GO: self._on_coord,
        }
        self.coord = Coordinator(self)  # graceful shutdown
        self.transport = Channel(group, self.limits, self._deliver, self._lost, timeout)
        try:
            group.barrier(timeout=init_timeout)  # every peer's channel exists before traffic
        except BaseException:
            self.transport.close(False, 0.0)
            raise
        # how a caller waiting for a reply from each peer reads it itself
        self._directs = [None if r == self.rank else self.transport.direct(r)
                         for r in range(self.size)]
        self.pool = Pool(f"hpcdp-rpc{self.rank}-pool", num_worker_threads,
                         max(1024, 64 * num_worker_threads), self, progress=self.transport)
        self.house.start(polled=self.transport)

    # -- naming -----------------------------------------------------------------------------
    def worker_info(self, rank: int) -> WorkerInfo:
        return WorkerInfo(self.names[rank], rank)

    def resolve(self, to: Any, op: str) -> int:
        if isinstance(to, WorkerInfo):
            to = to.id
        if isinstance(to, str):
            r = self.index.get(to)
            if r is None:
                raise ValueError(f"rpc.{op} on rank {self.rank}: no worker named {to!r} "
                                 f"(workers: {self.names})")
            return r
        if isinstance(to, (int, np.integer)) and not isinstance(to, bool) and 0 <= to < self.size:
            return int(to)
        raise ValueError(f"rpc.{op} on rank {self.rank}: 'to' must be a worker name, a rank in "
                         f"[0, {self.size}) or a WorkerInfo, got {to!r}")

    def timeout_of(self, timeout: float | None, op: str = "rpc") -> float:
        """A call's timeout: the default, or a finite number of seconds > 0 (``check_timeout``)."""
        if timeout is None:
            return self.default_timeout
        return check_timeout(f"{op} on rank {self.rank}: timeout={timeout!r}", timeout,
                             named=True)

    def what(self, op: str, target: str, dst: int) -> str:
        return f"{op} {target} to {self.names[dst]} (rank {dst}) from rank {self.rank}"

    # -- sending requests -------------------------------------------------------------------
    def request(self, dst: int, kind: int, fields: Sequence[Any], body: Any, what: str,
                timeout: float, control: bool = False) -> Future:
        """Send a request; its ``Future`` completes with the reply, an error or the deadline."""
        state = self.state
        if state != "running" and (state == "closed" or not control):
            raise HpcdpError(f"{what}: RPC has shut down on this worker")
        fut = Future(what, self)
        if dst in self.lost:
            fut.set_exception(PeerFailureError(f"{what}: {self.names[dst]} is gone "
                                               f"({self.lost[dst]})", peers=[dst]))
            return fut
        try:
            enc = encode(body, self.peer_limits[dst], self._enc_hooks[dst])
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{what}: {exc}") from None
        mid = next(self._ids)
        env = pack_envelope([kind, mid, *fields])
        if len(env) > MAX_ENVELOPE:
            raise ValueError(f"{what}: its names take {len(env)} bytes; at most {MAX_ENVELOPE} "
                             "fit in a request (a function or method name too long)")
        deadline = time.monotonic() + timeout
        fut._deadline, fut._mid = deadline, mid
        fut._direct = self._directs[dst]
        with self._lock:
            self._pending[mid] = _Pending(fut, dst, what, timeout, control)
            heapq.heappush(self._deadlines, (deadline, mid))
        if enc.rrefs:
            self.rrefs.commit(enc.rrefs)
        try:
            self._send(dst, kind, env, enc.body, enc.buffers, deadline)
        except BaseException as exc:  # noqa: BLE001 - delivered through the future
            with self._lock:
                self._pending.pop(mid, None)
            if enc.rrefs:
                self.rrefs.rollback(enc.rrefs)
            if not isinstance(exc, HpcdpError):
                exc = PeerFailureError(f"{what}: send failed ({type(exc).__name__}: {exc})",
                                       peers=[dst])
            elif what not in str(exc):
                exc = type(exc)(f"{what}: {exc}")
            fut.set_exception(exc.with_traceback(None))  # no frame (with fut) in its traceback
        return fut

    def internal(self, dst: int, kind_name: str, fields: Sequence[Any], body: Any = None,
                 timeout: float | None = None) -> Future:
        """A protocol request (FORK, ACCEPT, DELETE, READY, ...); failures are logged."""
        kind = P.BY_NAME[kind_name]
        what = f"rpc {kind_name} to rank {dst} from rank {self.rank}"
        try:
            fut = self.request(dst, kind, fields, body, what, self.timeout_of(timeout),
                               control=kind in P.CONTROL)
        except HpcdpError as exc:
            fut = Future(what, self)
            fut.set_exception(exc)
        fut._on_done(_log_failure)
        return fut

    def _send(self, dst: int, kind: int, env: bytes, body: bytes,
              buffers: Sequence[memoryview], deadline: float | None = None) -> None:
        counted = kind in P.COUNTED
        if dst == self.rank:  # loopback: copied like any message, delivered on this thread
            frame = Frame(env, bytes(body), [np.frombuffer(b, np.uint8).copy() for b in buffers])
            if counted:
                with self._lock:
                    self.sent[dst] += 1
            self._deliver(dst, frame, False)
            return
        self.transport.send(dst, env, body, buffers, deadline)
        if counted:
            with self._lock:
                self.sent[dst] += 1

    def reply(self, dst: int, mid: int, value: Any, kind: int = P.RESULT) -> None:
        """Send a result (from the pool or the control thread); an unsendable one becomes an error."""
        try:
            enc = encode(value, self.peer_limits[dst], self._enc_hooks[dst])
        except (TypeError, ValueError) as exc:
            return self.reply_error(dst, mid, type(exc)(f"the result cannot be sent back: {exc}"))
        if enc.rrefs:
            self.rrefs.commit(enc.rrefs)
        try:
            self._send(dst, kind, pack_envelope([kind, mid]), enc.body, enc.buffers)
        except Exception as exc:  # noqa: BLE001 - the caller is gone; nothing else to tell
            if enc.rrefs:
                self.rrefs.rollback(enc.rrefs)
            LOG.debug("hpcdp.rpc: rank %d could not reply to rank %d: %s", self.rank, dst, exc)

    def reply_error(self, dst: int, mid: int, exc: BaseException, tb: str | None = None) -> None:
        if tb is None:
            tb = "".join(traceback.format_exception(exc)) if exc.__traceback__ else ""
        name = getattr(exc, "remote_type", None) or type(exc).__name__  # nested: the origin's
        # the texts must fit the caller's limits, or the caller would only see its timeout
        cap = max(0, min(P.MAX_ERROR_TEXT, self.peer_limits[dst].max_body_bytes // 4 - 64))
        msg = str(exc)
        for body in ((name[:200], msg[:cap], tb[-cap:] if cap else ""),
                     (name[:40], msg[:40], "")):
            try:
                enc = encode(body, self.peer_limits[dst])
                self._send(dst, P.ERROR, pack_envelope([P.ERROR, mid]), enc.body, enc.buffers)
                return
            except ValueError:
                continue  # still too large for the caller: the short form
            except Exception as err:  # noqa: BLE001 - the caller is gone
                LOG.debug("hpcdp.rpc: rank %d could not send an error to rank %d: %s",
                          self.rank, dst, err)
                return

    def error_from(self, err: tuple[str, str, str], what: str) -> BaseException:
        name, msg, tb = err
        return remote_error(f"{what}: remote {name}: {msg}", name, tb)

    # -- the control thread and inline callees (``Housekeeping``) ---------------------------
    # ``Pool`` and ``Lent`` (``_duty``) call these on the agent they were given
    def control(self, fn: Callable[[], None], quiet: bool = False) -> None:
        """Run ``fn`` on the control thread (lock-free: safe from ``__del__``)."""
        self.house.control(fn, quiet)

    def lent_started(self, lent: Lent) -> None:
        self.house.lent_started(lent)

    def lent_ended(self, lent: Lent, seconds: float) -> None:
        self.house.lent_ended(lent, seconds)

    def requeue(self, lent: Lent) -> None:
        """An inline task its serving thread will not run after all: to the pool."""
        self.house.requeue(lent)

    # -- receiving --------------------------------------------------------------------------
    def _deliver(self, src: int, frame: Frame, may_inline: bool = False) -> Any:
        try:
            return self._dispatch(src, frame, may_inline)
        except Exception:  # noqa: BLE001 - a bug must not stop a transport thread
            LOG.exception("hpcdp.rpc: rank %d: failed to handle a message from rank %d",
                          self.rank, src)
            return None

    def _dispatch(self, src: int, frame: Frame, may_inline: bool) -> Any:
        try:
            fields = unpack_envelope(frame.env)
        except ProtocolError as exc:
            LOG.warning("hpcdp.rpc: rank %d dropped a message from rank %d: %s", self.rank, src,
                        exc)
            return None
        kind, mid = fields[0], fields[1]
        if kind in P.COUNTED:
            with self._lock:
                self.recv[src] += 1
        handler = self._handlers.get(kind)
        if handler is None:
            LOG.warning("hpcdp.rpc: rank %d: unknown message kind %d from rank %d", self.rank,
                        kind, src)
            return None
        if frame.refused is not None and kind in P.REQUESTS:
            self.control(lambda: self.reply_error(src, mid, ProtocolError(
                f"rank {self.rank} refused the request: {frame.refused}"), ""))
            return None
        if kind in P.QUEUED:
            over = self._enqueue(frame)
            if over is not None:
                self.discard(src, frame)
                self.control(lambda: self.reply_error(src, mid, HpcdpError(
                    f"{self.names[self.rank]} (rank {self.rank}) is overloaded: {over}; "
                    "the request was not run (retry later)"), ""))
                return None
        try:
            return handler(src, mid, fields, frame, may_inline)
        except Exception as exc:  # noqa: BLE001 - answered, and the worker serves on
            if isinstance(exc, ProtocolError):
                LOG.warning("hpcdp.rpc: rank %d refused a %s from rank %d: %s", self.rank,
                            P.NAMES.get(kind, kind), src, exc)
            else:
                LOG.exception("hpcdp.rpc: rank %d: failed to handle a %s from rank %d",
                              self.rank, P.NAMES.get(kind, kind), src)
            if kind in P.REQUESTS:
                self.unqueue(frame)
                self.discard(src, frame)
                self.control(lambda e=exc: self.reply_error(src, mid, e, ""))
            return None

    def _enqueue(self, frame: Frame) -> str | None:
        """Charge a request's bytes to the queue budget; why not, if that would pass it.

        A request larger than the whole budget is let in only when nothing else is held, so
        one such call still works and at most one is ever held."""
        n = frame.nbytes + QUEUE_OVERHEAD
        with self._qlock:
            held = self.queued_bytes
            if held and held + n > self.queue_budget:
                return (f"{held} bytes of requests are held there and this one of {n} would "
                        f"pass its budget of {self.queue_budget} (HPCDP_RPC_QUEUE_BYTES)")
            self.queued_bytes = held = held + n
            if held > self.queued_peak:
                self.queued_peak = held
        frame.queued = n
        return None

    def unqueue(self, frame: Frame | None) -> None:
        """The request of ``frame`` is answered (or dropped): its bytes leave the budget."""
        if frame is None or not frame.queued:
            return
        with self._qlock:
            n, frame.queued = frame.queued, 0
            self.queued_bytes -= n

    def decode(self, src: int, frame: Frame) -> Any:
        """The value of a message from ``src``: within our limits, its RRefs taken in."""
        return decode(frame.body, frame.buffers, self.limits, self._dec_hooks[src])

    def discard(self, src: int, frame: Frame) -> None:
        """A message that will not be used: its RRefs are still taken in and let go, so their
        owners can free what they refer to."""
        if frame.body is not None and len(frame.body):
            try:
                self.decode(src, frame)
            except Exception:  # noqa: BLE001 - whatever could be salvaged was
                pass

    def _on_reply(self, src: int, mid: int, fields: list, frame: Frame, _inline: bool) -> None:
        with self._lock:
            p = self._pending.get(mid)
            if p is None or p.dst != src or \
                    p.control != (fields[0] == P.CRESULT) and fields[0] != P.ERROR:
                forged = p is not None
                p = None
            else:
                del self._pending[mid]
        if p is None:
            if forged:
                LOG.warning("hpcdp.rpc: rank %d dropped a reply from rank %d for request %d, "
                            "which went to another worker", self.rank, src, mid)
            else:
                LOG.debug("hpcdp.rpc: rank %d: late or unknown reply %d from rank %d", self.rank,
                          mid, src)
            self.discard(src, frame)  # a late result may hold RRefs to let go of
            return
        if frame.refused is not None:
            p.fut.set_exception(ProtocolError(f"{p.what}: the reply was refused here: "
                                              f"{frame.refused}"))
            return
        try:
            value = self.decode(src, frame)
            if fields[0] == P.ERROR:
                if type(value) is not tuple or len(value) != 3 or \
                        any(type(v) is not str for v in value):
                    raise ProtocolError("malformed error reply")
                p.fut.set_exception(self.error_from(value, p.what))
            else:
                p.fut.set_result(value)
        except Exception as exc:  # noqa: BLE001 - whatever went wrong, the caller hears of it
            p.fut.set_exception(ProtocolError(f"{p.what}: bad reply: {exc}"))

    def _on_fork(self, src: int, mid: int, fields: list, frame: Frame, _inline: bool) -> None:
        if len(fields) != 6:
            raise ProtocolError("malformed FORK")
        self.rrefs.on_fork(src, fields[2], fields[3], fields[4], fields[5])
        self.control(lambda: self.reply(src, mid, None))

    def _on_accept(self, src: int, mid: int, fields: list, frame: Frame, _inline: bool) -> None:
        if len(fields) != 3:
            raise ProtocolError("malformed ACCEPT")
        self.rrefs.on_accept(src, fields[2])
        self.control(lambda: self.reply(src, mid, None))

    def _on_delete(self, src: int, mid: int, fields: list, frame: Frame, _inline: bool) -> None:
        if len(fields) != 4:
            raise ProtocolError("malformed DELETE")
        self.rrefs.on_delete(src, fields[2], fields[3])
        self.control(lambda: self.reply(src, mid, None))

    def _on_coord(self, src: int, mid: int, fields: list, frame: Frame, _inline: bool) -> None:
        self.control(lambda: self.coord.handle(src, mid, fields[0]))

    # -- failures and shutdown ---------------------------------------------------------------
    def _lost(self, peer: int, why: str, graceful: bool) -> None:
        with self._lock:
            self.lost[peer] = why
            failed = [mid for mid, p in self._pending.items() if p.dst == peer]
            failed_p = [self._pending.pop(mid) for mid in failed]
        if failed_p or not graceful:
            level = logging.DEBUG if graceful else logging.WARNING
            LOG.log(level, "hpcdp.rpc: rank %d lost %s (rank %d): %s", self.rank,
                    self.names[peer], peer, why)
        state = "shut down" if graceful else "failed"
        for p in failed_p:
            p.fut.set_exception(PeerFailureError(
                f"{p.what}: {self.names[peer]} (rank {peer}) {state} before replying ({why})",
                peers=[peer]))
        self.rrefs.peer_lost(peer, why)
        self.coord.peer_lost(peer)

    def pending_count(self, control: bool = False) -> int:
        with self._lock:
            return sum(1 for p in self._pending.values() if p.control == control)

    # -- deadlines (the timer and waiting callers) -------------------------------------------
    def next_deadline(self) -> float | None:
        """The earliest deadline of a pending call (monotonic), if any."""
        with self._lock:
            return self._deadlines[0][0] if self._deadlines else None

    def expire(self, now: float) -> None:
        """Fail the calls whose deadline is past ``now`` (the timer calls this)."""
        expired = []
        with self._lock:
            heap = self._deadlines
            while heap and heap[0][0] <= now:
                p = self._pending.pop(heapq.heappop(heap)[1], None)
                if p is not None:
                    expired.append(p)
            if len(heap) > 2 * len(self._pending) + 4096:  # drop entries of answered requests
                self._deadlines = [(d, m) for d, m in heap if m in self._pending]
                heapq.heapify(self._deadlines)
        for p in expired:
            p.fut.set_exception(CommTimeoutError(
                f"{p.what} did not complete within {p.timeout:g} s"))

    def expire_call(self, mid: int) -> None:
        """A caller waited until its call's deadline: fail the call now (the timer may be late)."""
        with self._lock:
            p = self._pending.pop(mid, None)
        if p is not None:
            p.fut.set_exception(CommTimeoutError(
                f"{p.what} did not complete within {p.timeout:g} s"))

    def close(self, graceful: bool, why: str) -> None:
        """Tear down (after the coordination, or at once when not graceful)."""
        with self._lock:
            if self.state == "closed":
                return
            self.state = "closed"
            failed = list(self._pending.values())
            self._pending.clear()
        self.transport.close(graceful, max(1.0, min(10.0, self.default_timeout)))
        for p in failed:
            p.fut.set_exception(HpcdpError(f"{p.what}: RPC was shut down on rank {self.rank} "
                                           f"({why}) before the reply came"))
        self.rrefs.fail_all(f"RPC was shut down on rank {self.rank}")
        self.pool.close(0.0)
        self.house.stop()


def _log_failure(fut: Future) -> None:
    err = fut.exception()
    if err is not None:
        LOG.debug("hpcdp.rpc: %s failed: %s", fut.what, err)


def exchange_bytes(group: Any, data: bytes, timeout: float) -> list[bytes]:
    """Every rank's ``data`` in rank order, over the group's collectives (no pickle)."""
    sizes = group.all_gather(np.array([len(data)], np.int64), timeout=timeout).reshape(-1)
    padded = np.zeros(max(1, int(sizes.max())), np.uint8)
    padded[: len(data)] = np.frombuffer(data, np.uint8)
    rows = group.all_gather(padded, timeout=timeout)
    return [rows[i, : int(sizes[i])].tobytes() for i in range(group.size)]

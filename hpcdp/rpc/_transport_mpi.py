"""MPI ranks: a duplicated communicator, progressed by whichever thread holds its token.

A message is a head (prefix, lengths, data tag, envelope fields and a body of at most 4 KiB, in
one MPI message on ``ENV_TAG``) followed by a larger body and each array as their own messages
on a data tag unique to the message, sent straight from the array (zero-copy). The receiver
checks the head against its limits, then matches each data message (``MPI_Improbe``), checks its
size against the announced one and only then takes a buffer of that size (``RECV_BUFFERS``:
one a received array has let go of, already mapped, where there is one) and receives into it
(a head whose data never comes reserves nothing): never a truncated receive, which Open
MPI 4 does not survive for large messages (a refused or forged message that is too large is
matched and left with its sender). Any thread posts sends (nonblocking). On shared memory a
matched receive copies the whole message at once, so one poll receives a few MiB at most
(``_POLL_BYTES``) before delivering what it completed.

Progress (matching heads, completing receives and sends, delivering in order per source) is
made by whichever thread holds the progress token (``poll``): an idle thread of the agent's pool
leads (``_pool``) and runs short callees itself (its duty is lent, see ``_duty``), and a thread
waiting for its own reply polls itself for a while (``direct``), so a call and its reply cross no
thread hand-off; the leader parks meanwhile. Polling backs off to millisecond sleeps when idle,
since Open MPI's blocking calls would hold a core.

MPI cannot tell a dead peer from a slow one, so on MPI a killed callee surfaces as the call's
timeout (Open MPI's ``mpirun`` also ends the whole job when a rank dies).
"""
from __future__ import annotations

import collections
import itertools
import logging
import struct
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import BackendUnavailableError, HpcdpError, PeerFailureError, ProtocolError
from ._codec import Limits
from ._pool import idle_pause
from ._transport_base import BYE, Deliver, Lost, Transport
from ._wire import (
    MAX_ENVELOPE, PREFIX, RECV_BUFFERS, Frame, check_sizes, pack_envelope, pack_prefix,
    parse_prefix,
)

__all__ = ["MPITransport"]

LOG = logging.getLogger("hpcdp.rpc")

ENV_TAG = 1
_DATA_TAG0 = 16
_CHUNK = 1 << 30  # MPI counts are ints: larger arrays go in several messages
_INLINE = 4096    # bodies up to this size travel in the head message, larger ones as data
_TAG = struct.Struct("<I")
_NO_TAG = _TAG.pack(0)
_GRAVEYARD: list[Any] = []  # requests dropped by a non-graceful close: MPI may still use them
_BYE_ENV = pack_envelope([BYE, 0])
_BYE_HEAD = pack_prefix(_BYE_ENV, b"", []) + _TAG.pack(0) + _BYE_ENV
#: after a caller's own polling the leader stays parked this long (a ping-pong's next call)
LINGER = 0.002
_MAX_DISCARDS = 64
#: data bytes one poll receives at most before the messages it completed are delivered: on
#: shared memory a matched receive copies the whole message at once, so a poll that matched
#: a burst of 64 MiB would keep 64 buffers alive (and their callees waiting) until the last
#: one; a message at a time, each callee frees its buffer for the next message, which then
#: lands in memory that is mapped and still in cache (``RECV_BUFFERS``; measured with
#: ``python -m hpcdp.bench rpc``: 1 MiB beat 2, 4, 16 MiB and no limit by 5-15%)
_POLL_BYTES = 1 << 20


def _mpi_comm(group: Any) -> Any:
    """The MPI communicator under ``group`` (``native_comm()`` once backends offer it)."""
    be = group.backend
    native = getattr(be, "native_comm", None)
    return native() if callable(native) else be.comm


def _chunks(n: int) -> list[tuple[int, int]]:
    return [(a, min(a + _CHUNK, n)) for a in range(0, n, _CHUNK)]


def _nchunks(n: int) -> int:
    return -(-n // _CHUNK)


class _Incoming:
    """A message whose body or arrays are still arriving. Each chunk is matched (``Improbe``)
    and its size checked against the announced one before a receive is posted into it, and a
    part's memory is allocated only when its first chunk is there: a head announcing arrays
    that never come reserves nothing."""

    __slots__ = ("env", "body", "bufs", "sizes", "parts", "plan", "next", "reqs", "refused",
                 "tag")

    def __init__(self, env: bytes | None, body: Any, tag: int, sizes: Sequence[int] = (),
                 big_body: bool = False, refused: str | None = None) -> None:
        self.env, self.body, self.tag, self.refused = env, body, tag, refused
        self.sizes = list(sizes)  # the big body first (when ``big_body``), then each array
        self.parts: list[Any] = [None] * len(self.sizes)
        self.bufs: list[Any] = []
        self.plan = [(i, lo, hi) for i, n in enumerate(self.sizes) for lo, hi in _chunks(n)]
        self.next = 0
        self.reqs: list[Any] = []
        if big_body:
            self.body = _BODY  # filled in at the end (``done``)

    def view(self) -> memoryview:
        """The memory of the next chunk (its part allocated on first use)."""
        i, lo, hi = self.plan[self.next]
        part = self.parts[i]
        if part is None:  # mapped memory where a received array has been let go
            part = self.parts[i] = RECV_BUFFERS.take(self.sizes[i])
        return memoryview(part)[lo:hi]

    def frame(self) -> Frame:
        parts = [p if p is not None else np.empty(0, np.uint8) for p in self.parts]
        if self.body is _BODY:
            return Frame(self.env, memoryview(parts[0]), parts[1:], self.refused)
        return Frame(self.env, self.body, parts, self.refused)


_BODY = object()


class MPITransport(Transport):
    name = "mpi"

    def __init__(self, group: Any, limits: Limits, deliver: Deliver, lost: Lost) -> None:
        super().__init__(group.rank, group.size, limits, deliver, lost)
        from ..backends.mpi import get_mpi

        MPI = self.MPI = get_mpi()
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise BackendUnavailableError(
                f"init_rpc (rank {self.rank}): RPC over MPI needs MPI_THREAD_MULTIPLE, but this MPI "
                f"library provides thread level {MPI.Query_thread()} (initialise MPI through "
                "hpcdp, or an MPI build with thread support)")
        self.comm = _mpi_comm(group).Dup()  # collective: RPC traffic never meets anything else
        self.tag_span = int(self.comm.Get_attr(MPI.TAG_UB) or 32767) - _DATA_TAG0
        self._tags = itertools.count()
        self._lock = threading.Lock()
        self._sends: list[tuple[list, Any]] = []
        self._incoming: dict[int, collections.deque[_Incoming]] = {}
        self._discards: list[tuple[int, int, int]] = []  # (src, tag, messages left)
        self._scratch = bytearray(64 << 10)
        self._status = MPI.Status()  # used by the token holder only
        self._stop = False
        self._closed = False
        self._token = threading.Lock()  # held by the one thread making progress
        self._park = threading.Condition(threading.Lock())
        self.pumpers = 0  # threads polling for their own replies (the pool's leader parks)
        self._pump_end = 0.0
        self._backoff = LINGER
        self._polls = 0
        self._delivered = 0  # frames delivered (a pump that saw more than its reply kicks)
        self.gone: dict[int, str] = {}
        self._small_body = min(_INLINE, limits.max_body_bytes, limits.max_message_bytes)
        self._max_env = PREFIX.size + 8 * limits.max_buffers + _TAG.size + MAX_ENVELOPE + _INLINE

    def start(self) -> None:
        """Nothing to start: the agent's pool threads take turns calling ``poll``."""

    def direct(self, dst: int) -> Callable[[Any, float], None] | None:
        return self._pump

    # -- sending ---------------------------------------------------------------------------
    def send(self, dst: int, env: bytes, body: bytes, buffers: Sequence[memoryview]) -> None:
        if dst in self.gone:
            raise PeerFailureError(f"rpc send from rank {self.rank} to rank {dst}: "
                                   f"{self.gone[dst]}", peers=[dst])
        if not buffers and len(body) <= _INLINE:  # the common small message: one head
            head = pack_prefix(env, body, ()) + _NO_TAG + env + body
            with self._lock:
                if self._closed:
                    raise HpcdpError(f"rpc send from rank {self.rank}: this worker has shut "
                                     "down")
                req = self.comm.Isend(head, dst, ENV_TAG)
                if not req.Test():  # a small message usually leaves at once (eager)
                    self._sends.append(([req], head))
            return
        MPI = self.MPI
        lens = [b.nbytes for b in buffers]
        tag = _DATA_TAG0 + next(self._tags) % self.tag_span
        inline = len(body) <= _INLINE
        head = pack_prefix(env, body, lens) + _TAG.pack(tag) + env + (body if inline else b"")
        if not inline:  # a large body follows as data, so the head stays small and refusable
            buffers = [memoryview(body), *buffers]
        with self._lock:
            if self._closed:
                raise HpcdpError(f"rpc send from rank {self.rank}: this worker has shut down")
            reqs = [self.comm.Isend([head, MPI.BYTE], dst, ENV_TAG)]
            for b in buffers:
                for lo, hi in _chunks(b.nbytes):
                    reqs.append(self.comm.Isend([b[lo:hi], MPI.BYTE], dst, tag))
            self._sends.append((reqs, (head, buffers)))

    # -- progress: whoever holds the token polls -------------------------------------------
    def poll(self, tasks: list | None = None) -> bool | None:
        """One round of progress unless another thread is making it: True if something moved,
        False if nothing did, None if the token is taken (or the transport closed).

        ``tasks``: the caller holds the serving duty (the pool's leader); callees it may run
        itself are appended, to be run once the token is released.
        """
        if not self._token.acquire(False):
            return None
        try:
            if self._stop:  # checked under the token: close() frees the communicator after
                return None
            return self._poll(tasks)
        except Exception:  # noqa: BLE001 - keep serving; the message at fault is logged
            LOG.exception("hpcdp.rpc: rank %d: MPI progress error", self.rank)
            return True
        finally:
            self._token.release()

    def _pump(self, fut: Any, until: float) -> None:
        """Poll on this thread for a while, for ``fut``'s reply (the leader parks meanwhile)."""
        with self._park:
            self.pumpers += 1
        seen = self._delivered
        t0 = last = time.monotonic()
        try:
            while not fut.done():
                busy = self.poll()
                if fut.done():
                    break
                now = time.monotonic()
                if now >= until:
                    break
                if busy is None:  # another thread polls: it delivers our reply, or gives up
                    if fut._sleep(2e-4):
                        break
                    last = time.monotonic()
                elif busy:
                    last = now
                else:
                    idle_pause(now - last)
        finally:
            with self._park:
                self.pumpers -= 1
                self._pump_end = t = time.monotonic()
                # a long wait (not a ping-pong), or more arrived than a reply: the leader
                # takes over now rather than after its linger
                if t - t0 > LINGER or self._delivered - seen > 1:
                    self._pump_end = 0.0
                    self._park.notify_all()

    def parked(self) -> bool:
        """For the pool's leader: park while a caller polls for itself, or just did (its next
        call is probably coming); True if it parked."""
        if not self.pumpers and time.monotonic() - self._pump_end >= LINGER:
            self._backoff = LINGER
            return False
        with self._park:
            if self.pumpers or time.monotonic() - self._pump_end < LINGER:
                self._park.wait(self._backoff)
                self._backoff = min(2 * self._backoff, 0.01)
                return True
        return False

    def _poll(self, tasks: list | None) -> bool:
        MPI = self.MPI
        busy = False
        st = self._status
        comm = self.comm
        while True:
            msg = comm.Improbe(MPI.ANY_SOURCE, ENV_TAG, st)
            if msg is None:
                break
            busy = True
            self._envelope(msg, st.Get_source(), st.Get_count(MPI.BYTE), tasks)
        if self._discards:
            busy |= self._discard()
        if self._incoming:
            budget = [_POLL_BYTES]
            for src, q in list(self._incoming.items()):
                for m in q:
                    if m.next < len(m.plan):
                        busy |= self._match(src, m, st, budget)
                        if m.next < len(m.plan):
                            break  # a peer's data comes in order: the later ones are not here
                while q and q[0].next == len(q[0].plan) and (
                        not q[0].reqs or MPI.Request.Testall(q[0].reqs)):
                    m = q.popleft()
                    busy = True
                    self._deliver(src, m.frame(), tasks)
                if not q:
                    del self._incoming[src]
        if self._sends:
            self._polls += 1
            with self._lock:
                sends = self._sends
                if self._polls % 64:  # sends complete in order, nearly: test the oldest ones
                    k = 0
                    while k < len(sends) and MPI.Request.Testall(sends[k][0]):
                        k += 1
                    if k:
                        del sends[:k]
                        busy = True
                else:  # now and then all of them (to peers that read at different paces)
                    keep = [s for s in sends if not MPI.Request.Testall(s[0])]
                    busy |= len(keep) != len(sends)
                    self._sends = keep
        return busy

    def _deliver(self, src: int, frame: Frame, tasks: list | None) -> None:
        self._delivered += 1
        task = self.deliver(src, frame, tasks is not None)
        if task is not None:
            tasks.append(task)

    def _match(self, src: int, m: _Incoming, st: Any, budget: list[int]) -> bool:
        """Post receives for the chunks of ``m`` that have arrived, checking each one's size
        first: a receive into a smaller buffer (truncation) is not safe with every MPI.

        ``budget``: bytes this poll may still post (at least one chunk is); see ``_POLL_BYTES``.
        """
        MPI, busy = self.MPI, False
        while m.next < len(m.plan) and budget[0] > 0:
            msg = self.comm.Improbe(src, m.tag, st)
            if msg is None:
                break
            busy = True
            _, lo, hi = m.plan[m.next]
            n = st.Get_count(MPI.BYTE)
            if n != hi - lo:
                _GRAVEYARD.append(msg)  # never received: its bytes stay with the sender
                LOG.warning("hpcdp.rpc: rank %d: rank %d sent an array chunk of %d bytes where "
                            "%d were announced", self.rank, src, n, hi - lo)
                left = len(m.plan) - m.next - 1
                if left:
                    self._add_discard(src, m.tag, left)
                m.refused = f"an array chunk of {n} bytes where {hi - lo} were announced"
                m.body, m.parts, m.next = None, [], len(m.plan)
                break
            m.reqs.append(msg.Irecv([m.view(), MPI.BYTE]))
            m.next += 1
            budget[0] -= n
        return busy

    def _envelope(self, msg: Any, src: int, n: int, tasks: list | None) -> None:
        MPI = self.MPI
        if n > self._max_env or n < PREFIX.size + _TAG.size:
            _GRAVEYARD.append(msg)  # matched but never received: nothing allocated for it
            LOG.warning("hpcdp.rpc: rank %d refused a %d-byte envelope from rank %d", self.rank,
                        n, src)
            return
        raw = bytearray(n)
        msg.Recv(raw)
        view = memoryview(raw)
        try:
            env_len, body_len, nbuf = parse_prefix(raw, self.limits)
            if not nbuf and body_len <= self._small_body and env_len <= MAX_ENVELOPE and \
                    PREFIX.size + _TAG.size + env_len + body_len == n and \
                    src not in self._incoming:
                # the common small message: complete, and nothing from this peer before it
                pos = PREFIX.size + _TAG.size
                env = bytes(raw[pos:pos + env_len])
                if env == _BYE_ENV:
                    self._bye(src)
                else:
                    self._deliver(src, Frame(env, view[pos + env_len:], []), tasks)
                return
            pos = PREFIX.size + 8 * nbuf
            lens = struct.unpack_from(f"<{nbuf}Q", raw, PREFIX.size)
            (tag,) = _TAG.unpack_from(raw, pos)
            pos += _TAG.size
            inline = body_len <= _INLINE
            if pos + env_len + (body_len if inline else 0) != n:
                raise ProtocolError("envelope sizes do not add up")
        except (ProtocolError, struct.error) as exc:
            LOG.warning("hpcdp.rpc: rank %d dropped a malformed message from rank %d: %s",
                        self.rank, src, exc)
            return
        env = bytes(view[pos:pos + env_len])
        body = view[pos + env_len:]
        if env == _BYE_ENV and nbuf == 0:
            self._bye(src)
            return
        q = self._incoming.get(src)
        refused = check_sizes(env_len, body_len, lens, self.limits)
        if refused is not None:
            LOG.warning("hpcdp.rpc: rank %d refused a message from rank %d: %s", self.rank, src,
                        refused)
            # counted, never listed: a forged head may announce any length
            count = sum(_nchunks(k) for k in lens) + (0 if inline else _nchunks(body_len))
            if count:
                self._add_discard(src, tag, count)
            m = _Incoming(env, None, tag, refused=refused)
        elif inline:
            m = _Incoming(env, body, tag, lens)
        else:
            m = _Incoming(env, None, tag, [body_len, *lens], big_body=True)
        if q is None:
            q = self._incoming[src] = collections.deque()
        q.append(m)

    def _bye(self, src: int) -> None:
        self.gone[src] = "it left (shutdown(graceful=False))"
        self.lost(src, self.gone[src], False)

    def _add_discard(self, src: int, tag: int, count: int) -> None:
        # a peer sends at most what its own limits let it: more than that is never matched
        count = min(count, self.limits.max_buffers + 2 + self.limits.max_message_bytes // _CHUNK)
        if len(self._discards) >= _MAX_DISCARDS:
            del self._discards[0]  # a flood of forged heads: forget the oldest
        self._discards.append((src, tag, count))

    def _discard(self) -> bool:
        """Drop the arrays of refused messages: small chunks are read into a scratch buffer,
        larger ones are left with the sender (matched, never received)."""
        MPI, busy, left = self.MPI, False, []
        st = self._status
        for src, tag, count in self._discards:
            while count:
                m = self.comm.Improbe(src, tag, st)
                if m is None:
                    break
                if st.Get_count(MPI.BYTE) <= len(self._scratch):
                    m.Recv([self._scratch, MPI.BYTE])
                else:
                    _GRAVEYARD.append(m)
                count -= 1
                busy = True
            if count:
                left.append((src, tag, count))
        self._discards = left
        return busy

    # -- closing ---------------------------------------------------------------------------
    def close(self, graceful: bool, timeout: float) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        deadline = time.monotonic() + timeout
        if not graceful:
            # MPI has no disconnect to notice: tell the peers, so their calls to us fail now
            # (a graceful shutdown needs none: every worker leaves at once)
            with self._lock:
                for r in range(self.size):
                    if r != self.rank and r not in self.gone:
                        req = self.comm.Isend([_BYE_HEAD, self.MPI.BYTE], r, ENV_TAG)
                        self._sends.append(([req], None))
            deadline = time.monotonic() + min(timeout, 2.0)
        # let our last sends (replies, acknowledgements, goodbyes) complete
        while self._sends and time.monotonic() < deadline:
            if self.poll() is None:
                time.sleep(1e-4)
        with self._park:
            self._park.notify_all()
        # the token holder never runs user code, so it lets go within one poll
        if not self._token.acquire(timeout=max(1.0, deadline - time.monotonic())):
            self._stop = True  # every later poll does nothing; the communicator is left as is
            LOG.warning("hpcdp.rpc: rank %d: MPI progress did not stop; its communicator is "
                        "left allocated", self.rank)
            return
        try:
            self._stop = True  # from here on poll() does nothing
        finally:
            self._token.release()
        MPI = self.MPI
        if MPI.Is_finalized():
            return
        for q in self._incoming.values():
            for m in q:
                _GRAVEYARD.append(m)  # receives matched to a message cannot be cancelled
        _GRAVEYARD.extend(self._sends)
        self._sends = []
        try:
            self.comm.Free()
        except MPI.Exception:
            pass

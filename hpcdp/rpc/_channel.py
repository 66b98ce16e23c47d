"""RPC messages over a duplicate of the group's backend (``Backend.dup()``): one channel for every
backend, built from its tagged point-to-point (``send``, ``recv``, ``probe`` with ANY_SOURCE).

Why a duplicate: RPC traffic then never matches a receive of the user's (nor theirs RPC's), and
the channel inherits what the backend already does well: TCP's HMAC-authenticated connections
and frame caps, MPI's shared memory, the simulated ranks' in-process mailboxes.

A message is a head (prefix, lengths, data tag, envelope fields and a body of at most 4 KiB, one
message on ``HEAD_TAG``) followed by a larger body and each array as their own messages on a
data tag unique to the message, sent straight from the array (zero-copy where the backend is).
The receiver checks the head against its limits, then probes each data message, checks its size
against the announced one and only then takes a buffer of that size (``RECV_BUFFERS``: one a
received array has let go of, already mapped, where there is one) and receives into it: never a
receive into a smaller buffer (Open MPI 4 does not survive a truncated large message), and a
head whose data never comes reserves nothing. Data that breaks its announcement is left
unreceived with the backend (on MPI with its sender). Where a wrong-sized receive fails cleanly
(``Backend.recv_size_checked``: TCP) the data receives are posted as soon as the head is read, so
the bytes land in place; a chunk the transport had read before that is taken as its own buffer
(``Backend.take``), never copied a second time. One poll receives a few MiB of data at most
(``_POLL_BYTES``) before delivering what it completed, so each callee frees its buffer for the
next message.

Contract with the agent (one channel per agent, over the ranks of one group):

1. ``__init__`` is collective over the group (it dups the backend); it delivers nothing until a
   thread polls.
2. ``send(dst, env, body, buffers, deadline)`` may be called from any thread, never waits for
   the peer's agent, and keeps each message whole and in order per (sender, receiver) (the
   backend's non-overtaking order per source and tag). It raises ``PeerFailureError`` when
   ``dst`` is known to be gone (or its send failed at once), and ``CommTimeoutError`` when a
   large message would wait for its window (``WINDOW``) past the call's ``deadline``. No lock
   is held while the backend sends (TCP writes on the caller's thread): a peer that stops
   reading blocks only the thread writing to it, for the duplicate's ``bound_sends`` at most.
   Arrays are sent from the given views; the caller must not change them until the call's
   reply arrives.
3. ``deliver(src, frame, may_inline)`` is called in order per source and must not block. A
   thread that holds the serving duty (the pool's leader) passes ``may_inline=True`` and may get
   back a ``Lent`` task to run once the progress token is released. Frames over this rank's
   ``Limits`` arrive with ``refused`` set and no payload.
4. ``lost(src, why, graceful)`` is called once per peer that leaves (a goodbye on the channel) or
   that the backend reports gone (``Backend.peers_gone``).
5. ``direct(dst)``: ``fn(future, until)`` that makes progress on the calling thread while it
   waits for a reply, so a call and its reply cross no thread hand-off (the leader parks).
6. ``close(graceful, timeout)``: says goodbye, lets the last sends complete, shuts the duplicate.

Progress (matching heads, completing receives and sends, delivering in order per source) is made
by whichever thread holds the progress token (``poll``): an idle thread of the agent's pool leads
(``_pool``) and a thread waiting for its own reply polls for a while (``direct``). Polling backs
off to millisecond sleeps when idle. Where ranks are threads of one process
(``Backend.shares_process``) a poll that found nothing always yields the interpreter.

A backend that cannot tell a dead peer from a slow one (MPI) shows a killed callee as the call's
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

from ..backends.base import ANY_SOURCE
from ..errors import (BackendUnavailableError, CommTimeoutError, HpcdpError, PeerFailureError,
                      ProtocolError)
from ._codec import Limits
from ._duty import before_blocking
from ._pool import idle_pause
from ._wire import (
    MAX_ENVELOPE, PREFIX, RECV_BUFFERS, Frame, check_sizes, pack_envelope, pack_prefix,
    parse_prefix,
)

__all__ = ["Channel", "Deliver", "Lost", "HEAD_TAG", "DATA_TAG0", "TAG", "BYE"]

LOG = logging.getLogger("hpcdp.rpc")

Deliver = Callable[[int, Frame, bool], Any]
Lost = Callable[[int, str, bool], None]

#: envelope kind of the channel's goodbye ``[BYE, graceful]`` (the agent never sees it; sent
#: by a worker that leaves alone, ``shutdown(graceful=False)``)
BYE = 99
HEAD_TAG = 1
DATA_TAG0 = 16
_CHUNK = 1 << 30  # MPI counts are ints: larger arrays go in several messages
_INLINE = 4096    # bodies up to this size travel in the head message, larger ones as data
TAG = struct.Struct("<I")
_NO_TAG = TAG.pack(0)
#: requests dropped by a non-graceful close: the backend may still use their buffers
_GRAVEYARD: list[Any] = []
_BYE_ENVS = {g: pack_envelope([BYE, g]) for g in (0, 1)}
#: after a caller's own polling the leader stays parked this long (a ping-pong's next call)
LINGER = 0.002
_MAX_DISCARDS = 64
#: data bytes one poll receives at most before the messages it completed are delivered: a
#: poll that matched a burst of 64 MiB would keep 64 buffers alive (and their callees waiting)
#: until the last one; a message at a time, each callee frees its buffer for the next message,
#: which then lands in memory that is mapped and still in cache (``RECV_BUFFERS``)
_POLL_BYTES = 1 << 20
#: how often (seconds) the token holder asks the backend which peers are gone
_GONE_EVERY = 0.05
#: bytes of large messages to one peer that may be in flight (sent, not yet received where the
#: backend's sends complete at receipt: MPI's large ones, a simulated rank's duplicate) before
#: a sender waits: a caller far faster than its callee must not hold every message at once
WINDOW = 128 << 20
#: bytes of receives posted ahead of their data (``Backend.recv_size_checked``): the data then
#: lands in place as it arrives (no unexpected-message copy); beyond this, data is probed first,
#: so heads whose data never comes reserve no more than this
_PREPOST_MAX = 64 << 20
#: seconds an idle leader polls back to back after the last activity (a ping-pong's next call
#: comes sooner); then it sleeps between polls, leaving the processor to the ranks that work
_SPIN = 3e-4
#: seconds the receive of a message ``probe`` reported may take (it has arrived: only a
#: transport that moves large messages when their sender polls needs it); past it the receive
#: is abandoned and its sender treated as failed
_RECV_WAIT = 5.0
#: least bound (seconds) on a send whose peer takes no byte (``Backend.bound_sends``): a live
#: rank's transport reads its sockets all the time, so this long means stopped or hung
_MIN_SEND_BOUND = 30.0
#: longest wait (seconds) of an idle leader on the data of a message whose head it has read,
#: reading it as it arrives rather than polling for it (``Channel.idle_pause``)
_DATA_WAIT = 1e-3


def _chunks(n: int) -> list[tuple[int, int]]:
    return [(a, min(a + _CHUNK, n)) for a in range(0, n, _CHUNK)]


def _nchunks(n: int) -> int:
    return -(-n // _CHUNK)


def _u8(b: Any) -> np.ndarray:
    return np.frombuffer(b, np.uint8)


class _Incoming:
    """A message whose body or arrays are still arriving. Each chunk is probed and its size
    checked against the announced one before a receive is posted into it, and a part's memory
    is allocated only when its first chunk is there: a head announcing arrays that never come
    reserves nothing."""

    __slots__ = ("env", "body", "bufs", "sizes", "parts", "plan", "next", "reqs", "refused",
                 "tag", "preposted")

    def __init__(self, env: bytes | None, body: Any, tag: int, sizes: Sequence[int] = (),
                 big_body: bool = False, refused: str | None = None) -> None:
        self.env, self.body, self.tag, self.refused = env, body, tag, refused
        self.sizes = list(sizes)  # the big body first (when ``big_body``), then each array
        self.parts: list[Any] = [None] * len(self.sizes)
        self.bufs: list[Any] = []
        self.plan = [(i, lo, hi) for i, n in enumerate(self.sizes) for lo, hi in _chunks(n)]
        self.next = 0
        self.reqs: list[Any] = []
        self.preposted = 0
        if big_body:
            self.body = _BODY  # filled in at the end (``frame``)

    def view(self) -> np.ndarray:
        """The memory of the next chunk (its part allocated on first use)."""
        i, lo, hi = self.plan[self.next]
        part = self.parts[i]
        if part is None:  # mapped memory where a received array has been let go
            part = self.parts[i] = RECV_BUFFERS.take(self.sizes[i])
        return part[lo:hi]

    def frame(self) -> Frame:
        parts = [p if p is not None else np.empty(0, np.uint8) for p in self.parts]
        if self.body is _BODY:
            return Frame(self.env, memoryview(parts[0]), parts[1:], self.refused)
        return Frame(self.env, self.body, parts, self.refused)


_BODY = object()


class Channel:
    """One worker's RPC channel over a duplicate of its group's backend."""

    def __init__(self, group: Any, limits: Limits, deliver: Deliver, lost: Lost,
                 timeout: float = 60.0) -> None:
        """``timeout``: the worker's default call timeout: how long a send without a deadline
        of its own (a reply) may wait for its window, and (at least ``_MIN_SEND_BOUND``) how long
        a send may wait on a peer that takes no byte before that peer counts as failed."""
        self.rank, self.size, self.limits = group.rank, group.size, limits
        self.timeout = timeout
        self.deliver, self.lost = deliver, lost
        parent = group.backend
        if parent.thread_level != "multiple":
            raise BackendUnavailableError(
                f"init_rpc (rank {self.rank}): RPC needs a backend that several threads may call "
                f"at once; the {parent.name} backend has thread level {parent.thread_level!r} "
                "(for MPI: an MPI library with MPI_THREAD_MULTIPLE, initialised through hpcdp)")
        self.be = be = parent.dup()  # collective: RPC traffic never meets anything else
        # no valid message of ours is larger: a bigger one is refused, so never stored (a
        # head, on its own tag, no larger than a head can be; data chunks up to a chunk)
        be.cap_unposted(min(_CHUNK, limits.max_message_bytes))
        be.cap_unposted(self._max_head_of(limits), tag=HEAD_TAG)
        # a send (TCP: written on the caller's thread) never blocks for good on a stopped peer
        be.bound_sends(max(_MIN_SEND_BOUND, timeout))
        self.tag_span = int(be.max_tag) - DATA_TAG0
        self._yield = bool(be.shares_process)  # idle polls must let the peers' threads run
        self._early = bool(be.recv_size_checked)
        self._polled = bool(be.needs_progress_thread)  # transfers advance only while polled
        self._preposted = 0
        self._tags = itertools.count()
        self._lock = threading.Lock()
        self._sends: list[tuple[list, Any, int, int]] = []  # (requests, kept, dst, bytes)
        self._writers = 0  # threads inside ``be.send`` (never under ``_lock``)
        self._inflight = [0] * self.size  # bytes of ``_sends`` per destination
        self._incoming: dict[int, collections.deque[_Incoming]] = {}
        self._discards: list[tuple[int, int, int]] = []  # (src, tag, messages left)
        self._scratch = np.empty(64 << 10, np.uint8)
        self._stop = False
        self._closed = False
        self._token = threading.Lock()  # held by the one thread making progress
        self._park = threading.Condition(threading.Lock())
        self.pumpers = 0  # threads polling for their own replies (the pool's leader parks)
        self._pump_end = 0.0
        self._backoff = LINGER
        self._polls = 0
        self._gone_at = 0.0
        self._delivered = 0  # frames delivered (a pump that saw more than its reply kicks)
        self._sender, self._sent_at = 0, 0.0  # the thread that sent last, and when
        self.gone: dict[int, str] = {}
        self._small_body = min(_INLINE, limits.max_body_bytes, limits.max_message_bytes)
        self._max_head = self._max_head_of(limits)

    @staticmethod
    def _max_head_of(limits: Limits) -> int:
        return PREFIX.size + 8 * limits.max_buffers + TAG.size + MAX_ENVELOPE + _INLINE

    def direct(self, dst: int) -> Callable[[Any, float], None] | None:
        return self._pump

    # -- sending ---------------------------------------------------------------------------
    def send(self, dst: int, env: bytes, body: bytes, buffers: Sequence[memoryview],
             deadline: float | None = None) -> None:
        """``deadline`` (``time.monotonic()``): that of the call the message belongs to (None:
        ``timeout`` from now); a large message that would wait past it for its window raises
        ``CommTimeoutError``."""
        self._check_peer(dst)
        self._sender, self._sent_at = threading.get_ident(), time.monotonic()
        if not buffers and len(body) <= _INLINE:  # the common small message: one head
            head = pack_prefix(env, body, ()) + _NO_TAG + env + body
            self._post(dst, [(_u8(head), HEAD_TAG)], head, 0)
            return
        lens = [b.nbytes for b in buffers]
        tag = DATA_TAG0 + next(self._tags) % self.tag_span
        inline = len(body) <= _INLINE
        head = pack_prefix(env, body, lens) + TAG.pack(tag) + env + (body if inline else b"")
        if not inline:  # a large body follows as data, so the head stays small and refusable
            buffers = [memoryview(body), *buffers]
        n = sum(lens) + (0 if inline else len(body))
        if self._inflight[dst] and self._inflight[dst] + n > WINDOW:
            self._wait_window(dst, n, time.monotonic() + self.timeout if deadline is None
                              else deadline)
            self._check_peer(dst)  # it may have gone while we waited
        parts = [(_u8(head), HEAD_TAG)]
        for b in buffers:
            parts.extend((_u8(b[lo:hi]), tag) for lo, hi in _chunks(b.nbytes))
        self._post(dst, parts, (head, buffers), n)

    def _check_peer(self, dst: int) -> None:
        if dst in self.gone:
            raise PeerFailureError(f"rpc send from rank {self.rank} to rank {dst}: "
                                   f"{self.gone[dst]}", peers=[dst])

    def _post(self, dst: int, parts: list[tuple[np.ndarray, int]], kept: Any, n: int) -> None:
        """Send ``parts`` (buffer, tag) to ``dst`` in order, holding no lock while the backend
        sends: TCP writes on this thread, and a peer that stops reading then blocks this caller
        alone (for the backend's ``bound_sends`` at most), never the progress of the others
        nor ``close``. ``n``: bytes counted against ``dst``'s window until the sends complete.
        A send that failed at once (the peer is gone) raises ``PeerFailureError``."""
        with self._lock:
            self._check_open()
            self._writers += 1
            self._inflight[dst] += n
        reqs: list[Any] = []
        failed: BaseException | None = None
        try:
            for buf, tag in parts:
                reqs.append(self.be.send(buf, dst, tag))
        finally:
            with self._lock:
                self._writers -= 1
                try:  # a small message usually leaves at once
                    done = len(reqs) == len(parts) and all(r.test() for r in reqs)
                except HpcdpError as exc:
                    done, failed = False, exc
                if dst in self.gone:  # ``_gone`` ran meanwhile: its sends are dropped
                    _GRAVEYARD.append((reqs, kept, dst, n))
                elif done:
                    self._inflight[dst] -= n
                else:
                    self._sends.append((reqs, kept, dst, n))
        if failed is not None:
            raise PeerFailureError(f"rpc send from rank {self.rank} to rank {dst}: {failed}",
                                   peers=[dst]) from None

    def _wait_window(self, dst: int, n: int, deadline: float) -> None:
        """Wait (polling: MPI moves sends only while polled) until ``n`` more bytes to ``dst``
        fit its window, the peer is gone, or this channel closes; ``CommTimeoutError`` at
        ``deadline`` (a callee that receives slower than we send, or not at all: on MPI and
        simulated ranks a large send completes only when received)."""
        before_blocking()  # a serving duty this thread holds goes to another thread first
        last = time.monotonic()
        while self._inflight[dst] and self._inflight[dst] + n > WINDOW and \
                dst not in self.gone and not self._closed and not self._stop:
            if time.monotonic() >= deadline:
                raise CommTimeoutError(
                    f"rpc send from rank {self.rank} to rank {dst}: a {n}-byte message waited "
                    f"for its window until the call's deadline: rank {dst} has not received "
                    f"{self._inflight[dst]} bytes sent to it before (at most {WINDOW >> 20} MiB "
                    "may be in flight to one peer)")
            busy = self.poll()
            if busy is None:
                time.sleep(1e-4)
            elif busy:
                last = time.monotonic()
            else:
                idle_pause(time.monotonic() - last, others=self._yield)

    def _check_open(self) -> None:
        if self._closed:
            raise HpcdpError(f"rpc send from rank {self.rank}: this worker has shut down")

    def _done(self, reqs: list[Any], dst: int) -> bool:
        """Whether every request completed; a failed one (the peer is gone) counts as done."""
        try:
            return all(r.test() for r in reqs)
        except HpcdpError as exc:
            LOG.debug("hpcdp.rpc: rank %d: a send to rank %d failed: %s", self.rank, dst, exc)
            return True

    # -- progress: whoever holds the token polls -------------------------------------------
    def poll(self, tasks: list | None = None) -> bool | None:
        """One round of progress unless another thread is making it: True if something moved,
        False if nothing did, None if the token is taken (or the channel closed).

        ``tasks``: the caller holds the serving duty (the pool's leader); callees it may run
        itself are appended, to be run once the token is released.
        """
        if not self._token.acquire(False):
            return None
        try:
            if self._stop:  # checked under the token: close() shuts the backend after
                return None
            return self._poll(tasks)
        except Exception:  # noqa: BLE001 - keep serving; the message at fault is logged
            LOG.exception("hpcdp.rpc: rank %d: RPC progress error", self.rank)
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
                    idle_pause(now - last, others=self._yield)
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

    def idle_pause(self, idle: float, others: bool) -> None:
        """The pool leader's wait between polls that found nothing (see ``_pool.idle_pause``).

        Where the backend moves bytes on threads of its own (TCP; not MPI, whose transfers
        advance only while polled, ``Backend.needs_progress_thread``), an idle leader spends
        as little of the processor as it can, which on a shared node belongs to the ranks
        that work:

        - waiting for the data of a message whose head it has read, it reads that data as it
          comes (waits on its receive, ``_DATA_WAIT`` at most) rather than polling for it;
        - while another thread of ours sends (inside ``send``, or it sent within ``LINGER``: a
          caller issuing a burst of calls) it sleeps between polls: that thread needs the
          interpreter back each time a socket write of its returns, and a leader polling back
          to back would keep it through its short system calls until the interpreter forces
          a switch. The leader's own sends (replies of the callees it ran) do not count;
        - otherwise it polls back to back only for ``_SPIN`` after the last activity (a
          ping-pong's next call comes sooner), then sleeps between polls.
        """
        if self._polled:
            idle_pause(idle, others=others or self._yield)
            return
        if self._early and self._incoming and not others:
            req = self._awaited()
            if req is not None:
                try:
                    req.wait(_DATA_WAIT)
                except Exception:  # noqa: BLE001 - the next poll reports it (``_received``)
                    pass
                return
        sending = self._writers or (
            self._sender != threading.get_ident() and time.monotonic() - self._sent_at < LINGER)
        idle_pause(idle, others=others or self._yield or sending or bool(self._incoming)
                   or idle >= _SPIN)

    def _awaited(self) -> Any:
        """A posted data receive of the oldest message still arriving, or None. Read without
        the token (the leader between polls): a message delivered meanwhile only makes the
        wait return at once."""
        try:
            for q in list(self._incoming.values()):
                if q and q[0].reqs:
                    return q[0].reqs[-1]
        except (RuntimeError, IndexError):  # changed under us: poll again instead
            pass
        return None

    def _poll(self, tasks: list | None) -> bool:
        busy = False
        posted = self._preposted + _POLL_BYTES
        # heads whose data receives this poll posted reach ``_POLL_BYTES``: deliver those first
        # (their callees let go of their buffers for the next ones, ``RECV_BUFFERS``)
        while self._preposted < posted:
            found = self._probe(ANY_SOURCE, HEAD_TAG)
            if found is None:
                break
            busy = True
            self._head(found[0], found[2], tasks)
        if self._discards:
            busy |= self._discard()
        if self._incoming:
            budget = [_POLL_BYTES]
            for src, q in list(self._incoming.items()):
                for m in q:
                    if m.next < len(m.plan):
                        busy |= self._match(src, m, budget)
                        if m.next < len(m.plan):
                            break  # a peer's data comes in order: the later ones are not here
                while q and q[0].next == len(q[0].plan) and self._received(src, q[0]):
                    m = q.popleft()
                    self._preposted -= m.preposted
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
                    while k < len(sends) and self._done(sends[k][0], sends[k][2]):
                        self._inflight[sends[k][2]] -= sends[k][3]
                        k += 1
                    if k:
                        del sends[:k]
                        busy = True
                else:  # now and then all of them (to peers that read at different paces)
                    keep = []
                    for s in sends:
                        if self._done(s[0], s[2]):
                            self._inflight[s[2]] -= s[3]
                        else:
                            keep.append(s)
                    busy |= len(keep) != len(sends)
                    self._sends = keep
        now = time.monotonic()
        if now - self._gone_at >= _GONE_EVERY:
            self._gone_at = now
            self._check_gone()
        return busy

    def _probe(self, src: int, tag: int) -> tuple[int, int, int] | None:
        """``be.probe``; None where it raises because the peers probed are gone (the next
        look at ``peers_gone`` reports them lost)."""
        try:
            return self.be.probe(src, tag)
        except PeerFailureError:
            self._gone_at = 0.0
            return None

    def _received(self, src: int, m: _Incoming) -> bool:
        """Whether the data receives of ``m`` completed; a failed one refuses the message."""
        if not m.reqs:
            return True
        try:
            return all(r.test() for r in m.reqs)
        except Exception as exc:  # noqa: BLE001 - the peer went, or broke its announcement
            LOG.warning("hpcdp.rpc: rank %d: receiving a message from rank %d failed: %s",
                        self.rank, src, exc)
            m.refused = f"its data could not be received ({exc})"
            m.body, m.parts, m.reqs = None, [], []
            return True

    def _check_gone(self) -> None:
        """Peers the backend reports dead or gone are lost (this rank: it stops serving)."""
        gone = self.be.peers_gone()
        if not gone:
            return
        if self.rank in gone:
            self._stop = True  # this rank's thread died: its agent goes with it
            return
        for r, why in gone.items():
            if r not in self.gone:
                self._gone(r, why, False)

    def _deliver(self, src: int, frame: Frame, tasks: list | None) -> None:
        self._delivered += 1
        task = self.deliver(src, frame, tasks is not None)
        if task is not None:
            tasks.append(task)

    def _match(self, src: int, m: _Incoming, budget: list[int]) -> bool:
        """Post receives for the chunks of ``m`` that have arrived, checking each one's size
        first: a receive into a smaller buffer (truncation) is not safe with every MPI.

        ``budget``: bytes this poll may still post (at least one chunk is); see ``_POLL_BYTES``.
        """
        be, busy = self.be, False
        while m.next < len(m.plan) and budget[0] > 0:
            found = self._probe(src, m.tag)
            if found is None:
                break
            busy = True
            _, lo, hi = m.plan[m.next]
            n = found[2]
            if n != hi - lo:  # never received: its bytes stay with the backend (the sender)
                LOG.warning("hpcdp.rpc: rank %d: rank %d sent an array chunk of %d bytes where "
                            "%d were announced", self.rank, src, n, hi - lo)
                m.refused = f"an array chunk of {n} bytes where {hi - lo} were announced"
                m.body, m.parts, m.next = None, [], len(m.plan)
                break
            i, lo, hi = m.plan[m.next]
            got = be.take(src, m.tag) if lo == 0 and hi == m.sizes[i] else None
            if got is not None:  # the transport's own copy of the message: no second one
                m.parts[i] = got
            else:
                m.reqs.append(be.recv(m.view(), src, m.tag))
            m.next += 1
            budget[0] -= n
        return busy

    def _head(self, src: int, n: int, tasks: list | None) -> None:
        # a head is received even when refused: left unreceived it would block every later one
        if n > self._max_head:  # refused before memory of its announced size is taken
            LOG.warning("hpcdp.rpc: rank %d refused a %d-byte head from rank %d (at most %d)",
                        self.rank, n, src, self._max_head)
            self._drop(src, HEAD_TAG, n, "a head")
            return
        raw = np.empty(n, np.uint8)
        if not self._receive(raw, src, HEAD_TAG, "a head"):
            return
        if n < PREFIX.size + TAG.size:
            LOG.warning("hpcdp.rpc: rank %d refused a %d-byte head from rank %d", self.rank, n,
                        src)
            return
        view = memoryview(raw)
        try:
            env_len, body_len, nbuf = parse_prefix(raw, self.limits)
            if not nbuf and body_len <= self._small_body and env_len <= MAX_ENVELOPE and \
                    PREFIX.size + TAG.size + env_len + body_len == n and \
                    src not in self._incoming:
                # the common small message: complete, and nothing from this peer before it
                pos = PREFIX.size + TAG.size
                env = bytes(view[pos:pos + env_len])
                if env in _BYE_ENVS.values():
                    self._bye(src, env == _BYE_ENVS[1])
                else:
                    self._deliver(src, Frame(env, view[pos + env_len:], []), tasks)
                return
            pos = PREFIX.size + 8 * nbuf
            lens = struct.unpack_from(f"<{nbuf}Q", raw, PREFIX.size)
            (tag,) = TAG.unpack_from(raw, pos)
            pos += TAG.size
            inline = body_len <= _INLINE
            if pos + env_len + (body_len if inline else 0) != n:
                raise ProtocolError("head sizes do not add up")
        except (ProtocolError, struct.error) as exc:
            LOG.warning("hpcdp.rpc: rank %d dropped a malformed message from rank %d: %s",
                        self.rank, src, exc)
            return
        env = bytes(view[pos:pos + env_len])
        body = view[pos + env_len:]
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
        if refused is None and self._early and m.plan and \
                self._preposted + sum(m.sizes) <= _PREPOST_MAX:
            self._prepost(src, m)
        if q is None:
            q = self._incoming[src] = collections.deque()
        q.append(m)

    def _prepost(self, src: int, m: _Incoming) -> None:
        """Post the receives of every chunk of ``m`` now, so its data lands in place as it
        arrives. A chunk that has arrived already (a thread of the transport read ahead) is
        taken as the transport's buffer where it can hand it over (``Backend.take``: no copy
        into ``view()``), once its size is checked against the announced one."""
        be, tag = self.be, m.tag
        m.preposted = sum(m.sizes)
        self._preposted += m.preposted
        taking = True
        while m.next < len(m.plan):
            i, lo, hi = m.plan[m.next]
            got = be.take(src, tag) if taking and lo == 0 and hi == m.sizes[i] else None
            if got is None:
                taking = False  # a peer's chunks come in order: the later ones are not here
                m.reqs.append(be.recv(m.view(), src, tag))
            elif got.nbytes != hi - lo:  # taken, so not left with the backend: dropped
                LOG.warning("hpcdp.rpc: rank %d: rank %d sent an array chunk of %d bytes where "
                            "%d were announced", self.rank, src, got.nbytes, hi - lo)
                m.refused = f"an array chunk of {got.nbytes} bytes where {hi - lo} were announced"
                m.body, m.parts, m.next = None, [], len(m.plan)
                return
            else:
                m.parts[i] = got
            m.next += 1

    def _bye(self, src: int, graceful: bool) -> None:
        if src not in self.gone:
            self._gone(src, "it shut down" if graceful else "it left (shutdown(graceful=False))",
                       graceful)

    def _gone(self, peer: int, why: str, graceful: bool) -> None:
        """``peer`` left: what we still send it will never be received (its requests are kept,
        the backend may still use their buffers), and the agent hears of it."""
        self.gone[peer] = why
        with self._lock:
            _GRAVEYARD.extend(s for s in self._sends if s[2] == peer)
            self._sends = [s for s in self._sends if s[2] != peer]
            self._inflight[peer] = 0
        self.lost(peer, why, graceful)

    def _add_discard(self, src: int, tag: int, count: int) -> None:
        # a peer sends at most what its own limits let it: more than that is never matched
        count = min(count, self.limits.max_buffers + 2 + self.limits.max_message_bytes // _CHUNK)
        if len(self._discards) >= _MAX_DISCARDS:
            del self._discards[0]  # a flood of forged heads: forget the oldest
        self._discards.append((src, tag, count))

    def _discard(self) -> bool:
        """Drop the arrays of refused messages: small chunks are received into a scratch
        buffer, larger ones are left unreceived (with the sender, on MPI)."""
        busy, left = False, []
        for src, tag, count in self._discards:
            while count and src not in self.gone:
                found = self._probe(src, tag)
                if found is None or found[2] > self._scratch.size:
                    break
                if not self._receive(self._scratch[:found[2]], src, tag, "refused data"):
                    self._scratch = np.empty_like(self._scratch)  # the old one may be written
                    break
                count -= 1
                busy = True
            if count and found is None and src not in self.gone:
                left.append((src, tag, count))
        self._discards = left
        return busy

    def _receive(self, buf: np.ndarray, src: int, tag: int, what: str) -> bool:
        """Receive a message ``probe`` reported into ``buf``; False where it fails. It has
        arrived, so this is quick; a receive still open after ``_RECV_WAIT`` is abandoned
        (left posted, it would take the next message of ``src`` with ``tag`` in its place)
        and ``src`` is treated as failed: its stream can no longer be read in order."""
        req = self.be.recv(buf, src, tag)
        try:
            if req.wait(_RECV_WAIT):
                return True
        except HpcdpError as exc:  # the peer went (the next look at ``peers_gone`` says so)
            LOG.warning("hpcdp.rpc: rank %d: receiving %s from rank %d failed: %s", self.rank,
                        what, src, exc)
            self._gone_at = 0.0
            return False
        try:
            if req.abandon():
                return True  # its last bytes came as we gave up
        except HpcdpError:
            pass
        _GRAVEYARD.append((req, buf))  # the backend may still write into it
        why = (f"{what} it sent ({buf.nbytes} bytes, reported by probe) was not received "
               f"within {_RECV_WAIT:g} s; its later messages cannot be read in order")
        LOG.error("hpcdp.rpc: rank %d: rank %d: %s", self.rank, src, why)
        if src not in self.gone:
            self._gone(src, why, False)
        return False

    def _drop(self, src: int, tag: int, n: int, what: str) -> None:
        """Take a refused message of ``n`` bytes off the backend, allocating for it only
        where the backend cannot hand over its own copy nor the scratch buffer holds it."""
        if self.be.take(src, tag) is not None:
            return
        buf = self._scratch[:n] if n <= self._scratch.size else np.empty(n, np.uint8)
        if not self._receive(buf, src, tag, what) and buf.base is self._scratch:
            self._scratch = np.empty_like(self._scratch)

    # -- closing ---------------------------------------------------------------------------
    def _writers_out(self, deadline: float) -> bool:
        """Wait until no thread is inside ``be.send`` (or ``deadline``); True if none is."""
        while self._writers and time.monotonic() < deadline:
            time.sleep(1e-3)
        return not self._writers

    def close(self, graceful: bool, timeout: float) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True  # no send starts from here on
        deadline = time.monotonic() + (timeout if graceful else min(timeout, 2.0))
        self._writers_out(deadline)  # a goodbye goes after the messages before it
        # leaving alone: tell the peers, so their calls to us fail now rather than at their
        # deadline (after a graceful shutdown's coordination every worker leaves: a goodbye
        # nobody receives would be left on the duplicate, and MPI may hand a message of a
        # freed communicator to the next one). Sent with no lock held, like any send.
        bye = _BYE_ENVS[0]
        head = _u8(pack_prefix(bye, b"", []) + _NO_TAG + bye)
        for r in range(self.size) if not graceful else ():
            if r != self.rank and r not in self.gone:
                try:
                    req = self.be.send(head, r, HEAD_TAG)
                except HpcdpError:
                    continue
                with self._lock:
                    self._sends.append(([req], head, r, 0))
        # let our last sends (replies, acknowledgements, goodbyes) complete; a poll on the way
        # also takes the small data of refused messages off the duplicate
        self.poll()
        while self._sends and time.monotonic() < deadline:
            if self.poll() is None or self._stop:
                time.sleep(1e-4)
            if self._stop:
                break
        with self._park:
            self._park.notify_all()
        # the token holder never runs user code, so it lets go within one poll
        if not self._token.acquire(timeout=max(1.0, deadline - time.monotonic())):
            self._stop = True  # every later poll does nothing; the duplicate is left as is
            LOG.warning("hpcdp.rpc: rank %d: RPC progress did not stop; its channel is left "
                        "open", self.rank)
            return
        try:
            self._stop = True  # from here on poll() does nothing
        finally:
            self._token.release()
        if not self._writers_out(deadline):
            LOG.warning("hpcdp.rpc: rank %d: a send is still blocked on its peer; the RPC "
                        "channel is left open", self.rank)
            return
        for q in self._incoming.values():
            _GRAVEYARD.extend(q)  # receives posted for a message may still be written to
        _GRAVEYARD.extend(self._sends)
        self._incoming, self._sends = {}, []
        try:
            self.be.shutdown()
        except Exception as exc:  # noqa: BLE001 - leaving anyway
            LOG.debug("hpcdp.rpc: rank %d: shutting the RPC channel down: %s", self.rank, exc)

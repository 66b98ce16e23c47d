"""MPI ranks: a duplicated communicator served by one progress thread (MPI_THREAD_MULTIPLE).

A message is a head (prefix, lengths, data tag, envelope fields and a body of at most 4 KiB, in
one MPI message on ``ENV_TAG``) followed by a larger body and each array as their own messages
on a data tag unique to the message, sent straight from the array (zero-copy). The receiver
checks the head against its limits, then matches each data message (``MPI_Improbe``), checks its
size against the announced one and only then receives it into a buffer of that size: never a
truncated receive, which Open MPI 4 does not survive for large messages (a refused or forged
message that is too large is matched and left with its sender). Any thread posts sends
(nonblocking). Progress (matching heads, completing receives and sends, delivering in order per
source) is made by whichever thread holds the progress token (``poll``): an idle thread of the
agent's pool leads (``_pool``), and a thread waiting for its own reply polls itself, so a call
and its reply cross no thread handoff on the way back. Polling backs off to millisecond sleeps
when idle, since Open MPI's blocking calls would hold a core.

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
from typing import Any, Sequence

import numpy as np

from ..errors import BackendUnavailableError, HpcdpError, PeerFailureError, ProtocolError
from ._codec import Limits
from ._transport_base import BYE, Deliver, Lost, Transport
from ._wire import (
    MAX_ENVELOPE, PREFIX, Frame, check_sizes, pack_envelope, pack_prefix, parse_prefix,
)

__all__ = ["MPITransport"]

LOG = logging.getLogger("hpcdp.rpc")

ENV_TAG = 1
_DATA_TAG0 = 16
_CHUNK = 1 << 30  # MPI counts are ints: larger arrays go in several messages
_INLINE = 4096    # bodies up to this size travel in the head message, larger ones as data
_TAG = struct.Struct("<I")
_GRAVEYARD: list[Any] = []  # requests dropped by a non-graceful close: MPI may still use them
_BYE_ENV = pack_envelope([BYE, 0])
_BYE_HEAD = pack_prefix(_BYE_ENV, b"", []) + _TAG.pack(0) + _BYE_ENV


def _mpi_comm(group: Any) -> Any:
    """The MPI communicator under ``group`` (``native_comm()`` once backends offer it)."""
    be = group.backend
    native = getattr(be, "native_comm", None)
    return native() if callable(native) else be.comm


def _chunks(n: int) -> list[tuple[int, int]]:
    return [(a, min(a + _CHUNK, n)) for a in range(0, n, _CHUNK)]


class _Incoming:
    """A message whose arrays are still arriving: each chunk is matched (``Improbe``) and its
    size checked against the announced one before a receive is posted into it."""

    __slots__ = ("env", "body", "bufs", "chunks", "next", "reqs", "refused", "tag")

    def __init__(self, env: bytes | None, body: Any, bufs: list, tag: int,
                 refused: str | None = None, fill: list | None = None) -> None:
        self.env, self.body, self.bufs, self.tag, self.refused = env, body, bufs, tag, refused
        self.chunks = [a[lo:hi] for a in (bufs if fill is None else fill)
                       for lo, hi in _chunks(a.size)]
        self.next = 0
        self.reqs: list[Any] = []


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
        self._incoming: dict[int, collections.deque[_Incoming]] = collections.defaultdict(
            collections.deque)
        self._discards: list[tuple[int, int, int]] = []  # (src, tag, messages left)
        self._scratch = bytearray(64 << 10)
        self._stop = False
        self._closed = False
        self._token = threading.Lock()  # held by the one thread making progress
        self.pumpers = 0  # threads polling for their own replies (the pool's leader yields)
        self.gone: dict[int, str] = {}
        self._max_env = PREFIX.size + 8 * limits.max_buffers + _TAG.size + MAX_ENVELOPE + _INLINE

    def start(self) -> None:
        """Nothing to start: the agent's pool threads take turns calling ``poll``."""

    # -- sending ---------------------------------------------------------------------------
    def send(self, dst: int, env: bytes, body: bytes, buffers: Sequence[memoryview]) -> None:
        MPI = self.MPI
        lens = [b.nbytes for b in buffers]
        tag = _DATA_TAG0 + next(self._tags) % self.tag_span
        inline = len(body) <= _INLINE
        head = pack_prefix(env, body, lens) + _TAG.pack(tag) + env + (body if inline else b"")
        if not inline:  # a large body follows as data, so the head stays small and refusable
            buffers = [memoryview(body), *buffers]
        if dst in self.gone:
            raise PeerFailureError(f"rpc send from rank {self.rank} to rank {dst}: "
                                   f"{self.gone[dst]}", peers=[dst])
        with self._lock:
            if self._closed:
                raise HpcdpError(f"rpc send from rank {self.rank}: this worker has shut down")
            reqs = [self.comm.Isend([head, MPI.BYTE], dst, ENV_TAG)]
            for b in buffers:
                for lo, hi in _chunks(b.nbytes):
                    reqs.append(self.comm.Isend([b[lo:hi], MPI.BYTE], dst, tag))
            self._sends.append((reqs, (head, buffers)))

    # -- progress: whoever holds the token polls -------------------------------------------
    def poll(self) -> bool | None:
        """One round of progress unless another thread is making it: True if something moved,
        False if nothing did, None if the token is taken (or the transport closed)."""
        if self._stop or not self._token.acquire(blocking=False):
            return None
        try:
            return self._poll()
        except Exception:  # noqa: BLE001 - keep serving; the message at fault is logged
            LOG.exception("hpcdp.rpc: rank %d: MPI progress error", self.rank)
            return True
        finally:
            self._token.release()

    def waiting(self, delta: int) -> None:
        """A thread starts (+1) or stops (-1) polling for its own reply (``Future.wait``)."""
        with self._lock:
            self.pumpers += delta

    def _poll(self) -> bool:
        MPI = self.MPI
        busy = False
        st = MPI.Status()
        while True:
            msg = self.comm.Improbe(MPI.ANY_SOURCE, ENV_TAG, st)
            if msg is None:
                break
            busy = True
            self._envelope(msg, st.Get_source(), st.Get_count(MPI.BYTE))
        if self._discards:
            busy |= self._discard()
        for src, q in self._incoming.items():
            for m in q:
                if m.next < len(m.chunks):
                    busy |= self._match(src, m, st)
            while q and q[0].next == len(q[0].chunks) and (
                    not q[0].reqs or MPI.Request.Testall(q[0].reqs)):
                m = q.popleft()
                busy = True
                self.deliver(src, Frame(m.env, m.body, m.bufs, m.refused))
        with self._lock:
            if self._sends:
                keep = [s for s in self._sends if not MPI.Request.Testall(s[0])]
                busy |= len(keep) != len(self._sends)
                self._sends = keep
        return busy

    def _match(self, src: int, m: _Incoming, st: Any) -> bool:
        """Post receives for the chunks of ``m`` that have arrived, checking each one's size
        first: a receive into a smaller buffer (truncation) is not safe with every MPI."""
        MPI, busy = self.MPI, False
        while m.next < len(m.chunks):
            msg = self.comm.Improbe(src, m.tag, st)
            if msg is None:
                break
            busy = True
            view, n = m.chunks[m.next], st.Get_count(MPI.BYTE)
            if n != len(view):
                _GRAVEYARD.append(msg)  # never received: its bytes stay with the sender
                LOG.warning("hpcdp.rpc: rank %d: rank %d sent an array chunk of %d bytes where "
                            "%d were announced", self.rank, src, n, len(view))
                left = len(m.chunks) - m.next - 1
                if left:
                    self._discards.append((src, m.tag, left))
                m.refused = f"an array chunk of {n} bytes where {len(view)} were announced"
                m.body, m.bufs, m.next = None, [], len(m.chunks)
                break
            m.reqs.append(msg.Irecv([view, MPI.BYTE]))
            m.next += 1
        return busy

    def _envelope(self, msg: Any, src: int, n: int) -> None:
        MPI = self.MPI
        if n > self._max_env or n < PREFIX.size + _TAG.size:
            _GRAVEYARD.append(msg)  # matched but never received: nothing allocated for it
            LOG.warning("hpcdp.rpc: rank %d refused a %d-byte envelope from rank %d", self.rank,
                        n, src)
            return
        raw = bytearray(n)
        msg.Recv([raw, MPI.BYTE])
        view = memoryview(raw)
        try:
            env_len, body_len, nbuf = parse_prefix(view[:PREFIX.size], self.limits)
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
            self.gone[src] = "it left (shutdown(graceful=False))"
            self.lost(src, self.gone[src], False)
            return
        refused = check_sizes(env_len, body_len, lens, self.limits)
        if refused is not None:
            LOG.warning("hpcdp.rpc: rank %d refused a message from rank %d: %s", self.rank, src,
                        refused)
            count = sum(len(_chunks(k)) for k in lens) + (0 if inline else len(_chunks(body_len)))
            if count:
                self._discards.append((src, tag, count))
            self._incoming[src].append(_Incoming(env, None, [], tag, refused))
            return
        bufs = [np.empty(k, np.uint8) for k in lens]
        if inline:
            self._incoming[src].append(_Incoming(env, body, bufs, tag))
        else:
            body = np.empty(body_len, np.uint8)
            self._incoming[src].append(_Incoming(env, body, bufs, tag, fill=[body, *bufs]))

    def _discard(self) -> bool:
        """Drop the arrays of refused messages: small chunks are read into a scratch buffer,
        larger ones are left with the sender (matched, never received)."""
        MPI, busy, left = self.MPI, False, []
        st = MPI.Status()
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
        self._token.acquire(timeout=max(1.0, deadline - time.monotonic()))
        self._stop = True  # from here on poll() does nothing
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

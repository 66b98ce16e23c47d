"""TCP backend: rendezvous through rank 0's store, an authenticated full mesh, shared algorithms.

Startup (``create_world``), in order, on every rank:

1. read ``RANK``, ``WORLD_SIZE``, ``HPCDP_MASTER_ADDR``/``MASTER_ADDR``, ``..._PORT`` and
   ``HPCDP_SECRET`` (required; strong when the job listens beyond loopback); rank 0 starts the
   store on the master address. Each ``init`` of the process is a new generation, in the store
   keys and in every handshake, so init -> finalize -> init never reaches the previous store;
2. listen on loopback (local jobs) or on the interface that routes to the master, publish
   ``host:port`` in the store;
3. connect to every higher rank and accept every lower one, each connection authenticated;
   the listener sheds floods like the store (``_accept``) and connects are retried;
4. publish ``ready/<rank>`` and wait for every rank's, so no rank starts before the mesh exists
   (store keys are prefixed with the generation).

Collectives run ``_algorithms`` on a per-group worker thread (``_runner.P2PBackend``); ``send``/``recv`` post directly.
Every collective frame carries its call's signature, so ranks that call different collectives
raise ``CollectiveMismatchError`` instead of mixing data (``_coll``).
"""
from __future__ import annotations

import itertools
import os
import socket
import threading
import time
import zlib
from typing import Any, Mapping, Sequence

import numpy as np

from ..._config import check_timeout, setting
from ...errors import (BackendUnavailableError, CollectiveMismatchError, CommTimeoutError,
                      PeerFailureError)
from .._runner import P2PBackend, Runner
from ..base import ANY_SOURCE, Probed, Request
from . import _coll as coll
from . import _wire as wire
from ._accept import AuthListener, connect
from ._store import StoreClient, StoreServer
from ._transport import COLL, P2P, Transport

__all__ = ["TCPBackend", "create_world", "bind_address"]

DEFAULT_PORT = 29500
#: one per ``create_world`` in this process; every rank of a job inits the same number of times
_GENERATIONS = itertools.count()


_is_loopback = wire.is_loopback


def bind_address(master: str) -> str:
    """Loopback for local jobs; else the address of the interface that routes to the master."""
    explicit = setting("HPCDP_BIND_ADDR")
    if explicit:
        return explicit
    if _is_loopback(master):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(master), 9))  # no packet is sent for UDP connect
        return s.getsockname()[0]


class _GroupP2P:
    """The ``_algorithms`` p2p interface for one group: group ranks, its collective channel,
    and the signature of the collective running (``begin``/``end``) stamped on every frame."""

    def __init__(self, be: "TCPBackend") -> None:
        self.be = be
        self.t = be.transport
        self.checks = be.transport.checks
        self.rank, self.size = be.rank, be.size
        self.ranks = be.ranks
        self.channel = be.channel
        self.state = self.checks.open_channel(be.channel, be.ranks)
        self.sig = wire.NOSIG
        self._waiting: Any = None

    def begin(self, seq: int, call: tuple) -> None:
        self.sig = sig = coll.make_sig(*call, seq)
        self.checks.coll_begin(self.state, sig)

    def end(self, ok: bool) -> None:
        self.checks.coll_end(self.state, self.channel, ok)

    def isend(self, buf: np.ndarray, dst: int, tag: int) -> Any:
        g = self.ranks[dst]
        return self.t.isend(buf, g, COLL, self.channel, tag,
                            ("collective send to rank %d on group %d", g, self.channel), self.sig)

    def irecv(self, buf: np.ndarray, src: int, tag: int) -> Any:
        g = self.ranks[src]
        return self.t.irecv(buf, g, COLL, self.channel, tag,
                            ("no collective message from rank %d%s (tag %d) on group %d", g,
                             self.t.where.get(g, ""), tag, self.channel), self.sig)

    def wait(self, reqs: Sequence[Any]) -> None:
        try:
            for rq in reqs:
                self._waiting = rq
                try:
                    # a peer that dies anywhere in the group fails the collective within the tick
                    if not rq.wait(0.2):
                        self._wait_long(rq)
                except PeerFailureError:
                    time.sleep(0.05)  # name the crashed rank, not a peer that gave up for it
                    self.check_usable("collective")
                    raise
        finally:
            self._waiting = None  # (a failed wait too: the request holds the call's buffer)

    def _wait_long(self, rq: Any) -> None:
        """A receive that takes a while: after ``PROBE_AFTER`` s, ask its sender (now and then)
        whether it runs the same call, so mismatched roots fail instead of timing out."""
        src = rq.key[0] if getattr(rq, "key", None) else None
        probe_at = time.monotonic() + coll.PROBE_AFTER - 0.2
        while not rq.wait(0.2):
            self.check_usable("collective")
            if src is not None and time.monotonic() >= probe_at:
                self.checks.send_probe(src, self.channel, self.sig)
                probe_at = time.monotonic() + coll.PROBE_EVERY

    def check_usable(self, what: str) -> None:
        t = self.t
        dead = [r for r in self.ranks if r in t.crashed]
        if dead:
            raise PeerFailureError(f"{what} on rank {t.rank}: rank {dead[0]} {t.dead[dead[0]]}",
                                   peers=dead)
        mismatched = self.checks.mismatched
        if mismatched:
            text = mismatched.get(self.channel)
            if text:  # the channel stays failed (``_coll``): say what works instead
                raise CollectiveMismatchError(f"{what} on rank {t.rank}: {text}; "
                                              f"{self.be.broken_advice}")
        why = t.aborted.get((COLL, self.be.channel))
        if why:
            raise PeerFailureError(f"{what} on rank {t.rank}: {why}; {self.be.broken_advice}")

    def pending(self) -> str:
        rq = self._waiting
        return rq.pending() if rq is not None else "between messages"

    def abort(self, why: str) -> None:
        self.t.abort_channel(COLL, self.be.channel, f"rank {self.t.rank}: {why}", self.ranks,
                             notify=True)


class TCPBackend(P2PBackend):
    """One group on the mesh; sub-groups share the sockets and differ by channel id."""

    name = "tcp"
    max_tag = 2**31 - 1
    recv_size_checked = True  # a wrong-sized receive fails, its message drained (``_frames``)
    carries_meta = True  # in the p2p frame header's signature fields (``_wire.p2p_sig``)

    def __init__(self, world: "_World", ranks: tuple[int, ...], channel: int) -> None:
        self.world = world
        self.transport = world.transport
        self.ranks = ranks
        self.size = len(ranks)
        self.rank = ranks.index(world.transport.rank)
        self.channel = channel
        self._subgroups = 0
        self._p2p = _GroupP2P(self)
        self._runner = Runner(self._p2p, f"tcp{world.transport.rank}-ch{channel}")

    def send(self, buf: np.ndarray, dst: int, tag: int) -> Request:
        g = self.ranks[dst]
        return self.transport.isend(buf, g, P2P, self.channel, tag, f"send to rank {g} tag {tag}",
                                    wire.p2p_sig(buf))

    def recv(self, buf: np.ndarray, src: int, tag: int) -> Request:
        g = self.ranks[src]
        return self.transport.irecv(buf, g, P2P, self.channel, tag,
                                    ("no message from rank %d%s with tag %d", g,
                                     self.transport.where.get(g, ""), tag), wire.recv_sig(buf))

    def probe(self, src: int, tag: int) -> tuple[int, int, int] | None:
        """(source, tag, nbytes) of a message waiting for this rank, else None."""
        found = self.probe_meta(src, tag)
        return None if found is None else found[:3]

    def probe_meta(self, src: int, tag: int) -> Probed | None:
        """``probe`` with the dtype and shape the message's header says it was sent with."""
        srcs = self.ranks if src == ANY_SOURCE else (self.ranks[src],)
        found = self.transport.probe(srcs, self.channel, tag, with_sig=True)
        if found is None:
            return None
        g, t, nbytes, sig = found
        return Probed(self.ranks.index(g), t, nbytes, *wire.p2p_meta(sig, nbytes))

    def peers_gone(self) -> dict[int, str]:
        """Group ranks whose connection ended (crashed, or finalized), with why."""
        dead = self.transport.dead
        return {i: f"rank {g} {dead[g]}" for i, g in enumerate(self.ranks) if g in dead}

    def tell_waiting(self, peers: Sequence[int], note: str) -> None:
        """A WAITING control frame to each of ``peers`` (group ranks) over the mesh."""
        self.transport.tell_waiting([self.ranks[p] for p in peers], note)

    def waiting_notes(self) -> dict[int, tuple[float, str]]:
        return dict(self.transport.frames.waits)  # the mesh is the process's: every channel's

    def dup(self) -> "TCPBackend":
        """Collective: these ranks on a channel of their own over the same authenticated
        connections (frames carry the channel id, so nothing crosses between channels)."""
        dup = self.new_group(range(self.size))
        assert dup is not None
        return dup

    def new_group(self, ranks: Sequence[int]) -> "TCPBackend | None":
        # every member of this group calls new_group in the same order, so the id agrees
        self._subgroups += 1
        channel = zlib.crc32(f"{self.channel}/{self._subgroups}".encode()) & 0x7FFFFFFF
        if self.rank not in ranks:
            return None
        return TCPBackend(self.world, tuple(self.ranks[r] for r in ranks), channel)

    def split(self, color: int | None, key: int,
              layout: Mapping[int, Sequence[int]]) -> "TCPBackend | None":
        """Collective, but nothing to send: ``layout`` is the same on every rank, so each color's
        members agree on a channel id of their own from the parent's channel, the count of its
        sub-groups and the color (as ``new_group`` does for one group)."""
        self._subgroups += 1
        if color is None:
            return None
        channel = zlib.crc32(
            f"{self.channel}/{self._subgroups}/{color}".encode()) & 0x7FFFFFFF
        return TCPBackend(self.world, tuple(self.ranks[r] for r in layout[color]), channel)

    def take(self, src: int, tag: int) -> np.ndarray | None:
        """The message ``probe(src, tag)`` reported, if it arrived before any receive was posted
        for it: the buffer the frame reader filled, handed over (no second copy)."""
        return self.transport.take(self.ranks[src], self.channel, tag)

    def cap_unposted(self, nbytes: int, tag: int | None = None) -> None:
        """Drop p2p messages of more than ``nbytes`` (with ``tag``; None: every tag without a
        cap of its own) that arrive before their receive is posted: drained off the socket, no
        more than the cap allocated for them; ``probe`` never reports them."""
        t = self.transport
        with t.lock:
            if tag is None:
                t.unposted_caps[self.channel] = int(nbytes)
            else:
                t.unposted_tag_caps[(self.channel, int(tag))] = int(nbytes)

    def bound_sends(self, seconds: float) -> None:
        """A send on this group whose peer takes no byte for ``seconds`` fails that peer
        (``PeerFailureError``: "stopped reading") instead of blocking on (``Transport._put``)."""
        self.transport.bound_sends(self.channel, seconds)

    def shutdown(self) -> None:
        self._runner.stop()
        if self.channel == 0:
            self.world.close()
        else:
            self.transport.close_channel(self.channel)

    def describe(self) -> str:
        return f"tcp(rank {self.rank} of {self.size}, channel {self.channel})"


class _World:
    """Process-wide state: the store (rank 0), the listener and the transport."""

    def __init__(self, rank: int, size: int, master: str, port: int, secret: bytes,
                 timeout: float, generation: int = 0) -> None:
        self.rank, self.size = rank, size
        self.secret = secret
        self.generation = gen = generation
        self.server: StoreServer | None = None
        self.transport = Transport(rank, size, wire.max_frame())
        self._closed = False
        self._expected = set(range(rank))
        self._cv = threading.Condition()
        host = bind_address(master)
        if rank == 0:
            store_host = host if not _is_loopback(master) else "127.0.0.1"
            self.server = StoreServer(store_host, port, secret, generation=gen)
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.bind((host, 0))
        self.listener.listen(max(128, size))
        # the same gate as the store: capped unauthenticated handshakes, rate-limited log
        self._acceptor = AuthListener(self.listener, secret, wire.ROLE_PEER, rank,
                                      f"rank {rank} peer listener", self._admit,
                                      served="admission", generation=gen)
        self.store = StoreClient(master, port, secret, rank, timeout, generation=gen)
        lhost, lport = self.listener.getsockname()
        self.store.set(f"{gen}/addr/{rank}", f"{lhost}:{lport}".encode())
        deadline = time.monotonic() + timeout
        for peer in range(rank + 1, size):
            addr = self.store.get(f"{gen}/addr/{peer}", max(0.0, deadline - time.monotonic()))
            h, p = addr.decode().rsplit(":", 1)
            # retried: the peer's listener may be shedding a flood of unauthenticated connections
            sock = connect(h, int(p), secret, wire.ROLE_PEER, rank, peer, deadline,
                           f"tcp rendezvous (rank {rank}): cannot reach rank {peer} at {h}:{p} "
                           f"within {timeout:g} s", generation=gen)
            self.transport.add_peer(peer, sock)
        with self._cv:
            while self._expected:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommTimeoutError(
                        f"tcp rendezvous (rank {rank}): ranks {sorted(self._expected)} did not "
                        f"connect within {timeout:g} s")
                self._cv.wait(left)
        self.store.set(f"{gen}/ready/{rank}", b"1")
        for r in range(size):
            self.store.get(f"{gen}/ready/{r}", max(0.0, deadline - time.monotonic()))

    def _admit(self, conn: socket.socket, _addr: object, claimed: int) -> None:
        """An authenticated peer joins the mesh, once, if it is a lower rank (they connect up)."""
        with self._cv:
            if self._closed or claimed not in self._expected:
                raise wire.ProtocolError(f"unexpected connection claiming rank {claimed} "
                                         f"(mesh of rank {self.rank} has no slot for it)")
            self._expected.discard(claimed)
            self.transport.add_peer(claimed, conn)
            self._cv.notify_all()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._acceptor.close()
        self.transport.close()
        self.store.close()
        if self.server is not None:
            self.server.close()


def _connect_timeout(given: float | None) -> float:
    """``connect_timeout=`` or ``HPCDP_CONNECT_TIMEOUT`` (default 60 s), checked like every
    timeout: finite and > 0."""
    if given is not None:
        return check_timeout("init(backend='tcp', connect_timeout=...)", given)
    return setting("HPCDP_CONNECT_TIMEOUT")


def create_world(*, connect_timeout: float | None = None) -> TCPBackend:
    """The world backend of this process, from the torchrun-style environment.

    Args:
        connect_timeout: seconds to reach the store and the peers (``HPCDP_CONNECT_TIMEOUT``,
            default 60).
    """
    # the HPCDP_ address and port win over the plain names; the plain rank and size win
    master = setting("HPCDP_MASTER_ADDR") or os.environ.get("MASTER_ADDR") or None
    rank_s = os.environ.get("RANK") or setting("HPCDP_RANK")
    size_s = os.environ.get("WORLD_SIZE") or setting("HPCDP_WORLD_SIZE")
    if not master or rank_s is None or size_s is None:
        raise BackendUnavailableError(
            "tcp backend: set HPCDP_MASTER_ADDR (or MASTER_ADDR), RANK and WORLD_SIZE, "
            "or start the job with hpcdp-run")
    port = setting("HPCDP_MASTER_PORT")
    if port is None:
        port = int(os.environ.get("MASTER_PORT") or DEFAULT_PORT)
    rank, size = int(rank_s), int(size_s)
    if not 0 <= rank < size:
        raise BackendUnavailableError(f"tcp backend: RANK={rank} is outside WORLD_SIZE={size}")
    # a secret that guards ports beyond this host must be hard to guess (loopback jobs: any)
    network = not (_is_loopback(master) and bind_address(master).startswith("127."))
    secret = wire.get_secret(network=network)
    wire.max_frame()  # bad HPCDP_MAX_FRAME or HPCDP_HANDSHAKE_TIMEOUT: an error before
    wire.handshake_timeout()  # anything listens
    ct = _connect_timeout(connect_timeout)
    world = _World(rank, size, master, port, secret, ct, generation=next(_GENERATIONS))
    return TCPBackend(world, tuple(range(size)), 0)

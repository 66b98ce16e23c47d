"""Ranks that are threads of one process (``Backend.shares_process``, e.g. simulated ranks): one
inbox queue per rank, a dispatcher thread each.

Messages are copied once on send, as a network would, so caller and callee never share arrays.
The ranks meet at a hub that rank 0 creates and names through the group (a random token), so
any backend whose ranks share a process gets this transport without hpcdp knowing it. A rank the
backend reports gone (``Backend.peers_gone``) is reported lost to its peers; a rank that shut
down gracefully leaves the hub first, so its later exit is not a failure.
"""
from __future__ import annotations

import functools
import queue
import secrets
import threading
import weakref
from typing import Any, Sequence

import numpy as np

from ..errors import HpcdpError, PeerFailureError
from ._codec import Limits
from ._transport_base import Deliver, Lost, Transport, exchange_bytes
from ._wire import Frame, check_sizes

__all__ = ["SimTransport"]

_TICK = 0.05


class _Hub:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.members: dict[int, "SimTransport"] = {}
        self.left: set[int] = set()


#: live hubs by token; a hub lives as long as a transport holds it
_hubs: "weakref.WeakValueDictionary[str, _Hub]" = weakref.WeakValueDictionary()
_hubs_lock = threading.Lock()


def _join_hub(group: Any, timeout: float) -> _Hub:
    """Collective: rank 0 makes the hub and sends its token; every rank finds it by the token."""
    hub = None
    token = b""
    if group.rank == 0:
        hub = _Hub()
        token = secrets.token_hex(16).encode()
        with _hubs_lock:
            _hubs[token.decode()] = hub
    token = exchange_bytes(group, token, timeout)[0]
    if hub is None:
        with _hubs_lock:
            hub = _hubs.get(token.decode("ascii", "replace"))
    if hub is None:
        raise HpcdpError(f"init_rpc (rank {group.rank}): rank 0's RPC hub is not in this process; "
                         f"the {group.backend.name} backend says its ranks share a process "
                         "(shares_process) but they do not")
    return hub


class SimTransport(Transport):
    """RPC between ranks that are threads of this process."""

    name = "threads"

    def __init__(self, group: Any, limits: Limits, deliver: Deliver, lost: Lost,
                 timeout: float) -> None:
        super().__init__(group.rank, group.size, limits, deliver, lost)
        self.backend = group.backend
        self.hub = _join_hub(group, timeout)
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.closed = False
        self.gone: set[int] = set()
        with self.hub.lock:
            self.hub.left.discard(self.rank)
            self.hub.members[self.rank] = self
        self.gen = 0  # which dispatcher serves the inbox (a new one after a hand-off)
        self._glock = threading.Lock()
        self.thread = self._dispatcher()

    def _dispatcher(self) -> threading.Thread:
        return threading.Thread(target=self._run, args=(self.gen,), daemon=True,
                                name=f"hpcdp-rpc-sim{self.rank}.{self.gen}")

    def start(self) -> None:
        self.thread.start()

    def _replace(self, gen: int) -> None:
        """Hand the inbox to a new dispatcher (this one's inline callee runs long)."""
        with self._glock:
            if self.gen != gen or self.closed:
                return
            self.gen += 1
            t = self.thread = self._dispatcher()
        t.start()

    def send(self, dst: int, env: bytes, body: bytes, buffers: Sequence[memoryview]) -> None:
        if self.closed:
            raise HpcdpError(f"rpc send from rank {self.rank}: this worker has shut down")
        with self.hub.lock:
            peer = self.hub.members.get(dst)
            left = dst in self.hub.left
        if peer is None or peer.closed:
            why = self.backend.peers_gone().get(dst)
            if left and why is None:
                why = "it has shut down its RPC agent"
            raise PeerFailureError(f"rpc send from rank {self.rank} to rank {dst}: "
                                   f"{why or 'it is not running RPC'}", peers=[dst])
        frame = Frame(bytes(env), bytes(body), [np.frombuffer(b, np.uint8).copy() for b in buffers])
        peer.inbox.put((self.rank, frame))

    def _run(self, gen: int) -> None:
        """The dispatcher (the inbox's serving duty): delivers in order, runs short callees."""
        handoff = functools.partial(self._replace, gen)
        while self.gen == gen:
            try:
                item = self.inbox.get(timeout=_TICK)
            except queue.Empty:
                item = None
            if item is None:
                if self.closed:
                    return
                self._check_peers()
                continue
            src, frame = item
            reason = check_sizes(len(frame.env), len(frame.body), [len(b) for b in frame.buffers],
                                 self.limits)
            if reason is not None:
                frame = Frame(frame.env if len(frame.env) <= 4096 else None, None, [], reason)
            task = self.deliver(src, frame, True)
            if task is not None:
                task.run(handoff)

    def _check_peers(self) -> None:
        dead = self.backend.peers_gone()
        if self.rank in dead and not self.closed:
            self.close(False, 0.0)  # this rank's thread died: its agent goes with it
            return
        with self.hub.lock:
            members, left = set(self.hub.members), set(self.hub.left)
        for r in range(self.size):
            if r == self.rank or r in self.gone:
                continue
            if r in dead or r not in members:
                self.gone.add(r)
                why = dead.get(r) or "it shut down its RPC agent"
                self.lost(r, why, r in left)

    def close(self, graceful: bool, timeout: float) -> None:
        if self.closed:
            return
        with self.hub.lock:
            self.closed = True
            self.hub.members.pop(self.rank, None)
            if graceful:
                self.hub.left.add(self.rank)
            peers = list(self.hub.members.values())
        for p in peers:
            p.inbox.put(None)  # wake them: they look at the hub on their next tick
        self.inbox.put(None)
        t = self.thread
        if threading.current_thread() is not t:
            t.join(timeout)

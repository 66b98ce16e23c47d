"""Graceful ``shutdown()``: every worker stops only when no RPC work is left anywhere.

1. Each worker sends READY to the leader (rank 0): its user makes no further calls (functions it
   serves still may, for calls not yet finished).
2. Once every live worker is ready, the leader probes all of them: each answers whether it is
   idle (no outstanding request, no queued or running callee, no queued protocol message or
   callback) and how many messages it has sent to and received from each peer. Every message
   is a request whose sender waits for the reply, or that reply, so when every worker is idle
   nothing is in flight; work is done when that holds in two probe rounds in a row with
   identical counts (nothing moved between the rounds: the classic double-counting check).
   The protocol messages of RRefs (forks, deletes) are requests too, so they are finished.
3. The leader sends GO; each worker answers and closes (saying BYE on TCP); the leader closes
   last. A worker that fails meanwhile is left out; a leader that fails ends the wait of the
   others with ``PeerFailureError``.
"""
from __future__ import annotations

import threading
import time
from typing import Any

from ..errors import CommTimeoutError, HpcdpError, PeerFailureError
from . import _protocol as P
from ._future import callbacks_idle

__all__ = ["Coordinator", "LEADER"]

LEADER = 0
_ROUND_PAUSE = 0.005


class Coordinator:
    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self.cv = threading.Condition()
        self.ready: set[int] = set()
        self.go = False

    # -- messages (on the control thread) -----------------------------------------------------
    def handle(self, src: int, mid: int, kind: int) -> None:
        a = self.agent
        if kind == P.READY:
            if a.rank != LEADER:
                raise HpcdpError(f"rank {a.rank} got READY from rank {src} but is not the leader")
            with self.cv:
                self.ready.add(src)
                self.cv.notify_all()
            a.reply(src, mid, True, kind=P.CRESULT)
        elif kind == P.PROBE:
            a.reply(src, mid, self.snapshot(on_control=True), kind=P.CRESULT)
        elif kind == P.GO and src == LEADER:
            with a._lock:
                if a.state == "running":
                    a.state = "closing"
            a.reply(src, mid, True, kind=P.CRESULT)
            with self.cv:
                self.go = True
                self.cv.notify_all()

    def snapshot(self, on_control: bool = False) -> list:
        a = self.agent
        quiet = a.house.control_queue_empty() if on_control else a.house.control_idle()
        idle = quiet and a.pending_count() == 0 and a.pool.idle() and callbacks_idle()
        with a._lock:
            return [idle, list(a.sent), list(a.recv)]

    def peer_lost(self, peer: int) -> None:
        with self.cv:
            self.cv.notify_all()

    # -- the user's call --------------------------------------------------------------------
    def shutdown(self, graceful: bool, timeout: float) -> None:
        a = self.agent
        if a.state == "closed":
            return
        if not graceful:
            a.close(False, "shutdown(graceful=False)")
            return
        deadline = time.monotonic() + timeout
        try:
            a.internal(LEADER, "READY", [], timeout=timeout)
            if a.rank == LEADER:
                self._lead(deadline, timeout)
            else:
                self._follow(deadline, timeout)
        except BaseException:
            a.close(False, "shutdown failed")
            raise
        a.close(True, "shutdown()")

    def _left(self, deadline: float, timeout: float, waiting_for: str) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise CommTimeoutError(f"rpc.shutdown on rank {self.agent.rank}: {waiting_for} "
                                   f"after {timeout:g} s")
        return left

    def _follow(self, deadline: float, timeout: float) -> None:
        a = self.agent
        with self.cv:
            while not self.go:
                if LEADER in a.lost:
                    raise PeerFailureError(f"rpc.shutdown on rank {a.rank}: the leader "
                                           f"(rank {LEADER}) failed: {a.lost[LEADER]}",
                                           peers=[LEADER])
                self.cv.wait(min(0.1, self._left(deadline, timeout, "no GO from rank 0")))

    def _live(self) -> list[int]:
        return [r for r in range(self.agent.size) if r not in self.agent.lost]

    def _lead(self, deadline: float, timeout: float) -> None:
        a = self.agent
        with self.cv:
            while not set(self._live()) <= self.ready:
                missing = sorted(set(self._live()) - self.ready)
                self.cv.wait(min(0.1, self._left(
                    deadline, timeout, f"ranks {missing} did not call shutdown()")))
        prev = None
        while True:
            live = self._live()
            futs = {r: a.internal(r, "PROBE", [], timeout=self._left(deadline, timeout, "probe"))
                    for r in live if r != a.rank}
            snaps = {a.rank: self.snapshot()}
            for r, f in futs.items():
                try:
                    snaps[r] = f.wait()
                except PeerFailureError:
                    pass  # left out from the next round on
            key = self._quiet(snaps) if set(snaps) == set(self._live()) else None
            if key is not None and key == prev:
                break
            prev = key
            self._left(deadline, timeout, "RPC work still in progress")
            time.sleep(_ROUND_PAUSE)
        gos = [a.internal(r, "GO", [], timeout=self._left(deadline, timeout, "GO"))
               for r in self._live() if r != a.rank]
        with a._lock:
            a.state = "closing"
        for f in gos:
            try:
                f.wait()
            except PeerFailureError:
                pass

    @staticmethod
    def _quiet(snaps: dict[int, Any]) -> tuple | None:
        """The message counts if every worker is idle, else None.

        Every counted message is a request (its sender waits for the reply) or a reply (its
        receiver waits for it), so when all are idle nothing counted is in flight; equal
        counts in two rounds in a row show nothing moved in between. Counts are not matched
        pairwise: a peer that forges frames past its agent would make them disagree forever.
        """
        for s in snaps.values():
            if type(s) is not list or len(s) != 3 or s[0] is not True:
                return None
        return tuple((r, repr(snaps[r][1]), repr(snaps[r][2])) for r in sorted(snaps))

"""Clocks: a cheap local timestamp per event, and the offsets that line ranks up.

Events are stamped with ``time.monotonic_ns`` (cheap, never jumps). Each process converts to
wall time with one anchor taken at import, and each rank adds the offset to the group root's
clock that ``estimate_clock_offset`` measured, so merged timelines from different nodes line up.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

__all__ = [
    "now_ns", "WALL_MINUS_MONO_NS", "wall_ns", "ClockSync", "estimate_clock_offset",
    "clock_offset_ns", "set_clock_offset", "CLOCK_TAG",
]

#: the timestamp every recorder and timeline uses (CLOCK_MONOTONIC: shared by the processes of
#: one node, never stepped by NTP)
now_ns: Callable[[], int] = time.monotonic_ns

#: p2p tag of the ping-pongs; below 32767, the smallest MPI_TAG_UB the standard allows
CLOCK_TAG = 32_101


def _anchor(samples: int = 7) -> int:
    """``time_ns() - monotonic_ns()`` from the tightest of a few paired readings."""
    best: tuple[int, int] | None = None
    for _ in range(samples):
        a = time.monotonic_ns()
        w = time.time_ns()
        b = time.monotonic_ns()
        if best is None or b - a < best[0]:
            best = (b - a, w - (a + b) // 2)
    assert best is not None
    return best[1]


WALL_MINUS_MONO_NS: int = _anchor()


def wall_ns(mono_ns: int) -> int:
    """This process's wall-clock time of a ``now_ns()`` reading."""
    return mono_ns + WALL_MINUS_MONO_NS


_offsets: dict[int, int] = {}
_offsets_lock = threading.Lock()


def clock_offset_ns(rank: int) -> int:
    """Nanoseconds to add to ``rank``'s wall clock to read the reference rank's (0 if unmeasured)."""
    return _offsets.get(rank, 0)


def set_clock_offset(rank: int, offset_ns: int) -> None:
    """Record ``rank``'s offset; dumps and timelines written afterwards carry it."""
    with _offsets_lock:
        _offsets[int(rank)] = int(offset_ns)


@dataclass(frozen=True)
class ClockSync:
    """One rank's measured offset to the group root's clock.

    ``offset_ns`` is added to this rank's wall clock to get the root's; the true offset lies
    within ``rtt_ns / 2`` of it (the round trip of the best ping-pong).
    """

    offset_ns: int
    rtt_ns: int
    rounds: int


def _default_clock() -> int:
    return time.monotonic_ns() + WALL_MINUS_MONO_NS


def estimate_clock_offset(
    group: Any,
    *,
    rounds: int = 8,
    timeout: float | None = None,
    clock: Callable[[], int] | None = None,
    apply: bool = True,
) -> ClockSync:
    """Collective over ``group``: measure each rank's clock offset to group rank 0.

    Rank 0 ping-pongs ``rounds`` times with each other rank in turn (point-to-point, tag
    ``CLOCK_TAG``) and keeps the exchange with the shortest round trip (NTP's rule: the reply
    was stamped somewhere inside it), then tells each rank its offset. Call it once after
    init, on every rank of the group, before other point-to-point traffic on that tag.

    Args:
        group: a ``ProcessGroup`` (anything with ``rank``, ``size``, ``ranks``, ``send``, ``recv``).
        rounds: ping-pongs per rank; more rounds find a tighter round trip.
        timeout: seconds each send/recv may wait (default: the group's).
        clock: wall-clock reader in nanoseconds (tests inject skewed clocks).
        apply: record the result with ``set_clock_offset`` for this rank's global rank.
    """
    if rounds < 1:
        raise ValueError(f"estimate_clock_offset: rounds must be >= 1, got {rounds}")
    read = clock or _default_clock
    me, n = group.rank, group.size
    if me < 0:
        raise ValueError(f"estimate_clock_offset: this rank is not a member of group {group.name}")
    sync = ClockSync(0, 0, 0)
    if n > 1:
        sync = _root(group, n, rounds, timeout, read) if me == 0 else _peer(group, rounds, timeout, read)
    if apply:
        set_clock_offset(group.ranks[me], sync.offset_ns)
    return sync


def _root(group: Any, n: int, rounds: int, timeout: float | None,
          read: Callable[[], int]) -> ClockSync:
    ping = np.zeros(2, np.int64)
    pong = np.zeros(2, np.int64)
    for peer in range(1, n):
        best_rtt, best_off = -1, 0
        for _ in range(rounds):
            t0 = read()
            ping[0] = t0
            group.send(ping, peer, CLOCK_TAG, timeout=timeout)
            group.recv(pong, peer, CLOCK_TAG, timeout=timeout)
            t2 = read()
            rtt = t2 - t0
            if best_rtt < 0 or rtt < best_rtt:
                # the peer read int(pong[0]) at some instant in [t0, t2]: assume the middle
                best_rtt, best_off = rtt, (t0 + t2) // 2 - int(pong[0])
        ping[0], ping[1] = best_off, best_rtt
        group.send(ping, peer, CLOCK_TAG, timeout=timeout)
    return ClockSync(0, 0, rounds)


def _peer(group: Any, rounds: int, timeout: float | None, read: Callable[[], int]) -> ClockSync:
    buf = np.zeros(2, np.int64)
    reply = np.zeros(2, np.int64)
    for _ in range(rounds):
        group.recv(buf, 0, CLOCK_TAG, timeout=timeout)
        reply[0] = read()
        group.send(reply, 0, CLOCK_TAG, timeout=timeout)
    group.recv(buf, 0, CLOCK_TAG, timeout=timeout)
    return ClockSync(int(buf[0]), int(buf[1]), rounds)

"""What the agent needs from a transport, and the helpers every transport shares.

Contract (one transport per agent, over the ranks of one process group):

1. ``__init__`` is collective over the group (all ranks, same order); it builds the channel but
   delivers nothing until ``start``.
2. ``send(dst, env, body, buffers)`` may be called from any thread, never waits for the peer's
   agent (a peer's transport always reads), and keeps each message whole and in order per
   (sender, receiver). It raises ``PeerFailureError`` when ``dst`` is known to be gone. Arrays
   are sent from the given views (zero-copy where the transport can); the caller must not
   change them until the call's reply arrives. A send that would block first calls
   ``_duty.before_blocking`` (a serving thread must not block holding its duty).
3. ``deliver(src, frame, may_inline)`` is called in order per source and must not block. A
   thread that holds a serving duty passes ``may_inline=True`` and may get back a ``Lent``
   task: it runs it (``Lent.run(handoff)``) with no lock held once the frame is consumed, and
   ``handoff()`` must give the duty to another thread. Frames over this rank's ``Limits``
   arrive with ``refused`` set and no payload.
4. ``lost(src, why, graceful)`` is called once per peer that disconnects (graceful: it said BYE).
5. ``direct(dst)``: None, or ``fn(future, until)`` that makes progress on the calling thread
   while it waits for a reply from ``dst`` (so the reply needs no hand-off), returning when the
   future completes, at ``until`` (monotonic), or when it cannot help (another thread reads).
6. ``close(graceful, timeout)``: graceful flushes what was sent and says BYE; otherwise drops all.
"""
from __future__ import annotations

import abc
from typing import Any, Callable, Sequence

import numpy as np

from ._codec import Limits
from ._wire import Frame

__all__ = ["Transport", "Deliver", "Lost", "exchange_bytes", "BYE"]

Deliver = Callable[[int, Frame, bool], Any]
Lost = Callable[[int, str, bool], None]

#: envelope kind of the transport-level goodbye (the agent never sees it)
BYE = 99


class Transport(abc.ABC):
    name = "?"

    def __init__(self, rank: int, size: int, limits: Limits, deliver: Deliver, lost: Lost) -> None:
        self.rank, self.size, self.limits = rank, size, limits
        self.deliver, self.lost = deliver, lost

    @abc.abstractmethod
    def start(self) -> None: ...

    @abc.abstractmethod
    def send(self, dst: int, env: bytes, body: bytes, buffers: Sequence[memoryview]) -> None: ...

    def direct(self, dst: int) -> Callable[[Any, float], None] | None:
        return None

    @abc.abstractmethod
    def close(self, graceful: bool, timeout: float) -> None: ...


def exchange_bytes(group: Any, data: bytes, timeout: float) -> list[bytes]:
    """Every rank's ``data`` in rank order, over the group's collectives (no pickle)."""
    sizes = group.all_gather(np.array([len(data)], np.int64), timeout=timeout).reshape(-1)
    padded = np.zeros(max(1, int(sizes.max())), np.uint8)
    padded[: len(data)] = np.frombuffer(data, np.uint8)
    rows = group.all_gather(padded, timeout=timeout)
    return [rows[i, : int(sizes[i])].tobytes() for i in range(group.size)]

"""The Backend contract every transport implements, the backend registry, and request handles."""
from __future__ import annotations

import abc
import time
from typing import Any, Callable, Sequence

import numpy as np

from ..ops import ReduceOp

__all__ = [
    "Backend",
    "Request",
    "CompletedRequest",
    "register_backend",
    "available_backends",
    "backend_factory",
]


class Request(abc.ABC):
    """A pending transport operation; the collectives API wraps it in a user-facing ``Work``."""

    @abc.abstractmethod
    def test(self) -> bool:
        """Make progress without blocking; True once the operation is complete."""

    def wait(self, timeout: float | None) -> bool:
        """Block up to ``timeout`` seconds (None: forever); True if complete, False on timeout.

        Subclasses override this with something better than polling where they can.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        return poll_until(self.test, deadline)

    def pending(self) -> str:
        """What has not arrived yet, for timeout messages ("ranks [1, 3] have not joined")."""
        return "the operation did not complete"

    def abandon(self) -> bool | None:
        """Called after a timeout; lets peers that arrive later fail fast instead of hanging.

        A transport that can tell returns True when the operation completed after all (its last
        bytes came in as the deadline passed): the caller then reports success.
        """


class CompletedRequest(Request):
    def test(self) -> bool:
        return True

    def wait(self, timeout: float | None) -> bool:
        return True


def poll_until(test: Callable[[], bool], deadline: float | None) -> bool:
    """Spin on ``test`` briefly for latency, then yield the CPU between polls.

    MPI and sockets progress only while polled, so the loop never sleeps long; oversubscribed
    ranks (4 ranks on 2 cores) need the yields to let their peers run.
    """
    if test():
        return True
    spins = 0
    now = time.monotonic
    start = now()
    while True:
        for _ in range(64):
            if test():
                return True
        spins += 1
        t = now()
        if deadline is not None and t >= deadline:
            return test()
        waited = t - start
        if waited > 0.5:
            time.sleep(2e-4)
        elif waited > 2e-3:
            time.sleep(0)


class Backend(abc.ABC):
    """A transport for one group of ranks. The collectives API is its only caller.

    Contract:

    1. Every collective method (``allreduce`` to ``barrier`` and ``new_group``) must be called by
       all ranks of the group, in the same order, with matching dtypes, shapes, ops and roots.
       The API layer validates each rank's arguments before calling; with ``HPCDP_DEBUG=detail``
       it also checks them across ranks first.
    2. Buffers handed in are C-contiguous arrays of one array module (numpy, or cupy where the
       backend says it takes cupy) with a supported dtype; ``sendbuf is recvbuf`` means in place.
       Shapes: ``all_gather``/``gather`` receive ``(size, *send.shape)``; ``scatter``,
       ``reduce_scatter`` and ``all_to_all`` split axis 0 of the send buffer into ``size`` parts.
    3. Every method returns at once with a ``Request``; nothing may block indefinitely. The caller
       waits with a deadline and raises ``CommTimeoutError`` itself. Buffers belong to the
       transport until the request completes.
    4. ``op`` is never MEAN: the API computes it as SUM and divides.
    5. ``send``/``recv`` are tag-matched and non-overtaking per (source, tag); they may be mixed
       freely with collectives on this and other groups, from several threads.
    6. A peer that is known to be dead makes pending and later requests raise
       ``PeerFailureError`` naming it, instead of waiting for the timeout.
    """

    name: str = "?"
    #: this rank in the group, and the group size
    rank: int
    size: int
    #: global (world) rank of each group rank
    ranks: tuple[int, ...]
    #: whether cupy arrays may be passed in directly
    accepts_cupy: bool = False

    @abc.abstractmethod
    def allreduce(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: ReduceOp) -> Request: ...

    def allreduce_blocking(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: ReduceOp,
                           timeout: float) -> Request | None:
        """``allreduce`` waited on up to ``timeout``: None once complete, else the request still
        pending at the deadline (the caller reports the timeout and abandons it).

        The latency path of blocking host allreduces: a backend may override it to skip the
        request bookkeeping that only asynchronous callers need.
        """
        req = self.allreduce(sendbuf, recvbuf, op)
        return None if req.wait(timeout) else req

    @abc.abstractmethod
    def broadcast(self, buf: np.ndarray, root: int) -> Request: ...

    @abc.abstractmethod
    def reduce(
        self, sendbuf: np.ndarray, recvbuf: np.ndarray | None, op: ReduceOp, root: int
    ) -> Request: ...

    @abc.abstractmethod
    def all_gather(self, sendbuf: np.ndarray, recvbuf: np.ndarray) -> Request: ...

    @abc.abstractmethod
    def gather(self, sendbuf: np.ndarray, recvbuf: np.ndarray | None, root: int) -> Request: ...

    @abc.abstractmethod
    def scatter(self, sendbuf: np.ndarray | None, recvbuf: np.ndarray, root: int) -> Request: ...

    @abc.abstractmethod
    def reduce_scatter(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: ReduceOp) -> Request: ...

    @abc.abstractmethod
    def all_to_all(self, sendbuf: np.ndarray, recvbuf: np.ndarray) -> Request: ...

    @abc.abstractmethod
    def barrier(self) -> Request: ...

    @abc.abstractmethod
    def send(self, buf: np.ndarray, dst: int, tag: int) -> Request: ...

    @abc.abstractmethod
    def recv(self, buf: np.ndarray, src: int, tag: int) -> Request: ...

    @abc.abstractmethod
    def new_group(self, ranks: Sequence[int]) -> "Backend | None":
        """Collective over this group: a backend for ``ranks`` (group ranks), None on non-members."""

    def shutdown(self) -> None:
        """Release transport resources; called once by ``finalize``."""

    def describe(self) -> str:
        return f"{self.name}(rank {self.rank} of {self.size})"


_REGISTRY: dict[str, Callable[..., Backend]] = {}


def register_backend(name: str, factory: Callable[..., Backend]) -> None:
    """Make ``hpcdp.init(backend=name)`` call ``factory(timeout=..., **options)``."""
    _REGISTRY[name] = factory


def backend_factory(name: str) -> Callable[..., Backend] | None:
    return _REGISTRY.get(name)


def available_backends() -> list[str]:
    """Names of the registered backends whose libraries import here."""
    from . import _probe_available  # late: probing imports optional libraries

    return [n for n in _REGISTRY if _probe_available(n)]


def payload(x: Any) -> str:
    """Short description of a buffer for error messages."""
    return f"{type(x).__module__.split('.')[0]}.ndarray{tuple(x.shape)} {x.dtype}"

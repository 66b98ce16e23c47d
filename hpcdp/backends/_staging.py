"""cupy arrays through a transport that cannot read device memory: pinned host copies.

Every backend takes cupy arrays. MPI hands them to the library directly when a functional probe
(``hpcdp.backends.mpi._staging``) found it CUDA-aware; otherwise, and on every transport that
reads host memory only (TCP sockets, simulated ranks), each device argument is copied into a
pinned host buffer, the operation runs on the host copies, and the arguments the operation writes
(its receive role) are copied back to the device when it completes.

Why pinned buffers from a pool: a copy between device and pageable memory goes through a
driver-owned bounce buffer (two copies, synchronous); pinned memory is copied by DMA at full
PCIe/NVLink speed. Pinning is slow (an ``mlock`` and a driver call per allocation), so buffers are
kept by (size, dtype) and reused: a training loop sends the same bucket sizes every step.

Why every copy goes on the current stream: cupy kernels run asynchronously on it, so a device
buffer may still be being written when the operation starts; a copy queued on the same stream
runs after those kernels (one on another stream, or MPI reading device memory directly, would not
wait for them: the CUDA-aware path synchronises the stream instead).
"""
from __future__ import annotations

import inspect
import threading
from typing import Any, Callable, Sequence

import numpy as np

from .._arrays import is_cupy
from .base import Request

__all__ = ["HostPool", "Chain", "RECV_ROLES", "stage", "HostStaged"]

#: For each transport call, the arguments it writes into (copied back to the device once the call
#: completed); every other array argument is only read. Declared once for every backend.
RECV_ROLES: dict[str, tuple[str, ...]] = {
    "allreduce": ("recvbuf",), "broadcast": ("buf",), "reduce": ("recvbuf",),
    "all_gather": ("recvbuf",), "gather": ("recvbuf",), "scatter": ("recvbuf",),
    "reduce_scatter": ("recvbuf",), "all_to_all": ("recvbuf",), "barrier": (),
    "send": (), "recv": ("buf",),
}


class HostPool:
    """Pinned host buffers kept by (size, dtype): each operation in flight holds its own.

    ``take`` pops a free buffer (operations in flight at once, DDP's buckets, never share one) and
    ``give`` returns it when the operation completed. Sizes repeat step after step, so after the
    first step nothing is pinned anew. ``pinned_bytes`` and ``allocations`` let tests and the GPU
    report see the reuse.
    """

    def __init__(self) -> None:
        self.free: dict[tuple[int, str], list[np.ndarray]] = {}
        self.allocations = 0
        self.pinned_bytes = 0
        self._lock = threading.Lock()

    def take(self, dev: Any) -> np.ndarray:
        key = (dev.size, dev.dtype.str)
        with self._lock:
            free = self.free.get(key)
            if free:
                return free.pop().reshape(dev.shape)
            self.allocations += 1
            self.pinned_bytes += dev.nbytes
        return _pinned(dev.shape, dev.dtype)

    def give(self, host: np.ndarray) -> None:
        with self._lock:
            self.free.setdefault((host.size, host.dtype.str), []).append(host)


def _pinned(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    try:
        import cupyx  # type: ignore[import-not-found]

        return cupyx.empty_pinned(shape, dtype)
    except (ImportError, AttributeError):  # a cupy without cupyx: pageable, still correct
        return np.empty(shape, dtype)


class Chain(Request):
    """``req``, then host-side work (``then``) once it completed; ``then`` never runs after the
    request is given up on (a staged receive must not copy back late). ``then`` runs once even
    when two threads (DDP's progress thread and a ``wait``) see the request complete together:
    staging's ``then`` gives pinned buffers back to a pool, and twice would hand one buffer to two
    later operations."""

    def __init__(self, req: Request, then: Callable[[], None]) -> None:
        self.req, self.then, self.done = req, then, False
        self.keep: Any = ()
        self._once = threading.Lock()

    def _finish(self) -> None:
        with self._once:
            if not self.done:
                self.then()
                self.done = True

    def test(self) -> bool:
        if not self.done and self.req.test():
            self._finish()
        return self.done

    def wait(self, timeout: float | None) -> bool:
        if not self.done and self.req.wait(timeout):
            self._finish()
        return self.done

    def pending(self) -> str:
        return self.req.pending()

    def abandon(self) -> bool | None:
        if self.done:
            return True
        if self.req.abandon():
            self._finish()
            return True
        with self._once:
            if self.done:
                return True
            self.then = _nothing
        return None


def _nothing() -> None:
    return None


#: calls whose receive-role buffer is also read (the root's broadcast buffer): copied in too
_READ_AND_WRITTEN = frozenset({"broadcast"})


def _same_layout(a: Any, b: Any) -> bool:
    """Two distinct cupy arrays of one size and dtype (an allreduce's input and result)."""
    return (a is not b and is_cupy(a) and is_cupy(b) and a.size == b.size
            and a.dtype == b.dtype)


def stage(pool: HostPool, call: Callable[..., Request], op: str, names: Sequence[str],
          args: tuple[Any, ...]) -> Request:
    """``call(*args)`` (the transport's ``op``) on pinned host copies of the cupy ``args``; the
    ones ``op`` writes (``RECV_ROLES``) are copied back to the device once it completed.

    The same device array passed twice (in place: ``sendbuf is recvbuf``) gets one host copy, so
    the transport still sees an in-place call. A buffer the call only writes is not copied in.
    """
    import cupy  # type: ignore[import-not-found]

    recv = RECV_ROLES[op]
    read_recv = op in _READ_AND_WRITTEN

    # One stream for every copy: a device-to-host copy on the current stream runs after the
    # kernels queued before it, and ``get`` blocks until it is done, so the transport sees
    # finished data without a separate synchronise (each costs a wait for the GPU, and more when
    # several ranks share one GPU: the driver time-slices their contexts).
    stream = cupy.cuda.get_current_stream()
    host: list[Any] = []
    copies: dict[int, tuple[Any, np.ndarray]] = {}
    written: set[int] = set()  # device arrays some receive-role argument names
    if op == "allreduce" and _same_layout(args[0], args[1]):
        # A separate result on the device is still one buffer on the host: the transport reduces
        # in place there (half the pinned memory, one buffer for MPI to walk; measured faster on
        # a lent GPU machine: README, A6).
        h = pool.take(args[0])
        args[0].get(out=h, stream=stream)
        copies = {id(args[0]): (args[0], h), id(args[1]): (args[1], h)}
        written.add(id(args[1]))
        host = [h, h, *args[2:]]
    else:
        for name, a in zip(names, args):
            if not is_cupy(a):
                host.append(a)
                continue
            if id(a) not in copies:
                h = pool.take(a)
                if read_recv or name not in recv or any(
                        b is a and n not in recv for n, b in zip(names, args)):
                    a.get(out=h, stream=stream)
                copies[id(a)] = (a, h)
            if name in recv:
                written.add(id(a))  # also when the same array came first as sendbuf
            host.append(copies[id(a)][1])
    req = call(*host)

    def copy_back() -> None:
        for key, (dev, h) in copies.items():
            if key in written:
                dev.set(h, stream=stream)
        if written:  # the host buffers go back to the pool: the copies out of them must be done
            stream.synchronize()
        for h in {id(h): h for _, h in copies.values()}.values():
            pool.give(h)

    # Given up on, the host copies do not go back to the pool: the transport may still write them
    # (a collective cannot be withdrawn, nor a receive already matched), and a later operation
    # taking one from the pool would get that late data. The request keeps them alive until the
    # transport is done; then they are garbage.
    chained = Chain(req, copy_back)
    chained.keep = (args, host)
    return chained


class HostStaged:
    """A backend that reads host memory only, presented as one that takes cupy arrays: its calls
    with cupy arguments run through ``stage``; calls without any go straight through."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.pool = HostPool()

    def __getattr__(self, name: str) -> Any:
        target = getattr(self.backend, name)
        recv = RECV_ROLES.get(name)
        if recv is None:
            return target
        # (the signature, not __code__: it sees through a decorator's *args to the names)
        names = tuple(inspect.signature(target).parameters)
        missing = [r for r in recv if r not in names]
        if missing:
            raise TypeError(f"{self.backend.name} backend: {name}() has no argument named "
                            f"{missing} (RECV_ROLES), so staging would not copy its result back")
        pool = self.pool

        def staged_call(*args: Any) -> Request:
            if not any(is_cupy(a) for a in args):
                return target(*args)
            return stage(pool, target, name, names, args)

        staged_call.__name__ = name
        self.__dict__[name] = staged_call  # looked up once per name
        return staged_call

"""Host staging of cupy buffers for an MPI library that cannot read device memory."""
from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from .._arrays import is_cupy
from ._mpi_requests import Chain
from .base import Request

if TYPE_CHECKING:
    from .mpi import MPIBackend

__all__ = ["Staging", "cuda_aware", "staged"]


def cuda_aware() -> bool:
    """Whether the MPI library takes device pointers (``HPCDP_CUDA_AWARE=0/1`` overrides)."""
    env = os.environ.get("HPCDP_CUDA_AWARE")
    if env is not None:
        return env.strip() not in ("0", "false", "no", "")
    return _query_cuda_support()


@functools.lru_cache(maxsize=1)
def _query_cuda_support() -> bool:
    from .mpi import get_mpi

    MPI = get_mpi()
    q = getattr(MPI, "Query_cuda_support", None)
    if q is not None:
        try:
            return bool(q())
        except Exception:  # noqa: BLE001 - not implemented by this MPI
            pass
    import ctypes

    try:  # Open MPI's extension, found in the already-loaded libmpi
        fn = ctypes.CDLL(None).MPIX_Query_cuda_support
        fn.restype = ctypes.c_int
        return bool(fn())
    except (AttributeError, OSError):
        return False


class Staging:
    """Pinned host copies of cupy buffers for an MPI that is not CUDA-aware.

    Each request takes buffers out of the pool and gives them back when it completes, so
    operations in flight at once (DDP buckets) never share one; sizes repeat, so they are reused.
    """

    def __init__(self) -> None:
        self.pool: dict[tuple[int, str], list[np.ndarray]] = {}

    def take(self, dev: Any) -> np.ndarray:
        free = self.pool.get((dev.size, dev.dtype.str))
        if free:
            try:  # (another thread may take the last one between the check and the pop)
                return free.pop().reshape(dev.shape)
            except IndexError:
                pass
        import cupyx  # type: ignore[import-not-found]

        return cupyx.empty_pinned(dev.shape, dev.dtype)

    def give(self, host: np.ndarray) -> None:
        self.pool.setdefault((host.size, host.dtype.str), []).append(host)


def staged(be: "MPIBackend", method: Callable[..., Request], names: Sequence[str],
           recv: Sequence[str], args: tuple[Any, ...]) -> Request:
    """``method`` on cupy ``args``: directly when MPI is CUDA-aware, else on pinned host copies
    that receive-role arguments (named in ``recv``) are copied back from once it completed."""
    import cupy  # type: ignore[import-not-found]

    cupy.cuda.get_current_stream().synchronize()  # MPI must see finished kernels
    if be.cuda_aware:
        req = method(be, *args)
        req.keep = (args, req.keep)
        return req
    host: list[Any] = []
    copies: dict[int, tuple[Any, np.ndarray]] = {}
    written: set[int] = set()  # device arrays some receive-role argument names
    for name, a in zip(names, args):
        if not is_cupy(a):
            host.append(a)
            continue
        if id(a) not in copies:
            h = be._staging.take(a)
            a.get(out=h)
            copies[id(a)] = (a, h)
        if name in recv:
            written.add(id(a))  # also when the same array came first as sendbuf
        host.append(copies[id(a)][1])
    req = method(be, *host)
    req.keep = (args, host, req.keep)

    def copy_back() -> None:
        for key, (dev, h) in copies.items():
            if key in written:
                dev.set(h)
            be._staging.give(h)

    # Given up on, the host copies do not go back to the pool: MPI may still write them (a
    # collective cannot be withdrawn, nor a receive already matched), and a later operation
    # taking one from the pool would get that late data. The request keeps them alive until
    # MPI is done; then they are garbage.
    return Chain(req, copy_back)

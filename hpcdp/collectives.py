"""Collectives on the default group (or ``group=``), numpy style: each returns its result.

Thin forwards to the ``ProcessGroup`` methods of the same names, which validate and document;
they spell out their signatures so editors and type checkers see them.
"""
from __future__ import annotations

from typing import Any

from ._world import get_default_group as _default
from .group import ProcessGroup
from .ops import ReduceOp
from .work import Work

__all__ = [
    "allreduce", "all_reduce", "broadcast", "reduce", "all_gather", "allgather", "gather",
    "scatter", "reduce_scatter", "all_to_all", "alltoall", "barrier", "send", "recv", "isend",
    "irecv", "broadcast_object", "all_gather_object", "gather_object",
]

Group = ProcessGroup | None
Op = ReduceOp | str


def allreduce(x: Any, op: Op = "sum", *, out: Any = None, group: Group = None,
              async_op: bool = False, timeout: float | None = None) -> Any:
    """Reduce ``x`` elementwise across ranks; every rank gets the result."""
    return (group or _default()).allreduce(x, op, out=out, async_op=async_op, timeout=timeout)


def broadcast(x: Any, root: int = 0, *, out: Any = None, group: Group = None,
              async_op: bool = False, timeout: float | None = None) -> Any:
    """Every rank gets root's ``x``; fills ``x`` (or ``out=``) in place when it can."""
    return (group or _default()).broadcast(x, root, out=out, async_op=async_op, timeout=timeout)


def reduce(x: Any, op: Op = "sum", root: int = 0, *, out: Any = None, group: Group = None,
           async_op: bool = False, timeout: float | None = None) -> Any:
    """Reduce ``x`` across ranks onto ``root``; other ranks get None."""
    return (group or _default()).reduce(x, op, root, out=out, async_op=async_op, timeout=timeout)


def all_gather(x: Any, *, out: Any = None, group: Group = None, async_op: bool = False,
               timeout: float | None = None) -> Any:
    """Stack every rank's ``x``: shape ``(world_size, *x.shape)``."""
    return (group or _default()).all_gather(x, out=out, async_op=async_op, timeout=timeout)


def gather(x: Any, root: int = 0, *, out: Any = None, group: Group = None,
           async_op: bool = False, timeout: float | None = None) -> Any:
    """Stack every rank's ``x`` on ``root``; other ranks get None."""
    return (group or _default()).gather(x, root, out=out, async_op=async_op, timeout=timeout)


def scatter(x: Any, root: int = 0, *, out: Any = None, group: Group = None,
            async_op: bool = False, timeout: float | None = None) -> Any:
    """Split root's ``x`` along axis 0; rank i gets part i."""
    return (group or _default()).scatter(x, root, out=out, async_op=async_op, timeout=timeout)


def reduce_scatter(x: Any, op: Op = "sum", *, out: Any = None, group: Group = None,
                   async_op: bool = False, timeout: float | None = None) -> Any:
    """Reduce ``x`` across ranks; rank i gets part i of axis 0."""
    return (group or _default()).reduce_scatter(x, op, out=out, async_op=async_op, timeout=timeout)


def all_to_all(x: Any, *, out: Any = None, group: Group = None, async_op: bool = False,
               timeout: float | None = None) -> Any:
    """Part j of ``x`` goes to rank j; the result stacks what each rank sent."""
    return (group or _default()).all_to_all(x, out=out, async_op=async_op, timeout=timeout)


def barrier(*, group: Group = None, async_op: bool = False, timeout: float | None = None) -> Any:
    """Return once every rank of the group has called ``barrier``."""
    return (group or _default()).barrier(async_op=async_op, timeout=timeout)


def isend(x: Any, dst: int, tag: int = 0, *, group: Group = None) -> Work:
    """Start sending ``x`` to ``dst``; do not modify ``x`` until ``wait()``."""
    return (group or _default()).isend(x, dst, tag)


def irecv(buf: Any, src: int, tag: int = 0, *, group: Group = None) -> Work:
    """Start receiving into ``buf`` from ``src``."""
    return (group or _default()).irecv(buf, src, tag)


def send(x: Any, dst: int, tag: int = 0, *, group: Group = None, timeout: float | None = None) -> None:
    """Send ``x`` to ``dst``; returns once ``x`` may be reused."""
    return (group or _default()).send(x, dst, tag, timeout=timeout)


def recv(buf: Any = None, src: int = -1, tag: int = 0, *, dtype: Any = None,
         return_status: bool = False, group: Group = None, timeout: float | None = None) -> Any:
    """Receive into ``buf`` from ``src`` (default ``ANY_SOURCE``); returns ``buf``.

    ``buf=None`` allocates from the probed size; ``return_status=True`` returns ``(buf, Status)``.
    """
    return (group or _default()).recv(buf, src, tag, dtype=dtype, return_status=return_status,
                                       timeout=timeout)


def broadcast_object(obj: Any = None, root: int = 0, *, group: Group = None,
                     timeout: float | None = None) -> Any:
    """Every rank gets root's picklable ``obj``."""
    return (group or _default()).broadcast_object(obj, root, timeout=timeout)


def all_gather_object(obj: Any, *, group: Group = None, timeout: float | None = None) -> list[Any]:
    """A list of every rank's picklable ``obj``."""
    return (group or _default()).all_gather_object(obj, timeout=timeout)


def gather_object(obj: Any, root: int = 0, *, group: Group = None,
                  timeout: float | None = None) -> list[Any] | None:
    """Every rank's ``obj`` as a list on ``root``; None elsewhere."""
    return (group or _default()).gather_object(obj, root, timeout=timeout)


all_reduce = allreduce
allgather = all_gather
alltoall = all_to_all

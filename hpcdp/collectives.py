"""Collectives on the default group (or ``group=``), numpy style: each returns its result.

These are thin forwards to the ``ProcessGroup`` methods of the same names, which hold the
validation and the docs.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

from ._world import get_default_group
from .group import ProcessGroup

__all__ = [
    "allreduce", "all_reduce", "broadcast", "reduce", "all_gather", "allgather", "gather",
    "scatter", "reduce_scatter", "all_to_all", "alltoall", "barrier", "send", "recv", "isend",
    "irecv", "broadcast_object", "all_gather_object", "gather_object",
]


def _forward(name: str) -> Callable[..., Any]:
    method = getattr(ProcessGroup, name)

    @functools.wraps(method)
    def call(*args: Any, group: ProcessGroup | None = None, **kwargs: Any) -> Any:
        return method(group if group is not None else get_default_group(), *args, **kwargs)

    return call


allreduce = _forward("allreduce")
all_reduce = allreduce
broadcast = _forward("broadcast")
reduce = _forward("reduce")
all_gather = _forward("all_gather")
allgather = all_gather
gather = _forward("gather")
scatter = _forward("scatter")
reduce_scatter = _forward("reduce_scatter")
all_to_all = _forward("all_to_all")
alltoall = all_to_all
barrier = _forward("barrier")
send = _forward("send")
recv = _forward("recv")
isend = _forward("isend")
irecv = _forward("irecv")
broadcast_object = _forward("broadcast_object")
all_gather_object = _forward("all_gather_object")
gather_object = _forward("gather_object")

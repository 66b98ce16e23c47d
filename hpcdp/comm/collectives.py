"""Collectives on the default group (or ``group=``), numpy style: each returns its result.

Thin forwards to the ``ProcessGroup`` methods of the same names, which validate and document;
they spell out their signatures so editors and type checkers see them.

torch.distributed's spellings do what torch's do (README, "torch.distributed spellings"):
``all_reduce``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_to_all_single``
and ``broadcast_object_list`` work in place and return None (or a ``Work``); the names both
APIs share switch to torch's behaviour when called with torch's arguments (``broadcast(x,
src=0)``, ``reduce(x, dst=0)``, ``all_gather(tensor_list, tensor)``, ...). Without them they
stay numpy style.

Every call takes torch tensors where it takes arrays (zero-copy views; results come back as
tensors): ``hpcdp._tensors`` states the rules.
"""
from __future__ import annotations

from typing import Any

from .world import get_default_group as _default
from ..errors import HpcdpError, public, public_error
from ._lane import all_gather_now, allreduce_now, broadcast_now
from .group import ProcessGroup
from ..ops import ReduceOp
from .work import Work

__all__ = [
    "allreduce", "all_reduce", "broadcast", "reduce", "all_gather", "allgather", "gather",
    "scatter", "reduce_scatter", "all_to_all", "alltoall", "barrier", "send", "recv", "isend",
    "irecv", "sendrecv", "broadcast_object", "all_gather_object", "gather_object", "all_gather_into_tensor",
    "reduce_scatter_tensor", "all_to_all_single", "broadcast_object_list", "get_rank",
    "get_world_size",
]

Group = ProcessGroup | None
Op = ReduceOp | str


def allreduce(x: Any, op: Op = "sum", *, out: Any = None, group: Group = None,
              async_op: bool = False, timeout: float | None = None) -> Any:
    """Reduce ``x`` elementwise across ranks; every rank gets the result (``x`` is unchanged)."""
    try:  # free on success: the latency lane is called from here, one frame fewer (A2, A5)
        g = group or _default()
        if g._fast and not async_op and (done := allreduce_now(g, x, op, out, timeout)) is not None:
            return done
        return g.allreduce(x, op, out=out, async_op=async_op, timeout=timeout)
    except HpcdpError as exc:
        raise public_error(exc)  # noqa: B904 - exc is its __context__


@public
def all_reduce(tensor: Any, op: Op = "sum", *, group: Group = None, async_op: bool = False,
               timeout: float | None = None) -> Work | None:
    """torch's ``all_reduce``: reduce ``tensor`` across ranks *in place*; None (or a Work).

    ``allreduce(x)`` (no underscore) returns the result instead.
    """
    return (group or _default()).all_reduce(tensor, op, async_op=async_op, timeout=timeout)


def broadcast(x: Any, root: int = 0, *, out: Any = None, group: Group = None,
              async_op: bool = False, timeout: float | None = None, src: int | None = None) -> Any:
    """Every rank gets root's ``x``; fills ``x`` (or ``out=``) in place when it can.

    ``broadcast(x, src=0)`` is torch's call: in place, returns None (or a Work).
    """
    try:  # the latency lane from here, as ``allreduce``'s (A3: a frame is a visible share)
        g = group or _default()
        if (g._fast and not async_op and out is None and src is None
                and (done := broadcast_now(g, x, root, timeout)) is not None):
            return done
        return g.broadcast(x, root, out=out, async_op=async_op, timeout=timeout, src=src)
    except HpcdpError as exc:
        raise public_error(exc)  # noqa: B904 - exc is its __context__


@public
def reduce(x: Any, op: Op = "sum", root: int = 0, *, out: Any = None, group: Group = None,
           async_op: bool = False, timeout: float | None = None, dst: int | None = None) -> Any:
    """Reduce ``x`` across ranks onto ``root``; other ranks get None.

    ``reduce(x, dst=0)`` (or torch's positional ``reduce(x, 0)``) is torch's call: the sum lands
    in ``x`` on ``dst``; returns None (or a Work).
    """
    return (group or _default()).reduce(x, op, root, out=out, async_op=async_op, timeout=timeout,
                                        dst=dst)


def all_gather(x: Any, tensor: Any = None, *, out: Any = None, group: Group = None,
               async_op: bool = False, timeout: float | None = None) -> Any:
    """Stack every rank's ``x``: shape ``(world_size, *x.shape)``.

    torch's ``all_gather(tensor_list, tensor)`` fills ``tensor_list``; returns None (or a Work).
    """
    try:  # the latency lane from here, as ``allreduce``'s
        g = group or _default()
        if (g._fast and not async_op and tensor is None
                and (done := all_gather_now(g, x, out, timeout)) is not None):
            return done
        return g.all_gather(x, tensor, out=out, async_op=async_op, timeout=timeout)
    except HpcdpError as exc:
        raise public_error(exc)  # noqa: B904 - exc is its __context__


@public
def gather(x: Any, root: Any = 0, *, out: Any = None, group: Group = None,
           async_op: bool = False, timeout: float | None = None, gather_list: Any = None,
           dst: int | None = None) -> Any:
    """Stack every rank's ``x`` on ``root``; other ranks get None.

    torch's ``gather(x, gather_list, dst=0)`` fills ``gather_list`` on ``dst``; returns None.
    """
    return (group or _default()).gather(x, root, out=out, async_op=async_op, timeout=timeout,
                                        gather_list=gather_list, dst=dst)


@public
def scatter(x: Any, root: Any = 0, *, out: Any = None, group: Group = None,
            async_op: bool = False, timeout: float | None = None, scatter_list: Any = None,
            src: int | None = None) -> Any:
    """Split root's ``x`` along axis 0; rank i gets part i.

    torch's ``scatter(x, scatter_list, src=0)`` fills ``x`` in place; returns None (or a Work).
    """
    return (group or _default()).scatter(x, root, out=out, async_op=async_op, timeout=timeout,
                                         scatter_list=scatter_list, src=src)


@public
def reduce_scatter(x: Any, op: Op = "sum", *, out: Any = None, group: Group = None,
                   async_op: bool = False, timeout: float | None = None) -> Any:
    """Reduce ``x`` across ranks; rank i gets part i of axis 0 (torch's list form: see
    ``reduce_scatter_tensor``)."""
    return (group or _default()).reduce_scatter(x, op, out=out, async_op=async_op, timeout=timeout)


@public
def all_to_all(x: Any, input_list: Any = None, *, out: Any = None, group: Group = None,
               async_op: bool = False, timeout: float | None = None) -> Any:
    """Part j of ``x`` goes to rank j; the result stacks what each rank sent.

    torch's ``all_to_all(output_list, input_list)`` fills ``output_list``; returns None.
    """
    return (group or _default()).all_to_all(x, input_list, out=out, async_op=async_op,
                                            timeout=timeout)


@public
def all_gather_into_tensor(output_tensor: Any, input_tensor: Any, *, group: Group = None,
                           async_op: bool = False, timeout: float | None = None) -> Work | None:
    """torch's ``all_gather_into_tensor``: rank i's input fills part i of ``output_tensor``."""
    return (group or _default()).all_gather_into_tensor(output_tensor, input_tensor,
                                                        async_op=async_op, timeout=timeout)


@public
def reduce_scatter_tensor(output: Any, input: Any, op: Op = "sum", *, group: Group = None,
                          async_op: bool = False, timeout: float | None = None) -> Work | None:
    """torch's ``reduce_scatter_tensor``: reduce ``input``; part i lands in rank i's ``output``."""
    return (group or _default()).reduce_scatter_tensor(output, input, op, async_op=async_op,
                                                       timeout=timeout)


@public
def all_to_all_single(output: Any, input: Any, output_split_sizes: Any = None,
                      input_split_sizes: Any = None, *, group: Group = None,
                      async_op: bool = False, timeout: float | None = None) -> Work | None:
    """torch's ``all_to_all_single`` (even splits): part j of ``input`` goes to rank j."""
    return (group or _default()).all_to_all_single(output, input, output_split_sizes,
                                                   input_split_sizes, async_op=async_op,
                                                   timeout=timeout)


@public
def barrier(*, group: Group = None, async_op: bool = False, timeout: float | None = None) -> Any:
    """Return once every rank of the group has called ``barrier`` (None, or a Work)."""
    return (group or _default()).barrier(async_op=async_op, timeout=timeout)


@public
def isend(x: Any, dst: int, tag: int = 0, *, group: Group = None) -> Work:
    """Start sending ``x`` to ``dst``; do not modify ``x`` until ``wait()``."""
    return (group or _default()).isend(x, dst, tag)


@public
def irecv(buf: Any, src: int, tag: int = 0, *, group: Group = None) -> Work:
    """Start receiving into ``buf`` from ``src``."""
    return (group or _default()).irecv(buf, src, tag)


@public
def send(x: Any, dst: int, tag: int = 0, *, group: Group = None, timeout: float | None = None) -> None:
    """Send ``x`` to ``dst``; returns once ``x`` may be reused."""
    return (group or _default()).send(x, dst, tag, timeout=timeout)


@public
def sendrecv(sendbuf: Any, dst: int, recvbuf: Any = None, src: int = -1, *, sendtag: int = 0,
             recvtag: int = -1, dtype: Any = None, return_status: bool = False,
             group: Group = None, timeout: float | None = None) -> Any:
    """Send to ``dst`` and receive from ``src`` in one deadlock-free call (mpi4py's
    ``Sendrecv``); returns ``recvbuf``. ``PROC_NULL`` skips a half. See ``ProcessGroup.sendrecv``."""
    return (group or _default()).sendrecv(sendbuf, dst, recvbuf, src, sendtag=sendtag,
                                          recvtag=recvtag, dtype=dtype,
                                          return_status=return_status, timeout=timeout)


@public
def recv(buf: Any = None, src: int | None = -1, tag: int = 0, *, dtype: Any = None,
         return_status: bool = False, group: Group = None, timeout: float | None = None) -> Any:
    """Receive into ``buf`` from ``src`` (default, or None as torch says: ``ANY_SOURCE``);
    returns ``buf`` (torch returns the sender's rank: ``return_status=True`` gives it).

    ``buf=None`` returns a new array of the sender's dtype and shape (``ProcessGroup.recv``);
    ``return_status=True`` returns ``(buf, Status)``.
    """
    return (group or _default()).recv(buf, src, tag, dtype=dtype, return_status=return_status,
                                       timeout=timeout)


@public
def broadcast_object(obj: Any = None, root: int = 0, *, group: Group = None,
                     timeout: float | None = None) -> Any:
    """Every rank gets root's picklable ``obj``."""
    return (group or _default()).broadcast_object(obj, root, timeout=timeout)


@public
def broadcast_object_list(object_list: list[Any], src: int = 0, *, group: Group = None,
                          timeout: float | None = None) -> None:
    """torch's ``broadcast_object_list``: every rank's ``object_list`` becomes ``src``'s."""
    return (group or _default()).broadcast_object_list(object_list, src, timeout=timeout)


@public
def all_gather_object(obj: Any, *args: Any, group: Group = None,
                      timeout: float | None = None) -> Any:
    """A list of every rank's picklable ``obj`` (torch's ``all_gather_object(object_list,
    obj)`` fills ``object_list`` and returns None)."""
    return (group or _default()).all_gather_object(obj, *args, timeout=timeout)


@public
def gather_object(obj: Any, root: Any = 0, *, group: Group = None, timeout: float | None = None,
                  object_gather_list: list[Any] | None = None,
                  dst: int | None = None) -> list[Any] | None:
    """Every rank's ``obj`` as a list on ``root``; None elsewhere (torch's form with
    ``object_gather_list``/``dst=`` fills that list on ``dst``)."""
    return (group or _default()).gather_object(obj, root, timeout=timeout,
                                               object_gather_list=object_gather_list, dst=dst)


def get_rank(group: Group = None) -> int:
    """torch's ``get_rank``: this process's rank in ``group`` (default: the world)."""
    return (group or _default()).rank


def get_world_size(group: Group = None) -> int:
    """torch's ``get_world_size``: the number of ranks in ``group`` (default: the world)."""
    return (group or _default()).size


allgather = all_gather
alltoall = all_to_all

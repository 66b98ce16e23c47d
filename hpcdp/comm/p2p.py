"""Point-to-point beyond one known peer: many transfers in flight, probes, receives from anyone.

Pipelines post every activation and gradient transfer of a step at once (``batch_isend_irecv``
then ``wait_all``); RPC servers and parameter servers receive from whichever rank sends first
(``recv(None, ANY_SOURCE)``, allocated as the probe says the sender's array was: dtype and
shape, which every built-in transport carries with the message). Underneath each backend offers one nonblocking
``Backend.probe(src, tag)``; everything here is built on it and on ``isend``/``irecv``. The
probes and the any-source receive are the group's own (``_group_p2p.PointToPoint``); the
functions here pick the group (default: the default group) and call it.

A probe and the receive that follows it are two steps: receive from ``ANY_SOURCE`` (or ``ANY_TAG``)
on a group from one thread at a time, or the message probed could go to another thread's receive
of the same source and tag.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from ._status import Status
from ._p2p_batch import post_batch
from .validation import check_timeout
from ..backends.base import ANY_SOURCE, ANY_TAG
from ..errors import HpcdpError, public, public_error
from .work import QuickBatch, Work, wait_batch, wait_quick
from .world import get_default_group

if TYPE_CHECKING:
    from .group import ProcessGroup

__all__ = ["ANY_SOURCE", "ANY_TAG", "Status", "P2POp", "batch_isend_irecv", "wait_all", "probe",
           "iprobe", "recv_any"]



@dataclass(frozen=True)
class P2POp:
    """One transfer of a ``batch_isend_irecv``: ``op`` is ``"isend"`` or ``"irecv"`` (or the
    ``hpcdp.isend``/``hpcdp.irecv`` functions, as in torch), ``buf`` the array, ``peer`` the
    group rank, ``group`` None for the default group."""

    op: Any
    buf: Any
    peer: int
    tag: int = 0
    group: Any = None

    def __post_init__(self) -> None:
        name = getattr(self.op, "__name__", self.op)
        if name not in ("isend", "irecv"):
            raise ValueError(f"P2POp: op must be 'isend' or 'irecv' (or hpcdp.isend/irecv), "
                             f"got {self.op!r}")
        object.__setattr__(self, "op", name)


def _group(group: Any) -> "ProcessGroup":
    return group if group is not None else get_default_group()


def batch_isend_irecv(ops: Sequence[P2POp]) -> list[Work]:
    """Post every transfer of ``ops`` at once; one ``Work`` per op, in the order given.

    Receives are posted before sends, so a message that arrives early lands in its buffer
    directly. Every op is checked before anything is posted: a bad op posts nothing, and the
    error is the one its ``isend``/``irecv`` would raise. On MPI the ops of plain arrays go
    straight to the quick lane in one loop (``_p2p_batch.post_batch``), cheaper than the same
    calls one by one; messages are numbered as those calls would number them.
    """
    try:  # (``errors.public``'s trimming without its wrapper)
        return post_batch(ops if type(ops) is list else list(ops), P2POp, get_default_group)
    except HpcdpError as exc:
        raise public_error(exc)  # noqa: B904 - exc is its __context__


@public
def wait_all(works: Iterable[Work], timeout: float | None = None) -> list[Any]:
    """Wait for every work within one deadline (default: each work's own); their results."""
    t = None if timeout is None else check_timeout("wait_all", timeout)  # (before any spin)
    if type(works) is QuickBatch and (out := wait_batch(works)) is not None:  # as posted
        return out
    works = list(works)
    if wait_quick(works):  # the quick lane's requests first, tested together: all done
        return [w._result for w in works]
    if t is None:  # (``_wait``: this function is the public boundary that trims errors)
        return [w._wait() for w in works]
    deadline = time.monotonic() + t
    # a work already complete returns at once; others get what is left (at least a tick)
    return [w._wait(max(1e-3, deadline - time.monotonic())) for w in works]


@public
def iprobe(src: int = ANY_SOURCE, tag: int = ANY_TAG, *, group: Any = None) -> Status | None:
    """The ``Status`` of a message waiting to be received from ``src`` with ``tag``, else None."""
    return _group(group)._p2p.iprobe(src, tag)


@public
def probe(src: int = ANY_SOURCE, tag: int = ANY_TAG, *, group: Any = None,
          timeout: float | None = None) -> Status:
    """Block until a message from ``src`` with ``tag`` can be received; its ``Status``.

    Raises ``CommTimeoutError`` after ``timeout`` (default: the group's), ``PeerFailureError``
    when every rank it could come from is gone.
    """
    return _group(group)._p2p.probe(src, tag, timeout=timeout)


@public
def recv_any(buf: Any = None, src: int = ANY_SOURCE, tag: int = ANY_TAG, *,
             dtype: Any = None, group: Any = None, timeout: float | None = None
             ) -> tuple[Any, Status]:
    """Receive the next message from ``src`` (any rank by default) with ``tag``.

    With ``buf=None`` a numpy array of the sender's dtype and shape is allocated from what the
    probe reports (a message that has been sent); a ``dtype`` other than the sender's reads the
    bytes as a 1-D array of it. Returns ``(array, status)``; ``status.dtype``/``shape`` say what
    was sent.
    """
    return _group(group)._p2p.recv_any(buf, src, tag, dtype=dtype, timeout=timeout)

"""Point-to-point beyond one known peer: many transfers in flight, probes, receives from anyone.

Pipelines post every activation and gradient transfer of a step at once (``batch_isend_irecv``
then ``wait_all``); RPC servers and parameter servers receive from whichever rank sends first
(``recv(None, ANY_SOURCE)``, sized by a probe). Underneath each backend offers one nonblocking
``Backend.probe(src, tag)``; everything here is built on it and on ``isend``/``irecv``.

A probe and the receive that follows it are two steps: receive from ``ANY_SOURCE`` (or ``ANY_TAG``)
on a group from one thread at a time, or the message probed could go to another thread's receive
of the same source and tag.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np

from .. import trace
from ._debug_p2p import payload_nbytes
from .validation import check_rank, check_tag, check_timeout
from ..backends.base import ANY_SOURCE, ANY_TAG, poll_until
from ..errors import CommTimeoutError, HpcdpError, public
from .work import Work

if TYPE_CHECKING:
    from .group import ProcessGroup

__all__ = ["ANY_SOURCE", "ANY_TAG", "Status", "P2POp", "batch_isend_irecv", "wait_all", "probe",
           "iprobe", "recv_any"]



@dataclass(frozen=True)
class Status:
    """What a probe or an any-source receive matched: group rank, tag and size in bytes."""

    source: int
    tag: int
    nbytes: int

    def count(self, dtype: Any = np.uint8) -> int:
        """How many elements of ``dtype`` the message holds."""
        return self.nbytes // np.dtype(dtype).itemsize


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
    if group is not None:
        return group
    from .world import get_default_group

    return get_default_group()


@public
def batch_isend_irecv(ops: Sequence[P2POp]) -> list[Work]:
    """Post every transfer of ``ops`` at once; one ``Work`` per op, in the order given.

    Receives are posted before sends, so a message that arrives early lands in its buffer
    directly. Every op is validated before anything is posted.
    """
    ops = list(ops)
    bad = [o for o in ops if not isinstance(o, P2POp)]
    if bad:
        raise TypeError(f"batch_isend_irecv: expected P2POp items, got {type(bad[0]).__name__}")
    works: list[Work | None] = [None] * len(ops)
    order = sorted(range(len(ops)), key=lambda i: ops[i].op != "irecv")
    for i in order:
        o = ops[i]
        g = _group(o.group)
        works[i] = (g.irecv(o.buf, o.peer, o.tag) if o.op == "irecv"
                    else g.isend(o.buf, o.peer, o.tag))
    return [w for w in works if w is not None]


@public
def wait_all(works: Iterable[Work], timeout: float | None = None) -> list[Any]:
    """Wait for every work within one deadline (default: each work's own); their results."""
    works = list(works)
    if timeout is None:
        return [w.wait() for w in works]
    t = check_timeout("wait_all", timeout)
    deadline = time.monotonic() + t
    # a work already complete returns at once; others get what is left (at least a tick)
    return [w.wait(max(1e-3, deadline - time.monotonic())) for w in works]


def _check_probe(g: "ProcessGroup", op: str, src: int, tag: int) -> tuple[str, int, int]:
    where = g._where(op)
    g._usable(op)
    if src != ANY_SOURCE:
        src = check_rank(where, "src", src, g.size)
    if tag != ANY_TAG:
        tag = check_tag(where, tag, g._max_tag)
    return where, src, tag


@public
def iprobe(src: int = ANY_SOURCE, tag: int = ANY_TAG, *, group: Any = None) -> Status | None:
    """The ``Status`` of a message waiting to be received from ``src`` with ``tag``, else None."""
    g = _group(group)
    _, src, tag = _check_probe(g, "iprobe", src, tag)
    found = g.backend.probe(src, tag)
    return _status(g, found) if found is not None else None


def _status(g: "ProcessGroup", found: tuple[int, int, int]) -> Status:
    """The ``Status`` of a probed message; under ``HPCDP_DEBUG`` its size without the header."""
    s, t, nbytes = found
    return Status(s, t, nbytes if g._debug == "off" else payload_nbytes(nbytes))


@public
def probe(src: int = ANY_SOURCE, tag: int = ANY_TAG, *, group: Any = None,
          timeout: float | None = None) -> Status:
    """Block until a message from ``src`` with ``tag`` can be received; its ``Status``.

    Raises ``CommTimeoutError`` after ``timeout`` (default: the group's), ``PeerFailureError``
    when every rank it could come from is gone.
    """
    g = _group(group)
    where, src, tag = _check_probe(g, "probe", src, tag)
    t = g.timeout if timeout is None else g._timeout_of("probe", timeout)
    box: list[Any] = []

    def found() -> bool:
        hit = g.backend.probe(src, tag)
        if hit is not None:
            box.append(hit)
        return hit is not None

    rec = g._rec  # recorded, so a rank stuck waiting for any sender shows where in its dump
    tok = rec.begin("probe", g, 0, None, None, src) if rec is not None else 0
    try:
        if not poll_until(found, time.monotonic() + t):
            raise CommTimeoutError(f"{where}: no message from "
                                   f"{'any rank' if src == ANY_SOURCE else f'rank {src}'} with "
                                   f"{'any tag' if tag == ANY_TAG else f'tag {tag}'} within {t:g} s")
    except HpcdpError as exc:
        trace.on_error(rec, tok, exc)
        raise
    if rec is not None:
        rec.end(tok)
    return _status(g, box[0])


@public
def recv_any(buf: Any = None, src: int = ANY_SOURCE, tag: int = ANY_TAG, *,
             dtype: Any = None, group: Any = None, timeout: float | None = None
             ) -> tuple[Any, Status]:
    """Receive the next message from ``src`` (any rank by default) with ``tag``.

    With ``buf=None`` a 1-D numpy array of ``dtype`` (default uint8) is allocated at the size the
    probe reports, which is the size of a message that has been sent. Returns ``(array, status)``.
    """
    g = _group(group)
    t = g.timeout if timeout is None else g._timeout_of("recv", timeout)
    deadline = time.monotonic() + t
    st = probe(src, tag, group=g, timeout=t)
    given = buf is not None
    if buf is None:
        dt = np.dtype(np.uint8 if dtype is None else dtype)
        if st.nbytes % dt.itemsize:
            raise ValueError(f"{g._where('recv')}: the message from rank {st.source} (tag "
                             f"{st.tag}) has {st.nbytes} bytes, not a whole number of {dt}")
        buf = np.empty(st.nbytes // dt.itemsize, dt)
    elif dtype is not None and np.dtype(dtype) != buf.dtype:
        raise TypeError(f"{g._where('recv')}: dtype={np.dtype(dtype)} but buf is {buf.dtype}")
    left = max(1e-3, deadline - time.monotonic())
    if g._debug != "off":  # a buffer made here is compared by what the caller chose of it
        check = "full" if given else "size" if dtype is None else "dtype"
        return g._irecv(buf, st.source, st.tag, check).wait(left), st
    if st.source == g.rank:  # a message to oneself: the blocking path refuses self-receives
        return g.irecv(buf, st.source, st.tag).wait(left), st
    return g.recv(buf, st.source, st.tag, timeout=left), st

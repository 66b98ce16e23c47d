"""``batch_isend_irecv``'s engine: every op checked before any is posted, then the receives,
then the sends, each through its group's ``PointToPoint`` (``_group_p2p``); a halo step's
batch of plain arrays on MPI's quick lane in one tight loop, cheaper than the calls one by one.
"""
from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from .._arrays import SUPPORTED_SET
from ..errors import HpcdpError
from .work import QuickBatch, QuickWork, Work

if TYPE_CHECKING:
    from .group import ProcessGroup

__all__ = ["post_batch"]

_ndarray = np.ndarray


def post_batch(ops: list[Any], kind: type, default: Callable[[], "ProcessGroup"]) -> list[Work]:
    """``batch_isend_irecv``'s engine: ``ops`` (items of ``kind``, ``P2POp``; a group of None is
    ``default()``), every one checked before any is posted, then the receives posted, then the
    sends; one ``Work`` per op, in the order given.

    A batch of plain arrays on one group with a quick lane (MPI), the usual halo step, is
    checked in one loop with ``isend``/``irecv``'s quick checks, posted by one
    ``Lane.start_all``, and its ``QuickWork``s made in one more loop, returned as a
    ``QuickBatch`` that ``wait_all`` tests as posted: what the calls one by one do, without
    their per-op calls, lookups and gathering, so the batch (the spelling torch users are told
    to use for many transfers) costs less than those calls. Any other batch goes
    ``_post_general``'s way. Numbers are taken in posting order, so the flight record counts
    the messages as the calls one by one would."""
    g: Any = None
    last: Any = kind  # (the ``group`` field of the op before: not a group)
    items: list[tuple[int, Any, int, int, bool]] = []  # the receives, then ``sends``
    sends: list[tuple[int, Any, int, int, bool]] = []
    for i, o in enumerate(ops):
        if type(o) is not kind and not isinstance(o, kind):
            raise TypeError(f"batch_isend_irecv: expected P2POp items, got {type(o).__name__}")
        if (h := o.group) is not last:  # (a batch is mostly one group's: looked up once)
            last = h
            if h is None:
                h = default()
            if g is None:
                g = h
                p = g._p2p
                ranks, max_tag, lane = p._ranks, p._max_tag, p._lane
                if lane is None or not g._fast:
                    return _post_general(ops, kind, default)
            elif h is not g:
                return _post_general(ops, kind, default)
        x, peer, tag = o.buf, o.peer, o.tag
        # (``isend``/``irecv``'s quick checks; a receive's buffer must be writeable)
        if not (type(x) is _ndarray and type(peer) is int and type(tag) is int
                and peer in ranks and 0 <= tag <= max_tag and x.dtype in SUPPORTED_SET
                and (f := x.flags).c_contiguous):
            return _post_general(ops, kind, default)
        if o.op == "isend":
            sends.append((i, x, peer, tag, True))
        elif f.writeable:
            items.append((i, x, peer, tag, False))
        else:
            return _post_general(ops, kind, default)
    if sends:
        items += sends
    n = len(items)
    works: list[Any] = [None] * n
    if not n:
        return works
    counts = p._counts
    rec = g._rec
    lines = rec is not None and rec.lines
    raws: list[Any] = []
    err = None
    try:
        lane.start_all(items, raws)
    except HpcdpError as exc:  # (the requests started before it are in raws)
        err = exc
    for (i, x, peer, tag, send), raw in zip(items, raws):
        op = "send" if send else "recv"
        c = counts.get((op, peer, tag))
        if c is None:  # (``_count`` inlined)
            c = counts.setdefault((op, peer, tag), itertools.count(1))
        works[i] = QuickWork(g, lane, raw, x, send, peer, tag, next(c),
                             rec.begin(op, g, 0, x.shape, x.dtype, peer) if lines else 0)
    m = len(raws)
    if m == n:  # (tested as posted by ``wait_all``)
        b = QuickBatch(works)
        b._snap, b._lane, b._raws = works, lane, raws
        return b
    for i, x, peer, tag, send in items[m:]:  # declined at ``m`` (over the lane's limit, a
        op = "send" if send else "recv"  # peer gone), or failed: one by one, as ``isend``
        k = p._count(op, peer, tag)  # and ``irecv`` post them
        if err is not None:
            raise p._failed(op, x, peer, tag, k, -1, err) from err
        try:
            raw = lane.start(send, x, peer, tag)
        except HpcdpError as exc:
            raise p._failed(op, x, peer, tag, k, -1, exc) from exc
        works[i] = (QuickWork(g, lane, raw, x, send, peer, tag, k,
                              rec.begin(op, g, 0, x.shape, x.dtype, peer) if lines else 0)
                    if raw is not None else
                    p._post_quick(send, x, peer, tag, "dst" if send else "src", None if send else x, k))
    return works


def _post_general(ops: list[Any], kind: type, default: Callable[[], "ProcessGroup"]) -> list[Work]:
    """``post_batch`` of any other batch (several groups, ``PROC_NULL``, tensors, non-contiguous
    or read-only arrays, a group without a quick lane or under ``HPCDP_DEBUG=detail``): every
    op checked by ``_check_op``, then each posted by its group's ``isend``/``irecv`` (which
    check it again: this way is not the one a halo step takes), receives first."""
    recvs: list[tuple[Any, ...]] = []
    sends: list[tuple[Any, ...]] = []
    dflt = last = p = None
    for i, o in enumerate(ops):
        if type(o) is not kind and not isinstance(o, kind):
            raise TypeError(f"batch_isend_irecv: expected P2POp items, got {type(o).__name__}")
        g = o.group
        if g is None:
            g = dflt if dflt is not None else (dflt := default())
        if g is not last:
            last, p = g, g._p2p
        send = o.op == "isend"
        (sends if send else recvs).append((i, p, send, p._check_op(send, o.buf, o.peer, o.tag),
                                           o.peer, o.tag))
    works: list[Any] = [None] * len(ops)
    for i, p, send, (x, tc), peer, tag in recvs + sends:
        works[i] = p._post_checked(send, x, peer, tag, tc)
    return works

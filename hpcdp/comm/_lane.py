"""The latency lanes of blocking collectives on plain host arrays, with nothing of the general
path but its bookkeeping: ``allreduce`` (A2 of PERF.md: a small allreduce costs what this shows),
``all_gather`` and ``broadcast`` (A3: at 1-2 MiB the general path's request, ``Work`` and checks
are a visible share of the call; README's benchmark table has the figures).

``ProcessGroup`` tries them first when the group's ``_fast`` switch is on (debug level not
"detail", the group usable, not deterministic) and the call is blocking; None sends the call to
the general path, which checks and explains everything a lane does not look at. A lane posts
what the general path posts (the backend's own requests, the same sequence number, flight-record
entry and sampled check), so ranks taking different lanes for the same call still match.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from . import debug as _debug
from ..errors import HpcdpError
from ..ops import ReduceOp
from ..trace import hooks as trace
from .work import WATCH_AFTER, annotate, finish_wait, work_where

__all__ = ["allreduce_now", "all_gather_now", "broadcast_now"]

_ndarray = np.ndarray
#: dtypes and ops for which the lane needs no further checks
_FAST_DTYPES = frozenset(np.dtype(t) for t in (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float32", "float64"))
_FAST_OPS: dict[Any, ReduceOp] = {}
for _o in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PROD):
    _FAST_OPS[_o] = _o
    _FAST_OPS[_o.value] = _o


def allreduce_now(g: Any, x: Any, op: Any, out: Any, timeout: float | None) -> Any:
    """``g.allreduce(x, op, out=out, timeout=timeout)``, blocking, handed to the backend's
    ``quick_allreduce`` where it has one. None: not such a call (the general path, with its
    checks and messages, takes it). Two arrays that both own their memory cannot overlap
    (``np.may_share_memory`` costs more than this lane); views take the general path."""
    try:
        rop = _FAST_OPS.get(op)
    except TypeError:  # unhashable: the general path says what is wrong with it
        return None
    if (rop is None or type(x) is not _ndarray or (xd := x.dtype) not in _FAST_DTYPES
            or not (xf := x.flags).c_contiguous):
        return None
    small = x.nbytes <= 65536
    if out is None:  # small: a copy reduced in place is cheaper than empty + separate
        out = send = x.copy() if small else np.empty(x.shape, xd)
        if not small:
            send = x
    elif (type(out) is _ndarray and (f := out.flags).c_contiguous and f.writeable
          and (out is x or (f.owndata and xf.owndata and out.dtype is xd
                            and out.shape == x.shape))):
        send = x
    else:
        return None
    t = g._timeout if timeout is None else g._timeout_of("allreduce", timeout)
    seq = next(g._seq)
    rec = g._rec
    tok = rec.begin("allreduce", g, seq, x.shape, xd, -1) if rec is not None else 0
    # ``_debug.sampled(seq)``, inlined: this lane is A2's, where a call costs what it shows
    if g._sample and (seq <= _debug.SAMPLE_FIRST or not seq & _debug.SAMPLE_MASK):
        _check_sampled(g, seq, t, tok, rop.value, x.shape, xd)
    be = g.backend
    if x.ndim == 1:
        sflat, rflat = send, out
    else:
        rflat = out.reshape(-1)
        sflat = rflat if send is out else send.reshape(-1)
    try:
        quick = be.quick_allreduce
        first = t if t < WATCH_AFTER else WATCH_AFTER  # then the watchdog (work.finish_wait)
        if quick is not None:
            req = quick(sflat, rflat, rop, first)
        elif (req := be.allreduce(sflat, rflat, rop)).wait(first):
            req = None
    except HpcdpError as exc:
        g._note_failure("allreduce", seq, f"failed ({type(exc).__name__})")
        err = annotate(exc, work_where(g, "allreduce", seq))
        trace.on_error(rec, tok, err)
        raise err from exc
    if req is not None and (err := finish_wait(g, "allreduce", seq, req, t, first)):
        trace.on_error(rec, tok, err)
        raise err
    if rec is not None:
        rec.end(tok)
    return out


def _check_sampled(g: Any, seq: int, t: float, tok: int, op: str, shape: Any, dtype: Any) -> None:
    """The lane's sampled check (``comm.debug``), failing its flight-record entry."""
    try:
        _debug.check_sampled(g, "allreduce", seq, t, op=op, shape=shape, dtype=dtype)
    except HpcdpError as exc:
        trace.on_error(g._rec, tok, exc)
        raise


def all_gather_now(g: Any, x: Any, out: Any, timeout: float | None) -> Any:
    """``g.all_gather(x, out=out, timeout=timeout)``, blocking, through the backend's
    ``quick_all_gather``; None: not such a call. ``out`` must own its memory and ``x`` own
    its own (or be a view of another owner), so that they cannot overlap without a check."""
    be = g.backend
    quick = be.quick_all_gather
    if (quick is None or type(x) is not _ndarray or (xd := x.dtype) not in _FAST_DTYPES
            or not (xf := x.flags).c_contiguous):
        return None
    n = len(g._members)  # (``g.size``, without the property's call)
    shape = (n, *x.shape)
    if out is None:
        out = np.empty(shape, xd)
    elif not (type(out) is _ndarray and (f := out.flags).c_contiguous and f.writeable and f.owndata
              and out.dtype is xd and out.shape == shape
              and (xf.owndata or (type(b := x.base) is _ndarray and b is not out
                                  and b.flags.owndata))):
        return None
    _quick(g, "all_gather", timeout, x, -1, quick,
           (x if x.ndim == 1 else x.reshape(-1), out if out.ndim == 2 else out.reshape(n, -1)), {})
    return out


def broadcast_now(g: Any, x: Any, root: Any, timeout: float | None) -> Any:
    """``g.broadcast(x, root, timeout=timeout)`` in place, blocking, through the backend's
    ``quick_broadcast``; None: not such a call (a read-only or non-contiguous ``x``, a root
    to check)."""
    quick = g.backend.quick_broadcast
    if (quick is None or type(x) is not _ndarray or type(root) is not int
            or not 0 <= root < g.size or x.dtype not in _FAST_DTYPES
            or not (f := x.flags).c_contiguous or not f.writeable):
        return None
    _quick(g, "broadcast", timeout, x, root, quick, (x if x.ndim == 1 else x.reshape(-1), root),
           {"root": root})
    return x


def _quick(g: Any, op: str, timeout: float | None, x: np.ndarray, peer: int,
           quick: Any, args: tuple[Any, ...], call: dict[str, Any]) -> None:
    """A lane's bookkeeping around ``quick(*args, first)``: the general path's sequence number,
    flight-record entry and sampled check (``call``: the arguments it compares besides shape and
    dtype), the timeout and its error."""
    t = g._timeout if timeout is None else g._timeout_of(op, timeout)
    seq = next(g._seq)
    rec = g._rec
    tok = rec.begin(op, g, seq, x.shape, x.dtype, peer) if rec is not None else 0
    if g._sample and (seq <= _debug.SAMPLE_FIRST or not seq & _debug.SAMPLE_MASK):
        try:
            _debug.check_sampled(g, op, seq, t, **call, shape=x.shape, dtype=x.dtype)
        except HpcdpError as exc:
            trace.on_error(rec, tok, exc)
            raise
    first = t if t < WATCH_AFTER else WATCH_AFTER  # then the watchdog (work.finish_wait)
    try:
        req = quick(*args, first)
    except HpcdpError as exc:
        g._note_failure(op, seq, f"failed ({type(exc).__name__})")
        err = annotate(exc, work_where(g, op, seq))
        trace.on_error(rec, tok, err)
        raise err from exc
    if req is not None and (err := finish_wait(g, op, seq, req, t, first)):
        trace.on_error(rec, tok, err)
        raise err
    if rec is not None:
        rec.end(tok)

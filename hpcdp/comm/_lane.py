"""``allreduce``'s latency lane: a blocking allreduce of a plain host array, with nothing of the
general path but its bookkeeping (A2 of PERF.md: a small allreduce costs what this shows).

``ProcessGroup.allreduce`` tries it first when the group's ``_fast`` switch is on (debug level
not "detail", the group usable, not deterministic); None sends the call to the general path,
which checks and explains everything this lane does not look at.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from . import debug as _debug
from ..errors import HpcdpError
from ..ops import ReduceOp
from ..trace import hooks as trace
from .work import WATCH_AFTER, annotate, finish_wait, work_where

__all__ = ["allreduce_now"]

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

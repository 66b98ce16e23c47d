"""Where a collective's result lands: numpy-style ``out=`` buffers and reduction plans.

Shared by ``ProcessGroup`` and its point-to-point methods: a call gets a contiguous buffer the
backend may write (the user's ``out=`` when it can be, else a scratch one), and the ``finish``
that runs once the transfer is complete copies it where numpy semantics say it belongs. A call
made on torch tensors' views hands its result back as tensors through ``via_tensors``.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .._arrays import contiguous, overlaps
from .._tensors import TensorCall
from .validation import check_out
from ..ops import ReduceOp
from .work import Work, then

__all__ = ["finish_into", "reduction_plan", "result_buffer", "via_tensors"]


def reduction_plan(x: Any, buf: Any, rop: ReduceOp, n: int, xp: Any,
                   inplace: bool) -> tuple[Any, Any, ReduceOp, Callable[[Any], None] | None]:
    """(send, receive buffer for the backend, backend op, post-step) of a reduction.

    ``mean`` is a sum then a division; on float16 both happen in float32 and round once, so a
    sum that overflows half precision still averages to what numpy's ``mean`` gives.
    """
    if rop is not ReduceOp.MEAN:
        return (buf if inplace else contiguous(x)), buf, rop, None
    if x.dtype != np.float16:
        return ((buf if inplace else contiguous(x)), buf, ReduceOp.SUM,
                lambda b: xp.divide(b, n, out=b, casting="unsafe"))
    wide = xp.empty(buf.shape, np.float32) if buf is not None else None

    def post(b: Any) -> None:
        xp.divide(wide, n, out=wide)
        b[...] = wide

    return x.astype(np.float32), wide, ReduceOp.SUM, post


def result_buffer(where: str, out: Any, shape: tuple, dtype: np.dtype, xp: Any,
                  x: Any = None) -> tuple[Any, Any]:
    """(user-visible result, contiguous buffer the backend writes).

    ``out`` that overlaps ``x`` without being ``x`` itself gets a separate buffer: MPI
    rejects aliased buffers and other transports would read half-written input.
    """
    if out is None:
        buf = xp.empty(shape, dtype)
        return buf, buf
    check_out(where, out, shape, dtype, xp)
    aliased = x is not None and out is not x and overlaps(out, x)
    return out, (out if out.flags.c_contiguous and not aliased else xp.empty(shape, dtype))


def finish_into(result: Any, buf: Any, post: Callable[[Any], None] | None = None) -> Callable[[], Any]:
    """What completes a call: ``post`` on the backend's buffer, then the copy into the user's."""
    def finish() -> Any:
        if post is not None:
            post(buf)
        if buf is not result:
            result[...] = buf
        return result

    return finish


def via_tensors(tc: TensorCall, result: Any) -> Any:
    """A call made on tensors' array views (``_tensors.TensorCall``), its result handed back as
    tensors: now, or when its ``Work`` completes (then ``wait()`` returns the tensors)."""
    return then(result, tc.back) if isinstance(result, Work) else tc.back(result)

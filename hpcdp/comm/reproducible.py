"""Deterministic mode's reductions: sums whose bits depend only on the values contributed.

``hpcdp.init(deterministic=True)`` (or ``HPCDP_DETERMINISTIC=1``) makes a group route ``sum``
and ``mean`` of floating-point arrays in ``allreduce``, ``reduce`` and ``reduce_scatter``
here; the layers above (DDP, ZeRO, FSDP, gradient clipping) call :func:`sum_rows` and
:func:`exact_total` directly to add their per-chunk gradients in the same exact way.

Each reduction is ordinary collectives, all of which any backend and any algorithm compute
exactly (``comm.exact`` has the arithmetic and its accuracy bound). Float32 and float64 data on
the host go range by range (``_RANGE_BYTES`` of input each, so that every range's exchanges and
temporaries stay in cache; a scatter is one range), each range in two steps:

1. ``allreduce(MAX)`` of int16 *block codes*, two per block of ``n / exact.BLOCKS`` elements
   (the largest exponent and the smallest nonzero one), a zeros flag and the number of rows:
   every rank learns the same grid per block (about 4 KiB per range);
2. the values on that grid, summed by the plain ``allreduce``/``reduce``/``reduce_scatter``,
   in the layout that moves the fewest bytes (``exact.block_plan``): the values themselves as
   one float64 (float32 data within 27 binades per block), or split into a float32 hi and a
   float64 lo (within 23 binades past 53 bits), or into two float64 halves (within 50); a
   block the range's layout cannot take travels as two halves in a tail of the float64
   exchange, so that one value far below its block's largest costs that block 8 bytes more per
   element, not the range 4; at most two finite summands (two ranks, one row each): the data
   itself in its own dtype, whose one IEEE addition is the exact sum correctly rounded,

then every rank rounds the exact sums once. A range with inf/NaN, or deeper than two halves
hold, takes the per-element method instead (same on every rank: the codes say so): an
``allreduce(MAX)`` of int16 codes per element, then values, halves or int64 limbs. Bytes on the
wire per element: 8 for float32 data and 12 for float64 (plus 8 per element of a tail block)
against 4 or 8 for the plain sum; 4 or 8 with at most two summands; plus 4 KiB per 1 MiB range
(:func:`record_phases` counts them). Memory passes per element and row, float64 data, a range
without zeros: three reads and one write for the codes (``bitwise_and``, ``max``, ``min``),
four for the split (rounding to the grid takes two, the lo one, adding it and the hi over the
rows one), against the plain sum's one addition over the rows; then one for the rounding. The
rounding to the grid adds and subtracts one constant for the whole range where every block's
bounds allow it (``exact.uniform_grid``: a scalar operand streams at about twice the speed of
one sigma per block), and rounds again, with their own sigma, the few blocks that hold a value
far below the range's largest; the common plans are read off a few reductions of the codes
(``exact.quick_plan``) rather than ``exact.block_plan``'s per-block arithmetic. The
split's temporaries reuse the codes' scratch, so a range's working set is its rows, one scratch
of their size and the two send buffers. Non-finite values cost one more small exchange, only
when some element has one. ``max`` and ``min`` need nothing (they do not depend on order);
``prod`` is refused in this mode rather than silently order-dependent.

Asynchronous calls complete before they return (the Work is already done): the two passes
depend on each other, and a deterministic run is about the bits, not overlap.
"""
from __future__ import annotations

import functools
import threading
import time
from fractions import Fraction
from typing import Any, Callable, TypeVar

import numpy as np

from .._arrays import xp_of
from ..trace import hooks as trace
from ._buffers import result_buffer
from .validation import check_out
from ..errors import CollectiveMismatchError, CommTimeoutError
from ..ops import ReduceOp
from . import exact

__all__ = ["sum_rows", "exact_total", "reducible", "routes", "takes", "run", "check_agreement",
           "record_phases"]

_MAX_ROWS = 32767       # the rows count travels as an int16 code
_RANGE_BYTES = 1 << 20  # input bytes per range of the blocked path (its exchanges stay in cache)
_tls = threading.local()
_phases: dict[str, float] | None = None   # while the benchmark records: seconds per step
_F = TypeVar("_F", bound=Callable[..., Any])


def routes() -> bool:
    """Whether a deterministic group's float sum goes to this module: not from inside it,
    where the float64 sums of exactly representable values are the plain backend's to do."""
    return not getattr(_tls, "inside", 0)


def takes(rop: ReduceOp, dtype: Any, where: str) -> bool:
    """Whether a deterministic group's reduction of ``rop`` on ``dtype`` comes here (float sum
    and mean, not from inside this module); ``prod`` of floats and sums of dtypes without an
    exact method (bfloat16) raise: their bits would depend on the order."""
    dt = np.dtype(dtype)
    if rop is ReduceOp.PROD and dt.kind in "fc":
        raise ValueError(f"{where}: op 'prod' on {dt} is not reproducible, and "
                         "this group is in deterministic mode (sum, mean, max and min are)")
    if rop in (ReduceOp.SUM, ReduceOp.MEAN) and dt.kind not in "fciub":
        raise TypeError(f"{where}: deterministic mode sums float16/32/64 and complex exactly, "
                        f"not {dt} (bfloat16: sum a float32 copy)")
    return reducible(rop, dtype) and routes()


def run(group: Any, opname: str, x: Any, rop: ReduceOp, out: Any, async_op: bool,
        timeout: float | None, mode: str, root: int = 0) -> Any:
    """``group.<opname>(x, ...)`` in deterministic mode: the exchanges of :func:`sum_rows` as
    one recorded call of the group; complete before it returns, also when asked for
    asynchronously (then a completed Work)."""
    where = group._where(opname)
    xp = xp_of(x)
    shape = x.shape if mode != "scatter" else (x.shape[0] // group.size, *x.shape[1:])
    result = None
    if mode != "root" or group.rank == root:
        result, _ = result_buffer(where, out, shape, x.dtype, xp, x)
    elif out is not None:  # checked here too: a bad out= must not leave only the root raising
        check_out(where, out, shape, x.dtype, xp)
    t = group._timeout_of(opname, timeout)
    call: dict[str, Any] = {"op": rop.value, "shape": x.shape, "dtype": x.dtype}
    if mode == "root":
        call["root"] = root
    seq, tok = group._begin(opname, t, True, **call)
    try:
        sum_rows(group, x.reshape(1, *x.shape), mode=mode, root=root,
                 divisor=group.size if rop is ReduceOp.MEAN else 1, dtype=x.dtype, timeout=t,
                 out=result)
    except Exception as exc:
        trace.on_error(group._rec, tok, exc)
        raise
    if group._rec is not None:
        group._rec.end(tok)
    return group._done(opname, seq, result, async_op)


def record_phases(on: bool = True) -> dict[str, float]:
    """Start (``on``) or stop recording the seconds the blocked path spends in each step
    (codes, codes exchange, layout, split, values exchange, rounding), summed over calls; returns
    the record (stopping returns what was recorded), with ``bytes``: what this rank handed its
    exchanges. For the benchmark's breakdown: a step's share is what an optimisation has to go
    after. Process-wide (simulated ranks share it); off, each step costs one global lookup."""
    global _phases
    done = _phases if _phases is not None else {}
    _phases = {} if on else None
    return _phases if on else done


def _lap(name: str, t0: float) -> float:
    """Add the time since ``t0`` to step ``name`` of the record (if recording); the new t0."""
    rec = _phases
    if rec is None:
        return 0.0
    now = time.perf_counter()
    rec[name] = rec.get(name, 0.0) + now - t0
    return now


def _count(name: str, amount: float) -> None:
    """Add ``amount`` to entry ``name`` of the record (if recording): bytes sent."""
    rec = _phases
    if rec is not None:
        rec[name] = rec.get(name, 0.0) + amount


def _t0() -> float:
    """A start time for :func:`_lap` while recording (0.0 otherwise: no clock read)."""
    return time.perf_counter() if _phases is not None else 0.0


def _plain_inside(fn: _F) -> _F:
    """Run ``fn`` with this thread's float sums on the plain path (see :func:`routes`)."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _tls.inside = getattr(_tls, "inside", 0) + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _tls.inside -= 1
    return wrapper  # type: ignore[return-value]


def reducible(rop: ReduceOp, dtype: Any) -> bool:
    """Whether deterministic mode takes a reduction of ``rop`` on ``dtype`` (floats: sum and
    mean; integers and booleans are exact already)."""
    return rop in (ReduceOp.SUM, ReduceOp.MEAN) and np.dtype(dtype).kind in "fc"


def _real(x: Any) -> Any:
    """Complex values as (real, imag) pairs of their real dtype; real arrays unchanged."""
    if x.dtype.kind == "c":
        return x.view(np.float64 if x.dtype == np.complex128 else np.float32)
    return x


def _as_rows(x: Any, xp: Any, ws: Any = None) -> Any:
    """Real ``x`` as float64 (a copy in the workspace ``ws`` when it is not float64 already)."""
    if x.dtype == np.float64:
        return x
    if ws is None:
        return x.astype(np.float64)
    wide = ws.take("rows", x.shape, np.float64, xp)
    xp.copyto(wide, x)
    return wide


@_plain_inside
def sum_rows(group: Any, rows: Any, *, mode: str = "all", root: int = 0, divisor: int = 1,
             dtype: Any = None, timeout: float | None = None, replicate: Any = None,
             out: Any = None) -> Any:
    """Exact sum over axis 0 of ``rows`` and over the ranks of ``group``, rounded once.

    Args:
        group: the ``ProcessGroup`` to reduce over (its plain integer collectives carry it).
        rows: ``(m, *shape)`` float array: this rank's m contributions (m may differ per rank,
            0 included; at most 32767).
        mode: "all" (every rank gets the result), "root" (only ``root``; others get None) or
            "scatter" (rank i gets part i of axis 0 of ``shape``, which the group size divides).
        divisor: the result is the rounded sum divided by it in ``dtype`` (a mean's count).
        dtype: result dtype (default: that of ``rows``; float16, float32, float64, complex).
        replicate: a second group whose ranks hold the same part (FSDP's hybrid sharding: the
            sum runs over ``group`` x ``replicate``, still exactly: the grid is agreed over both,
            the limbs are added over ``group`` then over ``replicate``, and rounded once).
        out: a C-contiguous array of the result's shape and dtype to write into.

    Returns:
        The array of ``shape`` (or its part), or None off the root in "root" mode.
    """
    xp = xp_of(rows)
    out_dtype = np.dtype(dtype if dtype is not None else rows.dtype)
    if out_dtype.kind == "c":
        part_dtype = np.dtype(np.float64 if out_dtype == np.complex128 else np.float32)
    else:
        part_dtype = out_dtype
    if part_dtype not in exact.FORMATS:
        raise TypeError(f"deterministic sum: dtype {out_dtype} is not float16, float32, float64 "
                        "or complex (bfloat16 arrays: sum them as float32)")
    if replicate is not None and mode == "root":
        raise ValueError("sum_rows: replicate= goes with mode 'all' or 'scatter'")
    m = int(rows.shape[0])
    if m > _MAX_ROWS:
        raise ValueError(f"deterministic sum: {m} rows per rank exceeds {_MAX_ROWS}")
    shape = tuple(rows.shape[1:])
    count = int(np.prod(shape, dtype=np.int64))
    in_dtype = np.dtype(rows.dtype)
    if in_dtype.kind == "c":
        in_dtype = np.dtype(np.float64 if in_dtype == np.complex128 else np.float32)
    if in_dtype not in exact.FORMATS:
        in_dtype = np.dtype(np.float64)
    if mode not in ("all", "root", "scatter"):
        raise ValueError(f"sum_rows: mode must be 'all', 'root' or 'scatter', got {mode!r}")
    real = _real(xp.ascontiguousarray(rows).reshape(m, count))   # complex: (m, 2 count)
    n = real.shape[1]
    # a mean: the sum in float64 (no overflow of a narrower format on the way), then divided
    rounded = part_dtype if divisor == 1 else np.dtype(np.float64)
    direct = (out is not None and divisor == 1 and out_dtype.kind != "c" and out.dtype == part_dtype
              and out.flags.c_contiguous)
    target = out.reshape(-1) if direct else None
    if xp is np and n and real.dtype in (np.float32, np.float64):
        result = _blocked(group, real, mode, root, rounded, target, timeout, replicate)
    else:
        result = _elementwise(group, real, in_dtype, mode, root, rounded, target, timeout, replicate)
    if result is None:
        return None
    if divisor != 1:
        result = xp.divide(result, divisor).astype(part_dtype)
    if out_dtype.kind == "c":
        result = result.view(out_dtype)
    result = result.reshape((shape[0] // group.size, *shape[1:]) if mode == "scatter" else shape)
    if out is not None and not direct:
        out[...] = result
        return out
    return out if direct else result


def _blocked(group: Any, real: Any, mode: str, root: int, rounded: np.dtype, target: Any,
             timeout: float | None, replicate: Any) -> Any:
    """The sum of ``real`` (``(m, n)`` float32 or float64 rows) range by range
    (:func:`_blocked_range`): each range's exchanges and temporaries stay in cache, and each
    element's sum is exact whatever the ranges (a scatter is one range: its parts are laid out
    rank-major). The flat result in ``rounded``; None off the root in mode "root"."""
    n = real.shape[1]
    step = _RANGE_BYTES // real.dtype.itemsize
    if mode == "scatter" or n <= step:
        return _blocked_range(group, real, mode, root, rounded, target, timeout, replicate)
    result = target
    if result is None and (mode == "all" or group.rank == root):
        result = np.empty(n, rounded)
    for lo in range(0, n, step):
        _blocked_range(group, real[:, lo:lo + step], mode, root, rounded,
                       None if result is None else result[lo:lo + step], timeout, replicate)
    return result


def _blocked_range(group: Any, real: Any, mode: str, root: int, rounded: np.dtype, target: Any,
                   timeout: float | None, replicate: Any) -> Any:
    """One range of :func:`_blocked`: ``allreduce(MAX)`` of the block codes (a few bytes per
    block of ``n / exact.BLOCKS`` elements), then the values on the blocks' grids in the
    layout ``exact.block_plan`` picks (one float64 each, a float32 hi and a float64 lo, or two
    float64 halves; the blocks the layout cannot take as halves in a tail), summed by the plain
    backend; a range some block of which fits none goes to :func:`_elementwise` whole (every
    rank sees the same codes)."""
    xp = np
    m, n = real.shape
    nb = min(exact.BLOCKS, n)
    ws = exact.workspace()
    t0 = _t0()
    head = ws.take("bhead", (2 * (nb + 1) + 2,), np.int16, xp)
    head[-2] = exact.block_codes(real, xp, nb, head[:-2].reshape(2, nb + 1))   # any zero
    head[-1] = m
    t0 = _lap("codes", t0)
    _count("bytes", head.nbytes)
    agreed = group.allreduce(head, "max", out=head, timeout=timeout)
    size = group.size
    if replicate is not None:
        agreed = replicate.allreduce(agreed, "max", timeout=timeout)
        size *= replicate.size
    t0 = _lap("codes exchange", t0)
    summands = max(int(agreed[-1]), 1) * size
    code = agreed[:-2].reshape(2, nb + 1)
    if rounded == real.dtype and exact.one_addition(code, summands, real.dtype):
        return _one_addition(group, real, mode, root, target, timeout, replicate)
    quick = exact.quick_plan(code, summands, real.dtype, xp, n)
    if quick is not None:   # the common plans, on one grid (block_plan's choice there)
        layout, sigma, tail, sigma2 = quick[0], quick[3], quick[4], quick[5]
        uni: Any = (quick[1], quick[2])
    else:
        layout, sigma, tail, sigma2 = exact.block_plan(code, summands, real.dtype, xp, n)
        uni = None
    if not layout:
        return _elementwise(group, real, real.dtype, mode, root, rounded, target, timeout, replicate)
    zeros = bool(agreed[-2])
    if tail is not None:
        pos, block = exact.tail_positions(tail, nb, n, xp)
        if uni is None and layout == 3:
            uni = _uniform(code, summands, real.dtype, layout, nb, tail)
        t0 = _lap("layout", t0)
        return _tailed(group, real, mode, root, rounded, target, timeout, replicate, layout,
                       sigma, pos, block, sigma2, zeros, t0, uni)
    if uni is None and layout > 1:
        uni = _uniform(code, summands, real.dtype, layout, nb, None)
    t0 = _lap("layout", t0)
    parts = group.size if mode == "scatter" else 1
    per = n // parts
    if layout == 3:   # hi float32, lo float64: two exchanges, each already part-major
        hi = ws.take("bhi", (n,), np.float32, xp)
        lo = ws.take("blo", (n,), np.float64, xp)
        _split(real, sigma, nb, hi, lo, uni)
        sends = [hi.reshape(parts, per), lo.reshape(parts, per)]
    else:
        main = ws.take("bmain", (layout, n), np.float64, xp)
        if m == 0:
            main.fill(-0.0)   # the sum's identity: no contribution, not a +0 one
        elif layout == 1:     # rows added one by one: numpy's sum would start from +0
            xp.copyto(main[0], real[0])
            for r in real[1:]:
                xp.add(main[0], r, out=main[0])
        else:
            _split(real, sigma, nb, main[0], main[1], uni)
        # (layout, n) -> part-major (parts, layout * per): each rank's part contiguous
        sends = [main.reshape(layout, parts, per).transpose(1, 0, 2).reshape(parts, layout * per)
                 if parts > 1 and layout > 1 else main.reshape(parts, layout * per)]
    t0 = _lap("split", t0)
    totals = []
    for send in sends:
        totals.append(_exchange(group, send, mode, root, timeout, replicate, out=send))
    t0 = _lap("values exchange", t0)
    if totals[0] is None:
        return None
    if layout == 3:
        hi_sum, lo_sum = totals[0].reshape(per), totals[1].reshape(per)
    else:
        sums = totals[0].reshape(layout, per)
        hi_sum, lo_sum = sums[0], sums[-1]
    result = _round(hi_sum, lo_sum, layout, rounded, target, zeros)
    _lap("rounding", t0)
    return result


def _split(real: Any, sigma: Any, nb: int, hi: Any, lo: Any, uni: Any) -> None:
    """Layouts 2 and 3: the rows' his (float64, or float32 for layout 3) and float64 los
    (``exact.split_blocks``), each added over the rows (exactly: the layout's bounds hold for
    every summand of the sum), a few whole passes over the range rather than a few per row; no
    rows: -0, the sum's identity. ``uni``: ``exact.uniform_grid``'s (constant, blocks to fix),
    or None (one sigma per block throughout)."""
    xp = np
    m, n = real.shape
    if m == 0:
        hi.fill(-0.0)
        lo.fill(-0.0)
        return
    t = exact.workspace().take("ab", (m, n), np.float64, xp)   # the codes' scratch, done with
    if uni is None:
        exact.round_blocks(real, sigma, nb, xp, t)  # every hi (an exact zero hi is +0)
    else:
        exact.round_uniform(real, uni[0], sigma, uni[1], nb, xp, t)
    xp.subtract(real[0], t[0], out=lo)             # x = -0 keeps its -0 here
    acc = t[0]
    for i in range(1, m):                          # rows added one by one: numpy's sum would
        into = hi if i == m - 1 else t[0]          # start from +0, losing an all -0 column's sign
        xp.add(acc, t[i], out=into, casting="same_kind")   # (float32 hi: exact, at most 24
        acc = into                                 # bits on float32's grid)
        xp.subtract(real[i], t[i], out=t[i])
        xp.add(lo, t[i], out=lo)
    if acc is not hi:
        xp.copyto(hi, acc, casting="same_kind")


def _uniform(code: Any, summands: int, dtype: Any, layout: int, nb: int, skip: Any) -> Any:
    """``exact.uniform_grid``'s (constant, blocks to fix) when few blocks need fixing (each
    costs a gather), else None: one sigma per block."""
    s, fix = exact.uniform_grid(code, summands, dtype, np, layout, skip)
    return (s, fix) if int(np.count_nonzero(fix)) <= max(4, nb // 16) else None


def _round(hi_sum: Any, lo_sum: Any, layout: int, rounded: np.dtype, target: Any,
           zeros: bool) -> Any:
    """The exact sums ``hi_sum + lo_sum`` (layout 1: ``hi_sum`` alone) rounded once to
    ``rounded``, into ``target`` where given. With ``zeros``: where hi is 0 (+0 even for
    x = -0) the exact sum is lo's, sign included."""
    xp = np
    with np.errstate(over="ignore"):   # an exact sum beyond a narrow format: +-inf, as IEEE
        if layout == 1:
            if target is None:
                return hi_sum.astype(rounded)
            xp.copyto(target, hi_sum, casting="unsafe")
            return target
        if layout == 3 and rounded == np.float64:   # one rounding: float32 + float64 in float64
            result = xp.add(hi_sum, lo_sum, out=target)
        else:
            result = exact.combine2(hi_sum.astype(np.float64, copy=False), lo_sum, rounded, xp,
                                    out=target)
        if zeros:
            zero = hi_sum == 0
            if bool(zero.any()):
                result[zero] = lo_sum[zero]
    return result


def _tailed(group: Any, real: Any, mode: str, root: int, rounded: np.dtype, target: Any,
            timeout: float | None, replicate: Any, layout: int, sigma: Any, pos: Any,
            block: Any, sigma2: Any, zeros: bool, t0: float, uni: Any = None) -> Any:
    """A range in ``layout`` 1 (values) or 3 (float32 hi, float64 lo) whose elements ``pos``
    (sorted; in blocks ``block``) need two float64 halves instead: one float64 exchange of the
    values (layout 3: the los) with those elements' hi in their places, each part followed by
    those elements' lo (padded with -0, the sum's identity, to the same length in every part);
    layout 3 adds a float32 exchange of the his (+0 at ``pos``)."""
    xp = np
    m, n = real.shape
    nb = min(exact.BLOCKS, n)
    parts = group.size if mode == "scatter" else 1
    per = n // parts
    nw = pos.shape[0]
    starts = xp.searchsorted(pos, xp.arange(parts + 1) * per)
    kmax = int((starts[1:] - starts[:-1]).max())
    width = per + kmax
    if parts == 1:
        at_hi, at_lo = pos, xp.arange(per, per + nw)
    else:   # flat places in the (parts, width) buffer: part row's values, then its lo
        row = xp.repeat(xp.arange(parts), starts[1:] - starts[:-1])
        at_hi = pos + row * kmax
        at_lo = row * width + per + xp.arange(nw) - starts[row]
    ws = exact.workspace()
    buf = ws.take("xbuf", (parts, width), np.float64, xp)
    flat = buf.reshape(-1)
    hi32 = ws.take("xhi", (parts, per), np.float32, xp) if layout == 3 else None
    if m:
        vals = buf[:, :per]
        if layout == 3:   # the los straight into their places (parts > 1: through a copy)
            los = vals.reshape(-1) if parts == 1 else ws.take("xlo", (n,), np.float64, xp)
            _split(real, sigma, nb, hi32.reshape(-1), los, uni)
            if parts > 1:
                xp.copyto(vals, los.reshape(parts, per))
            hi32.reshape(-1)[pos] = 0.0
        else:
            xp.copyto(vals, real[0].reshape(parts, per))  # values (the wide ones overwritten)
            for r in real[1:]:
                xp.add(vals, r.reshape(parts, per), out=vals)
        buf[:, per:] = -0.0                           # padding: the sum's identity
        hl = ws.take("xhl", (4, nw), np.float64, xp)
        xw = ws.take("xw", (nw,), real.dtype, xp)
        sig = xp.append(sigma2[block], 0.0)
        for i in range(m):
            h, l_ = (hl[0], hl[1]) if i == 0 else (hl[2], hl[3])
            xp.take(real[i], pos, out=xw)
            exact.split_blocks(xw, sig, max(nw, 1), xp, h, l_)
            if i:
                xp.add(hl[:2], hl[2:], out=hl[:2])
        flat[at_hi] = hl[0]
        flat[at_lo] = hl[1]
    else:
        buf.fill(-0.0)   # the sum's identity
        if hi32 is not None:
            hi32.fill(-0.0)
    t0 = _lap("split", t0)
    total = _exchange(group, buf, mode, root, timeout, replicate, out=buf)
    his = _exchange(group, hi32, mode, root, timeout, replicate, out=hi32) if layout == 3 else None
    t0 = _lap("values exchange", t0)
    if total is None:
        return None
    p = group.rank if mode == "scatter" else 0
    total = total.reshape(-1)[-width:]
    lo_n, hi_n = int(starts[p]), int(starts[p + 1])
    idx = pos[lo_n:hi_n] - p * per
    if layout == 3:
        result = _round(his.reshape(-1)[-per:], total[:per], 3, rounded, target, zeros)
    else:
        result = _round(total[:per], None, 1, rounded, target, False)
    with np.errstate(over="ignore"):   # an exact sum beyond a narrow format: +-inf, as IEEE
        hi, lo = xp.take(total, idx), total[per:per + hi_n - lo_n]
        both = exact.combine2(hi, lo, rounded, xp)
    if zeros:   # hi +0 (x = -0 gives +0 too): the exact sum is lo's, sign included
        zero = hi == 0
        both[zero] = lo[zero]
    result[idx] = both
    _lap("rounding", t0)
    return result


def _exchange(group: Any, buf: Any, mode: str, root: int, timeout: float | None,
              replicate: Any, out: Any = None) -> Any:
    """The plain sum of ``buf`` over ``group`` as ``mode`` asks (every rank, ``root`` only, or
    each rank its part of axis 0), then over ``replicate``; None off the root. The values are on
    a grid whose sums cannot round, so any algorithm adds them exactly."""
    _count("bytes", buf.nbytes)
    if mode == "all":
        total = group.allreduce(buf, "sum", out=out, timeout=timeout)
    elif mode == "root":   # (replicate= does not go with "root": refused by sum_rows)
        return group.reduce(buf, "sum", root=root, timeout=timeout)
    else:
        total = group.reduce_scatter(buf, "sum", timeout=timeout)
    if replicate is not None:
        total = replicate.allreduce(total, "sum", timeout=timeout)
    return total


def _one_addition(group: Any, real: Any, mode: str, root: int, target: Any,
                  timeout: float | None, replicate: Any) -> Any:
    """A range of at most two finite summands (``exact.one_addition``): the plain sum in the
    data's own dtype, which rounds the one addition correctly, whatever the order."""
    m, n = real.shape
    if m == 0:
        x = np.full(n, -0.0, real.dtype)   # the sum's identity
    else:
        x = real[0] if m == 1 else real[0] + real[1]
    if mode == "all" and replicate is None:
        _count("bytes", x.nbytes)
        return group.allreduce(x, "sum", out=target, timeout=timeout)
    total = _exchange(group, x if mode != "scatter" else x.reshape(group.size, -1), mode, root,
                      timeout, replicate)
    if total is None or target is None:
        return total
    target[...] = total.reshape(-1)
    return target


def _elementwise(group: Any, real: Any, in_dtype: np.dtype, mode: str, root: int,
                 rounded: np.dtype, target: Any, timeout: float | None, replicate: Any) -> Any:
    """The sum of ``real`` (``(m, n)``) with a grid per element: codes, then halves or limbs,
    non-finite values by IEEE's rule. The flat result in ``rounded`` (into ``target`` where
    given); None off the root in mode "root"."""
    xp = xp_of(real)
    m, n = real.shape
    ws = exact.workspace()
    size = group.size
    # pass 1: the grid (top exponent, lowest bit) per element and the most rows on any rank
    head = ws.take("head", (2 * n + 1,), np.int16, xp)
    if real.dtype == np.float32:   # read from the float32 bits: no float64 copy for the codes
        exact.codes32(real, xp, out=head[:2 * n].reshape(2, n))
        flat = None
    else:
        flat = _as_rows(real, xp, ws)
        exact.codes(flat, xp, in_dtype, out=head[:2 * n].reshape(2, n))
    head[-1] = m
    _count("bytes", head.nbytes)
    agreed = group.allreduce(head, "max", out=head, timeout=timeout)
    if replicate is not None:
        agreed = replicate.allreduce(agreed, "max", timeout=timeout)
        size *= replicate.size
    code = agreed[:2 * n].reshape(2, n)
    specials = None
    counts = None
    if int(code[0].max(initial=exact.POS_ZERO)) >= exact.NONFINITE:   # the same on every rank
        specials = code[0] == exact.NONFINITE
        counts = group.allreduce(exact.special_counts(real, xp), "sum", timeout=timeout)
        if replicate is not None:
            counts = replicate.allreduce(counts, "sum", timeout=timeout)
    # pass 2: the values themselves (or hi/lo halves) as float64, which the plain SUM adds
    # exactly (exact.float_layout); the rare elements that do not fit, as integer limbs
    summands = max(int(agreed[-1]), 1) * size
    parts = group.size if mode == "scatter" else 1
    per = n // parts
    halves, bad = exact.float_layout(code, summands, xp)
    main = ws.take("main", (halves, n), np.float64, xp)
    if halves == 1 and bad is None:   # every value on the grid: add the rows as they are
        if m == 1:
            xp.copyto(main[0], real[0])
        else:
            real.sum(axis=0, dtype=np.float64, out=main[0])
    else:
        if flat is None:
            flat = _as_rows(real, xp, ws)
        if halves == 1:
            if m == 1:
                main[0] = flat[0]
            else:
                flat.sum(axis=0, out=main[0])
        elif m == 1:
            exact.split2(flat[0], code, summands, xp, main[0], main[1])
        else:
            part = ws.take("split", (2, n), np.float64, xp)
            main[...] = 0
            for x in flat:   # each row's halves, added exactly
                exact.split2(x, code, summands, xp, part[0], part[1])
                main += part
    wide = []
    if bad is not None:
        main[:, bad] = 0
        wide = [xp.flatnonzero(bad[p * per:(p + 1) * per]) for p in range(parts)]
    kmax = max((int(w.shape[0]) for w in wide), default=0)
    if kmax:
        limb_w = exact.limb_width(summands)
        n_limbs = exact.nlimbs(code[:, bad], xp, limb_w)
    # (halves, n) -> part-major (parts, halves * per): each rank's part contiguous for the scatter
    send = main.reshape(halves, parts, per).transpose(1, 0, 2).reshape(parts, halves * per) \
        if parts > 1 and halves > 1 else main.reshape(parts, halves * per)
    if kmax:
        limbs = xp.zeros((parts, kmax * n_limbs), dtype=np.int64)
        for p, w in enumerate(wide):
            if w.shape[0]:
                cols = p * per + w
                limbs[p, :w.shape[0] * n_limbs] = exact.to_limbs(
                    flat[:, cols], code[:, cols], limb_w, n_limbs, xp).reshape(-1)
    total = _exchange(group, send, mode, root, timeout, replicate, out=send)  # parts == 1: a view
    tail = _exchange(group, limbs, mode, root, timeout, replicate) if kmax else None
    if total is None:
        return None
    lo, hi, mine = (group.rank * per, (group.rank + 1) * per, group.rank) if mode == "scatter" \
        else (0, n, 0)
    sums = total.reshape(halves, per)
    with np.errstate(over="ignore"):   # an exact sum beyond a narrow format: +-inf, as IEEE
        if halves == 1:
            if target is not None:
                xp.copyto(target, sums[0], casting="unsafe")
                result = target
            else:
                result = sums[0].astype(rounded)
        else:
            result = exact.combine2(sums[0], sums[1], rounded, xp, out=target)
    if int(code[0, lo:hi].min(initial=0)) == exact.NEG_ZERO:   # all -0: neither the halves'
        result[code[0, lo:hi] == exact.NEG_ZERO] = -0.0       # +0 nor numpy's row sum may win
    w = wide[mine] if kmax else None
    if w is not None and w.shape[0]:
        mine_limbs = tail.reshape(-1)[:w.shape[0] * n_limbs].reshape(-1, n_limbs).copy()
        result[w] = exact.round_limbs(mine_limbs, code[:, lo + w], limb_w, rounded, xp)
    if counts is not None:
        bad_here = specials[lo:hi]
        if bool(bad_here.any()):
            result[bad_here] = exact.apply_specials(result[bad_here], counts[lo:hi][bad_here], xp)
    return result


@_plain_inside
def exact_total(group: Any, x: Any, *, timeout: float | None = None) -> float:
    """The exact sum of every element of ``x`` on every rank, correctly rounded to a float.

    ``group`` None: this rank's elements alone (no communication).

    For scalars of a whole model (a squared gradient norm, a loss summed over samples): the
    partition of the elements among ranks does not change a bit of the answer. Elements are
    added as limbs on one grid for the whole array, block by block into Python integers, and
    the ranks' integers are added as fixed-width limbs in one more exchange.
    """
    xp = xp_of(x)
    v = _as_rows(_real(x), xp).reshape(1, -1)
    n = v.shape[1]
    c = exact.codes(v.reshape(-1, 1), xp).reshape(2)   # one element: all of x as rows
    allreduce = _local if group is None else group.allreduce
    agreed = allreduce(xp.asarray([int(c[0]), int(c[1]), min(n, _MAX_ROWS)], dtype=np.int16),
                       "max", timeout=timeout)
    top, neg_low = int(agreed[0]), int(agreed[1])
    if top == exact.NONFINITE:
        counts = allreduce(exact.special_counts(v.reshape(-1, 1), xp), "sum", timeout=timeout)
        return float(exact.apply_specials(np.zeros(1), np.asarray(counts), np)[0])
    if top <= exact.POS_ZERO:
        return -0.0 if top == exact.NEG_ZERO else 0.0
    width = 40                    # blocks of 2**20 elements add without overflow
    code = np.asarray([[top], [neg_low]], dtype=np.int16)
    n_limbs = exact.nlimbs(code, np, width)
    base = top - n_limbs * width  # the weight of one unit of the last limb
    whole = 0
    block = 1 << 20
    for i in range(0, n, block):
        part = v[:, i:i + block]   # one row: every element a column on the same grid
        grid = xp.broadcast_to(xp.asarray(code), (2, part.shape[1]))
        acc = exact.to_limbs(part, grid, width, n_limbs, xp).sum(axis=0)
        for j, a in enumerate(np.asarray(acc).tolist()):
            whole += int(a) << (width * (n_limbs - 1 - j))
    # the ranks' integers as limbs of 40 bits (two's complement digits, sign in the top one)
    digits = -(-(n_limbs * width + 33) // width) + 1   # room for 2**31 elements and a sign
    limbs = np.zeros(digits, dtype=np.int64)
    rest = whole
    for j in range(digits - 1, 0, -1):
        limbs[j] = rest & ((1 << width) - 1)
        rest >>= width
    limbs[0] = rest
    summed = np.asarray(allreduce(limbs, "sum", timeout=timeout)).tolist()
    total = 0
    for j, a in enumerate(summed):
        total += int(a) << (width * (digits - 1 - j))
    if total == 0:
        return 0.0
    try:
        return float(Fraction(total) * (Fraction(2) ** base))
    except OverflowError:
        return float("inf") if total > 0 else float("-inf")


def _local(x: Any, op: str, *, timeout: float | None = None) -> Any:
    """``allreduce`` over a group of one."""
    return x


def check_agreement(group: Any, deterministic: bool, *, timeout: float | None = None) -> None:
    """Collective: raise ``CollectiveMismatchError`` on every rank unless every rank runs in the
    same mode (one rank summing exactly and another plainly would give garbage silently).

    On a duplicate of the backend's context, so that the user's calls keep their numbers on
    the group and on the backend (#1 is the program's first collective in every message and
    flight record)."""
    flag = int(bool(deterministic))
    send = np.asarray([flag, -flag], dtype=np.int64)
    seen = np.empty_like(send)
    t = group.timeout if timeout is None else timeout
    side = group.backend.dup()
    try:
        if not side.allreduce(send, seen, ReduceOp.MAX).wait(t):
            raise CommTimeoutError(f"init on rank {group.rank}: the ranks did not all compare "
                                   f"their deterministic setting within {t:g} s")
    finally:
        side.shutdown()
    if int(seen[0]) == -int(seen[1]):
        return
    every = group.all_gather(np.asarray([flag], dtype=np.int8), timeout=timeout)
    on = [i for i, f in enumerate(np.asarray(every).reshape(-1).tolist()) if f]
    off = [i for i in range(group.size) if i not in on]
    raise CollectiveMismatchError(
        f"init on rank {group.rank}: deterministic mode differs across ranks: deterministic=True "
        f"on ranks {on}, deterministic=False on ranks {off} (set HPCDP_DETERMINISTIC or "
        "init(deterministic=) the same on every rank)")

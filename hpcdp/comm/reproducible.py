"""Deterministic mode's reductions: sums whose bits depend only on the values contributed.

``hpcdp.init(deterministic=True)`` (or ``HPCDP_DETERMINISTIC=1``) makes a group route ``sum``
and ``mean`` of floating-point arrays in ``allreduce``, ``reduce`` and ``reduce_scatter``
here; the layers above (DDP, ZeRO, FSDP, gradient clipping) call :func:`sum_rows` and
:func:`exact_total` directly to add their per-chunk gradients in the same exact way.

Each reduction is two ordinary collectives on integers, which any backend and any algorithm
add exactly (``comm.exact`` has the arithmetic and its accuracy bound):

1. ``allreduce(MAX)`` of int16 codes, two per element (the top exponent and the lowest bit of
   any contribution) plus one for the number of rows: every rank learns the same grid;
2. ``allreduce``/``reduce``/``reduce_scatter(SUM)`` of the int64 limbs on that grid,

then every rank rounds the exact sums once. Bytes on the wire per float64 element: 4 for the
codes and 8 per limb (one limb unless values of one element cancel across about 60 binades),
against 8 for the plain sum. Non-finite values cost one more small exchange, only when some
element has one (the codes say so on every rank). ``max`` and ``min`` need nothing (they do
not depend on order); ``prod`` is refused in this mode rather than silently order-dependent.

Asynchronous calls complete before they return (the Work is already done): the two passes
depend on each other, and a deterministic run is about the bits, not overlap.
"""
from __future__ import annotations

from fractions import Fraction
from typing import Any

import numpy as np

from .._arrays import xp_of
from ..errors import CollectiveMismatchError
from ..ops import ReduceOp
from . import exact

__all__ = ["sum_rows", "exact_total", "reducible", "check_agreement"]

_MAX_ROWS = 32767       # the rows count travels as an int16 code


def reducible(rop: ReduceOp, dtype: Any) -> bool:
    """Whether deterministic mode takes a reduction of ``rop`` on ``dtype`` (floats: sum and
    mean; integers and booleans are exact already)."""
    return rop in (ReduceOp.SUM, ReduceOp.MEAN) and np.dtype(dtype).kind in "fc"


def _as_rows(x: Any, xp: Any, ws: Any = None) -> Any:
    """``x`` as float64 rows of real numbers: complex values are (real, imag) pairs."""
    if x.dtype.kind == "c":
        x = x.view(np.float64 if x.dtype == np.complex128 else np.float32)
    if x.dtype == np.float64:
        return x
    if ws is None:
        return x.astype(np.float64)
    wide = ws.take("rows", x.shape, np.float64, xp)
    xp.copyto(wide, x)
    return wide


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
    ws = exact.workspace()
    flat = _as_rows(xp.ascontiguousarray(rows).reshape(m, count), xp, ws).reshape(m, -1)
    n = flat.shape[1]
    size = group.size
    # pass 1: the grid (top exponent, lowest bit) per element and the most rows on any rank
    head = ws.take("head", (2 * n + 1,), np.int16, xp)
    exact.codes(flat, xp, in_dtype, out=head[:2 * n].reshape(2, n))
    head[-1] = m
    agreed = group.allreduce(head, "max", out=head, timeout=timeout)
    if replicate is not None:
        agreed = replicate.allreduce(agreed, "max", timeout=timeout)
        size *= replicate.size
    code = agreed[:2 * n].reshape(2, n)
    width = exact.limb_width(max(int(agreed[-1]), 1) * size)
    specials = code[0] == exact.NONFINITE
    counts = None
    if bool(specials.any()):  # every rank sees the same codes, so every rank comes here
        counts = group.allreduce(exact.special_counts(flat, xp), "sum", timeout=timeout)
        if replicate is not None:
            counts = replicate.allreduce(counts, "sum", timeout=timeout)
    # pass 2: the limbs, exactly: one int64 for every element that fits one (the common case),
    # then, per part, the L limbs of each element that does not
    parts = group.size if mode == "scatter" else 1
    if mode not in ("all", "root", "scatter"):
        raise ValueError(f"sum_rows: mode must be 'all', 'root' or 'scatter', got {mode!r}")
    per = n // parts
    narrow = exact.narrow(code, width)
    wide = [xp.flatnonzero(~narrow[p * per:(p + 1) * per]) for p in range(parts)]
    kmax = max(int(w.shape[0]) for w in wide)
    n_limbs = exact.nlimbs(code[:, ~narrow], xp, width) if kmax else 0
    scales = exact.Scales(code, xp)
    buf = ws.take("limbs", (parts, per + kmax * n_limbs), np.int64, xp)
    exact.to_limb(flat, scales, xp, out=buf[:, :per].reshape(-1) if kmax == 0 else None)
    if kmax:
        buf[:, :per] = exact.to_limb(flat, scales, xp).reshape(parts, per)
        buf[:, per:] = 0
    for p, w in enumerate(wide):
        if w.shape[0]:
            cols = p * per + w
            buf[p, w] = 0
            buf[p, per:per + w.shape[0] * n_limbs] = exact.to_limbs(
                flat[:, cols], code[:, cols], width, n_limbs, xp).reshape(-1)
    if mode == "all":
        total = group.allreduce(buf, "sum", out=buf, timeout=timeout)
        lo, hi, mine_part = 0, n, 0
    elif mode == "root":
        total = group.reduce(buf, "sum", root=root, timeout=timeout)
        if total is None:
            return None
        lo, hi, mine_part = 0, n, 0
    else:
        total = group.reduce_scatter(buf, "sum", timeout=timeout)
        lo, hi, mine_part = group.rank * per, (group.rank + 1) * per, group.rank
    if replicate is not None:
        total = replicate.allreduce(total, "sum", timeout=timeout)
    row = total.reshape(-1)
    # a mean: the sum in float64 (no overflow of a narrower format on the way), then divided
    rounded = part_dtype if divisor == 1 else np.dtype(np.float64)
    direct = (out is not None and divisor == 1 and out_dtype.kind != "c" and out.dtype == part_dtype
              and out.flags.c_contiguous)
    result = exact.round_limb(row[:per], scales, rounded, xp, slice(lo, hi),
                              out=out.reshape(-1) if direct else None)
    w = wide[mine_part]
    if w.shape[0]:
        limbs = row[per:per + w.shape[0] * n_limbs].reshape(-1, n_limbs).copy()
        result[w] = exact.round_limbs(limbs, code[:, lo + w], width, rounded, xp)
    if counts is not None:
        bad = specials[lo:hi]
        if bool(bad.any()):
            result[bad] = exact.apply_specials(result[bad], counts[lo:hi][bad], xp)
    if divisor != 1:
        result = xp.divide(result, divisor).astype(part_dtype)
    if out_dtype.kind == "c":
        result = result.view(out_dtype)
    result = result.reshape((shape[0] // group.size, *shape[1:]) if mode == "scatter" else shape)
    if out is not None and not direct:
        out[...] = result
        return out
    return out if direct else result


def exact_total(group: Any, x: Any, *, timeout: float | None = None) -> float:
    """The exact sum of every element of ``x`` on every rank, correctly rounded to a float.

    ``group`` None: this rank's elements alone (no communication).

    For scalars of a whole model (a squared gradient norm, a loss summed over samples): the
    partition of the elements among ranks does not change a bit of the answer. Elements are
    added as limbs on one grid for the whole array, block by block into Python integers, and
    the ranks' integers are added as fixed-width limbs in one more exchange.
    """
    xp = xp_of(x)
    v = _as_rows(x, xp).reshape(1, -1)
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
    same mode (one rank summing exactly and another plainly would give garbage silently)."""
    flags = group.allreduce(np.asarray([int(deterministic), -int(deterministic)], dtype=np.int8),
                            "max", timeout=timeout)
    if int(flags[0]) == -int(flags[1]):
        return
    seen = group.all_gather(np.asarray([int(deterministic)], dtype=np.int8), timeout=timeout)
    on = [i for i, f in enumerate(np.asarray(seen).reshape(-1).tolist()) if f]
    off = [i for i in range(group.size) if i not in on]
    raise CollectiveMismatchError(
        f"init on rank {group.rank}: deterministic mode differs across ranks: deterministic=True "
        f"on ranks {on}, deterministic=False on ranks {off} (set HPCDP_DETERMINISTIC or "
        "init(deterministic=) the same on every rank)")

"""Exact floating-point sums: the arithmetic of deterministic mode (no communication).

A floating-point sum depends on its order, unless no addition ever rounds. Every value of an
element is put on a grid all contributors agree on, and the sums of values on that grid are
made exact by construction; the exact total is then rounded to the float format once,
correctly (round to nearest, ties to even). The result's bits depend only on the multiset of
values contributed.

The grid is per element. A first exchange (``MAX`` over int16 *codes*) gives, for element i,
the exponent ``E_i`` above every contribution (``|x| < 2**E_i``) and the lowest bit any
contribution has, ``low_i``; ``E_i - low_i`` is the element's depth. Then, with ``N`` summands:

* depth <= 53 - ceil(log2 N): the values themselves; float64 additions of them are exact in
  any order (every partial sum is a multiple of ``2**low_i`` below ``2**(low_i + 53)``). This
  holds for float32 data within ~27 binades per element.
* depth <= twice that: each value split into hi (on the grid ``2**(E_i - w')``) and lo, two
  float64 sums, exact the same way; hi + lo rounded once (float64 data within ~50 binades).
* deeper, inf/NaN, or near the top of the range: integer *limbs* of ``w = 62 - ceil(log2 N)``
  bits, added as int64 (exact, associative), any depth (36 limbs for 1e308 beside a
  subnormal), rounded from the integers.

The grid may as well be shared by a *block* of elements (:func:`block_codes`, a few bytes per
block instead of 4 per element; :func:`block_layout`): coarser, so sometimes a wider layout
than an element alone would need, exact the same way (see "the blocked path" below).

Accuracy: a sum is the exact sum correctly rounded (error <= 0.5 ulp), so never less accurate
than any order of plain float additions. A mean is that sum in float64 divided by the count,
then cast (<= 1 ulp; exact when the count is a power of two and the result is normal). Special
values follow IEEE arithmetic the same way on every rank: any NaN, or +inf with -inf, gives
NaN; +inf (-inf) otherwise wins; an exact sum beyond the format's range rounds to +-inf; an
exact zero is +0 unless every contribution was -0.

Every function takes the array module ``xp`` of its arrays (numpy or cupy).
"""
from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np

from .._arrays import xp_of

__all__ = ["FORMATS", "NONFINITE", "POS_ZERO", "NEG_ZERO", "codes", "codes32", "limb_width", "nlimbs",
           "to_limbs", "round_limbs", "float_width", "float_layout", "split2", "combine2", "apply_specials",
           "special_counts",
           "BLOCKS", "block_codes", "block_layout", "split_blocks", "one_addition",
           "block_plan", "tail_positions", "round_blocks", "uniform_grid", "round_uniform",
           "quick_plan"]

#: (significand bits, exponent of the smallest subnormal) of each float dtype summed exactly
FORMATS: dict[np.dtype, tuple[int, int]] = {
    np.dtype(np.float64): (53, -1074),
    np.dtype(np.float32): (24, -149),
    np.dtype(np.float16): (11, -24),
}

# int16 codes of the first exchange: the exponent e of a finite nonzero value (|x| < 2**e, as
# frexp gives it) lies in [-1073, 1024]; the float64 exponent field gives e - 1022 directly
# (subnormals read as -1022: still a bound), and inf/NaN's all-ones field reads as 1025
NONFINITE = 1025    # inf or NaN somewhere: the element takes the IEEE rule, not the limbs
POS_ZERO = -32767   # only zeros, at least one +0
NEG_ZERO = -32768   # only -0 (MAX picks POS_ZERO over it, as -0 + +0 = +0)
_NO_LOW = -32768    # the "-low" code of an element with no nonzero finite value

_MAX_SUMMANDS = 1 << 22   # w >= 40 bits: a float64 still needs at most two limbs


class Workspace:
    """Scratch arrays kept between calls, one set per thread (simulated ranks are threads).

    A large temporary allocated afresh on every call costs a page fault per 4 KiB on first
    touch, more than the arithmetic done in it: the one-limb path takes its temporaries from
    here. Results handed to callers never live here."""

    def __init__(self) -> None:
        self._bufs: dict[str, Any] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: Any, xp: Any) -> Any:
        dt = np.dtype(dtype)
        nbytes = math.prod(shape) * dt.itemsize
        buf = self._bufs.get(name)
        if buf is None or buf.nbytes < nbytes or xp_of(buf) is not xp:
            buf = self._bufs[name] = xp.empty(max(nbytes, 1), dtype=np.uint8)
        return buf[:nbytes].view(dt).reshape(shape)


_tls = threading.local()


def workspace() -> Workspace:
    """This thread's :class:`Workspace`."""
    ws = getattr(_tls, "ws", None)
    if ws is None:
        ws = _tls.ws = Workspace()
    return ws


def codes(rows: Any, xp: Any, dtype: Any = np.float64, out: Any = None) -> Any:
    """int16 array ``(2, n)``: per element, the max over ``rows`` (shape ``(m, n)``, float64,
    holding values of ``dtype``) of the exponent code and of minus the lowest bit a value of
    ``dtype`` can have at that exponent; both reduce by ``MAX``.

    Read from the float64 bits (no ``frexp``): the exponent field is all it takes. The lowest
    bit is a bound (``exponent - precision``, or the format's smallest subnormal), not the true
    last set bit, so ``L`` is sometimes one limb more than strictly needed, never less.
    """
    prec, qmin = FORMATS[np.dtype(dtype)]
    m, n = rows.shape
    if out is None:
        out = xp.empty((2, n), dtype=np.int16)
    if m == 0:
        out[...] = NEG_ZERO
        return out
    # the top 16 bits of each float64 (little-endian: the last uint16 of the four) hold the
    # sign and the 11-bit exponent field
    high = rows.view(np.uint16)[:, 3::4]
    f, code, neg_low = _fields(high, 4, 0x7FF, out, xp)
    xp.subtract(f, np.int16(1022), out=code)
    xp.subtract(np.int16(prec + 1022), f, out=neg_low)      # prec - code
    least = int(f.min()) if f.size else 1
    below = prec + 1022 + qmin        # exponent fields whose lowest bit is under the format's
    if least < below:                 # (subnormals: rare, so only then the masks)
        small = f < below
        neg_low[small] = -qmin
        if least == 0:
            _mark_zeros(rows, high, f == 0, code, neg_low, xp)
    return _over_rows(code, neg_low, out)


def _fields(high: Any, shift: int, mask: int, out: Any, xp: Any) -> tuple[Any, Any, Any]:
    """(exponent field of every value as int16, its code rows, its -low rows) from the top 16
    bits of each float (sign and exponent); one row writes straight into ``out``."""
    m, n = high.shape
    field = workspace().take("field", (m, n), np.uint16, xp)
    xp.copyto(field, high)                  # a strided copy, then in place: faster than shifting
    xp.right_shift(field, np.uint16(shift), out=field)
    xp.bitwise_and(field, np.uint16(mask), out=field)
    code = out[0:1] if m == 1 else xp.empty((m, n), np.int16)
    neg_low = out[1:2] if m == 1 else xp.empty((m, n), np.int16)
    return field.view(np.int16), code, neg_low


def _mark_zeros(rows: Any, high: Any, tiny: Any, code: Any, neg_low: Any, xp: Any) -> None:
    """Zeros among the ``tiny`` exponent fields (zeros and subnormals) get the zero codes."""
    zero = tiny & (rows == 0)
    if bool(zero.any()):
        code[zero] = xp.where((high[zero] >> 15) != 0, NEG_ZERO, POS_ZERO)
        neg_low[zero] = _NO_LOW


def _over_rows(code: Any, neg_low: Any, out: Any) -> Any:
    """The codes of several rows reduced by ``MAX`` into ``out`` (one row: already there)."""
    if code.shape[0] > 1:
        code.max(axis=0, out=out[0])
        neg_low.max(axis=0, out=out[1])
    return out


def codes32(rows: Any, xp: Any, out: Any) -> Any:
    """:func:`codes` straight from float32 rows (no float64 copy): the same codes, read from
    float32's 8-bit exponent field (a subnormal reads as exponent -126, a bound; its lowest bit
    is 2**-149)."""
    m, n = rows.shape
    if m == 0:
        out[...] = NEG_ZERO
        return out
    high = rows.view(np.uint16)[:, 1::2]
    f, code, neg_low = _fields(high, 7, 0xFF, out, xp)
    xp.subtract(f, np.int16(126), out=code)
    xp.subtract(np.int16(150), f, out=neg_low)      # 24 - code; at most 149 for normal values
    if int(f.max(initial=0)) == 0xFF:                 # inf or NaN
        code[f == 0xFF] = NONFINITE
    if int(f.min(initial=1)) == 0:                    # zeros and subnormals
        tiny = f == 0
        code[tiny] = -126
        neg_low[tiny] = 149
        _mark_zeros(rows, high, tiny, code, neg_low, xp)
    return _over_rows(code, neg_low, out)


def limb_width(summands: int) -> int:
    """Bits per limb when ``summands`` values are added: ``|sum| < summands * 2**w <= 2**62``."""
    summands = int(summands)
    if summands > _MAX_SUMMANDS:
        raise ValueError(f"an exact sum of {summands} contributions per element exceeds the "
                         f"{_MAX_SUMMANDS} this implementation provides for")
    return 62 - max(0, math.ceil(math.log2(max(summands, 1))))


def nlimbs(code: Any, xp: Any, width: int) -> int:
    """Limbs that cover every element exactly, from the reduced codes (same on every rank)."""
    top, neg_low = code[0].astype(np.int32), code[1].astype(np.int32)
    real = (top > POS_ZERO) & (top < NONFINITE) & (neg_low > _NO_LOW)
    if not bool(real.any()):
        return 1
    depth = int((top + neg_low)[real].max())   # E_i - low_i, bits from the top to the last one
    return max(1, -(-depth // width))


def to_limbs(rows: Any, code: Any, width: int, n_limbs: int, xp: Any, out: Any = None) -> Any:
    """Add every row of ``rows`` (``(m, n)`` float64) as limbs into int64 ``(n, n_limbs)``.

    Limb j of a value x is ``trunc(x * 2**((j+1)*w - E))`` after the limbs above it were taken
    away: each step peels off the next w bits exactly (scaling by a power of two and removing
    the leading bits of a float are exact), and all limbs share x's sign.
    """
    n = rows.shape[1]
    acc = xp.zeros((n, n_limbs), dtype=np.int64) if out is None else out
    top = code[0].astype(np.int64)
    usable = (top > POS_ZERO) & (top < NONFINITE)
    e = xp.where(usable, top, 0)
    shifts = [((j + 1) * width - e).astype(np.int32) for j in range(n_limbs)]
    every = bool(usable.all())
    for x in rows:
        r = x if every else xp.where(usable, x, 0.0)
        for j in range(n_limbs):
            v = xp.trunc(xp.ldexp(r, shifts[j]))
            acc[:, j] += v.astype(np.int64)
            if j + 1 < n_limbs:
                r = r - xp.ldexp(v, -shifts[j])
    return acc


# -- the fast path: exact sums in float64 itself --------------------------------------------------
# Values that are all multiples of 2**q, added in any order, give an exact float64 sum as long as
# every partial sum stays below 2**(q + 53): each one is then a representable integer times 2**q.
# With N summands below 2**E each that holds when E - q <= 53 - ceil(log2 N) =: w'. So an element
# whose depth (E - low) is at most w' is summed exactly by the plain float64 SUM of the backend,
# in any order; one of depth up to 2 w' is split first into hi (a multiple of 2**(E - w')) and
# lo = x - hi (exact), two float64 sums, and hi + lo rounded once. No integer conversion at all:
# float32 data (24 bits) spans 27 binades per element in one float64, float64 data ~50 in two.


def float_width(summands: int) -> int:
    """w': bits of a grid that ``summands`` float64 values can be added on exactly."""
    return 53 - max(0, math.ceil(math.log2(max(int(summands), 1))))


def float_layout(code: Any, summands: int, xp: Any) -> tuple[int, Any]:
    """(1 or 2 float64 per element, mask of the elements neither takes or None) from the
    reduced codes: the same decision on every rank. The others (deeper than 2 w', inf/NaN, or
    so large that a partial sum could overflow) take the integer limbs."""
    wp = float_width(summands)
    top, neg_low = code[0], code[1]
    depth = workspace().take("depth", top.shape, np.int16, xp)
    with np.errstate(over="ignore"):
        xp.add(top, neg_low, out=depth)   # int16 on purpose: all-zero elements wrap to 0 or 1
    ceiling = min(NONFINITE, 1023 - (53 - wp))
    if int(top.max(initial=POS_ZERO)) < ceiling:
        dmax = int(depth.max(initial=0))
        if dmax <= wp:
            return 1, None
        if dmax <= 2 * wp:
            return 2, None
    bad = (depth > 2 * wp) | (top >= ceiling)
    return 2, (bad if bool(bad.any()) else None)


def split2(x: Any, code: Any, summands: int, xp: Any, hi: Any, lo: Any) -> None:
    """``x = hi + lo`` exactly, hi on the grid 2**(E - w') of each element (see above)."""
    ws = workspace()
    k = ws.take("k", code[0].shape, np.int32, xp)
    xp.subtract(code[0], np.int32(float_width(summands)), out=k, casting="unsafe")
    neg_k = xp.negative(k, out=ws.take("neg_k", k.shape, np.int32, xp))
    with np.errstate(over="ignore", invalid="ignore"):
        xp.ldexp(x, neg_k, out=hi)
        xp.trunc(hi, out=hi)
        xp.ldexp(hi, k, out=hi)
        xp.subtract(x, hi, out=lo)


def combine2(hi: Any, lo: Any, dtype: Any, xp: Any, out: Any = None) -> Any:
    """``hi + lo`` (two exact float64 sums) correctly rounded to ``dtype``.

    One float64 addition rounds correctly; for a narrower format it would round twice, so
    there the float64 sum is rounded to odd first (its error from TwoSum decides the last bit),
    which makes the final rounding the correct one."""
    dtype = np.dtype(dtype)
    s = xp.add(hi, lo, out=out if (out is not None and dtype == np.float64) else None)
    if dtype == np.float64:
        return s
    bb = s - hi                                    # TwoSum: err = exact(hi + lo) - s
    err = (hi - (s - bb)) + (lo - bb)
    inexact = err != 0
    if bool(inexact.any()):
        bits = s.view(np.uint64)
        even = (bits & np.uint64(1)) == 0
        fix = inexact & even & xp.isfinite(s)
        toward = (err > 0) == (s > 0)              # away from zero when err has s's sign
        step = xp.where(toward, np.uint64(1), np.uint64(0)) - xp.where(toward, np.uint64(0), np.uint64(1))
        bits[fix] += step[fix]
    res = s.astype(dtype)
    if out is not None:
        out[...] = res
        return out
    return res


# -- the blocked path: one grid per block of elements ----------------------------------------------
# Per-element codes cost 4 bytes per element on the wire (half the plain float32 sum's) and several
# passes over memory. A grid only has to be shared by the values it adds, and may be coarser than
# any element needs: one exponent E (above every value of a block, on every rank) and one lowest
# bit (below every value's last bit) per *block* of elements is enough, and costs a few bytes per
# block. A block's depth E - low decides its layout: <= w', the values themselves (one float64);
# <= w32 + 1 + w' (w32 = 24 - ceil(log2 N)), a float32 hi and a float64 lo; <= min(w', 51) + 1 +
# w', two float64 halves (:func:`split_blocks`); deeper, or inf/NaN, or so large that the halves'
# constants would overflow: the per-element method above, for the whole range. A range takes one
# layout, and the blocks that layout cannot take travel as two halves beside it
# (:func:`block_plan`). Every layout adds exactly and is rounded once, so the partition into
# blocks (and into ranges, and which block takes which layout) never changes a bit, and the
# accuracy is the one stated at the top: the exact sum correctly rounded.

#: blocks per range of elements: element i of an n-element range belongs to block i % nb of its
#: first ``(n // nb) * nb`` elements, the rest to one tail block (so reductions run across rows)
BLOCKS = 1024

# per format: unsigned type of its bits, exponent shift, exponent field of inf/NaN, e = field - this
# bounds |x| < 2**e, field - this is the exponent of its last bit, all but the sign, all ones
_BITS = {np.dtype(np.float64): (np.uint64, 52, 0x7FF, 1022, 1075, np.uint64(2 ** 63 - 1), np.uint64(2 ** 64 - 1)),
         np.dtype(np.float32): (np.uint32, 23, 0xFF, 126, 150, np.uint32(2 ** 31 - 1), np.uint32(2 ** 32 - 1))}


def block_codes(rows: Any, xp: Any, nb: int, out: Any) -> bool:
    """int16 ``(2, nb + 1)`` into ``out``: per block of the columns of ``rows`` (``(m, n)``,
    float32 or float64, read in its own format), the largest exponent field of any value
    (all ones: inf or NaN) and ``ones - f``, ``f`` the smallest exponent field of a nonzero value
    (-1: no nonzero value); both reduce by ``MAX`` across ranks. Block ``nb`` is the tail.
    Returns whether any value is a zero (of either sign).

    Read from the magnitudes' bits: the largest magnitude has the largest field, the smallest
    the smallest; only where a block holds a zero, a second pass finds its smallest nonzero
    magnitude (subtracting 1 wraps zeros to the top, out of the min)."""
    utype, shift, ones, _, _, magnitude, top = _BITS[rows.dtype]
    m, n = rows.shape
    k = (n // nb) * nb
    ab = workspace().take("ab", (m, n), utype, xp)
    xp.bitwise_and(rows.view(utype), magnitude, out=ab)
    body = ab[:, :k].reshape(m, k // nb, nb)
    big = xp.empty(nb + 1, dtype=utype)
    small = xp.empty(nb + 1, dtype=utype)
    tail = k < n and m > 0                    # (no tail: its codes are those of no value)
    body.max(axis=(0, 1), initial=0, out=big[:nb])
    big[nb] = ab[:, k:].max() if tail else 0
    body.min(axis=(0, 1), initial=top, out=small[:nb])
    small[nb] = ab[:, k:].min() if tail else top
    zeros = m > 0 and int(small.min()) == 0
    if zeros:
        xp.subtract(ab, utype(1), out=ab)
        body.min(axis=(0, 1), initial=top, out=small[:nb])
        small[nb] = ab[:, k:].min() if tail else top
        xp.add(small, utype(1), out=small)        # back: 0 where no value was nonzero
    xp.right_shift(big, utype(shift), out=big)
    out[0] = big
    none = small == 0
    xp.right_shift(small, utype(shift), out=small)
    xp.subtract(utype(ones), small, out=small)
    out[1] = small
    out[1][none] = -1
    return zeros


def block_layout(code: Any, summands: int, dtype: Any, xp: Any) -> tuple[int, Any]:
    """(1, None): every block's values add exactly as float64; (2, sigma): every block splits
    into two float64 halves with :func:`split_blocks` and the constants ``sigma`` (float64,
    one per block); (3, sigma): into a float32 hi and a float64 lo (float64 data whose blocks
    span few binades: 12 bytes a value instead of 16); (0, None): some block needs the
    per-element method. ``code``: the reduced
    :func:`block_codes` of data of ``dtype``; the same decision on every rank."""
    grid = _block_grid(code, summands, dtype, xp)
    if grid is None:                               # inf or NaN
        return 0, None
    e, low, wp = grid
    if int((e - low).max(initial=0)) <= wp:
        return 1, None
    wp32 = wp - 29                                 # float32 sums: 24 - ceil(log2 N)
    e_max = int(e.max(initial=0))
    if wp32 > 0 and e_max <= 127 - (24 - wp32):
        g = xp.maximum(e - wp32, -149)
        if int((g - 1 - low).max(initial=0)) <= wp:   # lo's sums exact too
            return 3, _sigma(g, xp)
    g = xp.maximum(e - min(wp, 51), -1074)
    if e_max > 969 + wp or int((g - 1 - low).max(initial=0)) > wp:
        return 0, None
    return 2, _sigma(g, xp)


def block_plan(code: Any, summands: int, dtype: Any, xp: Any, n: int) -> tuple[int, Any, Any, Any]:
    """The layout that moves the fewest bytes for a range of ``n`` elements, from its reduced
    :func:`block_codes` (the same decision on every rank): ``(layout, sigma, tail, sigma2)``.

    ``layout`` as :func:`block_layout` (0: the per-element method; 1: one float64 a value;
    2: two float64 halves, ``sigma``; 3: a float32 hi and a float64 lo, ``sigma``). ``tail``:
    None, or the mask of the blocks the layout cannot take; their elements travel as layout 2's
    halves (constants ``sigma2``) instead: the hi in the element's float64 place (layout 3: the
    lo's place, its float32 hi +0), the lo in a tail of the float64 exchange. Bytes per element:
    8, 16 or 12, plus 8 for each element of a tail block (a range of normal float64 data with
    one value far under its block's largest stays at about 12, not 16).

    Exact for every plan: each block's values, in its own layout, add exactly in any order
    (:func:`split_blocks` proves each), and a tail block satisfies layout 2's bound; which
    layout a block takes changes no bit of the correctly rounded result."""
    grid = _block_grid(code, summands, dtype, xp)
    if grid is None:                               # inf or NaN
        return 0, None, None, None
    e, low, wp = grid
    wide = (e - low) > wp                          # blocks one float64 cannot take
    if not bool(wide.any()):
        return 1, None, None, None
    g2 = xp.maximum(e - min(wp, 51), -1074)
    unfit2 = (e > 969 + wp) | ((g2 - 1 - low) > wp)
    if bool((unfit2 & wide).any()):
        return 0, None, None, None
    nb = code.shape[1] - 1
    per_block = n // nb
    tail_len = n - per_block * nb

    def elements(mask: Any) -> int:
        return per_block * int(xp.count_nonzero(mask[:nb])) + tail_len * int(mask[nb])

    layout, tail = 2, None
    cost = None if bool(unfit2.any()) else 16 * n
    wp32 = wp - 29                                 # float32 sums: 24 - ceil(log2 N)
    if wp32 > 0 and int(e.max(initial=0)) <= 127 - (24 - wp32):
        g3 = xp.maximum(e - wp32, -149)
        deep = (g3 - 1 - low) > wp                 # lo's sums not exact there: halves instead
        n3 = elements(deep)
        if cost is None or 12 * n + 8 * n3 < cost:
            layout, tail, cost = 3, (deep if n3 else None), 12 * n + 8 * n3
    if cost is None or 8 * n + 8 * elements(wide) < cost:
        return 1, None, wide, _sigma(g2, xp)
    if layout == 2:
        return 2, _sigma(g2, xp), None, None
    return 3, _sigma(g3, xp), tail, (None if tail is None else _sigma(g2, xp))


def tail_positions(mask: Any, nb: int, n: int, xp: Any) -> tuple[Any, Any]:
    """(sorted positions, their blocks) of the elements of the blocks in ``mask`` (``nb + 1``
    entries, the last the tail block) of a range of ``n`` elements."""
    k = (n // nb) * nb
    bs = xp.flatnonzero(mask[:nb])
    pos = (xp.arange(0, k, nb)[:, None] + bs[None, :]).reshape(-1)
    block = xp.broadcast_to(bs, (k // nb, bs.shape[0])).reshape(-1)
    if bool(mask[nb]) and k < n:
        pos = xp.concatenate([pos, xp.arange(k, n)])
        block = xp.concatenate([block, xp.full(n - k, nb)])
    return pos, block


def _block_grid(code: Any, summands: int, dtype: Any, xp: Any) -> tuple[Any, Any, int] | None:
    """(e, low, w') per block from the reduced :func:`block_codes`: ``|x| < 2**e``, every value
    a multiple of ``2**low``; None when some block holds inf or NaN."""
    _, _, ones, top_bias, low_bias, _, _ = _BITS[np.dtype(dtype)]
    f_top = xp.maximum(code[0], 1).astype(np.int32)
    if int(f_top.max(initial=0)) >= ones:
        return None
    # low = max(ones - code[1], 1) - low_bias: the last bit of the block's smallest nonzero
    # value; a block without one (code[1] = -1) gets a low above its e, as deep as nothing
    low = xp.maximum(ones - code[1].astype(np.int32), 1) - low_bias
    return f_top - top_bias, low, float_width(summands)


def one_addition(code: Any, summands: int, dtype: Any) -> bool:
    """Whether a sum is at most one IEEE addition of finite values of ``dtype`` (at most two
    summands, all below half the format's largest binade in the reduced :func:`block_codes`:
    no inf, NaN or overflow): then the plain sum in
    ``dtype``, in either order, is already the exact sum correctly rounded (IEEE rounds every
    operation correctly; -0 + -0 = -0, anything else that cancels +0)."""
    return summands <= 2 and int(code[0].max(initial=0)) < _BITS[np.dtype(dtype)][2] - 1


def uniform_grid(code: Any, summands: int, dtype: Any, xp: Any, layout: int,
                 skip: Any = None) -> tuple[float, Any]:
    """(s, fix): one constant ``s``, the largest sigma of a :func:`block_plan` of ``layout``
    (2 or 3; its coarsest grid), that rounds every block's values to a grid the layout's bounds
    still hold on, except the blocks in ``fix`` (bool, ``nb + 1``), which keep their own sigma;
    blocks in ``skip`` (the plan's tail) are never in ``fix``. From the reduced
    :func:`block_codes`: the same on every rank.

    Why one constant: rounding with a scalar is a plain streaming operation, with one sigma per
    block a broadcast that costs about twice as much per pass. A grid ``2**g`` coarser than a
    block's own keeps the hi parts exact (still at most the layout's bits under ``2**E`` of the
    largest block, whose grid it is) and grows the lo to ``|lo| <= 2**(g - 1)``, whose sums stay
    exact while ``g - 1 - low <= w'`` for the block's lowest bit ``low`` (:func:`_block_grid`):
    only blocks holding a value far below the range's largest break that, and they are the
    ``fix``; compared on the codes directly (``low < T`` is ``code[1] > ones - T``)."""
    _, _, ones, top_bias, low_bias, _, _ = _BITS[np.dtype(dtype)]
    wp = float_width(summands)
    w, floor = (wp - 29, -149) if layout == 3 else (min(wp, 51), -1074)
    e_max = max(int(code[0].max(initial=0)), 1) - top_bias
    g = max(e_max - w, floor)
    limit = g - 1 - wp + low_bias          # fix: max(ones - code[1], 1) < limit
    if limit <= 1:
        fix = xp.zeros(code.shape[1], dtype=bool)
    else:
        fix = code[1] > ones - limit
        if skip is not None:
            fix &= ~skip
    return np.float64(math.ldexp(1.5, g + 52)), fix


def quick_plan(code: Any, summands: int, dtype: Any, xp: Any, n: int) -> tuple[Any, ...] | None:
    """:func:`block_plan`'s choice for the common ranges, from a few reductions of the codes
    instead of its per-block arithmetic: ``(layout, s, fix, sigma, tail, sigma2)``, or None
    for the others (then :func:`block_plan`). The same choice :func:`block_plan` makes there,
    on every rank.

    ``(1, 0.0, None, None, None, None)`` when every block fits one float64 (the range's largest
    exponent against its lowest last bit). ``(3, s, fix, sigma, tail, sigma2)`` when more than
    half the elements need two parts: a float32 hi and a float64 lo, rounded on the one grid of
    :func:`uniform_grid` (``s``) but for the few blocks ``fix`` (None: none), whose own
    constants are ``sigma`` at their places; of those, the ones too deep for the layout even on
    their own grid travel as two float64 halves in a ``tail`` (None: none; their constants
    ``sigma2``), as in :func:`block_plan`."""
    _, _, ones, top_bias, low_bias, _, _ = _BITS[np.dtype(dtype)]
    nb = code.shape[1] - 1
    per_block = n // nb
    tail_len = n - per_block * nb
    real = code if tail_len else code[:, :nb]      # (an empty tail block: no codes)
    c0, c1 = real[0], real[1]
    top, c1_max = int(c0.max(initial=0)), int(c1.max(initial=-1))
    if top >= ones or int(c0.min(initial=ones)) < 1 or c1_max >= ones:
        return None    # inf/NaN, a block of zeros and subnormals or a subnormal: the general rule
    wp = float_width(summands)
    # depth = e - low = (c0 - top_bias) - (ones - c1 - low_bias), no clamp applying here
    shift = top_bias + ones - low_bias
    if top + c1_max - shift <= wp:
        return 1, 0.0, None, None, None, None
    wp32 = wp - 29
    e_max = top - top_bias
    if wp32 <= 0 or e_max > 127 - (24 - wp32):
        return None

    def elements(blocks: Any) -> int:   # of a sorted array of block numbers
        k = blocks.shape[0]
        if k and int(blocks[-1]) == nb:
            return per_block * (k - 1) + tail_len
        return per_block * k

    wide = xp.flatnonzero((code[0] + code[1]) > (wp + shift))   # int16: at most 2 * 2047
    g = max(e_max - wp32, -149)
    s = np.float64(math.ldexp(1.5, g + 52))
    limit = g - 1 - wp + low_bias                  # uniform_grid's fix: code[1] > ones - limit
    if limit <= ones - c1_max:
        if 2 * elements(wide) < n:                 # block_plan: values, the wide blocks as a tail
            return None
        return 3, s, None, None, None, None
    fix = code[1] > ones - limit
    idx = xp.flatnonzero(fix)
    if idx.shape[0] > max(4, nb // 16):
        return None
    # each on its own grid (block_plan's): deeper than the layout holds there, it is a tail of
    # two halves, which must hold it (else block_plan: the per-element method)
    e_own = code[0][idx].astype(np.int32) - top_bias
    g_own = xp.maximum(e_own - wp32, -149)
    low = ones - code[1][idx].astype(np.int32) - low_bias
    sigma = xp.zeros(nb + 1)
    sigma[idx] = xp.ldexp(1.5, g_own + 52)
    deep = (g_own - 1 - low) > wp
    if not bool(deep.any()):
        if 2 * elements(wide) < n:
            return None
        return 3, s, fix, sigma, None, None
    g2 = xp.maximum(e_own[deep] - min(wp, 51), -1074)
    if bool(((g2 - 1 - low[deep]) > wp).any()):
        return None
    n3 = elements(idx[deep])
    cost3 = 12 * n + 8 * n3                        # block_plan's costs: layout 3 with a tail,
    if cost3 >= 16 * n or 8 * n + 8 * elements(wide) < cost3:   # two halves, values + tail
        return None
    tail = xp.zeros(nb + 1, dtype=bool)
    tail[idx[deep]] = True
    sigma2 = xp.zeros(nb + 1)
    sigma2[idx[deep]] = xp.ldexp(1.5, g2 + 52)
    fix &= ~tail
    return 3, s, (fix if bool(fix.any()) else None), sigma, tail, sigma2


def round_uniform(rows: Any, s: float, sigma: Any, fix: Any, nb: int, xp: Any, out: Any) -> None:
    """:func:`round_blocks` with the constant ``s`` of :func:`uniform_grid`, then the blocks in
    ``fix`` again with their own sigma (gathered: a few blocks, a few small operations)."""
    m, n = rows.shape
    k = (n // nb) * nb
    # ``s`` as a float64 array scalar: a Python float would take float32 rows' dtype (NEP 50),
    # rounding them in float32 (every hi 0, or inf - inf = NaN where ``s`` overflows float32)
    s = np.float64(s)
    with np.errstate(invalid="ignore", over="ignore"):
        xp.add(rows, s, out=out, dtype=np.float64)
        xp.subtract(out, s, out=out)
        if fix is None:
            return
        blocks = xp.flatnonzero(fix[:nb])
        if blocks.shape[0] and k:
            sub = rows[:, :k].reshape(m, -1, nb)[:, :, blocks].astype(np.float64)
            sig = sigma[blocks]
            xp.add(sub, sig, out=sub)
            xp.subtract(sub, sig, out=sub)
            out[:, :k].reshape(m, -1, nb)[:, :, blocks] = sub
        if bool(fix[nb]) and k < n:
            xp.add(rows[:, k:], sigma[nb], out=out[:, k:])
            xp.subtract(out[:, k:], sigma[nb], out=out[:, k:])


def _sigma(g: Any, xp: Any) -> Any:
    """``1.5 * 2**(g + 52)`` per block: adding it to a value below ``2**(g + 51)`` rounds the
    value to a multiple of ``2**g`` (:func:`split_blocks`)."""
    return xp.ldexp(xp.full(g.shape, 1.5), (g + 52).astype(np.int32))


def round_blocks(rows: Any, sigma: Any, nb: int, xp: Any, out: Any) -> None:
    """``out`` (float64, the shape of ``rows``, ``(m, n)`` float32 or float64): every value
    rounded to its block's grid, ``(x + sigma) - sigma`` as in :func:`split_blocks` (whose hi
    it is), all rows in one pass per operation."""
    m, n = rows.shape
    k = (n // nb) * nb
    with np.errstate(invalid="ignore", over="ignore"):
        if k:
            body = out[:, :k].reshape(m, -1, nb)
            xp.add(rows[:, :k].reshape(m, -1, nb), sigma[:nb], out=body)
            xp.subtract(body, sigma[:nb], out=body)
        if k < n:
            xp.add(rows[:, k:], sigma[nb], out=out[:, k:])
            xp.subtract(out[:, k:], sigma[nb], out=out[:, k:])


def split_blocks(x: Any, sigma: Any, nb: int, xp: Any, hi: Any, lo: Any, tmp: Any = None) -> None:
    """``x = hi + lo`` exactly (``x`` float32 or float64, one row; ``lo`` float64, ``hi``
    float64, or float32 with a float64 ``tmp`` of x's size): hi is x rounded to the block's
    grid ``2**g`` (``sigma = 1.5 * 2**(g + 52)``): adding sigma rounds away the bits under
    ``2**g`` (``|x| <= 2**(g + 51)``, so the sum stays in sigma's binade) and subtracting it is
    exact; lo is the rest, ``|lo| <= 2**(g - 1)``, exact.

    Layout 2 (:func:`block_layout`), ``E`` the block's exponent and ``g = E - min(w', 51)``:
    float64 sums of N hi stay below ``2**(g + 53)`` (exact), and of N lo too when the block's
    depth is at most ``min(w', 51) + 1 + w'``. Layout 3, ``g = E - w32`` with ``w32 = 24 -
    ceil(log2 N)``: hi has at most 24 bits and its float32 sums stay below ``2**(g + 24)``;
    float64 sums of lo are exact to a depth of ``w32 + 1 + w'``. An exact zero hi is +0 (x = -0
    included); lo keeps x's -0."""
    n = x.shape[0]
    k = (n // nb) * nb
    t = hi if tmp is None else tmp   # float64 arithmetic throughout (mixed types cost more)
    with np.errstate(invalid="ignore", over="ignore"):
        xp.add(x[:k].reshape(-1, nb), sigma[:nb], out=t[:k].reshape(-1, nb))
        xp.subtract(t[:k].reshape(-1, nb), sigma[:nb], out=t[:k].reshape(-1, nb))
        if k < n:
            xp.add(x[k:], sigma[nb], out=t[k:])
            xp.subtract(t[k:], sigma[nb], out=t[k:])
        xp.subtract(x, t, out=lo)
        if t is not hi:
            xp.copyto(hi, t, casting="same_kind")   # exact: at most 24 bits on float32's grid


def _normalize(a: Any, width: int) -> None:
    """Carry from the least significant limb up: limbs 1.. in [0, 2**w), limb 0 signed."""
    for j in range(a.shape[1] - 1, 0, -1):
        carry = a[:, j] >> width
        a[:, j] -= carry << width
        a[:, j - 1] += carry


def _bit_length(v: Any, xp: Any) -> Any:
    """Bits of each uint64 (0 for 0), by binary search on shifts."""
    v = v.copy()
    n = xp.zeros(v.shape, dtype=np.int64)
    for s in (32, 16, 8, 4, 2, 1):
        big = (v >> np.uint64(s)) != 0
        n += xp.where(big, s, 0)
        v = xp.where(big, v >> np.uint64(s), v)
    return n + (v != 0)


def _shift(v: Any, s: Any, xp: Any) -> tuple[Any, Any]:
    """(``v << s`` for s >= 0 or ``v >> -s`` for s < 0, bits lost) with shifts of 64 or more
    giving 0 (the hardware would take the shift modulo 64)."""
    left = xp.clip(s, 0, 63).astype(np.uint64)
    right = xp.clip(-s, 0, 63).astype(np.uint64)
    gone = -s >= 64
    shifted = xp.where(s >= 0, v << left, v >> right)
    lost = xp.where(s >= 0, np.uint64(0), v & ((np.uint64(1) << right) - np.uint64(1)))
    shifted = xp.where(gone | (s >= 64), np.uint64(0), shifted)
    lost = xp.where(gone, v, lost)
    return shifted, lost


def round_limbs(acc: Any, code: Any, width: int, dtype: Any, xp: Any) -> Any:
    """The exact sums in ``acc`` (``(n, L)`` int64, on the grid of ``code``) correctly rounded
    to ``dtype``; zeros signed by the codes. Non-finite elements are left for
    :func:`apply_specials`. ``acc`` is consumed."""
    dtype = np.dtype(dtype)
    prec, qmin = FORMATS[dtype]
    n, n_limbs = acc.shape
    top = code[0].astype(np.int64)
    a = acc
    _normalize(a, width)
    neg = a[:, 0] < 0
    a = xp.where(neg[:, None], -a, a)
    _normalize(a, width)
    mask = (1 << width) - 1
    # one more limb on top so that every limb is below 2**w
    full = xp.zeros((n, n_limbs + 3), dtype=np.int64)
    full[:, 0] = a[:, 0] >> width
    full[:, 1] = a[:, 0] & mask
    full[:, 2:n_limbs + 1] = a[:, 1:]
    u = full.astype(np.uint64)
    nonzero = u != 0
    anyv = nonzero.any(axis=1)
    t = xp.argmax(nonzero, axis=1)                     # first nonzero limb
    rows = xp.arange(n)
    lead = u[rows, t]
    nxt1 = u[rows, t + 1]
    nxt2 = u[rows, t + 2]
    p = _bit_length(lead, xp)                           # 1..w bits in the leading limb
    p = xp.where(anyv, p, 1)
    w0, _ = _shift(lead, 64 - p, xp)
    w1, lost1 = _shift(nxt1, 64 - p - width, xp)
    w2, lost2 = _shift(nxt2, 64 - p - 2 * width, xp)
    window = w0 | w1 | w2                               # leading one at bit 63
    below = xp.arange(n_limbs + 3)[None, :] > (t + 2)[:, None]
    sticky = (lost1 != 0) | (lost2 != 0) | (nonzero & below).any(axis=1)
    # exponent of the leading one: limb k (of n_limbs + 1 real ones) weighs 2**(E - (k)*w) / 2**0
    e = xp.where((top > POS_ZERO) & (top < NONFINITE), top, 0)
    lead_exp = e + width - (t * width) - (width - p) - 1
    keep = xp.clip(lead_exp - qmin + 1, 1, prec)        # fewer bits for subnormal results
    drop = (64 - keep).astype(np.uint64)
    mant = window >> drop
    rem = window & ((np.uint64(1) << drop) - np.uint64(1))
    half = np.uint64(1) << (drop - np.uint64(1))
    up = (rem > half) | ((rem == half) & (sticky | ((mant & np.uint64(1)) == 1)))
    mant = mant + up.astype(np.uint64)
    with np.errstate(over="ignore"):   # beyond the format's range: +-inf, as IEEE rounds it
        mag = xp.ldexp(mant.astype(np.float64), (lead_exp - keep + 1).astype(np.int32))
        val = xp.where(neg, -mag, mag).astype(dtype)
    zero = xp.where(top == NEG_ZERO, -0.0, 0.0).astype(dtype)
    return xp.where(anyv, val, zero)


def special_counts(rows: Any, xp: Any) -> Any:
    """int64 ``(n, 3)``: per element, how many NaN, +inf and -inf the rows hold (summed across
    ranks for the elements whose code is :data:`NONFINITE`)."""
    return xp.stack([xp.isnan(rows).sum(axis=0), (rows == np.inf).sum(axis=0),
                     (rows == -np.inf).sum(axis=0)], axis=1).astype(np.int64)


def apply_specials(result: Any, counts: Any, xp: Any) -> Any:
    """IEEE's answer for elements with non-finite contributions, from their summed counts."""
    nan, pinf, ninf = counts[:, 0], counts[:, 1], counts[:, 2]
    val = xp.where((nan > 0) | ((pinf > 0) & (ninf > 0)), np.nan, xp.where(pinf > 0, np.inf, -np.inf))
    return val.astype(result.dtype)

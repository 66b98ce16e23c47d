"""Exact floating-point sums as integers: the arithmetic of deterministic mode (no communication).

A floating-point sum depends on its order; an integer sum does not. So each value is cut into
fixed-point integer *limbs* on a grid every contributor agrees on, the limbs are added as
int64 (by any algorithm, in any order, on any backend: integer addition is associative), and
the exact total is rounded to the float format once, correctly (round to nearest, ties to
even). The result's bits depend only on the multiset of values contributed.

The grid is per element. A first exchange (``MAX`` over int16 *codes*) gives, for element i,
the exponent ``E_i`` above every contribution (``|x| < 2**E_i``) and the lowest bit any
contribution has, ``low_i``. Every value of element i is then an integer multiple of
``2**(E_i - L*w)`` below ``2**E_i``, written as ``L`` limbs of ``w`` bits (most significant
first), where ``w = 62 - ceil(log2(N))`` leaves room for ``N`` summands in an int64 without
overflow and ``L = ceil(max_i(E_i - low_i) / w)`` covers the widest element. Nothing is cut
off: the integer sum is the exact sum. Values of the same magnitude need one limb (for up to
16 summands a float64 of any exponent fits in 58 bits with room to spare); values that cancel
across magnitudes need more, up to 36 limbs for 1e308 beside a subnormal.

Accuracy: a sum is the exact sum correctly rounded (error <= 0.5 ulp), so never less accurate
than any order of plain float additions. A mean is that sum divided by the count in the same
dtype (a second rounding: <= 1 ulp; exact when the count is a power of two and the result is
normal). Special values follow IEEE arithmetic the same way on every rank: any NaN, or +inf
with -inf, gives NaN; +inf (-inf) otherwise wins; an exact sum beyond the format's range
rounds to +-inf; an exact zero is +0 unless every contribution was -0.

Every function takes the array module ``xp`` of its arrays (numpy or cupy).
"""
from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np

from .._arrays import xp_of

__all__ = ["FORMATS", "NONFINITE", "POS_ZERO", "NEG_ZERO", "codes", "limb_width", "nlimbs",
           "to_limbs", "round_limbs", "one_limb", "narrow", "Scales", "to_limb", "round_limb", "apply_specials",
           "special_counts"]

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
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
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
    field = xp.right_shift(high, 4, out=workspace().take("field", (m, n), np.uint16, xp)).view(np.int16)
    field &= 0x7FF
    code = out[0:1] if m == 1 else xp.empty((m, n), np.int16)
    neg_low = out[1:2] if m == 1 else xp.empty((m, n), np.int16)
    xp.subtract(field, 1022, out=code)
    xp.subtract(prec + 1022, field, out=neg_low)      # prec - code
    xp.clip(neg_low, -32768, -qmin, out=neg_low)   # (clip: numpy's int16 minimum is slow)
    tiny = field == 0                     # zeros and float64 subnormals: sort them out
    if bool(tiny.any()):
        zero = tiny & (rows == 0)
        if bool(zero.any()):
            code[zero] = xp.where((high[zero] >> 15) != 0, NEG_ZERO, POS_ZERO)
            neg_low[zero] = _NO_LOW
    if m > 1:
        code.max(axis=0, out=out[0])
        neg_low.max(axis=0, out=out[1])
    return out


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


def one_limb(code: Any, width: int, xp: Any) -> bool:
    """Whether the one-limb fast path takes these (reduced) codes: every element fits one limb,
    no inf/NaN, no bit below 2**-1022 (its powers of two are then normal floats).

    ``top + neg_low`` is added in int16 on purpose: for a real element it is its depth (at most
    2098); for an all-zero one the codes are -32767/-32768 twice and the sum wraps to 0 or 1.
    """
    top, neg_low = code[0], code[1]
    if int(top.max(initial=POS_ZERO)) >= NONFINITE or int(neg_low.max(initial=_NO_LOW)) > 1022:
        return False
    with np.errstate(over="ignore"):
        depth = top + neg_low
    return int(depth.max(initial=0)) <= width


def narrow(code: Any, width: int) -> Any:
    """Which elements the one-limb path takes: depth at most ``width`` bits, no inf/NaN, no bit
    below 2**-1022 (the powers of two it scales by are then normal floats). The others go the
    general way; every rank decides alike, from the reduced codes."""
    top, neg_low = code[0], code[1]
    with np.errstate(over="ignore"):
        depth = top + neg_low   # int16 on purpose: see one_limb
    return (depth <= width) & (neg_low <= 1022) & (top < NONFINITE)


class Scales:
    """The one-limb grid of every element: ``-low`` (to scale values up to integers) and
    ``low`` (to scale sums back), as int32 exponents for ``ldexp`` (exact for normal results);
    all-zero elements get a harmless ``low`` (their values are 0)."""

    def __init__(self, code: Any, xp: Any) -> None:
        ws = workspace()
        n = code.shape[1]
        self.down = ws.take("down", (n,), np.int32, xp)
        xp.clip(code[1], -1000, 1022, out=self.down, casting="unsafe")   # -low
        self.up = xp.negative(self.down, out=ws.take("up", (n,), np.int32, xp))   # low
        self.neg_zero = code[0] == NEG_ZERO


def to_limb(rows: Any, scales: Scales, xp: Any, out: Any = None) -> Any:
    """The one-limb path of :func:`to_limbs`: ``sum over rows of x * 2**-low`` as int64 ``(n,)``
    (into ``out``), each product an exact integer below ``2**w`` (what :func:`narrow` checked;
    other elements get garbage, for the caller to overwrite)."""
    m, n = rows.shape
    if out is None:
        out = xp.empty(n, dtype=np.int64)
    scaled = workspace().take("scaled", (m, n), np.float64, xp)
    with np.errstate(over="ignore", invalid="ignore"):
        xp.ldexp(rows, scales.down, out=scaled)
        if m == 1:
            xp.copyto(out, scaled[0], casting="unsafe")   # float to int64 truncates: exact here
        else:
            out[...] = scaled.astype(np.int64).sum(axis=0)
    return out


def round_limb(total: Any, scales: Scales, dtype: Any, xp: Any, part: slice = slice(None),
               out: Any = None) -> Any:
    """The one-limb path of :func:`round_limbs`: ``total * 2**low`` correctly rounded (for the
    elements ``part`` of the scales).

    int64 to float64 conversion rounds to nearest even in hardware, and the power of two is
    exact (the result is normal: ``low >= -1022``), so float64 needs nothing else. A narrower
    format would round twice where the sum has more than 53 bits; those elements (rare: it takes
    float32 values cancelling over 30 binades) round to odd first, which makes the second
    rounding the correct one.
    """
    dtype = np.dtype(dtype)
    if dtype == np.float64 and out is not None:
        f = out
    else:
        f = workspace().take("rounded", total.shape, np.float64, xp)
    xp.copyto(f, total, casting="unsafe")   # int64 to float64: round to nearest even
    if dtype != np.float64:
        big = xp.abs(total) >= (1 << 53)
        if bool(big.any()):
            t = total[big]
            g = f[big]
            back = g.astype(np.int64)
            bits = g.view(np.uint64)
            bits -= (xp.abs(back) > xp.abs(t)).astype(np.uint64)   # toward zero ...
            bits |= (back != t).astype(np.uint64)                   # ... then odd if inexact
            f[big] = bits.view(np.float64)
    with np.errstate(over="ignore"):
        xp.ldexp(f, scales.up[part], out=f)
        if out is None:
            out = f.astype(dtype)   # a copy: f is scratch
        elif out is not f:
            xp.copyto(out, f, casting="unsafe")
    neg = scales.neg_zero[part]
    if bool(neg.any()):
        out[neg] = -0.0
    return out


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

"""Communication hooks: how a bucket's flat gradient is averaged across ranks.

A hook is ``hook(state, bucket) -> future`` where ``bucket`` is a :class:`GradBucket` and the
returned object has ``wait()`` (returning the averaged flat gradient, the bucket's own buffer or a
new array of its size) and ``is_completed()``. DDP calls hooks in bucket order on every rank and
waits on their futures in the same order, so a hook may run several collectives as long as
``is_completed()`` never *starts* one (it only tests): later stages are started in ``wait()``.

Built-in hooks (``state`` may be None or a ``ProcessGroup`` to use instead of DDP's):

* :func:`allreduce_hook`: what DDP does without a hook (allreduce, divide by ``bucket.divisor``).
* :func:`fp16_compress_hook`: divide (in the bucket's dtype), cast to float16, allreduce float16
  (half the bytes of float32), cast back. Transports sum float16 in float32 and round once.
* :func:`bf16_compress_hook`: bfloat16 emulated in uint16 words (round to nearest even). No
  transport has a bfloat16 sum, so the reduction is a reduce-scatter done by hand: ``all_to_all``
  of bf16 chunks, a float32 sum of the n chunks this rank owns, rounded to bf16 once, then an
  ``all_gather`` of bf16 chunks. Every rank sends and receives ``2 (n-1)/n`` bf16 elements per
  element, exactly what a bf16 ring allreduce would move: half the bytes of float32.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .._arrays import xp_of

__all__ = [
    "GradBucket", "HookFuture", "Ready", "allreduce_hook", "fp16_compress_hook",
    "bf16_compress_hook", "to_bf16", "from_bf16",
]


class GradBucket:
    """What a comm hook sees of one bucket (torch's ``GradBucket`` names)."""

    def __init__(self, index: int, flat: Any, params: list[Any], views: list[Any], group: Any,
                 divisor: int, is_last: bool) -> None:
        self._index, self._flat, self._params, self._views = index, flat, params, views
        self.group = group
        #: number to divide the summed gradient by (group size, or active ranks under join)
        self.divisor = divisor
        self._is_last = is_last

    def index(self) -> int:
        """Return the bucket's position in launch order (0 is reduced first)."""
        return self._index

    def buffer(self) -> Any:
        """Return the flat gradient buffer (1-D, the bucket's dtype)."""
        return self._flat

    def gradients(self) -> list[Any]:
        """Return each parameter's gradient, as views into ``buffer()``."""
        return list(self._views)

    def parameters(self) -> list[Any]:
        """Return the bucket's parameters, in the order their gradients arrive."""
        return list(self._params)

    def is_last(self) -> bool:
        """Return True for the last bucket launched in an iteration."""
        return self._is_last


class Ready:
    """A finished operation whose result is ``value``: what a hook returns for a bucket it does
    not communicate (a group of one; a hook that reduces some buckets by other means)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def is_completed(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> Any:
        return self.value


class HookFuture:
    """A Work (or another future) plus a function applied to its result in ``wait()``.

    ``scale``: a factor the caller still applies to the result, None for none (DDP's default
    reduction leaves the 1/n of a mean to the copy back into the gradients: one pass over the
    bucket instead of a scaling pass and then a copy)."""

    __slots__ = ("_work", "_then", "_done", "_value", "scale")

    def __init__(self, work: Any, then: Callable[[Any], Any] | None = None,
                 scale: float | None = None) -> None:
        self._work, self._then, self._done, self._value = work, then, False, None
        self.scale = scale

    def is_completed(self) -> bool:
        """Test the underlying operation without blocking or starting anything new."""
        return self._done or bool(self._work.is_completed())

    def wait(self, timeout: float | None = None) -> Any:
        """Block for the operation, apply ``then`` once, return the value."""
        if not self._done:
            res = self._work.wait(timeout) if timeout is not None else self._work.wait()
            self._value = res if self._then is None else self._then(res)
            self._done = True
        return self._value

    def result(self) -> Any:
        """Same as ``wait()``."""
        return self.wait()


def _group(state: Any, bucket: GradBucket) -> Any:
    return state if hasattr(state, "allreduce") else bucket.group


def allreduce_hook(state: Any, bucket: GradBucket) -> HookFuture:
    """Sum the bucket across ranks in place and divide by ``bucket.divisor``."""
    return _average(_group(state, bucket), bucket.buffer(), bucket.divisor)


def _average(group: Any, flat: Any, d: int, async_op: bool = True,
             scale_later: bool = False) -> HookFuture:
    """``allreduce_hook``'s reduction of ``flat`` (sum over ``group``, divided by ``d`` in place);
    ``async_op=False`` runs it now (a blocking allreduce) and returns it done. ``scale_later``:
    where the mean is the sum times ``1/d`` (``_scales_exactly``), ``flat`` keeps the sum and
    the future's ``scale`` says what to multiply it by (the same bits)."""
    if group.size == 1 and d == 1:   # a group of one: the bucket is already its own average
        return HookFuture(Ready(flat))
    if d == group.size and (group.deterministic or not _scales_exactly(flat.dtype, d)):
        # "mean": float16 sums and divides in float32, rounding once; other sizes divide; a
        # deterministic group's mean is its own (the exact sum divided, rounded once)
        res = group.allreduce(flat, "mean", out=flat, async_op=async_op)
        return HookFuture(res if async_op else Ready(flat))
    res = group.allreduce(flat, "sum", out=flat, async_op=async_op)
    if d == 1:  # under join with one active rank
        return HookFuture(res if async_op else Ready(flat))
    if scale_later:
        return HookFuture(res if async_op else Ready(flat), scale=1.0 / d)
    if async_op:
        return HookFuture(res, _scaler(d))
    return HookFuture(Ready(_scaler(d)(flat)))


def _scales_exactly(dtype: Any, d: int) -> bool:
    """Whether multiplying a float32/float64 sum by ``1/d`` gives the very bits dividing by ``d``
    does (``d`` a power of two: ``1/d`` is exact and both round the same real number once). The
    product is the cheaper pass over a bucket (a division costs about twice a multiplication)."""
    return np.dtype(dtype) in _EXACT_DTYPES and d > 0 and d & (d - 1) == 0


#: (a set of dtypes: asked at every bucket's launch, a hashed test, not a dtype comparison chain)
_EXACT_DTYPES = frozenset({np.dtype(np.float32), np.dtype(np.float64)})


def _scaler(d: int) -> Callable[[Any], Any]:
    """Divide a summed bucket by ``d`` in place: the exact scale by ``1/d`` (see
    ``_scales_exactly``); for other ``d`` the product too (join's active-rank count, as before)."""
    s = 1.0 / d

    def scale(res: Any) -> Any:
        res *= s
        return res
    return scale


def fp16_compress_hook(state: Any, bucket: GradBucket) -> HookFuture:
    """Allreduce the bucket as float16, divided first so the sum fits whenever the mean does."""
    group = _group(state, bucket)
    flat = bucket.buffer()
    xp = xp_of(flat)
    comp = xp.empty(flat.shape, dtype=np.float16)
    # Computed in the bucket's dtype, rounded to float16 once on the way out: casting first would
    # turn every gradient above 65504 into inf even when its share of the mean fits.
    xp.multiply(flat, 1.0 / bucket.divisor, out=comp, casting="unsafe")
    work = group.allreduce(comp, "sum", out=comp, async_op=True)

    def decompress(res: Any) -> Any:
        flat[...] = res
        return flat

    return HookFuture(work, decompress)


def to_bf16(x: Any) -> Any:
    """Round a float array to bfloat16 (nearest even), returned as its uint16 bit patterns."""
    xp = xp_of(x)
    f = xp.ascontiguousarray(x, dtype=np.float32)
    bits = f.view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    out = (rounded >> np.uint32(16)).astype(np.uint16)
    nan = xp.isnan(f)
    if nan.any():
        out[nan] = np.uint16(0x7FC0)
    return out


def from_bf16(u: Any) -> Any:
    """Widen bfloat16 bit patterns (uint16) to float32 exactly."""
    return (u.astype(np.uint32) << np.uint32(16)).view(np.float32)


def bf16_compress_hook(state: Any, bucket: GradBucket) -> HookFuture:
    """Average the bucket in bfloat16: bf16 reduce-scatter (all_to_all + float32 sum), bf16 all_gather."""
    group = _group(state, bucket)
    flat = bucket.buffer()
    xp = xp_of(flat)
    n, length = group.size, int(flat.size)
    chunk = -(-length // n)
    comp = xp.zeros(n * chunk, dtype=np.uint16)
    comp[:length] = to_bf16(flat * (1.0 / bucket.divisor))
    work = group.all_to_all(comp.reshape(n, chunk), async_op=True)

    def second_stage(parts: Any) -> Any:
        # Row i is rank i's bf16 copy of the chunk this rank owns; sum in rank order in float32.
        mine = to_bf16(from_bf16(parts).sum(axis=0, dtype=np.float32))
        whole = group.all_gather(mine)
        flat[...] = from_bf16(whole.reshape(-1)[:length])
        return flat

    return HookFuture(work, second_stage)

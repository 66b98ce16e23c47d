"""numpy/cupy helpers shared by every layer: which module an array belongs to, and dtype facts."""
from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

import numpy as np

__all__ = ["refs_at", "free_refs", "is_cupy", "xp_of", "split_sizes", "shard_bounds", "to_host", "SUPPORTED_DTYPES", "SUPPORTED_SET", "is_array", "cupy_or_none",
           "contiguous", "overlaps"]

# Dtypes every collective accepts. float16 travels as raw bits and is reduced in float32 where the
# transport has no half type (Open MPI 4), which rounds once instead of at every step.
SUPPORTED_DTYPES: tuple[np.dtype, ...] = tuple(
    np.dtype(t)
    for t in (
        "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
        "float16", "float32", "float64", "complex64", "complex128",
    )
)
#: the same, as a set: membership tests on the hot paths
SUPPORTED_SET: frozenset[np.dtype] = frozenset(SUPPORTED_DTYPES)


def cupy_or_none() -> ModuleType | None:
    """cupy if the user already imported it; never import it ourselves (it is slow and optional)."""
    return sys.modules.get("cupy")


def is_cupy(x: Any) -> bool:
    cp = cupy_or_none()
    return cp is not None and isinstance(x, cp.ndarray)


def is_array(x: Any) -> bool:
    return isinstance(x, np.ndarray) or is_cupy(x)


def xp_of(*arrays: Any) -> ModuleType:
    """cupy if any argument is a cupy array, else numpy (one code path for both)."""
    for x in arrays:
        if type(x) is np.ndarray:  # the common case, without the cupy lookup
            continue
        if is_cupy(x):
            return cupy_or_none()  # type: ignore[return-value]
    return np


def split_sizes(length: int, parts: int) -> list[int]:
    """Sizes of ``parts`` near-equal pieces of ``length`` (numpy.array_split's rule: the first
    ``length % parts`` pieces are one longer)."""
    if parts < 1 or length < 0:
        raise ValueError(f"split_sizes: need length >= 0 and parts >= 1, got {length}, {parts}")
    q, r = divmod(length, parts)
    return [q + 1 if i < r else q for i in range(parts)]


def shard_bounds(length: int, parts: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` of each piece of ``split_sizes(length, parts)``: ring segments, checkpoint
    rows, shards."""
    out, lo = [], 0
    for n in split_sizes(length, parts):
        out.append((lo, lo + n))
        lo += n
    return out


def to_host(x: Any) -> np.ndarray:
    return x.get() if is_cupy(x) else np.asarray(x)


def is_supported_dtype(dt: np.dtype) -> bool:
    return (dt if isinstance(dt, np.dtype) else np.dtype(dt)) in SUPPORTED_SET


def contiguous(x: Any) -> Any:
    """``x`` itself when C-contiguous, else a contiguous copy."""
    return x if x.flags.c_contiguous else xp_of(x).ascontiguousarray(x)


def overlaps(a: Any, b: Any) -> bool:
    """Whether two arrays may share memory (numpy: may_share_memory; cupy: device ranges)."""
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return bool(np.may_share_memory(a, b))
    ptr = lambda v: v.data.ptr  # noqa: E731
    try:
        return ptr(a) < ptr(b) + b.nbytes and ptr(b) < ptr(a) + a.nbytes
    except AttributeError:
        return False


# -- reuse of buffers by reference count -------------------------------------------------------
def refs_at(entries: list, i: int) -> int:
    """The reference count of ``entries[i]`` as a pool's scan sees it (``free_refs`` calibrates
    it): a buffer pool whose only reference to a free buffer is a list slot reuses it when this
    equals ``free_refs()``; any view, request or user reference raises it."""
    return sys.getrefcount(entries[i])


def free_refs() -> int | None:
    """What ``refs_at`` reports for a buffer only its pool's list refers to, or None if this
    interpreter's counts cannot tell such a buffer from one with a live view (then a pool must
    not reuse anything)."""
    entries = [np.empty(1, np.uint8)]
    free = refs_at(entries, 0)
    view = entries[0][:]
    held = refs_at(entries, 0)
    del view
    if held != free + 1 or refs_at(entries, 0) != free:
        return None
    return free

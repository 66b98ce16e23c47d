"""numpy/cupy helpers shared by every layer: which module an array belongs to, and dtype facts."""
from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

import numpy as np

__all__ = ["is_cupy", "xp_of", "to_host", "SUPPORTED_DTYPES", "is_array", "cupy_or_none"]

# Dtypes every collective accepts. float16 travels as raw bits and is reduced in float32 where the
# transport has no half type (Open MPI 4), which rounds once instead of at every step.
SUPPORTED_DTYPES: tuple[np.dtype, ...] = tuple(
    np.dtype(t)
    for t in (
        "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
        "float16", "float32", "float64", "complex64", "complex128",
    )
)
_SUPPORTED = frozenset(SUPPORTED_DTYPES)


def cupy_or_none() -> ModuleType | None:
    """cupy if the user already imported it; never import it ourselves (it is slow and optional)."""
    return sys.modules.get("cupy")


def is_cupy(x: Any) -> bool:
    cp = cupy_or_none()
    return cp is not None and isinstance(x, cp.ndarray)


def is_array(x: Any) -> bool:
    return isinstance(x, np.ndarray) or is_cupy(x)


def xp_of(x: Any) -> ModuleType:
    """numpy or cupy, whichever owns ``x``."""
    if type(x) is np.ndarray:  # the common case, without the cupy lookup
        return np
    if is_cupy(x):
        return cupy_or_none()  # type: ignore[return-value]
    return np


def to_host(x: Any) -> np.ndarray:
    return x.get() if is_cupy(x) else np.asarray(x)


def is_supported_dtype(dt: np.dtype) -> bool:
    return (dt if isinstance(dt, np.dtype) else np.dtype(dt)) in _SUPPORTED

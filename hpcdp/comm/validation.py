"""Argument checks run on the calling rank before any byte moves."""
from __future__ import annotations

import math
import numbers
from types import ModuleType
from typing import Any

import numpy as np

from .._arrays import SUPPORTED_SET, is_cupy, is_supported_dtype, xp_of
from .._tensors import is_tensor
# one timeout rule for every layer, transports included: it lives with the settings it bounds
from .._config import TIMEOUT_MAX, check_timeout

__all__ = ["check_array", "check_out", "check_rank", "check_tag", "check_divisible",
           "check_timeout", "TIMEOUT_MAX"]


def check_array(where: str, x: Any, xp: ModuleType | None = None) -> Any:
    """``x`` must be a numpy (or cupy) array of a supported dtype, of the same module as ``xp``."""
    if type(x) is np.ndarray and x.dtype in SUPPORTED_SET and (xp is None or xp is np):
        return x  # the common case in one test
    if not isinstance(x, np.ndarray) and not is_cupy(x):
        if isinstance(x, (numbers.Number, np.generic)):
            raise TypeError(
                f"{where}: expected an array, got the scalar {x!r}; wrap it with np.asarray()"
            )
        if is_tensor(x):  # a path below the public calls, which convert tensors (``_tensors``)
            raise TypeError(f"{where}: expected a numpy or cupy array, got a torch tensor here; "
                            "pass t.detach().numpy() (the same memory)")
        raise TypeError(f"{where}: expected a numpy or cupy array, got {type(x).__name__}")
    if not is_supported_dtype(x.dtype):
        native = x.dtype.newbyteorder("=") if x.dtype.byteorder in "<>" else None
        if native is not None and is_supported_dtype(native):
            order = "big" if x.dtype.byteorder == ">" else "little"
            raise TypeError(
                f"{where}: dtype {x.dtype.str} is {order}-endian, not this machine's byte order; "
                f"convert it first: x.astype(x.dtype.newbyteorder('='))"
            )
        raise TypeError(
            f"{where}: dtype {x.dtype} is not supported "
            "(bool, int8-64, uint8-64, float16/32/64, complex64/128)"
        )
    if xp is not None and xp_of(x) is not xp:
        raise TypeError(
            f"{where}: cannot mix {xp.__name__} and {xp_of(x).__name__} arrays in one call"
        )
    return x


def check_out(where: str, out: Any, shape: tuple[int, ...], dtype: np.dtype, xp: ModuleType) -> Any:
    """``out=`` must have exactly the result's shape and dtype and be writable."""
    check_array(f"{where} out=", out, xp)
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{where}: out= has shape {tuple(out.shape)}, the result has {tuple(shape)}")
    if out.dtype != dtype:
        raise TypeError(f"{where}: out= has dtype {out.dtype}, the result has {dtype}")
    if isinstance(out, np.ndarray) and not out.flags.writeable:
        raise ValueError(f"{where}: out= is read-only")
    return out


def check_rank(where: str, what: str, r: Any, size: int) -> int:
    if type(r) is int and 0 <= r < size:  # the common case, without the ABC check
        return r
    if isinstance(r, bool) or not isinstance(r, numbers.Integral):
        raise TypeError(f"{where}: {what} must be an int, got {type(r).__name__}")
    r = int(r)
    if not 0 <= r < size:
        raise ValueError(f"{where}: {what}={r} is out of range for a group of size {size}")
    return r


def check_tag(where: str, tag: Any, max_tag: int) -> int:
    if isinstance(tag, bool) or not isinstance(tag, numbers.Integral):
        raise TypeError(f"{where}: tag must be an int, got {type(tag).__name__}")
    tag = int(tag)
    if not 0 <= tag <= max_tag:
        raise ValueError(f"{where}: tag={tag} is out of range [0, {max_tag}]")
    return tag


def check_divisible(where: str, x: Any, size: int) -> int:
    """Axis 0 of ``x`` splits into ``size`` equal parts; returns the part length."""
    if x.ndim == 0:
        raise ValueError(f"{where}: needs an array with at least one axis to split, got a 0-d array")
    if x.shape[0] % size:
        raise ValueError(
            f"{where}: axis 0 has length {x.shape[0]}, not divisible by the group size {size}"
        )
    return x.shape[0] // size

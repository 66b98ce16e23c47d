"""numpy/cupy dispatch for hpcdp.nn and hpcdp.optim (nn imports only the leaf ``hpcdp._arrays``)."""
from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import numpy as np

from .._arrays import is_cupy, xp_of  # one definition for every layer (a leaf module)

__all__ = ["xp_of", "is_cupy", "to_module", "copy_into", "scatter_add", "resolve_xp", "is_float_dtype", "erf"]


def resolve_xp(xp_or_device: Any) -> ModuleType:
    """Map numpy/cupy modules or the strings "cpu"/"numpy"/"cuda"/"gpu"/"cupy" to an array module."""
    if isinstance(xp_or_device, ModuleType):
        if xp_or_device.__name__ in ("numpy", "cupy"):
            return xp_or_device
        raise ValueError(f"unsupported array module {xp_or_device.__name__!r}; use numpy or cupy")
    name = str(xp_or_device).split(":")[0].lower()
    if name in ("cpu", "numpy", "np"):
        return np
    if name in ("cuda", "gpu", "cupy", "cp"):
        import cupy  # an explicit request for the GPU is the one place we import it

        return cupy
    raise ValueError(f"unknown device {xp_or_device!r}; expected 'cpu', 'cuda', numpy or cupy")


def to_module(x: Any, xp: ModuleType) -> Any:
    """Return ``x`` as an array of module ``xp`` (no copy when it already is one)."""
    if xp is np:
        return x.get() if is_cupy(x) else np.asarray(x)
    return xp.asarray(x)


def copy_into(dst: Any, src: Any) -> None:
    """Copy ``src`` into ``dst`` in place, across numpy/cupy when needed."""
    dst[...] = to_module(src, xp_of(dst))


def scatter_add(target: Any, index: Any, values: Any) -> None:
    """``target[index] += values`` with repeated indices summed (np.add.at / cupyx.scatter_add)."""
    if is_cupy(target):
        import cupyx

        cupyx.scatter_add(target, index, values)
    else:
        np.add.at(target, index, values)


def is_float_dtype(dtype: Any) -> bool:
    """Tell whether ``dtype`` is a real floating dtype (parameters and gradients must be)."""
    return np.issubdtype(np.dtype(dtype), np.floating)


def erf(x: Any) -> Any:
    """Elementwise error function on numpy (scipy, else math.erf) or cupy (cupyx) arrays."""
    if is_cupy(x):
        import cupyx.scipy.special

        return cupyx.scipy.special.erf(x)
    try:
        from scipy.special import erf as _erf
    except ImportError:  # scipy is optional: a vectorised math.erf is exact, only slower
        return np.vectorize(math.erf, otypes=[np.result_type(x, np.float32)])(x)
    return _erf(x)

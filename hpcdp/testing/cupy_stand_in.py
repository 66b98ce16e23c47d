"""The array module the GPU tests run on: real cupy on a GPU machine, a numpy-backed stand-in elsewhere.

The cupy tests (``tests/backends/test_cupy.py``) and the GPU script (``ci/gpu/run.sh``) are written once
against ``array_module()``. On a machine with a CUDA device they get real cupy; on this project's
CI machines (no GPU) they get the stand-in, so the same test bodies, the host-staging paths and
the script itself run in every ``make test`` and cannot rot. ``HPCDP_TEST_CUPY=real`` makes a
missing GPU an error instead (the GPU script sets it: a test that quietly ran on the stand-in
there would prove nothing).

What the stand-in reproduces: a distinct ``cupy.ndarray`` type (so ``is_cupy`` and every
"numpy or cupy" branch is exercised), ``get(out=, stream=)``/``set(stream=)`` host copies,
``data.ptr``, streams that can be synchronised, ``cupyx.empty_pinned`` and ``cupyx.scatter_add``,
and numpy's functions returning stand-in arrays. What it cannot: device memory that the host
cannot read (a transport handed a device pointer by mistake would crash on a GPU, and works
here), asynchronous kernels, and DLPack.
"""
from __future__ import annotations

import sys
import types
from typing import Any

import numpy as np

from .._config import setting

__all__ = ["array_module", "real_cupy", "install_stand_in", "stand_in_modules", "is_stand_in"]


def real_cupy() -> types.ModuleType | None:
    """cupy, when it imports and sees at least one CUDA device; else None."""
    mod = sys.modules.get("cupy")
    if mod is not None and getattr(mod, "_hpcdp_stand_in", False):
        return None
    try:
        import cupy  # type: ignore[import-not-found]

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
        return cupy
    except Exception:  # noqa: BLE001 - not installed, no driver, no device
        return None


def is_stand_in(mod: Any) -> bool:
    return bool(getattr(mod, "_hpcdp_stand_in", False))


def array_module(name: str) -> types.ModuleType:
    """``numpy`` for "numpy"; for "cupy", real cupy where a GPU is usable, else the stand-in
    (an error instead under ``HPCDP_TEST_CUPY=real``)."""
    if name == "numpy":
        return np
    if name != "cupy":
        raise ValueError(f"array_module: 'numpy' or 'cupy', got {name!r}")
    real = real_cupy()
    if real is not None:
        return real
    if setting("HPCDP_TEST_CUPY") == "real":
        raise RuntimeError("HPCDP_TEST_CUPY=real: cupy with a CUDA device is required here, and none "
                           "is usable (cupy missing, no driver, or no device)")
    return install_stand_in()


class ndarray(np.ndarray):  # noqa: N801 - mirrors cupy's name
    """A 'device' array: host memory with cupy's copy methods."""

    def get(self, stream: Any = None, order: str = "C", out: np.ndarray | None = None,
            blocking: bool = True) -> np.ndarray:
        host = self.view(np.ndarray)
        if out is None:
            return np.array(host, order=order, copy=True)
        np.copyto(out, host)
        return out

    def set(self, arr: Any, stream: Any = None) -> None:
        if not isinstance(arr, np.ndarray) or isinstance(arr, ndarray):
            raise TypeError("cupy.ndarray.set takes a numpy array")
        if arr.shape != self.shape or arr.dtype != self.dtype:
            raise ValueError(f"set: shape/dtype {arr.shape} {arr.dtype} != {self.shape} {self.dtype}")
        np.copyto(self.view(np.ndarray), arr)

    @property
    def data(self) -> Any:  # noqa: D401 - cupy's MemoryPointer, reduced to its address
        return types.SimpleNamespace(ptr=self.view(np.ndarray).ctypes.data)

    def __array_wrap__(self, arr: Any, context: Any = None, return_scalar: bool = False) -> Any:
        if return_scalar and isinstance(arr, np.ndarray) and arr.ndim == 0:
            return arr.view(ndarray)  # cupy returns 0-d arrays, never numpy scalars
        return super().__array_wrap__(arr, context, return_scalar)


class _Stream:
    def synchronize(self) -> None:
        return None


def _wrap(fn: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        if isinstance(out, np.ndarray) and not isinstance(out, ndarray):
            return out.view(ndarray)
        if isinstance(out, (tuple, list)):
            return type(out)(o.view(ndarray) if type(o) is np.ndarray else o for o in out)
        return out

    call.__name__ = getattr(fn, "__name__", "call")
    return call


def _module_getattr(name: str) -> Any:
    attr = getattr(np, name)
    if isinstance(attr, (types.FunctionType, types.BuiltinFunctionType)) or (
            callable(attr) and type(attr).__name__ in ("_ArrayFunctionDispatcher", "function")):
        return _wrap(attr)
    return attr


def _asarray(a: Any, dtype: Any = None, order: Any = None) -> ndarray:
    if isinstance(a, ndarray) and (dtype is None or a.dtype == np.dtype(dtype)):
        return a
    return np.array(a, dtype=dtype, order=order or "K", copy=True).view(ndarray)


def install_stand_in() -> types.ModuleType:
    """Put the stand-in ``cupy`` and ``cupyx`` into ``sys.modules`` (idempotent); return cupy."""
    cur = sys.modules.get("cupy")
    if cur is not None and is_stand_in(cur):
        return cur
    if cur is not None:
        raise RuntimeError("install_stand_in: the real cupy is already imported in this process")
    mods = stand_in_modules()
    sys.modules.update(mods)
    return mods["cupy"]


def stand_in_modules() -> dict[str, types.ModuleType]:
    """The stand-in modules by name (``cupy``, ``cupyx``, ...), not installed: a test fixture
    puts them into ``sys.modules`` for one test and takes them out again."""
    cp = types.ModuleType("cupy")
    cp.__dict__.update(
        _hpcdp_stand_in=True, __version__="stand-in", ndarray=ndarray,
        __getattr__=_module_getattr, asarray=_asarray,
        array=lambda a, dtype=None, copy=True: np.array(a, dtype=dtype, copy=True).view(ndarray),
        asnumpy=lambda a, stream=None: np.array(a.view(np.ndarray) if isinstance(a, ndarray) else a),
        get_array_module=lambda *arrays: cp if any(isinstance(a, ndarray) for a in arrays) else np,
        cuda=types.SimpleNamespace(
            get_current_stream=lambda: _Stream(), Stream=_Stream,
            runtime=types.SimpleNamespace(getDeviceCount=lambda: 0)),
    )
    cpx = types.ModuleType("cupyx")
    special = types.ModuleType("cupyx.scipy.special")

    def _erf(x: Any) -> Any:
        from math import erf

        return np.vectorize(erf, otypes=[np.asarray(x).dtype])(x).view(ndarray)

    special.erf = _erf
    scipy = types.ModuleType("cupyx.scipy")
    scipy.special = special
    cpx.__dict__.update(
        _hpcdp_stand_in=True, empty_pinned=lambda shape, dtype=float: np.empty(shape, dtype),
        zeros_pinned=lambda shape, dtype=float: np.zeros(shape, dtype),
        scatter_add=lambda a, idx, v: np.add.at(a.view(np.ndarray), idx, np.asarray(v)),
        scipy=scipy)
    return {"cupy": cp, "cupyx": cpx, "cupyx.scipy": scipy, "cupyx.scipy.special": special}

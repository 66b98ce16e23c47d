"""Inputs, numpy references and comparisons for the collective conformance bodies.

Every rank builds every rank's input from ``(rank, salt)`` alone (``make``), so each can compute
the reference result locally, with no communication that could itself be wrong.
"""
from __future__ import annotations

import functools
from typing import Any

import numpy as np

import hpcdp

__all__ = ["DTYPES", "OPS", "COLLECTIVES", "REDUCING", "SPLITTING", "shapes", "make", "reference",
           "reduce_ref", "expected_error", "close", "call"]

DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "float16", "float32", "float64", "complex64", "complex128"]
OPS = ["sum", "mean", "max", "min", "prod"]
REDUCING = {"allreduce", "reduce", "reduce_scatter"}
SPLITTING = {"scatter", "reduce_scatter", "all_to_all"}
COLLECTIVES = ["allreduce", "broadcast", "reduce", "all_gather", "gather", "scatter",
               "reduce_scatter", "all_to_all"]


def shapes(name: str, n: int) -> list[Any]:
    """Shapes per collective: 0-d, empty, 1, 7, 1000 and a 2-D non-contiguous view ("nc")."""
    if name in SPLITTING:
        return [(), (0,), (n,), (7 * n,), (1000 * n,), "nc"]
    return [(), (0,), (1,), (7,), (1000,), "nc"]


def make(rank: int, dtype: str, shape: Any, salt: int, n: int) -> np.ndarray:
    """Deterministic input of ``rank``: any rank can rebuild every rank's input."""
    rng = np.random.default_rng(1000 * rank + salt)
    real = shape == "nc"
    full = (2 * n, 6) if real else shape
    dt = np.dtype(dtype)
    if dt.kind == "b":
        a = rng.integers(0, 2, full).astype(bool)
    elif dt.kind == "u":
        a = rng.integers(0, 4, full).astype(dt)
    elif dt.kind == "i":
        a = rng.integers(-3, 4, full).astype(dt)
    elif dt.kind == "f":
        a = (rng.standard_normal(full) * 2).astype(dt)
    else:
        a = (rng.standard_normal(full) + 1j * rng.standard_normal(full)).astype(dt)
    return a[:, ::2] if real else np.asarray(a)


def reduce_ref(op: str, arrs: list[np.ndarray]) -> np.ndarray:
    """``op`` over ``arrs`` in double precision for floats, rounded once to the input dtype."""
    dt = arrs[0].dtype
    if dt.kind in "fc":  # reference in double precision, rounded once
        wide = [a.astype(np.complex128 if dt.kind == "c" else np.float64) for a in arrs]
        uf = {"sum": np.add, "mean": np.add, "max": np.maximum, "min": np.minimum,
              "prod": np.multiply}[op]
        res = functools.reduce(uf, wide)
        if op == "mean":
            res = res / len(arrs)
        return res.astype(dt)
    uf = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}[op]
    return functools.reduce(lambda a, b: uf(a, b, dtype=dt), arrs).astype(dt)


def reference(name: str, inputs: list[np.ndarray], rank: int, op: str, root: int) -> Any:
    """What ``name`` must return on ``rank`` given every rank's input (None off the root)."""
    n = len(inputs)
    x = inputs[rank]
    if name == "allreduce":
        return reduce_ref(op, inputs)
    if name == "broadcast":
        return inputs[root]
    if name == "reduce":
        return reduce_ref(op, inputs) if rank == root else None
    if name == "all_gather":
        return np.stack(inputs)
    if name == "gather":
        return np.stack(inputs) if rank == root else None
    if name == "scatter":
        return np.split(inputs[root], n)[rank]
    if name == "reduce_scatter":
        return np.split(reduce_ref(op, inputs), n)[rank]
    if name == "all_to_all":
        return np.concatenate([np.split(inputs[j], n)[rank] for j in range(n)]) if x.size or x.ndim else x
    raise ValueError(name)


def expected_error(name: str, dtype: str, shape: Any, op: str) -> type | None:
    """The error the API must raise for this combination (mean of ints, max of complex...)."""
    dt = np.dtype(dtype)
    if name in REDUCING:
        if op == "mean" and dt.kind not in "fc":
            return TypeError
        if op in ("max", "min") and dt.kind == "c":
            return TypeError
    if name in SPLITTING and shape == ():
        return ValueError
    return None


def close(got: Any, want: Any, dtype: str) -> bool:
    """Same shape and dtype, equal (floats: within a tolerance for the dtype)."""
    if want is None or got is None:
        return got is None and want is None
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    dt = np.dtype(dtype)
    if dt.kind in "fc":
        tol = {2: 2e-2, 4: 1e-5, 8: 1e-12, 16: 1e-12}[dt.itemsize if dt.kind == "f" else dt.itemsize // 2]
        return bool(np.allclose(got, want, rtol=tol, atol=tol * 4, equal_nan=True))
    return bool(np.array_equal(got, want))


def call(name: str, x: np.ndarray, op: str, root: int, group: Any = None,
         timeout: float | None = None) -> Any:
    """``hpcdp.<name>(x, ...)`` with the arguments that collective takes."""
    kw = {"group": group, "timeout": timeout}
    if name in ("allreduce", "reduce_scatter"):
        return getattr(hpcdp, name)(x, op, **kw)
    if name == "reduce":
        return hpcdp.reduce(x, op, root=root, **kw)
    if name in ("broadcast", "gather", "scatter"):
        return getattr(hpcdp, name)(x, root=root, **kw)
    return getattr(hpcdp, name)(x, **kw)

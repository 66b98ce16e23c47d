"""Collective test bodies and their numpy reference, shared by every backend's tests.

Bodies run on every rank and collect failures instead of raising, so one wrong answer never
leaves the other ranks waiting in a collective: the test asserts on the returned lists.
"""
from __future__ import annotations

import functools
import time
from typing import Any

import numpy as np

import hpcdp
from hpcdp.errors import CommTimeoutError, PeerFailureError

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
    if want is None or got is None:
        return got is None and want is None
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    dt = np.dtype(dtype)
    if dt.kind in "fc":
        tol = {2: 2e-2, 4: 1e-5, 8: 1e-12, 16: 1e-12}[dt.itemsize if dt.kind == "f" else dt.itemsize // 2]
        return bool(np.allclose(got, want, rtol=tol, atol=tol * 4, equal_nan=True))
    return bool(np.array_equal(got, want))


def call(name: str, x: np.ndarray, op: str, root: int, group: Any = None) -> Any:
    kw = {"group": group}
    if name in ("allreduce", "reduce_scatter"):
        return getattr(hpcdp, name)(x, op, **kw)
    if name == "reduce":
        return hpcdp.reduce(x, op, root=root, **kw)
    if name in ("broadcast", "gather", "scatter"):
        return getattr(hpcdp, name)(x, root=root, **kw)
    return getattr(hpcdp, name)(x, **kw)


def body_collective(rank: int, name: str, dtypes: list[str] | None = None,
                    group_ranks: list[int] | None = None) -> list[str]:
    """Every dtype x shape (x op) of one collective against numpy; returns failure messages."""
    group = None
    if group_ranks is not None:
        group = hpcdp.new_group(group_ranks)
        if not group.is_member:
            return []
        rank = group.rank
    n = group.size if group is not None else hpcdp.world_size()
    fails: list[str] = []
    salt = 0
    for dtype in dtypes or DTYPES:
        for shape in shapes(name, n):
            for op in (OPS if name in REDUCING else ["-"]):
                salt += 1
                root = salt % n
                inputs = [make(r, dtype, shape, salt, n) for r in range(n)]
                x = inputs[rank]
                before = x.copy()
                err = expected_error(name, dtype, shape, op)
                label = f"{name}(dtype={dtype}, shape={shape}, op={op}, root={root}, n={n})"
                try:
                    got = call(name, x, op, root, group)
                except Exception as exc:  # noqa: BLE001 - collected and reported
                    if err is None or not isinstance(exc, err):
                        fails.append(f"{label}: raised {type(exc).__name__}: {exc}")
                    continue
                if err is not None:
                    fails.append(f"{label}: expected {err.__name__}, got a result")
                    continue
                want = reference(name, inputs, rank, op, root)
                if name == "broadcast":
                    got = got if got is not None else x
                if not close(got, want, dtype):
                    fails.append(f"{label}: got {got!r}, want {want!r}")
                if name != "broadcast" and not np.array_equal(x, before, equal_nan=True):
                    fails.append(f"{label}: modified its input")
    return fails


def body_sleepy_timeout(rank: int, late: int, sleep: float, timeout: float,
                        per_call: bool = False) -> dict[str, Any]:
    """Rank ``late`` sleeps past the others' timeout; they must raise CommTimeoutError in time.

    ``per_call``: the group waits 30 s and the call passes ``timeout=`` itself.
    """
    group = hpcdp.new_group(list(range(hpcdp.world_size())), timeout=30.0 if per_call else timeout)
    out: dict[str, Any] = {"rank": rank}
    if rank == late:
        time.sleep(sleep)
    t0 = time.monotonic()
    try:
        hpcdp.allreduce(np.ones(4), group=group, timeout=timeout if per_call else None)
        out["result"] = "ok"
    except CommTimeoutError as exc:
        out["result"] = "timeout"
        out["message"] = str(exc)
    except PeerFailureError as exc:
        out["result"] = "peer-failure"
        out["message"] = str(exc)
    out["elapsed"] = time.monotonic() - t0
    hpcdp.barrier()  # the world group is still healthy
    return out


def body_mismatch(rank: int, group: Any = None) -> str:
    """Ranks disagree on the shape; with HPCDP_DEBUG=detail every rank must raise."""
    x = np.ones(3 + rank)
    try:
        hpcdp.allreduce(x, group=group)
    except hpcdp.CollectiveMismatchError as exc:
        return str(exc)
    return "no error"

"""The shared ring/tree algorithms, run on the simulated backend through its p2p opt-in.

Thresholds are lowered so small arrays take the ring and piece-pipelined paths too, with sizes that
do not split evenly into ring segments.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

import hpcdp
from hpcdp.backends import _algorithms as algo
from hpcdp.testing import run_ranks

SIZES = [1, 5, 13, 100]
DTYPES = ["float64", "float16", "int32", "bool", "complex64"]


@pytest.fixture(params=["latency", "ring"])
def p2p_sim(request, monkeypatch):
    monkeypatch.setenv("HPCDP_SIM_ALGORITHMS", "p2p")
    if request.param == "ring":
        monkeypatch.setattr(algo, "SMALL_BYTES", 0)
        monkeypatch.setattr(algo, "PIECE_BYTES", 24)  # several pieces per segment
    return request.param


def _input(rank: int, dtype: str, size: int) -> np.ndarray:
    rng = np.random.default_rng(rank * 7919 + size)
    if dtype == "bool":
        return rng.integers(0, 2, size).astype(bool)
    if dtype == "int32":
        return rng.integers(-3, 4, size).astype(np.int32)
    if dtype == "complex64":
        return (rng.standard_normal(size) + 1j * rng.standard_normal(size)).astype(np.complex64)
    return rng.standard_normal(size).astype(dtype)


def _ref(op: str, arrs: list[np.ndarray]) -> np.ndarray:
    uf = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}[op]
    dt = arrs[0].dtype
    if dt.kind in "fc":
        wide = np.complex128 if dt.kind == "c" else np.float64
        return functools.reduce(uf, [a.astype(wide) for a in arrs]).astype(dt)
    return functools.reduce(lambda a, b: uf(a, b, dtype=dt), arrs)


def _close(got: np.ndarray, want: np.ndarray) -> bool:
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if want.dtype.kind in "fc":
        tol = 2e-2 if want.dtype == np.float16 else 1e-5
        return bool(np.allclose(got, want, rtol=tol, atol=tol))
    return bool(np.array_equal(got, want))


def body(rank: int) -> list[str]:
    n = hpcdp.world_size()
    fails = []
    for dtype in DTYPES:
        for size in SIZES:
            ins = [_input(r, dtype, size * n) for r in range(n)]
            x = ins[rank]
            ops = ["sum", "prod"] + ([] if dtype == "complex64" else ["max", "min"])
            for op in ops:
                want = _ref(op, ins)
                checks = {
                    "allreduce": (hpcdp.allreduce(x, op), want),
                    "reduce_scatter": (hpcdp.reduce_scatter(x, op), np.split(want, n)[rank]),
                }
                root = size % n
                got = hpcdp.reduce(x, op, root=root)
                if rank == root:
                    checks["reduce"] = (got, want)
                for name, (g, w) in checks.items():
                    if not _close(g, w):
                        fails.append(f"{name}({dtype}, {size * n}, {op}) n={n}: {g} != {w}")
            root = (size + 1) % n
            checks = {
                "broadcast": (hpcdp.broadcast(x.copy(), root=root), ins[root]),
                "all_gather": (hpcdp.all_gather(x), np.stack(ins)),
                "scatter": (hpcdp.scatter(x, root=root), np.split(ins[root], n)[rank]),
                "all_to_all": (hpcdp.all_to_all(x),
                               np.concatenate([np.split(ins[j], n)[rank] for j in range(n)])),
            }
            g = hpcdp.gather(x, root=root)
            if rank == root:
                checks["gather"] = (g, np.stack(ins))
            for name, (g, w) in checks.items():
                if not np.array_equal(g, w):
                    fails.append(f"{name}({dtype}, {size * n}) n={n}: {g} != {w}")
            hpcdp.barrier()
    return fails


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_algorithms_match_numpy(p2p_sim, world_size: int) -> None:
    per_rank = run_ranks("sim", world_size, body)
    fails = [f"rank {r}: {f}" for r, fs in enumerate(per_rank) for f in fs]
    assert not fails, "\n".join(fails[:10])


def test_sim_really_uses_p2p_algorithms(monkeypatch) -> None:
    monkeypatch.setenv("HPCDP_SIM_ALGORITHMS", "p2p")
    calls = []
    real = algo.allreduce
    monkeypatch.setattr(algo, "allreduce", lambda *a: (calls.append(1), real(*a))[1])
    run_ranks("sim", 2, _one_allreduce)
    assert calls


def _one_allreduce(rank: int) -> float:
    return float(hpcdp.allreduce(np.ones(3))[0])


def test_recursive_doubling_is_bitwise_identical_across_ranks(monkeypatch) -> None:
    monkeypatch.setenv("HPCDP_SIM_ALGORITHMS", "p2p")
    res = run_ranks("sim", 3, _float_sum)
    assert all(np.array_equal(res[0], r) for r in res)


def _float_sum(rank: int) -> np.ndarray:
    x = np.random.default_rng(rank).standard_normal(101) * 10 ** rank
    return hpcdp.allreduce(x)

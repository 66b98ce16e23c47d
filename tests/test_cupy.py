"""cupy arrays on the MPI backend: CUDA-aware and host-staged paths (need a GPU; skip cleanly).

The array-module checks themselves run everywhere with a stand-in ``cupy`` module.
"""
from __future__ import annotations

import os
import sys
import types

import numpy as np
import pytest

import hpcdp


def _gpu_or_skip():
    cupy = pytest.importorskip("cupy", reason="cupy is not installed (no GPU on this machine)")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except Exception as exc:  # noqa: BLE001 - no driver
        pytest.skip(f"no usable CUDA device: {exc}")
    return cupy


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("aware", ["auto", "0"])
def test_cupy_collectives_mpi(mpi_world, aware: str, monkeypatch: pytest.MonkeyPatch) -> None:
    cupy = _gpu_or_skip()
    from hpcdp.backends import mpi

    monkeypatch.setenv("HPCDP_CUDA_AWARE", aware) if aware != "auto" else None
    group = hpcdp.new_group(list(range(mpi_world.size)))  # reads CUDA-awareness afresh
    rank, n = group.rank, group.size
    x = cupy.arange(1000, dtype=cupy.float32) + rank
    want = sum(np.arange(1000, dtype=np.float32) + r for r in range(n))
    got = hpcdp.allreduce(x, group=group)
    assert isinstance(got, cupy.ndarray)
    np.testing.assert_allclose(got.get(), want)
    hpcdp.allreduce(x, out=x, group=group)  # in place
    np.testing.assert_allclose(x.get(), want)
    ag = hpcdp.all_gather(cupy.full(3, rank, cupy.int64), group=group)
    np.testing.assert_array_equal(ag.get()[:, 0], np.arange(n))
    rs = hpcdp.reduce_scatter(cupy.ones((n, 5), cupy.float64), "mean", group=group)
    np.testing.assert_allclose(rs.get(), 1.0)
    b = hpcdp.broadcast(cupy.full(4, float(rank)), root=n - 1, group=group)
    np.testing.assert_array_equal(b.get(), n - 1)
    w = hpcdp.allreduce(cupy.ones(10, cupy.float16), async_op=True, group=group)
    np.testing.assert_allclose(w.wait().get(), n)
    if aware == "0":
        assert not group.backend.cuda_aware
    print(f"rank {rank}: cupy collectives ok, CUDA-aware MPI: {mpi.cuda_aware()}")


@pytest.fixture
def fake_cupy(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """A stand-in cupy whose ndarray is a numpy subclass, to test module checks without a GPU."""
    if "cupy" in sys.modules and hasattr(sys.modules["cupy"], "cuda"):
        pytest.skip("real cupy is loaded")
    mod = types.ModuleType("cupy")

    class ndarray(np.ndarray):  # noqa: N801 - mirrors cupy's name
        pass

    mod.ndarray = ndarray
    monkeypatch.setitem(sys.modules, "cupy", mod)
    return mod


def _body_mixed(rank: int) -> list[str]:
    import cupy  # the stand-in

    fails = []
    dev = np.ones(3).view(cupy.ndarray)
    for label, fn in [
        ("numpy x, cupy out", lambda: hpcdp.allreduce(np.ones(3), out=dev)),
        ("cupy on sim", lambda: hpcdp.allreduce(dev)),
    ]:
        try:
            fn()
            fails.append(f"{label}: accepted")
        except TypeError as exc:
            if "cupy" not in str(exc):
                fails.append(f"{label}: unclear message {exc}")
    return fails


def test_mixing_numpy_and_cupy_is_rejected(fake_cupy) -> None:
    fails = hpcdp.spawn(_body_mixed, 2)
    assert fails == [[], []]

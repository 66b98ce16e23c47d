"""cupy arrays on the MPI backend: CUDA-aware and host-staged paths (need a GPU; skip cleanly).

The array-module checks themselves run everywhere with a stand-in ``cupy`` module.
"""
from __future__ import annotations

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


@pytest.fixture
def staging_cupy(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """A stand-in cupy (numpy-backed) so the MPI backend's host-staging path runs on the CPU."""
    if "cupy" in sys.modules and hasattr(sys.modules["cupy"], "cuda") and \
            not getattr(sys.modules["cupy"], "_hpcdp_stand_in", False):
        pytest.skip("real cupy is loaded")
    cp = types.ModuleType("cupy")
    cp._hpcdp_stand_in = True

    class ndarray(np.ndarray):  # noqa: N801 - mirrors cupy's name
        def get(self, out=None):
            if out is None:
                return np.asarray(self).copy()
            np.copyto(out, np.asarray(self))
            return out

        def set(self, host):
            np.copyto(np.asarray(self), host)

    class _Stream:
        def synchronize(self) -> None:
            pass

    cp.ndarray = ndarray
    cp.cuda = types.SimpleNamespace(get_current_stream=lambda: _Stream())
    cp.empty = lambda shape, dtype=float: np.empty(shape, dtype).view(ndarray)
    cp.ascontiguousarray = lambda a: np.ascontiguousarray(a).view(ndarray)
    cp.divide = np.divide
    cpx = types.ModuleType("cupyx")
    cpx.empty_pinned = lambda shape, dtype: np.empty(shape, dtype)
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setitem(sys.modules, "cupyx", cpx)
    monkeypatch.setenv("HPCDP_CUDA_AWARE", "0")
    return cp


@pytest.mark.mpi(min_size=2)
def test_host_staging_path_mpi(mpi_world, staging_cupy) -> None:
    """In place, several async ops of one size in flight, float16: results land on the 'device'."""
    from hpcdp.backends.mpi import MPIBackend

    group = hpcdp.new_group(list(range(mpi_world.size)))
    assert isinstance(group.backend, MPIBackend)
    group.backend.cuda_aware = False
    dev = lambda a: np.ascontiguousarray(a).view(staging_cupy.ndarray)  # noqa: E731
    rank, n = group.rank, group.size
    x = dev(np.arange(4.0) + rank)
    hpcdp.allreduce(x, out=x, group=group)
    np.testing.assert_array_equal(np.asarray(x), sum(np.arange(4.0) + r for r in range(n)))
    a, b = dev(np.full(4, 1.0 * (rank + 1))), dev(np.full(4, 100.0 * (rank + 1)))
    wa = hpcdp.allreduce(a, group=group, async_op=True)
    wb = hpcdp.allreduce(b, group=group, async_op=True)
    tri = n * (n + 1) / 2
    np.testing.assert_array_equal(np.asarray(wb.wait()), 100 * tri)
    np.testing.assert_array_equal(np.asarray(wa.wait()), tri)
    h = hpcdp.allreduce(dev(np.ones(6, np.float16)), "mean", group=group)
    np.testing.assert_array_equal(np.asarray(h), 1.0)
    g = hpcdp.all_gather(dev(np.full(3, rank)), group=group)
    np.testing.assert_array_equal(np.asarray(g)[:, 0], np.arange(n))

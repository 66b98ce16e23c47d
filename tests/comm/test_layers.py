"""The seams issue 10 added: backend capabilities and registry, the finalize registry, the one
array-split rule, and the compatibility paths of the moved modules."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import hpcdp
from hpcdp._arrays import shard_bounds, split_sizes, xp_of
from hpcdp.backends import base


@pytest.mark.parametrize("length,parts", [(0, 1), (0, 3), (1, 4), (7, 3), (12, 4), (1000, 7)])
def test_split_rule_is_numpy_array_split(length: int, parts: int) -> None:
    want = [len(a) for a in np.array_split(np.arange(length), parts)]
    assert split_sizes(length, parts) == want
    bounds = shard_bounds(length, parts)
    assert [hi - lo for lo, hi in bounds] == want
    assert bounds[0][0] == 0 and bounds[-1][1] == length
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))


def test_split_rule_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="split_sizes"):
        split_sizes(4, 0)
    with pytest.raises(ValueError, match="split_sizes"):
        split_sizes(-1, 2)


def test_one_xp_of() -> None:
    from hpcdp.nn import backend as _backend

    assert _backend.xp_of is xp_of
    assert xp_of(np.ones(2), [1], 3.0) is np and xp_of() is np


def _caps(rank: int) -> tuple:
    be = hpcdp.get_default_group().backend
    return (be.max_tag, be.timeout_poisons_group, be.needs_progress_thread, be.thread_level,
            be.native_comm(), be.accepts_cupy)


def test_capabilities_of_the_builtin_backends() -> None:
    want = (2**31 - 1, False, False, "multiple", None, False)
    assert hpcdp.spawn(_caps, 2, backend="sim") == [want, want]
    assert hpcdp.spawn(_caps, 2, backend="tcp", timeout=30, join_timeout=120) == [want, want]


def test_registry_drives_available_and_spawn() -> None:
    calls: list[tuple] = []

    def spawn(fn, world_size, **kw):
        calls.append((world_size, sorted(kw)))
        return ["ran"] * world_size

    base.register_backend("custom-caps", lambda **o: None, available=lambda: True, spawn=spawn)
    base.register_backend("custom-off", lambda **o: None, available=lambda: False, spawn=spawn)
    try:
        assert "custom-caps" in hpcdp.available_backends()
        assert "custom-off" not in hpcdp.available_backends()
        assert "custom-caps" in base.spawnable_backends()
        assert "custom-off" not in base.spawnable_backends()
        assert "mpi" not in base.spawnable_backends()  # mpirun starts MPI ranks, not hpcdp
        assert hpcdp.spawn(lambda r: r, 3, backend="custom-caps") == ["ran"] * 3
        assert calls == [(3, ["args", "join_timeout", "kwargs", "timeout"])]
        with pytest.raises(ValueError, match="custom-caps"):
            hpcdp.spawn(lambda r: r, 2, backend="nope")
    finally:
        base._REGISTRY.pop("custom-caps", None)
        base._REGISTRY.pop("custom-off", None)
    with pytest.raises(TypeError, match="callable"):
        base.register_backend("bad", "not a factory")  # type: ignore[arg-type]


def test_a_backend_without_probe_says_so() -> None:
    def body(rank: int) -> str:
        be = hpcdp.get_default_group().backend
        try:
            base.Backend.probe(be, -1, -1)
        except hpcdp.HpcdpError as exc:
            return str(exc)
        return "no error"

    msg = hpcdp.spawn(body, 1, backend="sim")[0]
    assert "cannot probe" in msg and "rank 0" in msg


def test_finalize_runs_registered_hooks_before_the_transport_goes() -> None:
    from hpcdp.comm import world as _world

    seen: list[tuple] = []

    def hook(group):
        seen.append((group.name, group.backend is not None))

    assert _world.on_finalize(hook) is hook
    _world.on_finalize(hook)  # registered once
    try:
        hpcdp.init("sim")
        hpcdp.finalize()
        assert seen == [("world", True)]
    finally:
        _world._finalizers.remove(hook)


@pytest.mark.mpi(min_size=2)
def test_capabilities_of_mpi(mpi_world) -> None:
    be = mpi_world.backend
    assert be.timeout_poisons_group and be.needs_progress_thread
    assert be.thread_level in ("single", "serialized", "multiple")
    assert be.native_comm() is not None and be.native_comm().Get_size() == mpi_world.size
    assert be.max_tag >= 32767


@pytest.mark.timeout(120)
def test_run_is_the_launcher_entry_point_and_the_shims_are_gone() -> None:
    code = ("import importlib.util, hpcdp.run, hpcdp.backends.tcp as t;"
            "assert hpcdp.run.main is __import__('hpcdp.launch.cli').launch.cli.main;"
            "assert all(importlib.util.find_spec('hpcdp.backends.' + m) is None"
            "           for m in ('_tcp_wire', '_tcp_accept', '_tcp_spawn'));"
            "assert t.bind_address('127.0.0.1') == '127.0.0.1'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=100)
    out = subprocess.run([sys.executable, "-m", "hpcdp.run", "--help"], capture_output=True,
                         text=True, timeout=100)
    assert out.returncode == 0 and "hpcdp-run" in out.stdout

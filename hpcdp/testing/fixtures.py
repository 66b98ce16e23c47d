"""pytest fixtures that bind one test body to several worlds, as mpi4py binds one test class to
several communicators.

Use from a ``conftest.py``: ``from hpcdp.testing.fixtures import world, mpi_world, shared_tmp_path``.

A test written once against ``world`` runs on simulated 2 and 4 ranks and TCP 3 ranks in the
single-process run, and on the MPI world in the ``mpirun ... --with-mpi -m mpi`` runs: the MPI
variant carries the ``mpi`` marker, so ``-m "not mpi"`` deselects it (rather than skipping it) and
``-m mpi`` selects only it. A test that needs other worlds names them::

    @pytest.mark.parametrize("world", worlds("sim-1", "sim-3", "tcp-2", "mpi"), indirect=True)
    def test_something(world): check(world.run(body, arg))
"""
from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import pytest

from .. import comm
from .._config import setting
from ._harness import remove_shared_dir, run_mpi, run_ranks, shared_dir

__all__ = ["World", "worlds", "DEFAULT_WORLDS", "world", "mpi_world", "shared_tmp_path"]

#: the worlds a ``world`` test runs on unless it names others
DEFAULT_WORLDS = ("sim-2", "sim-4", "tcp-3", "mpi")


@dataclass(frozen=True)
class World:
    """Where a test body runs: ``size`` spawned ranks of ``backend``, or (``backend == "mpi"``)
    every rank of the ``mpirun`` job this pytest runs in."""

    backend: str
    size: int

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> list[Any]:
        """``fn(rank, *args)`` on every rank of this world; each rank's return value (on every
        rank, under MPI). ``timeout``: the group timeout of collectives inside ``fn``."""
        if self.backend == "mpi":
            return run_mpi(fn, *args) if timeout is None else run_mpi(fn, *args, timeout=timeout)
        return run_ranks(self.backend, self.size, fn, *args,
                         **({} if timeout is None else {"timeout": timeout}))

    @property
    def is_mpi(self) -> bool:
        return self.backend == "mpi"

    def __str__(self) -> str:
        return "mpi" if self.is_mpi else f"{self.backend}-{self.size}"


def worlds(*names: str, mpi_min_size: int = 2) -> list[Any]:
    """pytest params for ``world`` (``"sim-4"``, ``"tcp-3"``, ``"mpi"``): the MPI one marked ``mpi``."""
    out = []
    for name in names or DEFAULT_WORLDS:
        if name == "mpi":
            out.append(pytest.param(("mpi", 0), id="mpi", marks=pytest.mark.mpi(min_size=mpi_min_size)))
            continue
        backend, _, size = name.partition("-")
        if not size.isdigit() or int(size) < 1:
            raise ValueError(f"worlds: {name!r} is not 'backend-N' or 'mpi'")
        out.append(pytest.param((backend, int(size)), id=name))
    return out


def _mpi_group() -> comm.ProcessGroup:
    if not comm.is_initialized():
        comm.init("mpi")
    g = comm.get_default_group()
    assert g.backend.native_comm() is not None, f"not an MPI world: {g.backend.describe()}"
    return g


@pytest.fixture(params=worlds())
def world(request: pytest.FixtureRequest) -> World:
    """The world a test body runs on (see the module docstring)."""
    backend, size = request.param
    if backend == "mpi":
        return World("mpi", _mpi_group().size)
    return World(backend, size)


@pytest.fixture(scope="session")
def mpi_world() -> comm.ProcessGroup:
    """The MPI world group (tests marked ``mpi`` run under mpirun with --with-mpi)."""
    return _mpi_group()


@pytest.fixture
def shared_tmp_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One temporary directory for every rank of the default group (MPI-safe: each rank's
    pytest has its own ``tmp_path``, so rank 0 chooses and broadcasts); removed afterwards."""
    if not comm.is_initialized() or comm.world_size() == 1:
        path = tempfile.mkdtemp(prefix="hpcdp-test-", dir=tmp_path_factory.getbasetemp())
        yield path
        shutil.rmtree(path, ignore_errors=True)
        return
    # several nodes need a directory they all see: HPCDP_SHARED_TMPDIR (default: TMPDIR)
    path = shared_dir(setting("HPCDP_SHARED_TMPDIR"))
    yield path
    remove_shared_dir(path)

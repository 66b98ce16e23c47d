"""pytest fixtures that bind one test body to several worlds, as mpi4py binds one test class to
several communicators.

Use from a ``conftest.py``: ``from hpcdp.testing.fixtures import world, mpi_world, shared_tmp_path``.

A test written once against ``world`` runs on simulated 2 and 4 ranks and TCP 3 ranks in the
single-process run, and on the MPI world in the ``mpirun ... --with-mpi -m mpi`` runs: the MPI
variant carries the ``mpi`` marker, so ``-m "not mpi"`` deselects it (rather than skipping it) and
``-m mpi`` selects only it. A test that needs other worlds names them::

    @pytest.mark.parametrize("world", worlds("sim-1", "sim-3", "tcp-2", "mpi"), indirect=True)
    def test_something(world): check(world.run(body, arg))

and ``grid(sizes)`` spells every spawnable backend at each size (``worlds(*grid([1, 2, 3, 4]),
"mpi")``). The MPI world's size is whatever ``mpirun -n`` gave (``make test`` runs -n 2 and
-n 4); a body that needs more ranks says so with ``worlds(..., mpi_min_size=4)``.
"""
from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import pytest

from .. import comm
from .._config import setting
from ._harness import remove_shared_dir, run_mpi, run_ranks, shared_dir, spawn_backends

__all__ = ["World", "worlds", "grid", "DEFAULT_WORLDS", "world", "mpi_world", "shared_tmp_path"]

#: the worlds a ``world`` test runs on unless it names others
DEFAULT_WORLDS = ("sim-2", "sim-4", "tcp-3", "mpi")


@dataclass(frozen=True)
class World:
    """Where a test body runs: ``size`` spawned ranks of ``backend``, or (``backend == "mpi"``)
    every rank of the ``mpirun`` job this pytest runs in."""

    backend: str
    size: int

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None,
            mpi_timeout: float | None = None, join_timeout: float | None = None) -> list[Any]:
        """``fn(rank, *args)`` on every rank of this world; each rank's return value (on every
        rank, under MPI).

        Args:
            timeout: the group timeout of collectives inside ``fn`` on a spawned world (default:
                ``run_ranks``'s).
            mpi_timeout: the same on the MPI world (default: ``run_mpi``'s, longer: under
                ``mpirun -n 4`` on a small machine ranks share cores, and a tight cap meant for
                threads would fail a slow but correct body). Separate so that a test's short
                spawned-world cap does not silently tighten its MPI run.
            join_timeout: the hard cap on a spawned world's whole run (``run_ranks``); under
                MPI, pytest-timeout is that cap.
        """
        if self.backend == "mpi":
            return run_mpi(fn, *args, **({} if mpi_timeout is None else {"timeout": mpi_timeout}))
        caps = {k: v for k, v in (("timeout", timeout), ("join_timeout", join_timeout))
                if v is not None}
        return run_ranks(self.backend, self.size, fn, *args, **caps)

    def from_root(self, make: Callable[..., Any], *args: Any) -> Any:
        """``make(*args)`` once for the whole world: in this process for a spawned world (its
        ranks are this process's threads or children), on MPI rank 0 and broadcast otherwise:
        a file every rank then reads, made once."""
        if not self.is_mpi:
            return make(*args)
        group = _mpi_group()
        return group.broadcast_object(make(*args) if group.rank == 0 else None, root=0)

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


def grid(sizes: Sequence[int], backends: Sequence[str] | None = None) -> list[str]:
    """World names for ``worlds``: each backend (default: every one ``hpcdp.spawn`` can start)
    at each size, e.g. ``grid([1, 2])`` -> ``["sim-1", "sim-2", "tcp-1", "tcp-2"]``."""
    return [f"{b}-{n}" for b in (spawn_backends() if backends is None else backends) for n in sizes]


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
def shared_tmp_path(request: pytest.FixtureRequest,
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One temporary directory for every rank of the default group (MPI-safe: each rank's
    pytest has its own ``tmp_path``, so rank 0 chooses and broadcasts); removed afterwards.

    Under ``--with-mpi`` it joins the MPI world first: set up before a test's ``world`` (the
    order of fixtures is the test's to choose), it would otherwise give each rank its own."""
    if not comm.is_initialized() and request.config.getoption("--with-mpi", default=False):
        _mpi_group()
    if not comm.is_initialized() or comm.world_size() == 1:
        path = tempfile.mkdtemp(prefix="hpcdp-test-", dir=tmp_path_factory.getbasetemp())
        yield path
        shutil.rmtree(path, ignore_errors=True)
        return
    # several nodes need a directory they all see: HPCDP_SHARED_TMPDIR (default: TMPDIR)
    path = shared_dir(setting("HPCDP_SHARED_TMPDIR"))
    yield path
    remove_shared_dir(path)

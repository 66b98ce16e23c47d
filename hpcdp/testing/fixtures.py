"""pytest fixtures for suites that run under ``mpirun`` as well as single-process.

Use from a ``conftest.py``: ``from hpcdp.testing.fixtures import mpi_world, shared_tmp_path``.
"""
from __future__ import annotations

import shutil
import tempfile
from typing import Iterator

import pytest

import hpcdp

from .._config import setting
from ._harness import remove_shared_dir, shared_dir

__all__ = ["mpi_world", "shared_tmp_path"]


@pytest.fixture(scope="session")
def mpi_world() -> hpcdp.ProcessGroup:
    """The MPI world group (tests marked ``mpi`` run under mpirun with --with-mpi)."""
    if not hpcdp.is_initialized():
        hpcdp.init("mpi")
    g = hpcdp.get_default_group()
    assert g.backend.native_comm() is not None, f"not an MPI world: {g.backend.describe()}"
    return g


@pytest.fixture
def shared_tmp_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One temporary directory for every rank of the default group (MPI-safe: each rank's
    pytest has its own ``tmp_path``, so rank 0 chooses and broadcasts); removed afterwards."""
    if not hpcdp.is_initialized() or hpcdp.world_size() == 1:
        path = tempfile.mkdtemp(prefix="hpcdp-test-", dir=tmp_path_factory.getbasetemp())
        yield path
        shutil.rmtree(path, ignore_errors=True)
        return
    # several nodes need a directory they all see: HPCDP_SHARED_TMPDIR (default: TMPDIR)
    path = shared_dir(setting("HPCDP_SHARED_TMPDIR"))
    yield path
    remove_shared_dir(path)

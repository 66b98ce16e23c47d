"""Shared fixtures: run a test body on N ranks of a backend, or on the MPI world under mpirun."""
from __future__ import annotations

import os
import sys
from typing import Any, Callable

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # test bodies are imported by reference in spawned processes
    sys.path.insert(0, HERE)

import hpcdp  # noqa: E402


SPAWN_BACKENDS = ["sim", "tcp"]


def run_ranks(backend: str, world_size: int, fn: Callable[..., Any], *args: Any,
              timeout: float = 30.0, join_timeout: float = 180.0) -> list[Any]:
    """``fn(rank, *args)`` on ``world_size`` ranks of ``backend``; each rank's return value."""
    return hpcdp.spawn(fn, world_size, backend=backend, args=args, timeout=timeout,
                       join_timeout=join_timeout)


@pytest.fixture(scope="session")
def mpi_world() -> hpcdp.ProcessGroup:
    """The MPI world group (tests marked ``mpi`` run under mpirun with --with-mpi)."""
    if not hpcdp.is_initialized():
        hpcdp.init("mpi")
    g = hpcdp.get_default_group()
    assert g.backend.name == "mpi"
    return g


def run_mpi(fn: Callable[..., Any], *args: Any) -> list[Any]:
    """Run a body on the MPI world; every rank gets every rank's return value."""
    mine = fn(hpcdp.rank(), *args)
    return hpcdp.all_gather_object(mine)


@pytest.fixture
def log():
    """Messages the ``hpcdp.tcp`` logger emits during the test (DEBUG and up)."""
    import logging

    from tcp_helpers import LogCollector

    handler = LogCollector(logging.DEBUG).attach()
    try:
        yield handler.messages
    finally:
        handler.detach()

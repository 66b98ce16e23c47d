"""Transports behind the ``Backend`` interface: ``mpi``, ``tcp`` and ``sim``.

Backends register themselves by name (like h5py's drivers) with what they need to start:
``register_backend(name, factory, available=..., spawn=...)``; ``available_backends()``,
``hpcdp.spawn`` and the conformance suite's matrix (``hpcdp.testing``) all read the registry.
The heavy libraries a backend needs are imported only when one is actually created.
"""
from __future__ import annotations

import importlib.util
from typing import Any

from .base import (
    ANY_SOURCE, ANY_TAG, Backend, Request, available_backends, backend_factory, backend_spawner,
    register_backend, spawnable_backends,
)
from . import sim as _sim  # registers "sim"

__all__ = ["Backend", "Request", "register_backend", "available_backends", "backend_factory",
           "backend_spawner", "spawnable_backends", "ANY_SOURCE", "ANY_TAG"]


# The factories spell out the options each backend takes: ``hpcdp.init`` refuses any other
# (``_world.check_options``), the same way for every backend.
def _mpi_factory() -> Backend:
    from .mpi import create_world

    return create_world()


def _tcp_factory(*, connect_timeout: float | None = None) -> Backend:
    from .tcp import create_world

    return create_world(connect_timeout=connect_timeout)


def _mpi_available() -> bool:
    return importlib.util.find_spec("mpi4py") is not None


def _tcp_spawn(*args: Any, **kwargs: Any) -> list[Any]:
    """Local TCP ranks as processes (the launcher's machinery; imported when used)."""
    from ..launch._processes import spawn_processes

    return spawn_processes(*args, **kwargs)


# MPI ranks are started by mpirun/srun, never by hpcdp: no spawn
register_backend("mpi", _mpi_factory, available=_mpi_available)
register_backend("tcp", _tcp_factory, spawn=_tcp_spawn)

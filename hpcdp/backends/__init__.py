"""Transports behind the ``Backend`` interface: ``mpi``, ``tcp`` and ``sim``.

Backends register themselves by name (like h5py's drivers) with what they need to start:
``register_backend(name, factory, available=..., thread_world=..., processes=...)``;
``available_backends()``, ``hpcdp.spawn`` and the conformance suite's matrix (``hpcdp.testing``)
all read the registry. A backend declares how its ranks can run (threads of one process, local
processes, or started by ``mpirun``); ``hpcdp.launch`` starts them, so nothing here imports the
launcher. The heavy libraries a backend needs are imported only when one is actually created.
"""
from __future__ import annotations

import importlib.util

from .base import (
    ANY_SOURCE, ANY_TAG, Backend, BackendEntry, Request, available_backends, backend_entry,
    backend_factory, register_backend, spawnable_backends,
)
from . import sim as _sim  # registers "sim"
from ._staging import HostStaged

__all__ = ["Backend", "Request", "register_backend", "available_backends", "backend_factory",
           "backend_entry", "BackendEntry", "spawnable_backends", "ANY_SOURCE",
           "ANY_TAG", "HostStaged"]


# The factories spell out the options each backend takes: ``hpcdp.init`` refuses any other
# (``hpcdp.comm.world.check_options``), the same way for every backend.
def _mpi_factory() -> Backend:
    from .mpi import create_world

    return create_world()


def _tcp_factory(*, connect_timeout: float | None = None) -> Backend:
    from .tcp import create_world

    return create_world(connect_timeout=connect_timeout)


def _mpi_available() -> bool:
    return importlib.util.find_spec("mpi4py") is not None


# MPI ranks are started by mpirun/srun, never by hpcdp; TCP ranks may be local processes that
# meet through the launcher's environment (hpcdp.launch starts them)
register_backend("mpi", _mpi_factory, available=_mpi_available)
register_backend("tcp", _tcp_factory, processes=True)

"""Transports behind the ``Backend`` interface: ``mpi``, ``tcp`` and ``sim``.

Backends register themselves by name (like h5py's drivers); the heavy libraries they need are
imported only when a backend is actually created.
"""
from __future__ import annotations

import importlib.util
from typing import Any

from .base import Backend, Request, available_backends, backend_factory, register_backend
from . import sim as _sim  # registers "sim"

__all__ = ["Backend", "Request", "register_backend", "available_backends", "backend_factory"]


def _mpi_factory(**options: Any) -> Backend:
    from .mpi import create_world

    return create_world(**options)


def _tcp_factory(**options: Any) -> Backend:
    from .tcp import create_world

    return create_world(**options)


register_backend("mpi", _mpi_factory)
register_backend("tcp", _tcp_factory)


def _probe_available(name: str) -> bool:
    if name == "mpi":
        return importlib.util.find_spec("mpi4py") is not None
    if name == "tcp":
        return importlib.util.find_spec("hpcdp.backends.tcp") is not None
    return True

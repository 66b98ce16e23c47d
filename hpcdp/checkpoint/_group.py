"""Which group a checkpoint call runs on, and the separate group the writes use.

``save`` runs its collectives on a private duplicate of the caller's group (made, collectively, on
the first save), so that an ``async_save`` writing from a background thread never interleaves its
messages, or its MPI-IO, with the collectives training keeps running on the caller's group.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any

from ..comm.world import get_default_group, is_initialized

__all__ = ["Solo", "resolve", "ckpt_group", "native_comm", "backend_label", "pending", "set_pending"]


class Solo:
    """A one-rank stand-in when hpcdp is not initialised (a plain ``python`` session)."""

    rank, size, name = 0, 1, "solo"
    backend = None

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast_object(self, obj: Any = None, root: int = 0) -> Any:
        return obj

    def barrier(self) -> None:
        return None


_SOLO = Solo()
_ckpt: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
_pending: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def resolve(group: Any) -> Any:
    if group is not None:
        return group
    return get_default_group() if is_initialized() else _SOLO


def native_comm(group: Any) -> Any:
    """The MPI communicator under ``group`` (``Backend.native_comm``), None for other transports."""
    be = group.backend
    return be.native_comm() if be is not None else None


def backend_label(group: Any) -> str:
    """The backend's name, for messages only (behaviour follows its capabilities)."""
    be = group.backend
    return be.name if be is not None else "solo"


def ckpt_group(group: Any) -> Any:
    """The caller's group's private duplicate (collective the first time)."""
    # one rank needs no private group, unless MPI-IO will run collectively on its communicator
    if isinstance(group, Solo) or group.size == 1 and native_comm(group) is None:
        return group
    with _lock:
        g = _ckpt.get(group)
    if g is None:
        g = group.new_group(list(range(group.size)), name=f"{group.name}.ckpt")
        with _lock:
            _ckpt[group] = g
    return g


def pending(group: Any) -> Any:
    with _lock:
        return _pending.get(group)


def set_pending(group: Any, handle: Any) -> None:
    with _lock:
        if handle is None:
            _pending.pop(group, None)
        else:
            _pending[group] = handle

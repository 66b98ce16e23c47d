"""``RemoteError``: an exception raised by the callee, re-raised on the caller.

The callee sends only text (type name, message, traceback); nothing is unpickled. For a short
list of builtin exception types the caller raises a subclass of both ``RemoteError`` and that
builtin (``except ValueError`` keeps working across RPC); the class is looked up by name in a
fixed table, never built from what the peer sent.
"""
from __future__ import annotations

import threading

from ..errors import HpcdpError

__all__ = ["RemoteError", "remote_error"]


class RemoteError(HpcdpError):
    """A remote call raised; ``remote_type`` and ``remote_traceback`` are the callee's."""

    def __init__(self, message: str, *, remote_type: str = "Exception",
                 remote_traceback: str = "") -> None:
        super().__init__(message)
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback

    def __str__(self) -> str:
        base = super().__str__()
        if self.remote_traceback:
            return f"{base}\n--- remote traceback ---\n{self.remote_traceback.rstrip()}"
        return base


_BUILTIN = {
    c.__name__: c for c in (
        ValueError, TypeError, KeyError, IndexError, LookupError, RuntimeError, AttributeError,
        ZeroDivisionError, ArithmeticError, OverflowError, FloatingPointError,
        NotImplementedError, AssertionError, TimeoutError, MemoryError, PermissionError,
        FileNotFoundError, OSError, StopIteration,
    )
}
_classes: dict[str, type[RemoteError]] = {}
_lock = threading.Lock()


def remote_error(message: str, remote_type: str, remote_traceback: str) -> RemoteError:
    """A ``RemoteError`` for ``remote_type``, also an instance of that builtin when it is one."""
    base = _BUILTIN.get(remote_type)
    if base is None:
        return RemoteError(message, remote_type=remote_type, remote_traceback=remote_traceback)
    with _lock:
        cls = _classes.get(remote_type)
        if cls is None:
            cls = type(f"Remote{remote_type}", (RemoteError, base), {"__module__": __name__})
            _classes[remote_type] = cls
    return cls(message, remote_type=remote_type, remote_traceback=remote_traceback)

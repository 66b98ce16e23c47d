"""One error hierarchy for hpcdp: every message names the operation and the rank."""
from __future__ import annotations

__all__ = [
    "HpcdpError",
    "BackendUnavailableError",
    "CommTimeoutError",
    "CollectiveMismatchError",
    "PeerFailureError",
    "AuthError",
    "ProtocolError",
    "CheckpointError",
]


class HpcdpError(RuntimeError):
    """Base of every error hpcdp raises on purpose."""


class BackendUnavailableError(HpcdpError):
    """A requested backend cannot start here (missing library, no launcher environment)."""


class CommTimeoutError(HpcdpError, TimeoutError):
    """A blocking operation did not complete before its deadline."""


class CollectiveMismatchError(HpcdpError, ValueError):
    """Ranks called different collectives (op, shape, dtype or root) at the same step."""


class PeerFailureError(HpcdpError):
    """A peer rank died, dropped its connection, or abandoned an operation."""

    def __init__(self, message: str, *, peers: list[int] | tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.peers = tuple(peers)


class AuthError(HpcdpError):
    """A network peer failed authentication."""


class ProtocolError(HpcdpError):
    """A network peer sent something that is not the hpcdp wire protocol."""


class CheckpointError(HpcdpError):
    """A checkpoint could not be written, or what was read is torn, corrupt or foreign."""

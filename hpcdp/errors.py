"""One error hierarchy for hpcdp: every message names the operation and the rank."""
from __future__ import annotations

import copy
import functools
from typing import Any, Callable, ParamSpec, TypeVar

__all__ = [
    "HpcdpError",
    "BackendUnavailableError",
    "CommTimeoutError",
    "CollectiveMismatchError",
    "PeerFailureError",
    "AuthError",
    "ProtocolError",
    "CheckpointError",
    "ConfigError",
]

P = ParamSpec("P")
R = TypeVar("R")


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


class ConfigError(ValueError):
    """An ``HPCDP_*`` environment variable holds a value its declaration (``hpcdp._config``)
    does not allow. A ``ValueError`` rather than an ``HpcdpError``: it is a bad input, found
    before any communication, and callers that catch ``HpcdpError`` to handle a failed
    operation must not swallow it. ``name``, ``raw`` and ``allowed`` say what was wrong."""

    def __init__(self, name: str, raw: str, allowed: str) -> None:
        super().__init__(f"{name}={raw!r}: expected {allowed}")
        self.name, self.raw, self.allowed = name, raw, allowed

    def __reduce__(self) -> tuple[Any, ...]:  # pickled across spawn's processes
        return (type(self), (self.name, self.raw, self.allowed))


# -- errors raised from the public call -------------------------------------------------------
# A timeout inside a collective surfaces through a dozen internal frames (group, Work, request,
# transport); a user reading one traceback per rank wants the line of *their* call. At each public
# boundary an ``HpcdpError`` is re-raised as a copy whose traceback starts at that boundary; the
# original, with every internal frame, stays reachable as the copy's ``__context__`` (printed
# only with ``HPCDP_FULL_TRACEBACK=1``). Only ``HpcdpError``s are trimmed: anything else may come
# from user code (a hook, a model) whose frames the user needs. Success costs a ``try`` only.

_HIDDEN_NOTE = ("(hpcdp hid its internal frames: the full traceback is this error's __context__; "
                "set HPCDP_FULL_TRACEBACK=1 to print it)")


def full_traceback() -> bool:
    """Whether ``HPCDP_FULL_TRACEBACK`` asks for hpcdp's internal frames to be kept (read while
    an error is being raised: a bad value reads as the default rather than hide that error)."""
    from ._config import setting  # _config imports this module for ConfigError

    return setting("HPCDP_FULL_TRACEBACK", strict=False)


def public_error(exc: BaseException, prefix: str = "") -> BaseException:
    """What a public call raises for ``exc``: a copy of the same class (message prefixed with
    ``prefix``) whose traceback will start at the ``raise``, with ``exc`` as its ``__context__``.

    Use as ``except HpcdpError as exc: raise public_error(exc)``. An error already trimmed by an
    inner public call is re-raised itself, with its traceback reset to the outer call.
    """
    full = full_traceback()
    if full and not prefix:
        return exc  # (``raise exc`` inside its own handler re-raises it as it was)
    if getattr(exc, "_hpcdp_public", False) and not prefix:
        return exc.with_traceback(None)
    try:
        new = copy.copy(exc)  # same class, args and attributes (``peers``); no traceback, no chain
        if prefix:
            new.args = (prefix + str(exc),)
    except Exception:  # noqa: BLE001 - an exception class that cannot be copied: raise it whole
        return exc
    if prefix:
        new.__dict__.pop("__notes__", None)  # the prefix changed the message; notes stay below
        for note in getattr(exc, "__notes__", ()):
            if note != _HIDDEN_NOTE:
                new.add_note(note)
    new.__cause__ = None
    new.__context__ = exc
    new.__suppress_context__ = not full
    new._hpcdp_public = True  # type: ignore[attr-defined]
    if not full and _HIDDEN_NOTE not in getattr(new, "__notes__", ()):
        new.add_note(_HIDDEN_NOTE)
    return new


def public(fn: Callable[P, R]) -> Callable[P, R]:
    """Decorate a public entry point: its ``HpcdpError``s are raised from it (``public_error``)."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except HpcdpError as exc:
            raise public_error(exc)  # noqa: B904 - the original is this error's __context__

    return call  # type: ignore[return-value]

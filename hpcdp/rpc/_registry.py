"""What a peer may name: functions and classes registered with ``@rpc.register``.

A remote call names its target by string; the callee looks that string up here and nowhere else
(no import, no attribute walk), so a peer can run only what this process chose to expose.
Registered classes can be built with ``remote()`` and their public methods called through an
RRef; registered dataclasses may also travel as values (the codec rebuilds them by calling the
class with their init fields).
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, TypeVar, overload

__all__ = ["register", "lookup", "name_of", "is_registered_class", "dataclass_name", "Entry"]

T = TypeVar("T")

_lock = threading.Lock()
_by_name: dict[str, "Entry"] = {}
_by_obj: dict[int, str] = {}


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str
    obj: Any
    is_class: bool
    is_dataclass: bool


@overload
def register(obj: T) -> T: ...
@overload
def register(obj: None = None, *, name: str | None = None) -> Callable[[T], T]: ...


def register(obj: Any = None, *, name: str | None = None) -> Any:
    """Expose a function or class to remote callers (decorator; ``@register(name="x")`` too).

    Args:
        obj: a plain function or a class (a dataclass may then also travel as a value).
        name: the name peers use; default ``obj.__qualname__``.
    """
    if obj is None:
        return lambda o: register(o, name=name)
    if not (isinstance(obj, type) or callable(obj)):
        raise TypeError(f"rpc.register: expected a function or class, got {type(obj).__name__}")
    key = name if name is not None else getattr(obj, "__qualname__", None)
    if not isinstance(key, str) or not key:
        raise TypeError(f"rpc.register: {obj!r} has no __qualname__; pass name=")
    is_class = isinstance(obj, type)
    entry = Entry(key, obj, is_class, is_class and dataclasses.is_dataclass(obj))
    with _lock:
        old = _by_name.get(key)
        if old is not None and old.obj is not obj and not _same_definition(old.obj, obj):
            raise ValueError(
                f"rpc.register: name {key!r} is already taken by "
                f"{_where(old.obj)}; cannot also register {_where(obj)} (pass name=)")
        if old is not None:
            _by_obj.pop(id(old.obj), None)
        _by_name[key] = entry
        _by_obj[id(obj)] = key
    return obj


def _where(o: Any) -> str:
    return f"{getattr(o, '__module__', '?')}.{getattr(o, '__qualname__', repr(o))}"


def _same_definition(a: Any, b: Any) -> bool:
    """A module run again (``runpy``, a re-import) defines new objects for the same names."""
    return _where(a) == _where(b)


def lookup(name: str) -> Entry | None:
    return _by_name.get(name)  # one dict read: atomic, no lock on a call's path


def name_of(obj: Any) -> str | None:
    """The registered name of ``obj`` (the very object), or None."""
    key = _by_obj.get(id(obj))
    if key is not None:
        entry = _by_name.get(key)
        if entry is not None and entry.obj is obj:
            return key
    return None


def is_registered_class(cls: type) -> bool:
    key = name_of(cls)
    return key is not None and _by_name[key].is_class


def dataclass_name(cls: type) -> str | None:
    """The registered name of a dataclass type, None if it is not registered as one."""
    key = name_of(cls)
    return key if key is not None and _by_name[key].is_dataclass else None

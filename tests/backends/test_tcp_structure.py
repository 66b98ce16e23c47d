"""The TCP backend is built by composition: its parts are members, not mixins.

``Transport`` holds its frame parser and its collective checks (``frames``, ``checks``), each
given what it uses when it is built, instead of inheriting classes that read attributes the
host is trusted to define. The only hpcdp classes a class here may extend are the interfaces it
implements (``Backend``, ``Request``) and the error hierarchy.
"""
from __future__ import annotations

import importlib
import inspect
import pkgutil

import hpcdp.backends.tcp as tcp
from hpcdp.backends.base import Backend, Request
from hpcdp.backends.tcp._coll import CollChecks
from hpcdp.backends.tcp._frames import FrameReader
from hpcdp.backends.tcp._transport import Transport


def _tcp_classes() -> list[type]:
    found = []
    for info in pkgutil.iter_modules(tcp.__path__, tcp.__name__ + "."):
        mod = importlib.import_module(info.name)
        found += [c for _, c in inspect.getmembers(mod, inspect.isclass)
                  if c.__module__ == mod.__name__]
    return found


def test_transport_inherits_nothing() -> None:
    assert Transport.__bases__ == (object,)


def test_no_tcp_class_extends_another_hpcdp_class() -> None:
    classes = _tcp_classes()
    assert Transport in classes and FrameReader in classes and CollChecks in classes
    bad = [f"{c.__module__}.{c.__qualname__}({b.__module__}.{b.__qualname__})"
           for c in classes for b in c.__bases__
           if b.__module__.split(".")[0] == "hpcdp"
           and not issubclass(c, (Backend, Request, BaseException))]
    assert not bad, bad


def test_transport_holds_its_parts() -> None:
    t = Transport(0, 2, 1 << 20)
    assert isinstance(t.frames, FrameReader) and isinstance(t.checks, CollChecks)
    # the parts share the transport's queues and lock, and the reader sees the checks' state
    assert t.frames.posted is t.posted and t.frames.unexpected is t.unexpected
    assert t.frames.lock is t.lock and t.checks.lock is t.lock
    assert t.checks.unexpected is t.unexpected and t.checks.dead is t.dead
    assert t.frames.unposted_caps is t.unposted_caps
    assert t.frames._mismatched is t.checks.mismatched

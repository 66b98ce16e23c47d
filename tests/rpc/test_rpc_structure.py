"""How ``hpcdp.rpc`` is put together: the agent holds its parts, it does not inherit them.

Mixins that use their host's attributes without declaring them (``self.pool`` in a class that
never sets it) hide what each part depends on; the agent's parts are components given the
agent in their constructors instead (STYLE.md point 2, issue 22 item 5).
"""
from __future__ import annotations

import importlib
import inspect
import os
import pkgutil

import hpcdp.rpc


def _rpc_classes() -> list[type]:
    """Every class defined in a module of ``hpcdp.rpc``."""
    out = []
    for info in pkgutil.iter_modules([os.path.dirname(hpcdp.rpc.__file__)]):
        mod = importlib.import_module(f"hpcdp.rpc.{info.name}")
        out += [c for _, c in inspect.getmembers(mod, inspect.isclass)
                if c.__module__ == mod.__name__]
    return out


def test_agent_has_no_base_class_but_object() -> None:
    from hpcdp.rpc._agent import Agent

    assert Agent.__bases__ == (object,), \
        f"Agent inherits {[b.__qualname__ for b in Agent.__bases__]}: hold them as components"


def test_no_rpc_class_inherits_from_another_hpcdp_class() -> None:
    """Exceptions aside (one error hierarchy), a class of ``hpcdp.rpc`` that needs another's
    behaviour holds an instance of it."""
    classes = _rpc_classes()
    assert len(classes) >= 10, [c.__qualname__ for c in classes]  # the walk found the modules
    bad = [f"{c.__module__}.{c.__qualname__}({b.__module__}.{b.__qualname__})"
           for c in classes for b in c.__mro__[1:]
           if b.__module__.split(".")[0] == "hpcdp" and not issubclass(b, BaseException)]
    assert not bad, bad

"""The layers stay layered: the transports and the modules under them (``backends``,
``_arrays``, ``errors``, ``ops``, ``_config``, ``_atomic``, ``_validate``) never import the
layers built on them, not even lazily."""
from __future__ import annotations

import ast
import os

import hpcdp

PKG = os.path.dirname(os.path.abspath(hpcdp.__file__))
LOWER = ("backends", "_arrays", "errors", "ops", "_config", "_atomic", "_validate")
UPPER = ("ddp", "fsdp", "pipeline", "rpc", "checkpoint", "trace", "nn", "optim", "bench")


def _unit(path: str) -> str:
    rel = os.path.relpath(path, PKG).split(os.sep)
    return rel[0][:-3] if len(rel) == 1 else rel[0]


def _imported_units(path: str) -> set[str]:
    """The hpcdp units (subpackage or top-level module) that ``path`` imports."""
    rel = os.path.relpath(path, os.path.dirname(PKG))[:-3].split(os.sep)
    pkg = rel[:-1]  # the package a relative import starts from (also for __init__)
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), path)
    out: set[str] = set()
    for node in ast.walk(tree):
        names: list[list[str]] = []
        if isinstance(node, ast.Import):
            names = [a.name.split(".") for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = pkg[: len(pkg) - node.level + 1] if node.level else []
            mod = base + (node.module.split(".") if node.module else [])
            names = [mod + [a.name] for a in node.names] if len(mod) == 1 else [mod]
        for n in names:
            if n[0] == "hpcdp" and len(n) > 1:
                out.add(n[1])
    return out


def test_lower_layers_never_import_upper_ones() -> None:
    bad = []
    for root, _, files in os.walk(PKG):
        for f in files:
            path = os.path.join(root, f)
            if f.endswith(".py") and _unit(path) in LOWER:
                up = sorted(_imported_units(path) & set(UPPER))
                if up:
                    bad.append(f"{os.path.relpath(path, PKG)} imports {up}")
    assert not bad, "\n".join(bad)


def test_the_scan_sees_relative_and_absolute_imports() -> None:
    here = os.path.join(PKG, "backends", "tcp", "_wire.py")
    assert "errors" in _imported_units(here)       # from ...errors import ...
    assert _imported_units(os.path.join(PKG, "rpc", "_transport_tcp.py")) >= {"backends", "errors"}

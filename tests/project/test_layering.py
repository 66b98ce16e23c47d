"""The layers stay layered: every module of hpcdp imports only its own layer and those below it,
no import cycle spans two folders, and no module imports another package's private names.

The order is declared once, here (``LAYERS``), lowest first; a unit is a folder under ``hpcdp/``
or a top-level module. Imports inside functions count like any other: hiding one there does not
make an upward dependency go away.
"""
from __future__ import annotations

import ast
import os
import shutil
from typing import Iterator

import pytest

import hpcdp
from conftest import parse_source  # noqa: E402

PKG = os.path.dirname(os.path.abspath(hpcdp.__file__))

#: lowest first. Why this order:
#: - foundation: no hpcdp imports beyond each other (errors, reduce ops, array helpers, settings,
#:   safe file writes, the version);
#: - backends: the transports, under everything that communicates;
#: - trace: recording, timelines, dumps and offline analysis. It never communicates, so it sits
#:   under comm, which records into it; what must communicate (the straggler report, finalize)
#:   lives in comm and reaches trace through hooks (``trace.hooks.on_step``, ``record_finalize``);
#: - comm: groups, collectives, point-to-point, Work, the world, debug checks, stragglers;
#: - the building blocks that take a group (nn, optim, data, progress), then the parallel
#:   wrappers and services built on them (ddp, fsdp, pipeline, rpc, checkpoint);
#: - launch: every way ranks start (it runs hpcdp.init, trace dumps, the logger);
#: - the top package (``__init__``, ``run``, ``__main__``) gathers everything; ``torch_backend``
#:   (torch.distributed's "hpcdp" backend) sits beside it, serving torch from hpcdp's groups;
#: - testing and bench drive the whole package from above.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "ops", "_arrays", "_tensors", "_config", "_atomic", "_version"),
    ("backends",),
    ("trace",),
    ("comm",),
    ("nn", "optim", "data", "progress"),
    ("ddp", "fsdp", "pipeline", "rpc", "checkpoint"),
    ("launch",),
    ("__init__", "run", "__main__", "torch_backend"),
    ("testing", "bench"),
)
RANK = {unit: i for i, units in enumerate(LAYERS) for unit in units}

#: private imports tolerated, as (importing file, imported module) (none: each needs a reason)
PRIVATE_ALLOWED: frozenset[tuple[str, str]] = frozenset()
#: upward imports tolerated (none: an entry here needs a reason next to it)
UPWARD_ALLOWED: frozenset[tuple[str, str]] = frozenset()


def _modules(root: str) -> Iterator[tuple[str, list[str]]]:
    """(path, dotted module name as a list) of every module under the package at ``root``."""
    base = os.path.dirname(root)
    for d, _, files in os.walk(root):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(d, f)
                yield path, os.path.relpath(path, base)[:-3].split(os.sep)


def _is_module(root: str, parts: list[str]) -> bool:
    """Whether ``hpcdp.<parts[1:]>`` is a module or package under ``root``."""
    p = os.path.join(os.path.dirname(root), *parts)
    return os.path.isdir(p) or os.path.isfile(p + ".py")


#: file text -> its import statements (see ``_import_nodes``)
_PARSED: dict[str, tuple[ast.Import | ast.ImportFrom, ...]] = {}


def _import_nodes(text: str, path: str) -> tuple[ast.Import | ast.ImportFrom, ...]:
    """Every import statement of a file's ``text``, at any depth. Kept by the text itself: the
    scans read the same files many times (a planted copy differs only in its planted file), and
    the same text always parses to the same imports."""
    if text not in _PARSED:
        _PARSED[text] = tuple(n for n in ast.walk(parse_source(text, path))
                              if isinstance(n, (ast.Import, ast.ImportFrom)))
    return _PARSED[text]


def _imports(root: str, path: str, mod: list[str]) -> Iterator[tuple[list[str], str | None, int]]:
    """(imported module, imported name or None, line) for every hpcdp import in ``path``,
    at any depth (inside functions too); ``from X import Y`` names module ``X.Y`` when Y is one."""
    pkg = mod[:-1] if mod[-1] != "__init__" else mod[:-1]
    with open(path, encoding="utf-8") as fh:
        nodes = _import_nodes(fh.read(), path)
    for node in nodes:
        if isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "hpcdp":
                    yield parts, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = pkg[: len(pkg) - node.level + 1] if node.level else []
            target = base + (node.module.split(".") if node.module else [])
            if not target or target[0] != "hpcdp":
                continue
            for a in node.names:
                if _is_module(root, target + [a.name]):
                    yield target + [a.name], None, node.lineno
                else:
                    yield target, a.name, node.lineno


def _unit(parts: list[str]) -> str:
    """The layer unit of module ``parts`` (``hpcdp`` itself: ``__init__``)."""
    if len(parts) == 1 or parts[1] == "__init__":
        return "__init__"
    return parts[1]


def _rel(root: str, path: str) -> str:
    return os.path.relpath(path, root).replace(os.sep, "/")


def upward_imports(root: str = PKG) -> list[str]:
    """Every import of a higher layer, and every unit missing from ``LAYERS``."""
    bad = []
    for path, mod in _modules(root):
        me = _unit(mod)
        if me not in RANK:
            bad.append(f"{_rel(root, path)}: unit {me!r} is in no layer (add it to LAYERS)")
            continue
        for target, _, line in _imports(root, path, mod):
            them = _unit(target)
            if them not in RANK:
                bad.append(f"{_rel(root, path)}:{line}: imports {'.'.join(target)}, in no layer")
            elif RANK[them] > RANK[me] and (_rel(root, path), ".".join(target)) not in UPWARD_ALLOWED:
                bad.append(f"{_rel(root, path)}:{line}: {me} imports {'.'.join(target)} "
                           f"({them}, a higher layer)")
    return bad


def cross_folder_cycles(root: str = PKG) -> list[list[str]]:
    """Strongly connected groups of modules (by their imports) that span two folders."""
    mods = {".".join(m): (p, m) for p, m in _modules(root)}
    edges: dict[str, set[str]] = {}
    for name, (path, mod) in mods.items():
        outs = set()
        for target, _, _ in _imports(root, path, mod):
            for cand in (".".join(target), ".".join(target + ["__init__"])):
                if cand in mods and cand != name:
                    outs.add(cand)
        edges[name] = outs
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len({os.path.dirname(mods[c][0]) for c in comp}) > 1:
                out.append(sorted(comp))

    for v in mods:
        if v not in index:
            visit(v)
    return out


def _private_owner(target: list[str], name: str | None, root: str) -> list[str] | None:
    """The package a private module or name in this import belongs to (None: nothing private).

    ``hpcdp.a._b`` belongs to ``hpcdp.a``; a private ``_n`` of module ``hpcdp.a.m`` to ``hpcdp.a``
    (of package ``hpcdp.a``: to ``hpcdp.a``). The foundation's ``hpcdp._config`` belongs to
    ``hpcdp``, so every subpackage may use it."""
    for i, part in enumerate(target):
        if part.startswith("_") and not part.startswith("__"):
            return target[:i]
    if name is not None and name.startswith("_") and not name.startswith("__"):
        is_pkg = os.path.isdir(os.path.join(os.path.dirname(root), *target))
        return target if is_pkg else target[:-1]
    return None


def private_imports(root: str = PKG) -> list[str]:
    """Every import of another package's private module or name."""
    bad = []
    for path, mod in _modules(root):
        for target, name, line in _imports(root, path, mod):
            owner = _private_owner(target, name, root)
            if owner is None or mod[: len(owner)] == owner:
                continue
            if (_rel(root, path), ".".join(target)) in PRIVATE_ALLOWED:
                continue
            what = ".".join(target) + (f" import {name}" if name else "")
            bad.append(f"{_rel(root, path)}:{line}: {what} (private to {'.'.join(owner)})")
    return bad


def test_every_module_imports_only_its_layer_and_below() -> None:
    bad = upward_imports()
    assert not bad, "\n".join(bad)


def test_no_import_cycle_spans_two_folders() -> None:
    cycles = cross_folder_cycles()
    assert not cycles, "\n".join(" <-> ".join(c) for c in cycles)


def test_no_module_imports_another_packages_private_names() -> None:
    bad = private_imports()
    assert not bad, "\n".join(bad)


def test_the_allowlists_name_only_imports_that_exist() -> None:
    """An allowlist entry whose import is gone must go too (the lists only shrink)."""
    seen = {(_rel(PKG, p), ".".join(t)) for p, m in _modules(PKG) for t, _, _ in _imports(PKG, p, m)}
    assert PRIVATE_ALLOWED <= seen, sorted(PRIVATE_ALLOWED - seen)
    assert UPWARD_ALLOWED <= seen, sorted(UPWARD_ALLOWED - seen)


@pytest.fixture
def pkg_copy(tmp_path) -> str:
    root = str(tmp_path / "hpcdp")
    shutil.copytree(PKG, root, ignore=shutil.ignore_patterns("__pycache__"))
    assert upward_imports(root) == [] and cross_folder_cycles(root) == []
    assert private_imports(root) == []
    return root


def _plant(root: str, rel: str, text: str) -> None:
    with open(os.path.join(root, rel), "a", encoding="utf-8") as fh:
        fh.write(text)


def test_a_planted_upward_import_is_caught(pkg_copy: str) -> None:
    _plant(pkg_copy, "backends/sim.py", "\nfrom ..launch import spawn as _planted\n")
    bad = upward_imports(pkg_copy)
    assert len(bad) == 1 and bad[0].startswith("backends/sim.py:") and "hpcdp.launch" in bad[0], bad


def test_a_planted_import_inside_a_function_is_caught(pkg_copy: str) -> None:
    _plant(pkg_copy, "trace/_merge.py",
           "\n\ndef _planted():\n    import hpcdp.comm.world\n    return hpcdp.comm.world\n")
    bad = upward_imports(pkg_copy)
    assert len(bad) == 1 and bad[0].startswith("trace/_merge.py:") and "comm" in bad[0], bad
    # and it closes a cycle across folders (comm imports trace)
    assert any("hpcdp.trace._merge" in c and "hpcdp.comm.world" in c
               for c in cross_folder_cycles(pkg_copy))


def test_a_planted_import_of_the_top_package_is_caught(pkg_copy: str) -> None:
    _plant(pkg_copy, "checkpoint/_group.py", "\n\ndef _planted():\n    import hpcdp\n")
    bad = upward_imports(pkg_copy)
    assert len(bad) == 1 and "checkpoint/_group.py" in bad[0] and "__init__" in bad[0], bad


def test_a_planted_private_import_is_caught(pkg_copy: str) -> None:
    _plant(pkg_copy, "ddp/_buckets.py", "\nfrom ..trace._recorder import Recorder as _planted\n")
    _plant(pkg_copy, "comm/p2p.py", "\nfrom ..trace._chrome import _State as _also\n")
    bad = private_imports(pkg_copy)
    assert len(bad) == 2, bad
    assert any(b.startswith("ddp/_buckets.py:") and "private to hpcdp.trace" in b for b in bad)
    assert any(b.startswith("comm/p2p.py:") and "_chrome" in b for b in bad)


def test_a_folder_in_no_layer_is_caught(pkg_copy: str) -> None:
    os.makedirs(os.path.join(pkg_copy, "newlayer"))
    _plant(pkg_copy, "newlayer/__init__.py", "")
    assert any("'newlayer' is in no layer" in b for b in upward_imports(pkg_copy))


def test_the_scan_sees_relative_and_absolute_imports() -> None:
    here = os.path.join(PKG, "backends", "tcp", "_wire.py")
    units = {_unit(t) for t, _, _ in _imports(PKG, here, ["hpcdp", "backends", "tcp", "_wire"])}
    assert "errors" in units       # from ...errors import ...
    world = os.path.join(PKG, "comm", "world.py")
    targets = {".".join(t) for t, _, _ in _imports(PKG, world, ["hpcdp", "comm", "world"])}
    assert "hpcdp.trace" in targets and "hpcdp.trace.hooks" in targets  # from .. import trace


def test_trace_exports_what_users_call() -> None:
    """``hpcdp.trace`` is the user's surface; the recording hooks are in ``trace.hooks`` and the
    straggler report, which communicates, in ``comm`` (and at the top, ``hpcdp.report_stragglers``)."""
    from hpcdp import trace
    from hpcdp.trace import hooks

    assert len(trace.__all__) < 38
    assert not hasattr(trace, "report_stragglers") and not hasattr(trace, "gather_arrivals")
    for name in ("install", "on_error", "active_recorder", "state", "mark_finished", "hide_frames",
                 "report_stragglers", "gather_arrivals", "StragglerReport", "StragglerReporter"):
        assert name not in trace.__all__, name
    for name in hooks.__all__:
        assert getattr(hooks, name) is not None
    assert hpcdp.report_stragglers is hpcdp.comm.stragglers.report_stragglers

"""Every ``HPCDP_*`` environment variable hpcdp reads is in README.md's "## Environment variables"
table (issue 21, item 15), unless ``hpcdp/_config.py`` declares it an internal switch (issue 22).

The reads are found in the source with ``ast``, not listed by hand: a string constant starting with
``HPCDP_`` used as the key of ``os.environ.get`` / ``os.getenv`` / ``environ[...]`` / ``... in
os.environ`` (also on a mapping named ``env...``), bound by a loop over a literal tuple whose items
are such keys, or passed to an env-parsing helper: any function of hpcdp that reads the
environment with a key it was given (``_config.setting`` and ``_config.raw`` today), found the
same way, so a new helper needs no edit here. Writes (``env["HPCDP_X"] = ...``,
``dict(..., HPCDP_X=...)``) and mentions in docstrings are not reads. ``direct_reads`` (used by
tests/project/test_config.py) is the same scan, keeping only reads that bypass ``hpcdp/_config.py``.
"""
from __future__ import annotations

import ast
import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

from hpcdp import _config
from conftest import parse_source  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent.parent

#: variables hpcdp reads that are not user settings, each with why it stays out of the README
#: (declared in hpcdp/_config.py as internal: tests' and benchmarks' switches)
INTERNAL = {s.name: s.meaning for s in _config.internal_switches()}


def _is_environ(node: ast.AST) -> bool:
    """``os.environ``, ``environ``, or a mapping whose name says it is an environment (``env``)."""
    if isinstance(node, ast.Attribute):
        return node.attr == "environ"
    return isinstance(node, ast.Name) and "env" in node.id.lower()


def _read_key(node: ast.AST) -> ast.AST | None:
    """The key expression when ``node`` reads the environment, else None."""
    if isinstance(node, ast.Call) and node.args:
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr == "get" and _is_environ(f.value):
            return node.args[0]
        if (isinstance(f, ast.Attribute) and f.attr == "getenv") or (isinstance(f, ast.Name) and f.id == "getenv"):
            return node.args[0]
    if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
        return node.slice
    if (isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.In, ast.NotIn))
            and _is_environ(node.comparators[0])):
        return node.left
    return None


def _hpcdp_constants(nodes: Iterable[ast.AST]) -> list[str]:
    return [n.value for n in nodes
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.startswith("HPCDP_")]


def _helpers(tree: ast.Module) -> set[str]:
    """Functions of ``tree`` that read the environment with a key that is not a constant (their
    argument)."""
    out: set[str] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            params = {a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)}
            params |= {a.arg for a in (fn.args.vararg, fn.args.kwarg) if a is not None}
            for node in ast.walk(fn):
                key = _read_key(node)
                if key is not None and not isinstance(key, ast.Constant) and (
                        {n.id for n in ast.walk(key) if isinstance(n, ast.Name)} & params
                        or _loop_bound(fn, key, params)):
                    out.add(fn.name)
    return out


def _loop_bound(scope: ast.AST, key: ast.AST, over: set[str]) -> bool:
    """Whether ``key`` is a loop variable of a ``for`` over one of ``over`` (``for n in names``)."""
    if not isinstance(key, ast.Name):
        return False
    return any(isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.target, ast.Name)
               and node.target.id == key.id and isinstance(node.iter, ast.Name) and node.iter.id in over
               for node in ast.walk(scope))


def _literal_loop_keys(tree: ast.AST, key: ast.Name) -> list[str]:
    """``HPCDP_*`` items of literal tuples/lists a loop binds ``key`` to (``for k in ("HPCDP_A", ...)``)."""
    out: list[str] = []
    for node in ast.walk(tree):
        pairs = [(node.target, node.iter)] if isinstance(node, (ast.For, ast.comprehension)) else []
        for target, it in pairs:
            if isinstance(target, ast.Name) and target.id == key.id and isinstance(it, (ast.Tuple, ast.List)):
                out += _hpcdp_constants(it.elts)
    return out


class _Scan(NamedTuple):
    """What one file's text says, helpers aside: the helpers it defines, and its candidate reads
    in ``ast.walk`` order as (called function's name or None for a direct read, HPCDP_* keys, line).
    A call counts as a read only where its function is a helper of the package scanned."""
    helpers: frozenset[str]
    reads: tuple[tuple[str | None, tuple[str, ...], int], ...]


#: file text -> its scan: the tests scan the same files many times (each planted copy differs in
#: one file), and the same text always scans the same
_SCANS: dict[str, _Scan] = {}


def _scan(path: Path) -> _Scan:
    text = path.read_text()
    if text in _SCANS:
        return _SCANS[text]
    tree = parse_source(text, str(path))
    reads: list[tuple[str | None, tuple[str, ...], int]] = []
    for node in ast.walk(tree):
        key = _read_key(node)
        if key is not None:
            names = _hpcdp_constants([key])
            if isinstance(key, ast.Name):
                names += _literal_loop_keys(tree, key)
            reads.append((None, tuple(names), node.lineno))
        elif isinstance(node, ast.Call):
            f = node.func
            fname = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            names = _hpcdp_constants([*node.args, *(k.value for k in node.keywords)])
            if names:
                reads.append((fname, tuple(names), node.lineno))
    _SCANS[text] = _Scan(frozenset(_helpers(tree)), tuple(reads))
    return _SCANS[text]


def env_reads(package: Path, *, bypassing: Path | None = None) -> dict[str, list[str]]:
    """``HPCDP_*`` variable -> ``file:line`` of every place under ``package`` that reads it.

    ``bypassing``: only the reads that do not go through that module (``hpcdp/_config.py``):
    its own reads and calls of the helpers it defines are left out; a helper defined anywhere
    else counts, even one with the same name as a function of that module."""
    scans = {p: _scan(p) for p in sorted(package.rglob("*.py"))}
    if bypassing is not None:
        scans.pop(bypassing, None)
    helpers = set().union(*(sc.helpers for sc in scans.values()))
    reads: dict[str, list[str]] = {}
    for path, sc in scans.items():
        where = f"{path.relative_to(package.parent)}"
        for fname, names, line in sc.reads:
            if fname is None or fname in helpers:
                for name in names:
                    reads.setdefault(name, []).append(f"{where}:{line}")
    return reads


def direct_reads(package: Path) -> dict[str, list[str]]:
    """Reads of ``HPCDP_*`` variables under ``package`` that bypass its ``_config.py``."""
    return env_reads(package, bypassing=package / "_config.py")


def documented(readme: str) -> set[str]:
    """``HPCDP_*`` names in the rows of the README's "## Environment variables" table."""
    m = re.search(r"^## Environment variables\n(.*?)(?=^## |\Z)", readme, re.M | re.S)
    assert m, 'README.md has no "## Environment variables" section'
    rows = [ln for ln in m.group(1).splitlines() if ln.startswith("|")]
    return {v for row in rows for v in re.findall(r"HPCDP_[A-Z0-9_]*[A-Z0-9]", row)}


def undocumented(package: Path, readme: str) -> dict[str, list[str]]:
    docs = documented(readme)
    return {k: v for k, v in sorted(env_reads(package).items()) if k not in docs and k not in INTERNAL}


def test_every_read_variable_is_documented() -> None:
    missing = undocumented(ROOT / "hpcdp", (ROOT / "README.md").read_text())
    assert not missing, ("HPCDP_* variables read but not in README.md's environment table (add a row, "
                         "or to INTERNAL with a reason if no user should set it): "
                         + "; ".join(f"{k} ({', '.join(v)})" for k, v in missing.items()))


def test_internal_switches_are_still_read_and_not_user_settings() -> None:
    reads = env_reads(ROOT / "hpcdp")
    stale = sorted(set(INTERNAL) - set(reads))
    assert not stale, f"INTERNAL lists variables hpcdp no longer reads: {stale}"
    both = sorted(set(INTERNAL) & documented((ROOT / "README.md").read_text()))
    assert not both, f"INTERNAL variables also in the README's table: {both}"


def test_the_scan_sees_every_known_form_of_read() -> None:
    """The forms in hpcdp today, each found: a direct get, a helper, a two-name helper, a loop."""
    reads = env_reads(ROOT / "hpcdp")
    for name in ("HPCDP_TIMEOUT",            # setting(name)
                 "HPCDP_TRACE_LINES",        # setting(name) at import
                 "HPCDP_RPC_MAX_DEPTH",      # setting(name) in a lambda
                 "HPCDP_WORLD_SIZE",         # os.environ.get("WORLD_SIZE") or setting(name)
                 "HPCDP_CUDA_AWARE",         # raw(name), for display
                 "HPCDP_RESTART_COUNT"):     # setting(name) beside a Slurm variable
        assert name in reads, (name, sorted(reads))
    assert not set(reads) - set(_config.SETTINGS), sorted(set(reads) - set(_config.SETTINGS))


def test_a_planted_undocumented_read_is_caught(tmp_path: Path) -> None:
    """A copy of hpcdp/ with reads of new variables added in every form fails the check, naming
    each and where it is read; writes and docstrings in the same file are not reported."""
    pkg = tmp_path / "hpcdp"
    shutil.copytree(ROOT / "hpcdp", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    readme = (ROOT / "README.md").read_text()
    before = undocumented(pkg, readme)  # empty once the first test passes; this one stands alone
    plant(pkg / "comm" / "group.py")
    missing = {k: v for k, v in undocumented(pkg, readme).items() if k not in before}
    assert sorted(missing) == PLANTED, missing
    assert all(v and v[0].startswith(os.path.join("hpcdp", "comm", "group.py") + ":") for v in missing.values()), missing
    # documenting one in the table clears it
    readme2 = readme.replace("| `HPCDP_TIMEOUT` |", "| `HPCDP_PLANTED_GET` | planted |\n| `HPCDP_TIMEOUT` |", 1)
    assert "HPCDP_PLANTED_GET" not in undocumented(pkg, readme2)


#: the variables ``plant`` reads, one per form of read
PLANTED = sorted(f"HPCDP_PLANTED_{s}" for s in ("GET", "GETENV", "SUBSCRIPT", "IN", "TRUTHY", "ENV_INT", "LOOP"))


def plant(target: Path) -> None:
    """Append to ``target`` reads of ``PLANTED`` in every form (two through helpers of its own,
    as the parsers before hpcdp/_config.py were), beside writes and a docstring mention."""
    target.write_text(target.read_text() + '''

import os as _planted_os


def _truthy(name):
    return _planted_os.environ.get(name, "").strip().lower() in ("1", "true")


def _env_int(name, default):
    raw = _planted_os.environ.get(name, "")
    return int(raw) if raw else default


def _planted() -> object:
    """HPCDP_PLANTED_DOCSTRING is only mentioned here."""
    os = _planted_os
    env = dict(os.environ, HPCDP_PLANTED_KEYWORD_WRITE="1")
    env["HPCDP_PLANTED_WRITE"] = "1"
    return (os.environ.get("HPCDP_PLANTED_GET"), os.getenv("HPCDP_PLANTED_GETENV"),
            os.environ["HPCDP_PLANTED_SUBSCRIPT"], "HPCDP_PLANTED_IN" in os.environ,
            _truthy("HPCDP_PLANTED_TRUTHY"), _env_int("HPCDP_PLANTED_ENV_INT", 1),
            [os.environ.get(k) for k in ("HPCDP_PLANTED_LOOP", "OTHER")])
''')

"""``--help`` / ``--version`` of ``python -m hpcdp`` and ``python -m hpcdp.bench`` (issue 21, item 13).

Each command runs in a subprocess, as a user types it; what its help must mention comes from the
parser's own actions, so an option added later without help text, or left out of the help, fails
here rather than being listed by hand.
"""
from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
from typing import Any
from unittest import mock

import pytest

import hpcdp
import hpcdp.__main__ as top
import hpcdp.bench.__main__ as bench_main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: modules whose argument parser another owner keeps: checked for exit 0 and every option listed,
#: not for help text on every option
_HELP_TEXT_EXEMPT = {"gpu"}


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, COLUMNS="100")
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=180,
                          cwd=ROOT, env=env, stdin=subprocess.DEVNULL)


class _Captured(Exception):
    pass


def _parser_of(name: str) -> argparse.ArgumentParser:
    """The benchmark's parser: ``parser()`` where the module has one, else the one its ``main``
    builds (caught at ``parse_args``, before anything runs)."""
    mod = importlib.import_module(f"hpcdp.bench.{name}")
    if hasattr(mod, "parser"):
        return mod.parser()
    seen: list[argparse.ArgumentParser] = []

    def grab(self: argparse.ArgumentParser, *a: Any, **k: Any) -> Any:
        seen.append(self)
        raise _Captured

    with mock.patch.object(argparse.ArgumentParser, "parse_args", grab), pytest.raises(_Captured):
        mod.main([])
    return seen[0]


def _mentions(parser: argparse.ArgumentParser) -> list[str]:
    """Every string a complete help of ``parser`` shows: option strings, positionals, choices."""
    out: list[str] = []
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            out += list(a.choices)
            continue
        out += list(a.option_strings) or [a.metavar or a.dest]
        if a.choices is not None and a.metavar is None:
            out.append("{" + ",".join(map(str, a.choices)) + "}")
    return out


def _undocumented(parser: argparse.ArgumentParser) -> list[str]:
    return [a.option_strings[0] if a.option_strings else a.dest for a in parser._actions
            if not isinstance(a, (argparse._HelpAction, argparse._VersionAction)) and not a.help]


def _check_help(cmd: list[str], parser: argparse.ArgumentParser, *, help_text: bool = True) -> str:
    p = _run(*cmd, "--help")
    assert p.returncode == 0, (cmd, p.returncode, p.stdout, p.stderr)
    assert p.stdout.startswith("usage: "), (cmd, p.stdout, p.stderr)
    missing = [m for m in _mentions(parser) if m not in p.stdout]
    assert not missing, f"{' '.join(cmd)} --help omits {missing}:\n{p.stdout}"
    if help_text:
        assert not _undocumented(parser), f"{' '.join(cmd)}: options without help: {_undocumented(parser)}"
    return p.stdout


def test_hpcdp_help_lists_every_option() -> None:
    out = _check_help(["hpcdp"], top._parser())
    assert "info" in out and "--version" in out


def test_hpcdp_info_help() -> None:
    sub = next(a for a in top._parser()._actions if isinstance(a, argparse._SubParsersAction))
    _check_help(["hpcdp", "info"], sub.choices["info"])


def test_hpcdp_version() -> None:
    p = _run("hpcdp", "--version")
    assert p.returncode == 0, (p.stdout, p.stderr)
    assert p.stdout.strip() == f"hpcdp {hpcdp.__version__}", p.stdout


def test_hpcdp_info_keeps_its_output() -> None:
    p = _run("hpcdp", "info")
    assert p.returncode == 0, p.stderr
    first = p.stdout.splitlines()[0]
    assert first.split(":", 1)[0].strip() == "hpcdp" and first.split(":", 1)[1].strip() == hpcdp.__version__
    keys = [line.split(" : ", 1)[0].strip() for line in p.stdout.splitlines()]
    assert keys[:len(top.info())] == list(top.info()), keys  # every row, in the same order


@pytest.mark.parametrize("cmd", [["hpcdp"], ["hpcdp.bench"]])
def test_unknown_subcommand_exits_2_naming_it(cmd: list[str]) -> None:
    p = _run(*cmd, "no-such-command")
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert "invalid choice: 'no-such-command'" in p.stderr, p.stderr
    assert "info" in p.stderr if cmd == ["hpcdp"] else "collectives" in p.stderr, p.stderr


def test_bench_help_lists_every_benchmark_with_its_description() -> None:
    p = _run("hpcdp.bench", "--help")
    assert p.returncode == 0, (p.stdout, p.stderr)
    assert p.stderr == "", p.stderr
    names = bench_main.benchmarks()
    assert {"collectives", "ddp", "fsdp", "pipeline", "gpu"} <= set(names), names
    for name in names:
        desc = bench_main.description(name)
        assert desc, f"benchmark {name} has no description"
        line = next((ln for ln in p.stdout.splitlines() if ln.strip().startswith(name + " ")), None)
        assert line is not None, f"{name} not listed:\n{p.stdout}"
        assert desc.split()[0] in line, (name, line)


@pytest.mark.parametrize("name", bench_main.benchmarks())
def test_bench_subcommand_help_lists_every_option(name: str) -> None:
    out = _check_help(["hpcdp.bench", name], _parser_of(name), help_text=name not in _HELP_TEXT_EXEMPT)
    assert f"python -m hpcdp.bench {name}" in out.splitlines()[0], out


def test_collectives_backend_is_a_documented_option() -> None:
    from hpcdp.bench import collectives, sim, tcp

    out = _check_help(["hpcdp.bench", "collectives"], collectives.parser())
    assert "--backend {mpi,tcp,sim}" in out, out
    for backend, mod in (("tcp", tcp), ("sim", sim)):
        p = _run("hpcdp.bench", "collectives", "--backend", backend, "--help")
        assert p.returncode == 0, (backend, p.stdout, p.stderr)
        assert f"python -m hpcdp.bench collectives --backend {backend}" in p.stdout.splitlines()[0]
        missing = [m for m in _mentions(mod.parser()) if m not in p.stdout]
        assert not missing, (backend, missing, p.stdout)


def test_collectives_rejects_unknown_backend_and_options() -> None:
    p = _run("hpcdp.bench", "collectives", "--backend", "nccl")
    assert p.returncode == 2 and "invalid choice: 'nccl'" in p.stderr, (p.stdout, p.stderr)
    # the TCP benchmark once ignored what it did not know (parse_known_args) and ran anyway
    p = _run("hpcdp.bench", "collectives", "--backend", "tcp", "--no-such-option")
    assert p.returncode == 2 and "--no-such-option" in p.stderr, (p.stdout, p.stderr)

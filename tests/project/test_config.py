"""One config module (issue 22, item 3): every ``HPCDP_*`` variable is declared once in
``hpcdp/_config.py``, parsed by ``setting`` with one error type, listed by ``python -m hpcdp
info``, and no module reads one any other way.

What is checked: each type's parsing (good values, bad values raising ``ConfigError`` that names
the variable, the value and what is allowed); that every declaration is complete; that the
README's table and the job scripts agree with the declarations; that ``info`` shows each user
setting's value and source; and that an ``ast`` scan finds no read bypassing ``_config`` (and
does find one planted in a copy of the package).
"""
from __future__ import annotations

import ast
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hpcdp import _config
from hpcdp._config import INTERNAL, JOBS, LAUNCHER, SETTINGS, USER, ConfigError, setting
from hpcdp.errors import ConfigError as ErrorsConfigError
from test_env_documented import PLANTED, direct_reads, documented, plant
from conftest import parse_source  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent.parent


def _bad(monkeypatch: pytest.MonkeyPatch, name: str, raw: str, *allowed: str) -> ConfigError:
    monkeypatch.setenv(name, raw)
    with pytest.raises(ConfigError) as info:
        setting(name)
    msg = str(info.value)
    assert msg.startswith(f"{name}={raw!r}: expected "), msg
    for word in allowed:
        assert word in msg, (word, msg)
    assert (info.value.name, info.value.raw) == (name, raw)
    return info.value


# -- parsing, one type at a time ------------------------------------------------------------------

def test_one_error_type_a_value_error() -> None:
    assert ConfigError is ErrorsConfigError and issubclass(ConfigError, ValueError)
    err = ConfigError("HPCDP_X", "y", "a z")
    import pickle

    back = pickle.loads(pickle.dumps(err))
    assert str(back) == str(err) == "HPCDP_X='y': expected a z" and back.allowed == "a z"


def test_unset_and_empty_read_as_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, decl in SETTINGS.items():
        monkeypatch.delenv(name, raising=False)
        assert setting(name) == decl.default, name
        assert _config.source(name) == "default" and _config.raw(name) is None
        monkeypatch.setenv(name, "")
        assert setting(name) == decl.default, name
        if decl.kind != "str":
            monkeypatch.setenv(name, "   ")
            assert setting(name) == decl.default, name


def test_int(monkeypatch: pytest.MonkeyPatch) -> None:
    for raw, want in (("0", 0), ("17", 17), (" 25 ", 25), ("+3", 3)):
        monkeypatch.setenv("HPCDP_FLIGHT_RECORDER", raw)
        assert setting("HPCDP_FLIGHT_RECORDER") == want, raw
        assert _config.source("HPCDP_FLIGHT_RECORDER") == "environment"
    for raw in ("lots", "1.5", "-1", "1e3", "0x10"):
        _bad(monkeypatch, "HPCDP_FLIGHT_RECORDER", raw, "whole number", ">= 0")
    monkeypatch.setenv("HPCDP_RPC_MAX_DEPTH", "512")
    assert setting("HPCDP_RPC_MAX_DEPTH") == 512
    for raw in ("513", "0"):
        _bad(monkeypatch, "HPCDP_RPC_MAX_DEPTH", raw, ">= 1", "<= 512")
    _bad(monkeypatch, "HPCDP_MASTER_PORT", "65536", "<= 65535")


def test_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    name = "HPCDP_MAX_FRAME"
    for raw, want in (("4096", 4096), ("64K", 64 << 10), ("64 KiB", 64 << 10), ("2m", 2 << 20),
                      ("1GiB", 1 << 30), ("1T", 1 << 40)):
        monkeypatch.setenv(name, raw)
        assert setting(name) == want, raw
    for raw in ("0", "-5", "abc", "1.5", "1KB", "1 MB", "G"):
        _bad(monkeypatch, name, raw, "whole number of bytes", ">= 1")
    monkeypatch.setenv("HPCDP_RPC_RECV_CACHE", "0")  # 0 allowed where the minimum is 0
    assert setting("HPCDP_RPC_RECV_CACHE") == 0


def test_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    for raw, want in (("12.5", 12.5), ("1e3", 1000.0), (" 3 ", 3.0)):
        monkeypatch.setenv("HPCDP_TIMEOUT", raw)
        assert setting("HPCDP_TIMEOUT") == want
    # nan never expires, 0 and negatives expire at once, inf never ends a hung job
    for raw in ("soon", "nan", "NaN", "-1", "0", "inf", "-inf", "1e400", str(_config.TIMEOUT_MAX * 2)):
        _bad(monkeypatch, "HPCDP_TIMEOUT", raw, "finite number of seconds", "> 0", "<= ")
    for raw in ("0", "-1", "inf", "nan"):  # no upper bound here, but finite and > 0
        _bad(monkeypatch, "HPCDP_HANDSHAKE_TIMEOUT", raw, "> 0")
    monkeypatch.setenv("HPCDP_TRACE_DUMP_INTERVAL", "0")  # >= 0: 0 allowed
    assert setting("HPCDP_TRACE_DUMP_INTERVAL") == 0.0
    _bad(monkeypatch, "HPCDP_TRACE_DUMP_INTERVAL", "-1", ">= 0")


def test_bool(monkeypatch: pytest.MonkeyPatch) -> None:
    for raw, want in (("1", True), ("true", True), ("YES", True), (" on ", True),
                      ("0", False), ("false", False), ("No", False), ("off", False)):
        monkeypatch.setenv("HPCDP_TRACE_LINES", raw)
        assert setting("HPCDP_TRACE_LINES") is want, raw
    for raw in ("2", "maybe", "enabled"):
        _bad(monkeypatch, "HPCDP_TRACE_LINES", raw, "1/true/yes/on", "0/false/no/off")
    # a boolean whose default is "decide for me" (None) keeps it when unset
    monkeypatch.delenv("HPCDP_CUDA_AWARE", raising=False)
    assert setting("HPCDP_CUDA_AWARE") is None
    monkeypatch.setenv("HPCDP_CUDA_AWARE", "0")
    assert setting("HPCDP_CUDA_AWARE") is False


def test_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    for raw, want in (("detail", "detail"), ("DETAIL", "detail"), ("1", "detail"), ("on", "detail"),
                      ("0", "off"), ("no", "off"), ("off", "off")):
        monkeypatch.setenv("HPCDP_DEBUG", raw)
        assert setting("HPCDP_DEBUG") == want, raw
    _bad(monkeypatch, "HPCDP_DEBUG", "verbose", "'off'", "'detail'")
    monkeypatch.setenv("HPCDP_CKPT_MODE", "VDS")
    assert setting("HPCDP_CKPT_MODE") == "vds"
    _bad(monkeypatch, "HPCDP_CKPT_MODE", "posix", "'auto'", "'mpio'", "'vds'")


def test_str_is_taken_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPCDP_TRACE_DIR", " /tmp/x y ")
    assert setting("HPCDP_TRACE_DIR") == " /tmp/x y "


def test_strict_false_gives_the_default_for_a_bad_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPCDP_FULL_TRACEBACK", "maybe")
    assert setting("HPCDP_FULL_TRACEBACK", strict=False) is False
    with pytest.raises(ConfigError):
        setting("HPCDP_FULL_TRACEBACK")


def test_an_undeclared_name_is_refused() -> None:
    with pytest.raises(KeyError, match="HPCDP_NOT_DECLARED is not declared in hpcdp/_config.py"):
        setting("HPCDP_NOT_DECLARED")


def test_call_sites_raise_config_error_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """A few readers, each through ``setting``: the error is a ConfigError (TCP wraps it in the
    BackendUnavailableError its callers expect, with the ConfigError as the cause)."""
    from hpcdp.comm import debug as _debug
    from hpcdp.backends.tcp import _wire as wire
    from hpcdp.checkpoint.preempt import restart_count
    from hpcdp.comm.group import default_timeout
    from hpcdp.rpc._codec import Limits

    monkeypatch.setenv("HPCDP_TIMEOUT", "soon")
    with pytest.raises(ConfigError, match="HPCDP_TIMEOUT='soon'"):
        default_timeout()
    monkeypatch.setenv("HPCDP_DEBUG", "loud")
    with pytest.raises(ConfigError, match="HPCDP_DEBUG='loud'"):
        _debug.debug_level()
    monkeypatch.setenv("HPCDP_RPC_MAX_DEPTH", "600")
    with pytest.raises(ConfigError, match="HPCDP_RPC_MAX_DEPTH='600'.*<= 512"):
        Limits()
    monkeypatch.setenv("HPCDP_RESTART_COUNT", "2")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "5")
    assert restart_count() == 5
    monkeypatch.delenv("SLURM_RESTART_COUNT")
    assert restart_count() == 2
    monkeypatch.setenv("HPCDP_HANDSHAKE_TIMEOUT", "never")
    import hpcdp

    with pytest.raises(hpcdp.BackendUnavailableError, match="HPCDP_HANDSHAKE_TIMEOUT='never'") as info:
        wire.handshake_timeout()
    assert isinstance(info.value.__cause__, ConfigError)


# -- the declarations -----------------------------------------------------------------------------

def test_every_declaration_is_complete() -> None:
    assert len(SETTINGS) == len(_config._DECLARED), "a variable is declared twice"
    for name, s in SETTINGS.items():
        assert re.fullmatch(r"HPCDP_[A-Z0-9_]*[A-Z0-9]", name), name
        assert s.kind in _config.KINDS, (name, s.kind)
        assert s.audience in (USER, LAUNCHER, INTERNAL) and s.read_by in (_config.HPCDP, JOBS), name
        assert s.meaning and "\n" not in s.meaning and len(s.meaning) <= 120, name
        assert s.default is not None or s.default_text, f"{name}: a None default needs default_text"
        assert s.allowed().strip() and s.shown_default().strip(), name
        if s.kind == "choice":
            assert s.choices and s.default in s.choices, name
            assert all(v in s.choices for _, v in s.aliases), name
        else:
            assert not s.choices and not s.aliases, name
        if s.kind in ("int", "bytes", "seconds"):
            assert s.minimum is not None, f"{name}: a number needs its range"
            if s.default is not None:  # the default itself is allowed
                assert _config.parse(s, repr(s.default) if s.kind == "seconds" else str(s.default)) == s.default
        else:
            assert s.minimum is None and s.maximum is None, name
        if s.kind == "seconds":
            assert s.maximum is None or math.isfinite(s.maximum), name
    assert {s.name for s in _config.internal_switches()} == {
        "HPCDP_SIM_ALGORITHMS", "HPCDP_TEST_CUPY", "HPCDP_MPI_FASTPATH", "HPCDP_DDP_PROGRESS_THREAD"}


def test_defaults_match_the_modules_constants() -> None:
    """The modules keep named constants for their defaults; each equals its declaration."""
    from hpcdp.comm import group
    from hpcdp.backends.tcp import _backend as tcp_backend, _wire as tcp_wire
    from hpcdp.rpc import _agent, _api
    from hpcdp.trace import _recorder

    pairs = [(group.DEFAULT_TIMEOUT, "HPCDP_TIMEOUT"), (_api.DEFAULT_TIMEOUT, "HPCDP_RPC_TIMEOUT"),
             (_agent.QUEUE_BYTES, "HPCDP_RPC_QUEUE_BYTES"), (_recorder.DEFAULT_CAPACITY, "HPCDP_FLIGHT_RECORDER"),
             (tcp_wire.DEFAULT_MAX_FRAME, "HPCDP_MAX_FRAME")]
    for value, name in pairs:
        assert SETTINGS[name].default == value, (name, value)
    assert str(tcp_backend.DEFAULT_PORT) in SETTINGS["HPCDP_MASTER_PORT"].default_text


def test_readme_table_matches_the_declarations() -> None:
    readme = (ROOT / "README.md").read_text()
    rows = documented(readme)
    documentable = {s.name for s in _config.user_settings()}
    assert documentable - rows == set(), f"declared user settings without a README row: {sorted(documentable - rows)}"
    assert rows - documentable == set(), (f"README rows naming variables that are not declared user settings: "
                                          f"{sorted(rows - documentable)}")
    section = re.search(r"^## Environment variables\n(.*?)(?=^## |\Z)", readme, re.M | re.S).group(1)
    note = [ln for ln in section.splitlines() if ln.startswith("Test and benchmark switches")]
    assert len(note) == 1, "the section lists the internal switches in one line of their own"
    assert set(re.findall(r"HPCDP_[A-Z0-9_]*[A-Z0-9]", note[0])) == {s.name for s in _config.internal_switches()}


def test_job_scripts_read_only_declared_variables() -> None:
    used = set()
    for script in sorted((ROOT / "jobs").glob("*.sbatch")):
        code = "\n".join(ln for ln in script.read_text().splitlines() if not ln.lstrip().startswith("#"))
        used |= set(re.findall(r"\$\{?(HPCDP_[A-Z0-9_]+)", code))
    declared = {n for n, s in SETTINGS.items() if s.read_by == JOBS}
    assert used == declared, (sorted(used), sorted(declared))


# -- python -m hpcdp info -------------------------------------------------------------------------

def test_info_lists_each_user_setting_with_value_and_source(monkeypatch: pytest.MonkeyPatch) -> None:
    from hpcdp import __main__ as top

    for name in SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HPCDP_TIMEOUT", "12.5")
    monkeypatch.setenv("HPCDP_SECRET", "do-not-print-me")
    monkeypatch.setenv("HPCDP_STRAGGLER", "often")
    sections = list(top.settings().values())
    rows = {name: (value, src) for name, value, src in sections[0]}
    assert list(rows) == [s.name for s in _config.user_settings()]
    assert rows["HPCDP_TIMEOUT"] == ("12.5 s", "environment")
    assert rows["HPCDP_DEBUG"] == ("sample", "default")  # the sampled call checks (comm.debug)
    assert rows["HPCDP_MAX_FRAME"] == ("1 GiB", "default")
    assert rows["HPCDP_SECRET"] == ("set (hidden)", "environment")
    assert rows["HPCDP_STRAGGLER"][1] == "environment" and "invalid: HPCDP_STRAGGLER='often'" in rows["HPCDP_STRAGGLER"][0]
    assert sections[1] == []  # internal switches: only when set
    monkeypatch.setenv("HPCDP_SIM_ALGORITHMS", "p2p")
    assert list(top.settings().values())[1] == [("HPCDP_SIM_ALGORITHMS", "p2p", "environment")]


def test_info_command_prints_the_settings_section() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HPCDP_")}
    env.update(HPCDP_RPC_TIMEOUT="7", HPCDP_SECRET="do-not-print-me")
    p = subprocess.run([sys.executable, "-m", "hpcdp", "info"], capture_output=True, text=True,
                       timeout=180, cwd=ROOT, env=env, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    at = lines.index("settings (HPCDP_* environment variables)")
    listed = {ln.split(" : ")[0].strip(): ln.split(" : ", 1)[1] for ln in lines[at + 1:] if " : " in ln}
    assert set(listed) == {s.name for s in _config.user_settings()}, listed
    assert listed["HPCDP_RPC_TIMEOUT"] == "7 s  [environment]"
    assert listed["HPCDP_TIMEOUT"] == "1800 s  [default]"
    assert "do-not-print-me" not in p.stdout


# -- nothing reads HPCDP_* except through hpcdp/_config.py ------------------------------------------

def test_no_module_reads_an_hpcdp_variable_except_through_config() -> None:
    bypass = direct_reads(ROOT / "hpcdp")
    assert not bypass, ("read these through hpcdp._config.setting (declare them there): "
                        + "; ".join(f"{k} ({', '.join(v)})" for k, v in sorted(bypass.items())))


def test_every_variable_read_through_config_is_declared() -> None:
    undeclared = []
    for path in sorted((ROOT / "hpcdp").rglob("*.py")):
        for node in ast.walk(parse_source(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("setting", "raw", "source") and node.args
                    and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
                    and node.args[0].value.startswith("HPCDP_") and node.args[0].value not in SETTINGS):
                undeclared.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.args[0].value}")
    assert not undeclared, undeclared


def test_a_planted_direct_read_is_caught(tmp_path: Path) -> None:
    """A copy of hpcdp/ with a direct ``os.environ.get("HPCDP_X")`` (and every other form of
    read, two through private helpers) fails the scan, each named with its file and line;
    reads through ``_config`` in the same copy do not."""
    pkg = tmp_path / "hpcdp"
    shutil.copytree(ROOT / "hpcdp", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    assert direct_reads(pkg) == {}
    plant(pkg / "comm" / "group.py")
    found = direct_reads(pkg)
    assert sorted(found) == PLANTED, found
    assert all(v[0].startswith(os.path.join("hpcdp", "comm", "group.py") + ":") for v in found.values()), found
    # the smallest case the issue names, alone in another module
    other = tmp_path / "hpcdp2"
    shutil.copytree(ROOT / "hpcdp", other, ignore=shutil.ignore_patterns("__pycache__"))
    target = other / "backends" / "sim.py"
    target.write_text(target.read_text() + '\n\ndef _x():\n    return os.environ.get("HPCDP_X")\n')
    assert list(direct_reads(other)) == ["HPCDP_X"]

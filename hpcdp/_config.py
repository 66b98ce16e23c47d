"""Every ``HPCDP_*`` environment variable, declared once, and the one function that reads them.

Before this module each reader parsed its own variable, so the same word meant different things
(``HPCDP_TRACE=off`` turned tracing off in one place and kept the records in another), bad
values were refused with four error types or silently ignored, and nothing listed what can be
set. Here each variable has one ``Setting``: its type, default, allowed range or choices, one
line of meaning, who it is for, and who reads it. ``setting(name)`` is the only parser; a value
it does not allow raises ``ConfigError`` (a ``ValueError``) naming the variable, the raw value
and what is allowed. ``python -m hpcdp info`` lists the user settings with their current value
and source, and ``tests/project/test_config.py`` checks README.md's table against ``SETTINGS`` and that
no module reads an ``HPCDP_*`` variable except through here.

Rules shared by every type: a variable that is unset or empty reads as its default. Numbers,
booleans and choices ignore surrounding blanks and case; strings are taken as they are.
Values are read from ``os.environ`` at each call (tests and launchers change it while a process
runs); a reader that wants one value per process caches it itself.

Audiences: ``user`` settings are what a user sets (each has a README row); ``launcher`` variables
are set by ``hpcdp-run`` for its ranks (documented, read by scripts, not set by hand);
``internal`` switches exist for tests and benchmarks: they stay readable, but are not settings.
Stdlib only, so every layer (``backends``, ``trace``) may import it.
"""
from __future__ import annotations

import math
import numbers
import os
import re
import threading
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

__all__ = ["Setting", "SETTINGS", "ConfigError", "setting", "raw", "source", "parse", "describe",
           "user_settings", "internal_switches", "listing", "TIMEOUT_MAX", "check_timeout"]

#: the longest timeout a blocking call accepts (what ``threading`` can wait, about 292 years)
TIMEOUT_MAX = float(threading.TIMEOUT_MAX)

USER, LAUNCHER, INTERNAL = "user", "launcher", "internal"
#: who reads a variable: the Python package, or the Slurm job scripts (``jobs/*.sbatch``)
HPCDP, JOBS = "hpcdp", "jobs/*.sbatch"
KINDS = ("int", "bytes", "seconds", "bool", "choice", "str")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_UNITS = {"": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40}
_INT = re.compile(r"[+-]?[0-9]+")
_BYTES = re.compile(r"([0-9]+)\s*([a-z]*)")


@dataclass(frozen=True)
class Setting:
    """One variable. ``default`` None means "not set": the reader decides (a probe, a fallback
    to another variable); ``default_text`` then says what happens, for ``info`` and the README.
    ``minimum``/``maximum`` bound numbers (``above``: the minimum itself is excluded);
    ``aliases`` map other words to a choice; ``secret`` values are never printed."""

    name: str
    kind: str
    default: Any
    meaning: str
    audience: str = USER
    read_by: str = HPCDP
    minimum: float | None = None
    maximum: float | None = None
    above: bool = False
    choices: tuple[str, ...] = ()
    aliases: tuple[tuple[str, str], ...] = ()
    secret: bool = False
    default_text: str = ""

    def allowed(self) -> str:
        """What a value may be, in words (the end of every ``ConfigError`` message)."""
        if self.kind == "bool":
            return f"a boolean ({'/'.join(_TRUE)} or {'/'.join(_FALSE)})"
        if self.kind == "choice":
            words = [*self.choices, *(a for a, _ in self.aliases)]
            return "one of " + ", ".join(repr(w) for w in words)
        if self.kind == "str":
            return "a string"
        what = {"int": "a whole number", "seconds": "a finite number of seconds",
                "bytes": "a whole number of bytes (suffixes K, M, G, T or KiB, MiB, GiB, TiB)"}[self.kind]
        bounds = []
        if self.minimum is not None:
            bounds.append(f"{'>' if self.above else '>='} {self.minimum:g}")
        if self.maximum is not None:
            bounds.append(f"<= {self.maximum:g}")
        return what + (" " + " and ".join(bounds) if bounds else "")

    def shown_default(self) -> str:
        if self.default_text:
            return self.default_text
        return "(none)" if self.default is None else _show(self, self.default)


def _s(name: str, kind: str, default: Any, meaning: str, **kw: Any) -> Setting:
    return Setting(name, kind, default, meaning, **kw)


_MiB = 1 << 20
_DECLARED = [
    # -- every backend ---------------------------------------------------------------------------
    _s("HPCDP_BACKEND", "str", None, "force the backend: mpi, tcp or sim (init refuses others)",
       default_text="auto-detected"),
    _s("HPCDP_TIMEOUT", "seconds", 1800.0, "seconds any blocking call may wait before CommTimeoutError",
       minimum=0, above=True, maximum=TIMEOUT_MAX),
    _s("HPCDP_WARN_AFTER", "seconds", 60.0,
       "seconds a blocked call waits before it logs once what it waits for and on whom (0: off)",
       minimum=0, maximum=TIMEOUT_MAX),
    _s("HPCDP_DEBUG", "choice", "sample",
       "cross-rank call checks: sample (first calls, then every 128th), detail (all, p2p too), off",
       choices=("off", "sample", "detail"),
       aliases=(("0", "off"), ("false", "off"), ("no", "off"),
                ("1", "detail"), ("true", "detail"), ("yes", "detail"), ("on", "detail"))),
    _s("HPCDP_DETERMINISTIC", "bool", False,
       "deterministic mode: exact float sums, bit-identical for any backend, algorithm or world size"),
    _s("HPCDP_FULL_TRACEBACK", "bool", False, "keep hpcdp's internal frames in printed tracebacks"),
    # -- trace -----------------------------------------------------------------------------------
    _s("HPCDP_TRACE", "bool", False, "write a Chrome-trace timeline per rank (and every source line)"),
    _s("HPCDP_TRACE_DIR", "str", "hpcdp-trace", "where flight records and timelines go"),
    _s("HPCDP_TRACE_LINES", "bool", False, "record every operation's source line in the flight record"),
    _s("HPCDP_TRACE_DUMP_INTERVAL", "seconds", 1.0,
       "least seconds between two automatic flight-record dumps of a process", minimum=0),
    _s("HPCDP_FLIGHT_RECORDER", "int", 2048, "ring size of the flight recorder (0 turns it off)",
       minimum=0),
    _s("HPCDP_STRAGGLER", "int", 0, "every N steps rank 0 reports late ranks (0: off)", minimum=0),
    # -- MPI -------------------------------------------------------------------------------------
    _s("HPCDP_MAX_MESSAGE_ELEMENTS", "int", 2**31 - 1,
       "MPI: split messages above this many elements (read once, at import)", minimum=1),
    _s("HPCDP_CUDA_AWARE", "bool", None, "MPI: whether the library reads device memory",
       default_text="probed (a child process, at the first cupy collective)"),
    # -- TCP -------------------------------------------------------------------------------------
    _s("HPCDP_SECRET", "str", None, "shared secret that authenticates TCP ranks", secret=True,
       default_text="(none: hpcdp-run and spawn set one)"),
    _s("HPCDP_MASTER_ADDR", "str", None, "TCP rendezvous address (wins over MASTER_ADDR)",
       default_text="MASTER_ADDR"),
    _s("HPCDP_MASTER_PORT", "int", None, "TCP rendezvous port (wins over MASTER_PORT)",
       minimum=0, maximum=65535, default_text="MASTER_PORT, else 29500"),
    _s("HPCDP_RANK", "int", None, "this rank, where RANK is not set", minimum=0,
       default_text="RANK"),
    _s("HPCDP_WORLD_SIZE", "int", None, "the world size, where WORLD_SIZE is not set", minimum=1,
       default_text="WORLD_SIZE"),
    _s("HPCDP_BIND_ADDR", "str", None, "TCP: the address this rank listens on",
       default_text="loopback for a local master, else the interface routing to it"),
    _s("HPCDP_CONNECT_TIMEOUT", "seconds", 60.0, "TCP: seconds to reach the store and the peers",
       minimum=0, above=True, maximum=TIMEOUT_MAX),
    _s("HPCDP_MAX_FRAME", "bytes", 1 << 30, "TCP: largest frame; longer messages are split",
       minimum=1),
    _s("HPCDP_HANDSHAKE_TIMEOUT", "seconds", 10.0,
       "TCP: seconds an unauthenticated connection may take to authenticate", minimum=0, above=True),
    # -- RPC -------------------------------------------------------------------------------------
    _s("HPCDP_RPC_TIMEOUT", "seconds", 60.0, "default seconds an RPC call waits for its answer",
       minimum=0, above=True, maximum=TIMEOUT_MAX),
    _s("HPCDP_RPC_RECV_CACHE", "bytes", 128 * _MiB,
       "bytes of RPC receive buffers kept for reuse (0: none; read once, at import)", minimum=0),
    _s("HPCDP_RPC_QUEUE_BYTES", "bytes", 256 * _MiB,
       "bytes of received RPC requests a worker holds until answered", minimum=1),
    _s("HPCDP_RPC_MAX_MESSAGE", "bytes", 1 << 30, "cap on one RPC message, arrays included", minimum=1),
    _s("HPCDP_RPC_MAX_BODY", "bytes", 16 * _MiB, "cap on one RPC message's msgpack body", minimum=1),
    _s("HPCDP_RPC_MAX_DEPTH", "int", 64, "cap on container nesting in one RPC message",
       minimum=1, maximum=512),
    _s("HPCDP_RPC_MAX_ELEMENTS", "int", 1_000_000, "cap on container items in one RPC message",
       minimum=1),
    _s("HPCDP_RPC_MAX_BUFFERS", "int", 4096, "cap on arrays in one RPC message", minimum=1),
    # -- checkpoint, testing ---------------------------------------------------------------------
    _s("HPCDP_CKPT_MODE", "choice", "auto", "how checkpoint.save writes (save(mode=) overrides)",
       choices=("auto", "mpio", "vds")),
    _s("HPCDP_SHARED_TMPDIR", "str", None, "hpcdp.testing's shared_tmp_path on several ranks",
       default_text="TMPDIR"),
    # -- set by hpcdp-run for its ranks ----------------------------------------------------------
    _s("HPCDP_RESTART_COUNT", "int", 0, "the attempt number (0 first); checkpoint.restart_count()",
       audience=LAUNCHER, minimum=0),
    _s("HPCDP_MAX_RESTARTS", "int", 0, "hpcdp-run's --max-restarts, for the script to read",
       audience=LAUNCHER, minimum=0),
    # -- test and benchmark switches: readable, not settings -------------------------------------
    _s("HPCDP_SIM_ALGORITHMS", "choice", "native",
       "tests: run the simulated backend's collectives through TCP's p2p algorithms",
       audience=INTERNAL, choices=("native", "p2p")),
    _s("HPCDP_TEST_CUPY", "choice", "auto",
       "GPU check: 'real' fails where cupy has no device instead of using the numpy stand-in",
       audience=INTERNAL, choices=("auto", "real")),
    _s("HPCDP_MPI_FASTPATH", "bool", True,
       "MPI: the small-message allreduce path (0: off; alike on every rank)",
       audience=INTERNAL),
    _s("HPCDP_DDP_PROGRESS_THREAD", "bool", None,
       "MPI: force DDP's progress thread on or off (benchmarks; it needs MPI_THREAD_MULTIPLE)",
       audience=INTERNAL, default_text="on where the rank may use more than one core"),
    # -- read by the Slurm job scripts, not by Python --------------------------------------------
    _s("HPCDP_VENV", "str", None, "jobs: the virtual environment to activate", read_by=JOBS,
       default_text="$SLURM_SUBMIT_DIR/.venv"),
    _s("HPCDP_SRUN_MPI", "str", "pmix", "jobs: the srun --mpi= plugin", read_by=JOBS),
    _s("HPCDP_CKPT_ROOT", "str", None, "jobs: where checkpoints go", read_by=JOBS,
       default_text="$SLURM_SUBMIT_DIR/checkpoints"),
    _s("HPCDP_SELF_PREEMPT_AT", "str", "20",
       "jobs/preempt_requeue.sbatch: signal itself after N steps (set empty: wait for a real one)",
       read_by=JOBS),
]

#: every declared variable, by name
SETTINGS: dict[str, Setting] = {s.name: s for s in _DECLARED}


def _declared(name: str) -> Setting:
    try:
        return SETTINGS[name]
    except KeyError:
        raise KeyError(f"{name} is not declared in hpcdp/_config.py (declare it there, with its "
                       "type, default and meaning, before reading it)") from None


def raw(name: str) -> str | None:
    """The environment's text for ``name``, or None when it is unset or empty (for display)."""
    _declared(name)
    value = os.environ.get(name)
    return value if value and value.strip() else None


def source(name: str) -> str:
    """"environment" when ``name`` is set to a non-empty value, else "default"."""
    return "default" if raw(name) is None else "environment"


def parse(decl: Setting, text: str | None) -> Any:
    """``text`` (None: unset) as ``decl``'s type; ConfigError for a value it does not allow."""
    if text is None or not text.strip():
        return decl.default
    if decl.kind == "str":
        return text
    s = text.strip().lower()
    value: Any
    if decl.kind == "bool":
        if s in _TRUE or s in _FALSE:
            return s in _TRUE
        raise ConfigError(decl.name, text, decl.allowed())
    if decl.kind == "choice":
        s = dict(decl.aliases).get(s, s)
        if s in decl.choices:
            return s
        raise ConfigError(decl.name, text, decl.allowed())
    if decl.kind == "int":
        if not _INT.fullmatch(s):
            raise ConfigError(decl.name, text, decl.allowed())
        value = int(s)
    elif decl.kind == "bytes":
        m = _BYTES.fullmatch(s)
        if not m or m.group(2) not in _UNITS:
            raise ConfigError(decl.name, text, decl.allowed())
        value = int(m.group(1)) * _UNITS[m.group(2)]
    else:  # seconds
        try:
            value = float(s)
        except ValueError:
            raise ConfigError(decl.name, text, decl.allowed()) from None
        if not math.isfinite(value):
            raise ConfigError(decl.name, text, decl.allowed())
    low, high = decl.minimum, decl.maximum
    if (low is not None and (value <= low if decl.above else value < low)) or (
            high is not None and value > high):
        raise ConfigError(decl.name, text, decl.allowed())
    return value


def setting(name: str, *, strict: bool = True) -> Any:
    """The value of ``name`` now: parsed from the environment, else its declared default.

    ``strict=False`` gives the default instead of raising for a value that is not allowed: only
    for reads on an error path (reporting a timeout, trimming a traceback), where raising would
    hide the error being reported. ``python -m hpcdp info`` shows such a value as invalid.
    """
    decl = _declared(name)
    text = os.environ.get(name)
    if strict:
        return parse(decl, text)
    try:
        return parse(decl, text)
    except ConfigError:
        return decl.default


def _show(decl: Setting, value: Any) -> str:
    if decl.kind == "bytes" and isinstance(value, int):
        for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if value >= size and value % size == 0:
                return f"{value // size} {unit}"
        return f"{value} B"
    if decl.kind == "seconds":
        return f"{value:g} s"
    return str(value)


def describe(name: str) -> tuple[str, str]:
    """``(value, source)`` of ``name`` as ``info`` prints them; never raises for a bad value."""
    decl = _declared(name)
    src = source(name)
    if decl.secret:
        return ("set (hidden)" if src == "environment" else decl.shown_default()), src
    try:
        value = setting(name)
    except ConfigError as exc:
        return f"invalid: {exc}", src
    if src == "default":
        return decl.shown_default(), src
    return _show(decl, value), src


def user_settings() -> list[Setting]:
    """What users set (and what hpcdp-run sets for them), in declaration order."""
    return [s for s in _DECLARED if s.audience != INTERNAL]


def internal_switches() -> list[Setting]:
    """Test and benchmark switches: readable, listed apart, not in the README's table."""
    return [s for s in _DECLARED if s.audience == INTERNAL]


def listing() -> list[tuple[str, str, str]]:
    """``(name, value, source)`` of every user setting (the job scripts' too), then of each
    internal switch that is set (a bug report should show them), for ``python -m hpcdp info``."""
    rows = [(s.name, *describe(s.name)) for s in user_settings()]
    rows += [(s.name, *describe(s.name)) for s in internal_switches() if source(s.name) == "environment"]
    return rows


def check_timeout(where: str, t: Any, *, named: bool = False) -> float:
    """A timeout in seconds: a finite number > 0, at most ``TIMEOUT_MAX``.

    nan would never expire (every comparison with it is false) and a negative or zero one would
    expire before the call starts; inf is refused too, because every blocking call in hpcdp must
    end, and a deadline that cannot pass hides a hung job (pass a large value to wait long).
    ``named``: ``where`` already names the value (``HPCDP_TIMEOUT='nan'``).
    """
    if (type(t) is float or type(t) is int) and 0 < t <= TIMEOUT_MAX:  # nan fails both
        return float(t)
    what = where if named else f"{where}: timeout={t!r}"
    if isinstance(t, bool) or not isinstance(t, numbers.Real):
        raise TypeError(f"{what}: a timeout is a number of seconds, got {type(t).__name__}")
    f = float(t)
    if math.isnan(f):
        raise ValueError(f"{what}: nan is not a timeout (it would never expire)")
    if f <= 0:
        raise ValueError(f"{what}: a timeout must be > 0 seconds")
    if f > TIMEOUT_MAX:
        raise ValueError(f"{what}: a timeout must be finite and at most {TIMEOUT_MAX:g} s "
                         "(every blocking call must end; pass a large value to wait long)")
    return f

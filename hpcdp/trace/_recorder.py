"""The flight recorder: the last N operations of each rank, in a ring cheap enough to stay on.

Contract for the collective layer (the only caller on the hot path)::

    self._rec = hooks.active_recorder(global_rank)    # once per group; None when switched off
    ...
    rec = self._rec
    tok = rec.begin("allreduce", self, seq, x.shape, x.dtype, -1) if rec is not None else 0
    try:
        ... run the operation ...
    except Exception as exc:
        hooks.on_error(rec, tok, exc)                  # timed out / failed; dumps on a timeout
        raise
    if rec is not None:
        rec.end(tok)

``begin``/``end`` are plain closures stored on the instance (no method binding, no lock), and
the common case (no source lines, no timeline) is specialised when the recorder is built, so the
blocking allreduce's latency lane, the one caller where a Python call is a measurable share of the
operation, calls them like every other caller does. A ring slot holds ``(t, op, group, seq,
shape, dtype, peer, start_ns, thread, where)`` from ``begin`` and ``(t, end_ns, state, where)``
from ``end``; each is replaced by one tuple store, atomic under the GIL, and an end is paired
with its begin by token, so threads may begin and end operations concurrently and a slot that a
newer operation took over is never misattributed.

Source lines: walking the stack out of hpcdp costs as much as the rest of ``begin``, so by
default only failed or timed-out operations (on the error path) record their caller's line;
``dump`` fills in the line of each thread's in-flight operation from its live stack, which is
where a hung rank is stuck. ``HPCDP_TRACE=1`` or ``HPCDP_TRACE_LINES=1`` (or
``configure(lines=True)``) records the line of every operation.
"""
from __future__ import annotations

import itertools
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable

from .._config import SETTINGS, setting
from ._clock import now_ns

__all__ = [
    "STARTED", "COMPLETED", "TIMED_OUT", "FAILED", "STATES", "Recorder", "Op", "recorder",
    "active_recorder", "configure", "reset", "all_recorders", "bind_rank", "current_rank",
    "user_frame", "where_of", "DEFAULT_CAPACITY", "hide_frames", "pin_line",
]

STARTED = "started"
COMPLETED = "completed"
TIMED_OUT = "timed out"
FAILED = "failed"
STATES = (STARTED, COMPLETED, TIMED_OUT, FAILED)

DEFAULT_CAPACITY = SETTINGS["HPCDP_FLIGHT_RECORDER"].default

_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
#: hpcdp's benchmarks are hpcdp's users: a line recorded from them names their own loop, as it
#: names a training script's (and the walk stops there, as it does in a script)
_USER_DIR = _PKG_DIR + "bench" + os.sep
_inside: dict[str, bool] = {}
#: ids of the code objects ``hide_frames`` names, kept alive in ``_hidden_codes`` (so no id is
#: reused). By id, not by value: hashing a code object hashes its constants, nested functions'
#: code included, every time (on every line capture).
_hidden: set[int] = set()
_hidden_codes: list[Any] = []


def hide_frames(fn: Any) -> Any:
    """Decorator: source lines skip ``fn``'s frames too, as they skip hpcdp's own.

    For wrappers around hpcdp calls (a framework adapter, a test helper), so that recorded
    lines point at the wrapper's caller.
    """
    code = getattr(fn, "__code__", fn)
    _hidden_codes.append(code)
    _hidden.add(id(code))
    return fn


#: directories of frameworks whose frames lines skip too (``hide_package``): a torch backward
#: runs hpcdp's hooks from inside torch's autograd engine, and the line worth naming is the
#: user's ``loss.backward()``, not torch's
_hidden_dirs: list[str] = []


def hide_package(directory: str) -> None:
    """Source lines skip frames of code under ``directory`` (a framework's package, e.g. torch's)."""
    d = os.path.abspath(directory) + os.sep
    if d not in _hidden_dirs:
        _hidden_dirs.append(d)
        _inside.clear()


def user_frame(f: Any, passed: list[Any] | None = None) -> Any:
    """The first frame at or above ``f`` whose code lies outside hpcdp (and ``hide_frames``);
    ``passed`` gets the code of each frame it went up past (``pin_line``'s memo)."""
    inside, hidden = _inside, _hidden
    while f is not None:
        code = f.f_code
        fn = code.co_filename
        hit = inside.get(fn)
        if hit is None:
            path = os.path.abspath(fn)
            hit = inside[fn] = ((path.startswith(_PKG_DIR) and not path.startswith(_USER_DIR))
                                or any(path.startswith(d) for d in _hidden_dirs))
        if not hit and id(code) not in hidden:
            return f
        if passed is not None:
            passed.append(code)
        f = f.f_back
    return None


def where_of(where: tuple[Any, int] | None) -> str | None:
    """``"path/to/train.py:42 (step)"`` for a stored ``(code, lineno)``."""
    if where is None:
        return None
    code, line = where
    return f"{code.co_filename}:{line} ({code.co_name})"


#: ``(code, line)`` of a call site, by ``(id(code), f_lasti)``: ``f_lineno`` decodes the code's
#: line table from its start on every read (in a long function or module, more than walking
#: the stack costs), while the offset of the call is at hand. One tuple per site (a recorded
#: line costs no allocation). The entry keeps its code alive, so an id is never matched to
#: another code (checked anyway: ``hit[0] is code``).
_sites: dict[tuple[int, int], tuple[Any, int]] = {}


def _site(f: Any) -> tuple[Any, int]:
    """``(f.f_code, f.f_lineno)``, one tuple per call site (``_sites``)."""
    code = f.f_code
    key = (id(code), f.f_lasti)
    hit = _sites.get(key)
    if hit is None or hit[0] is not code:
        if len(_sites) >= 10_000:  # bounded: code made at run time (exec, lambdas) comes and goes
            _sites.clear()
        hit = _sites[key] = (code, f.f_lineno)
    return hit


def _caller(depth: int) -> tuple[Any, int] | None:
    pinned = _tls.line
    if pinned is not None:  # inside ``pinned_line``: the user's call that started it all
        return pinned  # type: ignore[no-any-return]
    try:
        f = user_frame(sys._getframe(depth + 1))
    except ValueError:
        return None
    return None if f is None else _site(f)


#: ``pin_line``'s last walk: (the code objects of the frames it went up past, the user's code,
#: its call offset, the site, ``len(_hidden)``, ``len(_hidden_dirs)``); None before the first
_last_walk: list[Any] = [None]


def pin_line() -> tuple[bool, Any]:
    """Pin the source line of the user's call around the caller's caller (a ``with`` block's
    ``__enter__`` calls this) for the operations this thread starts until it is restored:
    (whether source lines are recorded, the line pinned before, which the caller puts back)."""
    on = _settings.get("lines")
    if on is None:
        on = _setting("lines")
    if not on:
        return False, None
    prev = _tls.line
    if prev is None:  # (once per traced backward)
        try:
            f = sys._getframe(2)
        except ValueError:
            return True, prev
        # (read before the walk: a hide on another thread during it makes the memo stale)
        nh, nd = len(_hidden), len(_hidden_dirs)
        last = _last_walk[0]
        if last is not None and last[4] == nh and last[5] == nd:
            # the stack the last walk went up (each training step repeats it): the same code
            # objects, frame by frame, and the same call offset in the user's frame name the
            # same site, while no code or package was hidden since
            g = f
            for c in last[0]:
                if g.f_code is not c:
                    break
                g = g.f_back
                if g is None:
                    break
            else:
                if g.f_code is last[1] and g.f_lasti == last[2]:
                    _tls.line = last[3]
                    return True, prev
        passed: list[Any] = []
        u = user_frame(f, passed)
        if u is not None:
            site = _tls.line = _site(u)
            _last_walk[0] = (tuple(passed), u.f_code, u.f_lasti, site, nh, nd)
    return True, prev


class pinned_line:
    """``with pinned_line():`` operations started inside, on this thread, take the source line of
    the user's call around it instead of each walking up the stack to find it.

    For layers that start operations deep inside the user's one call (DDP's backward launches
    bucket allreduces from gradient hooks twenty frames down): one shallow walk instead of many
    deep ones. Does nothing unless source lines are being recorded.
    """

    __slots__ = ("_prev", "_set")

    def __enter__(self) -> "pinned_line":
        self._set, self._prev = pin_line()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._set:
            _tls.line = self._prev


@dataclass(frozen=True)
class Op:
    """One recorded operation, as ``Recorder.snapshot`` returns it (times: ``now_ns`` readings)."""

    id: int
    op: str
    group: Any
    seq: int
    shape: Any
    dtype: Any
    peer: int
    start_ns: int
    end_ns: int | None
    state: str
    thread: int
    where: tuple[Any, int] | None

    @property
    def line(self) -> str | None:
        return where_of(self.where)


class Recorder:
    """A ring of the last ``capacity`` operations of one rank.

    Args:
        rank: the global rank whose operations these are.
        capacity: entries kept; 0 makes ``begin``/``end`` no-ops.
        lines: record the caller's source line of every operation (slower; see module doc).
    """

    def __init__(self, rank: int, capacity: int = DEFAULT_CAPACITY, *, lines: bool = False) -> None:
        if capacity < 0:
            raise ValueError(f"Recorder: capacity must be >= 0, got {capacity}")
        self.rank = int(rank)
        self.capacity = int(capacity)
        self.lines = bool(lines)
        self._rows: list[Any] = [None] * self.capacity
        self._ends: list[Any] = [None] * self.capacity
        self._count = itertools.count(1)
        self._timeline: Any = None
        self.begin: Callable[..., int]
        self.end: Callable[..., None]
        #: (how, wall-clock ns) once this rank is done ("finalize", or "exit" without it): its
        #: record then says so, and ``analyze`` tells a rank that finished from one that died
        self.finished: tuple[str, int] | None = None
        self._build()

    def attach_timeline(self, timeline: Any) -> None:
        """Also emit each finished operation to ``timeline`` (``HPCDP_TRACE=1``); None detaches."""
        self._timeline = timeline
        self._build()

    def set_lines(self, lines: bool) -> None:
        self.lines = bool(lines)
        self._build()

    def _build(self) -> None:
        cap = self.capacity
        if cap == 0:
            self.begin = lambda *a, **k: 0
            self.end = lambda *a, **k: None
            return
        rows, ends, nxt, clock = self._rows, self._ends, self._count.__next__, now_ns
        ident = threading.get_ident
        tl = self._timeline

        # An operation that ends after ``cap`` newer ones began has lost its slot: its end is
        # dropped, so it cannot overwrite the end of the newer operation now in that slot.
        def finish(token: int, state: str, t1: int) -> None:
            if state not in STATES:
                raise ValueError(f"Recorder.end: state must be one of {STATES}, got {state!r}")
            i = token % cap
            row = rows[i]
            if row is None or row[0] != token:
                return
            # a failure records its caller's line: the error path can afford the stack walk
            ends[i] = (token, t1, state, None if state == COMPLETED else _caller(2))
            if tl is not None:
                tl.op_event(row, t1, state)

        if tl is None:
            def end(token: int, state: str = COMPLETED, _c: Any = clock) -> None:
                """Mark operation ``token`` finished; a failure also records where it was called."""
                if state is COMPLETED:  # (``finish`` inlined: the common case, every operation)
                    i = token % cap
                    row = rows[i]
                    if row is not None and row[0] == token:
                        ends[i] = (token, _c(), COMPLETED, None)
                else:
                    finish(token, state, _c())
        else:
            tbuf, every = tl.op_sink()

            def end(token: int, state: str = COMPLETED, _c: Any = clock, _t: Any = _tls) -> None:
                """Mark operation ``token`` finished; a failure also records where it was called."""
                if state is COMPLETED:  # (``finish`` and ``Timeline.op_event`` inlined)
                    i = token % cap
                    row = rows[i]
                    if row is not None and row[0] == token:
                        t1 = _c()
                        ends[i] = (token, t1, COMPLETED, None)
                        h = _t.here  # the thread's tid, when the thread that began the op ends it
                        tbuf.append((row, t1, COMPLETED, h[1] if h is not None and h[0] is tl
                                     and h[2] == row[8] else tl._tid(row[8])))
                        if len(tbuf) >= every:
                            tl.flush()
                else:
                    finish(token, state, _c())

        if self.lines or tl is not None:
            def begin(op: str, group: Any, seq: int = 0, shape: Any = None, dtype: Any = None,
                      peer: int = -1, _n: Any = nxt, _c: Any = clock, _i: Any = ident,
                      _t: Any = _tls) -> int:
                """Record the start of ``op``; returns the token ``end`` takes."""
                token = _n()
                where = _t.line  # ``_caller``'s pinned case inlined (DDP's bucket allreduces)
                rows[token % cap] = (token, op, group, seq, shape, dtype, peer, _c(), _i(),
                                     _caller(1) if where is None else where)
                return token
        else:
            def begin(op: str, group: Any, seq: int = 0, shape: Any = None, dtype: Any = None,
                      peer: int = -1, _n: Any = nxt, _c: Any = clock, _i: Any = ident) -> int:
                """Record the start of ``op``; returns the token ``end`` takes."""
                token = _n()
                rows[token % cap] = (token, op, group, seq, shape, dtype, peer, _c(), _i(), None)
                return token

        self.begin = begin
        self.end = end

    def snapshot(self) -> list[Op]:
        """The retained operations, oldest first (safe while other threads record)."""
        rows, ends = list(self._rows), list(self._ends)
        done = {e[0]: e for e in ends if e is not None}
        out = []
        for r in sorted((r for r in rows if r is not None), key=lambda r: r[0]):
            e = done.get(r[0])
            out.append(Op(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7],
                          None if e is None else e[1], STARTED if e is None else e[2], r[8],
                          r[9] if r[9] is not None or e is None else e[3]))
        return out

    def total(self) -> int:
        """Operations begun so far (retained or not)."""
        return max((r[0] for r in self._rows if r is not None), default=0)

    def clear(self) -> None:
        """Forget every entry (tokens keep counting, so late ``end`` calls stay harmless)."""
        for i in range(self.capacity):
            self._rows[i] = None
            self._ends[i] = None

    def __repr__(self) -> str:
        return f"<Recorder rank {self.rank} capacity {self.capacity} ops {self.total()}>"


# -- registry: one recorder per global rank living in this process ----------------------------

_recorders: dict[int, Recorder] = {}
_lock = threading.Lock()
class _Local(threading.local):
    """Per-thread state; class-level defaults, because a missing attribute makes every
    ``getattr(_tls, name, None)`` raise and catch an AttributeError (a microsecond here)."""

    rank: int | None = None   # ``bind_rank``
    line: Any = None          # ``pinned_line``
    #: the timeline events of this thread go to, with the thread's tid in it (kept by the
    #: timeline module, ``_chrome``): one lookup per event instead of rank, timeline and tid
    here: Any = None


_tls = _Local()
_process_rank: list[int] = [0]
#: the largest world size ``install`` was told (dumps name it; 0 = unknown)
world_size_seen: list[int] = [0]
_settings: dict[str, Any] = {}
#: set by the timeline module while ``HPCDP_TRACE`` is on: rank -> Timeline
timeline_factory: list[Callable[[int], Any] | None] = [None]


def _setting(key: str) -> Any:
    if key not in _settings:
        _settings["capacity"] = _settings.get("capacity", setting("HPCDP_FLIGHT_RECORDER"))
        _settings["lines"] = _settings.get("lines", setting("HPCDP_TRACE_LINES") or setting("HPCDP_TRACE"))
    return _settings[key]


def bind_rank(rank: int | None) -> None:
    """Make ``rank`` this thread's rank (simulated ranks are threads); None unbinds."""
    _tls.rank = rank
    _tls.here = None  # another rank's timeline


def current_rank() -> int:
    """This thread's bound rank, else the process's (from ``install``), else 0."""
    r = _tls.rank
    return _process_rank[0] if r is None else r


def recorder(rank: int | None = None) -> Recorder:
    """The recorder of global ``rank`` in this process (default: the current rank), made on first use."""
    r = current_rank() if rank is None else int(rank)
    rec = _recorders.get(r)
    if rec is not None:
        return rec
    with _lock:
        rec = _recorders.get(r)
        if rec is None:
            rec = Recorder(r, _setting("capacity"), lines=_setting("lines"))
            make = timeline_factory[0]
            if make is not None:
                rec.attach_timeline(make(r))
            _recorders[r] = rec
    return rec


def active_recorder(rank: int | None = None) -> Recorder | None:
    """``recorder(rank)``, or None when recording is off (``HPCDP_FLIGHT_RECORDER=0``)."""
    rec = recorder(rank)
    return rec if rec.capacity else None


def all_recorders() -> list[Recorder]:
    """Every recorder in this process, by rank."""
    return [_recorders[r] for r in sorted(_recorders)]


def configure(*, capacity: int | None = None, lines: bool | None = None) -> None:
    """Change the defaults of recorders made from now on; ``lines`` also applies to existing ones.

    Args:
        capacity: ring size of new recorders (``HPCDP_FLIGHT_RECORDER``; 0 = off).
        lines: record every operation's source line (``HPCDP_TRACE_LINES``).
    """
    with _lock:
        if capacity is not None:
            if capacity < 0:
                raise ValueError(f"configure: capacity must be >= 0, got {capacity}")
            _setting("capacity")
            _settings["capacity"] = int(capacity)
        if lines is not None:
            _setting("lines")
            _settings["lines"] = bool(lines)
            for rec in _recorders.values():
                rec.set_lines(bool(lines))


def reset() -> None:
    """Drop every recorder and re-read the environment (a fresh job in the same process; tests)."""
    with _lock:
        _recorders.clear()
        _settings.clear()
        world_size_seen[0] = 0

"""``HPCDP_TRACE=1``: a Chrome-trace timeline per rank (opens in Perfetto / chrome://tracing).

Each rank writes ``<HPCDP_TRACE_DIR>/trace-rank<R>.json``: an 'X' (complete) event per
collective and point-to-point operation (pid = rank, tid = the calling thread), plus whatever
other layers emit through ``span`` (DDP backward, FSDP gathers, pipeline stages, checkpoint
phases), ``instant`` and ``counter``. Events are buffered and appended in chunks; the file is
closed (made valid JSON) by ``close_all`` at exit, and ``merge`` repairs one cut short by a crash.

When tracing is off, ``span``/``instant``/``counter`` return after one attribute check, and the
recorder's fast path is untouched.
"""
from __future__ import annotations

import atexit
import functools
import json
import os
import socket
import sys
import threading
from typing import Any, Callable, TypeVar

from .._atomic import open_new
from .._config import setting
from ._clock import WALL_MINUS_MONO_NS, clock_offset_ns, now_ns
from ._dump import describe_group, job_id, on_dump, trace_dir
from ._recorder import (
    all_recorders, configure, current_rank, timeline_factory, where_of,
)

__all__ = [
    "FORMAT", "state", "Timeline", "enabled", "enable", "disable", "timeline", "flush", "close_all",
    "span", "instant", "counter", "trace_path",
]

FORMAT = "hpcdp.trace/1"
F = TypeVar("F", bound=Callable[..., Any])


def _make_encode() -> Callable[[Any], str]:
    """Compact JSON with ``default=str``, through one C encoder built once.

    ``JSONEncoder.encode`` builds a new C encoder on every call (about 3 us here, more than
    the rest of recording an event); the timeline encodes one small dict per span or mark.
    """
    enc = json.JSONEncoder(default=str, separators=(",", ":"))
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # no _json accelerator: the pure-Python encoder
        return enc.encode
    markers: dict[int, Any] = {}  # circular-reference check, emptied again by every call
    lock = threading.Lock()
    it = make(markers, enc.default, json.encoder.encode_basestring_ascii, None, ":", ",",
              False, False, True)

    def encode(obj: Any) -> str:
        with lock:
            try:
                return "".join(it(obj, 0))
            finally:
                markers.clear()  # after an error (a circular value), the ids left behind

    return encode


_encode = _make_encode()
_dtype_names: dict[Any, str] = {}
_group_names: dict[int, tuple[Any, str]] = {}


def _dtype_name(dt: Any) -> str:
    try:
        name = _dtype_names.get(dt)
    except TypeError:  # unhashable
        return str(dt)
    if name is None:
        name = _dtype_names[dt] = str(dt)
    return name


def _group_json(g: Any) -> str:
    """``"group":...,"group_ranks":[...]`` of a group, cached by identity (name and ranks never change)."""
    hit = _group_names.get(id(g))
    if hit is None or hit[0] is not g:
        name, ranks, _ = describe_group(g)
        text = '"group":' + json.dumps(name) + ("" if ranks is None else ',"group_ranks":' + json.dumps(ranks))
        hit = _group_names[id(g)] = (g, text)
    return hit[1]


_json_strs: dict[Any, str] = {}
_shapes: dict[Any, str] = {}


def _shape_json(shape: Any) -> str:
    hit = _shapes.get(shape)
    if hit is None:
        hit = json.dumps([int(v) for v in shape])
        if len(_shapes) < 100_000:
            _shapes[shape] = hit
    return hit


def _js(value: Any) -> str:
    """``json.dumps(str(value))``, cached: op names, states, dtypes and source lines repeat."""
    hit = _json_strs.get(value)
    if hit is None:
        hit = json.dumps(value if isinstance(value, str) else str(value))
        if len(_json_strs) < 100_000:
            _json_strs[value] = hit
    return hit


_quote = json.encoder.encode_basestring_ascii


def _args_json(args: dict[Any, Any]) -> str:
    """``,"args":{...}`` of a span's or mark's ``args``: scalars formatted here (the common case,
    several times faster than an encoder call), anything else through ``_encode``."""
    parts = []
    get = _json_strs.get
    for k, v in args.items():
        t = type(v)
        if type(k) is not str:
            return ',"args":' + _encode(args)
        kj = get(k) or _js(k)
        if t is int:
            parts.append(f"{kj}:{v}")
        elif t is bool or v is None:
            parts.append(f"{kj}:{'null' if v is None else 'true' if v else 'false'}")
        elif t is float:  # JSON has no nan/inf: those as strings, which every viewer loads
            parts.append(f"{kj}:{v!r}" if v - v == 0 else f'{kj}:"{v!r}"')
        elif t is str:
            parts.append(f"{kj}:{_quote(v)}")
        else:
            return ',"args":' + _encode(args)
    return ',"args":{' + ",".join(parts) + "}"


class _ThreadTid(threading.local):
    """A timeline's tid for the calling thread (class defaults: no AttributeError to catch)."""

    tid: int | None = None
    ident: int | None = None


class _State:
    """``state.on`` is the one attribute other layers check before building trace events."""

    __slots__ = ("on", "directory")

    def __init__(self) -> None:
        self.on = False
        self.directory: str | None = None


state = _State()
_timelines: dict[int, "Timeline"] = {}
_lock = threading.Lock()


def trace_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"trace-rank{rank}.json")


class Timeline:
    """The Chrome-trace events of one rank, appended to its file in chunks.

    Args:
        rank: global rank (the event ``pid``).
        directory: where ``trace-rank<rank>.json`` goes.
        flush_every: events buffered before a chunk is written (512 measured the same as
            8192 on the DDP benchmark once the chunks' writing time is counted).
    """

    def __init__(self, rank: int, directory: str, *, flush_every: int = 8192) -> None:
        self.rank = int(rank)
        self.path = trace_path(directory, self.rank)
        self.flush_every = max(1, int(flush_every))
        self.epoch_ns = now_ns()
        #: the one list events are appended to; ``flush`` takes from it, never replaces it (a
        #: thread appending to a replaced list would lose its event)
        self._buf: list[tuple[Any, ...]] = []
        self._tids: dict[Any, int] = {}
        self._local = _ThreadTid()
        #: the fixed part of recorder events, by what it depends on (see ``_text``)
        self._fixed: dict[tuple[Any, ...], str] = {}
        #: the fixed start of span/mark/counter events, by (ph, name, cat)
        self._heads: dict[tuple[str, str, str], str] = {}
        self._lock = threading.Lock()
        self._fh: Any = None
        self.closed = False
        #: nanoseconds spent in ``flush`` (formatting and writing events), for benchmarks
        self.flush_ns = 0

    # -- recording (any thread) ------------------------------------------------------------
    def _tid(self, ident: int | None = None) -> int:
        """Small tid of a thread. Keyed by the Thread object where it is the caller, because the
        OS reuses the idents of finished threads."""
        loc = self._local  # the calling thread's tid, cached in a thread-local (the hot path)
        tid = loc.tid
        if tid is not None and (ident is None or ident == loc.ident):
            return tid  # type: ignore[no-any-return]
        if ident is None or ident == threading.get_ident():
            loc.ident = threading.get_ident()
            loc.tid = tid = self._slow_tid(loc.ident)
            return tid
        return self._slow_tid(ident)

    def _slow_tid(self, ident: int) -> int:
        cur = threading.current_thread()
        key: Any = cur if ident == cur.ident else ident
        tid = self._tids.get(key)
        if tid is None:
            with self._lock:
                tid = self._tids.get(key)
                if tid is None:
                    tid = len(self._tids)
                    name = cur.name if key is cur else next(
                        (t.name for t in threading.enumerate() if t.ident == ident), str(ident))
                    self._buf.append(("M", "thread_name", "", 0, 0, tid, {"name": name}))
                    self._tids[key] = tid
        return tid

    def _add(self, ev: tuple[Any, ...]) -> None:
        self._buf.append(ev)
        if len(self._buf) >= self.flush_every:
            self.flush()

    def op_event(self, row: tuple[Any, ...], t1: int, st: str) -> None:
        """A recorder row (see ``Recorder``) that just ended, as an 'X' event."""
        self._add(("X", row[1], "collective" if row[3] else "p2p", row[7], t1 - row[7],
                   self._tid(row[8]), (row, st)))

    def complete(self, name: str, cat: str, t0_ns: int, t1_ns: int,
                 args: dict[str, Any] | None = None) -> None:
        """A span from ``t0_ns`` to ``t1_ns`` (``now_ns`` readings) on the calling thread."""
        self._add(("X", name, cat, t0_ns, t1_ns - t0_ns, self._tid(), args))

    def instant(self, name: str, cat: str, args: dict[str, Any] | None = None) -> None:
        self._add(("i", name, cat, now_ns(), 0, self._tid(), args))

    def counter(self, name: str, cat: str, values: dict[str, float]) -> None:
        self._add(("C", name, cat, now_ns(), 0, self._tid(), values))

    # -- writing ---------------------------------------------------------------------------
    def _text(self, ev: tuple[Any, ...]) -> str:
        """One event as JSON; recorder rows (the bulk) are formatted directly, off the hot path."""
        ph, name, cat, t, dur, tid, args = ev
        if ph != "M" and (args is None or type(args) is dict):  # spans, marks, counters
            head = self._heads.get((ph, name, cat))
            if head is None:
                head = (f'{{"name":{_js(name)},"ph":"{ph}","pid":{self.rank},"cat":{_js(cat)}'
                        + (',"s":"t"' if ph == "i" else ""))
                if len(self._heads) < 10_000:
                    self._heads[(ph, name, cat)] = head
            a = _args_json(args) if args else ""
            if ph == "X":
                return f'{head},"tid":{tid},"ts":{(t - self.epoch_ns) / 1e3:.3f},"dur":{dur / 1e3:.3f}{a}}}'
            return f'{head},"tid":{tid},"ts":{(t - self.epoch_ns) / 1e3:.3f}{a}}}'
        if not isinstance(args, tuple):
            out: dict[str, Any] = {"name": name, "ph": ph, "pid": self.rank, "tid": tid}
            if ph != "M":
                out["cat"] = cat
                out["ts"] = round((t - self.epoch_ns) / 1e3, 3)
                if ph == "X":
                    out["dur"] = round(dur / 1e3, 3)
                elif ph == "i":
                    out["s"] = "t"
            if args:
                out["args"] = args
            return _encode(out)
        row, st = args
        # Everything but seq, tid, ts and dur repeats from step to step (the same op, group,
        # shape, dtype, peer and line): that part is formatted once and looked up by one key.
        # (the line by its text's parts: hashing a code object costs more than the rest)
        w = row[9]
        key = (name, cat, row[2], row[4], row[5], row[6], st) if w is None else \
            (name, cat, row[2], row[4], row[5], row[6], st, w[0].co_filename, w[0].co_name, w[1])
        try:
            fixed = self._fixed.get(key)
        except TypeError:  # an unhashable shape or dtype: format it every time
            fixed, key = None, None
        if fixed is None:
            parts = [f'{{"name":{_js(name)},"ph":"X","pid":{self.rank},"cat":"{cat}",'
                     f'"args":{{{_group_json(row[2])},"state":{_js(st)}']
            if row[4] is not None:
                parts.append(',"shape":' + _shape_json(row[4]))
            if row[5] is not None:
                parts.append(',"dtype":' + _js(_dtype_name(row[5])))
            if row[6] >= 0:
                parts.append(f',"peer":{int(row[6])}')
            if w is not None:
                parts.append(',"line":' + _js(where_of(w)))
            parts.append(',"seq":')
            fixed = "".join(parts)
            if key is not None and len(self._fixed) < 100_000:
                self._fixed[key] = fixed
        return f'{fixed}{int(row[3])}}},"tid":{tid},"ts":{(t - self.epoch_ns) / 1e3:.3f},"dur":{dur / 1e3:.3f}}}'

    def _meta(self) -> dict[str, Any]:
        return {"format": FORMAT, "rank": self.rank, "job": job_id(),
                "epoch_wall_ns": self.epoch_ns + WALL_MINUS_MONO_NS,
                "clock_offset_ns": clock_offset_ns(self.rank), "host": socket.gethostname(),
                "pid": os.getpid()}

    def flush(self) -> None:
        """Append the buffered events to the file (opening it on the first flush).

        Tracing must not break the job it watches: a file that cannot be written (a full disk, a
        directory that cannot be created) is reported once on stderr, and this
        rank's timeline stops.
        """
        t0 = now_ns()
        try:
            self._write_chunk()
        finally:
            self.flush_ns += now_ns() - t0

    def _write_chunk(self) -> None:
        with self._lock:
            # Take the events from the one list every recorder appends to (never swap it: a
            # thread holding the old list would append to a list nobody writes any more).
            pending = self._buf
            buf = pending[:len(pending)]
            del pending[:len(buf)]
            if self.closed or (not buf and self._fh is not None):
                return
            try:
                if self._fh is None:
                    os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
                    # a fresh file renamed into place at once (a crash leaves what was flushed
                    # under the final name): a link planted there is replaced, never followed
                    self._fh = open_new(self.path, "w", perms=0o644)
                    head = [{"name": "process_name", "ph": "M", "pid": self.rank, "tid": 0,
                             "args": {"name": f"rank {self.rank}"}},
                            {"name": "process_sort_index", "ph": "M", "pid": self.rank, "tid": 0,
                             "args": {"sort_index": self.rank}},
                            {"name": "hpcdp_clock", "ph": "M", "pid": self.rank, "tid": 0,
                             "args": self._meta()}]
                    self._fh.write('{"traceEvents":[\n' + ",\n".join(json.dumps(e) for e in head))
                text = ",\n".join(self._text(e) for e in buf)
                if text:
                    self._fh.write(",\n" + text)
                self._fh.flush()
            except OSError as exc:
                self.closed = True
                if self._fh is not None:
                    try:
                        self._fh.close()
                    except OSError:
                        pass
                    self._fh = None
                print(f"hpcdp.trace: rank {self.rank}'s timeline stops: cannot write {self.path}: {exc}",
                      file=sys.stderr)

    def close(self) -> None:
        """Flush and finish the file as valid JSON; later events are dropped."""
        self.flush()
        with self._lock:
            if self.closed:
                return
            self.closed = True
            if self._fh is not None:
                self._fh.write('\n],"displayTimeUnit":"ms","otherData":' + json.dumps(self._meta()) + "}\n")
                self._fh.close()
                self._fh = None


# -- module state ---------------------------------------------------------------------------

def enabled() -> bool:
    """Whether ``HPCDP_TRACE`` timelines are being written."""
    return state.on


def timeline(rank: int | None = None) -> Timeline | None:
    """The timeline of ``rank`` (default: the current rank), or None when tracing is off."""
    if not state.on:
        return None
    r = current_rank() if rank is None else int(rank)
    tl = _timelines.get(r)
    if tl is None:
        with _lock:
            tl = _timelines.get(r)
            if tl is None:
                tl = _timelines[r] = Timeline(r, state.directory or trace_dir())
    return tl


def enable(directory: str | os.PathLike[str] | None = None) -> None:
    """Start writing timelines (what ``HPCDP_TRACE=1`` does at import); also records source lines."""
    with _lock:
        state.directory = trace_dir(directory)
        state.on = True
    timeline_factory[0] = lambda r: timeline(r)
    configure(lines=True)
    for rec in all_recorders():
        rec.attach_timeline(timeline(rec.rank))


def disable() -> None:
    """Stop tracing and close every timeline file."""
    timeline_factory[0] = None
    for rec in all_recorders():
        rec.attach_timeline(None)
    state.on = False
    configure(lines=setting("HPCDP_TRACE_LINES"))  # back to the cheap ring unless asked otherwise
    close_all()


def flush() -> None:
    """Write every buffered event of every rank in this process."""
    for tl in list(_timelines.values()):
        tl.flush()


def close_all() -> None:
    """Close every timeline (valid JSON on disk); events traced afterwards start the files anew."""
    with _lock:
        tls = list(_timelines.values())
        _timelines.clear()
    for tl in tls:
        try:
            tl.close()
        except OSError as exc:
            print(f"hpcdp.trace: could not finish {tl.path}: {exc}", file=sys.stderr)


class span:
    """Time a block or a function on the current rank's timeline (no-op when tracing is off).

    ``with span("backward", "ddp", step=3): ...`` or ``@span("load_batch", "data")``.
    One instance times one block at a time; as a decorator it makes a fresh one per call.
    """

    __slots__ = ("name", "cat", "args", "_t0", "_tl")

    def __init__(self, name: str, cat: str = "user", **args: Any) -> None:
        self.name, self.cat, self.args = name, cat, args
        self._tl: Timeline | None = None
        self._t0 = 0

    def __enter__(self) -> "span":
        if state.on:
            self._tl = timeline()
            self._t0 = now_ns()
        return self

    def __exit__(self, tp: Any, value: Any, tb: Any) -> bool:
        tl = self._tl
        if tl is not None:
            self._tl = None
            args = self.args if tp is None else dict(self.args, error=tp.__name__)
            tl.complete(self.name, self.cat, self._t0, now_ns(), args or None)
        return False

    def __call__(self, fn: F) -> F:
        name, cat, args = self.name, self.cat, self.args

        @functools.wraps(fn)
        def wrapper(*a: Any, **k: Any) -> Any:
            if not state.on:
                return fn(*a, **k)
            with span(name, cat, **args):
                return fn(*a, **k)

        return wrapper  # type: ignore[return-value]


def instant(name: str, cat: str = "mark", **args: Any) -> None:
    """A point in time on the current rank's timeline (e.g. "bucket 3 ready")."""
    if state.on:
        tl = timeline()
        if tl is not None:
            tl.instant(name, cat, args or None)


def counter(name: str, cat: str = "counter", **values: float) -> None:
    """A counter sample (e.g. buckets in flight, bytes written) on the current rank's timeline."""
    if state.on:
        tl = timeline()
        if tl is not None:
            tl.counter(name, cat, values)


atexit.register(lambda: disable() if state.on else close_all())  # no new files during shutdown
on_dump.append(flush)
if setting("HPCDP_TRACE"):
    enable()

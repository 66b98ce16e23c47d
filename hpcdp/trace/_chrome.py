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
    _process_rank, _tls, all_recorders, configure, current_rank, timeline_factory, where_of,
)

__all__ = [
    "FORMAT", "state", "Timeline", "enabled", "enable", "disable", "timeline", "flush", "close_all",
    "span", "instant", "counter", "trace_path",
]

FORMAT = "hpcdp.trace/1"
F = TypeVar("F", bound=Callable[..., Any])


def _make_encode() -> Callable[[Any], str]:
    """Compact JSON with ``default=str``, through one C encoder built once.

    ``JSONEncoder.encode`` builds a new C encoder on every call (more than the rest of
    recording an event costs); the timeline encodes one small dict per span or mark.
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
    try:
        hit = _shapes.get(shape)
    except TypeError:  # unhashable (a list)
        return json.dumps([int(v) for v in shape])
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
#: the three digits after a time's decimal point, by nanoseconds mod 1000
_MS = tuple(f"{i:03d}" for i in range(1000))
#: the types of args values whose text is kept by value (equal values, same text)
_PLAIN = frozenset((int, bool, str, type(None)))


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


_Texts = dict[tuple[Any, ...], tuple[str, Any]]
#: rank -> (recorder-event heads, span/mark/counter plans): see ``Timeline._render``
_rank_texts: dict[int, tuple[_Texts, _Texts]] = {}


def _event(ev: tuple[Any, ...]) -> tuple[Any, ...]:
    """A buffered event as ``(ph, name, cat, start_ns, dur_ns, tid, args)``: a recorder row's
    ``(row, end_ns, state, tid)`` (``Timeline.op_event``) as its 'X' event, args ``(row, state)``."""
    if len(ev) != 4:
        return ev
    row, t1, st, tid = ev
    return ("X", row[1], "collective" if row[3] else "p2p", row[7], t1 - row[7], tid, (row, st))


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
#: replaced whenever timelines come or go (``enable``, ``disable``, ``close_all``, a new one in
#: ``timeline``): a thread's cached ``_tls.here`` made under an older one is looked up again
_epoch = object()


def _new_epoch() -> None:
    global _epoch
    _epoch = object()


def _refresh_here() -> tuple[Any, ...] | None:
    """The calling thread's ``_tls.here``, looked up afresh (None when tracing is off):
    ``(timeline, tid, thread ident, epoch, process rank or None, buffer, flush_every)``.

    The process rank is kept for a thread bound to no rank (``bind_rank``): ``install`` may
    change it, and the entry is then stale. ``bind_rank`` clears the entry itself."""
    r = _tls.rank
    rank = _process_rank[0] if r is None else r
    tl = timeline(rank)
    if tl is None:
        return None
    h = (tl, tl._tid(), threading.get_ident(), _epoch, rank if r is None else None, tl._buf,
         tl.flush_every)
    _tls.here = h
    return h


def _here_entry() -> tuple[Any, ...] | None:
    """The calling thread's ``_tls.here``, looked up again (``_refresh_here``) when timelines
    came or went since it was made, or the process rank it was made under changed."""
    h = _tls.here
    if h is None or h[3] is not _epoch or (h[4] is not None and h[4] != _process_rank[0]):
        h = _refresh_here()
    return h


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
        #: the fixed part of recorder events and the code of their line, by what it depends on,
        #: and the fixed start of span/mark/counter events (see ``_render``): the rank's, shared
        #: with its earlier timelines (a job that traces in several stretches formats them once)
        self._fixed, self._heads = _rank_texts.setdefault(self.rank, ({}, {}))
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
        h = _tls.here  # this thread's tid here, when the thread that began the op ends it
        tid = h[1] if h is not None and h[0] is self and h[2] == row[8] else self._tid(row[8])
        buf = self._buf
        buf.append((row, t1, st, tid))  # the row holds the rest: made an event at flush (``_event``)
        if len(buf) >= self.flush_every:
            self.flush()

    def op_sink(self) -> tuple[list[tuple[Any, ...]], int]:
        """(the buffer, its flush size): where a ``Recorder`` appends what ``op_event`` would, a
        call fewer per operation (appends ``(row, end_ns, state, tid)``, then flushes when the
        buffer holds ``flush size`` events)."""
        return self._buf, self.flush_every

    def _mine(self) -> int:
        """The calling thread's tid (``_tid()``'s common case first)."""
        tid = self._local.tid
        return self._tid() if tid is None else tid  # type: ignore[no-any-return]

    def complete(self, name: str, cat: str, t0_ns: int, t1_ns: int,
                 args: dict[str, Any] | None = None) -> None:
        """A span from ``t0_ns`` to ``t1_ns`` (``now_ns`` readings) on the calling thread."""
        self._add(("X", name, cat, t0_ns, t1_ns - t0_ns, self._mine(), args))

    def instant(self, name: str, cat: str, args: dict[str, Any] | None = None) -> None:
        self._add(("i", name, cat, now_ns(), 0, self._mine(), args))

    def counter(self, name: str, cat: str, values: dict[str, float]) -> None:
        self._add(("C", name, cat, now_ns(), 0, self._mine(), values))

    # -- writing ---------------------------------------------------------------------------
    def _render(self, events: list[tuple[Any, ...]]) -> str:
        """``events`` as JSON text, one per line, at flush time (off the hot path).

        Everything of an event but its times (and an op's seq, a mark's args) repeats from step
        to step: that part is formatted once, kept by what it depends on, and each event is one
        f-string around it. Times are written from integer nanoseconds ("us.nnn", the digits of
        ``ns / 1e3`` to three places, without formatting a float). Metadata, unusual events and
        times before the epoch are formatted one by one (``_literal``).
        """
        epoch = self.epoch_ns
        plans, fixed_ops, ms = self._heads, self._fixed, _MS
        out: list[str] = []
        add = out.append
        for ev in events:
            if len(ev) == 4:  # a recorder row (the bulk): (row, end_ns, state, tid)
                row, t1, st, tid = ev
                t = row[7] - epoch
                dur = t1 - row[7]
                if t < 0 or dur < 0:
                    add(self._literal(_event(ev)))
                    continue
                name, cat = row[1], "collective" if row[3] else "p2p"
                w = row[9]
                # the dtype and the line by their ids (hashing a numpy dtype or a code object
                # costs more than the rest); the entry keeps both, so an id is never matched to
                # another object. ``w`` is the one ``(code, line)`` tuple of its call site.
                key = (name, cat, row[2], row[4], id(row[5]), row[6], st, tid, id(w))
                try:
                    hit = fixed_ops.get(key)
                except TypeError:  # an unhashable shape: made every time
                    hit, key = None, None
                if hit is None or hit[2] is not w or hit[3] is not row[5]:
                    hit = (self._op_head(name, cat, row, st), f'}},"tid":{tid},"ts":', w, row[5])
                    if key is not None and len(fixed_ops) < 100_000:
                        fixed_ops[key] = hit
                add(f'{hit[0]}{int(row[3])}{hit[1]}{t // 1000}.{ms[t % 1000]},'
                    f'"dur":{dur // 1000}.{ms[dur % 1000]}}}')
                continue
            if len(ev) == 10:  # a ``Phase``'s entry: its span, inner span and marks
                add(ev[0]._text(self, ev))
                continue
            ph, name, cat, t, dur, tid, args = ev
            t -= epoch
            if t < 0 or dur < 0 or ph == "M" or (args is not None and type(args) is not dict):
                add(self._literal(ev))
            else:  # spans, marks, counters
                # args (DDP's bucket marks, a backward's sync flag) repeat too: by value and type
                key = (ph, name, cat, tid, *args.items(), *map(type, args.values())) if args else \
                    (ph, name, cat, tid)
                try:
                    plan = plans.get(key)
                except TypeError:  # an unhashable value: formatted every time
                    plan, key = None, None
                if plan is None:
                    plan = self._span_plan(ph, name, cat, tid, args)
                    # values equal across types (True == 1) are told apart by the types in the
                    # key; those that differ within a type (0.0 and -0.0) are not kept, nor names
                    # that are not strings (1 and True would be)
                    if key is not None and (not args or (_PLAIN.issuperset(map(type, args.values()))
                                                         and all(type(k) is str for k in args))):
                        if len(plans) >= 10_000:
                            plans.clear()
                        plans[key] = plan
                tq, tr = divmod(t, 1000)
                if ph == "X":
                    dq, dr = divmod(dur, 1000)
                    add(f'{plan[0]}{tq}.{ms[tr]},"dur":{dq}.{ms[dr]}{plan[1]}}}')
                else:
                    add(f'{plan[0]}{tq}.{ms[tr]}{plan[1]}}}')
        return ",\n".join(out)

    def _span_plan(self, ph: str, name: str, cat: str, tid: int,
                   args: dict[Any, Any] | None) -> tuple[str, str]:
        """(a span's/mark's/counter's text up to its time, the text of its args)."""
        head = (f'{{"name":{_js(name)},"ph":"{ph}","pid":{self.rank},"cat":{_js(cat)}'
                + (',"s":"t"' if ph == "i" else "") + f',"tid":{tid},"ts":')
        return head, _args_json(args) if args else ""

    def _literal(self, ev: tuple[Any, ...]) -> str:
        """One event's text, formatted on its own (the uncommon events)."""
        ph, name, cat, t, dur, tid, args = ev
        if ph == "M":
            # a thread's name (one per thread and timeline, so one per traced stretch of a job):
            # its text as the encoder writes it, without the encoder (whose code, cold at a
            # flush, cost more than the chunk's other events together)
            v = args.get("name") if type(args) is dict and len(args) == 1 else None
            if type(v) is str and type(name) is str and type(tid) is int:
                return (f'{{"name":{_quote(name)},"ph":"M","pid":{self.rank},"tid":{tid},'
                        f'"args":{{"name":{_quote(v)}}}}}')
            return self._text(ev)
        if args is not None and type(args) not in (tuple, dict):
            return self._text(ev)
        # a time before the epoch (an operation begun before tracing was): floats keep the sign
        ts = f'"ts":{(t - self.epoch_ns) / 1e3:.3f}' + (f',"dur":{dur / 1e3:.3f}' if ph == "X" else "")
        if type(args) is tuple:
            row, st = args
            return f'{self._op_head(name, cat, row, st)}{int(row[3])}}},"tid":{tid},{ts}}}'
        return (f'{{"name":{_js(name)},"ph":"{ph}","pid":{self.rank},"cat":{_js(cat)}'
                + (',"s":"t"' if ph == "i" else "") + f',"tid":{tid},{ts}'
                + (_args_json(args) if args else "") + "}")

    def _op_head(self, name: str, cat: str, row: tuple[Any, ...], st: str) -> str:
        """A recorder event's text up to its seq: what repeats from step to step."""
        parts = [f'{{"name":{_js(name)},"ph":"X","pid":{self.rank},"cat":"{cat}",'
                 f'"args":{{{_group_json(row[2])},"state":{_js(st)}']
        if row[4] is not None:
            parts.append(',"shape":' + _shape_json(row[4]))
        if row[5] is not None:
            parts.append(',"dtype":' + _js(_dtype_name(row[5])))
        if row[6] >= 0:
            parts.append(f',"peer":{int(row[6])}')
        if row[9] is not None:
            parts.append(',"line":' + _js(where_of(row[9])))
        parts.append(',"seq":')
        return "".join(parts)

    def _text(self, ev: tuple[Any, ...]) -> str:
        """One event as JSON; metadata and events whose args are not a dict through the encoder."""
        ph, name, cat, t, dur, tid, args = _event(ev)
        if ph != "M" and (args is None or type(args) in (tuple, dict)):
            return self._render([ev])
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
        self._timed_write(False)

    def close(self) -> None:
        """Flush and finish the file as valid JSON; later events are dropped."""
        self._timed_write(True)

    def _timed_write(self, last: bool) -> None:
        t0 = now_ns()
        try:
            self._write_chunk(last)
        finally:
            self.flush_ns += now_ns() - t0

    def _write_chunk(self, last: bool) -> None:
        """Write the buffered events (and, ``last``, the file's end, then close it): one write."""
        with self._lock:
            # Take the events from the one list every recorder appends to (never swap it: a
            # thread holding the old list would append to a list nobody writes any more).
            pending = self._buf
            buf = pending[:len(pending)]
            del pending[:len(buf)]
            if self.closed or (not buf and self._fh is not None and not last):
                return
            try:
                parts = []
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
                    parts.append('{"traceEvents":[\n' + ",\n".join(json.dumps(e) for e in head))
                if buf:
                    parts.append(",\n" + self._render(buf))
                if last:
                    parts.append('\n],"displayTimeUnit":"ms","otherData":' + json.dumps(self._meta()) + "}\n")
                self._fh.write("".join(parts))
                if last:
                    self.closed = True
                    fh, self._fh = self._fh, None
                    fh.close()
                else:
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
                _new_epoch()
    return tl


def enable(directory: str | os.PathLike[str] | None = None) -> None:
    """Start writing timelines (what ``HPCDP_TRACE=1`` does at import); also records source lines."""
    with _lock:
        state.directory = trace_dir(directory)
        state.on = True
        _new_epoch()
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
        _new_epoch()
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

    __slots__ = ("name", "cat", "args", "_t0", "_h")

    def __init__(self, name: str, cat: str = "user", **args: Any) -> None:
        self.name, self.cat, self.args = name, cat, args
        self._h: tuple[Any, ...] | None = None  # ``_tls.here`` while timing
        self._t0 = 0

    def __enter__(self) -> "span":
        if state.on:  # the thread's timeline and tid
            self._h = _here_entry()
            self._t0 = now_ns()
        return self

    def __exit__(self, tp: Any, value: Any, tb: Any) -> bool:
        h = self._h
        if h is not None:
            t1 = now_ns()
            self._h = None
            args = self.args if tp is None else dict(self.args, error=tp.__name__)
            buf = h[5]  # ``Timeline.complete`` inlined
            buf.append(("X", self.name, self.cat, self._t0, t1 - self._t0, h[1], args or None))
            if len(buf) >= h[6]:
                h[0].flush()
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


def _here() -> Timeline | None:
    """The current rank's timeline (``timeline()``, its common case first); None when off."""
    r = _tls.rank
    tl = _timelines.get(_process_rank[0] if r is None else r)
    return tl if tl is not None else timeline()


def instant(name: str, cat: str = "mark", **args: Any) -> None:
    """A point in time on the current rank's timeline (e.g. "bucket 3 ready")."""
    if state.on:
        h = _here_entry()  # (``Timeline.instant`` inlined)
        if h is None:
            return
        buf = h[5]
        buf.append(("i", name, cat, now_ns(), 0, h[1], args or None))
        if len(buf) >= h[6]:
            h[0].flush()


def counter(name: str, cat: str = "counter", **values: float) -> None:
    """A counter sample (e.g. buckets in flight, bytes written) on the current rank's timeline."""
    if state.on:
        tl = _here()
        if tl is not None:
            tl.counter(name, cat, values)


atexit.register(lambda: disable() if state.on else close_all())  # no new files during shutdown
on_dump.append(flush)
if setting("HPCDP_TRACE"):
    enable()

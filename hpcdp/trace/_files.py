"""Reading flight records and timelines back: untrusted input, checked before use.

Only regular files named ``flight-rank<N>.json`` / ``trace-rank<N>.json`` directly inside the
directory the user named are read (no symlinks, no paths taken from file contents), each at most
``MAX_BYTES`` (flight records) or ``MAX_TIMELINE_BYTES``; everything is JSON (nothing is
executed), and every field is type-checked so a damaged or hostile file gives a clear
``ValueError`` naming the file, not a crash later.

Memory: a JSON document loaded whole costs many times its size in Python objects (a list of small
integers, 2 bytes each in the file, costs 8 to 44 bytes each as a list and again as a tuple). So a
flight record's entries are decoded one at a time and turned straight into compact ``Entry``
objects (slots; repeated strings, integers and tuples shared), and the caps are set so that what a
file of the largest size accepted costs stays within what a login node can hold.
"""
from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass, field
from typing import Any, Iterator

from ._recorder import STATES

__all__ = [
    "MAX_BYTES", "MAX_TIMELINE_BYTES", "Entry", "FlightRecord", "list_rank_files", "read_json", "load_flight_records",
    "load_timeline", "clean", "read_flight_record",
]

#: largest flight record read (a full ring of 2048 entries with source lines is ~0.6 MiB; the
#: reader holds at most ~8x a record's size, however it is built)
MAX_BYTES = 128 << 20
#: largest timeline read (``merge``/``plot`` load its events whole: ~8-10x its size in memory)
MAX_TIMELINE_BYTES = 256 << 20
#: largest world size a record may claim (the analyzer makes per-rank lists of this length)
MAX_WORLD = 1 << 20
_INT64 = 1 << 63
_FLIGHT_FORMAT = "hpcdp.flight/1"
_FINISHED = ("finalize", "exit")
_CTRL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def clean(text: Any, limit: int = 300) -> str:
    """``text`` safe to print on a terminal: control characters escaped, length capped."""
    s = _CTRL.sub(lambda m: f"\\x{ord(m.group()):02x}", str(text))
    return s if len(s) <= limit else s[: limit - 3] + "..."


def list_rank_files(directory: str, prefix: str) -> dict[int, str]:
    """``{rank: path}`` of regular files ``<prefix><rank>.json`` in ``directory`` (symlinks skipped)."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{directory!r} is not a directory")
    pat = re.compile(re.escape(prefix) + r"(\d{1,9})\.json")
    out: dict[int, str] = {}
    with os.scandir(directory) as it:
        for de in it:
            m = pat.fullmatch(de.name)
            if m and de.is_file(follow_symlinks=False):
                out[int(m.group(1))] = os.path.join(directory, de.name)
    return dict(sorted(out.items()))


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB" if n >= 1 << 20 else f"{n} bytes"


def read_text(path: str, limit: int) -> str:
    """The UTF-8 text of ``path``, a regular file of at most ``limit`` bytes (the error says the cap)."""
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path}: not a regular file")
    if st.st_size > limit:
        raise ValueError(f"{path}: {st.st_size} bytes, more than the {limit} ({_mib(limit)}) this reader "
                         "accepts (the cap keeps its memory bounded)")
    with open(path, "rb") as fh:
        raw = fh.read(limit + 1)
    if len(raw) > limit:
        raise ValueError(f"{path}: grew past the {limit} ({_mib(limit)}) this reader accepts while being read")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc})") from None


def _bad_json(path: str, exc: BaseException) -> ValueError:
    return ValueError(f"{path}: not valid JSON ({type(exc).__name__}: {clean(exc, 200)})")


def read_json(path: str, *, repair_trace: bool = False, limit: int | None = None) -> Any:
    """Parse ``path`` (a regular file of at most ``limit`` bytes, default ``MAX_TIMELINE_BYTES``).

    ``repair_trace``: a timeline cut short by a crash (``{"traceEvents":[`` ... without its
    closing) is closed before parsing.
    """
    text = read_text(path, MAX_TIMELINE_BYTES if limit is None else limit)
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:  # also nesting too deep, integers too long
        if repair_trace and isinstance(exc, json.JSONDecodeError):
            body = text.rstrip()
            if body.startswith('{"traceEvents":['):
                body = body.rstrip(",")
                try:
                    return json.loads(body + "]}")
                except (ValueError, RecursionError):
                    pass
        raise _bad_json(path, exc) from None


def _int(v: Any, what: str, lo: int | None = None, hi: int = _INT64) -> int:
    """``v`` checked to be an integer in ``[lo, hi)`` (int64 at most: times, ids, ranks)."""
    if not isinstance(v, int) or isinstance(v, bool):
        raise ValueError(f"{what} must be an integer, got {clean(repr(v), 60)}")
    if not (-_INT64 if lo is None else lo) <= v < hi:
        raise ValueError(f"{what} must be in [{-_INT64 if lo is None else lo}, {hi}), got {clean(v, 60)}")
    return v


def _opt_str(v: Any, what: str, limit: int = 4096) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str):
        raise ValueError(f"{what} must be a string, got {clean(repr(v), 60)}")
    return v[:limit]


class _Shared(dict):
    """One object per distinct value of a record (entries repeat groups, ops, lines and rank
    lists): ``shared(v)`` is the first object equal to ``v`` that was seen."""

    def __call__(self, v: Any) -> Any:
        return self.setdefault(v, v)


def _int_list(v: Any, what: str, lo: int | None = None, hi: int = _INT64,
              shared: _Shared | None = None) -> tuple[int, ...] | None:
    if v is None:
        return None
    if not isinstance(v, list) or len(v) > 1 << 20:
        raise ValueError(f"{what} must be a list of integers")
    if not all(type(x) is int for x in v):  # checked at C speed; the slow path names the culprit
        return tuple(_int(x, what, lo, hi) for x in v)
    low = -_INT64 if lo is None else lo
    if v and (min(v) < low or max(v) >= hi):
        return tuple(_int(x, what, lo, hi) for x in v)
    if shared is None:
        return tuple(v)
    return shared(tuple(map(shared.setdefault, v, v)))


@dataclass(frozen=True, slots=True)
class Entry:
    """One operation of a rank's flight record; ``start``/``end`` are on the reference clock (ns)."""

    rank: int
    id: int
    seq: int
    op: str
    group: str
    group_ranks: tuple[int, ...] | None
    shape: tuple[int, ...] | None
    dtype: str | None
    peer: int
    start: int
    end: int | None
    state: str
    line: str | None
    thread: int

    def call(self) -> str:
        """``allreduce #5 on group world`` (p2p: ``recv(peer 3) on group world``)."""
        if self.seq:
            return f"{clean(self.op, 60)} #{self.seq} on group {clean(self.group, 80)}"
        peer = f"(peer {self.peer})" if self.peer >= 0 else ""
        return f"{clean(self.op, 60)}{peer} on group {clean(self.group, 80)}"

    def signature(self) -> tuple[Any, ...]:
        return (self.op, self.shape, self.dtype, self.peer)


@dataclass
class FlightRecord:
    """One rank's dump."""

    path: str
    rank: int
    world_size: int
    job: str
    host: str
    pid: int
    reason: str
    dumped_at: int
    entries: list[Entry]
    threads: list[dict[str, Any]] = field(default_factory=list)
    capacity: int = 0
    total_ops: int = 0
    #: "finalize" or "exit" when the rank wrote this record as it finished (see ``_dump``), else None
    finished: str | None = None
    finished_at: int | None = None
    #: every reason this process dumped for, oldest first (an uncaught exception shows here)
    reasons: list[str] = field(default_factory=list)


def _entry(d: Any, rank: int, world: int, offset: int, where: str, shared: _Shared | None = None) -> Entry:
    if not isinstance(d, dict):
        raise ValueError(f"{where} is not an object")
    sh: Any = shared if shared is not None else (lambda v: v)
    state = d.get("state")
    if state not in STATES:
        raise ValueError(f"{where}: state must be one of {STATES}, got {clean(repr(state), 60)}")
    end = d.get("end_ns")
    op = _opt_str(d.get("op"), f"{where}.op", 200)
    group = _opt_str(d.get("group"), f"{where}.group", 400)
    if op is None or group is None:
        raise ValueError(f"{where}: op and group are required")
    return Entry(
        rank=rank, id=_int(d.get("id"), f"{where}.id", 0), seq=_int(d.get("seq"), f"{where}.seq", 0),
        op=sh(op), group=sh(group),
        group_ranks=_int_list(d.get("group_ranks"), f"{where}.group_ranks", 0, world, shared),
        shape=_int_list(d.get("shape"), f"{where}.shape", shared=shared),
        dtype=sh(_opt_str(d.get("dtype"), f"{where}.dtype", 60)),
        peer=_int(d.get("peer", -1), f"{where}.peer"),
        start=_int(d.get("start_ns"), f"{where}.start_ns") + offset,
        end=None if end is None else _int(end, f"{where}.end_ns") + offset,
        state=sh(state), line=sh(_opt_str(d.get("line"), f"{where}.line")),
        thread=_int(d.get("thread", 0), f"{where}.thread"),
    )


def _header(doc: Any, path: str) -> tuple[int, int, int]:
    """(rank, world size, clock offset) of a record's top level, checked."""
    if not isinstance(doc, dict) or doc.get("format") != _FLIGHT_FORMAT:
        raise ValueError(f"{path}: not an hpcdp flight record (format {_FLIGHT_FORMAT!r} expected)")
    rank = _int(doc.get("rank"), f"{path}: rank", 0)
    world = _int(doc.get("world_size"), f"{path}: world_size", 1, MAX_WORLD + 1)
    if rank >= world:
        raise ValueError(f"{path}: rank {rank} is not below world_size {world}")
    return rank, world, _int(doc.get("clock_offset_ns", 0), f"{path}: clock_offset_ns")


def _record(doc: dict[str, Any], path: str, rank: int, world: int, offset: int,
            entries: list[Entry]) -> FlightRecord:
    entries.sort(key=lambda e: e.id)
    threads = [t for t in doc.get("threads", []) if isinstance(t, dict)] if isinstance(doc.get("threads"), list) else []
    finished = doc.get("finished")
    if finished is not None and finished not in _FINISHED:
        raise ValueError(f"{path}: finished must be one of {_FINISHED} or null, got {clean(repr(finished), 60)}")
    fin_at = doc.get("finished_at_ns")
    raw_reasons = doc.get("reasons")
    reasons = [clean(r, 400) for r in raw_reasons[:20] if isinstance(r, str)] if isinstance(raw_reasons, list) else []
    return FlightRecord(
        path=path, rank=rank, world_size=world, job=clean(doc.get("job", ""), 200), host=clean(doc.get("host", "?"), 100),
        pid=_int(doc.get("pid", 0), f"{path}: pid"), reason=clean(doc.get("reason", ""), 400),
        dumped_at=_int(doc.get("dumped_at_ns", 0), f"{path}: dumped_at_ns") + offset,
        entries=entries, threads=threads, capacity=_int(doc.get("capacity", 0), f"{path}: capacity", 0),
        total_ops=_int(doc.get("total_ops", 0), f"{path}: total_ops", 0),
        finished=finished, reasons=reasons,
        finished_at=None if fin_at is None else _int(fin_at, f"{path}: finished_at_ns") + offset,
    )


# -- reading a record without holding its JSON tree -----------------------------------------
_WS = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()


def _ws(text: str, i: int) -> int:
    return _WS.match(text, i).end()  # type: ignore[union-attr]


def _array_items(text: str, i: int, end: list[int] | None = None) -> Iterator[Any]:
    """Each item of the JSON array starting at ``text[i] == "["``, decoded one at a time;
    ``end[0]`` is set to the index after its ``]``."""
    i = _ws(text, i + 1)
    if not text.startswith("]", i):
        while True:
            item, i = _DECODER.raw_decode(text, i)
            yield item
            del item
            i = _ws(text, i)
            if text.startswith(",", i):
                i = _ws(text, i + 1)
            elif text.startswith("]", i):
                break
            else:
                raise json.JSONDecodeError("expecting ',' or ']'", text, i)
    if end is not None:
        end[0] = i + 1


class _NotAnObject(Exception):
    pass


def _scan_object(text: str, stream: str) -> tuple[dict[str, Any], int | None]:
    """The top-level object of ``text`` without its ``stream`` member, and where that member's
    array starts (its items are checked for syntax here, one at a time, and not kept)."""
    i = _ws(text, 0)
    if not text.startswith("{", i):
        raise _NotAnObject()
    doc: dict[str, Any] = {}
    at: int | None = None
    i = _ws(text, i + 1)
    if text.startswith("}", i):
        i += 1
    else:
        while True:
            if not text.startswith('"', i):
                raise json.JSONDecodeError("expecting a property name in double quotes", text, i)
            key, i = _DECODER.raw_decode(text, i)
            i = _ws(text, i)
            if not text.startswith(":", i):
                raise json.JSONDecodeError("expecting ':'", text, i)
            i = _ws(text, i + 1)
            if key == stream and text.startswith("[", i):
                at = i
                doc.pop(key, None)
                end = [i]
                for _ in _array_items(text, i, end):
                    pass
                i = end[0]
            else:
                doc[key], i = _DECODER.raw_decode(text, i)
                if key == stream:
                    at = None
            i = _ws(text, i)
            if text.startswith(",", i):
                i = _ws(text, i + 1)
            elif text.startswith("}", i):
                i += 1
                break
            else:
                raise json.JSONDecodeError("expecting ',' or '}'", text, i)
    if _ws(text, i) != len(text):
        raise json.JSONDecodeError("extra data", text, i)
    return doc, at


def read_flight_record(path: str) -> FlightRecord:
    """Read and check one ``flight-rank<N>.json`` (at most ``MAX_BYTES``).

    Its entries are decoded one at a time, each turned into an ``Entry`` at once: the memory
    held is the file's text plus the entries, never the whole JSON tree as well.
    """
    text = read_text(path, MAX_BYTES)
    try:
        doc, at = _scan_object(text, "entries")
    except _NotAnObject:
        raise ValueError(f"{path}: not an hpcdp flight record (a JSON object of format {_FLIGHT_FORMAT!r} "
                         "expected)") from None
    except (ValueError, RecursionError) as exc:  # also nesting too deep, integers too long
        raise _bad_json(path, exc) from exc
    rank, world, offset = _header(doc, path)
    if at is None:
        raise ValueError(f"{path}: entries must be a list")
    shared = _Shared()
    items = _array_items(text, at)   # its syntax was checked by the scan
    entries = [_entry(d, rank, world, offset, f"{path}: entries[{n}]", shared) for n, d in enumerate(items)]
    del text
    return _record(doc, path, rank, world, offset, entries)


def load_flight_records(directory: str, stale: list[int] | None = None) -> dict[int, FlightRecord]:
    """The ``flight-rank<N>.json`` files of ``directory``'s newest job, checked, by rank.

    Records an earlier job left there (another job id) are set aside; their ranks are appended
    to ``stale`` when given.
    """
    out: dict[int, FlightRecord] = {}
    for rank, path in list_rank_files(directory, "flight-rank").items():
        rec = read_flight_record(path)
        if rec.rank != rank:
            raise ValueError(f"{path}: the file name says rank {rank} but it holds rank {rec.rank}")
        out[rank] = rec
    if not out:
        raise FileNotFoundError(f"no flight records (flight-rank<N>.json) in {directory!r}")
    newest = max(out.values(), key=lambda r: r.dumped_at).job
    old = sorted(r for r, rec in out.items() if rec.job != newest)
    if stale is not None:
        stale.extend(old)
    return {r: rec for r, rec in out.items() if rec.job == newest}


def load_timeline(path: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(events, metadata) of one Chrome-trace file, repaired if it was cut short."""
    doc = read_json(path, repair_trace=True)
    meta: dict[str, Any] = {}
    if isinstance(doc, list):
        events = doc
    elif isinstance(doc, dict) and isinstance(doc.get("traceEvents"), list):
        events = doc["traceEvents"]
        if isinstance(doc.get("otherData"), dict):
            meta = dict(doc["otherData"])
    else:
        raise ValueError(f"{path}: not a Chrome trace (a list of events or {{'traceEvents': [...]}})")
    good = [e for e in events if isinstance(e, dict) and isinstance(e.get("ph"), str)]
    if not meta:
        for e in good:
            if e.get("ph") == "M" and e.get("name") == "hpcdp_clock" and isinstance(e.get("args"), dict):
                meta = dict(e["args"])
    return good, meta

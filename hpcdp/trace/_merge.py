"""``python -m hpcdp.trace merge DIR``: every rank's timeline in one Chrome-trace file for Perfetto.

Each rank's times are moved onto the reference clock (its epoch plus the offset that
``estimate_clock_offset`` measured), shifted so the job starts at 0, and sorted. Operations that
overlap without nesting on one thread (async collectives in flight together) are moved to extra
lanes of that rank, because trace viewers draw a thread's 'X' events as a strict stack. Without
``HPCDP_TRACE`` timelines, the flight records are drawn instead.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any

from .._atomic import atomic_write
from ._files import list_rank_files, load_flight_records, load_timeline

__all__ = ["merged_events", "merge", "assign_lanes", "clean_event"]

_PHASES = frozenset("XiICMBEbenf")
_EPS_US = 1e-3
#: largest |ts| or dur accepted, in microseconds (~30 years): beyond it float arithmetic overflows
_MAX_US = 1e15
_INT64 = 1 << 63


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    f = float(v)
    return f if math.isfinite(f) and abs(f) <= _MAX_US else None


def _small_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and -_INT64 <= v < _INT64


def clean_event(e: Any, pid: int | None = None) -> dict[str, Any] | None:
    """A checked copy of an untrusted Chrome-trace event (``pid`` given: that rank's), or None to
    drop it: a known phase, a string name, integer pid/tid, finite bounded ``ts`` and ``dur``."""
    if not isinstance(e, dict):
        return None
    ph = e.get("ph")
    if not isinstance(ph, str) or len(ph) != 1 or ph not in _PHASES:
        return None
    if pid is None:
        pid = e.get("pid")
        if not _small_int(pid):
            return None
    name = e.get("name")
    ev: dict[str, Any] = {"name": name if isinstance(name, str) else str(name), "ph": ph, "pid": pid}
    tid = e.get("tid", 0)
    ev["tid"] = tid if _small_int(tid) else 0
    if isinstance(e.get("args"), dict):
        ev["args"] = e["args"]
    if ph == "M":
        return ev
    ts = _num(e.get("ts"))
    if ts is None:
        return None
    if isinstance(e.get("cat"), str):
        ev["cat"] = e["cat"]
    ev["ts"] = ts
    if ph == "X":
        dur = _num(e.get("dur"))
        if dur is None or dur < 0:
            return None
        ev["dur"] = dur
    for k in ("s", "id"):
        if isinstance(e.get(k), str) or _small_int(e.get(k)):
            ev[k] = e[k]
    return ev


def _rank_events(rank: int, path: str) -> tuple[list[dict[str, Any]], int, tuple[str, int]]:
    """(events, clock offset used, (job id, epoch)); ``_base`` + ``ts`` * 1000 is an event's time on the
    reference clock in ns (kept apart: a float of epoch nanoseconds would lose 256 ns)."""
    events, meta = load_timeline(path)
    epoch = meta.get("epoch_wall_ns", 0)
    offset = meta.get("clock_offset_ns", 0)
    if not _small_int(epoch) or not _small_int(offset):
        raise ValueError(f"{path}: epoch_wall_ns / clock_offset_ns must be 64-bit integers")
    out = []
    for e in events:
        ev = clean_event(e, rank)
        if ev is None or (ev["ph"] == "M" and ev["name"] == "hpcdp_clock"):
            continue
        if ev["ph"] != "M":
            ev["_base"] = epoch + offset
        out.append(ev)
    return out, offset, (str(meta.get("job", "")), epoch)


def _flight_events(directory: str) -> tuple[dict[int, list[dict[str, Any]]], dict[int, int]]:
    """Timelines drawn from flight records (only the last N operations of each rank)."""
    per: dict[int, list[dict[str, Any]]] = {}
    offs: dict[int, int] = {}
    for r, rec in load_flight_records(directory).items():
        tids: dict[int, int] = {}
        evs: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": r, "tid": 0,
                                      "args": {"name": f"rank {r}"}}]
        for e in rec.entries:
            tid = tids.setdefault(e.thread, len(tids))
            end = e.end if e.end is not None else max(rec.dumped_at, e.start)
            args: dict[str, Any] = {"seq": e.seq, "group": e.group, "state": e.state}
            for k in ("shape", "dtype", "line"):
                if getattr(e, k) is not None:
                    args[k] = list(getattr(e, k)) if k == "shape" else getattr(e, k)
            if e.peer >= 0:
                args["peer"] = e.peer
            evs.append({"name": e.op, "ph": "X", "cat": "collective" if e.seq else "p2p", "pid": r,
                        "tid": tid, "ts": 0.0, "_base": e.start, "dur": (end - e.start) / 1e3, "args": args})
        per[r] = evs
        offs[r] = 0
    return per, offs


#: extra lanes per thread at most; beyond, overlapping events share the last lane (a damaged or
#: hostile trace of n such events would otherwise cost n lanes and n^2 time)
MAX_LANES = 32


def assign_lanes(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Move 'X' events that overlap without nesting on one (pid, tid) to extra tids of that pid
    (at most ``MAX_LANES`` per thread)."""
    by_thread: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for e in events:
        if e["ph"] == "X":
            by_thread.setdefault((e["pid"], e["tid"]), []).append(e)
    used: dict[int, set[int]] = {}
    for e in events:
        used.setdefault(e["pid"], set()).add(e["tid"])
    extra: list[dict[str, Any]] = []
    for (pid, tid), evs in sorted(by_thread.items()):
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        lanes: list[tuple[int, list[float]]] = [(tid, [])]
        for e in evs:
            start, end = e["ts"], e["ts"] + e["dur"]
            for lane_tid, stack in lanes:
                while stack and stack[-1] <= start + _EPS_US:
                    stack.pop()
                if not stack or end <= stack[-1] + _EPS_US:
                    stack.append(end)
                    e["tid"] = lane_tid
                    break
            else:
                if len(lanes) > MAX_LANES:
                    e["tid"] = lanes[-1][0]
                    continue
                new = max(used[pid]) + 1
                used[pid].add(new)
                lanes.append((new, [end]))
                e["tid"] = new
                extra.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": new,
                              "args": {"name": f"thread {tid}: overlapping ops {len(lanes) - 1}"}})
    return events + extra


def merged_events(directory: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(events sorted by time with ``ts``/``dur`` in microseconds from the job's start, metadata)."""
    files = list_rank_files(directory, "trace-rank")
    if files:
        per, offs, jobs = {}, {}, {}
        for r, path in files.items():
            per[r], offs[r], jobs[r] = _rank_events(r, path)
        newest = jobs[max(jobs, key=lambda r: jobs[r][1])][0]  # an earlier job's files are set aside
        per = {r: evs for r, evs in per.items() if jobs[r][0] == newest}
        offs = {r: o for r, o in offs.items() if r in per}
        source = "timelines"
    else:
        per, offs = _flight_events(directory)
        source = "flight records"
    timed = [e for evs in per.values() for e in evs if e["ph"] != "M"]
    t0 = min((e["_base"] + int(e["ts"] * 1e3) for e in timed), default=0)
    for e in timed:
        e["ts"] = round((e.pop("_base") - t0) / 1e3 + e["ts"], 3)
    meta_events = [e for evs in per.values() for e in evs if e["ph"] == "M"]
    for r in per:
        meta_events.append({"name": "process_sort_index", "ph": "M", "pid": r, "tid": 0,
                            "args": {"sort_index": r}})
    timed = assign_lanes(timed)
    meta_events += [e for e in timed if e["ph"] == "M"]
    timed = [e for e in timed if e["ph"] != "M"]
    timed.sort(key=lambda e: (e["ts"], e["pid"], -e.get("dur", 0.0)))
    meta = {"format": "hpcdp.merged/1", "source": source, "ranks": sorted(per),
            "clock_offsets_ns": {str(r): o for r, o in sorted(offs.items())}, "start_wall_ns": int(t0)}
    return meta_events + timed, meta


def merge(directory: str, out: str | None = None) -> str:
    """Write ``out`` (default ``DIR/merged-trace.json``): one Chrome trace of every rank; returns its path."""
    events, meta = merged_events(directory)
    out = out or os.path.join(directory, "merged-trace.json")
    # a fresh exclusive temporary renamed onto ``out``: links planted in DIR are never followed
    with atomic_write(out, "w") as fh:
        fh.write('{"traceEvents":[\n')
        fh.write(",\n".join(json.dumps(e, default=str) for e in events))
        fh.write('\n],"displayTimeUnit":"ms","otherData":' + json.dumps(meta) + "}\n")
    return out

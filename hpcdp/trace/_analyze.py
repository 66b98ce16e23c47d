"""``python -m hpcdp.trace analyze DIR``: the first operation where the ranks' flight records diverge.

Collectives of a group carry a per-group sequence number, so the records of all members line up
by (group, seq). Walking each group's sequence from the oldest number every member still holds,
the first number where a member is missing, called something else, or did not complete is that
group's divergence; the earliest of those (by the reference clock) is reported, together with
what each rank that did not get there was doing instead and the source lines.
"""
from __future__ import annotations

import re

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from ..backends.base import FINALIZED
from ._deadlock import describe_deadlocks, find_deadlocks
from ._files import Entry, FlightRecord, clean, load_flight_records
from ._recorder import COMPLETED

__all__ = ["Divergence", "find_divergence", "describe", "analyze", "fmt_ranks", "finished_note", "NO_RECORD"]


def fmt_ranks(ranks: Any) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    rs = sorted(set(int(r) for r in ranks))
    parts: list[str] = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        parts.append(str(rs[i]) if i == j else (f"{rs[i]}, {rs[j]}" if j == i + 1 else f"{rs[i]}-{rs[j]}"))
        i = j + 1
    return ", ".join(parts)


def _plural(ranks: Any) -> str:
    return ("rank " if len(set(ranks)) == 1 else "ranks ") + fmt_ranks(ranks)


@dataclass
class Divergence:
    """Where the records part ways. ``kind``: "missing" (some members never called it),
    "mismatch" (some called something else at that number) or "stuck" (all called it; it did
    not complete everywhere)."""

    kind: str
    group: str
    seq: int
    expected: Entry
    reached: dict[int, Entry]
    others: dict[int, Entry]            # members that called a different op at this seq
    missing: list[int]                  # members with a record but no entry at this seq
    no_record: list[int]                # members that wrote no flight record at all
    instead: dict[int, str] = field(default_factory=dict)
    instead_at: dict[int, tuple[str, int] | None] = field(default_factory=dict)
    facts: dict[int, list[str]] = field(default_factory=dict)

    @property
    def first_start(self) -> int:
        return min(e.start for e in self.reached.values())

    @property
    def not_reached(self) -> list[int]:
        return sorted(set(self.others) | set(self.missing) | set(self.no_record))


def _shape(e: Entry) -> str:
    bits = []
    if e.shape is not None:
        bits.append("shape (" + ", ".join(map(str, e.shape)) + ("," if len(e.shape) == 1 else "") + ")")
    if e.dtype:
        bits.append(clean(e.dtype, 30))
    if e.peer >= 0:
        bits.append(f"{'root' if e.seq else 'peer'} {e.peer}")
    return ", ".join(bits)


def _at(e: Entry) -> str:
    return f" at {clean(e.line, 300)}" if e.line else " (line not recorded; HPCDP_TRACE_LINES=1 records every line)"


class _Index:
    """Every record's entries indexed by group, built once: the analysis then visits each entry
    a bounded number of times however many groups there are (a scan of every entry per group,
    or per divergence, is quadratic in a record whose every entry names another group)."""

    def __init__(self, records: dict[int, FlightRecord]) -> None:
        #: rank -> group -> that rank's entries on the group, in id order
        self.by_group: dict[int, dict[str, list[Entry]]] = {}
        #: rank -> its unfinished entries, in id order
        self.pending: dict[int, list[Entry]] = {}
        #: rank -> where its first thread with a line was when it dumped
        self.now: dict[int, str | None] = {}
        #: group -> the distinct rank lists its entries named, and the ranks holding an entry on it
        lists: dict[str, dict[int, tuple[int, ...]]] = defaultdict(dict)
        holders: dict[str, set[int]] = defaultdict(set)
        for r, rec in records.items():
            mine: dict[str, list[Entry]] = defaultdict(list)
            for e in rec.entries:
                mine[e.group].append(e)
                if e.group_ranks is not None:
                    lists[e.group].setdefault(id(e.group_ranks), e.group_ranks)
            for g in mine:
                holders[g].add(r)
            self.by_group[r] = dict(mine)
            self.pending[r] = [e for e in rec.entries if e.state != COMPLETED]
            t = next((t for t in rec.threads if isinstance(t.get("line"), str)), None)
            self.now[r] = t["line"] if t is not None else None
        # one group's set at a time: sets of every group at once would cost ~30x the rank lists
        self.members: dict[str, tuple[int, ...]] = {}
        for g, rs in holders.items():
            named = lists.get(g, {})
            m = set(rs)
            for lst in named.values():
                m.update(lst)
            t = tuple(sorted(m))
            only = next(iter(named.values()), None) if len(named) == 1 else None
            self.members[g] = only if only == t else t   # the usual case: share the entries' tuple

    def seqs(self, r: int, group: str) -> dict[int, Entry]:
        return {e.seq: e for e in self.by_group[r].get(group, ()) if e.seq > 0}


def _group_divergence(records: dict[int, FlightRecord], group: str,
                      members: tuple[int, ...], index: _Index | None = None) -> Divergence | None:
    index = index or _Index(records)
    have = [r for r in members if r in records]
    seqs = {r: index.seqs(r, group) for r in have}
    no_record = [r for r in members if r not in records]
    lows = [min(seqs[r]) for r in have if seqs[r]]
    if not lows:
        return None
    # Compare only numbers every member still holds; a member whose ring never showed this
    # group (and dropped nothing) simply never got there.
    start = max(lows)
    for r in have:
        if not seqs[r] and records[r].total_ops > records[r].capacity > 0:
            return None  # its ring overflowed: nothing can be said about this group
    # The numbers someone holds, not range(start, top): a damaged record may claim any number.
    for s in sorted({q for r in have for q in seqs[r] if q >= start}):
        at = {r: seqs[r].get(s) for r in have}
        present = {r: e for r, e in at.items() if e is not None}
        holders: dict[tuple[Any, ...], list[int]] = defaultdict(list)
        for r, e in sorted(present.items()):
            holders[e.signature()].append(r)
        best_sig = min(holders, key=lambda sig: (-len(holders[sig]), holders[sig][0]))
        reached = {r: e for r, e in present.items() if e.signature() == best_sig}
        others = {r: e for r, e in present.items() if e.signature() != best_sig}
        missing = [r for r, e in at.items() if e is None]
        done = all(e.state == COMPLETED for e in present.values())
        if not others and not missing and done:
            continue
        if not others and not missing:
            kind = "stuck"
        else:
            kind = "mismatch" if others else "missing"
        expected = reached[min(reached)]
        return Divergence(kind, group, s, expected, reached, others, missing, no_record)
    return None


NO_RECORD = ("wrote no flight record: killed or crashed hard, or it called hpcdp.finalize() without "
             "HPCDP_TRACE or HPCDP_TRACE_DIR set on a transport that does not tell its peers (MPI) "
             "(a rank that raises or times out always writes one)")


def _last_on_group(r: int, d: Divergence, index: _Index) -> tuple[Entry | None, str]:
    """Rank ``r``'s newest entry on ``d.group`` before ``d.seq`` (entries are in id order), and a
    sentence saying what it was."""
    for e in reversed(index.by_group[r].get(d.group, ())):
        if 0 < e.seq < d.seq:
            where = f" at {clean(e.line, 300)}" if e.line else ""
            return e, f"its last operation on group {clean(d.group, 80)} was {clean(e.op, 60)} #{e.seq}{where}"
    return None, f"it recorded nothing on group {clean(d.group, 80)}"


def finished_note(rec: FlightRecord, now: str | None = None) -> str | None:
    """What a record written as its rank finished says about how it ended (None: not such a record)."""
    if rec.finished is None:
        return None
    where = f" at {clean(now)}" if now else ""
    if rec.finished == "exit":
        return ("exited without an uncaught exception, without calling hpcdp.finalize() "
                "(its interpreter exit wrote this record)")
    failed = [x for x in rec.reasons if x.startswith("uncaught ")]
    if failed:
        return f"finished after an error: hpcdp.finalize(){where}, after {clean(failed[-1], 200)}"
    return f"finished normally: hpcdp.finalize(){where}"


def _instead(d: Divergence, records: dict[int, FlightRecord], index: _Index | None = None) -> None:
    """Fill ``d.instead`` (what each rank that did not reach the operation was doing) and
    ``d.facts`` (more about it, one sentence each)."""
    index = index or _Index(records)
    for r, e in d.others.items():
        d.instead[r] = f"called {e.call()} instead ({_shape(e) or 'no arguments'}; {e.state}){_at(e)}"
        d.instead_at[r] = (e.group, e.seq)
    for r in d.missing:
        rec = records[r]
        prior, last = _last_on_group(r, d, index)
        after_id = -1 if prior is None else prior.id
        pending = index.pending[r]
        done = finished_note(rec, index.now[r])
        if done is None and pending and pending[-1].id > after_id:
            # the newest unfinished one is where it is (older ones may be forgotten async ops)
            e = pending[-1]
            d.instead[r] = f"was in {e.call()} ({e.state}){_at(e)}"
            d.facts[r] = [last]
            d.instead_at[r] = (e.group, e.seq) if e.seq else None
            continue
        d.instead_at[r] = None
        newest = rec.entries[-1] if rec.entries and rec.entries[-1].id > after_id else None
        if done is not None:
            d.instead[r] = done
            d.facts[r] = ([f"its last operation was {newest.call()} ({newest.state}){_at(newest)}"]
                          if newest is not None else []) + [last]
            continue
        now = index.now[r]
        where = [f"its thread was at {clean(now)} when it dumped"] if now is not None else []
        if newest is not None:
            d.instead[r] = f"had finished {newest.call()}{_at(newest)} and started nothing after it"
        else:
            d.instead[r] = "had started no operation since"
        d.facts[r] = where + [last]
    for r in d.no_record:
        told = _told_finished(r, records)
        d.instead[r] = told or NO_RECORD
        d.instead_at[r] = None


_SHUT_DOWN = re.compile(r"\brank (\d+) " + re.escape(FINALIZED))


def _told_finished(r: int, records: dict[int, FlightRecord]) -> str | None:
    """What a peer's record says of rank ``r`` that wrote none: a rank that calls
    ``hpcdp.finalize`` tells its peers, and a peer left waiting records that notice in its error.
    (A finished rank writes a record of its own only under ``HPCDP_TRACE=1`` or an explicit
    ``HPCDP_TRACE_DIR``: clean runs leave no files behind.)"""
    for peer, rec in sorted(records.items()):
        for why in [rec.reason, *rec.reasons]:
            m = _SHUT_DOWN.search(why or "")
            if m and int(m.group(1)) == r:
                return (f"finished normally: it called hpcdp.finalize() and told its peers "
                        f"(rank {peer}'s error says so); it wrote no flight record of its own")
    return None


def find_divergence(records: dict[int, FlightRecord]) -> Divergence | None:
    """The first divergence across groups, or None when every shared operation completed alike."""
    index = _Index(records)
    members = index.members
    world = max(rec.world_size for rec in records.values())
    if "world" in members:  # ranks with no record at all are still members of the world group
        members["world"] = tuple(sorted(set(members["world"]) | set(range(world))))
    # Keep only the earliest candidate: one per group, and a record may name a group per entry.
    first: Divergence | None = None
    for g in members:
        d = _group_divergence(records, g, members[g], index)
        if d is not None and (first is None or _order(d) < _order(first)):
            first = d
    if first is None:
        return None
    _instead(first, records, index)
    # The ranks that did not reach `first` may all be at another group's divergence point that
    # more ranks reached (A skipped an op on one group and went on to another): the same event,
    # better told from the side of the majority.
    targets = {first.instead_at.get(r) for r in first.not_reached}
    if len(targets) == 1 and None not in targets:
        group, seq = targets.pop()  # type: ignore[misc]
        d = _group_divergence(records, group, members[group], index) if group in members else None
        if d is not None and d.seq == seq and len(d.reached) > len(first.reached):
            _instead(d, records, index)
            return d
    return first


def _order(d: Divergence) -> tuple[int, str, int]:
    return (d.first_start, d.group, d.seq)


def _states(rs: list[int], entries: dict[int, Entry]) -> str:
    by: dict[str, list[int]] = defaultdict(list)
    for r in rs:
        by[entries[r].state].append(r)
    if len(by) == 1:
        return next(iter(by))
    return "; ".join(f"{st} on {_plural(x)}" for st, x in by.items())


def describe(d: Divergence | None, records: dict[int, FlightRecord]) -> str:
    """What ``analyze`` prints: one fact per line, for a person at 3 a.m.

    First any point-to-point deadlock (``_deadlock``: ranks each blocked until its timeout in a
    call that waited on the next); then the divergent operation; who reached it (with the source line); who did not, and for each
    such rank what it was doing instead (with its line), whether it finished normally (its
    record says so: ``hpcdp.finalize`` writes one) or left no record at all; why records were
    written.
    """
    world = max(rec.world_size for rec in records.values())
    absent = sorted(set(range(world)) - set(records))
    deadlocks = describe_deadlocks(find_deadlocks(records))
    if deadlocks:  # ranks that waited on each other in point-to-point: named first
        rest = _describe(d, records, world, absent) if d is not None else (
            f"No flight record from {_plural(absent)}." if absent else "")
        return "\n".join(deadlocks + ([rest] if rest else []))
    return _describe(d, records, world, absent)


def _describe(d: Divergence | None, records: dict[int, FlightRecord], world: int,
              absent: list[int]) -> str:
    if d is None:
        n = sum(len(r.entries) for r in records.values())
        out = [f"No divergence found in {len(records)} flight records: every operation that all "
               f"members of its group still hold was called alike and completed ({n} entries read)."]
        if absent:
            out.append(f"No flight record from {_plural(absent)}.")
        return "\n".join(out)
    e = d.expected
    out = [f"First divergence: {e.call()} ({_shape(e) or 'no arguments'})"]
    at_line: dict[str | None, list[int]] = defaultdict(list)
    for r in sorted(d.reached):
        at_line[d.reached[r].line].append(r)
    for ln, rs in at_line.items():
        where = f" at {clean(ln, 300)}" if ln else _at(d.reached[rs[0]])
        out.append(f"Reached by {_plural(rs)} ({_states(rs, d.reached)}){where}")
    for r in sorted(d.reached):
        done = finished_note(records[r], None) if r in records else None
        if done is not None:
            out.append(f"  rank {r}: {done}")
    told = {r: _told_finished(r, records) for r in d.no_record} if d.kind == "stuck" else {}
    if any(told.values()):  # the ranks without a record finished: that is the divergence
        done = [r for r, t in told.items() if t]
        out.append(f"Not reached by {_plural(done)}:")
        out.extend(f"  rank {r}: {told[r]}" for r in done)
        rest = [r for r, t in told.items() if not t]
        if rest:
            out.append(f"  {_plural(rest)}: {NO_RECORD}")
    elif d.kind == "stuck":
        out.append(f"Every member of group {clean(d.group, 80)} with a record called it alike; it did not "
                   f"complete on {_plural([r for r, x in d.reached.items() if x.state != COMPLETED])}")
        if d.no_record:
            out.append(f"  {_plural(d.no_record)}: {NO_RECORD}")
        else:
            out.append("Look for a peer stalled inside the transport or a failed link")
    else:
        out.append(f"Not reached by {_plural(d.not_reached)}:")
        told: dict[tuple[str, tuple[str, ...]], list[int]] = defaultdict(list)
        for r in d.not_reached:
            told[(d.instead[r], tuple(d.facts.get(r, ())))].append(r)
        for (what, facts), rs in told.items():
            out.append(f"  {_plural(rs)}: {what}")
            out.extend(f"  {_plural(rs)}: {f}" for f in facts)
    why: dict[str, list[int]] = defaultdict(list)
    for r, rec in sorted(records.items()):
        if rec.reason:
            why[rec.reason].append(r)
    for reason, rs in sorted(why.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))[:4]:
        out.append(f"Record of {_plural(rs)} written on: {clean(reason, 160)}")
    if len(why) > 4:
        out.append(f"(and {len(why) - 4} other reasons)")
    if absent and not set(absent) <= set(d.no_record):
        out.append(f"No flight record from {_plural(absent)}.")
    return "\n".join(out)


def analyze(directory: str) -> str:
    """Load ``directory``'s flight records and describe their first divergence."""
    stale: list[int] = []
    records = load_flight_records(directory, stale)
    return describe(find_divergence(records), records) + stale_note(stale)


def stale_note(stale: list[int]) -> str:
    return (f"\nSet aside the records of {_plural(stale)}: they are from an earlier job."
            if stale else "")


def summary(records: dict[int, FlightRecord]) -> list[str]:
    """One line per rank: its last operation and any unfinished ones (``analyze -v``)."""
    out = []
    for r, rec in sorted(records.items()):
        pend = [e for e in rec.entries if e.state != COMPLETED]
        last = rec.entries[-1] if rec.entries else None
        head = f"rank {r} ({rec.host} pid {rec.pid}): {len(rec.entries)} ops kept of {rec.total_ops}"
        if last is not None:
            head += f"; last {last.call()} {last.state}{_at(last)}"
        if pend:
            head += "; unfinished: " + ", ".join(f"{e.call()} ({e.state})" for e in pend[-3:])
        if rec.finished is not None:
            head += f"; {finished_note(rec)}"
        out.append(head)
    return out


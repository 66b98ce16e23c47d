"""Point-to-point deadlocks in flight records: ranks that waited on each other until they timed out.

Collectives line up by sequence number (``_analyze``); point-to-point calls do not, so a cycle of
ranks each blocked in a ``recv`` from the next left records in which every collective completed
("no divergence"). Here each rank's point-to-point wait at the end of its record is an edge from
it to the rank it waited on (its entry's peer, as a world rank); a loop of such edges is a
deadlock, reported with each rank's call and source line.

The edges: every point-to-point entry that timed out, and, for a rank with none, its newest
entry if that is a point-to-point call still in flight when it dumped (where it was stuck).
"""
from __future__ import annotations

from dataclasses import dataclass

from ._files import Entry, FlightRecord, clean
from ._recorder import STARTED, TIMED_OUT

__all__ = ["Deadlock", "find_deadlocks", "describe_deadlocks"]

#: recorded operations that wait on one peer
_P2P = frozenset({"send", "recv", "probe", "sendrecv"})
#: cycles reported at most (a job of many ranks in one ring is one cycle; pairs are each one)
_MAX = 8


@dataclass(frozen=True)
class Deadlock:
    """A waits-for cycle: ``ranks[i]`` waited on ``ranks[i + 1]`` (the last on the first) in
    ``entries[i]``."""

    ranks: tuple[int, ...]
    entries: tuple[Entry, ...]


def _waits(records: dict[int, FlightRecord]) -> dict[int, list[tuple[int, Entry]]]:
    """rank -> [(world rank it waited on, the entry)], oldest first."""
    out: dict[int, list[tuple[int, Entry]]] = {}
    for r, rec in records.items():
        p2p = [e for e in rec.entries if e.seq == 0 and e.op in _P2P and e.peer >= 0]
        waits = [e for e in p2p if e.state == TIMED_OUT]
        if not waits and p2p and rec.entries[-1] is p2p[-1] and p2p[-1].state == STARTED:
            waits = [p2p[-1]]
        edges = []
        for e in waits:
            gr = e.group_ranks
            if gr is None:
                peer = e.peer
            elif e.peer < len(gr):
                peer = gr[e.peer]
            else:
                continue  # a damaged record: a peer outside its group
            if peer != r:
                edges.append((peer, e))
        if edges:
            out[r] = edges
    return out


def find_deadlocks(records: dict[int, FlightRecord]) -> list[Deadlock]:
    """Every distinct waits-for cycle among the ranks' point-to-point waits (at most ``_MAX``)."""
    waits = _waits(records)
    found: dict[tuple[int, ...], Deadlock] = {}
    for start in sorted(waits):
        # depth first along the edges, never revisiting a rank on the path: a loop back to
        # ``start`` through ranks above it is a cycle seen from its smallest rank (counted once)
        stack: list[tuple[int, list[int], list[Entry]]] = [(start, [start], [])]
        while stack and len(found) < _MAX:
            r, path, entries = stack.pop()
            for peer, e in waits.get(r, ()):
                if peer == start:
                    key = tuple(path)
                    if key not in found:
                        found[key] = Deadlock(key, tuple(entries + [e]))
                elif peer > start and peer not in path and peer in waits and len(path) < 64:
                    stack.append((peer, path + [peer], entries + [e]))
    return sorted(found.values(), key=lambda d: (len(d.ranks), d.ranks))


def _waiting_for(e: Entry, peer: int) -> str:
    if e.op == "send":
        return f"waiting for rank {peer} to receive"
    if e.op == "recv":
        return f"waiting for rank {peer} to send"
    return f"waiting for rank {peer}"


def describe_deadlocks(cycles: list[Deadlock]) -> list[str]:
    """The "Deadlock:" section of ``analyze``: per cycle, each rank's call, state and line."""
    out: list[str] = []
    for d in cycles:
        loop = " -> ".join(map(str, (*d.ranks, d.ranks[0])))
        states = sorted({e.state for e in d.entries})
        out.append(f"Deadlock: ranks {', '.join(map(str, d.ranks))} waited on each other in "
                   f"point-to-point calls (cycle {loop}); none could go on ({', '.join(states)})")
        for i, (r, e) in enumerate(zip(d.ranks, d.entries)):
            peer = d.ranks[(i + 1) % len(d.ranks)]
            at = (f" at {clean(e.line, 300)}" if e.line
                  else " (line not recorded; HPCDP_TRACE_LINES=1 records every line)")
            out.append(f"  rank {r}: {e.call()} ({e.state}){at}, {_waiting_for(e, peer)}")
    if out:
        out.append("Each blocking call above waits for the next rank's; post receives first "
                   "(irecv), or pair them with sendrecv")
    return out

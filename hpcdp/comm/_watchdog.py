"""The watchdog of blocked calls: say what a rank waits for, on whom, and name deadlock cycles.

A blocking call that has not completed after ``WATCH_AFTER`` seconds comes here (``work.wait_for``
waits that long first, so a call that completes sooner never does). From then on, every
``step`` seconds (half the warning interval, or half the timeout, whichever is shorter) the
rank tells the ranks it waits on, and those that said they wait on it, what it is blocked in:
"recv(src=1, tag=0) #1 at heat.py:42, waiting for world rank 1", over the backend's side channel
(``Backend.tell_waiting``: simulated ranks share the note, TCP sends a WAITING control frame, MPI
a notice on the group's notice communicator), never mixed with messages. What the others said
(``Backend.waiting_notes``) is what this rank knows of them: once the call has waited
``HPCDP_WARN_AFTER`` seconds it logs one warning through the ``hpcdp`` logger naming its peer's
state and, where the waits-for edges close a loop, the deadlock cycle; if it times out, the
``CommTimeoutError`` names the cycle too. Nothing is raised early: another thread of a rank in
the cycle could still send.

Notes are small JSON objects, parsed as untrusted input (bounded, type-checked, never executed).
A note promises a refresh every ``every`` seconds while its call stays blocked, so a note older
than two refreshes is stale (its "done" note was lost); a call that ends sends "done" to every
rank it told, or, if it timed out, that it did (its peers in the cycle time out about then too,
and their errors should still name it).
"""
from __future__ import annotations

import itertools
import json
import logging
import math
import os
import re
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from .._config import setting
from ..backends.base import Request
from ..trace.hooks import user_frame

if TYPE_CHECKING:
    from .group import ProcessGroup

__all__ = ["WATCH_AFTER", "watch", "warn_after", "set_warn_after", "LOG"]

#: seconds a blocking call waits before the watchdog looks at it: the only cost a call that
#: completes sooner pays is choosing this first, shorter wait
WATCH_AFTER = 0.1
#: the shortest interval between two notes of one call (a 0.3 s warning interval still gets one)
_MIN_STEP = 0.2
#: collectives on groups larger than this tell nobody (a note to every member would cost
#: the group a message per pair); their rank still warns
_TELL_COLLECTIVE_UP_TO = 16
#: longest op or source-line text a note carries (the MPI notice holds about 200 bytes)
_TEXT = 60
_MAX_EDGES = 16
_ROOM = 200

#: the logger the warning goes to; ``[rank N] WARNING hpcdp: ...`` unless logging is set up
LOG = logging.getLogger("hpcdp")
_FORMAT = "[rank %(rank)s] %(levelname)s %(name)s: %(message)s"
_log_lock = threading.Lock()  # simulated ranks warn from several threads at once

_override: list[float | None] = [None]
_ids = itertools.count(1)
_PEERS = re.compile(r"\b(dst|src)=(-?\d+)")


def warn_after() -> float:
    """Seconds a call may stay blocked before its rank warns (0: never); ``set_warn_after``'s
    value, else ``HPCDP_WARN_AFTER`` (read at each blocked call: tests and jobs change it)."""
    v = _override[0]
    return setting("HPCDP_WARN_AFTER") if v is None else v


def set_warn_after(seconds: float | None) -> None:
    """Set this process's warning interval (0: off); None: back to ``HPCDP_WARN_AFTER``."""
    if seconds is not None:
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
            raise TypeError(f"warn_after: a number of seconds, got {type(seconds).__name__}")
        if not 0 <= seconds < math.inf:
            raise ValueError(f"warn_after must be a finite number of seconds >= 0 (0: off), "
                             f"got {seconds!r}")
        seconds = float(seconds)
    _override[0] = seconds


def _caller() -> str:
    """``file.py:42`` of the user's frame that made the blocked call ("" if none): the first
    frame outside hpcdp above this one (the watchdog runs on the blocked thread)."""
    f = user_frame(sys._getframe(1))
    if f is None:
        return ""
    return f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}"


class _Note:
    """One rank's note, checked: what it is blocked in and on whom (world ranks)."""

    __slots__ = ("rank", "op", "at", "group", "seq", "on", "edges", "every", "done", "ended",
                 "arrived")

    def __init__(self, rank: int, d: dict[str, Any], arrived: float) -> None:
        self.rank = rank
        self.done = bool(d.get("done"))
        self.ended = bool(d.get("ended"))  # it timed out: blocked until then
        self.op = _str(d.get("op"))
        self.at = _str(d.get("at"))
        self.group = _str(d.get("g"))
        self.seq = d.get("s") if type(d.get("s")) is int else 0
        self.on = _ranks(d.get("on"))
        self.edges = [(a, b) for a, b in (_pair(e) for e in _list(d.get("e"))) if a >= 0]
        ev = d.get("every")
        self.every = float(ev) if type(ev) in (int, float) and 0 <= ev < 1e6 else 0.0
        self.arrived = arrived

    def live(self, now: float, since: float) -> bool:
        """Whether it still describes the rank: blocked and refreshed lately, or timed out
        while the call asking was already blocked (the cycle it closed ended only now)."""
        if self.done or not self.op:
            return False
        if self.ended:
            return self.arrived >= since
        return now - self.arrived <= 2 * self.every + 1.0

    def call(self) -> str:
        return f"{self.op} at {self.at}" if self.at else self.op


def _str(v: Any) -> str:
    return "".join(c for c in v[:_TEXT] if c.isprintable()) if isinstance(v, str) else ""


def _list(v: Any) -> list[Any]:
    return v[:_MAX_EDGES] if isinstance(v, list) else []


def _ranks(v: Any) -> list[int]:
    return [r for r in _list(v) if type(r) is int and 0 <= r < 1 << 30]


def _pair(e: Any) -> tuple[int, int]:
    if isinstance(e, list) and len(e) == 2 and all(type(x) is int and 0 <= x < 1 << 30 for x in e):
        return e[0], e[1]
    return -1, -1


def _notes(group: "ProcessGroup", me: int, now: float, since: float) -> dict[int, _Note]:
    """The notes of other ranks this process holds that hold for a call blocked ``since``."""
    out: dict[int, _Note] = {}
    for r, (arrived, text) in group.backend.waiting_notes().items():
        if r == me or len(text) > 4096:
            continue
        try:
            d = json.loads(text)
        except ValueError:
            continue
        if isinstance(d, dict):
            n = _Note(r, d, arrived)
            if n.live(now, since):
                out[r] = n
    return out


class _Blocked:
    """One blocked call: what it waits for, whom it told, whether it warned."""

    def __init__(self, group: "ProcessGroup", op: str, seq: int, step: float, t0: float) -> None:
        self.group, self.seq, self.step, self.t0 = group, seq, step, t0
        self.op = f"{op} #{seq}" if seq else op  # collectives by number, as errors name them
        self.ranks = group.ranks
        self.me = group.ranks[group.rank]
        self.at = _caller()
        self.id = next(_ids)
        self.sent = 0
        self.told: set[int] = set()  # group ranks
        self.warned = False
        #: group ranks it waits to receive from, and to send to (point to point)
        self.srcs: list[int] = []
        self.dsts: list[int] = []
        if seq:  # a collective waits for every member that has not joined
            self.peers = [r for r in range(group.size) if r != group.rank]
        else:
            for kind, p in _PEERS.findall(op):
                if 0 <= int(p) < group.size:
                    (self.srcs if kind == "src" else self.dsts).append(int(p))
            self.peers = sorted({*self.srcs, *self.dsts})
        self.on = [self.ranks[p] for p in self.peers]

    # -- what this rank knows --------------------------------------------------------------
    def _edges(self, notes: dict[int, _Note]) -> dict[int, set[int]]:
        """Waits-for edges between world ranks: this call's, each note's, and the point-to-point
        edges notes relayed. A collective waits on no member blocked in the same collective."""
        edges: dict[int, set[int]] = {}
        for a, b in (e for n in notes.values() for e in n.edges):
            edges.setdefault(a, set()).add(b)

        def same(n: _Note | None, group: str, seq: int) -> bool:
            return n is not None and seq > 0 and n.seq == seq and n.group == group

        mine = {r for r in self.on if not same(notes.get(r), self.group.name, self.seq)}
        edges[self.me] = mine
        for r, n in notes.items():
            edges[r] = {s for s in n.on
                        if not (n.seq and (same(notes.get(s), n.group, n.seq)
                                           or (s == self.me and self.group.name == n.group
                                               and self.seq == n.seq)))}
        return edges

    def cycle(self, notes: dict[int, _Note]) -> list[int]:
        """The shortest waits-for cycle through this rank (world ranks, first = last = this
        one), or [] if none is known."""
        edges = self._edges(notes)
        prev: dict[int, int | None] = {self.me: None}
        frontier = [self.me]
        while frontier:  # breadth first: the first way back is a shortest cycle
            nxt = []
            for a in frontier:
                for b in sorted(edges.get(a, ())):
                    if b == self.me:
                        path = [a]
                        while (p := prev[path[-1]]) is not None:
                            path.append(p)
                        return [*reversed(path), self.me]
                    if b not in prev:
                        prev[b] = a
                        nxt.append(b)
            frontier = nxt
        return []

    def _relay(self, notes: dict[int, _Note]) -> list[list[int]]:
        """Point-to-point edges to pass on (this call's and those notes told), so a longer
        cycle closes on some rank of it."""
        out = {(self.me, r) for r in self.on} if not self.seq else set()
        for n in notes.values():
            if not n.seq:
                out.update((n.rank, r) for r in n.on)
            out.update(n.edges)
        return [list(e) for e in sorted(out)[:_MAX_EDGES]]

    # -- telling ---------------------------------------------------------------------------
    def tell(self, now: float) -> dict[int, _Note]:
        """Send this call's note to the ranks it waits on and to those waiting on it; the notes
        this rank holds."""
        notes = _notes(self.group, self.me, now, self.t0)
        to = set(self.peers) if not self.seq or self.group.size <= _TELL_COLLECTIVE_UP_TO else set()
        index = {w: g for g, w in enumerate(self.ranks)}
        to.update(index[r] for r, n in notes.items() if self.me in n.on and r in index)
        to.discard(self.group.rank)
        self.sent += 1
        note = {"op": self.op[:_TEXT], "at": self.at[-_TEXT:], "g": self.group.name[:_TEXT],
                "s": self.seq, "on": self.on[:_MAX_EDGES], "e": self._relay(notes),
                "every": round(self.step, 3), "id": self.id, "n": self.sent}
        self._send(sorted(to), note)
        self.told |= to
        return notes

    def _send(self, to: list[int], note: dict[str, Any]) -> None:
        text = json.dumps(note, separators=(",", ":"))
        # the MPI notice's room: relayed edges go first, then ranks waited on, then text
        while len(text) > _ROOM and (note.get("e") or note.get("on")):
            (note["e"] if note.get("e") else note["on"]).pop()
            text = json.dumps(note, separators=(",", ":"))
        if len(text) > _ROOM:
            note["g"], note["at"] = note.get("g", "")[:20], note.get("at", "")[-30:]
            text = json.dumps(note, separators=(",", ":"))
        try:
            self.group.backend.tell_waiting(to, text)
        except Exception:  # noqa: BLE001 - best effort: a failed note must not fail the call
            pass

    def finish(self, timed_out: bool) -> None:
        """The call ended: its note no longer holds. One that timed out says so ("ended"):
        a peer in the same cycle times out about now too, and its error should still see this
        rank in it (a peer's call blocked since before the note arrived: ``_Note.live``)."""
        if not self.sent:
            return
        if timed_out:
            self._send(sorted(self.told), {
                "op": self.op[:_TEXT], "at": self.at[-_TEXT:], "g": self.group.name[:_TEXT],
                "s": self.seq, "on": self.on[:_MAX_EDGES], "ended": 1, "id": self.id})
        else:
            self._send(sorted(self.told), {"done": 1, "id": self.id})

    # -- saying ----------------------------------------------------------------------------
    def _rank(self, w: int) -> str:
        return f"rank {w}" if self.ranks == tuple(range(len(self.ranks))) else f"world rank {w}"

    def _what(self) -> str:
        if self.seq:
            return f"waiting for the other ranks of group {self.group.name} to join"
        parts = [f"rank {p} to receive" for p in self.dsts]
        parts += [f"rank {p} to send" for p in self.srcs]
        if not parts:
            return "waiting for a message from any rank"
        return "waiting for " + " and ".join(parts)

    def _peer_states(self, notes: dict[int, _Note]) -> str:
        """What the ranks this call waits on said they are blocked in."""
        parts = []
        for r in self.on[:4]:
            n = notes.get(r)
            if n is not None:
                if self.seq and n.seq == self.seq and n.group == self.group.name:
                    continue  # in this same collective
                parts.append(f"{self._rank(r)} is itself blocked in {n.call()}")
            elif not self.seq:
                parts.append(f"{self._rank(r)} has not said it is blocked (busy outside hpcdp, "
                             "or slow)")
        silent = [r for r in self.on if r not in notes]
        if self.seq and silent and len(self.on) <= _TELL_COLLECTIVE_UP_TO:
            names = ", ".join(map(str, silent[:8])) + (", ..." if len(silent) > 8 else "")
            world = "" if self._rank(silent[0]).startswith("rank") else "world "
            parts.append(f"{world}rank(s) {names} have not said they are blocked (busy outside "
                         "hpcdp, or slow)")
        return "".join(f"; {p}" for p in parts)

    def describe_cycle(self, cyc: list[int], notes: dict[int, _Note]) -> str:
        """"rank 0 waits for rank 1 in recv(src=1, tag=0) #1 at heat.py:42, rank 1 waits ..."."""
        parts = []
        for a, b in zip(cyc, cyc[1:]):
            if a == self.me:
                call = f"{self.op} at {self.at}" if self.at else self.op
            else:
                n = notes.get(a)
                call = n.call() if n is not None else ""
            parts.append(f"{self._rank(a)} waits for {self._rank(b)}" + (f" in {call}" if call else ""))
        return ", ".join(parts)

    def warn(self, waited: float, now: float) -> None:
        notes = _notes(self.group, self.me, now, self.t0)
        at = f" at {self.at}" if self.at else ""
        cyc = self.cycle(notes)
        tail = f" (a deadlock cycle: {' -> '.join(map(str, cyc))})" if cyc else ""
        _emit(self.me, f"blocked {waited:.3g} s in {self.op}{at} on group {self.group.name}: "
                       f"{self._what()}{self._peer_states(notes)}{tail}")
        self.warned = True

    def timeout_note(self, now: float) -> str:
        """What the timeout error adds: the cycle, else what the awaited ranks are blocked in."""
        notes = _notes(self.group, self.me, now, self.t0)
        cyc = self.cycle(notes)
        if cyc:
            return (f"; a deadlock: {self.describe_cycle(cyc, notes)} (cycle "
                    f"{' -> '.join(map(str, cyc))}; no rank in it can go on)")
        return self._peer_states(notes) if any(r in notes for r in self.on) else ""


def _emit(rank: int, text: str) -> None:
    """Log ``text`` as a warning with ``[rank N]`` in front, unless logging is set up already
    (then the record goes where the application sends its logs, with ``rank`` set)."""
    with _log_lock:
        if not LOG.hasHandlers():
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter(_FORMAT))
            handler._hpcdp = True  # type: ignore[attr-defined]  # (progress.get_logger's mark)
            LOG.addHandler(handler)
            LOG.propagate = False
            if LOG.level == logging.NOTSET:
                LOG.setLevel(logging.INFO)
    LOG.warning("%s", text, extra={"rank": rank})


def watch(group: "ProcessGroup", op: str, seq: int, req: Request, timeout: float,
          waited: float) -> tuple[bool, str]:
    """Wait for ``req``, blocked ``waited`` s already (< ``timeout``), until ``timeout`` s in all,
    telling peers and warning as the module says. ``(done, note)``: ``note`` is what a timeout
    error should add ("" when nothing is known)."""
    now = time.monotonic
    t0 = now() - waited
    deadline = t0 + timeout
    warn = warn_after()
    warn_at = t0 + warn if 0 < warn < timeout else math.inf
    step = max(_MIN_STEP, min(warn if warn > 0 else math.inf, timeout) / 2)
    tell_at = t0 + step if step < timeout else math.inf
    b: _Blocked | None = None
    timed_out = False
    try:
        while True:
            t = now()
            until = min(tell_at, warn_at, deadline)
            if until > t and req.wait(until - t):
                return True, ""
            t = now()
            if t >= deadline:
                timed_out = True
                return False, (b.timeout_note(t) if b is not None else "")
            if b is None:
                b = _Blocked(group, op, seq, step, t0)
            if t >= tell_at:
                b.tell(t)
                tell_at = t + step
            if t >= warn_at:
                b.warn(t - t0, t)
                warn_at = math.inf
    finally:
        if b is not None:
            b.finish(timed_out)

"""Straggler report: which ranks arrive late at collectives, and by how much.

Every ``every`` steps each rank takes the start times of its recent collectives on a group from
its flight recorder, the group all-gathers them (one fixed-size int64 array per rank: no pickle),
and rank 0 prints, per rank, how late it arrived on average against the first arrival, and the
ops with the largest arrival skew. Start times are on the reference clock (see
``estimate_clock_offset``), so ranks on different nodes compare fairly.
"""
from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from typing import Any, TextIO

import numpy as np

from .._config import setting
from ..trace import Recorder
from ..trace import recorder as _recorder_of
from ..trace.hooks import clock_offset_ns, current_rank, on_step, wall_ns
from . import world  # (world imports this module too: a cycle inside comm, resolved at call time)

__all__ = [
    "WINDOW", "StragglerReport", "gather_arrivals", "StragglerReporter", "report_stragglers",
    "from_env", "stop",
]

#: collectives per rank looked at in one report (the gathered array is WINDOW x 2 int64)
WINDOW = 256


def _same_group(g: Any, group: Any) -> bool:
    return g is group or getattr(g, "name", g) == group.name


@dataclass
class StragglerReport:
    """Arrival times of the collectives every member of ``group`` recorded (rows: ops, cols: ranks)."""

    group: str
    ranks: tuple[int, ...]
    seqs: np.ndarray        # (ops,) sequence numbers
    ops: list[str]          # op name per row
    arrival_ns: np.ndarray  # (ops, ranks) reference-clock start times

    @property
    def late_ns(self) -> np.ndarray:
        """How long after the first rank each rank arrived, per op."""
        if not self.seqs.size:
            return np.zeros((0, len(self.ranks)), np.int64)
        return self.arrival_ns - self.arrival_ns.min(axis=1, keepdims=True)

    @property
    def skew_ns(self) -> np.ndarray:
        """Arrival skew per op: last arrival minus first."""
        late = self.late_ns
        return late.max(axis=1) if late.size else np.zeros(0, np.int64)

    def mean_late_ns(self) -> np.ndarray:
        late = self.late_ns
        return late.mean(axis=0) if late.size else np.zeros(len(self.ranks))

    def last_counts(self) -> np.ndarray:
        late = self.late_ns
        return np.bincount(late.argmax(axis=1), minlength=len(self.ranks)) if late.size else \
            np.zeros(len(self.ranks), np.int64)

    def format(self, *, label: str = "", top: int = 3) -> str:
        """A few lines for rank 0's log."""
        n_ops = int(self.seqs.size)
        head = f"hpcdp stragglers{(' ' + label) if label else ''}, group {self.group} ({len(self.ranks)} ranks)"
        if n_ops == 0:
            return f"{head}: no collective recorded by every member since the last report"
        mean, last, late, skew = self.mean_late_ns(), self.last_counts(), self.late_ns, self.skew_ns
        order = np.argsort(-mean, kind="stable")
        worst = float(mean[order[0]])
        parts = []
        for i in order[:5]:
            if parts and mean[i] < 0.25 * worst:
                break
            j = int(late[:, i].argmax())
            parts.append(f"rank {self.ranks[i]} arrives {_ms(mean[i])} late on average (last at "
                         f"{int(last[i])} of {n_ops}, worst {_ms(late[j, i])} at {self.ops[j]} #{int(self.seqs[j])})")
        worst_ops = np.argsort(-skew, kind="stable")[:top]
        ops = ", ".join(f"{self.ops[k]} #{int(self.seqs[k])} {_ms(skew[k])} (last: rank "
                        f"{self.ranks[int(late[k].argmax())]})" for k in worst_ops)
        return (f"{head}, {n_ops} collectives: " + "; ".join(parts) + ".\n"
                f"  arrival skew per op: median {_ms(np.median(skew))}, max {_ms(skew.max())}; "
                f"largest: {ops}")


def _ms(ns: float) -> str:
    ns = float(ns)
    return f"{ns / 1e6:.2f} ms" if abs(ns) >= 1e5 else f"{ns / 1e3:.1f} us"


def gather_arrivals(group: Any, *, rec: Recorder | None = None, since: int = 0, window: int = WINDOW,
                    timeout: float | None = None) -> StragglerReport:
    """Collective over ``group``: every member's start times of its recent collectives on it.

    Takes this rank's last ``window`` collectives on ``group`` begun after token ``since`` from
    its recorder (default: the recorder of this rank), all-gathers them and keeps the sequence
    numbers every member holds. ``window`` must be the same on every rank. Every rank gets the
    report (rank 0 usually prints it).
    """
    if window < 1:
        raise ValueError(f"gather_arrivals: window must be >= 1, got {window}")
    me = group.rank
    if me < 0:
        raise ValueError(f"gather_arrivals: this rank is not a member of group {group.name}")
    grank = group.ranks[me]
    rec = rec if rec is not None else _group_recorder(group)
    off = clock_offset_ns(grank)
    ops = [o for o in rec.snapshot() if o.id > since and o.seq > 0 and _same_group(o.group, group)]
    ops = ops[-window:]
    mine = np.full((window, 2), -1, np.int64)
    for i, o in enumerate(ops):
        mine[i, 0] = o.seq
        mine[i, 1] = wall_ns(o.start_ns) + off
    every = np.asarray(group.all_gather(mine, timeout=timeout)).reshape(group.size, window, 2)
    names = {o.seq: str(o.op) for o in ops}
    common = None
    for r in range(group.size):
        s = set(int(v) for v in every[r, :, 0] if v > 0)
        common = s if common is None else common & s
    seqs = np.array(sorted(common or ()), np.int64)
    arr = np.zeros((seqs.size, group.size), np.int64)
    for r in range(group.size):
        col = {int(q): int(t) for q, t in every[r] if q > 0}
        arr[:, r] = [col[int(q)] for q in seqs]
    return StragglerReport(str(group.name), tuple(int(r) for r in group.ranks), seqs,
                           [names.get(int(q), "?") for q in seqs], arr)


def _group_recorder(group: Any) -> Recorder:
    """The recorder ``group``'s collectives write to (a group made before ``reset`` keeps its own)."""
    rec = getattr(group, "_rec", None)
    return rec if isinstance(rec, Recorder) else _recorder_of(group.ranks[group.rank])


class StragglerReporter:
    """Every ``every`` calls of ``step()``, gather arrivals on the group; rank 0 prints the report.

    ``step()`` is collective every ``every``-th call: call it on every rank at the same points
    (DDP does, once per backward, when wired).
    """

    def __init__(self, every: int, group: Any = None, *, window: int = WINDOW,
                 file: TextIO | None = None, timeout: float | None = None) -> None:
        if every < 1:
            raise ValueError(f"report_stragglers: every must be >= 1, got {every}")
        self.every, self.window, self.timeout = int(every), int(window), timeout
        self._group = group
        self.file = file
        self.steps = 0
        self._since = 0
        self.last: StragglerReport | None = None

    @property
    def group(self) -> Any:
        if self._group is None:
            self._group = world.get_default_group()
        return self._group

    def step(self) -> StragglerReport | None:
        """Count a step; on every ``every``-th, report (collective) and return the report."""
        self.steps += 1
        return self.report() if self.steps % self.every == 0 else None

    def report(self) -> StragglerReport:
        """Gather now (collective) and print on group rank 0."""
        g = self.group
        rec = _group_recorder(g)
        rep = gather_arrivals(g, rec=rec, since=self._since, window=self.window, timeout=self.timeout)
        self._since = rec.total()  # the gather's own all_gather is not a straggler signal
        self.last = rep
        if g.rank == 0:
            lo = self.steps - self.every + 1
            print(rep.format(label=f"steps {max(lo, 1)}-{self.steps}"), file=self.file or sys.stderr,
                  flush=True)
        return rep


_reporters: dict[int, StragglerReporter] = {}
_lock = threading.Lock()


def report_stragglers(every: int, group: Any = None, **options: Any) -> StragglerReporter:
    """Report late ranks every ``every`` steps on this rank (see ``StragglerReporter``); returns it.

    Steps are counted by ``hpcdp.trace.step()`` (call it once per training step on every rank,
    or let DDP call it).
    """
    rep = StragglerReporter(every, group, **options)
    with _lock:
        _reporters[current_rank()] = rep
    return rep


@on_step
def _step() -> StragglerReport | None:
    """``hpcdp.trace.step()``'s observer: count a step for this rank's reporter, if any."""
    rep = _reporters.get(current_rank()) if _reporters else None
    return None if rep is None else rep.step()


def from_env(group: Any = None) -> StragglerReporter | None:
    """``HPCDP_STRAGGLER=N``: ``report_stragglers(every=N)`` (call at init on every rank)."""
    n = setting("HPCDP_STRAGGLER")
    return report_stragglers(n, group) if n else None


def stop() -> None:
    """Drop this rank's reporter."""
    with _lock:
        _reporters.pop(current_rank(), None)

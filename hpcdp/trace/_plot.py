"""``python -m hpcdp.trace plot DIR``: a PNG that answers "where did the step go".

Each rank's time in each training step is split three ways (``step_breakdown``):

* **waiting**: inside a collective before its last member arrived. Every collective event
  carries its group and sequence number, and ``merge`` puts every rank on one clock, so the
  last arrival is the latest start among the members' events of that (group, seq); the time
  a rank spent in it before then is time it waited for a slower peer.
* **communication**: inside a collective after every member arrived, or in a point-to-point
  operation (no arrival to compare).
* **compute**: the rest of the step (time with no operation in flight).

An asynchronous operation (DDP's bucket allreduces) counts from its launch to its completion,
also where the rank computed meanwhile: the split shows how long communication was in flight,
not what overlapping it would save.

Steps: spans named ``step`` when the program draws them (``trace.span("step")``), else the
intervals between ``trace.step()`` marks (DDP makes one per synchronised backward; the time
before the first mark is set-up, not a step), else the whole trace as one.

The figure: top, one row per rank along time from the first step's start, coloured by the
three kinds; bottom, stacked bars per step and rank. The legend sits outside both.
"""
from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from .._atomic import atomic_write
from ._files import load_timeline
from ._merge import clean_event, merged_events

__all__ = ["self_times", "plot", "load_events", "StepTime", "step_breakdown", "KINDS"]

_EPS_US = 1e-3
KINDS = ("compute", "communication", "waiting")
_COLOUR = {"compute": "#4c78a8", "communication": "#f58518", "waiting": "#e45756"}
#: bars drawn at most in the per-step panel (the newest steps beyond it are kept)
_MAX_STEPS_DRAWN = 40
_MAX_RANK_BARS = 8


def self_times(events: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """``{rank: {phase: seconds}}`` of self time, from merged 'X' events (properly nested per tid)."""
    by_thread: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X":
            by_thread[(e["pid"], e["tid"])].append(e)
    out: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for (pid, _), evs in by_thread.items():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list[Any]] = []  # [end, name, duration, time of children]
        for e in evs + [None]:
            start = float("inf") if e is None else e["ts"]
            while stack and stack[-1][0] <= start + _EPS_US:
                _, name, dur, kids = stack.pop()
                out[pid][name] += max(0.0, dur - kids) / 1e6
            if e is not None:
                if stack:
                    stack[-1][3] += e["dur"]
                stack.append([e["ts"] + e["dur"], e["name"], e["dur"], 0.0])
    return {r: dict(v) for r, v in out.items()}


@dataclass
class StepTime:
    """One rank's step: its bounds and how its time split (seconds since the merged trace's 0).

    ``compute + communication + waiting == end - start``; ``segments`` are the (start, end,
    kind) pieces of communication and waiting inside it (compute is the rest).
    """

    rank: int
    step: int
    start: float
    end: float
    compute: float
    communication: float
    waiting: float
    segments: list[tuple[float, float, str]] = field(default_factory=list)

    @property
    def duration(self) -> float:
        return self.end - self.start


def _is_op(e: dict[str, Any]) -> bool:
    return e.get("ph") == "X" and e.get("cat") in ("collective", "p2p")


def _op_key(e: dict[str, Any]) -> tuple[Any, ...] | None:
    """(group, its ranks, seq) of a collective event, the same on every member; None for p2p."""
    a = e.get("args")
    if e.get("cat") != "collective" or not isinstance(a, dict):
        return None
    seq, group, ranks = a.get("seq"), a.get("group"), a.get("group_ranks")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq <= 0 or not isinstance(group, str):
        return None
    return (group, tuple(ranks) if isinstance(ranks, list) and all(isinstance(r, int) for r in ranks) else None,
            seq)


def _classified(wait: list[tuple[float, float]], comm: list[tuple[float, float]]) -> list[tuple[float, float, str]]:
    """Disjoint (start, end, kind) pieces covering the union of both lists, waiting over communication."""
    pts: list[tuple[float, int, int]] = []
    for kind, ivs in ((0, wait), (1, comm)):
        for s, t in ivs:
            if t > s:
                pts.append((s, kind, 1))
                pts.append((t, kind, -1))
    pts.sort()
    out: list[tuple[float, float, str]] = []
    depth = [0, 0]
    prev = None
    for t, kind, d in pts:
        if prev is not None and t > prev and (depth[0] or depth[1]):
            k = "waiting" if depth[0] else "communication"
            if out and out[-1][2] == k and abs(out[-1][1] - prev) <= 1e-12:
                out[-1] = (out[-1][0], t, k)
            else:
                out.append((prev, t, k))
        depth[kind] += d
        prev = t
    return out


def _rank_steps(xs: list[dict[str, Any]], marks: list[float]) -> tuple[list[tuple[float, float]], str]:
    """A rank's step bounds (microseconds) and what they came from."""
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in xs if e["name"] == "step")
    if spans:
        return spans, "step spans"
    marks = sorted(marks)
    if len(marks) >= 2:
        return list(zip(marks[:-1], marks[1:])), "trace.step() marks"
    if not xs:
        return [], "none"
    return [(min(e["ts"] for e in xs), max(e["ts"] + e["dur"] for e in xs))], "whole trace"


def step_breakdown(events: list[dict[str, Any]]) -> tuple[list[StepTime], str]:
    """(compute, communication and waiting of every rank in every step, where the steps came
    from) of merged events (``ts``/``dur`` in microseconds on one clock); see the module doc."""
    xs: dict[int, list[dict[str, Any]]] = defaultdict(list)
    marks: dict[int, list[float]] = defaultdict(list)
    last_arrival: dict[tuple[Any, ...], float] = {}
    for e in events:
        ph = e.get("ph")
        if ph == "X":
            xs[e["pid"]].append(e)
            key = _op_key(e)
            if key is not None and e["ts"] > last_arrival.get(key, float("-inf")):
                last_arrival[key] = e["ts"]
        elif ph in ("i", "I") and e.get("name") == "step":
            marks[e["pid"]].append(e["ts"])
    out: list[StepTime] = []
    sources: set[str] = set()
    for r in sorted(set(xs) | set(marks)):
        wait: list[tuple[float, float]] = []
        comm: list[tuple[float, float]] = []
        for e in xs.get(r, ()):
            if not _is_op(e):
                continue
            s, t = e["ts"], e["ts"] + e["dur"]
            key = _op_key(e)
            split = s if key is None else min(max(last_arrival[key], s), t)
            wait.append((s, split))
            comm.append((split, t))
        pieces = _classified(wait, comm)
        bounds, source = _rank_steps(xs.get(r, []), marks.get(r, []))
        if bounds:
            sources.add(source)
        i = 0
        for k, (b0, b1) in enumerate(bounds):
            while i < len(pieces) and pieces[i][1] <= b0:
                i += 1
            got = {"waiting": 0.0, "communication": 0.0}
            segs: list[tuple[float, float, str]] = []
            j = i
            while j < len(pieces) and pieces[j][0] < b1:
                s, t = max(pieces[j][0], b0), min(pieces[j][1], b1)
                if t > s:
                    got[pieces[j][2]] += t - s
                    segs.append((s / 1e6, t / 1e6, pieces[j][2]))
                j += 1
            dur = b1 - b0
            out.append(StepTime(r, k, b0 / 1e6, b1 / 1e6, max(0.0, dur - got["waiting"] - got["communication"]) / 1e6,
                                got["communication"] / 1e6, got["waiting"] / 1e6, segs))
    return out, " and ".join(sorted(sources)) or "none"


def load_events(source: str) -> list[dict[str, Any]]:
    """Events of a trace directory (merged on the fly) or of a merged trace file."""
    if os.path.isdir(source):
        return merged_events(source)[0]
    events, _ = load_timeline(source)
    return [ev for ev in map(clean_event, events) if ev is not None]   # untrusted: checked


def plot(source: str, out: str | None = None, *, title: str | None = None) -> str:
    """Draw ``source`` (a trace directory or merged trace) to ``out`` (PNG); returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    events = load_events(source)
    steps, where_from = step_breakdown(events)
    if not steps:
        raise ValueError(f"{source}: no timed ('X') events to plot")
    ranks = sorted({s.rank for s in steps})
    row = {r: i for i, r in enumerate(ranks)}
    t0 = min(s.start for s in steps)
    span = max(s.end for s in steps) - t0
    unit, scale = ("s", 1.0) if span >= 1.0 else ("ms", 1e3)
    fig, (tl, bars) = plt.subplots(2, 1, figsize=(13, 3.2 + 0.4 * len(ranks) + 3.2), layout="constrained",
                                   gridspec_kw={"height_ratios": [max(1.0, 0.4 * len(ranks)), 3.0]})
    # -- timeline: the steps of each rank, coloured by kind, from the first step's start
    for s in steps:
        y = (row[s.rank] - 0.4, 0.8)
        tl.broken_barh([((s.start - t0) * scale, s.duration * scale)], y, facecolors=_COLOUR["compute"], linewidth=0)
        for kind in ("communication", "waiting"):
            xs = [((a - t0) * scale, (b - a) * scale) for a, b, k in s.segments if k == kind]
            if xs:
                tl.broken_barh(xs, y, facecolors=_COLOUR[kind], linewidth=0)
        tl.plot([(s.start - t0) * scale] * 2, [y[0], y[0] + y[1]], color="white", linewidth=0.8)
    tl.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    tl.set_ylim(len(ranks) - 0.5, -0.5)
    tl.set_xlim(0, span * scale)
    tl.set_xlabel(f"time since the first step started ({unit}); white ticks: step boundaries")
    tl.set_title(f"each rank's steps over time (steps from {where_from})")
    # -- per step: one stacked bar per rank (ranks' mean when there are many)
    nsteps = max(s.step for s in steps) + 1
    shown = list(range(max(0, nsteps - _MAX_STEPS_DRAWN), nsteps))
    per = {(s.rank, s.step): s for s in steps}
    groups = ranks if len(ranks) <= _MAX_RANK_BARS else [None]
    width = 0.8 / len(groups)
    for gi, r in enumerate(groups):
        xpos, vals = [], {k: [] for k in KINDS}
        for k in shown:
            got = [per[(q, k)] for q in (ranks if r is None else [r]) if (q, k) in per]
            if not got:
                continue
            xpos.append(k - 0.4 + width * (gi + 0.5))
            for kind in KINDS:
                vals[kind].append(1e3 * sum(getattr(s, kind) for s in got) / len(got))
        bottom = [0.0] * len(xpos)
        for kind in KINDS:
            bars.bar(xpos, vals[kind], width=width * 0.9, bottom=bottom, color=_COLOUR[kind], linewidth=0)
            bottom = [a + b for a, b in zip(bottom, vals[kind])]
        if r is not None and len(groups) > 1 and len(shown) * len(groups) <= 48:
            for x, h in zip(xpos, bottom):
                bars.annotate(f"r{r}", (x, h), ha="center", va="bottom", fontsize=7, xytext=(0, 1),
                              textcoords="offset points")
    bars.set_xticks(shown, [str(k) for k in shown] if len(shown) <= 20 else
                    [str(k) if k % 5 == 0 else "" for k in shown])
    bars.set_xlabel("step" + (f" (the last {len(shown)} of {nsteps})" if len(shown) < nsteps else ""))
    bars.set_ylabel("time (ms)")
    bars.set_title("time per step, one bar per rank" if groups[0] is not None
                   else f"time per step, mean of {len(ranks)} ranks")
    handles = [Patch(color=_COLOUR[k], label=k + (" (blocked before the last rank arrived)" if k == "waiting" else ""))
               for k in KINDS]
    fig.legend(handles=handles, loc="outside lower center", ncols=3, frameon=False)
    fig.suptitle(title or f"hpcdp trace: {os.path.basename(os.path.abspath(source))}: where each step's time went")
    if out is None:
        out = os.path.join(source, "phases.png") if os.path.isdir(source) else os.path.splitext(source)[0] + ".png"
    return save_png(fig, out)


def save_png(fig: Any, out: str) -> str:
    """Write ``fig`` to ``out`` as a PNG, never through a link planted there, and close it."""
    import matplotlib.pyplot as plt

    try:
        with atomic_write(out, "wb") as fh:
            fig.savefig(fh, format="png", dpi=100)
    finally:
        plt.close(fig)
    return out

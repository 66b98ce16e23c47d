"""``python -m hpcdp.trace plot DIR``: a PNG of where each rank's time went.

Left: per rank, the self time of each phase (an event's duration minus the events nested in it
on the same thread, so a ``backward`` span does not count the allreduces inside it twice),
stacked. Right: the timeline itself, one row per rank, coloured by the same phases.
"""
from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

from .._atomic import atomic_write
from ._files import load_timeline
from ._merge import clean_event, merged_events

__all__ = ["self_times", "plot", "load_events"]

_TOP = 9
_EPS_US = 1e-3


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

    events = load_events(source)
    times = self_times(events)
    if not times:
        raise ValueError(f"{source}: no timed ('X') events to plot")
    totals: dict[str, float] = defaultdict(float)
    for per in times.values():
        for k, v in per.items():
            totals[k] += v
    top = [k for k, _ in sorted(totals.items(), key=lambda kv: -kv[1])[:_TOP]]
    phases = top + (["other"] if len(totals) > len(top) else [])
    cmap = plt.get_cmap("tab10")
    colour = {p: cmap(i % 10) for i, p in enumerate(phases)}
    ranks = sorted(times)
    fig, (ax, tl) = plt.subplots(1, 2, figsize=(14, max(3.0, 0.45 * len(ranks) + 1.8)),
                                 gridspec_kw={"width_ratios": [1, 2]})
    left = [0.0] * len(ranks)
    for p in phases:
        vals = [times[r].get(p, 0.0) if p != "other" else
                sum(v for k, v in times[r].items() if k not in top) for r in ranks]
        ax.barh(range(len(ranks)), vals, left=left, color=colour[p], label=p)
        left = [a + b for a, b in zip(left, vals)]
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("self time (s)")
    ax.set_title("time per phase per rank")
    ax.legend(fontsize="small", loc="lower right")
    row = {r: i for i, r in enumerate(ranks)}
    spans: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e["pid"] in row:
            p = e["name"] if e["name"] in colour else "other"
            spans[(e["pid"], p)].append((e["ts"] / 1e6, max(e["dur"] / 1e6, 1e-7)))
    for (pid, p), xs in spans.items():
        tl.broken_barh(xs, (row[pid] - 0.4, 0.8), facecolors=colour[p], linewidth=0)
    tl.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    tl.set_ylim(len(ranks) - 0.5, -0.5)
    tl.set_xlabel("time since the job's first event (s)")
    tl.set_title("timeline")
    fig.suptitle(title or f"hpcdp trace: {os.path.basename(os.path.abspath(source))}")
    fig.tight_layout()
    if out is None:
        out = os.path.join(source, "phases.png") if os.path.isdir(source) else os.path.splitext(source)[0] + ".png"
    try:
        with atomic_write(out, "wb") as fh:  # never through a link planted at ``out``
            fig.savefig(fh, format="png", dpi=100)
    finally:
        plt.close(fig)
    return out


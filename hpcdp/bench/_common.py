"""Measurement helpers shared by every benchmark (the method of ../shared/PERF.md).

The machine is noisy, so figures are ratios against a baseline timed in the same launch on the
same pre-touched buffers, over interleaved trials (baseline, candidate, baseline, ...), quoting
the median of the per-trial ratios.
"""
from __future__ import annotations

import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from .._atomic import open_append
from ._targets import Target, target

__all__ = [
    "SIZES", "sizes", "Row", "time_loop", "interleaved", "busbw_factor", "print_header",
    "print_row", "JsonSink", "fmt_size", "slowest", "time_alone", "summarize", "verdict", "judged",
]

#: 8 B to 64 MiB by x4, as PERF.md asks: 8 * 4**k stops at 32 MiB, so the powers of two that
#: the targets name as bounds (1 KiB, 1 MiB, 64 MiB) are added.
SIZES: tuple[int, ...] = tuple(sorted({8 * 4**k for k in range(12)} | {1 << 10, 1 << 20, 64 << 20}))


def sizes(lo: int = 8, hi: int = 64 << 20) -> list[int]:
    return [s for s in SIZES if lo <= s <= hi]


def fmt_size(n: int) -> str:
    for unit, k in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << k:
            return f"{n / (1 << k):g} {unit}"
    return f"{n} B"


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests bus bandwidth factors."""
    if op == "allreduce":
        return 2 * (n - 1) / n if n > 1 else 1.0
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n if n > 1 else 1.0
    return 1.0


def iters_for(seconds_per_op: float, min_time: float = 0.05, min_iters: int = 20,
              max_iters: int = 10_000) -> int:
    """Enough back-to-back operations for >= min_time and >= min_iters."""
    if seconds_per_op <= 0:
        return max_iters
    return int(min(max_iters, max(min_iters, min_time / seconds_per_op)))


def time_loop(fn: Callable[[], Any], iters: int, sync: Callable[[], Any] | None = None) -> float:
    """Seconds per call of ``fn`` over ``iters`` back-to-back calls (after a sync)."""
    if sync is not None:
        sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if sync is not None:
        sync()
    return (time.perf_counter() - t0) / iters


def slowest(g: Any, t: float) -> float:
    """The largest of every rank's ``t`` (a step is as fast as its slowest rank). Collective."""
    return float(g.allreduce(np.array([t]), "max")[0])


def time_alone(g: Any, fn: Callable[[], Any], iters: int, tag: int = 77) -> float:
    """Seconds per call of ``fn`` on rank 0 while the other ranks sleep (not spin: two cores may
    be hyperthreads of one), told to every rank: the one-rank baseline of weak scaling. Collective."""
    g.barrier()
    box = np.zeros(1)
    if g.rank == 0:
        box[0] = time_loop(fn, iters)
        for w in [g.isend(box, r, tag=tag) for r in range(1, g.size)]:
            w.wait()
    else:
        req = g.irecv(box, 0, tag=tag)
        while not req.is_completed():
            time.sleep(1e-3)
    return float(box[0])


@dataclass
class Trials:
    """Per-trial times of a baseline and a candidate, interleaved."""

    base: list[float] = field(default_factory=list)
    cand: list[float] = field(default_factory=list)

    @property
    def ratios(self) -> list[float]:
        """candidate time / baseline time, per trial."""
        return [c / b for b, c in zip(self.base, self.cand)]

    @property
    def median_ratio(self) -> float:
        return statistics.median(self.ratios)

    @property
    def base_median(self) -> float:
        return statistics.median(self.base)

    @property
    def cand_median(self) -> float:
        return statistics.median(self.cand)


def interleaved(base: Callable[[], float], cand: Callable[[], float], trials: int = 5) -> Trials:
    """Run ``base`` and ``cand`` (each returns seconds per op) alternately ``trials`` times."""
    t = Trials()
    for i in range(trials):
        if i % 2 == 0:
            t.base.append(base())
            t.cand.append(cand())
        else:
            t.cand.append(cand())
            t.base.append(base())
    return t


@dataclass
class Row:
    """One nccl-tests-style result row."""

    bench: str
    op: str
    size: int
    count: int
    dtype: str
    redop: str
    root: int
    time_us: float
    algbw_gbs: float
    busbw_gbs: float
    base_time_us: float
    ratio: float  # hpcdp time / baseline time (median of per-trial ratios)
    ranks: int
    extra: dict[str, Any] = field(default_factory=dict)


def print_header(title: str, out: Any = sys.stdout) -> None:
    print(f"# {title}", file=out)
    print(f"# {'size':>10} {'count':>10} {'type':>8} {'redop':>6} {'root':>4} "
          f"{'time(us)':>10} {'algbw':>8} {'busbw':>8} {'base(us)':>10} {'t/base':>7}", file=out)
    print(f"# {'(B)':>10} {'(elems)':>10} {'':>8} {'':>6} {'':>4} {'':>10} {'(GB/s)':>8} "
          f"{'(GB/s)':>8} {'':>10} {'':>7}", file=out)


def print_row(r: Row, out: Any = sys.stdout) -> None:
    print(f"  {r.size:>10} {r.count:>10} {r.dtype:>8} {r.redop:>6} {r.root:>4} "
          f"{r.time_us:>10.2f} {r.algbw_gbs:>8.3f} {r.busbw_gbs:>8.3f} {r.base_time_us:>10.2f} "
          f"{r.ratio:>7.3f}", file=out, flush=True)


class JsonSink:
    """JSON lines to a file (``--json PATH``), one object per row or summary."""

    def __init__(self, path: str | None) -> None:
        # appended in place (several runs share one file), never through a link at ``path``
        self.fh = open_append(path) if path else None

    def write(self, obj: Any) -> None:
        if self.fh is None:
            return
        if hasattr(obj, "__dataclass_fields__"):
            obj = asdict(obj)
        self.fh.write(json.dumps(obj) + "\n")
        self.fh.flush()

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()


def pretouch(*arrays: np.ndarray) -> None:
    """Fault the pages in so neither side of a comparison pays for first touch."""
    for a in arrays:
        a.reshape(-1).view(np.uint8)[::4096] = 0


def verdict(met: bool | None) -> str:
    """How a judged figure is printed: ``met``, ``MISSED``, or ``not judged`` (a report-only
    figure, or none: no size in the range the target covers)."""
    return "not judged" if met is None else ("met" if met else "MISSED")


def judged(id: str, part: str = "", value: float | None = None, slack: float = 0.0) -> str:
    """``target OP BOUND`` (no value) or ``target OP BOUND: met`` for a benchmark's printed line,
    from ``_targets`` (a printed target and a judged one cannot differ)."""
    t = target(id, part)
    if value is None:
        return f"target {t.text}"
    return f"target {t.text}: {verdict(t.met(value, slack))}"


def summarize(sink: Any, id: str, value: float | None, *, part: str = "", ranks: int | None = None,
              variant: str = "", slack: float = 0.0, name: str | None = None,
              **extra: Any) -> bool | None:
    """Write the summary record of one judged figure to ``sink`` (a ``JsonSink``); return whether
    it meets its target (``None``: report-only, or no figure).

    The record is what ``python -m hpcdp.bench report`` reads: ``{"bench": "summary", "id",
    "part", "key", "name", "what", "value", "target", "met", "ranks", ...}``; ``variant`` tells
    apart figures of one id measured on several things in one run (a model, a schedule, a
    backend); ``slack`` widens a ``within`` target by what the record's own run allows (E1's
    padding). ``name`` keeps a benchmark's older record name (scripts match on it).
    """
    t: Target = target(id, part)
    v = None if value is None or not math.isfinite(float(value)) else float(value)
    met = t.met(v, slack)
    label = t.key + (f" [{variant}]" if variant else "")
    rec: dict[str, Any] = {"bench": "summary", "id": id, "part": part, "key": t.key,
                           "name": name or f"{label}: {t.what}", "what": t.what, "value": v,
                           "target": t.text, "met": met, "ranks": ranks}
    if variant:
        rec["variant"] = variant
    if slack:
        rec["slack"] = slack
    rec.update(extra)
    sink.write(rec)
    return met

"""Benchmark pictures: bus bandwidth and latency against size, hpcdp beside its baseline.

Reads the JSON lines every benchmark writes with ``--json`` (or the rows themselves) and draws
one panel per operation as nccl-tests / OSU results are usually drawn, with the PERF.md target
marked: a dashed "target x baseline" curve over the sizes the target covers, and a closing panel
of every single-figure result (DDP, checkpoint, the A-series summaries) against its target.

Offline analysis of files, like the rest of ``trace``'s tools, so it lives here: the benchmarks
(``hpcdp.bench``, a layer above) draw through it (``--plot``), and ``python -m hpcdp.trace
plot-bench`` needs no import of them.

    python -m hpcdp.trace plot-bench .bench/*.jsonl -o bench.png
    python -m hpcdp.bench._plot .bench/*.jsonl -o bench.png
"""
from __future__ import annotations

import json
import math
import os
import re
from collections import defaultdict
from dataclasses import asdict, is_dataclass
from typing import Any, Callable, Iterable, Sequence

from ._plot import save_png

__all__ = ["load_rows", "plot_rows", "plot_files", "BW_TARGETS"]

MIB = 1 << 20
#: (bench, op) -> (busbw ratio the target asks for, smallest size it covers, baseline's name)
BW_TARGETS: dict[tuple[str, str], tuple[float, int, str]] = {
    ("collectives", "allreduce"): (0.97, MIB, "mpi4py"),
    ("collectives", "all_gather"): (0.95, MIB, "mpi4py"),
    ("collectives", "reduce_scatter"): (0.95, MIB, "mpi4py"),
    ("collectives", "broadcast"): (0.95, MIB, "mpi4py"),
}
_MAX_LINE = 1 << 20


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def load_rows(paths: Iterable[str], on_bad: Callable[[str], Any] | None = None) -> list[dict[str, Any]]:
    """Every JSON object of the given JSON-lines files. A bad line is an error naming file:line;
    with ``on_bad``, that message (and a file that cannot be read) goes to ``on_bad`` and the rest
    is read on (the benchmark report: one bad file must not hide the others)."""
    rows: list[dict[str, Any]] = []

    def bad(msg: str) -> None:
        if on_bad is None:
            raise ValueError(msg)
        on_bad(msg)

    for path in paths:
        try:
            fh = open(path, encoding="utf-8", errors="replace")
        except OSError as exc:
            if on_bad is None:
                raise
            on_bad(f"cannot read {path}: {exc.strerror or exc}")
            continue
        with fh:
            for i, line in enumerate(fh, 1):
                if len(line) > _MAX_LINE:
                    bad(f"{path}:{i}: line longer than {_MAX_LINE} characters")
                    continue
                line = line.strip()
                if not line:
                    continue
                try:
                    obj = json.loads(line)
                except (ValueError, RecursionError) as exc:  # also too deeply nested, too long a number
                    bad(f"{path}:{i}: not JSON ({type(exc).__name__}: {str(exc)[:200]})")
                    continue
                if not isinstance(obj, dict) or not isinstance(obj.get("bench"), str):
                    bad(f"{path}:{i}: not a benchmark row (an object with 'bench')")
                    continue
                rows.append(obj)
    return rows


def _as_dicts(rows: Iterable[Any]) -> list[dict[str, Any]]:
    return [asdict(r) if is_dataclass(r) and not isinstance(r, type) else dict(r) for r in rows]


class _Panel:
    """One axes: named (size, value) series; times are drawn on a log scale."""

    def __init__(self, title: str, ylabel: str) -> None:
        self.title, self.ylabel = title, ylabel
        self.log_y = ylabel.startswith("time")
        self.series: list[tuple[str, list[float], list[float], dict[str, Any]]] = []

    def line(self, label: str, xs: Sequence[float], ys: Sequence[float], **style: Any) -> None:
        pts = sorted((x, y) for x, y in zip(xs, ys) if x is not None and y is not None and y > 0)
        if pts:
            self.series.append((label, [p[0] for p in pts], [p[1] for p in pts], style))


def _collective_panels(rows: list[dict[str, Any]]) -> list[_Panel]:
    panels = []
    groups: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if r.get("bench") == "collectives" and _num(r.get("size")) and _num(r.get("busbw_gbs")):
            groups[(str(r.get("op")), int(r.get("ranks") or 0))].append(r)
    for (op, n), rs in sorted(groups.items()):
        p = _Panel(f"{op}, {n} ranks: bus bandwidth", "busbw (GB/s)")
        xs = [_num(r["size"]) for r in rs]
        base = [(_num(r.get("busbw_gbs")) or 0) * (_num(r.get("time_us")) or 0) / (_num(r.get("base_time_us")) or math.inf)
                for r in rs]
        p.line("hpcdp", xs, [_num(r["busbw_gbs"]) for r in rs], marker="o")
        tgt = BW_TARGETS.get(("collectives", op), (None, 0, "baseline"))
        p.line(tgt[2], xs, base, marker="s")
        if tgt[0] is not None:
            cov = [(x, b * tgt[0]) for x, b in zip(xs, base) if x is not None and x >= tgt[1]]
            p.line(f"target: >= {tgt[0]:g} x {tgt[2]} (>= {_fmt_size(tgt[1])})", [c[0] for c in cov],
                   [c[1] for c in cov], linestyle="--", color="black")
        panels.append(p)
        lat = _Panel(f"{op}, {n} ranks: time per op", "time (us)")
        lat.line("hpcdp", xs, [_num(r.get("time_us")) for r in rs], marker="o")
        lat.line(tgt[2], xs, [_num(r.get("base_time_us")) for r in rs], marker="s")
        panels.append(lat)
    lat_rows = [r for r in rows if r.get("bench") == "latency"]
    if lat_rows:
        p = _Panel("allreduce latency (barrier between calls)", "time (us)")
        xs = [_num(r.get("size")) for r in lat_rows]
        base = [_num(r.get("base_time_us")) for r in lat_rows]
        p.line("hpcdp", xs, [_num(r.get("time_us")) for r in lat_rows], marker="o")
        p.line("mpi4py", xs, base, marker="s")
        p.line("target: <= mpi4py + 3 us", xs, [None if b is None else b + 3 for b in base],
               linestyle="--", color="black")
        panels.append(p)
    return panels


def _pair_panels(rows: list[dict[str, Any]]) -> list[_Panel]:
    """sim (C1), TCP B1 and B2: one panel per figure, hpcdp beside its baseline."""
    panels = []
    sim = [r for r in rows if r.get("bench") == "sim"]
    if sim:
        p = _Panel(f"sim allreduce, {sim[0].get('ranks', '?')} ranks: time", "time (us)")
        xs = [_num(r.get("size")) for r in sim]
        base = [_num(r.get("base_time_us")) for r in sim]
        p.line("hpcdp sim", xs, [_num(r.get("time_us")) for r in sim], marker="o")
        p.line("numpy sum + copies", xs, base, marker="s")
        p.line("target: <= 2 x baseline (>= 1 MiB)", *_covered(xs, base, 2.0, MIB), linestyle="--", color="black")
        panels.append(p)
    b1 = [r for r in rows if r.get("bench") == "B1"]
    if b1:
        xs = [_num(r.get("size")) for r in b1]
        p = _Panel("TCP send/recv (B1): bandwidth", "GB/s")
        raw = [_num(r.get("raw_GBps")) for r in b1]
        p.line("hpcdp", xs, [_num(r.get("hpcdp_GBps")) for r in b1], marker="o")
        p.line("raw socket", xs, raw, marker="s")
        p.line("target: >= 0.9 x raw (>= 1 MiB)", *_covered(xs, raw, 0.9, MIB), linestyle="--", color="black")
        panels.append(p)
        q = _Panel("TCP send/recv (B1): latency", "time (us)")
        raw_t = [_num(r.get("raw_us")) for r in b1]
        q.line("hpcdp", xs, [_num(r.get("hpcdp_us")) for r in b1], marker="o")
        q.line("raw socket", xs, raw_t, marker="s")
        q.line("target: <= 1.5 x raw (8 B)", *_covered(xs, raw_t, 1.5, 0, 8), linestyle="--", color="black")
        panels.append(q)
    by_n: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if r.get("bench") == "B2":
            by_n[int(r.get("ranks") or 0)].append(r)
    for n, rs in sorted(by_n.items()):
        p = _Panel(f"TCP allreduce (B2), {n} ranks: bus bandwidth", "busbw (GB/s)")
        xs = [_num(r.get("size")) for r in rs]
        gloo = [_num(r.get("gloo_busbw_GBps")) for r in rs]
        p.line("hpcdp", xs, [_num(r.get("hpcdp_busbw_GBps")) for r in rs], marker="o")
        p.line("torch gloo", xs, gloo, marker="s")
        t = 1.5 if n <= 2 else 1.0
        p.line(f"target: >= {t:g} x gloo (>= 4 MiB)", *_covered(xs, gloo, t, 4 * MIB), linestyle="--", color="black")
        panels.append(p)
    return panels


def _covered(xs: Sequence[float | None], base: Sequence[float | None], factor: float, lo: int,
             hi: float = math.inf) -> tuple[list[float], list[float]]:
    pts = [(x, b * factor) for x, b in zip(xs, base) if x is not None and b is not None and lo <= x <= hi]
    return [p[0] for p in pts], [p[1] for p in pts]


_TARGET = re.compile(r"^\s*(>=|<=)\s*\+?\s*([0-9.]+)")


def _figure_rows(rows: list[dict[str, Any]]) -> list[tuple[str, float, str, float]]:
    """(label, value, direction, target) of every single-figure result.

    Files from benchmarks that write summary records (one per judged figure, with an ``id`` and
    the target it is judged by, declared once in ``hpcdp/bench/_targets.py``) are drawn from
    those alone; the per-benchmark rows below serve files written before them."""
    out = []
    summaries = any(r.get("bench") == "summary" and "id" in r for r in rows)
    for r in rows:
        b = r.get("bench")
        if b == "summary":
            m = _TARGET.match(str(r.get("target", "")))
            v = _num(r.get("value"))
            if m and v is not None:
                label = r.get("name") or " ".join(str(x) for x in (r.get("id"), r.get("part")) if x)
                out.append((str(label)[:60], v, m.group(1), float(m.group(2))))
        elif summaries:
            continue
        elif b in ("ddp", "checkpoint") and isinstance(r.get("extra"), dict):
            ex = r["extra"]
            if b == "ddp":
                m = _TARGET.match(str(ex.get("target", "")))
                v = _num(r.get("ratio"))
                if m and v is not None:
                    out.append((f"{str(r.get('op'))[:40]}: time / baseline", v, m.group(1), float(m.group(2))))
            else:
                v, t = _num(ex.get("bw_ratio")), _num(ex.get("target"))
                if v is not None and t is not None:
                    out.append((f"checkpoint {r.get('op')}, {r.get('ranks')} ranks: bw / MPI-IO", v, ">=", t))
        elif b == "ddp" and r.get("op") == "D4" and _num(r.get("efficiency")) is not None:
            out.append((f"D4 weak scaling efficiency, {r.get('ranks')} ranks", float(r["efficiency"]), ">=", 0.85))
        elif b == "E3" and r.get("kind") == "zero3" and _num(r.get("ratio")) is not None:
            out.append((f"E3 ZeRO-3 step / DDP step, {r.get('ranks')} ranks", float(r["ratio"]), "<=", 1.3))
        elif b == "E4" and _num(r.get("ratio")) is not None and _num(r.get("ranks")):
            out.append((f"E4 ZeRO-3 / DDP model size, {r.get('ranks')} ranks", float(r["ratio"]), ">=",
                        0.8 * float(r["ranks"])))
        elif b == "F1":   # python -m hpcdp.bench pipeline
            name = f"F1 {str(r.get('schedule'))[:30]}, {r.get('ranks')} ranks"
            ratio, bubble, theory = _num(r.get("ratio")), _num(r.get("bubble")), _num(r.get("bubble_theory"))
            if ratio is not None:
                out.append((f"{name}: step / ideal", ratio, "<=", 1.10))
            if bubble is not None and theory is not None:
                out.append((f"{name}: |bubble - theory|", abs(bubble - theory), "<=", 0.03))
    return out


def _fmt_size(n: float) -> str:
    for unit, k in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << k:
            return f"{n / (1 << k):g} {unit}"
    return f"{int(n)} B"


def plot_rows(rows: Iterable[Any], out: str, *, title: str | None = None) -> str:
    """Draw benchmark rows (dicts or ``Row``s) to the PNG ``out``; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = _as_dicts(rows)
    panels = _collective_panels(data) + _pair_panels(data)
    figures = _figure_rows(data)
    n = len(panels) + (1 if figures else 0)
    if n == 0:
        raise ValueError("no benchmark rows to plot (expected rows written with --json)")
    cols = min(3, n)
    nrows = (n + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(6.2 * cols, 4.2 * nrows), squeeze=False)
    flat = [a for row in axes for a in row]
    for ax, p in zip(flat, panels):
        for label, xs, ys, style in p.series:
            ax.plot(xs, ys, label=label, **style)
        ax.set_xscale("log", base=2)
        if p.log_y:
            ax.set_yscale("log")
        ticks = sorted({x for _, xs, _, _ in p.series for x in xs})
        if ticks:
            step = max(1, len(ticks) // 8)
            ax.set_xticks(ticks[::step], [_fmt_size(t) for t in ticks[::step]], rotation=30, fontsize="small")
        ax.set_xlabel("message size")
        ax.set_ylabel(p.ylabel)
        ax.set_title(p.title, fontsize="medium")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize="x-small")
    if figures:
        ax = flat[len(panels)]
        labels = [f"{lab} = {v:.3g} (target {d} {t:g})" for lab, v, d, t in figures]
        norm = [v / t if t else float("nan") for _, v, _, t in figures]
        met = [(v >= t) if d == ">=" else (v <= t) for _, v, d, t in figures]
        ax.barh(range(len(figures)), norm, color=["tab:green" if m else "tab:red" for m in met])
        ax.axvline(1.0, color="black", linestyle="--", label="target")
        ax.set_yticks(range(len(figures)), labels, fontsize="x-small")
        ax.invert_yaxis()
        ax.set_xlabel("value / target (green: met)")
        ax.set_title("single figures against PERF.md targets", fontsize="medium")
    for ax in flat[n:]:
        ax.set_visible(False)
    fig.suptitle(title or "hpcdp benchmarks: hpcdp beside its baseline")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    return save_png(fig, out)


def plot_files(paths: Sequence[str], out: str, *, title: str | None = None) -> str:
    """``plot_rows`` of the JSON lines in ``paths``."""
    return plot_rows(load_rows(paths), out, title=title)

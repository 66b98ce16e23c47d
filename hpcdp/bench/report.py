"""``python -m hpcdp.bench report FILES...``: one table of every PERF.md id, its figure, met or missed.

Reads the JSON lines the benchmarks wrote with ``--json`` (``make bench`` ends with this over
``.bench/*.jsonl``) and prints one row per figure of ``_targets.TARGETS``:
``id | what | figure | target | met / MISSED / not run``. The figure of one run is the value its
summary record holds; several runs of a figure (a file appended by repeated runs, or one id in
several files, as A1 in both import orders) show their median and range, and meet the target only
when every run does (the issue's "in every run"). Each figure is judged again here against the
table, not by the ``met`` a record carries, so a record written before a target moved is judged
by today's target. A record of a world size other than the one its target is gated at (PERF.md:
gate on 2 ranks) is listed on its own row as a trend, not judged. Ids with no record are
"not run". A report is not a test: it exits 0 whatever it finds (2 for a usage error only).
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence, TextIO

from ..trace.benchplot import load_rows
from ._targets import TARGETS, Target

__all__ = ["main", "parser", "read_records", "build_rows", "format_table", "ReportRow"]

NOT_RUN = "not run"
TREND = "trend"


@dataclass
class ReportRow:
    """One line of the table: a figure of one target (and one variant, one world size)."""

    key: str
    what: str
    target: str
    values: list[float] = field(default_factory=list)
    status: str = NOT_RUN

    @property
    def figure(self) -> str:
        vals = self.values
        if not vals:
            return "-"
        med = statistics.median(vals)
        if len(vals) == 1 or min(vals) == max(vals):
            return _num(med) + (f" ({len(vals)} runs)" if len(vals) > 1 else "")
        return f"{_num(med)} ({_num(min(vals))} - {_num(max(vals))}, {len(vals)} runs)"


def _num(v: float) -> str:
    return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.3e}"


def read_records(paths: Iterable[str], err: TextIO = sys.stderr) -> list[dict[str, Any]]:
    """The summary records of ``paths`` (JSON lines). A file that cannot be read, or a line that is
    not a benchmark row, is named on ``err`` and skipped: one bad file must not hide the rest."""
    rows = load_rows(paths, on_bad=lambda msg: print(f"# report: {msg}, skipped", file=err))
    return [r for r in rows if r.get("bench") == "summary" and isinstance(r.get("id"), str)]


def _value(rec: dict[str, Any]) -> float | None:
    v = rec.get("value")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def _slack(rec: dict[str, Any]) -> float:
    s = rec.get("slack", 0.0)
    return float(s) if isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) else 0.0


def _status(t: Target | None, recs: list[dict[str, Any]], gated: bool) -> str:
    judged: list[bool | None] = []
    for r in recs:
        v = _value(r)
        if v is None:
            continue
        if t is None:  # a figure this table does not declare: the record's own verdict
            m = r.get("met")
            judged.append(m if isinstance(m, bool) else None)
        else:
            judged.append(t.met(v, _slack(r)))
    if not judged:
        return "no figure"
    if t is not None and t.op == "report":
        return "report"
    if not gated:
        return TREND
    if any(m is False for m in judged):
        return "MISSED"
    if all(m is True for m in judged):
        return "met"
    return "report"


def build_rows(records: Sequence[dict[str, Any]],
               targets: Sequence[Target] = TARGETS) -> list[ReportRow]:
    """One row per declared figure (``not run`` without records) and per (variant, world size)
    seen, in the table's order; then records naming figures the table does not declare."""
    by_key: dict[tuple[str, str], Target] = {(t.id, t.part): t for t in targets}
    groups: dict[tuple[str, str], dict[tuple[str, int | None, bool], list[dict[str, Any]]]] = {}
    for r in records:
        part = r.get("part") if isinstance(r.get("part"), str) else ""
        key = (r["id"], part)
        t = by_key.get(key)
        ranks = r.get("ranks") if isinstance(r.get("ranks"), int) and not isinstance(r.get("ranks"), bool) else None
        gated = t is None or t.ranks is None or ranks == t.ranks
        variant = r.get("variant") if isinstance(r.get("variant"), str) else ""
        sub = (variant, None if gated else ranks, gated)
        groups.setdefault(key, {}).setdefault(sub, []).append(r)
    rows: list[ReportRow] = []

    def emit(t: Target | None, key: tuple[str, str], subs: dict[tuple[str, int | None, bool], list]) -> None:
        # gated rows first, then trends by world size
        for (variant, ranks, gated) in sorted(subs, key=lambda s: (not s[2], s[1] or 0, s[0])):
            recs = subs[(variant, ranks, gated)]
            name = (t.key if t else (f"{key[0]} {key[1]}" if key[1] else key[0]))
            what = t.what if t else str(recs[-1].get("what") or recs[-1].get("name") or "")
            if not gated:
                what = f"({ranks} ranks, not gated) {what}"
            if variant:   # first: a long description is cut at the end, not the variant
                what = f"[{variant}] {what}"
            target = t.text if t else str(recs[-1].get("target", "?"))
            vals = [v for v in map(_value, recs) if v is not None]
            rows.append(ReportRow(name, what, target, vals, _status(t, recs, gated)))

    for t in targets:
        subs = groups.pop((t.id, t.part), None)
        if not subs:
            rows.append(ReportRow(t.key, t.what, t.text))
        else:
            emit(t, (t.id, t.part), subs)
    for key, subs in groups.items():   # not declared here: shown as written
        emit(None, key, subs)
    return rows


def format_table(rows: Sequence[ReportRow], what_width: int = 72) -> str:
    """The rows as one fixed-width table, and a closing count of each status."""
    def cut(s: str) -> str:
        return s if len(s) <= what_width else s[:what_width - 3] + "..."

    head = ("id", "what", "figure", "target", "status")
    cells = [(r.key, cut(r.what), r.figure, r.target, r.status) for r in rows]
    w = [max(len(head[i]), *(len(c[i]) for c in cells)) if cells else len(head[i]) for i in range(5)]
    line = " | ".join

    def fmt(c: Sequence[str]) -> str:
        return line(c[i].ljust(w[i]) for i in range(5)).rstrip()

    out = [fmt(head), "-+-".join("-" * x for x in w)]
    out += [fmt(c) for c in cells]
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.status] = counts.get(r.status, 0) + 1
    order = ["met", "MISSED", NOT_RUN, "report", TREND, "no figure"]
    out.append("# " + ", ".join(f"{counts[k]} {k}" for k in order + sorted(set(counts) - set(order))
                                if counts.get(k)))
    return "\n".join(out)


def parser() -> argparse.ArgumentParser:
    """Options of the report."""
    p = argparse.ArgumentParser(
        prog="python -m hpcdp.bench report",
        description="One table of every PERF.md id: its figure (median, and the range over runs), "
                    "its target, and met / MISSED / not run, from the JSON lines benchmarks wrote "
                    "with --json. Exits 0 whatever it finds.")
    p.add_argument("files", nargs="*", metavar="FILE",
                   help="JSON-lines files written by the benchmarks' --json (e.g. .bench/*.jsonl)")
    p.add_argument("--what-width", type=int, default=72, help="characters of the 'what' column")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Print the table; 0 whatever the figures are."""
    args = parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    records = read_records(args.files)
    print(f"# hpcdp benchmark report: {len(records)} summary records from {len(args.files)} file(s); "
          "targets from hpcdp/bench/_targets.py (../shared/PERF.md)")
    print(format_table(build_rows(records), max(20, args.what_width)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

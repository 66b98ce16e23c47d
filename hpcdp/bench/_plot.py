"""Benchmarks' ``--plot``: draw the rows a run wrote, through ``hpcdp.trace.benchplot``.

    python -m hpcdp.bench._plot .bench/*.jsonl -o bench.png
    # in a benchmark: add_plot_argument(parser); ...; maybe_plot(args, rows)
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Iterable, Sequence

from ..trace.benchplot import load_rows, plot_files, plot_rows

__all__ = ["load_rows", "plot_rows", "plot_files", "add_plot_argument", "maybe_plot", "PlotSink", "main"]


def add_plot_argument(parser: argparse.ArgumentParser) -> None:
    """``--plot out.png`` for a benchmark's argument parser."""
    parser.add_argument("--plot", default=None, metavar="PNG",
                        help="also draw the results (busbw / latency vs size beside the baseline) to this PNG")


class PlotSink:
    """A benchmark's ``JsonSink`` that also keeps every row written, for ``maybe_plot``."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.rows: list[Any] = []

    def write(self, obj: Any) -> None:
        self.rows.append(obj)
        self.inner.write(obj)

    def close(self) -> None:
        self.inner.close()


def maybe_plot(args: argparse.Namespace, rows: Iterable[Any], *, title: str | None = None) -> str | None:
    """Draw ``rows`` to ``args.plot`` when given (call on the rank that holds the rows)."""
    out = getattr(args, "plot", None)
    if not out:
        return None
    path = plot_rows(rows, out, title=title)
    print(f"# plot: {path}", flush=True)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hpcdp.bench._plot",
                                description="Draw benchmark JSON lines (written with --json) to a PNG.")
    p.add_argument("files", nargs="+")
    p.add_argument("-o", "--out", required=True)
    p.add_argument("--title", default=None)
    a = p.parse_args(argv)
    try:
        print(plot_files(a.files, a.out, title=a.title))
    except (OSError, ValueError) as exc:
        print(f"python -m hpcdp.bench._plot: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

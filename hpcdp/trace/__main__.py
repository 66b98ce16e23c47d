"""``python -m hpcdp.trace {analyze,merge,plot,plot-bench} ...``: read what a job left behind."""
from __future__ import annotations

import argparse
import sys

from ._analyze import describe, find_divergence, stale_note, summary
from ._files import load_flight_records
from ._merge import merge
from ._overhead import main as overhead
from ._plot import plot
from .benchplot import plot_files


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hpcdp.trace",
        description="Read the flight records and timelines that hpcdp ranks write to HPCDP_TRACE_DIR "
                    "(default ./hpcdp-trace/).")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{analyze,merge,plot,plot-bench,overhead}")
    a = sub.add_parser("analyze", help="name the first operation where the ranks' flight records diverge",
                       description="Merge the ranks' flight records (flight-rank<N>.json) and print, one "
                                   "fact per line, the first operation where the ranks diverge: which ranks "
                                   "reached it, which did not and what those were doing instead (or that "
                                   "they finished normally), with source lines.")
    a.add_argument("directory", help="directory holding flight-rank<N>.json files")
    a.add_argument("-v", "--verbose", action="store_true", help="also one line per rank")
    m = sub.add_parser("merge", help="one Chrome-trace JSON of every rank (opens in Perfetto)",
                       description="Merge trace-rank<N>.json timelines (HPCDP_TRACE=1), or the flight "
                                   "records when there are none, into one Chrome trace on a common clock.")
    m.add_argument("directory")
    m.add_argument("-o", "--out", default=None, help="output file (default DIR/merged-trace.json)")
    pl = sub.add_parser("plot", help="PNG of time per phase per rank",
                        description="Draw self time per phase per rank, and the timeline, to a PNG.")
    pl.add_argument("source", help="a trace directory or a merged trace file")
    pl.add_argument("-o", "--out", default=None, help="output PNG (default DIR/phases.png)")
    b = sub.add_parser("plot-bench", help="PNG of benchmark JSON lines (python -m hpcdp.bench ... --json)",
                       description="Draw benchmark results as nccl-tests/OSU plots: bus bandwidth and latency "
                                   "against size, hpcdp beside its baseline, the PERF.md target marked.")
    b.add_argument("files", nargs="+", help="JSON-lines files written with --json")
    b.add_argument("-o", "--out", required=True, help="output PNG")
    o = sub.add_parser("overhead", help="ns per operation that recording costs, per mode",
                       description="Micro-benchmark of the flight recorder's begin+end in each mode.")
    o.add_argument("-n", type=int, default=200_000, help="begin+end pairs per trial")
    o.add_argument("--trials", type=int, default=7)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.cmd == "analyze":
            stale: list[int] = []
            records = load_flight_records(args.directory, stale)
            print(describe(find_divergence(records), records) + stale_note(stale))
            if args.verbose:
                print("\n".join(summary(records)))
        elif args.cmd == "merge":
            print(merge(args.directory, args.out))
        elif args.cmd == "plot":
            print(plot(args.source, args.out))
        elif args.cmd == "overhead":
            return overhead(["-n", str(args.n), "--trials", str(args.trials)])
        else:
            print(plot_files(args.files, args.out))
    except (OSError, ValueError) as exc:
        print(f"python -m hpcdp.trace {args.cmd}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

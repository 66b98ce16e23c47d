"""``python -m hpcdp.bench collectives --backend sim`` (or ``python -m hpcdp.bench sim``): C1 of PERF.md.

Simulated allreduce on N thread-ranks vs what it must at least do: numpy adds of the N arrays
into one result plus one copy out per rank, timed in the same process on the same buffers.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import hpcdp

from ._common import JsonSink, fmt_size, interleaved, judged, pretouch, sizes, summarize
from ._plot import PlotSink, add_plot_argument, maybe_plot


def parser(prog: str = "python -m hpcdp.bench sim") -> argparse.ArgumentParser:
    """Options of C1."""
    p = argparse.ArgumentParser(
        prog=prog,
        description="Simulated backend: C1, allreduce on N thread ranks against numpy adding the N "
                    "arrays and copying the sum out to each, in the same process.")
    p.add_argument("--ranks", type=int, default=4, help="simulated (thread) ranks")
    p.add_argument("--min-size", type=int, default=1 << 20, help="smallest array in bytes")
    p.add_argument("--max-size", type=int, default=64 << 20, help="largest array in bytes")
    p.add_argument("--trials", type=int, default=5, help="interleaved sim/numpy trials per size")
    p.add_argument("--json", default=None, help="append JSON lines here")
    add_plot_argument(p)
    return p


def main(argv: list[str] | None = None, prog: str = "python -m hpcdp.bench sim") -> int:
    args = parser(prog).parse_args(sys.argv[1:] if argv is None else argv)
    n = args.ranks
    sink = PlotSink(JsonSink(args.json))
    print(f"# sim allreduce, {n} thread ranks, float32, median of {args.trials} interleaved trials")
    print(f"# {'size':>10} {'sim(us)':>10} {'numpy(us)':>10} {'ratio':>7}   (C1 {judged('C1')})")
    ratios = []
    for size in sizes(args.min_size, args.max_size):
        count = size // 4
        xs = [np.full(count, r + 1, np.float32) for r in range(n)]
        outs = [np.empty(count, np.float32) for _ in range(n)]
        acc = np.empty(count, np.float32)
        pretouch(*xs, *outs, acc)
        iters = max(3, min(50, int(0.2 / (size / 2e9))))

        def baseline() -> float:
            t0 = time.perf_counter()
            for _ in range(iters):
                np.add(xs[0], xs[1], out=acc)
                for x in xs[2:]:
                    np.add(acc, x, out=acc)
                for o in outs:
                    np.copyto(o, acc)
            return (time.perf_counter() - t0) / iters

        def simulated() -> float:
            times = [0.0] * n

            def body(rank: int) -> None:
                hpcdp.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    hpcdp.allreduce(xs[rank], out=outs[rank])
                hpcdp.barrier()
                times[rank] = (time.perf_counter() - t0) / iters

            hpcdp.spawn(body, n)
            return max(times)

        tr = interleaved(baseline, simulated, args.trials)
        ratios.append(tr.median_ratio)
        assert np.allclose(outs[0][:4], n * (n + 1) / 2)
        print(f"  {size:>10} {tr.cand_median * 1e6:>10.1f} {tr.base_median * 1e6:>10.1f} "
              f"{tr.median_ratio:>7.3f}", flush=True)
        sink.write({"bench": "sim", "op": "allreduce", "size": size, "ranks": n,
                    "time_us": tr.cand_median * 1e6, "base_time_us": tr.base_median * 1e6,
                    "ratio": tr.median_ratio})
    med = float(np.median(ratios)) if ratios else float("nan")
    covered = [r for s, r in zip(sizes(args.min_size, args.max_size), ratios) if s >= 1 << 20]
    figure = float(np.median(covered)) if covered else float("nan")   # C1 covers >= 1 MiB
    print(f"# C1 sim allreduce / numpy sum+copies, {fmt_size(args.min_size)}-{fmt_size(args.max_size)}: "
          f"worst {max(ratios, default=float('nan')):.3f}, median {med:.3f} "
          + (f"(median >= 1 MiB {figure:.3f}: {judged('C1', '', figure)})" if covered
             else f"(no size >= 1 MiB: C1 not judged, {judged('C1')})"))
    if covered:
        summarize(sink, "C1", figure, ranks=n, worst=max(covered), sizes=len(covered))
    sink.close()
    maybe_plot(args, sink.rows, title=f"hpcdp sim allreduce (C1), {n} thread ranks")
    return 0


if __name__ == "__main__":
    sys.exit(main())

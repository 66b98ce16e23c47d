"""``mpirun -n 2 python -m hpcdp.bench collectives``: hpcdp vs raw mpi4py on the same buffers.

Reports nccl-tests-style rows per op and size, then the PERF.md ratios:
A1 allreduce busbw >= 1 MiB, A2 allreduce latency 8 B - 1 KiB, A3 all_gather / reduce_scatter /
broadcast busbw >= 1 MiB, A5 an 8 B collective vs mpi4py's pickle-based ``allreduce``.

A1 and A2 must hold whether a script imports mpi4py (which runs ``MPI_Init``) before hpcdp or
after, so ``--import-order`` picks the order of one launch; run outside ``mpirun``, the default
(``both``) launches ``mpirun -n RANKS --bind-to core`` once per order and prints A1/A2 side by side.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import numpy as np

import hpcdp

from .._atomic import open_append
from ._common import (JsonSink, Row, busbw_factor, fmt_size, interleaved, pretouch, print_header, print_row,
                      sizes, summarize, verdict)
from ._targets import target
from ._plot import PlotSink, add_plot_argument, maybe_plot

OPS = ("allreduce", "all_gather", "reduce_scatter", "broadcast")


BACKENDS = ("mpi", "tcp", "sim")


def parser() -> argparse.ArgumentParser:
    """Options of the MPI benchmark, and ``--backend`` naming the TCP and simulated ones."""
    p = argparse.ArgumentParser(
        prog="python -m hpcdp.bench collectives",
        description="hpcdp collectives against raw mpi4py on the same buffers (A1-A5, under mpirun), "
                    "the TCP backend against sockets and gloo (B1, B2) or the simulated backend "
                    "against numpy (C1).",
        epilog="'--backend tcp --help' and '--backend sim --help' list the options of those backends.")
    p.add_argument("--backend", choices=BACKENDS, default="mpi",
                   help="mpi: A1-A5 under mpirun, the options below; tcp: B1/B2, local processes; "
                        "sim: C1, thread ranks (default: mpi)")
    p.add_argument("--ops", default=",".join(OPS), help="comma-separated collectives to time (default: all)")
    p.add_argument("--min-size", type=int, default=8, help="smallest message in bytes")
    p.add_argument("--max-size", type=int, default=64 << 20, help="largest message in bytes")
    p.add_argument("--trials", type=int, default=5, help="interleaved hpcdp/mpi4py trials per size")
    p.add_argument("--min-time", type=float, default=0.05, help="seconds per timed loop")
    p.add_argument("--dtype", default="float32", help="numpy dtype of the buffers")
    p.add_argument("--json", default=None, help="append JSON lines here")
    p.add_argument("--import-order", choices=("hpcdp-first", "mpi4py-first", "both"), default=None,
                   help="import hpcdp or mpi4py first (default: hpcdp-first under mpirun; both, "
                        "as two mpirun launches, outside it)")
    p.add_argument("--ranks", type=int, default=2, help="ranks per launch with --import-order both")
    add_plot_argument(p)
    return p


def _parse(argv: list[str]) -> argparse.Namespace:
    return parser().parse_args(argv)


def _backend(argv: list[str]) -> tuple[str, list[str]]:
    """``--backend`` and the other arguments, for the TCP and sim benchmarks' own parsers."""
    pre = argparse.ArgumentParser(prog="python -m hpcdp.bench collectives", add_help=False)
    pre.add_argument("--backend", choices=BACKENDS, default="mpi")
    known, rest = pre.parse_known_args(argv)
    return known.backend, rest


_ORDERS = ("hpcdp-first", "mpi4py-first")


def _under_launcher() -> bool:
    return any(k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"))


def _both_orders(args: argparse.Namespace, argv: list[str]) -> int:
    """One ``mpirun`` launch per import order; their output, then A1/A2 side by side."""
    if _under_launcher():
        print("--import-order both launches mpirun itself: run it outside mpirun, or pick one "
              "order per launch", file=sys.stderr)
        return 2
    rest, skip = [], False
    for a in argv:  # drop our own options; the launches get the rest
        if skip:
            skip = False
        elif a in ("--import-order", "--ranks", "--json", "--plot"):
            skip = True
        elif not a.startswith(("--import-order=", "--ranks=", "--json=", "--plot=")):
            rest.append(a)
    summaries: dict[str, dict[str, float]] = {}
    drawn: list[dict] = []
    for order in _ORDERS:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.jsonl")
            cmd = ["mpirun", "-n", str(args.ranks), "--bind-to", "core", "--oversubscribe",
                   sys.executable, "-m", "hpcdp.bench", "collectives", "--import-order", order,
                   "--json", out, *rest]
            print(f"# launch: {' '.join(cmd)}", flush=True)
            code = subprocess.call(cmd, stdin=subprocess.DEVNULL)
            if code != 0:
                return code
            with open(out) as fh:
                lines = [json.loads(line) for line in fh]
        if args.json:
            with open_append(args.json) as fh:
                fh.writelines(json.dumps(obj) + "\n" for obj in lines)
        summaries[order] = {o["name"]: o["value"] for o in lines if o.get("bench") == "summary"}
        if order == _ORDERS[0]:
            drawn = lines  # one order's rows: the plot shows hpcdp beside mpi4py, not two copies
    print(f"# by import order (A1: busbw ratio, target {target('A1').text}; A2: worst overhead, "
          f"target {target('A2', 'mean').text})")
    for name in summaries[_ORDERS[0]]:
        if name.startswith(("A1", "A2")):
            print(f"#   {name}: " + ", ".join(f"{o} {summaries[o].get(name, float('nan')):.3f}"
                                            for o in _ORDERS))
    maybe_plot(args, drawn, title=f"hpcdp collectives vs mpi4py, {args.ranks} ranks ({_ORDERS[0]})")
    return 0


class _Case:
    """The same pre-touched buffers for the baseline and the candidate of one op and size."""

    def __init__(self, op: str, nbytes: int, dtype: np.dtype, comm: Any, n: int, rank: int) -> None:
        from mpi4py import MPI

        item = dtype.itemsize
        count = max(nbytes // item, 1)
        if op in ("all_gather", "reduce_scatter"):
            count = max(count // n, 1) * n  # the full array splits into n parts
        self.op, self.count, self.nbytes = op, count, count * item
        part = count // n
        if op == "allreduce":
            self.x, self.out = np.ones(count, dtype), np.empty(count, dtype)
            self.base = lambda: comm.Allreduce(self.x, self.out, MPI.SUM)
            self.cand = lambda: hpcdp.allreduce(self.x, out=self.out)
        elif op == "all_gather":
            self.x, self.out = np.full(part, rank, dtype), np.empty((n, part), dtype)
            self.base = lambda: comm.Allgather(self.x, self.out)
            self.cand = lambda: hpcdp.all_gather(self.x, out=self.out)
        elif op == "reduce_scatter":
            self.x, self.out = np.ones(count, dtype), np.empty(part, dtype)
            self.base = lambda: comm.Reduce_scatter_block(self.x, self.out, MPI.SUM)
            self.cand = lambda: hpcdp.reduce_scatter(self.x, out=self.out)
        elif op == "broadcast":
            self.x = self.out = np.ones(count, dtype)
            self.base = lambda: comm.Bcast(self.x, 0)
            self.cand = lambda: hpcdp.broadcast(self.x, 0)
        else:
            raise ValueError(f"unknown op {op}")
        pretouch(self.x, self.out)


def _bandwidth_trial(fn: Callable[[], Any], iters: int, comm: Any) -> float:
    """Seconds per op over ``iters`` back-to-back ops; the slowest rank's figure."""
    from mpi4py import MPI

    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    dt = (time.perf_counter() - t0) / iters
    return comm.allreduce(dt, op=MPI.MAX)


def _latency_trial(fn: Callable[[], Any], iters: int, comm: Any,
                   medians: list[float] | None = None) -> float:
    """Mean seconds per call, a barrier between calls; averaged over ranks.

    ``medians`` also gets the median call (averaged over ranks): on a shared machine one
    preempted call in 2000 moves the mean by microseconds, the median not at all.
    """
    times = np.empty(iters)
    for i in range(iters):
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        times[i] = time.perf_counter() - t0
    n = comm.Get_size()
    if medians is not None:
        medians.append(comm.allreduce(float(np.median(times))) / n)
    return comm.allreduce(float(times.mean())) / n


def _iters(fn: Callable[[], Any], comm: Any, min_time: float) -> int:
    from mpi4py import MPI

    for _ in range(3):
        fn()
    t = _bandwidth_trial(fn, 5, comm)
    iters = int(min(20_000, max(20, min_time / max(t, 1e-9))))
    return comm.allreduce(iters, op=MPI.MAX)  # every rank runs the same count


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    backend, rest = _backend(argv)
    if backend == "tcp":
        from .tcp import main_tcp

        return main_tcp(rest, prog="python -m hpcdp.bench collectives --backend tcp")
    if backend == "sim":
        from .sim import main as main_sim

        return main_sim(rest, prog="python -m hpcdp.bench collectives --backend sim")
    args = _parse(argv)
    order = args.import_order or ("hpcdp-first" if _under_launcher() else "both")
    if order == "both":
        return _both_orders(args, argv)
    if order == "mpi4py-first":
        from mpi4py import MPI  # MPI_Init runs here, before hpcdp can set anything
    hpcdp.init("mpi")
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    dtype = np.dtype(args.dtype)
    sink = PlotSink(JsonSink(args.json if rank == 0 else None))  # rank 0's rows, for --plot
    ops = [o for o in args.ops.split(",") if o]
    rows: list[Row] = []
    if rank == 0:
        print(f"# hpcdp {hpcdp.__version__} collectives vs mpi4py, {n} ranks, {dtype}, "
              f"{args.trials} interleaved trials, median ratio t(hpcdp)/t(mpi4py), "
              f"import order {order}")
    for op in ops:
        if rank == 0:
            print_header(f"{op}: bandwidth (back-to-back ops)")
        for size in sizes(args.min_size, args.max_size):
            case = _Case(op, size, dtype, comm, n, rank)
            iters = _iters(case.base, comm, args.min_time)
            _iters(case.cand, comm, args.min_time)  # warm-up
            tr = interleaved(lambda: _bandwidth_trial(case.base, iters, comm),
                             lambda: _bandwidth_trial(case.cand, iters, comm), args.trials)
            t = tr.cand_median
            algbw = case.nbytes / t / 1e9
            row = Row("collectives", op, case.nbytes, case.count, dtype.name,
                      "sum" if op in ("allreduce", "reduce_scatter") else "none",
                      0 if op == "broadcast" else -1, t * 1e6, algbw, algbw * busbw_factor(op, n),
                      tr.base_median * 1e6, tr.median_ratio, n,
                      {"ratios": tr.ratios, "import_order": order})
            rows.append(row)
            if rank == 0:
                print_row(row)
                sink.write(row)
    # A2: latency of small allreduces, a barrier between calls
    lat: list[tuple[int, float, float, float, float]] = []
    if "allreduce" in ops:
        if rank == 0:
            print("# allreduce latency (barrier between calls): size, hpcdp us, mpi4py us, diff us "
                  "(means), diff us (median calls)")
        for size in sizes(8, 1024):
            case = _Case("allreduce", size, dtype, comm, n, rank)
            bmed: list[float] = []
            cmed: list[float] = []
            tr = interleaved(lambda: _latency_trial(case.base, 2000, comm, bmed),
                             lambda: _latency_trial(case.cand, 2000, comm, cmed), args.trials)
            diffs = [c - b for b, c in zip(tr.base, tr.cand)]
            mdiffs = [c - b for b, c in zip(bmed, cmed)]
            lat.append((case.nbytes, tr.cand_median * 1e6, tr.base_median * 1e6,
                        statistics.median(diffs) * 1e6, statistics.median(mdiffs) * 1e6))
            if rank == 0:
                print(f"  {case.nbytes:>10} {lat[-1][1]:>10.2f} {lat[-1][2]:>10.2f} "
                      f"{lat[-1][3]:>+8.2f} {lat[-1][4]:>+8.2f}")
                sink.write({"bench": "latency", "op": "allreduce", "size": case.nbytes,
                            "time_us": lat[-1][1], "base_time_us": lat[-1][2], "diff_us": lat[-1][3],
                            "diff_median_call_us": lat[-1][4], "import_order": order})
    # A2's share of the sampled call checks (HPCDP_DEBUG=sample, the default): the same 8 B
    # allreduce with the checks off and on, on the same group, trials interleaved. Means: a
    # check is one call in 128 (after the first 32), so the median call never sees it.
    chk = None
    if "allreduce" in ops:
        group = hpcdp.get_default_group()
        level = group.debug
        x8c = np.ones(1, np.float64)

        def at(lv: str) -> Callable[[], float]:
            def trial() -> float:
                group.debug = lv  # every rank switches at the same point: the calls stay aligned
                try:
                    return _latency_trial(lambda: hpcdp.allreduce(x8c), 2048, comm)
                finally:
                    group.debug = level
            return trial

        chk = interleaved(at("off"), at("sample"), args.trials)
    # A5: an 8 B ndarray collective vs mpi4py's pickle path
    x8 = np.ones(2, np.float32)
    a5 = interleaved(lambda: _latency_trial(lambda: comm.allreduce(x8), 2000, comm),
                     lambda: _latency_trial(lambda: hpcdp.allreduce(x8), 2000, comm), args.trials)
    if rank == 0:
        big = [r for r in rows if r.size >= 1 << 20]

        def med(op: str) -> float:
            vals = [1.0 / r.ratio for r in big if r.op == op]  # busbw ratio = base time / time
            return statistics.median(vals) if vals else float("nan")

        # (record name, id, part, value): names kept as scripts match them ("A1 ...")
        summary = [
            ("A1 allreduce busbw ratio (>= 1 MiB)", "A1", "", med("allreduce")),
            ("A3 all_gather busbw ratio (>= 1 MiB)", "A3", "all_gather", med("all_gather")),
            ("A3 reduce_scatter busbw ratio (>= 1 MiB)", "A3", "reduce_scatter", med("reduce_scatter")),
            ("A3 broadcast busbw ratio (>= 1 MiB)", "A3", "broadcast", med("broadcast")),
            ("A2 allreduce latency overhead us (8 B - 1 KiB, worst size)", "A2", "mean",
             max((x[3] for x in lat), default=float("nan"))),
            ("A2 the same, median calls (robust to preempted calls)", "A2", "median call",
             max((x[4] for x in lat), default=float("nan"))),
            ("A5 8 B allreduce time / pickle allreduce time", "A5", "", a5.median_ratio),
        ]
        if chk is not None:
            summary.append(("A2' share of the sampled call checks us (8 B, mean call, sample - off)", "A2'", "",
                            statistics.median(c - b for b, c in zip(chk.base, chk.cand)) * 1e6))
        busbw = [r.busbw_gbs for r in rows]
        print(f"# Avg bus bandwidth    : {statistics.mean(busbw) if busbw else 0:.4f} GB/s")
        for k, id, part, v in summary:   # an op not timed in this run (--ops): value None, not judged
            met = summarize(sink, id, v, part=part, ranks=n, name=k, import_order=order)
            print(f"# {k}: {v:.3f} (target {target(id, part).text}: {verdict(met)}; import order {order})")
        print(f"# sizes {fmt_size(args.min_size)} - {fmt_size(args.max_size)}; "
              "pickle allreduce 8 B: %.2f us, hpcdp: %.2f us" % (a5.base_median * 1e6, a5.cand_median * 1e6))
        maybe_plot(args, sink.rows, title=f"hpcdp collectives vs mpi4py, {n} ranks ({order})")
    sink.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

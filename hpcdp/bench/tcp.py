"""TCP backend benchmarks with their baselines in the same run (PERF.md B1 and B2).

B1: hpcdp ``send``/``recv`` ping-pong against a raw Python socket ping-pong between the same two
    processes on the same buffers, trials interleaved; 8 B latency and >= 1 MiB bandwidth.
B2: hpcdp TCP ``allreduce`` bus bandwidth against torch.distributed gloo ``all_reduce`` on the
    same numpy buffers (``torch.from_numpy``), >= 4 MiB; skipped with a note without torch.

``python -m hpcdp.bench collectives --backend tcp`` calls ``main_tcp``; so do
``python -m hpcdp.bench tcp`` and ``python -m hpcdp.bench.tcp``.
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time
from typing import Any, Sequence

import numpy as np

import hpcdp

from .._atomic import open_append
from ..launch import free_port, spawn_processes
from ._common import judged, summarize
from ._targets import targets_of
from ._plot import add_plot_argument, maybe_plot

__all__ = ["main", "main_tcp", "parser", "run_b1", "run_b2"]


def _raw_pair(rank: int) -> socket.socket:
    if rank == 1:
        lst = socket.socket()
        lst.bind(("127.0.0.1", 0))
        lst.listen(1)
        hpcdp.broadcast_object(lst.getsockname()[1], root=1)
        s, _ = lst.accept()
        lst.close()
    else:
        port = hpcdp.broadcast_object(None, root=1)
        s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _raw_recv(s: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = s.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("closed")
        got += k


def _pingpong(rank: int, buf: np.ndarray, iters: int, raw: socket.socket | None) -> float:
    """Seconds per one-way trip (half a round trip)."""
    g = hpcdp.get_default_group()
    view = memoryview(buf).cast("B")
    t0 = time.perf_counter()
    for _ in range(iters):
        if raw is None:
            if rank == 0:
                g.send(buf, 1)
                g.recv(buf, 1)
            else:
                g.recv(buf, 0)
                g.send(buf, 0)
        else:
            if rank == 0:
                raw.sendall(view)
                _raw_recv(raw, view)
            else:
                _raw_recv(raw, view)
                raw.sendall(view)
    return (time.perf_counter() - t0) / (2 * iters)


def _b1_body(rank: int, sizes: list[int], trials: int) -> list[dict[str, Any]]:
    raw = _raw_pair(rank)
    rows = []
    for size in sizes:
        buf = np.ones(size, np.uint8)  # touched: same pages for both
        iters = max(20, min(2000, int(2e8 // max(size, 1) // 50)))
        _pingpong(rank, buf, 5, None)
        _pingpong(rank, buf, 5, raw)
        ratios, ours, base = [], [], []
        for _ in range(trials):
            hpcdp.barrier()
            a = _pingpong(rank, buf, iters, None)
            hpcdp.barrier()
            b = _pingpong(rank, buf, iters, raw)
            ours.append(a)
            base.append(b)
            ratios.append(a / b)
        rows.append({"bench": "B1", "size": size, "iters": iters,
                     "hpcdp_us": statistics.median(ours) * 1e6, "raw_us": statistics.median(base) * 1e6,
                     "hpcdp_GBps": size / statistics.median(ours) / 1e9,
                     "raw_GBps": size / statistics.median(base) / 1e9,
                     "time_ratio": statistics.median(ratios),
                     "bw_ratio": statistics.median([1 / r for r in ratios])})
    raw.close()
    return rows


def _b2_body(rank: int, sizes: list[int], trials: int, port: int) -> list[dict[str, Any]]:
    n = hpcdp.world_size()
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=n)
    except ImportError:
        dist = None
    rows = []
    for size in sizes:
        x = np.ones(size // 4, np.float32)
        y = np.ones_like(x)  # results go here, so repeated sums never overflow
        iters = max(5, min(50, int(4e8 // size)))

        def ours() -> float:
            hpcdp.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                hpcdp.allreduce(x, out=y)
            return _slowest(time.perf_counter() - t0) / iters

        def gloo() -> float:
            hpcdp.barrier()
            t = torch.from_numpy(y)
            t0 = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(t)
            return _slowest(time.perf_counter() - t0) / iters

        ours()
        if dist is not None:
            gloo()
        a_s, b_s, ratios = [], [], []
        for _ in range(trials):
            a = ours()
            a_s.append(a)
            if dist is not None:
                b = gloo()
                b_s.append(b)
                ratios.append(b / a)  # busbw ratio = inverse time ratio
        bus = 2 * (n - 1) / n
        row = {"bench": "B2", "ranks": n, "size": size, "iters": iters,
               "hpcdp_us": statistics.median(a_s) * 1e6,
               "hpcdp_busbw_GBps": size / statistics.median(a_s) * bus / 1e9}
        if dist is not None:
            row.update(gloo_us=statistics.median(b_s) * 1e6,
                       gloo_busbw_GBps=size / statistics.median(b_s) * bus / 1e9,
                       busbw_ratio=statistics.median(ratios))
        rows.append(row)
    if dist is not None:
        dist.destroy_process_group()
    return rows


def _slowest(t: float) -> float:
    return float(hpcdp.allreduce(np.array([t]), op="max")[0])


def run_b1(sizes: Sequence[int] = (8, 1 << 20, 16 << 20), trials: int = 5) -> list[dict[str, Any]]:

    return spawn_processes(_b1_body, 2, args=(list(sizes), trials), timeout=600)[0]


def run_b2(ranks: int, sizes: Sequence[int] = (4 << 20, 16 << 20), trials: int = 5) -> list[dict[str, Any]]:

    return spawn_processes(_b2_body, ranks, args=(list(sizes), trials, free_port()), timeout=600)[0]


def parser(prog: str = "python -m hpcdp.bench tcp") -> argparse.ArgumentParser:
    """Options of B1 and B2."""
    p = argparse.ArgumentParser(
        prog=prog,
        description="TCP backend: B1, hpcdp send/recv against a raw socket ping-pong (2 ranks); B2, "
                    "hpcdp allreduce against torch.distributed gloo (each of --ranks). Local "
                    "processes, no mpirun.")
    p.add_argument("--ranks", default="2,4", help="comma-separated world sizes for B2 (default: 2,4)")
    p.add_argument("--trials", type=int, default=5, help="interleaved hpcdp/baseline trials")
    p.add_argument("--json", default=None, help="append JSON lines here")
    p.add_argument("--skip-b1", action="store_true", help="run B2 only")
    add_plot_argument(p)
    return p


def main_tcp(argv: Sequence[str] | None = None, prog: str = "python -m hpcdp.bench tcp") -> int:
    """Run B1 (2 ranks) and B2 (each ``--ranks``); print nccl-tests-style rows and the ratios."""
    ns = parser(prog).parse_args(argv)
    rows: list[dict[str, Any]] = []
    if not ns.skip_b1:
        print("# B1: hpcdp send/recv vs raw socket ping-pong, 2 ranks (median of interleaved trials)")
        print(f"#{'size':>11} {'hpcdp us':>10} {'raw us':>10} {'hpcdp GB/s':>11} {'raw GB/s':>9} "
              f"{'time x':>7} {'bw x':>6}")
        for r in run_b1(trials=ns.trials):
            rows.append(r)
            print(f"{r['size']:>12} {r['hpcdp_us']:>10.2f} {r['raw_us']:>10.2f} "
                  f"{r['hpcdp_GBps']:>11.3f} {r['raw_GBps']:>9.3f} {r['time_ratio']:>7.2f} "
                  f"{r['bw_ratio']:>6.2f}")
    try:
        import torch  # noqa: F401

        have_torch = True
    except ImportError:
        have_torch = False
        print("# B2: torch is not installed: the gloo baseline is skipped")
    for n in [int(v) for v in ns.ranks.split(",") if v]:
        print(f"# B2: allreduce float32 sum, {n} ranks"
              + ("; baseline torch.distributed gloo" if have_torch else ""))
        print(f"#{'size':>11} {'count':>10} {'type':>7} {'redop':>5} {'root':>4} {'time us':>10} "
              f"{'algbw':>7} {'busbw':>7} {'gloo busbw':>10} {'ratio':>6}")
        for r in run_b2(n, trials=ns.trials):
            rows.append(r)
            alg = r["size"] / r["hpcdp_us"] / 1e3
            print(f"{r['size']:>12} {r['size'] // 4:>10} {'float':>7} {'sum':>5} {-1:>4} "
                  f"{r['hpcdp_us']:>10.1f} {alg:>7.3f} {r['hpcdp_busbw_GBps']:>7.3f} "
                  f"{r.get('gloo_busbw_GBps', float('nan')):>10.3f} {r.get('busbw_ratio', float('nan')):>6.2f}")
    summary = _summaries(rows)
    for rec in summary:
        print(f"# {rec['name'].split(':')[0]}: {rec['value']:.3f} ({judged(rec['id'], rec['part'], rec['value'])}; "
              f"median over sizes {rec['covers']}, worst {rec['worst']:.3f})")
    if ns.json:
        with open_append(ns.json) as f:
            for r in rows + summary:
                f.write(json.dumps(r) + "\n")
    maybe_plot(ns, rows, title="hpcdp TCP (B1, B2) beside raw sockets and gloo")
    return 0


class _Collect:
    """A sink that keeps the summary records (the rows are written together at the end)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def write(self, obj: dict[str, Any]) -> None:
        self.rows.append(obj)


def _summaries(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """B1 (bandwidth >= 1 MiB, latency at 8 B) and B2 (>= 4 MiB, per world size): the median over
    the sizes each covers, as A1 and A3 are; the worst size beside it."""
    out = _Collect()
    b1 = [r for r in rows if r.get("bench") == "B1"]
    for part, pick, key in (("bandwidth", lambda r: r["size"] >= 1 << 20, "bw_ratio"),
                            ("latency", lambda r: r["size"] == 8, "time_ratio")):
        vals = [r[key] for r in b1 if pick(r)]
        if vals:
            worst = min(vals) if part == "bandwidth" else max(vals)
            summarize(out, "B1", statistics.median(vals), part=part, ranks=2, worst=worst,
                      covers=">= 1 MiB" if part == "bandwidth" else "8 B")
    for n in sorted({r["ranks"] for r in rows if r.get("bench") == "B2"}):
        vals = [r["busbw_ratio"] for r in rows
                if r.get("bench") == "B2" and r["ranks"] == n and r["size"] >= 4 << 20 and "busbw_ratio" in r]
        part = f"{n} ranks"
        if vals and part in {t.part for t in targets_of("B2")}:   # a world size PERF.md gates
            summarize(out, "B2", statistics.median(vals), part=part, ranks=n, worst=min(vals),
                      covers=">= 4 MiB")
    return out.rows


main = main_tcp  # python -m hpcdp.bench tcp

if __name__ == "__main__":
    sys.exit(main_tcp(sys.argv[1:]))

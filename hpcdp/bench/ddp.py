"""``python -m hpcdp.bench ddp``: D1, D2, D4 of PERF.md and the share of communication hidden by backward.

Run on 2 ranks bound to cores, one BLAS thread each::

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 mpirun -n 2 --bind-to core python -m hpcdp.bench ddp

* D1: DDP gradient sync of 1000 small tensors vs one blocking allreduce per tensor.
* D2: DDP gradient sync with 25 MB buckets vs one mpi4py ``Allreduce`` of a pre-flattened buffer.
  "Sync" is what DDP adds after the gradients exist: the hooks' bookkeeping, the bucket
  reductions and the averaging, driven by calling DDP's gradient hook for each parameter in
  backward order (no model compute, so the figure is DDP's overhead over the raw transport).
* D4: weak scaling, MLP 784-1024-1024-10, batch 64 per rank, SGD: t1 = one rank training alone
  (the other waits at a barrier), t2 = both ranks training with DDP; efficiency = t1 / t2.
* hidden: (t_sync + t_backward - t_backward_with_ddp) / t_sync on the D4 model.

Every figure is the median over interleaved trials of per-trial ratios (PERF.md's method). The
size options exist for a quick smoke run (``--d1-tensors 20 --d2-mb 1 --d4-hidden 32 --iters 2``);
PERF.md's figures are the defaults.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import numpy as np

import hpcdp
from hpcdp import nn, optim

from ._common import (JsonSink, Row, interleaved, judged, print_header, print_row, summarize, time_alone,
                      time_loop)
from ._targets import target
from ._plot import PlotSink, add_plot_argument, maybe_plot

__all__ = ["main"]


def _limit_blas() -> str:
    try:
        from threadpoolctl import threadpool_limits

        threadpool_limits(1)
        return "threadpoolctl: 1 BLAS thread"
    except ImportError:
        import os

        n = os.environ.get("OPENBLAS_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS")
        return f"BLAS threads from environment: {n or 'unset (set OMP_NUM_THREADS=1)'}"


class _Params(nn.Module):
    """A bag of parameters of given sizes (for driving DDP's sync without a model)."""

    def __init__(self, sizes: list[int], dtype: Any = np.float32) -> None:
        super().__init__()
        for i, n in enumerate(sizes):
            setattr(self, f"p{i}", nn.Parameter(np.ones(n, dtype=dtype)))


def _ddp_sync(ddp: Any) -> Callable[[], None]:
    """One DDP sync: fire the gradient hook of every parameter in backward order, then finish."""
    reducer = ddp._reducer
    order = [p for _, p in reversed(reducer.named)]
    for p in order:
        if p.grad is None:
            p.grad = np.ones_like(p.data)
    reducer.point_grads_at_buckets()

    def run() -> None:
        reducer.begin_pass(True)
        for p in order:
            reducer.on_grad(p)
        reducer.finish_sync_pass()
        reducer.in_backward = False

    run()  # the first pass counts hooks; later passes overlap
    return run


def _gather_max(t: float) -> float:
    return float(hpcdp.allreduce(np.array([t]), "max")[0])


def bench_d1(g: Any, trials: int, sink: JsonSink, ntensors: int = 1000, elems: int = 256,
             iters: int = 5) -> float:
    module = _Params([elems] * ntensors)
    ddp = hpcdp.DDP(module, group=g)
    sync = _ddp_sync(ddp)
    grads = [np.ones(elems, np.float32) for _ in range(ntensors)]

    def per_tensor() -> None:
        for x in grads:
            g.allreduce(x, "mean", out=x)

    t = interleaved(lambda: _gather_max(time_loop(per_tensor, iters, g.barrier)),
                    lambda: _gather_max(time_loop(sync, iters, g.barrier)), trials)
    nbytes = ntensors * elems * 4
    row = Row("ddp", f"D1 sync {ntensors} tensors", nbytes, ntensors * elems, "float32", "mean", -1,
              t.cand_median * 1e6, nbytes / t.cand_median / 1e9, 0.0, t.base_median * 1e6,
              t.median_ratio, g.size, {"buckets": len(ddp.buckets), "target": target("D1").text})
    if g.rank == 0:
        print_row(row)
        print(f"# D1 DDP sync of {ntensors} tensors of {elems} float32: {t.cand_median * 1e6:.1f} us, "
              f"one allreduce per tensor {t.base_median * 1e6:.1f} us, ratio {t.median_ratio:.3f} "
              f"({judged('D1', '', t.median_ratio)})")
    sink.write(row)
    summarize(sink, "D1", t.median_ratio, ranks=g.size, tensors=ntensors, trials=t.ratios)
    return t.median_ratio


def bench_d2(g: Any, trials: int, sink: JsonSink, total_mb: float = 50, iters: int = 5) -> float:
    from mpi4py import MPI

    comm = g.backend.native_comm() or MPI.COMM_WORLD
    n = max(16, int(total_mb * (1 << 20)) // 4)
    sizes = [n // 16] * 16
    module = _Params(sizes)
    ddp = hpcdp.DDP(module, group=g, bucket_cap_mb=25)
    sync = _ddp_sync(ddp)
    flat = np.ones(sum(sizes), np.float32)

    def raw() -> None:
        comm.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)

    t = interleaved(lambda: _gather_max(time_loop(raw, iters, g.barrier)),
                    lambda: _gather_max(time_loop(sync, iters, g.barrier)), trials)
    nbytes = flat.nbytes
    algbw = nbytes / t.cand_median / 1e9
    row = Row("ddp", "D2 sync 25MB buckets", nbytes, flat.size, "float32", "mean", -1,
              t.cand_median * 1e6, algbw, algbw * 2 * (g.size - 1) / g.size, t.base_median * 1e6,
              t.median_ratio, g.size, {"buckets": [round(b.nbytes / 2**20, 2) for b in ddp.buckets],
                                       "target": target("D2").text})
    if g.rank == 0:
        print_row(row)
        print(f"# D2 DDP sync of {nbytes / 2**20:.1f} MiB in 25 MB buckets: {t.cand_median * 1e3:.2f} ms, "
              f"mpi4py Allreduce of the flat buffer {t.base_median * 1e3:.2f} ms, ratio "
              f"{t.median_ratio:.3f} ({judged('D2', '', t.median_ratio)})")
    sink.write(row)
    summarize(sink, "D2", t.median_ratio, ranks=g.size, bytes=nbytes, trials=t.ratios)
    return t.median_ratio


def _d4_limits(g: Any, step: Callable[[], None], model: nn.Module, t1: Callable[[], float],
               iters: int, trials: int) -> dict[str, Any]:
    """What the machine allows D4 (MPI only): t1 against the plain step run on every rank at
    once ("bound": the cost of sharing memory and caches), and against that step plus a raw
    mpi4py ``Allreduce`` of a buffer of its gradients' size after it ("ceiling": DDP with no
    overhead and no overlap; its copies left out, so an upper bound). Interleaved like D4."""
    comm = g.backend.native_comm()
    if comm is None:  # not MPI: no raw Allreduce to compare with
        return {}
    from mpi4py import MPI

    flat = np.zeros(sum(p.data.size for p in model.parameters()), np.float32)
    flat += 1.0  # touched: no page faults in the timed part

    def raw_step() -> None:
        step()
        comm.Allreduce(MPI.IN_PLACE, flat)

    def t_both() -> float:
        return _gather_max(time_loop(step, iters, g.barrier))

    def t_raw() -> float:
        return _gather_max(time_loop(raw_step, iters, g.barrier))

    raw_step()
    tb = interleaved(t1, t_both, trials)
    tr = interleaved(t1, t_raw, trials)
    return {"bound": statistics.median(b / c for b, c in zip(tb.base, tb.cand)),
            "t_both_ms": tb.cand_median * 1e3, "grad_mb": flat.nbytes / 1e6,
            "ceiling": statistics.median(b / c for b, c in zip(tr.base, tr.cand)),
            "t_raw_step_ms": tr.cand_median * 1e3}


def _mlp(seed: int, hidden: int = 1024) -> nn.Module:
    return nn.Sequential(nn.Linear(784, hidden, seed=seed), nn.ReLU(), nn.Linear(hidden, hidden, seed=seed + 1),
                         nn.ReLU(), nn.Linear(hidden, 10, seed=seed + 2))


def bench_d4(g: Any, trials: int, sink: JsonSink, batch: int = 64, iters: int = 10,
             hidden: int = 1024) -> dict[str, float]:
    rng = np.random.default_rng(g.rank)
    x = rng.normal(size=(batch, 784)).astype(np.float32)
    y = rng.integers(0, 10, batch)
    loss = nn.CrossEntropyLoss()
    # t1 is what a careful single-process user runs: the plain model, no DDP, reusing gradient
    # memory (zero_grad(set_to_none=False)) as DDP reuses its bucket memory. Allocating fresh
    # gradients each step costs page faults that would flatter DDP.
    alone = _mlp(0, hidden)
    alone_opt = optim.SGD(alone.parameters(), lr=1e-3)
    model = _mlp(0, hidden)
    ddp = hpcdp.DDP(model, group=g)
    opt = optim.SGD(ddp.parameters(), lr=1e-3)

    def step_alone() -> None:
        loss(alone(x), y)
        alone.backward(loss.backward())
        alone_opt.step()
        alone_opt.zero_grad(set_to_none=False)

    def step_ddp() -> None:
        loss(ddp(x), y)
        ddp.backward(loss.backward())
        opt.step()
        opt.zero_grad()

    def t1() -> float:
        return time_alone(g, step_alone, iters)

    def t2() -> float:
        return _gather_max(time_loop(step_ddp, iters, g.barrier))

    step_alone()
    step_ddp()
    tr = interleaved(t1, t2, trials)
    eff = statistics.median(b / c for b, c in zip(tr.base, tr.cand))
    limits = _d4_limits(g, step_alone, alone, t1, iters, trials)

    # Hidden communication: backward alone, sync alone, backward with DDP (all ranks at once).
    def bwd_alone() -> float:
        vals = []
        for _ in range(iters):
            loss(alone(x), y)
            g.barrier()
            t0 = time.perf_counter()
            alone.backward(loss.backward())
            vals.append(time.perf_counter() - t0)
            alone.zero_grad(set_to_none=False)
        return _gather_max(statistics.median(vals))

    def bwd_ddp() -> float:
        vals = []
        for _ in range(iters):
            loss(ddp(x), y)
            g.barrier()
            t0 = time.perf_counter()
            ddp.backward(loss.backward())
            vals.append(time.perf_counter() - t0)
            ddp.zero_grad()
        return _gather_max(statistics.median(vals))

    sync = _ddp_sync(hpcdp.DDP(_mlp(0, hidden), group=g))

    def sync_alone() -> float:
        return _gather_max(time_loop(sync, iters, g.barrier))

    shares: list[float] = []
    tb, ts, to = [], [], []
    for _ in range(trials):
        b, s, o = bwd_alone(), sync_alone(), bwd_ddp()
        tb.append(b), ts.append(s), to.append(o)
        shares.append(min(1.0, max(0.0, (s + b - o) / s)) if s > 0 else 0.0)
    res = {"efficiency": eff, "t1_ms": tr.base_median * 1e3, "t2_ms": tr.cand_median * 1e3,
           "hidden": statistics.median(shares), "t_backward_ms": statistics.median(tb) * 1e3,
           "t_sync_ms": statistics.median(ts) * 1e3, "t_backward_ddp_ms": statistics.median(to) * 1e3,
           "buckets_mb": [round(b.nbytes / 2**20, 2) for b in ddp.buckets], **limits}
    if g.rank == 0:
        print(f"# D4 weak scaling ({g.size} ranks vs 1, MLP 784-{hidden}-{hidden}-10, batch {batch}/rank): "
              f"t1 {res['t1_ms']:.2f} ms, t2 {res['t2_ms']:.2f} ms, efficiency {eff:.3f} ({judged('D4', '', eff)})")
        print(f"# hidden communication: backward {res['t_backward_ms']:.2f} ms, sync alone "
              f"{res['t_sync_ms']:.2f} ms, backward+DDP {res['t_backward_ddp_ms']:.2f} ms -> "
              f"{100 * res['hidden']:.0f}% of the sync time hidden behind backward (buckets {res['buckets_mb']} MiB)")
        if "bound" in res:
            print(f"# machine limits (D4): the plain step on every rank at once {res['t_both_ms']:.2f} ms "
                  f"(t1 / that {res['bound']:.3f}: what sharing the machine costs); plain step + a raw "
                  f"mpi4py Allreduce of its {res['grad_mb']:.2f} MB of gradients {res['t_raw_step_ms']:.2f} ms "
                  f"(t1 / that {res['ceiling']:.3f}: the most a DDP without overhead or overlap reaches)")
    sink.write({"bench": "ddp", "op": "D4", "ranks": g.size, **res})
    summarize(sink, "D4", eff, ranks=g.size, width=hidden, batch=batch, hidden_share=res["hidden"],
              trials=[b / c for b, c in zip(tr.base, tr.cand)])
    return res


def parser() -> argparse.ArgumentParser:
    """Options of D1, D2, D4."""
    p = argparse.ArgumentParser(
        prog="python -m hpcdp.bench ddp",
        description="D1, D2, D4: DDP gradient sync against per-tensor allreduces and one mpi4py "
                    "Allreduce, weak-scaling efficiency, and the share of communication hidden by "
                    "backward. Run under 'mpirun -n 2 --bind-to core'.")
    p.add_argument("--trials", type=int, default=5, help="interleaved trials per figure")
    p.add_argument("--json", default=None, help="append JSON lines to this file")
    p.add_argument("--only", default="D1,D2,D4", help="comma-separated subset of D1,D2,D4")
    p.add_argument("--iters", type=int, default=None,
                   help="timed calls per trial (default 5 for D1/D2, 10 for D4)")
    p.add_argument("--d1-tensors", type=int, default=1000, help="D1: number of small tensors")
    p.add_argument("--d2-mb", type=float, default=50, help="D2: MiB of gradients")
    p.add_argument("--d4-hidden", type=int, default=1024, help="D4: hidden width of the MLP")
    p.add_argument("--d4-batch", type=int, default=64, help="D4: batch per rank")
    add_plot_argument(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run D1, D2, D4 and the hidden-communication share; print rows and summaries."""
    p = parser()
    args = p.parse_args(argv)
    for name in ("trials", "d1_tensors", "d4_hidden", "d4_batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if (args.iters is not None and args.iters < 1) or args.d2_mb <= 0:
        p.error("--iters must be >= 1 and --d2-mb positive")
    short = args.iters or 5
    blas = _limit_blas()
    g = hpcdp.init()
    sink = PlotSink(JsonSink(args.json if g.rank == 0 else None))
    only = {s.strip().upper() for s in args.only.split(",")}
    if g.rank == 0:
        print(f"# hpcdp DDP benchmark: {g.size} {g.backend.name} ranks, {blas}, {args.trials} interleaved trials")
        print_header("DDP gradient sync (time = DDP, base = baseline, t/base = median ratio)")
    ok = True
    if "D1" in only:
        r = bench_d1(g, args.trials, sink, ntensors=args.d1_tensors, iters=short)
        ok &= bool(target("D1").met(r))
    if "D2" in only and g.backend.native_comm() is not None:  # baseline: mpi4py directly
        r = bench_d2(g, args.trials, sink, total_mb=args.d2_mb, iters=short)
        ok &= bool(target("D2").met(r))
    if "D4" in only:
        res = bench_d4(g, args.trials, sink, batch=args.d4_batch, iters=args.iters or 10,
                       hidden=args.d4_hidden)
        ok &= bool(target("D4").met(res["efficiency"]))
    if g.rank == 0:
        print(f"# targets {'met' if ok else 'NOT met'}")
        maybe_plot(args, sink.rows, title=f"hpcdp DDP (D1, D2, D4), {g.size} {g.backend.name} ranks")
    sink.close()
    return 0

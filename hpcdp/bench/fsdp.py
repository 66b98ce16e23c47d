"""``python -m hpcdp.bench fsdp``: E1-E4 of PERF.md, FSDP and ZeRO against DDP.

Run on 2 and 4 ranks, one BLAS thread each::

    OMP_NUM_THREADS=1 mpirun -n 2 --bind-to core python -m hpcdp.bench fsdp
    OMP_NUM_THREADS=1 mpirun -n 4 --oversubscribe python -m hpcdp.bench fsdp

The model is a stack of ``Linear(w, w) + Tanh`` layers, each Linear its own FSDP unit, trained
with Adam in float32 (16 bytes per parameter: 4 parameter, 4 gradient, 8 optimizer state).
Stages: DDP (0), DDP + ``ZeroRedundancyOptimizer`` (1), FSDP ``shard_grad_op`` (2), ``full_shard`` (3).

* E1: bytes held per rank against the ZeRO formulas, from the arrays actually held after the
  optimizer step (before ``zero_grad``; ZeRO-2 at its in-step peak, when the gathered parameters
  are still held for backward); tracemalloc's count of everything numpy allocated is shown beside.
* E2: bytes each rank sends in one step, counted at the collectives with the ring algorithms'
  factors ((n-1) x send for all_gather, (n-1)/n for reduce_scatter, 2(n-1)/n for allreduce),
  against DDP's (theory: ZeRO-3 1.5x, ZeRO-2 1.0x, ZeRO-1 1.5x).
* E3: step time of ZeRO-3 and ZeRO-2 over DDP's on a communication-bound model (few rows per
  step), median of interleaved trials; the share of all-gather time hidden by prefetch is
  1 - (time blocked on all-gathers with prefetch) / (the same without prefetch).
* E4: the largest model (parameters) whose training step fits a per-rank memory budget (the
  step's tracemalloc peak, slowest rank), DDP against ZeRO-3, found by bisection on the width.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time
import tracemalloc
from typing import Any, Callable

import numpy as np

import hpcdp
from hpcdp import nn, optim
from hpcdp.fsdp import FSDP, zero_formula
from hpcdp.fsdp import distinct_nbytes, optimizer_state_bytes, step_breakdown

from ._common import JsonSink, interleaved, judged, summarize, verdict
from ._targets import target
from ._plot import PlotSink, add_plot_argument, maybe_plot

__all__ = ["main"]

KINDS = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}


def _limit_blas() -> str:
    try:
        from threadpoolctl import threadpool_limits

        threadpool_limits(1)
        return "1 BLAS thread"
    except ImportError:
        return "BLAS threads from the environment"


def _model(depth: int, width: int, seed: int = 0) -> nn.Module:
    layers: list[nn.Module] = []
    for k in range(depth):
        layers += [nn.Linear(width, width, seed=seed + k), nn.Tanh()]
    return nn.Sequential(*layers)


class Trainer:
    """One model wrapped as ``kind``, with Adam, and a step on a fixed batch."""

    def __init__(self, kind: str, depth: int, width: int, batch: int, prefetch: bool = True) -> None:
        self.kind = kind
        self.model = _model(depth, width)
        if kind in ("ddp", "zero1"):
            self.w: Any = hpcdp.DDP(self.model)
            params = self.w.parameters()
            self.opt: Any = (optim.ZeroRedundancyOptimizer(params, optim.Adam, lr=1e-4) if kind == "zero1"
                             else optim.Adam(params, lr=1e-4))
        else:
            self.w = FSDP(self.model, strategy="shard_grad_op" if kind == "zero2" else "full_shard",
                          auto_wrap={nn.Linear}, prefetch=prefetch)
            self.opt = optim.Adam(self.w.parameters(), lr=1e-4)
        rng = np.random.default_rng(hpcdp.rank())
        self.x = rng.standard_normal((batch, width)).astype(np.float32)
        self.loss = nn.MSELoss()
        self.params = depth * (width * width + width)

    def step(self, zero: bool = True) -> None:
        out = self.w(self.x)
        self.loss(out, self.x)
        self.w.backward(self.loss.backward())
        self.opt.step()
        if zero:
            self.opt.zero_grad()

    def held(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state this rank holds now."""
        if isinstance(self.w, FSDP):
            st = self.w.memory_stats(self.opt)
            out = {"params": st["params"], "grads": st["grads"], "optim_state": st["optim_state"],
                   "gathered_peak": st["gathered_peak"], "padding": st["padding"]}
            return out
        ps = list(self.model.parameters())
        opt = self.opt.local if self.kind == "zero1" else self.opt
        state = optimizer_state_bytes(opt, ps) if opt is not None else 0
        return {"params": distinct_nbytes(p.data for p in ps), "grads": distinct_nbytes(p.grad for p in ps),
                "optim_state": state, "gathered_peak": 0, "padding": 0}


def _max(x: float) -> float:
    return float(hpcdp.allreduce(np.array([x], dtype=np.float64), "max")[0])


def _sum(x: float) -> float:
    return float(hpcdp.allreduce(np.array([x], dtype=np.float64), "sum")[0])


def _say(*a: Any) -> None:
    if hpcdp.rank() == 0:
        print(*a, flush=True)


# -- E1 --------------------------------------------------------------------------------------------
def bench_e1(depth: int, width: int, sink: JsonSink) -> bool:
    n = hpcdp.world_size()
    _say(f"\n# E1: bytes per rank after an Adam step vs the ZeRO formulas ({n} ranks, {depth} x "
         f"Linear({width}, {width}))")
    _say(f"# {'stage':<8} {'formula':>12} {'held':>12} {'held/form':>9} {'allowed':>9} "
         f"{'tracemalloc':>12}  (bytes; params / grads / optimizer state; {judged('E1')})")
    ok = True
    for kind, stage in KINDS.items():
        gc.collect()
        tracemalloc.start()
        t = Trainer(kind, depth, width, batch=4)
        for _ in range(2):
            t.step()
        if isinstance(t.w, FSDP):
            t.w.memory_stats(reset_peak=True)
        t.step(zero=False)
        h = t.held()
        traced = tracemalloc.get_traced_memory()[0] - t.x.nbytes
        tracemalloc.stop()
        form = zero_formula(stage, t.params, n)
        total_form = sum(form.values())
        pad = h["padding"] * 4   # padding rows of parameters, gradients and both Adam moments
        if kind == "zero2":   # in-step: the gathered parameters are held from forward to backward
            held = h["gathered_peak"] + h["grads"] + h["optim_state"]
            extra = h["params"]   # the sharded master copy, which the formula does not count
        else:
            held = h["params"] + h["grads"] + h["optim_state"]
            extra = 0
        goal = target("E1")
        assert goal.bound is not None
        slack = (pad + extra) / total_form   # padding (and ZeRO-2's master copy), as a share
        allowed = goal.tol * goal.bound + slack   # as a share of the formula
        good = bool(goal.met(held / total_form, slack))
        ok &= good
        _say(f"  {kind:<8} {total_form:>12,.0f} {held:>12,d} {held / total_form:>9.3f} "
             f"{allowed:>9.3f} {traced:>12,d}  "
             f"({h['params']:,} / {h['grads']:,} / {h['optim_state']:,}"
             + (f"; gathered peak {h['gathered_peak']:,}" if kind == "zero2" else "") + ")"
             + ("" if good else "  <-- outside"))
        sink.write({"bench": "E1", "kind": kind, "ranks": n, "formula": total_form, "held": held,
                    "tracemalloc": traced, **h})
        summarize(sink, "E1", held / total_form, ranks=n, variant=kind, slack=slack)
        del t
    return ok


# -- E2 --------------------------------------------------------------------------------------------
class _Counter:
    """Bytes this rank sends in the collectives of one group (ring-algorithm factors)."""

    def __init__(self, group: Any) -> None:
        self.group, self.bytes = group, 0.0
        n = group.size

        def wrap(name: str, factor: Callable[[Any], float]) -> None:
            real = getattr(group, name)

            def counted(x: Any, *a: Any, **k: Any) -> Any:
                self.bytes += factor(x)
                return real(x, *a, **k)

            setattr(group, name, counted)

        wrap("all_gather", lambda x: (n - 1) * x.nbytes)
        wrap("reduce_scatter", lambda x: (n - 1) / n * x.nbytes)
        wrap("all_to_all", lambda x: (n - 1) / n * x.nbytes)
        wrap("allreduce", lambda x: 2 * (n - 1) / n * x.nbytes if x.nbytes > 64 else 0)

    def close(self) -> None:
        for name in ("all_gather", "reduce_scatter", "all_to_all", "allreduce"):
            self.group.__dict__.pop(name, None)


def bench_e2(depth: int, width: int, sink: JsonSink) -> bool:
    n = hpcdp.world_size()
    if n == 1:
        _say("\n# E2: needs 2 or more ranks")
        return True
    _say(f"\n# E2: bytes sent per rank in one step vs DDP ({n} ranks)")
    moved: dict[str, float] = {}
    ok = True
    for kind in KINDS:
        t = Trainer(kind, depth, width, batch=4)
        t.step()
        counter = _Counter(hpcdp.get_default_group())
        try:
            t.step()
        finally:
            counter.close()
        moved[kind] = counter.bytes
        del t
        gc.collect()
    ideal = 2 * (n - 1) / n * 4 * depth * (width * width + width)
    _say(f"# {'stage':<8} {'bytes':>14} {'x DDP':>7} {'target':>18}   (DDP theory {ideal:,.0f} B)")
    for kind, b in moved.items():
        r = b / moved["ddp"]
        if kind == "ddp":   # the baseline itself
            _say(f"  {kind:<8} {b:>14,.0f} {r:>7.3f}")
            continue
        goal = target("E2", kind)
        good = bool(goal.met(r))
        ok &= good
        _say(f"  {kind:<8} {b:>14,.0f} {r:>7.3f} {goal.text:>18}" + ("" if good else "  <-- outside"))
        sink.write({"bench": "E2", "kind": kind, "ranks": n, "bytes": b, "ratio": r, "theory": goal.bound})
        summarize(sink, "E2", r, part=kind, ranks=n, bytes=b)
    return ok


# -- E3 --------------------------------------------------------------------------------------------
def _time_steps(t: Trainer, iters: int) -> float:
    hpcdp.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        t.step()
    hpcdp.barrier()
    return _max((time.perf_counter() - t0) / iters)


def bench_e3(depth: int, width: int, batch: int, trials: int, iters: int, sink: JsonSink) -> bool:
    n = hpcdp.world_size()
    _say(f"\n# E3: step time over DDP's, {depth} x Linear({width}, {width}), batch {batch} per rank "
         f"({n} ranks, {trials} interleaved trials of {iters} steps)")
    trainers = {k: Trainer(k, depth, width, batch) for k in ("ddp", "zero2", "zero3")}
    trainers["zero3-noprefetch"] = Trainer("zero3", depth, width, batch, prefetch=False)
    for t in trainers.values():
        t.step()
        t.step()
    ok = True
    for kind in ("zero3", "zero2"):
        tr = interleaved(lambda: _time_steps(trainers["ddp"], iters),
                         lambda k=kind: _time_steps(trainers[k], iters), trials)
        r = statistics.median(tr.ratios)
        ok &= bool(target("E3", kind).met(r))
        _say(f"  {kind:<8} {tr.cand_median * 1e3:9.2f} ms / DDP {tr.base_median * 1e3:9.2f} ms = {r:.3f}"
             f"  ({judged('E3', kind, r)}; per-trial {' '.join(f'{x:.3f}' for x in tr.ratios)})")
        sink.write({"bench": "E3", "kind": kind, "ranks": n, "ratio": r, "ms": tr.cand_median * 1e3,
                    "ddp_ms": tr.base_median * 1e3})
        summarize(sink, "E3", r, part=kind, ranks=n, trials=tr.ratios, ms=tr.cand_median * 1e3,
                  ddp_ms=tr.base_median * 1e3)

    _say("  per phase, slowest rank's median step (hpcdp.fsdp.step_breakdown):")
    for k in ("ddp", "zero2", "zero3"):
        t = trainers[k]
        b = step_breakdown(t.w, t.opt, t.x, t.loss, steps=iters)
        _say(f"  {k:<8} {b}")
        sink.write({"bench": "E3", "kind": f"{k} breakdown", "ranks": n, **dict(b)})

    def ag_wait(t: Trainer) -> float:
        total = 0.0
        for _ in range(iters):
            t.step()
            total += t.w.comm_wait["all_gather"]
        return _max(total / iters)

    waits = [(ag_wait(trainers["zero3"]), ag_wait(trainers["zero3-noprefetch"])) for _ in range(trials)]
    with_pf = statistics.median(w for w, _ in waits)
    without = statistics.median(w for _, w in waits)
    hidden = 1.0 - with_pf / without if without > 0 else 0.0
    _say(f"  all-gather blocking per step: {with_pf * 1e3:.2f} ms with prefetch, {without * 1e3:.2f} ms "
         f"without: {100 * hidden:.0f}% hidden by prefetch")
    sink.write({"bench": "E3", "kind": "hidden", "ranks": n, "hidden": hidden, "wait_ms": with_pf * 1e3,
                "wait_noprefetch_ms": without * 1e3})
    summarize(sink, "E3", hidden, part="hidden", ranks=n)
    return ok


# -- E4 --------------------------------------------------------------------------------------------
def _step_peak(kind: str, depth: int, width: int) -> float:
    """The slowest rank's tracemalloc peak over one steady-state training step."""
    gc.collect()
    tracemalloc.start()
    try:
        t = Trainer(kind, depth, width, batch=4)
        t.step()
        tracemalloc.reset_peak()
        t.step()
        peak = tracemalloc.get_traced_memory()[1]
        del t
    finally:
        tracemalloc.stop()
    gc.collect()
    return _max(peak)


def _largest(kind: str, depth: int, budget: int, step: int = 16) -> tuple[int, int]:
    """(width, parameters) of the widest model whose step fits ``budget`` bytes, by bisection."""
    lo, hi = 0, step
    while _step_peak(kind, depth, hi) <= budget:   # grow until it does not fit
        lo, hi = hi, hi * 2
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        if _step_peak(kind, depth, mid) <= budget:
            lo = mid
        else:
            hi = mid
    return lo, depth * (lo * lo + lo)


def bench_e4(depth: int, budget_mib: float, sink: JsonSink) -> bool:
    n = hpcdp.world_size()
    budget = int(budget_mib * 2**20)
    _say(f"\n# E4: largest model whose training step fits {budget_mib:g} MiB per rank ({depth} layers, "
         f"{n} ranks; tracemalloc peak of a steady-state step, slowest rank)")
    res = {kind: _largest(kind, depth, budget) for kind in ("ddp", "zero3")}
    ratio = res["zero3"][1] / max(1, res["ddp"][1])
    for kind, (w, p) in res.items():
        _say(f"  {kind:<8} width {w:>5}  {p:>12,d} parameters")
    goal = target("E4")
    met = summarize(sink, "E4", ratio / n, ranks=n, zero3_over_ddp=ratio, budget_mib=budget_mib)
    _say(f"  ZeRO-3 / DDP = {ratio:.2f} = {ratio / n:.3f} x {n} ranks (target ZeRO-3 {goal.text} x N "
         f"times DDP's: {verdict(met)})")
    sink.write({"bench": "E4", "ranks": n, "budget_mib": budget_mib, "ddp_params": res["ddp"][1],
                "zero3_params": res["zero3"][1], "ratio": ratio})
    return bool(met)


def parser() -> argparse.ArgumentParser:
    """Options of E1-E4."""
    p = argparse.ArgumentParser(
        prog="python -m hpcdp.bench fsdp",
        description="E1-E4: FSDP and ZeRO stages against DDP: bytes held per rank, bytes sent per "
                    "step, step time, and the largest model that fits a memory budget. Run under "
                    "'mpirun -n 2 --bind-to core' (and -n 4).")
    p.add_argument("--only", default="E1,E2,E3,E4", help="comma-separated subset of E1,E2,E3,E4")
    p.add_argument("--depth", type=int, default=8, help="E1-E3: Linear layers")
    p.add_argument("--width", type=int, default=512, help="E1, E2: layer width")
    p.add_argument("--e3-width", type=int, default=1024, help="E3: layer width (communication-bound)")
    p.add_argument("--e3-batch", type=int, default=4, help="E3: rows per rank per step")
    p.add_argument("--trials", type=int, default=5, help="E3: interleaved trials")
    p.add_argument("--iters", type=int, default=3, help="E3: steps per timed trial")
    p.add_argument("--e4-depth", type=int, default=32, help="E4: Linear layers of the bisected model")
    p.add_argument("--budget-mib", type=float, default=64.0, help="E4: memory budget per rank")
    p.add_argument("--json", default=None, help="append JSON lines to this file")
    add_plot_argument(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run E1-E4 (``--only`` picks); print tables on rank 0; JSON lines with ``--json``."""
    p = parser()
    args = p.parse_args(argv)
    if min(args.depth, args.width, args.e3_width, args.e3_batch, args.trials, args.iters, args.e4_depth) < 1 \
            or args.budget_mib <= 0:
        p.error("sizes, --trials and --iters must be >= 1 and --budget-mib positive")
    blas = _limit_blas()
    g = hpcdp.init()
    sink = PlotSink(JsonSink(args.json if g.rank == 0 else None))
    only = {s.strip().upper() for s in args.only.split(",")}
    _say(f"# hpcdp FSDP benchmark: {g.size} {g.backend.name} ranks, {blas}")
    ok = True
    if "E1" in only:
        ok &= bench_e1(args.depth, args.width, sink)
    if "E2" in only:
        ok &= bench_e2(args.depth, args.width, sink)
    if "E3" in only:
        ok &= bench_e3(args.depth, args.e3_width, args.e3_batch, args.trials, args.iters, sink)
    if "E4" in only:
        ok &= bench_e4(args.e4_depth, args.budget_mib, sink)
    _say(f"# targets {'met' if ok else 'NOT met'}")
    if g.rank == 0 and sink.rows and ({"E3", "E4"} & only):  # E1/E2 are tables, not figures
        maybe_plot(args, sink.rows, title=f"hpcdp FSDP/ZeRO (E3, E4), {g.size} ranks")
    sink.close()
    return 0

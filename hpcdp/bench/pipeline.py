"""``python -m hpcdp.bench pipeline``: F1 and F2 of PERF.md.

F1: every stage sleeps known times (forward ``t_f``, input gradient ``t_i``, weight gradient
``t_w``; a full backward is ``t_b = t_i + t_w``), so the ideal step time of each schedule is known:
GPipe and 1F1B take ``(m + p - 1)(t_f + t_b)`` with bubble ``(p - 1)/(m + p - 1)``; interleaved
1F1B with ``v`` stages per rank (each sleeping ``1/v`` of the times) has bubble
``(p - 1)/(v m + p - 1)``; ZB-H1 with ``t_f = t_i = t_w`` and ``m >= p`` takes
``m (t_f + t_b) + (p - 1)(t_f + t_i - t_w)``. Measured: the median step time over ``--trials``
steps (after one warm-up step), and the bubble ``1 - m (t_f + t_b) / step time``; also the
verifier's prediction on the same costs.

"floor" is the same schedule run by bare threads that only sleep and hand off with events, timed
before each pipeline step of the same launch (interleaved trials, median of the per-trial ratios,
as PERF.md asks): what this machine's sleeps and thread wake-ups alone cost. On a loaded machine
they, not the pipeline, dominate the distance to the ideal.

F2: the peak number of microbatches whose saved activations a rank holds at once, measured in the
layers' per-microbatch stores during a step: exactly ``m`` for GPipe and ``p - rank`` for 1F1B
(``m >= p``), and equal to what ``verify`` predicts for every schedule.

Runs on the ranks of an ``mpirun``/``hpcdp-run`` launch, or on ``--ranks`` simulated ranks (threads,
which sleep without holding the GIL) when started alone.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from typing import Any

import numpy as np

import hpcdp
import hpcdp.pipeline as pipeline
from hpcdp import nn

from ._common import JsonSink, summarize
from ._plot import add_plot_argument, maybe_plot
from ._targets import target

VARIANTS = (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1))


class SleepStage(nn.Module):
    """Sleeps known times in forward, input gradient and weight gradient; keeps its input per
    microbatch like a real layer (what F2 counts)."""

    def __init__(self, t_f: float, t_i: float, t_w: float) -> None:
        super().__init__()
        self.t_f, self.t_i, self.t_w = t_f, t_i, t_w

    def forward(self, x: Any) -> Any:
        time.sleep(self.t_f)
        self.save_for_backward(x)
        return x + 1.0

    def backward_input(self, g: Any) -> Any:
        self.saved_tensors()
        time.sleep(self.t_i)
        self.save_for_weight(g)
        return g

    def backward_weight(self) -> None:
        self.saved_for_weight()
        time.sleep(self.t_w)


def theory(name: str, p: int, m: int, v: int, t_f: float, t_i: float, t_w: float) -> tuple[float, float]:
    """(step time, bubble) the closed forms above give."""
    work = m * (t_f + t_i + t_w)
    if name == "interleaved_1f1b":
        t = work + (p - 1) * (t_f + t_i + t_w) / v
    elif name == "zero_bubble":
        t = work + (p - 1) * (t_f + t_i - t_w)
    else:
        t = (m + p - 1) * (t_f + t_i + t_w)
    return t, 1.0 - work / t


def floor(sched: pipeline.Schedule, t_f: float, t_i: float, t_w: float) -> float:
    """The same schedule run by bare threads that sleep and hand off with ``threading.Event``:
    what this machine's sleeps and wake-ups cost, without hpcdp (the "ideal" it can reach)."""
    from hpcdp.pipeline import Op

    cost = {Op.FORWARD: t_f, Op.BACKWARD: t_i + t_w, Op.BACKWARD_INPUT: t_i, Op.BACKWARD_WEIGHT: t_w}
    last = sched.n_stages - 1
    done: dict[tuple[str, int, int], threading.Event] = {}
    for s in range(sched.n_stages):
        for mb in range(sched.microbatches):
            done[("F", s, mb)] = threading.Event()
            done[("B", s, mb)] = threading.Event()

    def rank(r: int) -> None:
        for a in sched.compute_only().actions[r]:
            if a.op is Op.FORWARD and a.stage > 0:
                done[("F", a.stage - 1, a.mb)].wait()
            elif a.op in (Op.BACKWARD, Op.BACKWARD_INPUT) and a.stage < last:
                done[("B", a.stage + 1, a.mb)].wait()
            time.sleep(cost[a.op])
            if a.op is Op.FORWARD:
                done[("F", a.stage, a.mb)].set()
            elif a.op in (Op.BACKWARD, Op.BACKWARD_INPUT):
                done[("B", a.stage, a.mb)].set()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(sched.stages)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def run_rank(name: str, v: int, m: int, trials: int, t_f: float, t_i: float, t_w: float,
             group: Any = None) -> dict[str, Any]:
    """One schedule on this rank: per-trial step times, interleaved with the floor (run by
    group rank 0 while the others wait), and the measured/predicted peak activations."""
    g = group or hpcdp.get_default_group()
    n = g.size * v
    model = nn.Sequential(*[SleepStage(t_f / v, t_i / v, t_w / v) for _ in range(n)])
    stage = pipeline.PipelineStage(model, split_points=list(range(1, n)), virtual=v, group=g)
    pipe = pipeline.Pipeline(stage, schedule=name, n_microbatches=m, loss_fn=nn.MSELoss())
    x = np.zeros((m, 1))
    pipe.step(x, x)   # the first step also exchanges shapes
    times, floors = [], []
    for _ in range(trials):
        if g.rank == 0:
            floors.append(floor(pipe.schedule, t_f / v, t_i / v, t_w / v))
        g.barrier()
        t0 = time.perf_counter()
        pipe.step(x, x)
        times.append(time.perf_counter() - t0)
    costs = pipeline.Costs(forward=t_f / v, backward_input=t_i / v, backward_weight=t_w / v)
    report = pipeline.verify(pipe.schedule.compute_only(), costs=costs)
    return {"times": times, "floors": floors, "peak": pipe.peak_activations,
            "predicted_peak": pipe.predicted_peak_activations,
            "sim_makespan": report.makespan, "sim_bubble": report.bubble}


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every variant on this launch's ranks (or simulated ones); one row per variant."""
    t_f, t_i, t_w = args.t_f / 1e3, args.t_i / 1e3, args.t_w / 1e3
    rows = []
    for name, v in VARIANTS:
        call = (name, v, args.microbatches, args.trials, t_f, t_i, t_w)
        if hpcdp.world_size() > 1:
            per_rank = hpcdp.all_gather_object(run_rank(*call))
        else:
            per_rank = hpcdp.spawn(lambda r: run_rank(*call), args.ranks, backend="sim")
        p = len(per_rank)
        r0 = per_rank[0]
        step = statistics.median(r0["times"])
        ideal, bubble_theory = theory(name, p, args.microbatches, v, t_f, t_i, t_w)
        work = args.microbatches * (t_f + t_i + t_w)
        rows.append({
            "bench": "F1", "schedule": name, "ranks": p, "microbatches": args.microbatches,
            "virtual": v, "step_s": step, "ideal_s": ideal, "ratio": step / ideal,
            "floor_s": statistics.median(r0["floors"]),
            "ratio_floor": statistics.median(t / f for t, f in zip(r0["times"], r0["floors"])),
            "bubble": 1.0 - work / step, "bubble_theory": bubble_theory,
            "bubble_verify": r0["sim_bubble"],
            "peak": [r["peak"] for r in per_rank],
            "predicted_peak": [r["predicted_peak"] for r in per_rank],
        })
    return rows


def _f2_expected(r: dict[str, Any], m: int) -> list[int] | None:
    """F2's closed form for GPipe (m) and 1F1B (p - rank, at most m); None: verify's prediction."""
    p = r["ranks"]
    return {"gpipe": [m] * p, "1f1b": [min(p - k, m) for k in range(p)]}.get(r["schedule"])


def summaries(rows: list[dict[str, Any]], args: argparse.Namespace, sink: Any) -> None:
    """The summary records of F1 (per schedule: step / ideal, bubble - theory; zero-bubble / 1F1B)
    and F2 (per schedule: the largest difference from the expected peaks)."""
    m = args.microbatches
    for r in rows:
        common = {"ranks": r["ranks"], "variant": r["schedule"], "microbatches": m}
        summarize(sink, "F1", r["ratio"], part="step", **common)
        summarize(sink, "F1", r["bubble"] - r["bubble_theory"], part="bubble", bubble=r["bubble"],
                  bubble_theory=r["bubble_theory"], **common)
        want = _f2_expected(r, m) or r["predicted_peak"]   # and verify's prediction for every schedule
        diff = max([abs(a - b) for a, b in zip(r["peak"], want)]
                   + [abs(a - b) for a, b in zip(r["peak"], r["predicted_peak"])], default=0)
        summarize(sink, "F2", diff, peak=r["peak"], expected=want, **common)
    by = {r["schedule"]: r for r in rows}
    if "zero_bubble" in by and "1f1b" in by:
        summarize(sink, "F1", by["zero_bubble"]["step_s"] / by["1f1b"]["step_s"], part="zero-bubble",
                  ranks=rows[0]["ranks"], microbatches=m)


def report(rows: list[dict[str, Any]], args: argparse.Namespace, out: Any = sys.stdout) -> bool:
    """Print F1 and F2 with their targets; True when every target is met."""
    ok = True
    step_t, bubble_t, zb_t, f2_t = (target("F1", "step"), target("F1", "bubble"), target("F1", "zero-bubble"),
                                    target("F2"))
    p, m = rows[0]["ranks"], args.microbatches
    print(f"# F1 pipeline step, {p} ranks, {m} microbatches, stages sleep t_f={args.t_f:g} "
          f"t_i={args.t_i:g} t_w={args.t_w:g} ms (t_b = t_i + t_w), median of {args.trials} "
          f"interleaved trials",
          file=out)
    print(f"# {'schedule':<18} {'v':>2} {'step(ms)':>9} {'ideal(ms)':>9} {'ratio':>6} "
          f"{'bubble':>7} {'theory':>7} {'verify':>7} {'floor(ms)':>9} {'/floor':>6}   target",
          file=out)
    by = {r["schedule"]: r for r in rows}
    for r in rows:
        good = bool(step_t.met(r["ratio"])) and bool(bubble_t.met(r["bubble"] - r["bubble_theory"]))
        ok &= good
        print(f"  {r['schedule']:<18} {r['virtual']:>2} {r['step_s'] * 1e3:>9.1f} "
              f"{r['ideal_s'] * 1e3:>9.1f} {r['ratio']:>6.3f} {r['bubble']:>7.4f} "
              f"{r['bubble_theory']:>7.4f} {r['bubble_verify']:>7.4f} {r['floor_s'] * 1e3:>9.1f} "
              f"{r['ratio_floor']:>6.3f}   "
              f"{'ok' if good else 'MISSED'} ({step_t.text}, bubble {bubble_t.text})", file=out)
    zb_below = bool(zb_t.met(by["zero_bubble"]["step_s"] / by["1f1b"]["step_s"]))
    ok &= zb_below
    print(f"# zero_bubble below 1f1b: {zb_below} ({by['zero_bubble']['step_s'] * 1e3:.1f} vs "
          f"{by['1f1b']['step_s'] * 1e3:.1f} ms)", file=out)
    print(f"# F2 peak stashed activations per rank (measured in the layers' stores; target {f2_t.text})",
          file=out)
    for r in rows:
        expected = _f2_expected(r, m)
        exact = r["peak"] == r["predicted_peak"] and (expected is None or r["peak"] == expected)
        ok &= exact
        want = f"expected {expected}" if expected else "verify predicts"
        print(f"  {r['schedule']:<18} measured {r['peak']}  {want} {expected or r['predicted_peak']}"
              f"   {'exact' if exact else 'MISMATCH'}", file=out)
    return ok


def parser() -> argparse.ArgumentParser:
    """Options of F1 and F2."""
    ap = argparse.ArgumentParser(
        prog="python -m hpcdp.bench pipeline",
        description="F1, F2: each pipeline schedule's step time and bubble against theory and a "
                    "bare-thread floor, and the activations each rank stashes. Runs on the ranks of "
                    "a launch, or on --ranks simulated ranks when started alone.")
    ap.add_argument("--ranks", type=int, default=4, help="simulated ranks when started alone")
    ap.add_argument("--microbatches", type=int, default=8, help="microbatches per step (m)")
    ap.add_argument("--trials", type=int, default=5, help="timed steps, each after a floor run")
    ap.add_argument("--t-f", type=float, default=50.0, help="forward sleep per stage, ms")
    ap.add_argument("--t-i", type=float, default=50.0, help="input-gradient sleep, ms")
    ap.add_argument("--t-w", type=float, default=50.0, help="weight-gradient sleep, ms")
    ap.add_argument("--json", default=None, help="append JSON lines here")
    ap.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    add_plot_argument(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    started = not hpcdp.is_initialized()
    if started:
        hpcdp.init()
    try:
        rows = measure(args)
    finally:
        if started and hpcdp.world_size() > 1:
            hpcdp.barrier()
    ok = True
    if hpcdp.rank() == 0:
        ok = report(rows, args)
        sink = JsonSink(args.json)
        for r in rows:
            sink.write(r)
        summaries(rows, args, sink)
        sink.close()
        maybe_plot(args, rows, title=f"hpcdp pipeline F1: step time and bubble, {rows[0]['ranks']} ranks")
    return 0 if ok or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())

"""``python -m hpcdp.bench trace``: T1, what tracing costs on the DDP example's training step.

The model and batch are those of ``examples/02_ddp_train.py`` (an MLP 64-128-128-10, 16 rows per
rank, Adam), on synthetic data: a small, latency-bound step, where per-operation costs show most.
Three modes run in the same launch, interleaved trial by trial (rotating which goes first, the
machine is shared and noisy), each trial a fixed number of steps (its median step, on the slowest rank):

* ``recorder off``: what ``HPCDP_FLIGHT_RECORDER=0`` gives (the group's recorder detached);
* ``ring``: the default flight-recorder ring;
* ``traced``: ``HPCDP_TRACE=1`` (ring + Chrome-trace timeline with source lines), the events
  written to a temporary directory, formatting and writing them included in the time. Opening
  the file and closing it are not: a job does each once, however many steps it runs, while a
  trial of a few dozen steps would charge them to every step (printed apart;
  ``--file-in-trial`` counts them, as this benchmark did before).

Prints the median per-trial ratios: T1 = traced / ring and ring / off, the recorder's cost per
recorded operation, and (first, ``--calls``) the ring's cost on the tuned 8 B allreduce fast
path, recorder on against off in interleaved trials (targets: T1, T1 ring, T1 fast path of
``_targets``). Run under any launcher::

    mpirun -n 2 --bind-to core python -m hpcdp.bench trace
    python -m hpcdp.run -n 2 -m hpcdp.bench trace      # TCP ranks
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

import hpcdp
from hpcdp import nn, optim, trace

from ._common import JsonSink, interleaved, summarize, verdict
from ._targets import target
from ._plot import PlotSink, add_plot_argument, maybe_plot

__all__ = ["main"]

MODES = ("recorder off", "ring", "traced")


def _model(hidden: int, seed: int) -> nn.Module:
    return nn.Sequential(nn.Linear(64, hidden, seed=seed), nn.ReLU(),
                         nn.Linear(hidden, hidden, seed=seed + 1), nn.ReLU(),
                         nn.Linear(hidden, 10, seed=seed + 2))


class _Trainer:
    """The example's step on a fixed synthetic batch per rank."""

    def __init__(self, group: Any, hidden: int, batch: int) -> None:
        self.group = group
        self.ddp = hpcdp.DDP(_model(hidden, 0), group=group)
        self.opt = optim.Adam(self.ddp.parameters(), lr=2e-3)
        self.loss = nn.CrossEntropyLoss()
        rng = np.random.default_rng(group.rank)
        self.x = rng.standard_normal((batch, 64)).astype(np.float32)
        self.y = rng.integers(0, 10, batch).astype(np.int64)

    def step(self) -> None:
        out = self.ddp(self.x)
        self.loss(out, self.y)
        self.ddp.backward(self.loss.backward())
        self.opt.step()
        self.opt.zero_grad()


def _trial(tr: _Trainer, mode: str, steps: int, directory: str,
           file_in_trial: bool = False) -> tuple[float, int, float]:
    """(seconds per step on the slowest rank, operations recorded per step, seconds the slowest
    rank took to open and close its timeline file) in ``mode``.

    A trial's figure is its median step plus, when traced, all the time spent writing the
    timeline (the chunks flushed during the trial and the last one) spread over the steps:
    medians shrug off the steps another process preempted (this machine is shared), and would
    also drop the few steps that flushed a chunk, so that time is added back explicitly. The
    file is opened (created, its header written) before the steps and closed after the last
    chunk, outside the figure, unless ``file_in_trial``.
    """
    g = tr.group
    rec = g._rec  # the recorder the collective layer writes to
    per_step = [0.0] * steps
    clock = time.perf_counter
    once = 0.0  # opening and closing the file
    tl = None
    if mode == "recorder off":
        g._rec = None
    elif mode == "traced":
        # a directory of its own, as a job's first trace: not the truncation of the previous
        # trial's file
        trace.enable(tempfile.mkdtemp(dir=directory))
        tl = trace.timeline()
        if tl is not None and not file_in_trial:
            t0 = clock()
            tl.flush()  # no events yet: creates the file and writes its header
            once = clock() - t0
    try:
        g.barrier()
        before = rec.total() if rec is not None else 0
        base = tl.flush_ns if tl is not None else 0  # the opening, when done above
        for i in range(steps):
            t0 = clock()
            tr.step()
            per_step[i] = clock() - t0
        tail = 0.0
        if tl is not None:
            tail = (tl.flush_ns - base) / 1e9  # the chunks written during the steps
            t0 = clock()
            if not file_in_trial:
                tl.flush()  # the last chunk: part of tracing's cost
            tail += clock() - t0
            t0 = clock()
            trace.disable()  # closes the file (and, ``file_in_trial``, writes the last chunk)
            if file_in_trial:
                tail += clock() - t0
            else:
                once += clock() - t0
        ops = (rec.total() - before) if rec is not None and mode != "recorder off" else 0
    finally:
        g._rec = rec
        if trace.enabled():
            trace.disable()
    mine = statistics.median(per_step) + tail / steps
    worst = g.allreduce(np.array([mine, once]), "max")
    return float(worst[0]), ops // steps, float(worst[1])


def _latency_trial(g: Any, on: bool, calls: int) -> float:
    """Mean seconds per blocking 8 B allreduce (the tuned fast path), recorder on or off."""
    x, out = np.ones(2, np.float32), np.empty(2, np.float32)
    rec = g._rec
    if not on:
        g._rec = None
    try:
        g.barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            g.allreduce(x, out=out)
        dt = (time.perf_counter() - t0) / calls
    finally:
        g._rec = rec
    return float(g.allreduce(np.array([dt]), "max")[0])


def latency(group: Any, *, trials: int, calls: int) -> dict[str, Any]:
    """The ring's cost on the 8 B allreduce fast path: interleaved trials, on minus off (seconds)."""
    if group._rec is None:
        raise RuntimeError("python -m hpcdp.bench trace: the flight recorder is off "
                           "(HPCDP_FLIGHT_RECORDER=0); nothing to compare")
    _latency_trial(group, True, calls)  # warm-up
    tr = interleaved(lambda: _latency_trial(group, False, calls),
                     lambda: _latency_trial(group, True, calls), trials)
    diffs = [on - off for off, on in zip(tr.base, tr.cand)]
    return {"on": tr.cand, "off": tr.base, "diff": statistics.median(diffs), "diffs": diffs}


def measure(group: Any, *, trials: int, steps: int, hidden: int, batch: int,
            directory: str, file_in_trial: bool = False) -> dict[str, Any]:
    """Per-mode step times (lists, seconds) and the median ratios of the same trials."""
    if trace.enabled():
        raise RuntimeError("python -m hpcdp.bench trace: unset HPCDP_TRACE (the benchmark switches it)")
    tr = _Trainer(group, hidden, batch)
    for _ in range(5):  # warm-up: the first synced backward learns the bucket order
        tr.step()
    for m in MODES:  # and one untimed trial per mode (what each formats once, a job formats once)
        _trial(tr, m, min(steps, 10), directory, file_in_trial)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    opens: list[float] = []
    ops = 0
    for i in range(trials):
        order = MODES[i % 3:] + MODES[:i % 3]
        for m in order:
            t, n, o = _trial(tr, m, steps, directory, file_in_trial)
            times[m].append(t)
            ops = max(ops, n)
            if m == "traced" and not file_in_trial:
                opens.append(o)
    t1 = [b / a for a, b in zip(times["ring"], times["traced"])]
    ring = [b / a for a, b in zip(times["recorder off"], times["ring"])]
    per_op = [(b - a) / max(ops, 1) for a, b in zip(times["recorder off"], times["ring"])]
    return {"times": times, "ops_per_step": ops, "t1": statistics.median(t1), "t1_trials": t1,
            "file": statistics.median(opens) if opens else None,
            "ring": statistics.median(ring), "ring_trials": ring,
            "ring_ns_per_op": statistics.median(per_op) * 1e9}


def parser() -> argparse.ArgumentParser:
    """Options of T1."""
    p = argparse.ArgumentParser(
        prog="python -m hpcdp.bench trace",
        description="T1: the DDP example's training step with the flight recorder off, the default "
                    "ring, and full tracing (HPCDP_TRACE=1), interleaved; and the ring's cost per "
                    "recorded 8 B allreduce. Run under any launcher.")
    p.add_argument("--trials", type=int, default=7, help="interleaved trials per mode")
    p.add_argument("--steps", type=int, default=60, help="training steps per trial")
    p.add_argument("--hidden", type=int, default=128, help="hidden width of the MLP")
    p.add_argument("--batch", type=int, default=16, help="rows per rank")
    p.add_argument("--calls", type=int, default=2000,
                   help="8 B allreduces per latency trial (0: skip the latency comparison)")
    p.add_argument("--file-in-trial", action="store_true",
                   help="count opening and closing the timeline file (once per job) in each traced trial")
    p.add_argument("--json", default=None, help="append JSON lines here")
    add_plot_argument(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run T1; print the table and ratios on rank 0; JSON lines with ``--json``."""
    p = parser()
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if min(args.trials, args.steps, args.hidden, args.batch) < 1 or args.calls < 0:
        p.error("--trials, --steps, --hidden and --batch must be >= 1, --calls >= 0")
    g = hpcdp.init()
    directory = tempfile.mkdtemp(prefix="hpcdp-bench-trace-") if g.rank == 0 else ""
    directory = g.broadcast_object(directory)  # one directory: each rank writes its own file
    try:
        lat = latency(g, trials=args.trials, calls=args.calls) if args.calls > 0 else None
        res = measure(g, trials=args.trials, steps=args.steps, hidden=args.hidden, batch=args.batch,
                      directory=directory, file_in_trial=args.file_in_trial)
    finally:
        g.barrier()
        if g.rank == 0:
            shutil.rmtree(directory, ignore_errors=True)
    if g.rank == 0:
        sink = PlotSink(JsonSink(args.json))
        print(f"# hpcdp trace benchmark (T1): DDP example step, {g.size} {g.backend.name} ranks, "
              f"{args.trials} interleaved trials of {args.steps} steps, "
              f"{res['ops_per_step']} recorded operations per step")
        for m in MODES:
            ts = res["times"][m]
            print(f"  {m:<14} median {statistics.median(ts) * 1e3:8.3f} ms/step   "
                  + " ".join(f"{t * 1e3:.3f}" for t in ts))
        rows = [("T1 DDP example step: HPCDP_TRACE=1 / off", "", res["t1"], res["t1_trials"]),
                ("flight-recorder ring / HPCDP_FLIGHT_RECORDER=0", "ring", res["ring"], res["ring_trials"])]
        for name, part, v, per in rows:
            met = summarize(sink, "T1", v, part=part, ranks=g.size, name=name, trials=per)
            print(f"# {name}: {v:.3f} (target {target('T1', part).text}: {verdict(met)}; trials "
                  + " ".join(f"{r:.3f}" for r in per) + ")")
        if res["file"] is not None:
            print(f"# opening and closing the timeline file (once per job, not in T1; --file-in-trial "
                  f"counts it): {res['file'] * 1e6:.0f} us (median, slowest rank)")
        print(f"# ring cost per recorded operation: {res['ring_ns_per_op']:+.0f} ns (median of trials; "
              "noise of a step time spread over its operations)")
        if lat is not None:
            met = summarize(sink, "T1", lat["diff"] * 1e6, part="fast path", ranks=g.size,
                            name="flight recorder on - off, 8 B allreduce (us)")
            print(f"# 8 B allreduce fast path: recorder on {statistics.median(lat['on']) * 1e6:.2f} us, "
                  f"off {statistics.median(lat['off']) * 1e6:.2f} us; on - off {lat['diff'] * 1e6:+.3f} us "
                  f"(target {target('T1', 'fast path').text}: {verdict(met)}; median of {args.trials} "
                  f"interleaved trials of {args.calls} calls; trials "
                  + " ".join(f"{d * 1e6:+.2f}" for d in lat["diffs"]) + ")")
        sink.close()
        maybe_plot(args, sink.rows, title=f"hpcdp tracing overhead (T1), {g.size} ranks")
    hpcdp.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())

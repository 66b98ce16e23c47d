"""``python -m hpcdp.bench torch``: D5 of PERF.md, torch models under ``hpcdp.DDP`` against torch's own DDP.

Run on 2 ranks bound to cores, one thread each (PERF.md's method)::

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 mpirun -n 2 --bind-to core python -m hpcdp.bench torch

For each model (the CNN of ``examples/07_torch_cnn.py`` and an MLP 784-1024-1024-10), batch
``--batch`` per rank, SGD, a torch user's step (``loss.backward()``, ``opt.step()``,
``opt.zero_grad()``):

* weak scaling: t1 = plain torch on rank 0 alone (the other ranks sleep), t2 = every rank training
  with ``hpcdp.DDP(model)`` over this launch's backend (MPI), t2_gloo = every rank training with
  ``torch.nn.parallel.DistributedDataParallel`` over gloo (``init_process_group("gloo")`` on
  127.0.0.1 inside the same launch); efficiency = t1 / t2 (target: D5 efficiency) beside t1 / t2_gloo;
* bound: the plain torch step on every rank at once without communication; t1 / that is what
  sharing the machine's cores, caches and memory bandwidth alone leaves of the efficiency;
* ceiling without overlap (MPI): a raw mpi4py ``Allreduce`` of the model's gradient bytes, timed
  alone (interleaved with t1): t1 / (bound's time + that) is what a DDP that hid none of its
  communication behind backward could reach; beside it, the plain torch step with that
  ``Allreduce`` of its own gradients (one flat buffer they are views of) in every step, t1 / that
  (per-step synchronization included). With one core per rank and shared-memory MPI the
  reduction is CPU work on the core that runs backward, so these are what the machine allows;
* breakdown (rank 0, median ms per step, interleaved): forward, backward up to the last
  gradient's arrival, the tail from there until ``loss.backward()`` returns (DDP's last launches
  and its wait for every bucket), ``opt.step()``, ``opt.zero_grad()``, for plain torch, plain
  torch + the raw ``Allreduce`` and ``hpcdp.DDP``: where DDP's excess over the raw step goes;
* adapter overhead: every rank at once, ``hpcdp.DDP`` over a group of that rank alone against the
  plain torch model (target: D5 overhead).

Every figure is the median over interleaved trials of per-trial ratios.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
from typing import Any, Callable


import numpy as np

import hpcdp

from ._common import JsonSink, interleaved, judged, pretouch, slowest, summarize, time_alone, time_loop

__all__ = ["main"]


def _models(torch: Any) -> dict[str, Callable[[], Any]]:
    nn = torch.nn

    def cnn() -> Any:
        return nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(32 * 2 * 2, 64), nn.ReLU(inplace=True), nn.Linear(64, 10))

    def mlp() -> Any:
        return nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                             nn.Linear(1024, 10))
    return {"cnn": cnn, "mlp": mlp}


def _batch(torch: Any, name: str, batch: int, rank: int) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(rank)
    shape = (batch, 1, 8, 8) if name == "cnn" else (batch, 784)
    return torch.randn(*shape, generator=g), torch.randint(0, 10, (batch,), generator=g)


def _stepper(torch: Any, model: Any, x: Any, y: Any) -> Callable[[], None]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    f = torch.nn.functional.cross_entropy

    def step() -> None:
        f(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)   # gradient memory reused, as DDP's buckets are
    return step


class _RawStep:
    """Plain torch with its gradients in one flat buffer (views, as DDP's buckets) and a raw
    mpi4py ``Allreduce`` of that buffer after backward: the step a DDP without overhead and
    without overlap would take (the sum is not divided: a lower bound)."""

    def __init__(self, torch: Any, model: Any, x: Any, y: Any, comm: Any) -> None:
        from mpi4py import MPI

        params = [p for p in model.parameters() if p.requires_grad]
        dtype = params[0].detach().numpy().dtype
        self.flat = np.zeros(sum(p.numel() for p in params), dtype)
        pretouch(self.flat)
        at = 0
        for p in params:
            n = p.numel()
            p.grad = torch.from_numpy(self.flat[at:at + n]).view(p.shape)
            at += n
        self.model, self.x, self.y, self.comm, self.inplace = model, x, y, comm, MPI.IN_PLACE
        self.opt = torch.optim.SGD(params, lr=1e-3)
        self.loss = torch.nn.functional.cross_entropy

    def allreduce(self) -> None:
        self.comm.Allreduce(self.inplace, self.flat)

    def __call__(self) -> None:
        self.loss(self.model(self.x), self.y).backward()
        self.allreduce()
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)


_PHASES = ("forward", "backward", "tail", "comm", "opt.step", "zero_grad", "total")


def _phased(torch: Any, model: Any, x: Any, y: Any, comm: Callable[[], None] | None = None
            ) -> Callable[[], list[float]]:
    """A step timed per phase (``_PHASES``, seconds): "backward" ends when the gradient that
    arrives last (the first parameter's) is about to accumulate, "tail" is the rest of
    ``loss.backward()``, "comm" the raw ``Allreduce`` after it (plain + raw only)."""
    import time

    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    f = torch.nn.functional.cross_entropy
    first = next(p for p in model.parameters() if p.requires_grad)
    mark = [0.0]

    def seen(grad: Any) -> None:
        mark[0] = time.perf_counter()
    first.register_hook(seen)

    def step() -> list[float]:
        t0 = time.perf_counter()
        loss = f(model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if comm is not None:
            comm()
        t3 = time.perf_counter()
        opt.step()
        t4 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        t5 = time.perf_counter()
        return [t1 - t0, mark[0] - t1, t2 - mark[0], t3 - t2, t4 - t3, t5 - t4, t5 - t0]
    return step


def _breakdown(torch: Any, g: Any, steps: dict[str, Callable[[], list[float]]], n: int) -> dict[str, list[float]]:
    """Median ms per phase of each step over ``n`` interleaved steps (every rank in step)."""
    got: dict[str, list[list[float]]] = {k: [] for k in steps}
    for fn in steps.values():
        fn()
    for i in range(n):
        for k in (list(steps) if i % 2 == 0 else list(steps)[::-1]):
            g.barrier()
            got[k].append(steps[k]())
    return {k: [float(v) * 1e3 for v in np.median(np.array(rows), axis=0)] for k, rows in got.items()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def bench_model(torch: Any, dist: Any, g: Any, name: str, batch: int, iters: int, trials: int,
                sink: JsonSink, bucket_mb: float = 25.0, breakdown: int = 0) -> dict[str, float]:
    make = _models(torch)[name]
    x, y = _batch(torch, name, batch, g.rank)
    torch.manual_seed(0)
    alone = _stepper(torch, make(), x, y)
    torch.manual_seed(0)
    ours = _stepper(torch, hpcdp.DDP(make(), group=g, bucket_cap_mb=bucket_mb), x, y)
    torch.manual_seed(0)
    gloo = (_stepper(torch, torch.nn.parallel.DistributedDataParallel(make(), bucket_cap_mb=bucket_mb), x, y)
            if dist else None)
    comm = g.backend.native_comm() if g.size > 1 else None
    torch.manual_seed(0)
    raw = _RawStep(torch, make(), x, y, comm) if comm is not None else None
    solo_group = g.split(g.rank)
    torch.manual_seed(0)
    solo = _stepper(torch, hpcdp.DDP(make(), group=solo_group), x, y)

    def t1() -> float:
        return time_alone(g, alone, iters, tag=78)

    def t2() -> float:
        return slowest(g, time_loop(ours, iters, g.barrier))

    def t_both() -> float:   # plain torch on every rank at once: what sharing the machine costs
        return slowest(g, time_loop(alone, iters, g.barrier))

    def t2_gloo() -> float:
        return slowest(g, time_loop(gloo, iters, g.barrier))

    def t_allreduce() -> float:   # the raw Allreduce of the gradient bytes alone
        return slowest(g, time_loop(raw.allreduce, iters, g.barrier))

    def t_raw_step() -> float:
        return slowest(g, time_loop(raw, iters, g.barrier))

    for fn in (alone, ours, solo) + ((gloo,) if gloo else ()) + ((raw,) if raw else ()):
        fn()   # first steps: hpcdp.DDP learns its buckets' hook counts, torch allocates
    tr = interleaved(t1, t2, trials)
    eff = statistics.median(b / c for b, c in zip(tr.base, tr.cand))
    res: dict[str, Any] = {"efficiency": eff, "t1_ms": tr.base_median * 1e3, "t2_ms": tr.cand_median * 1e3}
    tb = interleaved(t1, t_both, trials)
    res.update(bound=statistics.median(b / c for b, c in zip(tb.base, tb.cand)),
               t_both_ms=tb.cand_median * 1e3)
    if raw is not None:
        ta = interleaved(t1, t_allreduce, trials)
        tr_ = interleaved(t1, t_raw_step, trials)
        res.update(t_allreduce_ms=ta.cand_median * 1e3, grad_mb=raw.flat.nbytes / 1e6,
                   ceiling=res["t1_ms"] / (res["t_both_ms"] + ta.cand_median * 1e3),
                   t_raw_step_ms=tr_.cand_median * 1e3,
                   ceiling_step=statistics.median(b / c for b, c in zip(tr_.base, tr_.cand)))
    if gloo is not None:
        tg = interleaved(t1, t2_gloo, trials)
        res.update(efficiency_gloo=statistics.median(b / c for b, c in zip(tg.base, tg.cand)),
                   t2_gloo_ms=tg.cand_median * 1e3)
    # adapter overhead: each rank alone, at once (bound to its own core)
    to = interleaved(lambda: time_loop(alone, iters), lambda: time_loop(solo, iters), trials)
    mine = statistics.median(c / b for b, c in zip(to.base, to.cand))
    res.update(overhead=slowest(g, mine), overhead_rank0=mine,
               t_plain_ms=to.base_median * 1e3, t_solo_ddp_ms=to.cand_median * 1e3)
    if g.rank == 0:
        gl = (f", torch DDP over gloo: t2 {res['t2_gloo_ms']:.2f} ms, efficiency {res['efficiency_gloo']:.3f}"
              if gloo is not None else " (gloo baseline unavailable)")
        print(f"# D5 {name} weak scaling ({g.size} ranks vs 1, batch {batch}/rank): t1 {res['t1_ms']:.2f} ms, "
              f"hpcdp.DDP t2 {res['t2_ms']:.2f} ms, efficiency {eff:.3f} ({judged('D5', 'efficiency', eff)}){gl}")
        print(f"# D5 {name} the same plain torch step on every rank at once, no communication: "
              f"{res['t_both_ms']:.2f} ms, t1 / that {res['bound']:.3f} (the machine's own bound on efficiency)")
        if raw is not None:
            print(f"# D5 {name} ceiling without overlap: raw mpi4py Allreduce of the {res['grad_mb']:.2f} MB "
                  f"of gradients alone {res['t_allreduce_ms']:.2f} ms, t1 / (the step on every rank at once "
                  f"+ that) {res['ceiling']:.3f}; plain torch step + that Allreduce of its own gradients "
                  f"every step {res['t_raw_step_ms']:.2f} ms, t1 / that {res['ceiling_step']:.3f} "
                  f"(hpcdp.DDP's efficiency {eff:.3f})")
        print(f"# D5 {name} adapter overhead at 1 rank: plain torch {res['t_plain_ms']:.2f} ms, hpcdp.DDP "
              f"{res['t_solo_ddp_ms']:.2f} ms, ratio {res['overhead']:.3f} (max over ranks; "
              f"{judged('D5', 'overhead', res['overhead'])})")
    if breakdown and raw is not None:
        def seeded() -> Any:   # the same weights for all three (a step's time depends on them)
            torch.manual_seed(0)
            return make()
        raw.model.load_state_dict(seeded().state_dict())   # (in place: its gradients stay views)
        rows = _breakdown(torch, g, {
            "plain torch": _phased(torch, seeded(), x, y),
            "plain + raw Allreduce": _phased(torch, raw.model, x, y, raw.allreduce),
            "hpcdp.DDP": _phased(torch, hpcdp.DDP(seeded(), group=g, bucket_cap_mb=bucket_mb), x, y)},
            breakdown)
        res["breakdown_ms"] = rows
        if g.rank == 0:
            print(f"# D5 {name} breakdown, rank 0, median ms per step over {breakdown} interleaved steps "
                  "(tail: from the last gradient to loss.backward() returning):")
            print("#   " + " " * 22 + "".join(f"{ph:>10s}" for ph in _PHASES))
            for k, v in rows.items():
                print(f"#   {k:22s}" + "".join(f"{t:10.3f}" for t in v))
            ex = [a - b for a, b in zip(rows["hpcdp.DDP"], rows["plain + raw Allreduce"])]
            print(f"#   {'DDP - (plain + raw)':22s}" + "".join(f"{t:+10.3f}" for t in ex))
    sink.write({"bench": "torch", "op": "D5", "model": name, "ranks": g.size, "batch": batch,
                "bucket_mb": bucket_mb, **res})
    res["met"] = bool(summarize(sink, "D5", eff, part="efficiency", ranks=g.size, variant=name,
                                efficiency_gloo=res.get("efficiency_gloo"), machine_bound=res["bound"],
                                ceiling_no_overlap=res.get("ceiling"),
                                ceiling_raw_step=res.get("ceiling_step")))
    res["met"] &= bool(summarize(sink, "D5", res["overhead"], part="overhead", ranks=g.size, variant=name))
    return res


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hpcdp.bench torch",
        description="D5: torch models (CNN, MLP 784-1024-1024-10) under hpcdp.DDP against plain "
                    "torch (weak scaling, adapter overhead) and torch's DDP over gloo. Run under "
                    "'mpirun -n 2 --bind-to core'.")
    p.add_argument("--trials", type=int, default=7, help="interleaved trials per figure")
    p.add_argument("--iters", type=int, default=10, help="timed steps per trial")
    p.add_argument("--batch", type=int, default=64, help="samples per rank")
    p.add_argument("--models", default="cnn,mlp", help="comma-separated subset of cnn,mlp")
    p.add_argument("--no-gloo", action="store_true", help="skip torch's DDP over gloo")
    p.add_argument("--bucket-mb", type=float, default=25.0,
                   help="bucket_cap_mb of both DDPs (default 25, torch's and hpcdp's default)")
    p.add_argument("--breakdown", type=int, default=20, metavar="STEPS",
                   help="steps of the per-phase breakdown (0: none; needs MPI and 2+ ranks)")
    p.add_argument("--json", default=None, help="append JSON lines to this file")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run D5 for each model; print the figures with their targets."""
    p = parser()
    args = p.parse_args(argv)
    if min(args.trials, args.iters, args.batch) < 1:
        p.error("--trials, --iters and --batch must be >= 1")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not models or set(models) - {"cnn", "mlp"}:
        p.error(f"--models: choose from cnn,mlp, got {args.models!r}")
    import torch

    torch.set_num_threads(1)
    g = hpcdp.init()
    dist = None
    if not args.no_gloo and g.size > 1:
        import torch.distributed as dist

        port = g.broadcast_object(_free_port() if g.rank == 0 else None, 0)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=g.rank,
                                world_size=g.size)
    sink = JsonSink(args.json if g.rank == 0 else None)
    if g.rank == 0:
        print(f"# hpcdp torch benchmark (D5): {g.size} {g.backend.name} ranks, torch {torch.__version__}, "
              f"1 torch thread per rank, {args.trials} interleaved trials x {args.iters} steps")
    ok = True
    for name in models:
        res = bench_model(torch, dist, g, name, args.batch, args.iters, args.trials, sink, args.bucket_mb,
                          max(0, args.breakdown))
        ok &= res["met"]
    if g.rank == 0:
        print(f"# targets {'met' if ok else 'NOT met'}")
    sink.close()
    if dist is not None:
        dist.destroy_process_group()
    return 0

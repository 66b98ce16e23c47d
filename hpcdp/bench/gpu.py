"""``mpirun -n 2 python -m hpcdp.bench gpu``: A6, host-staging overhead, DDP/FSDP on cupy vs numpy.

- **A6** (PERF.md): ``hpcdp.allreduce`` on cupy arrays against the best the same MPI library does
  with the same device buffers: mpi4py's ``Allreduce`` on them where MPI is CUDA-aware, else a
  hand-written host-staged copy (device-to-pinned, ``Allreduce`` on the host, pinned-to-device)
  on the same pinned buffers. Ratio = baseline time / hpcdp time (busbw ratio), judged at the worst
  size >= 1 MiB against A6 of ``_targets``.
- **Staging overhead**: the same cupy allreduce against hpcdp's allreduce of the same bytes
  already on the host (numpy): what a step pays for its gradients living on the device. Beside it,
  hpcdp's host allreduce against mpi4py's, so a miss of A6 shows whether the copies or the host
  algorithm cost the time.
- **Training**: step time of the digits-style MLP (784-1024-1024-10, batch 64 per rank) under
  DDP and FSDP full_shard with cupy parameters against numpy on this machine's CPU.

Run without a GPU (``--array stand-in``), every part runs on the numpy-backed stand-in
(``hpcdp.testing.cupy_stand_in``): the figures mean nothing there, the code paths are the same,
which is what ``make test`` checks.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import numpy as np

import hpcdp

from ._common import JsonSink, fmt_size, interleaved, iters_for, judged, summarize, time_loop
from ._targets import target


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hpcdp.bench gpu", description=__doc__.splitlines()[0])
    p.add_argument("--array", choices=("cupy", "stand-in"), default="cupy",
                   help="real cupy (a GPU), or the numpy-backed stand-in (a dry run)")
    p.add_argument("--sizes", default="4096,65536,1048576,16777216,67108864",
                   help="bytes per allreduce, comma-separated")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--min-time", type=float, default=0.05, help="seconds per timed loop")
    p.add_argument("--steps", type=int, default=20, help="training steps per timed trial")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--skip-training", action="store_true")
    p.add_argument("--json", default=None, help="append JSON lines here")
    return p.parse_args(argv)


def _array_module(kind: str) -> Any:
    from ..testing.cupy_stand_in import array_module, install_stand_in

    return install_stand_in() if kind == "stand-in" else array_module("cupy")


def _allreduce_rows(cp: Any, args: argparse.Namespace, sink: JsonSink) -> list[dict[str, Any]]:
    from mpi4py import MPI

    group = hpcdp.get_default_group()
    comm = group.backend.native_comm()
    if comm is None:
        raise SystemExit("bench gpu: A6 needs the MPI backend (run under mpirun)")
    n = group.size
    from ..backends.mpi import cuda_aware, describe

    aware = cuda_aware()
    stream = cp.cuda.get_current_stream()
    if hpcdp.rank() == 0:
        print(f"# MPI: {MPI.Get_library_version().splitlines()[0].strip()}")
        print(f"# {describe()}")
        print(f"# A6 baseline: {'mpi4py Allreduce on the cupy arrays' if aware else 'hand-staged copy: get -> Allreduce -> set on pinned buffers'}")
        print("# hpcdp: cupy allreduce; base: A6 baseline; A6 = base/hpcdp; hpcdp-np: hpcdp on host numpy;"
              " mpi4py-np: Allreduce on host numpy; staging = hpcdp/hpcdp-np")
        print(f"# {'size':>10} {'hpcdp(us)':>11} {'base(us)':>10} {'A6':>6} {'hpcdp-np':>10} "
              f"{'mpi4py-np':>10} {'staging x':>9} {'busbw GB/s':>10}")
    rows = []
    for nbytes in [int(s) for s in args.sizes.split(",") if s]:
        count = max(1, nbytes // 4)
        x = cp.asarray(np.ones(count, np.float32))
        y = cp.empty_like(x) if hasattr(cp, "empty_like") else cp.asarray(np.empty(count, np.float32))
        hx, hy = np.ones(count, np.float32), np.empty(count, np.float32)
        pin_x, pin_y = _pinned(count), _pinned(count)

        def sync() -> None:
            stream.synchronize()
            comm.Barrier()

        def cand_op() -> None:
            hpcdp.allreduce(x, out=y)

        if aware:
            def base_op() -> None:
                stream.synchronize()
                comm.Allreduce(x, y, op=MPI.SUM)
        else:
            def base_op() -> None:
                x.get(out=pin_x, stream=stream)
                stream.synchronize()
                comm.Allreduce(pin_x, pin_y, op=MPI.SUM)
                y.set(pin_y, stream=stream)
                stream.synchronize()

        def host_op() -> None:
            comm.Allreduce(hx, hy, op=MPI.SUM)

        def host_hpcdp_op() -> None:
            hpcdp.allreduce(hx, out=hy)

        for op in (cand_op, base_op, host_op, host_hpcdp_op):  # warm-up: pools, pinned pages, algorithm choice
            op()
        sync()
        t0 = time.perf_counter()
        cand_op()
        sync()
        iters = int(comm.allreduce(iters_for(time.perf_counter() - t0, args.min_time), op=MPI.MIN))

        def timed(op: Any) -> Any:
            return lambda: comm.allreduce(time_loop(op, iters, sync), op=MPI.MAX)

        t = interleaved(timed(base_op), timed(cand_op), args.trials)
        h = interleaved(timed(host_hpcdp_op), timed(cand_op), args.trials)
        m = interleaved(timed(host_op), timed(host_hpcdp_op), args.trials)
        a6 = statistics.median(b / c for b, c in zip(t.base, t.cand))
        staging = h.median_ratio  # what staging adds to hpcdp's own host path
        busbw = nbytes / t.cand_median * 2 * (n - 1) / n / 1e9
        row = {"bench": "gpu", "id": "A6", "size": nbytes, "ranks": n, "cuda_aware": aware,
               "time_us": t.cand_median * 1e6, "base_time_us": t.base_median * 1e6, "a6": a6,
               "a6_trials": [b / c for b, c in zip(t.base, t.cand)], "hpcdp_host_time_us": h.base_median * 1e6,
               "mpi4py_host_time_us": m.base_median * 1e6, "host_ratio": m.median_ratio,
               "staging_overhead": staging, "busbw_gbs": busbw, "target": target("A6").bound}
        rows.append(row)
        if hpcdp.rank() == 0:
            sink.write(row)
            print(f"  {fmt_size(nbytes):>10} {row['time_us']:>11.1f} {row['base_time_us']:>10.1f} "
                  f"{a6:>6.3f} {row['hpcdp_host_time_us']:>10.1f} {row['mpi4py_host_time_us']:>10.1f} "
                  f"{staging:>9.2f} {busbw:>10.3f}", flush=True)
    return rows


def _pinned(count: int) -> np.ndarray:
    try:
        import cupyx

        return cupyx.empty_pinned((count,), np.float32)
    except ImportError:
        return np.empty(count, np.float32)


def _step_time(xp: Any, strategy: str, args: argparse.Namespace) -> Any:
    """A function timing ``args.steps`` training steps (seconds per step), on ``xp``."""
    from .. import nn, optim

    rng = np.random.default_rng(hpcdp.rank())
    model = nn.Sequential(nn.Linear(784, args.hidden, seed=1), nn.ReLU(),
                          nn.Linear(args.hidden, args.hidden, seed=2), nn.ReLU(),
                          nn.Linear(args.hidden, 10, seed=3))
    if xp is not np:
        model.to("cuda")
    wrapped = hpcdp.DDP(model) if strategy == "ddp" else hpcdp.FSDP(model, strategy=strategy)
    opt = optim.SGD(wrapped.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    x = xp.asarray(rng.standard_normal((64, 784)).astype(np.float32))
    y = xp.asarray(rng.integers(0, 10, 64))
    sync = (lambda: xp.cuda.get_current_stream().synchronize()) if xp is not np else (lambda: None)

    def step() -> None:
        loss_fn(wrapped(x), y)
        wrapped.backward(loss_fn.backward())
        opt.step()
        opt.zero_grad()

    step()
    sync()

    def run() -> float:
        hpcdp.barrier()
        t = time_loop(step, args.steps, sync)
        return float(hpcdp.allreduce(np.array([t]), "max")[0])

    return run


def _training_rows(cp: Any, args: argparse.Namespace, sink: JsonSink) -> list[dict[str, Any]]:
    rows = []
    if hpcdp.rank() == 0:
        print(f"# training step, MLP 784-{args.hidden}-{args.hidden}-10, batch 64 per rank, "
              f"{hpcdp.world_size()} ranks: cupy vs numpy (CPU)")
        print(f"# {'strategy':>12} {'numpy(ms)':>10} {'cupy(ms)':>10} {'cupy/numpy':>10}")
    for strategy in ("ddp", "full_shard"):
        t = interleaved(_step_time(np, strategy, args), _step_time(cp, strategy, args), args.trials)
        row = {"bench": "gpu", "id": "train", "strategy": strategy, "ranks": hpcdp.world_size(),
               "numpy_ms": t.base_median * 1e3, "cupy_ms": t.cand_median * 1e3,
               "ratio": t.median_ratio}
        rows.append(row)
        if hpcdp.rank() == 0:
            sink.write(row)
            print(f"  {strategy:>12} {row['numpy_ms']:>10.2f} {row['cupy_ms']:>10.2f} {row['ratio']:>10.3f}",
                  flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    cp = _array_module(args.array)
    hpcdp.init()
    sink = JsonSink(args.json if hpcdp.rank() == 0 else None)
    try:
        rows = _allreduce_rows(cp, args, sink)
        big = [r["a6"] for r in rows if r.get("id") == "A6" and r["size"] >= 1 << 20]
        if big and hpcdp.rank() == 0:
            summarize(sink, "A6", min(big), ranks=hpcdp.world_size(), sizes=len(big))
            print(f"# A6 (>= 1 MiB, worst size): {min(big):.3f} ({judged('A6', '', min(big))})")
        if not args.skip_training:
            rows += _training_rows(cp, args, sink)
    finally:
        sink.close()
    if hpcdp.rank() == 0:
        print("# json " + json.dumps({"rows": len(rows)}))
    hpcdp.finalize()
    return 0

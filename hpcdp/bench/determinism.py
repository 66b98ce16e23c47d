"""``python -m hpcdp.bench determinism``: H1, H2 of PERF.md, and the bit-for-bit check.

Three parts (``--part``; default all that apply where it runs):

* ``check`` (a driver, not under mpirun): trains the GPT example (``examples/03_fsdp_gpt.py``)
  for ``--steps`` steps on a global batch of ``--global-batch`` windows with
  ``--deterministic-chunk`` on several world sizes, launchers (simulated ranks in this process,
  ``hpcdp-run`` TCP processes, ``mpirun``) and layers (DDP, DDP + ZeRO-1, FSDP strategies), and
  prints the SHA-256 of the final parameters of each: the same hash in every row is the
  property. Every run has one BLAS thread per rank (the README says why).
* ``H1`` (under ``mpirun -n 2``): the GPT example's training step with
  ``deterministic_chunk=2`` against the same step with the mode off, same world size, one
  process, interleaved trials (target: ``_targets``' H1).
* ``H2`` (under ``mpirun -n 2``): deterministic allreduce busbw against the plain allreduce on
  the same buffers, 1-16 MiB, float64 and float32 (target: H2, at the worst size), with one row
  per rank and with two (the general path; see ``part_h2``), and the bytes each moves.

    python -m hpcdp.bench determinism --part check
    OMP_NUM_THREADS=1 mpirun -n 2 --bind-to core python -m hpcdp.bench determinism --part H1,H2

A missed H1 or H2 is printed and written (``--json``), not an exit status (as every benchmark);
hashes that differ in ``check`` are a broken property, and exit 1.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os
import pathlib
import re
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

import hpcdp

from ._common import JsonSink, fmt_size, interleaved, judged, summarize, time_loop

__all__ = ["main"]

_EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "03_fsdp_gpt.py"
_ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _example() -> Any:
    if not _EXAMPLE.exists():
        raise SystemExit(f"determinism: the GPT example is not at {_EXAMPLE} (a source checkout has it)")
    spec = importlib.util.spec_from_file_location("gpt_example", _EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


# -- check: the hashes ------------------------------------------------------------------------
def _example_args(args: argparse.Namespace, layer: str, n: int) -> list[str]:
    parallel, _, option = layer.partition(":")
    out = ["--steps", str(args.steps), "--global-batch", str(args.global_batch),
           "--deterministic-chunk", str(args.chunk), "--dropout", str(args.dropout), "--sha",
           "--no-progress", "--no-ckpt", "--eval-windows", "4", "--parallel", parallel]
    if option:   # fsdp:STRATEGY, ddp:BUCKET_MB
        out += ["--strategy", option] if parallel == "fsdp" else ["--bucket-mb", option]
    if option == "hybrid_shard":   # shard groups of 2 ranks, replicated across them
        out += ["--shard-size", str(2 if n % 2 == 0 else 1)]
    return out + args.example_args.split()


def _sha_of(text: str) -> str | None:
    found = re.findall(r"parameters sha256 ([0-9a-f]{64})", text)
    return found[-1] if found else None


def _run_sim(args: argparse.Namespace, layer: str, n: int) -> str | None:
    gpt = _example()
    os.environ["HPCDP_DETERMINISTIC"] = "1"
    try:
        with contextlib.redirect_stdout(io.StringIO()):   # the ranks' own printing
            res = hpcdp.spawn(lambda r: gpt.main(_example_args(args, layer, n)), world_size=n,
                              backend="sim", timeout=600)
    finally:
        os.environ.pop("HPCDP_DETERMINISTIC", None)
    return res[0]["sha256"]


def _run_proc(cmd: list[str]) -> tuple[str | None, str]:
    env = {**os.environ, **_ONE_THREAD, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    text = proc.stdout + proc.stderr
    return (_sha_of(text) if proc.returncode == 0 else None), text


def part_check(args: argparse.Namespace, sink: JsonSink | None = None) -> bool:
    """Train on every (launcher, world size, layer); True when every hash agrees."""
    # this process's BLAS too: simulated ranks share it
    try:
        from threadpoolctl import threadpool_limits
        threadpool_limits(1)
    except ImportError:
        if os.environ.get("OPENBLAS_NUM_THREADS") != "1":
            print("# note: simulated ranks use this process's BLAS threads; set "
                  "OPENBLAS_NUM_THREADS=1 for hashes comparable with mpirun's", flush=True)
    py = sys.executable
    rows: list[tuple[str, int, str, str | None, float]] = []
    for launcher in args.launchers.split(","):
        for n in [int(v) for v in args.worlds.split(",")]:
            if args.global_batch % (args.chunk * n):
                continue
            for layer in args.layers.split(","):
                t0 = time.perf_counter()
                if launcher == "sim":
                    sha: str | None = _run_sim(args, layer, n)
                    text = ""
                elif launcher == "tcp":
                    sha, text = _run_proc([py, "-m", "hpcdp.run", "-n", str(n), str(_EXAMPLE),
                                           *_example_args(args, layer, n)])
                else:
                    sha, text = _run_proc(["mpirun", "--oversubscribe", "-n", str(n), py, "-m", "hpcdp.run",
                                           str(_EXAMPLE), *_example_args(args, layer, n)])
                dt = time.perf_counter() - t0
                rows.append((launcher, n, layer, sha, dt))
                print(f"{launcher:>4} {n:>2} ranks  {layer:<22} {sha or 'FAILED'}  ({dt:.1f} s)", flush=True)
                if sha is None and text:
                    print("\n".join(text.splitlines()[-15:]), flush=True)
    hashes = {r[3] for r in rows}
    ok = len(hashes) == 1 and None not in hashes
    print(f"# check: {len(rows)} runs, {len(hashes)} distinct hash(es): "
          f"{'bit-identical' if ok else 'DIFFERENT'} (target: one hash)", flush=True)
    if sink is not None:   # a property, not a PERF.md figure: no summary record
        sink.write({"bench": "determinism", "part": "check", "runs": len(rows), "hashes": len(hashes),
                    "bit_identical": ok,
                    "rows": [{"launcher": a, "ranks": n, "layer": la, "sha256": h, "seconds": dt}
                             for a, n, la, h, dt in rows]})
    return ok


# -- H1: the step ------------------------------------------------------------------------------
def part_h1(args: argparse.Namespace, g: Any, sink: JsonSink) -> bool:
    """GPT example step, deterministic_chunk=2 vs off, same ranks, interleaved."""
    from .. import nn, optim
    from ..fsdp import FSDP

    gpt = _example()
    n, r = g.size, g.rank
    batch = args.global_batch
    text = np.random.default_rng(1).integers(0, 100, 100_000)

    def build(chunk: int | None) -> tuple[Any, Any]:
        nn.manual_seed(0)
        model = gpt.GPT(100, 64, 64, 4, 4, 0)
        par = (FSDP(model, auto_wrap={gpt.Block}, deterministic_chunk=chunk) if args.layer == "fsdp"
               else hpcdp.DDP(model, deterministic_chunk=chunk))
        return par, optim.AdamW(par.parameters(), lr=1e-3)

    plain, chunked = build(None), build(args.chunk)
    loss_fn = nn.CrossEntropyLoss()
    step_no = [0]

    def step(pair: tuple[Any, Any]) -> None:
        par, opt = pair
        starts = np.random.default_rng([3, step_no[0]]).integers(0, len(text) - 65, batch)
        x, y = gpt.windows(text, starts, 64)
        lo, hi = r * batch // n, (r + 1) * batch // n
        loss_fn(par(x[lo:hi]), y[lo:hi])
        par.backward(loss_fn.backward())
        if args.layer == "fsdp":
            par.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        step_no[0] += 1

    def timed(pair: tuple[Any, Any]) -> float:
        return time_loop(lambda: step(pair), args.iters, sync=g.barrier)

    for pair in (plain, chunked):
        step(pair)   # warm-up
    t = interleaved(lambda: timed(plain), lambda: timed(chunked), args.trials)
    ratio = t.median_ratio
    if r == 0:
        print(f"# H1 {args.layer} GPT step, {n} ranks, global batch {batch}, chunks of {args.chunk}: "
              f"off {t.base_median * 1e3:.1f} ms, deterministic {t.cand_median * 1e3:.1f} ms, "
              f"median ratio {ratio:.3f} ({judged('H1', '', ratio)}); per-trial "
              f"{[round(v, 3) for v in t.ratios]}", flush=True)
    sink.write({"bench": "determinism", "op": "H1", "layer": args.layer, "ranks": n, "global_batch": batch,
                "chunk": args.chunk, "off_ms": t.base_median * 1e3, "det_ms": t.cand_median * 1e3,
                "ratio": ratio, "trials": t.ratios})
    return bool(summarize(sink, "H1", ratio, ranks=n, variant=args.layer, trials=t.ratios))


# -- H2: the collective ------------------------------------------------------------------------
def part_h2(args: argparse.Namespace, g: Any, sink: JsonSink) -> bool:
    """Deterministic allreduce busbw vs plain on the same buffers, two ways:

    - one row per rank (the allreduce itself). With two ranks this is at most two summands,
      which ``sum_rows`` adds plainly: one IEEE addition is already the exact sum correctly
      rounded, in either order, so only the block codes travel beside the data;
    - two rows per rank (``deterministic_chunk``'s gradients: four summands on two ranks), the
      general blocked path; its baseline adds the two rows locally, then the plain allreduce.
    """
    from ..comm import reproducible

    sizes = [int(float(v) * (1 << 20)) for v in args.sizes.split(",")]
    worst: dict[str, float] = {}
    phases: list[str] = []
    if g.rank == 0:
        print(f"# H2 deterministic allreduce vs plain (busbw ratio; {judged('H2')})", flush=True)
        print(f"# {'size':>8} {'dtype':>8} {'rows':>4} {'plain us':>10} {'exact us':>10} {'ratio':>7}  "
              "wire bytes/elem sent (det vs plain)", flush=True)
    for rows in [int(v) for v in args.rows.split(",")]:
        for dtype in (np.float64, np.float32):
            for nbytes in sizes:
                count = nbytes // np.dtype(dtype).itemsize
                rng = np.random.default_rng(g.rank)
                x = rng.standard_normal((rows, count)).astype(dtype)
                out = np.empty(count, dtype)
                local = np.empty(count, dtype)
                iters = max(3, int(args.iters * (1 << 20) / nbytes * 4))

                def plain() -> float:
                    if rows == 1:
                        return time_loop(lambda: g.allreduce(x[0], out=out), iters, sync=g.barrier)

                    def both() -> None:
                        np.add(x[0], x[1], out=local)
                        g.allreduce(local, out=out)
                    return time_loop(both, iters, sync=g.barrier)

                def det() -> float:
                    return time_loop(lambda: reproducible.sum_rows(g, x, out=out), iters, sync=g.barrier)

                t = interleaved(plain, det, args.trials)
                ratio = 1.0 / t.median_ratio   # busbw ratio = time ratio inverted
                # where the time goes: one more loop with the steps' clocks on (rank 0's)
                reproducible.record_phases(True)
                time_loop(lambda: reproducible.sum_rows(g, x, out=out), iters, sync=g.barrier)
                steps = reproducible.record_phases(False)
                sent = steps.pop("bytes", 0.0) / iters / count   # wire bytes per element, as sent
                phases.append(f"  {fmt_size(nbytes):>8} {np.dtype(dtype).name:>8} {rows:>4}  "
                              + ", ".join(f"{k} {v / iters * 1e6:.0f}" for k, v in steps.items())
                              + f"; {sent:.2f} bytes/elem sent")
                name = np.dtype(dtype).name
                variant = name if rows == 1 else f"{name}, {rows} rows per rank"
                worst[variant] = min(worst.get(variant, ratio), ratio)
                item = np.dtype(dtype).itemsize
                # what each rank hands its exchanges per element (block codes, about 4 KiB per
                # MiB, included), as counted: the data in its own dtype where the sum is one
                # addition; else float64 values (float32 data) or a float32 hi and a float64 lo
                # (float64 data), plus 8 per element of the few blocks that need two halves
                one = rows * g.size <= 2
                wire = round(sent, 2)
                sink.write({"bench": "determinism", "op": "H2", "ranks": g.size, "rows": rows,
                            "size": nbytes, "dtype": name, "plain_us": t.base_median * 1e6,
                            "det_us": t.cand_median * 1e6, "busbw_ratio": ratio,
                            "wire_bytes_per_elem": wire, "data_bytes_per_elem": item})
                if g.rank == 0:
                    print(f"  {fmt_size(nbytes):>8} {name:>8} {rows:>4} {t.base_median * 1e6:>10.0f} "
                          f"{t.cand_median * 1e6:>10.0f} {ratio:>7.3f}  {wire:.2f} vs {item}"
                          + (" (one addition)" if one else ""), flush=True)
    if g.rank == 0:
        print("# H2 steps of the deterministic sum, us per call (rank 0; their sum is below the "
              "call's time by the Python between them):", flush=True)
        print("\n".join(phases), flush=True)
    ok = True
    for name, v in worst.items():   # a figure per dtype: its worst size (the bound holds at every size)
        ok &= bool(summarize(sink, "H2", v, ranks=g.size, variant=name))
    if g.rank == 0:
        print("# H2 worst size: " + ", ".join(f"{k} {v:.3f}" for k, v in worst.items())
              + f" ({judged('H2', '', min(worst.values()))})", flush=True)
    return ok


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hpcdp.bench determinism",
                                description="H1, H2 and the bit-for-bit check of deterministic mode")
    p.add_argument("--part", default=None, help="check, H1, H2 (default: check outside mpirun, H1,H2 under it)")
    p.add_argument("--steps", type=int, default=20, help="check: optimizer steps")
    p.add_argument("--global-batch", type=int, default=16, help="windows per step over all ranks")
    p.add_argument("--chunk", type=int, default=2, help="deterministic_chunk")
    p.add_argument("--dropout", type=float, default=0.1, help="check: dropout in the GPT (keyed masks)")
    p.add_argument("--worlds", default="1,2,4", help="check: world sizes")
    p.add_argument("--launchers", default="sim,tcp,mpi", help="check: sim, tcp (hpcdp-run), mpi (mpirun)")
    p.add_argument("--layers", default="ddp,ddp:0.05,zero1,fsdp:full_shard,fsdp:shard_grad_op",
                   help="check: ddp[:BUCKET_MB], zero1, fsdp:STRATEGY")
    p.add_argument("--example-args", default="",
                   help="check: more options for the example (a quick run: '--dim 16 --layers 1 --context 16')")
    p.add_argument("--layer", default="fsdp", choices=["fsdp", "ddp"], help="H1: the example's FSDP or DDP")
    p.add_argument("--trials", type=int, default=5, help="H1, H2: interleaved trials per figure")
    p.add_argument("--iters", type=int, default=5, help="H1: steps per trial; H2: calls per trial at 1 MiB")
    p.add_argument("--sizes", default="1,4,16", help="H2: sizes in MiB")
    p.add_argument("--rows", default="1,2",
                   help="H2: rows per rank (1: the allreduce itself; 2: the general path)")
    p.add_argument("--json", default=None, help="append JSON lines here (rank 0's)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    under_mpi = any(v in os.environ for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"))
    parts = {s.strip().upper() for s in (args.part or ("H1,H2" if under_mpi else "CHECK")).split(",")}
    ok = True
    same = True
    if "CHECK" in parts:
        sink = JsonSink(args.json)
        same = part_check(args, sink)
        sink.close()
    if parts & {"H1", "H2"}:
        g = hpcdp.init()
        sink = JsonSink(args.json if g.rank == 0 else None)
        if "H2" in parts:
            ok &= part_h2(args, g, sink)
        if "H1" in parts:
            ok &= part_h1(args, g, sink)
        sink.close()
    if not parts & {"H1", "H2"} or hpcdp.rank() == 0:
        print(f"# targets {'met' if ok and same else 'NOT met'}", flush=True)
    return 0 if same else 1

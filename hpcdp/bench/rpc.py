"""RPC benchmarks against raw point-to-point on the same backend, in the same run.

R1  ``rpc_sync`` round trip of a no-op against a ``send``/``recv`` ping-pong of 8 bytes
    (target: R1 of ``_targets``, on MPI and TCP): mean over a loop, and the median of single calls.
R2  64 ``rpc_async`` calls in flight, each carrying a 1 MiB array to a callee that drops it,
    against 64 ``isend``/``irecv`` of the same buffers (target: R2, a share of the raw rate).
    The raw side receives into arrays allocated once; RPC receives into buffers it reuses once
    a callee has let go of them (``hpcdp.rpc._wire.RECV_BUFFERS``): into fresh memory each
    message would also pay its page faults, which on shared memory halve the rate or worse.

Trials alternate baseline and RPC (``_common.interleaved``); figures are medians.

    mpirun -n 2 python -m hpcdp.bench rpc          # MPI
    python -m hpcdp.bench rpc --backend tcp         # two local TCP ranks (also: sim)
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from typing import Any, Sequence

import numpy as np

from ._targets import target

__all__ = ["main", "run"]


_DONE = threading.Event()


def _noop() -> None:
    return None


def _done() -> None:
    _DONE.set()


def _serve_until_done(rank: int) -> None:
    """Rank 1 during an RPC phase: idle (blocked, not polling a collective, which would keep
    the interpreter from the threads serving the calls) until rank 0 says it is done."""
    import hpcdp.rpc as rpc

    if rank == 0:
        rpc.rpc_sync(1, "bench.done")
    else:
        _DONE.wait(600)
        _DONE.clear()


def _sink(a: Any) -> None:
    return None


def _registered() -> None:
    import hpcdp.rpc as rpc

    for fn, name in ((_noop, "bench.noop"), (_sink, "bench.sink"), (_done, "bench.done")):
        rpc.register(fn, name=name)


def _r1(rank: int, iters: int, trials: int) -> dict[str, Any]:
    """Mean time per round trip over a loop, and the median of each round trip timed alone
    (on a loaded machine the mean carries the scheduler's stalls of either side)."""
    import hpcdp
    import hpcdp.rpc as rpc
    from ._common import interleaved

    g = hpcdp.get_default_group()
    buf = np.zeros(1, np.float64)
    each: dict[str, list[float]] = {"base": [], "cand": []}

    def base() -> float:
        g.barrier()
        times = []
        t0 = time.perf_counter()
        for _ in range(iters):
            t = time.perf_counter()
            if rank == 0:
                g.send(buf, 1)
                g.recv(buf, 1)
            else:
                g.recv(buf, 0)
                g.send(buf, 0)
            times.append(time.perf_counter() - t)
        dt = (time.perf_counter() - t0) / iters
        each["base"].append(statistics.median(times))
        return dt

    def cand() -> float:
        g.barrier()
        times = []
        t0 = time.perf_counter()
        if rank == 0:
            for _ in range(iters):
                t = time.perf_counter()
                rpc.rpc_sync(1, "bench.noop")
                times.append(time.perf_counter() - t)
        dt = (time.perf_counter() - t0) / iters
        each["cand"].append(statistics.median(times) if times else 0.0)
        _serve_until_done(rank)
        return dt

    for _ in range(max(1, iters // 10)):  # warm-up: threads started, paths hot
        if rank == 0:
            rpc.rpc_sync(1, "bench.noop")
    t = interleaved(base, cand, trials)
    p50 = [c / b for b, c in zip(each["base"], each["cand"])]
    return {"bench": "R1", "op": "rpc_sync no-op round trip", "base_us": t.base_median * 1e6,
            "rpc_us": t.cand_median * 1e6, "ratio": t.median_ratio,
            "base_p50_us": statistics.median(each["base"]) * 1e6,
            "rpc_p50_us": statistics.median(each["cand"]) * 1e6,
            "ratio_p50": statistics.median(p50), "target": target("R1").text}


def _r2(rank: int, window: int, nbytes: int, rounds: int, trials: int) -> dict[str, Any]:
    import hpcdp
    import hpcdp.rpc as rpc
    from ._common import interleaved, pretouch

    g = hpcdp.get_default_group()
    bufs = [np.full(nbytes // 4, i, np.float32) for i in range(window)]
    pretouch(*bufs)
    ack = np.zeros(1, np.int64)

    def base() -> float:
        g.barrier()
        t0 = time.perf_counter()
        for _ in range(rounds):
            if rank == 0:
                works = [g.isend(b, 1, tag=i) for i, b in enumerate(bufs)]
                for w in works:
                    w.wait()
                g.recv(ack, 1)
            else:
                works = [g.irecv(b, 0, tag=i) for i, b in enumerate(bufs)]
                for w in works:
                    w.wait()
                g.send(ack, 0)
        return (time.perf_counter() - t0) / rounds

    def cand() -> float:
        g.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            for _ in range(rounds):
                futs = [rpc.rpc_async(1, "bench.sink", args=(b,)) for b in bufs]
                for f in futs:
                    f.wait()
        dt = (time.perf_counter() - t0) / rounds
        _serve_until_done(rank)
        return dt

    t = interleaved(base, cand, trials)
    per_round = window * nbytes
    base_gbs = per_round / t.base_median / 1e9
    rpc_gbs = per_round / t.cand_median / 1e9
    return {"bench": "R2", "op": f"{window} rpc_async of {nbytes >> 20} MiB in flight",
            "base_gbs": base_gbs, "rpc_gbs": rpc_gbs,
            "ratio": statistics.median(b / c for b, c in zip(t.base, t.cand)), "target": target("R2").text}


def run(rank: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Both benchmarks on this rank of a 2-rank job (ranks beyond 1 only join the barriers)."""
    import hpcdp
    import hpcdp.rpc as rpc

    _registered()
    rpc.init_rpc(f"bench{rank}", rpc_timeout=120)
    backend = hpcdp.get_default_group().backend.name
    rows = [_r1(rank, cfg["iters"], cfg["trials"]),
            _r2(rank, cfg["window"], cfg["mib"] << 20, cfg["rounds"], cfg["trials"])]
    rpc.shutdown()
    for r in rows:
        r.update(backend=backend, ranks=hpcdp.world_size())
    return rows


def _print(rows: Sequence[dict[str, Any]]) -> None:
    from ._common import judged

    for r in rows:
        if r["bench"] == "R1":
            print(f"# R1 {r['backend']}: rpc_sync no-op {r['rpc_us']:.1f} us, send/recv round "
                  f"trip {r['base_us']:.1f} us: ratio {r['ratio']:.2f} ({judged('R1', '', r['ratio'])}); "
                  f"per-call medians {r['rpc_p50_us']:.1f} / {r['base_p50_us']:.1f} us: ratio "
                  f"{r['ratio_p50']:.2f}")
        else:
            print(f"# R2 {r['backend']}: {r['op']}: {r['rpc_gbs']:.3f} GB/s, raw p2p "
                  f"{r['base_gbs']:.3f} GB/s: ratio {r['ratio']:.2f} ({judged('R2', '', r['ratio'])})")
    sys.stdout.flush()


def parser() -> argparse.ArgumentParser:
    """Options of R1 and R2."""
    p = argparse.ArgumentParser(prog="python -m hpcdp.bench rpc", description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=["auto", "mpi", "tcp", "sim"], default="auto",
                   help="auto: mpi under mpirun/srun, else tcp (two local ranks)")
    p.add_argument("--trials", type=int, default=5, help="interleaved raw/RPC trials")
    p.add_argument("--iters", type=int, default=1000, help="R1 round trips per trial")
    p.add_argument("--window", type=int, default=64, help="R2 calls in flight")
    p.add_argument("--mib", type=int, default=1, help="R2 array size in MiB")
    p.add_argument("--rounds", type=int, default=4, help="R2 windows per trial")
    p.add_argument("--json", default=None, help="append JSON lines here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hpcdp.bench rpc [--backend mpi|tcp|sim] [--trials N] [--json PATH]``."""
    a = parser().parse_args(list(argv) if argv is not None else None)
    import hpcdp
    from hpcdp.comm.world import detect_backend

    from ._common import JsonSink, summarize

    cfg = {"iters": a.iters, "trials": a.trials, "window": a.window, "mib": a.mib,
           "rounds": a.rounds}
    backend = a.backend if a.backend != "auto" else ("mpi" if detect_backend() == "mpi" else "tcp")
    if backend == "mpi":
        hpcdp.init("mpi")
        if hpcdp.world_size() < 2:
            print("rpc bench: needs at least 2 ranks (mpirun -n 2)", file=sys.stderr)
            return 2
        rows = run(hpcdp.rank(), cfg)
        mine = hpcdp.rank() == 0
        hpcdp.finalize()
    else:
        rows = hpcdp.spawn(run, 2, backend=backend, args=(cfg,), timeout=300,
                           join_timeout=1800)[0]
        mine = True
    if mine:
        _print(rows)
        sink = JsonSink(a.json)
        for r in rows:
            sink.write(r)
        for r in rows:
            summarize(sink, r["bench"], r["ratio"], ranks=r["ranks"], variant=r["backend"],
                      **({"ratio_p50": r["ratio_p50"]} if "ratio_p50" in r else {}))
        sink.close()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())

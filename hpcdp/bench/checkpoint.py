"""``mpirun -n 2 python -m hpcdp.bench checkpoint``: G1 (save) and G2 (load) against raw MPI-IO.

The state is ``--arrays`` float32 arrays of ``--total`` bytes in all, each sharded by rows across
the ranks (every rank writes and reads its own rows). Baseline, in the same launch on the same
pre-touched buffers: ``MPI.File.Open`` + one ``Write_at_all`` per array at the same offsets +
``Sync`` + ``Close`` (G1), and ``Read_at_all`` of the same bytes into pre-touched buffers (G2).
The checkpoint save includes everything ``save`` does (plan checks, CRC32s, fsync of the files and
the directory, rename). G2 is reported twice: reading a file just written (page cache), and after
``posix_fadvise(DONTNEED)`` evicted both files' pages before each trial (from the device). The
judged load is ``load(out=)`` into pre-touched arrays, like for like with the baseline (as a
restart loads into the model it built). It also prints, not judged, ``load(like=)``, which
returns new arrays, against ``Read_at_all`` into fresh arrays (their first touch is in both).
Trials alternate baseline and candidate; the figure is the median of the per-trial time ratios,
each trial timed as the slowest rank's time between two barriers. ``--only load`` runs G2 alone
(``--only save``: G1); ``--breakdown`` then also prints where a page-cache ``load(out=)`` spends
its time, per rank, from the load's own ``hpcdp.trace`` spans (open, manifest, survey, walk: the
state built, close, bulk: the large slabs read and verified, agree: the closing exchange), beside
the raw read's time.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sys
import time
from typing import Any, Callable

import numpy as np

import hpcdp

from .._config import setting
from ._common import JsonSink, Row, fmt_size, interleaved, pretouch, summarize, verdict
from ._targets import target
from ._plot import PlotSink, add_plot_argument, maybe_plot


def parser() -> argparse.ArgumentParser:
    """Options of G1 and G2."""
    p = argparse.ArgumentParser(
        prog="python -m hpcdp.bench checkpoint",
        description="G1 (save) and G2 (load) of a row-sharded state against raw MPI-IO on the same "
                    "buffers, in the same launch. Run under mpirun.")
    p.add_argument("--total", type=int, default=256 << 20, help="bytes in the whole state")
    p.add_argument("--arrays", type=int, default=4, help="float32 arrays the state is split into")
    p.add_argument("--trials", type=int, default=5, help="interleaved baseline/checkpoint trials")
    p.add_argument("--dir", default=None, help="where to write (default: ./.bench-ckpt)")
    p.add_argument("--mode", default=None, help="checkpoint mode: mpio, vds or auto")
    p.add_argument("--json", default=None, help="append JSON lines here")
    p.add_argument("--only", choices=("save", "load"), default=None,
                   help="run only G1 (save) or only G2 (load; the checkpoint is saved once)")
    p.add_argument("--breakdown", action="store_true",
                   help="also print where load(out=) from the page cache spends its time (ms per "
                        "part, per rank, from its trace spans)")
    add_plot_argument(p)
    return p


def _parse(argv: list[str]) -> argparse.Namespace:
    return parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    from mpi4py import MPI

    from hpcdp.checkpoint import Shard, load, save
    from hpcdp._arrays import shard_bounds as row_bounds  # the rows a checkpoint gives each rank

    g = hpcdp.init("mpi")
    comm = g.backend.native_comm()
    rank, n = g.rank, g.size
    root = os.path.abspath(args.dir or ".bench-ckpt")
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
    comm.Barrier()

    cols = 1024
    rows = max(n, args.total // args.arrays // (cols * 4))
    lo, hi = row_bounds(rows, n)[rank]
    bufs = [np.full((hi - lo, cols), k + rank, np.float32) for k in range(args.arrays)]
    rbufs = [np.empty_like(b) for b in bufs]
    obufs = [np.empty_like(b) for b in bufs]  # what load(out=) fills
    pretouch(*bufs, *rbufs, *obufs)
    state = {"model": {f"w{k}": Shard(b, (rows, cols), (lo, 0)) for k, b in enumerate(bufs)}, "step": 1}
    like = {"model": {f"w{k}": Shard(b, (rows, cols), (lo, 0)) for k, b in enumerate(rbufs)}, "step": 0}
    into = {"model": {f"w{k}": Shard(b, (rows, cols), (lo, 0)) for k, b in enumerate(obufs)}, "step": 0}
    total = rows * cols * 4 * args.arrays
    raw_path = os.path.join(root, "raw.bin")
    ck = os.path.join(root, "ckpt", "step-1")

    def timed(fn: Callable[[], Any], before: Callable[[], Any] | None = None) -> float:
        if before is not None:
            before()
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        comm.Barrier()
        return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)

    def raw_write() -> None:
        fh = MPI.File.Open(comm, raw_path, MPI.MODE_CREATE | MPI.MODE_WRONLY)
        for k, b in enumerate(bufs):
            fh.Write_at_all((k * rows + lo) * cols * 4, b)
        fh.Sync()
        fh.Close()

    def raw_read() -> None:
        fh = MPI.File.Open(comm, raw_path, MPI.MODE_RDONLY)
        for k, b in enumerate(rbufs):
            fh.Read_at_all((k * rows + lo) * cols * 4, b)
        fh.Close()

    def clean_raw() -> None:
        if rank == 0 and os.path.exists(raw_path):
            os.unlink(raw_path)

    def clean_ck() -> None:
        if rank == 0:
            shutil.rmtree(os.path.dirname(ck), ignore_errors=True)

    def ck_save() -> None:
        save(ck, state, mode=args.mode)

    def ck_load() -> None:
        out = load(ck, like=like)
        assert out["model"]["w0"].local[0, 0] == rank

    def ck_load_into() -> None:
        obufs[0][0, 0] = -1
        load(ck, out=into)
        assert obufs[0][0, 0] == rank and into["step"] == 1

    # warm-up (imports, first-touch of the file system paths)
    timed(raw_write, clean_raw)
    timed(ck_save, clean_ck)
    g1 = None
    if args.only != "load":
        g1 = interleaved(lambda: timed(raw_write, clean_raw), lambda: timed(ck_save, clean_ck), args.trials)
    timed(raw_write, clean_raw)
    if args.only == "save":
        _report(args, rank, n, root, total, {"G1": g1})
        comm.Barrier()
        return 0
    # one load of each first: the first read after a save may still come from the device
    timed(raw_read)
    timed(ck_load)
    timed(ck_load_into)
    g2 = interleaved(lambda: timed(raw_read), lambda: timed(ck_load_into), args.trials)

    def raw_read_fresh() -> None:
        """``Read_at_all`` into new, untouched arrays, as ``load`` must return (the page
        faults of fresh memory are in both, not in the pre-touched baseline's)."""
        fh = MPI.File.Open(comm, raw_path, MPI.MODE_RDONLY)
        for k, b in enumerate(rbufs):
            fh.Read_at_all((k * rows + lo) * cols * 4, np.empty_like(b))
        fh.Close()

    g2f = interleaved(lambda: timed(raw_read_fresh), lambda: timed(ck_load), args.trials)

    def evict() -> None:
        """Drop the files' pages from the page cache (posix_fadvise DONTNEED: no root needed)."""
        if rank != 0:
            return
        paths = [raw_path] + [os.path.join(ck, f) for f in os.listdir(ck)]
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)

    g2c = interleaved(lambda: timed(raw_read, evict), lambda: timed(ck_load_into, evict), args.trials)
    parts = None
    if args.breakdown:
        parts = _breakdown(comm, rank, root, timed, raw_read, ck_load_into, args.trials)
    _report(args, rank, n, root, total, {"G1": g1, "G2": g2, "G2 evicted": g2c, "G2 fresh": g2f}, parts)
    comm.Barrier()
    return 0


#: the load's trace spans (``hpcdp.checkpoint._reader``), in the order they run
_SPANS = ("checkpoint.open", "checkpoint.manifest", "checkpoint.survey", "checkpoint.walk",
          "checkpoint.close", "checkpoint.bulk", "checkpoint.agree")


def _breakdown(comm: Any, rank: int, root: str, timed: Callable[..., float], raw_read: Callable[[], Any],
               load_into: Callable[[], Any], trials: int) -> list[dict[str, float]] | None:
    """Per rank, the median ms of each part of a page-cache ``load(out=)`` (its trace spans; the
    rest of the call is "other"), of the whole call, and of a raw ``Read_at_all`` between them."""
    from hpcdp import trace

    tdir = os.path.join(root, "trace")
    raw, whole = [], []
    trace.enable(tdir)
    try:
        for _ in range(max(3, trials)):
            raw.append(_own_time(timed, raw_read))
            whole.append(_own_time(timed, load_into))
    finally:
        trace.disable()
    per: dict[str, list[float]] = {}
    for path in glob.glob(os.path.join(tdir, f"trace-rank{rank}.json")):
        with open(path) as fh:
            doc = json.load(fh)
        events = doc["traceEvents"] if isinstance(doc, dict) else doc
        for e in events:
            if e.get("ph") == "X" and e.get("name") in _SPANS + ("checkpoint.read",):
                per.setdefault(e["name"], []).append(float(e["dur"]) / 1e3)
    k, out = len(whole), {}
    for name, v in per.items():  # (m spans of a name per load: each load's sum)
        m = len(v) // k
        out[name] = float(np.median([sum(v[i * m:(i + 1) * m]) for i in range(k)])) if m else float("nan")
    out["load(out=) total"] = float(np.median(whole)) * 1e3
    # (medians of the parts need not add up to the median whole: "other" is approximate)
    out["other"] = out["load(out=) total"] - sum(out.get(s, 0.0) for s in _SPANS)
    out["raw Read_at_all"] = float(np.median(raw)) * 1e3
    return comm.gather(out)


def _own_time(timed: Callable[..., float], fn: Callable[[], Any]) -> float:
    """This rank's own time in ``fn`` (``timed`` reports the slowest rank's)."""
    box: list[float] = []

    def run() -> None:
        t0 = time.perf_counter()
        fn()
        box.append(time.perf_counter() - t0)

    timed(run)
    return box[0]


def _report(args: argparse.Namespace, rank: int, n: int, root: str, total: int, res: dict[str, Any],
            parts: list[dict[str, float]] | None = None) -> None:
    """Rank 0 prints (and writes to ``--json``) the results; every rank closes the sink."""
    sink = PlotSink(JsonSink(args.json if rank == 0 else None))
    if rank == 0:
        import h5py

        mode = args.mode or setting("HPCDP_CKPT_MODE")
        print(f"# hpcdp checkpoint benchmark: {n} ranks, {fmt_size(total)} in {args.arrays} sharded "
              f"float32 arrays, mode {mode}, h5py {h5py.__version__} (mpi={h5py.get_config().mpi}), "
              f"{args.trials} interleaved trials, dir {root}")
        print(f"# {'what':<40} {'base(ms)':>10} {'hpcdp(ms)':>10} {'base GB/s':>10} "
              f"{'hpcdp GB/s':>10} {'bw ratio':>9}  per-trial bw ratios")
        for name, op, key, (tid, part) in (("G1 save (+fsync) vs Write_at_all+Sync", "save", "G1", ("G1", "")),
                                           ("G2 load(out=) (page cache) vs Read_at_all", "load", "G2", ("G2", "page cache")),
                                           ("G2 load(out=) (evicted) vs Read_at_all", "load-cold", "G2 evicted", ("G2", "evicted"))):
            t = res.get(key)
            if t is None:
                continue
            goal = target(tid, part)
            ratio = 1.0 / t.median_ratio  # bandwidth ratio = baseline time / hpcdp time
            per = " ".join(f"{1 / r:.3f}" for r in t.ratios)
            print(f"  {name:<40} {t.base_median * 1e3:>10.1f} {t.cand_median * 1e3:>10.1f} "
                  f"{total / t.base_median / 1e9:>10.3f} {total / t.cand_median / 1e9:>10.3f} "
                  f"{ratio:>9.3f}  {per}")
            sink.write(Row("checkpoint", op, total, total // 4, "float32", "-", 0,
                           t.cand_median * 1e6, total / t.cand_median / 1e9, total / t.cand_median / 1e9,
                           t.base_median * 1e6, t.median_ratio, n,
                           {"bw_ratio": ratio, "target": goal.bound,
                            "trial_bw_ratios": [1 / r for r in t.ratios]}))
            met = summarize(sink, tid, ratio, part=part, ranks=n, op=op, total_bytes=total,
                            trial_bw_ratios=[1 / r for r in t.ratios])
            print(f"# {goal.key}: median bandwidth ratio {ratio:.3f} (target {goal.text}: {verdict(met)})")
        g2f = res.get("G2 fresh")
        if g2f is not None:
            print(f"# (not judged) G2 page cache, load(like=) into new arrays against Read_at_all into "
                  f"fresh arrays: {1.0 / g2f.median_ratio:.3f} ({total / g2f.base_median / 1e9:.3f} "
                  f"vs {total / g2f.cand_median / 1e9:.3f} GB/s)")
        if parts:
            names = [k for k in ("raw Read_at_all", "load(out=) total") + _SPANS + ("other",)]
            print(f"# G2 page-cache breakdown, ms per load, median of each rank's own times "
                  f"(trace spans on; rank {', rank '.join(str(r) for r in range(len(parts)))}):")
            for k in names:
                cells = " ".join(f"{p.get(k, float('nan')):>8.3f}" for p in parts)
                print(f"#   {k.replace('checkpoint.', ''):<18} {cells}")
        shutil.rmtree(root, ignore_errors=True)
        maybe_plot(args, sink.rows, title=f"hpcdp checkpoint (G1, G2) vs raw MPI-IO, {n} ranks")
    sink.close()


if __name__ == "__main__":
    sys.exit(main())

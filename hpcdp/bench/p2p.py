"""A7: MPI point-to-point against mpi4py on the same buffers, in the same run.

Three figures, each the median of per-trial ratios over interleaved trials (PERF.md method):

- latency: an 8-byte ``send``/``recv`` ping-pong between ranks 0 and 1 against mpi4py's
  ``Send``/``Recv`` (target: A7 latency of ``_targets``);
- halo step: every rank exchanges a boundary with each neighbour of a periodic grid (1-D: left and
  right; 2-D: a ``dims_create`` grid, four neighbours), hpcdp ``isend``/``irecv`` + ``wait_all``
  against mpi4py ``Isend``/``Irecv``/``Waitall``, and hpcdp ``sendrecv`` against mpi4py
  ``Sendrecv``, with tags and with mpi4py's defaults (any receive tag) (target: A7 halo);
- ``batch_isend_irecv`` + ``wait_all`` against hpcdp's own ``isend``/``irecv`` of the same halo
  step (target: A7 batch: the batch must be no slower).

    mpirun -n 4 python -m hpcdp.bench p2p
    mpirun -n 4 python -m hpcdp.bench p2p --halo-bytes 8 --steps 200 --trials 7
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import numpy as np

from ._targets import target

__all__ = ["main", "run", "TARGETS"]

#: the bounds of PERF.md's A7 row by figure (from ``_targets``): a ratio at most ``bound`` meets it
TARGETS = {part: target("A7", part).bound for part in ("latency", "halo", "batch")}


def _quiet_barrier(comm: Any) -> None:
    """A barrier whose waiting ranks sleep between tests: with more ranks than cores, a rank
    spinning in ``MPI_Barrier`` takes the CPU from the pair being timed."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(2e-4)


def _timed(fn: Callable[[], Any], steps: int, comm: Any) -> float:
    """Seconds per step of ``fn``, every rank starting together (a barrier) and the slowest
    rank's time counting (a max over ranks), as a halo step finishes when its last rank does."""
    _quiet_barrier(comm)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    dt = (time.perf_counter() - t0) / steps
    every = np.empty(comm.Get_size())
    req = comm.Iallgather(np.array([dt]), every)
    while not req.Test():
        time.sleep(2e-4)
    return float(every.max())


def _mpi() -> Any:
    from mpi4py import MPI
    return MPI


def _trials(base: Callable[[], float], cand: Callable[[], float], trials: int) -> tuple[float, float, float]:
    """(median base s, median candidate s, median ratio) over alternating trials."""
    b: list[float] = []
    c: list[float] = []
    for i in range(trials):
        if i % 2 == 0:
            b.append(base())
            c.append(cand())
        else:
            c.append(cand())
            b.append(base())
    return statistics.median(b), statistics.median(c), statistics.median(y / x for x, y in zip(b, c))


def _latency(g: Any, comm: Any, iters: int, trials: int) -> dict[str, Any]:
    rank = comm.Get_rank()
    a = np.zeros(1, np.float64)  # 8 bytes

    def ping(send: Callable[..., Any], recv: Callable[..., Any]) -> Callable[[], None]:
        if rank == 0:
            def step() -> None:
                send(a, 1)
                recv(a, 1)
        elif rank == 1:
            def step() -> None:
                recv(a, 0)
                send(a, 0)
        else:
            def step() -> None:
                pass
        return step

    raw = ping(lambda x, p: comm.Send(x, p, 0), lambda x, p: comm.Recv(x, p, 0))
    ours = ping(lambda x, p: g.send(x, p), lambda x, p: g.recv(x, p))
    b, c, r = _trials(lambda: _timed(raw, iters, comm), lambda: _timed(ours, iters, comm), trials)
    return {"bench": "A7", "figure": "latency", "op": "8 B send/recv round trip",
            "base_us": b * 1e6, "us": c * 1e6, "ratio": r, "target": TARGETS["latency"]}


def _neighbours(size: int, rank: int, ndim: int) -> tuple[list[int], list[int]]:
    """(sources, destinations) of a periodic grid's halo exchange, in MPI ``Cart_shift`` order:
    for each dimension, data goes to the +1 neighbour (from the -1 one), then the reverse."""
    MPI = _mpi()
    dims = MPI.Compute_dims(size, ndim)
    coords = np.unravel_index(rank, dims)
    srcs, dsts = [], []
    for d in range(ndim):
        for disp in (1, -1):
            up = list(coords)
            up[d] = (up[d] + disp) % dims[d]
            down = list(coords)
            down[d] = (down[d] - disp) % dims[d]
            dsts.append(int(np.ravel_multi_index(up, dims)))
            srcs.append(int(np.ravel_multi_index(down, dims)))
    return srcs, dsts


def _halo(g: Any, comm: Any, ndim: int, nbytes: int, steps: int, trials: int) -> list[dict[str, Any]]:
    import hpcdp

    MPI = _mpi()
    rank, size = comm.Get_rank(), comm.Get_size()
    srcs, dsts = _neighbours(size, rank, ndim)
    n = max(1, nbytes // 8)
    out = [np.full(n, rank, np.float64) for _ in dsts]
    inn = [np.zeros(n, np.float64) for _ in srcs]
    k = len(dsts)

    def raw_nb() -> None:
        reqs = [comm.Irecv(inn[i], srcs[i], i) for i in range(k)]
        reqs += [comm.Isend(out[i], dsts[i], i) for i in range(k)]
        MPI.Request.Waitall(reqs)

    def raw_sr() -> None:
        for i in range(k):
            comm.Sendrecv(out[i], dsts[i], i, inn[i], srcs[i], i)

    def ours_nb() -> None:
        ws = [g.irecv(inn[i], srcs[i], i) for i in range(k)]
        ws += [g.isend(out[i], dsts[i], i) for i in range(k)]
        hpcdp.wait_all(ws)

    def ours_sr() -> None:
        for i in range(k):
            g.sendrecv(out[i], dsts[i], inn[i], srcs[i], sendtag=i, recvtag=i)

    def raw_sr_any() -> None:  # mpi4py's defaults: send tag 0, receive any tag
        for i in range(k):
            comm.Sendrecv(out[i], dsts[i], recvbuf=inn[i], source=srcs[i])

    def ours_sr_any() -> None:
        for i in range(k):
            g.sendrecv(out[i], dsts[i], inn[i], srcs[i])

    ops = ([hpcdp.P2POp("irecv", inn[i], srcs[i], i) for i in range(k)]
           + [hpcdp.P2POp("isend", out[i], dsts[i], i) for i in range(k)])

    def ours_batch() -> None:
        hpcdp.wait_all(hpcdp.batch_isend_irecv(ops))

    what = f"{ndim}-D halo step, {k} neighbours x {n * 8} B"
    rows = []
    for figure, base, cand, baseline in (
            ("halo", raw_nb, ours_nb, "mpi4py Isend/Irecv/Waitall"),
            ("halo", raw_sr, ours_sr, "mpi4py Sendrecv"),
            ("halo", raw_sr_any, ours_sr_any, "mpi4py Sendrecv, default tags"),
            ("batch", ours_nb, ours_batch, "hpcdp isend/irecv + wait_all")):
        b, c, r = _trials(lambda: _timed(base, steps, comm), lambda: _timed(cand, steps, comm), trials)
        op = {"halo": ("isend/irecv + wait_all" if base is raw_nb else "sendrecv" if base is raw_sr
                       else "sendrecv, any receive tag"),
              "batch": "batch_isend_irecv + wait_all"}[figure]
        rows.append({"bench": "A7", "figure": figure, "op": f"{what}: {op}", "baseline": baseline,
                     "base_us": b * 1e6, "us": c * 1e6, "ratio": r, "target": TARGETS[figure]})
    return rows


def run(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Every A7 figure on this rank of an MPI job (the rows are the same on every rank)."""
    import hpcdp

    MPI = _mpi()
    g = hpcdp.get_default_group()
    comm = MPI.COMM_WORLD.Dup()  # the baseline's own communicator: no message mixes with ours
    try:
        rows = [_latency(g, comm, cfg["iters"], cfg["trials"])]
        for ndim in (1, 2):
            rows += _halo(g, comm, ndim, cfg["halo_bytes"], cfg["steps"], cfg["trials"])
    finally:
        comm.Free()
    for r in rows:
        r["ranks"] = g.size
        r["met"] = bool(target("A7", r["figure"]).met(r["ratio"]))
    return rows


def _print(rows: Sequence[dict[str, Any]]) -> None:
    for r in rows:
        base = r.get("baseline", "mpi4py Send/Recv")
        print(f"# A7 {r['figure']:>7}: {r['op']}: {r['us']:.2f} us vs {base} {r['base_us']:.2f} us: "
              f"ratio {r['ratio']:.2f} (target {target('A7', r['figure']).text}: "
              f"{'met' if r['met'] else 'MISSED'})")
    sys.stdout.flush()


def parser() -> argparse.ArgumentParser:
    """Options of A7."""
    p = argparse.ArgumentParser(prog="python -m hpcdp.bench p2p", description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=7, help="interleaved mpi4py/hpcdp trials")
    p.add_argument("--iters", type=int, default=2000, help="latency round trips per trial")
    p.add_argument("--steps", type=int, default=500, help="halo steps per trial")
    p.add_argument("--halo-bytes", type=int, default=1024,
                   help="bytes sent to each neighbour per halo step (a row of 128 doubles)")
    p.add_argument("--json", default=None, help="append JSON lines here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``mpirun -n 4 python -m hpcdp.bench p2p [--trials N] [--json PATH]``."""
    a = parser().parse_args(list(argv) if argv is not None else None)
    import hpcdp

    from ._common import JsonSink, summarize

    hpcdp.init("mpi")
    if hpcdp.world_size() < 2:
        print("p2p bench: needs at least 2 ranks (mpirun -n 4)", file=sys.stderr)
        hpcdp.finalize()
        return 2
    rows = run({"iters": a.iters, "steps": a.steps, "trials": a.trials, "halo_bytes": a.halo_bytes})
    if hpcdp.rank() == 0:
        _print(rows)
        sink = JsonSink(a.json)
        for r in rows:
            sink.write(r)
        for r in rows:   # one figure per row: its op (and grid) tells the variants apart
            summarize(sink, "A7", r["ratio"], part=r["figure"], ranks=r["ranks"], variant=r["op"],
                      baseline=r.get("baseline", "mpi4py Send/Recv"))
        sink.close()
    hpcdp.finalize()
    return 0

"""A task farm with hpcdp.rpc.Executor: a Monte Carlo estimate of pi, one task per seed.

Rank 0 hands out the tasks and sums the results; every other rank runs tasks as it frees up.

    mpirun -n 4 python examples/07_task_farm.py
    hpcdp-run -n 4 examples/07_task_farm.py                  # TCP ranks
    python examples/07_task_farm.py                          # one rank runs every task itself

Prints ``pi ~ 3.14...`` and the count of points inside the quarter circle; ``--check`` also
counts them serially with numpy on rank 0 and exits with status 1 if the counts differ.

The same with mpi4py::

    from mpi4py import MPI
    from mpi4py.futures import MPICommExecutor

    def count_hits(seed, task, n): ...                       # any picklable function

    with MPICommExecutor(MPI.COMM_WORLD, root=0) as ex:
        if ex is not None:
            hits = sum(ex.starmap(count_hits, [(seed, t, n) for t in range(tasks)]))
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np

import hpcdp
import hpcdp.rpc as rpc


@rpc.register                 # tasks travel by name: module-level functions, registered
def count_hits(seed: int, task: int, n: int) -> int:
    """Of ``n`` uniform points in the unit square, how many fall inside the quarter circle."""
    xy = np.random.default_rng([seed, task]).random((n, 2))
    return int(np.count_nonzero((xy * xy).sum(axis=1) < 1.0))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", type=int, default=64)
    p.add_argument("--samples", type=int, default=100_000, help="points per task")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="compare with a serial numpy count")
    args = p.parse_args(argv)
    jobs = [(args.seed, t, args.samples) for t in range(args.tasks)]
    out: dict[str, Any] = {}
    with rpc.Executor() as ex:                         # every rank; None on all but rank 0
        if ex is not None:
            hits = sum(ex.starmap(count_hits, jobs))
            n = args.tasks * args.samples
            print(f"pi ~ {4.0 * hits / n:.6f}  ({hits} of {n} points inside; {args.tasks} "
                  f"tasks on {len(ex.workers)} worker(s))", flush=True)
            out = {"hits": hits, "pi": 4.0 * hits / n, "workers": len(ex.workers)}
    if out and args.check:
        serial = sum(count_hits(*job) for job in jobs)
        print(f"serial numpy count: {serial} ({'same' if serial == out['hits'] else 'DIFFERS'})")
        if serial != out["hits"]:
            raise SystemExit(1)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
    hpcdp.finalize()

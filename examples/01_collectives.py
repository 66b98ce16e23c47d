"""Every collective once, checked against numpy on the spot.

Runs unchanged on any backend:
    python examples/01_collectives.py                      # one simulated rank
    mpirun -n 4 python -m hpcdp.run examples/01_collectives.py
    hpcdp-run -n 4 examples/01_collectives.py              # TCP ranks
"""
from __future__ import annotations

import numpy as np

import hpcdp


def main() -> dict[str, bool]:
    hpcdp.init()
    rank, n = hpcdp.rank(), hpcdp.world_size()
    x = np.arange(4, dtype=np.float64) + rank          # rank r holds [r, r+1, r+2, r+3]
    every = [np.arange(4, dtype=np.float64) + r for r in range(n)]
    checks = {
        "allreduce sum": np.array_equal(hpcdp.allreduce(x), sum(every)),
        "allreduce mean": np.allclose(hpcdp.allreduce(x, "mean"), sum(every) / n),
        "allreduce max": np.array_equal(hpcdp.allreduce(x, "max"), every[-1]),
        "broadcast": np.array_equal(hpcdp.broadcast(x.copy(), root=n - 1), every[-1]),
        "all_gather": np.array_equal(hpcdp.all_gather(x), np.stack(every)),
        "reduce_scatter": np.array_equal(hpcdp.reduce_scatter(np.tile(x, n)), np.tile(sum(every), n)[4 * rank: 4 * rank + 4]),
        "all_to_all": np.array_equal(hpcdp.all_to_all(np.full(n, rank)), np.arange(n)),
        "scatter": np.array_equal(hpcdp.scatter(np.arange(2 * n), root=0), [2 * rank, 2 * rank + 1]),
        "all_gather_object": hpcdp.all_gather_object({"rank": rank}) == [{"rank": r} for r in range(n)],
    }
    red = hpcdp.reduce(x, root=0)
    gat = hpcdp.gather(x, root=0)
    checks["reduce"] = np.array_equal(red, sum(every)) if rank == 0 else red is None
    checks["gather"] = np.array_equal(gat, np.stack(every)) if rank == 0 else gat is None
    work = hpcdp.allreduce(np.ones(3), async_op=True)   # overlap something here, then wait
    checks["async allreduce"] = np.array_equal(work.wait(), np.full(3, n))
    if n > 1:                                            # a ring of point-to-point messages
        req = hpcdp.irecv(np.empty(1), (rank - 1) % n, tag=7)
        hpcdp.isend(np.array([float(rank)]), (rank + 1) % n, tag=7).wait()
        checks["ring send/recv"] = req.wait()[0] == (rank - 1) % n
    ok = hpcdp.all_gather_object(all(checks.values()))
    if rank == 0:
        backend = hpcdp.get_default_group().backend.name
        for name, good in checks.items():
            print(f"  {name:<18} {'ok' if good else 'WRONG'}")
        print(f"{len(checks)} collectives checked on {n} {backend} rank(s): "
              f"{'all correct' if all(ok) else 'MISMATCH on ranks ' + str([i for i, g in enumerate(ok) if not g])}")
    if not all(ok):
        raise SystemExit(1)
    return checks


if __name__ == "__main__":
    main()
    hpcdp.finalize()

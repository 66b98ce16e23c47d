"""Smoke test of ``python -m hpcdp.bench p2p`` (A7) on a tiny configuration, on MPI (the
benchmark compares against mpi4py): every row is there with a finite ratio. Timings are never
asserted (the machine is shared and noisy)."""
from __future__ import annotations

import math

import pytest

from hpcdp.testing.fixtures import World, worlds


def _tiny(rank: int) -> list[dict]:
    from hpcdp.bench.p2p import run

    return run({"iters": 20, "steps": 10, "trials": 2, "halo_bytes": 64})


@pytest.mark.parametrize("world", worlds("mpi"), indirect=True)
def test_bench_p2p_rows(world: World) -> None:
    out = world.run(_tiny, timeout=120)
    rows = out[0]
    ops = [r["op"] for r in rows]
    assert ops[0] == "8 B send/recv round trip", ops
    for ndim in (1, 2):
        for op in ("isend/irecv + wait_all", "sendrecv", "sendrecv, any receive tag",
                   "batch_isend_irecv + wait_all"):
            assert sum(o.startswith(f"{ndim}-D halo") and o.endswith(f": {op}") for o in ops) == 1, (op, ops)
    for r in rows:
        assert math.isfinite(r["ratio"]) and r["ratio"] > 0 and r["us"] > 0 and r["base_us"] > 0, r
        assert r["ranks"] == world.size

"""The conformance suite (``hpcdp.testing.suite``) on every spawnable backend and under mpirun.

Every case runs on world sizes 1-4 (from its ``min_size``) of each registered backend that
``hpcdp.spawn`` can start, and every case that does not need ranks to leave runs on the MPI world
of ``mpirun -n 2`` and ``-n 4`` (``tests/run_mpi.py``): one test, bound to each world by the
``world`` fixture.
"""
from __future__ import annotations

from typing import Any

import pytest

from hpcdp.testing import Case, check_failures, matrix
from hpcdp.testing.fixtures import World, grid, worlds

WORLD_SIZES = [1, 2, 3, 4]


def _cases_by_world() -> list[Any]:
    """(world, case) params: on a spawned world of n ranks the cases whose ``min_size`` allows n;
    on the MPI world those that do not need ranks to leave (``spawn_only``)."""
    out = []
    for w in worlds(*grid(WORLD_SIZES), "mpi"):
        (backend, size), = w.values
        cases = ([c for c, _ in matrix([2], spawned=False)] if backend == "mpi"
                 else [c for c, _ in matrix([size])])
        out += [pytest.param(w.values[0], c, id=f"{w.id}-{c.name}", marks=w.marks) for c in cases]
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world,case", _cases_by_world(), indirect=["world"])
def test_conformance(world: World, case: Case) -> None:
    # spawned worlds get the case's own group timeout; the MPI world run_mpi's (longer) one
    check_failures(case.judge(world.run(case.body, *case.args, timeout=case.timeout)))

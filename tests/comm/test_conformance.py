"""The conformance suite (``hpcdp.testing.suite``) on every spawnable backend and under mpirun.

Every case runs on world sizes 1-4 (from its ``min_size``) of each registered backend that
``hpcdp.spawn`` can start, and every case that does not need ranks to leave runs on the MPI world
of ``mpirun -n 2`` and ``-n 4`` (``tests/run_mpi.py``).
"""
from __future__ import annotations

import pytest

from hpcdp.testing import Case, check_failures, matrix, run_case, run_case_here, spawn_backends

WORLD_SIZES = [1, 2, 3, 4]


def _id(param: object) -> str:
    return param.name if isinstance(param, Case) else str(param)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", spawn_backends())
@pytest.mark.parametrize("case,world_size", matrix(WORLD_SIZES), ids=_id)
def test_conformance(backend: str, case: Case, world_size: int) -> None:
    check_failures(run_case(backend, world_size, case))


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", [c for c, n in matrix([2], spawned=False)], ids=_id)
def test_conformance_mpi(mpi_world, case: Case) -> None:
    check_failures(run_case_here(case))

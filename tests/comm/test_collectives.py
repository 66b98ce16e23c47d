"""Every collective x op x dtype x shape against numpy, on every backend and world size."""
from __future__ import annotations

import pytest

from cases import COLLECTIVES, body_collective
from hpcdp.testing import check, run_mpi
from hpcdp.testing.fixtures import World, grid, worlds

WORLD_SIZES = [1, 2, 3, 4]


@pytest.mark.parametrize("world", worlds(*grid(WORLD_SIZES), "mpi"), indirect=True)
@pytest.mark.parametrize("name", COLLECTIVES)
def test_collective_matches_numpy(world: World, name: str) -> None:
    check(world.run(body_collective, name))


# MPI only: sizes 1 and 3 (and a reversed rank order) exist under ``mpirun -n 2/-n 4`` only as
# sub-groups; the spawned worlds above run those sizes directly.
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", COLLECTIVES)
def test_collective_on_subgroups_mpi(mpi_world, name: str) -> None:
    """World sizes 1 and 3 (and reversed rank order) under mpirun, through sub-groups."""
    n = mpi_world.size
    layouts = [[n - 1], list(range(n - 1, -1, -1))] + ([[0, 1, 2]] if n >= 4 else [])
    fails: list[str] = []
    for ranks in layouts:
        per_rank = run_mpi(body_collective, name, ["int32", "float64", "bool"], ranks)
        fails += [f"group {ranks} rank {r}: {f}" for r, fs in enumerate(per_rank) for f in fs]
    assert not fails, "\n".join(fails[:20])

"""Every collective x op x dtype x shape against numpy, on every backend and world size."""
from __future__ import annotations

import pytest

from cases import COLLECTIVES, body_collective
from conftest import SPAWN_BACKENDS, run_mpi, run_ranks

WORLD_SIZES = [1, 2, 3, 4]


@pytest.mark.parametrize("backend", SPAWN_BACKENDS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name", COLLECTIVES)
def test_collective_matches_numpy(backend: str, world_size: int, name: str) -> None:
    per_rank = run_ranks(backend, world_size, body_collective, name)
    fails = [f"rank {r}: {f}" for r, fs in enumerate(per_rank) for f in fs]
    assert not fails, "\n".join(fails[:20])


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", COLLECTIVES)
def test_collective_matches_numpy_mpi(mpi_world, name: str) -> None:
    per_rank = run_mpi(body_collective, name)
    fails = [f"rank {r}: {f}" for r, fs in enumerate(per_rank) for f in fs]
    assert not fails, "\n".join(fails[:20])


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

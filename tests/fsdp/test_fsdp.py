"""FSDP parity with single-process training (float64, 3 steps) for every strategy, N = 1..4, on
sim, TCP and MPI, with odd shapes (a 7x15 weight, a bias of 3 on 4 ranks) and nested units."""
from __future__ import annotations

import pytest

from conftest import SPAWN_BACKENDS, run_mpi, run_ranks
from hpcdp.testing import check
from hpcdp.testing.fixtures import World, worlds
from fsdp_bodies import body_parity, body_parity_first3

pytestmark = pytest.mark.timeout(180)

STRATEGIES = ["full_shard", "shard_grad_op", "no_shard"]


@pytest.mark.parametrize("world", worlds("sim-2", "sim-3", "sim-4", "mpi"), indirect=True)
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_parity(world: World, strategy: str, opt: str) -> None:
    check(world.run(body_parity, strategy, opt, "nested"))
    if world.is_mpi and world.size == 4:   # N = 3 as well, on a sub-group
        check(world.run(body_parity_first3, strategy, opt, "nested"))


@pytest.mark.parametrize("wrap", ["none", "blocks", "size"])
def test_parity_wrap_policies(wrap: str) -> None:
    check(run_ranks("sim", 4, body_parity, "full_shard", "adamw", wrap))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_sync_accumulation(strategy: str) -> None:
    check(run_ranks("sim", 3, body_parity, strategy, "sgd", "nested", 3, 4, 2))


@pytest.mark.parametrize("world", worlds("sim-4", "mpi", mpi_min_size=4), indirect=True)
def test_hybrid_shard(world: World) -> None:
    """Two sub-groups of two: reduce-scatter inside, allreduce across."""
    check(world.run(body_parity, "hybrid_shard", "adamw", "nested", 3, 4, 1, 2))
    check(world.run(body_parity, "hybrid_shard", "sgd", "blocks", 3, 4, 2, 2))


def test_single_rank_is_plain_training() -> None:
    check(run_ranks("sim", 1, body_parity, "full_shard", "adamw", "nested"))


@pytest.mark.parametrize("backend", [b for b in SPAWN_BACKENDS if b != "sim"])
def test_parity_other_spawn_backends(backend: str) -> None:
    check(run_ranks(backend, 3, body_parity, "full_shard", "adamw", "nested", 2))


# Not a world of test_no_sync_accumulation: that one runs every strategy with SGD on 3 ranks;
# this one full_shard with AdamW on the MPI world.
@pytest.mark.mpi(min_size=2)
def test_no_sync_mpi(mpi_world) -> None:
    check(run_mpi(body_parity, "full_shard", "adamw", "nested", 3, 4, 2))


"""FSDP parity with single-process training (float64, 3 steps) for every strategy, N = 1..4, on
sim, TCP and MPI, with odd shapes (a 7x15 weight, a bias of 3 on 4 ranks) and nested units."""
from __future__ import annotations

import pytest

from conftest import SPAWN_BACKENDS, run_mpi, run_ranks
from fsdp_bodies import body_parity, body_parity_first3

pytestmark = pytest.mark.timeout(180)

STRATEGIES = ["full_shard", "shard_grad_op", "no_shard"]


def _check(per_rank: list[list[str]]) -> None:
    fails = [f"rank {r}: {f}" for r, fs in enumerate(per_rank) for f in fs]
    assert not fails, "\n".join(fails)


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_parity_sim(strategy: str, opt: str, world_size: int) -> None:
    _check(run_ranks("sim", world_size, body_parity, strategy, opt, "nested"))


@pytest.mark.parametrize("wrap", ["none", "blocks", "size"])
def test_parity_wrap_policies(wrap: str) -> None:
    _check(run_ranks("sim", 4, body_parity, "full_shard", "adamw", wrap))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_sync_accumulation(strategy: str) -> None:
    _check(run_ranks("sim", 3, body_parity, strategy, "sgd", "nested", 3, 4, 2))


def test_hybrid_shard_sim() -> None:
    _check(run_ranks("sim", 4, body_parity, "hybrid_shard", "adamw", "nested", 3, 4, 1, 2))


def test_single_rank_is_plain_training() -> None:
    _check(run_ranks("sim", 1, body_parity, "full_shard", "adamw", "nested"))


@pytest.mark.parametrize("backend", [b for b in SPAWN_BACKENDS if b != "sim"])
def test_parity_other_spawn_backends(backend: str) -> None:
    _check(run_ranks(backend, 3, body_parity, "full_shard", "adamw", "nested", 2))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_parity_mpi(mpi_world, strategy: str, opt: str) -> None:
    _check(run_mpi(body_parity, strategy, opt, "nested"))
    if mpi_world.size == 4:   # N = 3 as well, on a sub-group
        _check(run_mpi(body_parity_first3, strategy, opt, "nested"))


@pytest.mark.mpi(min_size=2)
def test_no_sync_mpi(mpi_world) -> None:
    _check(run_mpi(body_parity, "full_shard", "adamw", "nested", 3, 4, 2))


@pytest.mark.mpi(min_size=4)
def test_hybrid_shard_mpi(mpi_world) -> None:
    """Two sub-groups of two: reduce-scatter inside, allreduce across."""
    _check(run_mpi(body_parity, "hybrid_shard", "adamw", "nested", 3, 4, 1, 2))
    _check(run_mpi(body_parity, "hybrid_shard", "sgd", "blocks", 3, 4, 2, 2))

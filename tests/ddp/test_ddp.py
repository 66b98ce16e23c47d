"""DDP: parity with one process, overlap, unused parameters, join, compression hooks, sub-groups,
frozen parameters, detaching (close), the MPI progress thread."""
from __future__ import annotations

import numpy as np
import pytest

import hpcdp
from hpcdp.testing import check, run_ranks, spawn_backends
from hpcdp.testing.fixtures import World, worlds
from ddp_bodies import (
    SMALL_CAP, body_comm_hook, body_fp16_large, body_hooks_see_local, body_join,
    body_join_frozen, body_join_no_sync, body_many_buckets, body_overlap, body_parity,
    body_parity_first3, body_progress_thread, body_rewrap, body_subgroups, body_unused,
)
from hpcdp.ddp._buckets import assign_buckets
from hpcdp.ddp.comm_hooks import from_bf16, to_bf16

SPAWN_BACKENDS = spawn_backends()


PARITY = [  # (model, optimizer, bucket cap MiB, no_sync accumulation steps, bucket view)
    ("mlp", "sgd", 25.0, 1, True),
    ("mlp", "adam", SMALL_CAP, 1, True),
    ("mlp", "sgd", SMALL_CAP, 3, True),
    ("mlp", "adam", 25.0, 2, False),
    ("tied", "sgd", SMALL_CAP, 2, True),
    ("penalized", "sgd", SMALL_CAP, 1, True),   # backward not linear in grad_output
    ("frozen", "adam", SMALL_CAP, 1, True),     # frozen first layer: broadcast, not bucketed
]


@pytest.mark.parametrize("world", worlds("sim-2", "sim-3", "sim-4", "mpi"), indirect=True)
@pytest.mark.parametrize("case", PARITY, ids=lambda c: "-".join(map(str, c)))
def test_parity(world: World, case: tuple) -> None:
    model, opt, cap, accum, view = case
    check(world.run(body_parity, model, opt, cap, accum, 3, 4, view))
    if world.is_mpi and world.size == 4:   # N = 3 as well, on a sub-group
        check(world.run(body_parity_first3, model, opt, cap, accum, 3, 4, view))


@pytest.mark.parametrize("backend", [b for b in SPAWN_BACKENDS if b != "sim"])
def test_parity_other_spawn_backends(backend: str) -> None:
    check(run_ranks(backend, 3, body_parity, "mlp", "adam", SMALL_CAP, 2, 2, 4, True))


def test_single_rank_is_plain_training() -> None:
    check(run_ranks("sim", 1, body_parity, "mlp", "adam", SMALL_CAP, 2, 2, 4, True))


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_hooks_and_input_gradient_unscaled(world_size: int) -> None:
    check(run_ranks("sim", world_size, body_hooks_see_local))


def test_bucket_assignment() -> None:
    # first bucket capped at 1 MiB, later ones at the cap; dtypes never mix; order of readiness
    mib = 1 << 20
    got = assign_buckets([mib // 2, mib // 2, mib, 3 * mib, mib], ["f"] * 5, cap_bytes=4 * mib)
    assert got == [[0, 1], [2, 3], [4]]
    got = assign_buckets([8, 8, 8, 8], ["a", "b", "a", "b"], cap_bytes=16, first_cap_bytes=16)
    assert got == [[0, 2], [1, 3]]
    with pytest.raises(ValueError):
        assign_buckets([1], ["a"], cap_bytes=0)


def test_many_buckets_reverse_order() -> None:
    check(run_ranks("sim", 2, body_many_buckets))


@pytest.mark.parametrize("world", worlds("sim-2", "sim-4", "mpi"), indirect=True)
def test_overlap(world: World) -> None:
    check(world.run(body_overlap))


@pytest.mark.parametrize("find_unused", [True, False])
@pytest.mark.parametrize("world", worlds("sim-2", "sim-3", "mpi"), indirect=True)
def test_unused_parameters(world: World, find_unused: bool) -> None:
    check(world.run(body_unused, find_unused))


@pytest.mark.parametrize("divide_initial", [True, False])
@pytest.mark.parametrize("world", worlds("sim-2", "sim-4", "mpi"), indirect=True)
def test_join_uneven_inputs(world: World, divide_initial: bool) -> None:
    check(world.run(body_join, divide_initial, timeout=20))


@pytest.mark.parametrize("divide_initial", [True, False])
@pytest.mark.parametrize("world", worlds("sim-2", "sim-3", "mpi"), indirect=True)
def test_join_with_no_sync_and_buffers(world: World, divide_initial: bool) -> None:
    check(world.run(body_join_no_sync, divide_initial, timeout=20))


def test_join_disagreeing_no_sync_raises() -> None:
    def body(rank: int) -> list[str]:
        from ddp_bodies import data, make_mlp
        ddp = hpcdp.DDP(make_mlp(0))
        x, _ = data(4)
        try:
            with ddp.join():
                if rank == 0:
                    with ddp.no_sync():
                        ddp(x)
                else:
                    ddp(x)
        except hpcdp.HpcdpError as exc:
            return [] if "no_sync" in str(exc) else [f"unexpected error: {exc}"]
        return ["ranks disagreeing about no_sync under join did not raise"]

    check(run_ranks("sim", 2, body, timeout=20))


@pytest.mark.parametrize("world", worlds("sim-2", "sim-3", "mpi"), indirect=True)
def test_join_syncs_frozen_parameters(world: World) -> None:
    check(world.run(body_join_frozen, timeout=20))


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
@pytest.mark.parametrize("world", worlds("sim-2", "sim-3", "mpi"), indirect=True)
def test_compression_hooks(world: World, kind: str) -> None:
    check(world.run(body_comm_hook, kind))


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
@pytest.mark.parametrize("world", worlds("sim-2", "sim-4", "mpi"), indirect=True)
def test_compression_hooks_large_gradients(world: World, kind: str) -> None:
    check(world.run(body_fp16_large, kind))


def test_bf16_rounding() -> None:
    x = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -2.5, 0.0, np.inf, 1e-40, 3.4e38], np.float32)
    u = to_bf16(x)
    back = from_bf16(u)
    # 1 + 2^-8 is a tie between 1 and 1 + 2^-7: nearest even is 1; 1 + 3*2^-8 rounds up to 1 + 2^-6
    assert back[0] == 1.0 and back[1] == 1.0 and back[2] == 1.0 + 2**-6
    assert back[3] == -2.5 and back[4] == 0.0 and np.isinf(back[5])
    assert np.isnan(from_bf16(to_bf16(np.array([np.nan], np.float32))))[0]
    rng = np.random.default_rng(0).normal(size=10000).astype(np.float32)
    rel = np.abs(from_bf16(to_bf16(rng)) - rng) / np.abs(rng)
    assert rel.max() <= 2**-8


@pytest.mark.parametrize("world", worlds("sim-4", "mpi", mpi_min_size=4), indirect=True)
def test_subgroups(world: World) -> None:
    check(world.run(body_subgroups))


@pytest.mark.parametrize("world", worlds("sim-1", "sim-2", "mpi"), indirect=True)
def test_rewrap_and_close(world: World) -> None:
    check(world.run(body_rewrap))


# MPI only: the progress thread drives MPI requests (a thread-multiple or serialized MPI
# library); the simulated and TCP backends have no such thread to test.
@pytest.mark.parametrize("world", worlds("mpi"), indirect=True)
@pytest.mark.parametrize("thread_multiple", [True, False])
def test_progress_thread(world: World, thread_multiple: bool) -> None:
    check(world.run(body_progress_thread, thread_multiple))


def test_errors() -> None:
    with pytest.raises(TypeError):
        hpcdp.DDP(object())

    def body(rank: int) -> list[str]:
        from ddp_bodies import make_mlp
        try:
            hpcdp.DDP(make_mlp(0), bucket_cap_mb=0)
        except ValueError:
            return []
        return ["bucket_cap_mb=0 accepted"]

    check(run_ranks("sim", 2, body))

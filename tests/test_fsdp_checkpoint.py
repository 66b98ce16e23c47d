"""FSDP checkpoints: Shards at global names, and round trips across strategies and world sizes
(FSDP 4 -> FSDP 3, -> DDP 2, -> a plain model in one process, and the reverse), model and
optimizer state, checked by training on after loading and comparing with uninterrupted training."""
from __future__ import annotations

import os
import shutil

import pytest

import hpcdp
from conftest import run_mpi, run_ranks
from fsdp_bodies import body_ckpt_segment, body_ckpt_sharded_layout, compare, reference_params

pytestmark = pytest.mark.timeout(240)

ROUND_TRIPS = [  # (saved by, world size) -> (loaded by, world size)
    (("fsdp:full_shard", 4), ("fsdp:full_shard", 3)),
    (("fsdp:full_shard", 4), ("ddp", 2)),
    (("fsdp:full_shard", 4), ("plain", 1)),
    (("fsdp:full_shard", 3), ("fsdp:full_shard", 4)),
    (("ddp", 2), ("fsdp:full_shard", 4)),
    (("plain", 1), ("fsdp:full_shard", 4)),
    (("fsdp:shard_grad_op", 2), ("fsdp:no_shard", 3)),
    (("fsdp:no_shard", 3), ("fsdp:shard_grad_op", 4)),
    (("fsdp:hybrid_shard", 4), ("fsdp:full_shard", 2)),
    (("fsdp:full_shard", 2), ("fsdp:hybrid_shard", 4)),
]


@pytest.fixture(scope="module")
def want() -> dict:
    return reference_params(3)


@pytest.mark.parametrize("saver,loader", ROUND_TRIPS, ids=lambda c: f"{c[0]}x{c[1]}")
def test_round_trip(saver: tuple, loader: tuple, want: dict, tmp_path) -> None:
    path = str(tmp_path / "ck" / "step-2")
    run_ranks("sim", saver[1], body_ckpt_segment, saver[0], 0, 2, None, path)
    got = run_ranks("sim", loader[1], body_ckpt_segment, loader[0], 2, 3, path, None)[0]
    fails = compare(want, got, 1e-10, f"{saver} -> {loader}, then one more step")
    assert not fails, "\n".join(fails)


def test_state_dict_is_shards_at_global_names() -> None:
    per_rank = run_ranks("sim", 4, body_ckpt_sharded_layout)
    fails = [f"rank {r}: {f}" for r, fs in enumerate(per_rank) for f in fs]
    assert not fails, "\n".join(fails)


def _mpi_round_trip(rank: int, path: str) -> list[str]:
    """Save under FSDP on the whole world, load under FSDP and DDP on smaller sub-groups."""
    n = hpcdp.world_size()
    body_ckpt_segment(rank, "fsdp:full_shard", 0, 2, None, path)
    fails = []
    ref = reference_params(3)
    for kind, size in (("fsdp:full_shard", n - 1), ("ddp", max(1, n // 2)), ("fsdp:no_shard", n)):
        sub = hpcdp.new_group(list(range(size)))
        if rank < size:
            got = body_ckpt_segment(rank, kind, 2, 3, path, None, group=sub)
            if rank == 0:
                fails += compare(ref, got, 1e-10, f"FSDP {n} -> {kind} {size}")
    return fails


@pytest.mark.mpi(min_size=2)
def test_round_trip_mpi(mpi_world) -> None:
    from ckpt_bodies import shared_dir

    d = shared_dir()
    try:
        per_rank = run_mpi(_mpi_round_trip, os.path.join(d, "step-2"))
    finally:
        hpcdp.barrier()
        if hpcdp.rank() == 0:
            shutil.rmtree(d, ignore_errors=True)
    fails = [f"rank {r}: {f}" for r, fs in enumerate(per_rank) for f in fs]
    assert not fails, "\n".join(fails)

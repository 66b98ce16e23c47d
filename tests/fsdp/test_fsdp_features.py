"""FSDP's schedule (prefetch order and limit, async reduction), memory, clipping, summon, errors,
mixed precision, and ZeRO-1 (``ZeroRedundancyOptimizer``) against plain DDP."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import run_ranks
from hpcdp.testing import check
from hpcdp.testing.fixtures import World, worlds
from fsdp_bodies import (
    body_clip, body_foreign, body_memory_peak, body_misuse, body_mixed, body_models_differ, body_prefetch,
    body_summon_writeback, body_zero,
)
from hpcdp.fsdp import MixedPrecision, size_based

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("limit", [True, False])
@pytest.mark.parametrize("world", worlds("sim-2", "sim-3", "mpi"), indirect=True)
def test_prefetch_order_and_limit(world: World, limit: bool) -> None:
    check(world.run(body_prefetch, True, limit))


def test_no_prefetch_gathers_nothing_ahead() -> None:
    check(run_ranks("sim", 2, body_prefetch, False))


@pytest.mark.parametrize("world_size", [2, 4])
def test_memory_peak_and_stats(world_size: int) -> None:
    check(run_ranks("sim", world_size, body_memory_peak))


@pytest.mark.parametrize("strategy", ["full_shard", "no_shard"])
def test_clip_grad_norm_is_global(strategy: str) -> None:
    check(run_ranks("sim", 3, body_clip, strategy))


def test_model_that_is_not_an_nn_module() -> None:
    check(run_ranks("sim", 3, body_foreign))


def test_summon_full_params_writeback() -> None:
    check(run_ranks("sim", 2, body_summon_writeback))


@pytest.mark.parametrize("what", ["shape", "dtype", "options"])
def test_models_differ_raise_on_every_rank(what: str) -> None:
    msgs = run_ranks("sim", 3, body_models_differ, what)
    assert all(m != "no error" for m in msgs), msgs
    for r, m in enumerate(msgs):
        assert f"rank {r}" in m and "rank 1:" in m, m   # names this rank and the one that differs
        assert "rank 2:" not in m, m


def test_misuse_raises() -> None:
    check(run_ranks("sim", 2, body_misuse))


# Max abs parameter difference after 3 SGD steps (lr 0.2) against float32 FSDP: float16 compute
# measures ~6e-5, bfloat16 ~3e-4 (8 mantissa bits); the bounds leave a margin of ~8x.
MIXED = [("float16", None, 5e-4), ("float16", "float32", 5e-4), ("bfloat16", "float32", 2.5e-3),
         ("bfloat16", "bfloat16", 2.5e-3), ("float32", "float16", 5e-4), ("float32", "bfloat16", 2.5e-3)]


@pytest.mark.parametrize("param_dtype,reduce_dtype,tol", MIXED)
@pytest.mark.parametrize("world", worlds("sim-2", "sim-4", "mpi"), indirect=True)
def test_mixed_precision_close_to_float32(world: World, param_dtype: str, reduce_dtype: str | None,
                                          tol: float) -> None:
    res = world.run(body_mixed, param_dtype, reduce_dtype)
    check([f for f, _ in res])
    err = res[0][1]
    assert 0 < err <= tol, f"max difference {err} (tolerance {tol}); 0 would mean no low precision"


@pytest.mark.parametrize("strategy", ["shard_grad_op", "no_shard"])
def test_mixed_precision_other_strategies(strategy: str) -> None:
    res = run_ranks("sim", 2, body_mixed, "bfloat16", None, strategy)
    check([f for f, _ in res])
    assert 0 < res[0][1] <= 2.5e-3


def test_mixed_precision_hybrid() -> None:
    res = run_ranks("sim", 4, body_mixed, "float16", "float32", "hybrid_shard", 2)
    check([f for f, _ in res])
    assert 0 < res[0][1] <= 5e-4


def test_policies_validate() -> None:
    with pytest.raises(ValueError):
        MixedPrecision()
    with pytest.raises(ValueError):
        MixedPrecision(param_dtype="int8")
    with pytest.raises(ValueError):
        size_based(0)
    mp = MixedPrecision(param_dtype="bf16")
    assert mp.param_dtype == "bfloat16" and mp.reduce_dtype == "bfloat16"
    assert MixedPrecision(param_dtype=np.float16).reduce_dtype == np.dtype(np.float16)


@pytest.mark.parametrize("opt", ["adam", "sgd"])
@pytest.mark.parametrize("world", worlds("sim-2", "sim-3", "mpi"), indirect=True)
def test_zero1_matches_ddp(world: World, opt: str) -> None:
    check(world.run(body_zero, opt))


def _memory_stats_find_the_optimizer(rank: int) -> list[str]:
    import hpcdp
    from hpcdp import nn, optim

    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).astype(np.float64)
    f = hpcdp.FSDP(m)
    fails = []
    if f.memory_stats()["optim_state"] != 0:
        fails.append("optimizer state counted before any optimizer exists")
    opt = optim.Adam(f.parameters(), lr=1e-3)
    other = optim.Adam(nn.Linear(3, 3).parameters(), lr=1e-3)  # not on these shards: not counted
    out = f(np.ones((4, 8)))
    f.backward(np.ones_like(out))
    opt.step()
    found, given = f.memory_stats()["optim_state"], f.memory_stats(opt)["optim_state"]
    if not (found == given > 0):
        fails.append(f"memory_stats() found {found} B of optimizer state, memory_stats(opt) {given} B")
    del other
    return fails


@pytest.mark.timeout(120)
def test_memory_stats_finds_the_optimizer_itself() -> None:
    for fails in run_ranks("sim", 2, _memory_stats_find_the_optimizer):
        assert not fails, fails

"""FSDP over torch models (``hpcdp.FSDP(torch_module)``): every strategy, both calling modes
(tensors and ``loss.backward()`` with ``torch.optim`` on the shards; arrays and
``fsdp.backward(g)``), auto_wrap by torch classes and callables, mixed precision, and
checkpoints that load at other world sizes and into a plain torch module, each compared with
one process of plain torch on the whole batch (float64, within 1e-10 after 5 steps)."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch  # a missing torch must fail here, not skip: make test installs it

from fsdp_torch_bodies import (body_misuse, body_mixed, body_mpi_checkpoint, body_parity,
                               body_no_sync, body_saved_memory, body_segment, body_units_and_grads, compare, plain_torch_load, reference)
from hpcdp.testing import check
from hpcdp.testing.fixtures import World, worlds

pytestmark = pytest.mark.timeout(240)

torch.set_num_threads(1)   # simulated ranks are threads: one torch thread each


@pytest.mark.parametrize("world", worlds("sim-1", "sim-2", "sim-3", "sim-4", "tcp-2", "mpi"), indirect=True)
def test_parity_every_strategy(world: World) -> None:
    check(world.run(body_parity, "mlp", timeout=60, mpi_timeout=120))


@pytest.mark.parametrize("world", worlds("sim-2", "sim-3", "mpi"), indirect=True)
def test_parity_cnn(world: World) -> None:
    # Conv2d's weight is saved by autograd itself: full_shard re-gathers it for backward
    check(world.run(body_parity, "cnn", "full_shard", timeout=60, mpi_timeout=120))


@pytest.mark.parametrize("world", worlds("sim-2", "sim-3", "mpi"), indirect=True)
def test_parity_frozen_layers(world: World) -> None:
    check(world.run(body_parity, "frozen", timeout=60, mpi_timeout=120))


@pytest.mark.parametrize("world", worlds("sim-2", "sim-3", "mpi"), indirect=True)
def test_units_and_reduced_gradients(world: World) -> None:
    check(world.run(body_units_and_grads, timeout=60, mpi_timeout=120))


@pytest.mark.parametrize("world", worlds("sim-2", "mpi"), indirect=True)
def test_mixed_precision(world: World) -> None:
    check(world.run(body_mixed, timeout=60, mpi_timeout=120))


@pytest.mark.parametrize("world", worlds("sim-1"), indirect=True)
def test_full_shard_frees_what_autograd_saved(world: World) -> None:
    check(world.run(body_saved_memory, timeout=60))


@pytest.mark.parametrize("world", worlds("sim-2", "mpi"), indirect=True)
def test_no_sync_accumulation(world: World) -> None:
    check(world.run(body_no_sync, timeout=60, mpi_timeout=120))


@pytest.mark.parametrize("world", worlds("sim-2", "mpi"), indirect=True)
def test_misuse(world: World) -> None:
    check(world.run(body_misuse, timeout=60, mpi_timeout=120))


@pytest.fixture(scope="module")
def saved_at_2(tmp_path_factory: pytest.TempPathFactory) -> str:
    from conftest import run_ranks

    path = str(tmp_path_factory.mktemp("torch_ck") / "step-2")
    run_ranks("sim", 2, body_segment, "full_shard", 0, 2, None, path)
    return path


@pytest.mark.parametrize("strategy,size", [("full_shard", 1), ("full_shard", 3), ("shard_grad_op", 4),
                                           ("hybrid_shard", 4), ("no_shard", 3)])
def test_checkpoint_other_world_size(saved_at_2: str, strategy: str, size: int) -> None:
    from conftest import run_ranks

    mode = "numpy" if size == 3 else "torch"
    got = run_ranks("sim", size, body_segment, strategy, 2, 3, saved_at_2, None, None, mode)
    fails = compare(reference("cnn", "adamw", 3), got[0], 1e-10,
                    f"saved under full_shard at 2 ranks, loaded under {strategy} at {size}, one more step")
    assert not fails, "\n".join(fails)


def test_checkpoint_into_plain_torch(saved_at_2: str) -> None:
    got = plain_torch_load(saved_at_2)
    fails = compare(reference("cnn", "adamw", 2), got["saved"], 1e-10, "the saved model")
    fails += compare(reference("cnn", "adamw", 3), got["after"], 1e-10,
                     "a plain torch module and AdamW loaded from it, one more step")
    assert not fails, "\n".join(fails)


@pytest.mark.mpi(min_size=2)
def test_checkpoint_mpi(mpi_world) -> None:
    import shutil

    import hpcdp
    from ckpt_bodies import shared_dir
    from conftest import run_mpi

    d = shared_dir()
    try:
        per_rank = run_mpi(body_mpi_checkpoint, os.path.join(d, "step-2"))
    finally:
        hpcdp.barrier()
        if hpcdp.rank() == 0:
            shutil.rmtree(d, ignore_errors=True)
    check(per_rank)


def test_reference_is_deterministic() -> None:
    # the parity tests compare against this: two runs must agree exactly, or 1e-10 means nothing
    a, b = reference("mlp", "adamw"), reference("mlp", "adamw")
    assert all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("world", worlds("sim-2", "mpi"), indirect=True)
def test_backward_that_raises_leaves_nothing_stuck(world: World) -> None:
    from ddp_torch_bodies import body_backward_raises
    check(world.run(body_backward_raises, "fsdp"))

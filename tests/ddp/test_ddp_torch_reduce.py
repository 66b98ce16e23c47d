"""How DDP reduces a torch model's buckets: the average has the very bits of the transport's
``mean`` (a sum scaled by 1/n where that is exact, a division otherwise), blocking or not; and
``python -m hpcdp.bench torch`` (D5) prints its no-overlap ceiling and per-phase breakdown on
a tiny configuration (timings are never asserted: the machine is shared and noisy)."""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

import hpcdp
from hpcdp.ddp.comm_hooks import _average, _scales_exactly
from hpcdp.testing import check
from hpcdp.testing.fixtures import World, worlds

torch.set_num_threads(1)


def body_average_bits(rank: int) -> list[str]:
    """Each dtype's bucket average against ``allreduce(x, "mean")`` of the same data, bit for bit,
    async and blocking; then a DDP step's gradients against it."""
    g = hpcdp.get_default_group()
    n = g.size
    fails = []
    rng = np.random.default_rng(100 + rank)
    for dtype in (np.float32, np.float64, np.float16):
        x = (rng.standard_normal(1001) * 3).astype(dtype)
        want = g.allreduce(x, "mean")
        for async_op in (True, False):
            flat = x.copy()
            got = _average(g, flat, n, async_op).wait()
            if got is not flat:
                fails.append(f"{np.dtype(dtype).name} async={async_op}: result not in the bucket")
            if not np.array_equal(flat.view(np.uint8), want.view(np.uint8)):
                diff = int(np.count_nonzero(flat != want))
                fails.append(f"{np.dtype(dtype).name} async={async_op} on {n} ranks: {diff} elements "
                             "differ from allreduce 'mean'")
    def make() -> Any:
        return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    model = make()
    ddp = hpcdp.DDP(model, group=g, bucket_cap_mb=40 / 2**20)   # several buckets
    local = make()
    local.load_state_dict(model.state_dict())   # rank 0's parameters, as DDP broadcast them
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(rank))
    for _ in range(2):   # the second step launches buckets during backward
        ddp.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), torch.zeros(4, 3)).backward()
    torch.nn.functional.mse_loss(local(x), torch.zeros(4, 3)).backward()
    for (name, p), q in zip(ddp.named_parameters(), local.parameters()):
        want = g.allreduce(q.grad.numpy(), "mean")
        if not np.array_equal(p.grad.numpy(), want):
            fails.append(f"DDP gradient of {name} on {n} ranks differs from allreduce 'mean' of the "
                         "ranks' gradients")
    if len(ddp.buckets) < 2:
        fails.append(f"expected several buckets, got {len(ddp.buckets)}")
    ddp.close()
    return fails


@pytest.mark.parametrize("world", worlds("sim-2", "sim-3", "sim-4", "mpi"), indirect=True)
def test_bucket_average_bits(world: World) -> None:
    check(world.run(body_average_bits))


def test_scales_exactly() -> None:
    assert _scales_exactly(np.float32, 2) and _scales_exactly(np.float64, 4)
    assert not _scales_exactly(np.float32, 3) and not _scales_exactly(np.float16, 2)
    # where it says so, the product is the quotient, to the bit (subnormals and huge values too)
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(10_000) * 10.0 ** k for k in (-310, -300, 0, 300)])
    x32 = np.concatenate([rng.standard_normal(10_000) * 10.0 ** k for k in (-44, -38, 0, 37)]
                         ).astype(np.float32)
    for d in (2, 4, 8, 64):
        assert np.array_equal(x * (1.0 / d), x / d)
        assert np.array_equal(x32 * np.float32(1.0 / d), x32 / np.float32(d))
    assert not np.array_equal(x * (1.0 / 3), x / 3)   # (why other sizes divide)


def body_first_bucket(rank: int) -> list[str]:
    """Torch's small first bucket (1 MiB), except over MPI with the job on one node and no rank
    holding a progress thread: then one cap for all (the same buckets on every rank)."""
    g = hpcdp.get_default_group()
    model = torch.nn.Sequential(torch.nn.Linear(300, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 300))
    ddp = hpcdp.DDP(model, group=g)   # 1.2 MB per layer: two buckets with a 1 MiB first cap
    progress = int(g.allreduce(np.array([int(ddp._reducer.progress is not None)]), "max")[0])
    one_node = hpcdp.local_world_size() == g.size
    mpi = g.backend.native_comm() is not None
    want = 1 if (mpi and g.size > 1 and not progress and one_node) else 2
    sizes = [b.nbytes for b in ddp.buckets]
    fails = []
    if len(sizes) != want:
        fails.append(f"{len(sizes)} buckets {sizes}, expected {want} (mpi {mpi}, progress thread on "
                     f"some rank {bool(progress)}, one node {one_node})")
    every = g.all_gather(np.array(sizes + [0] * (2 - len(sizes)), dtype=np.int64))
    if not (every == every[0]).all():
        fails.append(f"ranks built different buckets: {every.tolist()}")
    x = torch.randn(4, 300, generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        ddp.zero_grad()
        ddp(x).square().mean().backward()
    local = torch.nn.Sequential(torch.nn.Linear(300, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 300))
    local.load_state_dict(model.state_dict())
    local(x).square().mean().backward()
    for (name, p), q in zip(ddp.named_parameters(), local.parameters()):
        if not np.allclose(p.grad.numpy(), g.allreduce(q.grad.numpy(), "mean"), rtol=1e-5, atol=1e-7):
            fails.append(f"gradient of {name} is not the ranks' average")
    ddp.close()
    return fails


@pytest.mark.parametrize("world", worlds("sim-2", "tcp-2", "mpi"), indirect=True)
def test_first_bucket_cap(world: World) -> None:
    check(world.run(body_first_bucket))


def body_bench(rank: int) -> list[str]:
    from hpcdp.bench import torch as bench
    from hpcdp.bench._common import JsonSink

    g = hpcdp.get_default_group()
    res = bench.bench_model(torch, None, g, "cnn", 8, 1, 1, JsonSink(None), breakdown=2)
    fails = []
    mpi = g.backend.native_comm() is not None
    keys = ["efficiency", "bound", "overhead"] + (["ceiling", "ceiling_step", "t_allreduce_ms"] if mpi else [])
    for k in keys:
        v = res.get(k)
        if v is None or not math.isfinite(v) or v <= 0:
            fails.append(f"{k} = {v!r}")
    if mpi:
        rows: dict[str, Any] = res.get("breakdown_ms", {})
        if set(rows) != {"plain torch", "plain + raw Allreduce", "hpcdp.DDP"}:
            fails.append(f"breakdown rows {sorted(rows)}")
        for k, v in rows.items():
            if len(v) != len(bench._PHASES) or not all(math.isfinite(t) and t >= 0 for t in v):
                fails.append(f"breakdown {k}: {v}")
        if rows and rows["plain + raw Allreduce"][bench._PHASES.index("comm")] <= 0:
            fails.append("the raw Allreduce was not timed")
    return fails


@pytest.mark.parametrize("world", worlds("sim-2", "mpi"), indirect=True)
def test_bench_torch_tiny(world: World) -> None:
    check(world.run(body_bench, timeout=120))

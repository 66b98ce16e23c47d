"""World-size-independent training (``deterministic_chunk``): the GPT example's model trained by
DDP, DDP + ZeRO-1 and FSDP (every strategy) on N ranks ends with the same parameters, to the bit,
as the same global batch trained on one rank. The one-rank reference runs on every rank, on a
group of that rank alone, so the comparison needs no second process and works under mpirun."""
from __future__ import annotations

import importlib.util
import pathlib
from typing import Any

import numpy as np
import pytest

import hpcdp
from hpcdp import nn, optim
from hpcdp.fsdp import FSDP
from hpcdp.testing import check
from hpcdp.testing.fixtures import World, worlds

_EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "03_fsdp_gpt.py"
_spec = importlib.util.spec_from_file_location("gpt_example", _EXAMPLE)
gpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpt)

STEPS, CHUNK, VOCAB, CONTEXT = 3, 2, 20, 8


def train(kind: str, group: Any, batch: int, chunk: int | None, bucket_mb: float = 25.0) -> str | None:
    """SHA-256 of the parameters after ``STEPS`` AdamW steps on ``batch`` windows per step,
    split evenly over ``group``; None on ranks that do not hold the full state (FSDP: rank 0 has
    it)."""
    n, r = group.size, group.rank
    nn.manual_seed(0)
    model = gpt.GPT(VOCAB, CONTEXT, 16, 2, 2, 0)
    if kind in ("ddp", "zero1"):
        par: Any = hpcdp.DDP(model, group=group, deterministic_chunk=chunk, bucket_cap_mb=bucket_mb)
        opt: Any = (optim.ZeroRedundancyOptimizer(par.parameters(), optim.AdamW, group=group, lr=1e-2)
                    if kind == "zero1" else optim.AdamW(par.parameters(), lr=1e-2))
    else:
        if kind == "hybrid_shard" and n == 1:   # the one-rank reference: nothing to shard
            kind = "full_shard"
        extra = {"shard_size": 2} if kind == "hybrid_shard" else {}
        par = FSDP(model, strategy=kind, group=group, auto_wrap={gpt.Block}, deterministic_chunk=chunk,
                   **extra)
        opt = optim.AdamW(par.parameters(), lr=1e-2)
    loss_fn = nn.CrossEntropyLoss()
    text = np.random.default_rng(1).integers(0, VOCAB, 500)
    for step in range(STEPS):
        starts = np.random.default_rng([7, step]).integers(0, 480, batch)
        x, y = gpt.windows(text, starts, CONTEXT)
        lo, hi = r * batch // n, (r + 1) * batch // n
        loss_fn(par(x[lo:hi]), y[lo:hi])
        par.backward(loss_fn.backward())
        if kind in ("ddp", "zero1"):
            nn.utils.clip_grad_norm_(list(par.parameters()), 0.5)
        else:
            par.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()
    return gpt.parameters_sha(par, "ddp" if kind in ("ddp", "zero1") else "fsdp")


def body_same_bits(rank: int, kind: str, chunk: int | None) -> list[str]:
    world = hpcdp.get_default_group()
    n = world.size
    batch = 12 if n == 3 else 16
    got = train(kind, world, batch, chunk)
    alone = world.split(rank)                       # every rank: the one-rank run, same batch
    want = train(kind, alone, batch, chunk)
    if got is None:
        return []
    if chunk is None:   # the control: plain reductions are expected to differ across world sizes
        return [] if n == 1 or got != want else [f"{kind} without chunks matched on {n} ranks"]
    return [] if got == want else [f"{kind} on {n} ranks: {got[:16]} != one rank's {want[:16]}"]


KINDS = ["ddp", "zero1", "full_shard", "shard_grad_op", "no_shard"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world", worlds("sim-1", "sim-2", "sim-3", "sim-4", "tcp-2", "mpi"),
                         indirect=True)
def test_parameters_bit_identical_to_one_rank(world: World, kind: str) -> None:
    check(world.run(body_same_bits, kind, CHUNK))


@pytest.mark.parametrize("world", worlds("sim-4", "sim-8", "mpi", mpi_min_size=4), indirect=True)
def test_hybrid_shard_and_eight_ranks(world: World) -> None:
    check(world.run(body_same_bits, "hybrid_shard", CHUNK))
    if world.size == 8 or world.is_mpi:
        check(world.run(body_same_bits, "ddp", CHUNK))


@pytest.mark.parametrize("world", worlds("sim-2"), indirect=True)
def test_without_chunks_world_sizes_differ(world: World) -> None:
    """The control: the property above is not a given; plain DDP on 2 ranks drifts from 1."""
    check(world.run(body_same_bits, "ddp", None))


def body_buckets_and_no_sync(rank: int) -> list[str]:
    """Bucket boundaries and gradient accumulation change no bit: two bucket sizes, and the
    batch fed as two no_sync halves plus one synced pass."""
    world = hpcdp.get_default_group()
    fails = []
    a = train("ddp", world, 16, CHUNK, bucket_mb=25.0)
    b = train("ddp", world, 16, CHUNK, bucket_mb=0.001)
    if a != b:
        fails.append("bucket size changed the parameters")
    n, r = world.size, rank
    nn.manual_seed(0)
    model = gpt.GPT(VOCAB, CONTEXT, 16, 2, 2, 0)
    ddp = hpcdp.DDP(model, deterministic_chunk=CHUNK)
    loss_fn = nn.CrossEntropyLoss()
    text = np.random.default_rng(1).integers(0, VOCAB, 500)
    x, y = gpt.windows(text, np.random.default_rng([7, 0]).integers(0, 480, 16), CONTEXT)
    lo, hi = r * 16 // n, (r + 1) * 16 // n
    mid = lo + (hi - lo) // 2
    with ddp.no_sync():
        loss_fn(ddp(x[lo:mid]), y[lo:mid])
        ddp.backward(loss_fn.backward())
    loss_fn(ddp(x[mid:hi]), y[mid:hi])
    ddp.backward(loss_fn.backward())
    split = {k: p.grad.copy() for k, p in model.named_parameters()}
    ddp.zero_grad()
    loss_fn(ddp(x[lo:hi]), y[lo:hi])
    ddp.backward(loss_fn.backward())
    for k, p in model.named_parameters():
        if not np.array_equal(p.grad.view(np.uint32), split[k].view(np.uint32)):
            fails.append(f"no_sync halves differ from one pass in {k}")
            break
    try:
        ddp(x[lo:lo + 1])
        fails.append("a batch that does not split into chunks was accepted")
    except ValueError as exc:
        if "chunks of 2" not in str(exc):
            fails.append(f"odd batch: {exc}")
    finally:
        nn.chunking.set_chunk_size(None)
    return fails


@pytest.mark.parametrize("world", worlds("sim-2", "sim-4", "mpi"), indirect=True)
def test_bucket_sizes_and_no_sync_change_no_bit(world: World) -> None:
    check(world.run(body_buckets_and_no_sync))


def test_the_checker_agrees_across_launchers() -> None:
    """``python -m hpcdp.bench determinism``'s check, small: the GPT example on simulated
    ranks, hpcdp-run (TCP) and mpirun, 1 and 2 ranks, DDP (two bucket sizes), ZeRO-1 and FSDP,
    with dropout on; one hash for every run."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "hpcdp.bench", "determinism", "--part", "check", "--steps", "3",
         "--worlds", "1,2", "--launchers", "sim,tcp,mpi", "--layers", "ddp,ddp:0.001,zero1,fsdp:full_shard",
         "--example-args", "--dim 16 --layers 1 --context 16 --heads 2"],
        capture_output=True, text=True, timeout=600, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "24 runs, 1 distinct hash(es): bit-identical" in out, out[-3000:]


def body_zero_grad_drops_kept_chunks(rank: int) -> list[str]:
    """A no_sync pass whose gradients are thrown away (zero_grad) leaves nothing behind: the next
    synced pass gives the gradient of its own batch alone, under DDP and FSDP."""
    world = hpcdp.get_default_group()
    n = world.size
    text = np.random.default_rng(1).integers(0, VOCAB, 500)
    x, y = gpt.windows(text, np.random.default_rng([7, 0]).integers(0, 480, 8), CONTEXT)
    lo, hi = rank * 8 // n, (rank + 1) * 8 // n
    fails = []
    for kind in ("ddp", "fsdp"):
        grads = []
        for skip_first in (False, True):
            nn.manual_seed(0)
            model = gpt.GPT(VOCAB, CONTEXT, 16, 2, 2, 0)
            par = hpcdp.DDP(model, deterministic_chunk=CHUNK) if kind == "ddp" else \
                FSDP(model, deterministic_chunk=CHUNK)
            loss_fn = nn.CrossEntropyLoss()
            if skip_first:
                with par.no_sync():
                    loss_fn(par(x[lo:hi][::-1].copy()), y[lo:hi][::-1].copy())
                    par.backward(loss_fn.backward())
                par.zero_grad()
            loss_fn(par(x[lo:hi]), y[lo:hi])
            par.backward(loss_fn.backward())
            grads.append([p.grad.copy() for p in par.parameters() if p.grad is not None])
        if len(grads[0]) != len(grads[1]) or any(
                not np.array_equal(a, b) for a, b in zip(grads[0], grads[1])):
            fails.append(f"{kind}: a discarded no_sync pass changed the next gradient")
    return fails


@pytest.mark.parametrize("world", worlds("sim-2", "mpi"), indirect=True)
def test_zero_grad_drops_kept_chunks(world: World) -> None:
    check(world.run(body_zero_grad_drops_kept_chunks))


def body_mode_under_plain_layers(rank: int) -> list[str]:
    """A deterministic group under DDP and FSDP without chunks: their asynchronous bucket and
    shard reductions take the exact path (complete at the call) and train as the plain mode
    does, up to rounding."""
    g = hpcdp.get_default_group()
    fails: list[str] = []
    for kind in ("ddp", "full_shard", "no_shard"):
        finals = []
        for mode in (False, True):
            g.deterministic = mode
            try:
                # own seeds: simulated ranks are threads, and the global generator is shared
                model = nn.Sequential(nn.Linear(8, 16, seed=1), nn.ReLU(), nn.Linear(16, 4, seed=2))
                par = hpcdp.DDP(model) if kind == "ddp" else FSDP(model, strategy=kind)
                opt = optim.SGD(par.parameters(), lr=0.1)
                loss_fn = nn.CrossEntropyLoss()
                rng = np.random.default_rng(rank)
                for _ in range(3):
                    x, y = rng.standard_normal((4, 8)), rng.integers(0, 4, 4)
                    loss_fn(par(x), y)
                    par.backward(loss_fn.backward())
                    opt.step()
                    opt.zero_grad()
                finals.append([p.data.copy() for p in par.parameters()])
            finally:
                g.deterministic = False
        if not all(np.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(*finals)):
            fails.append(f"{kind}: deterministic mode trained differently from the plain one")
    return fails


@pytest.mark.parametrize("world", worlds("sim-2", "tcp-2", "mpi"), indirect=True)
def test_deterministic_group_under_plain_ddp_and_fsdp(world: World) -> None:
    check(world.run(body_mode_under_plain_layers))

"""After FSDP construction each rank holds ~1/N of the model, on every backend (issue #20, item 7).

Construction broadcasts rank 0's parameters (packed per dtype, up to 64 MiB a message); a
backend that keeps a reference to a collective's buffers after the collective completes (a
worker thread's last task, a sender thread's last frame, a request kept by the group) keeps
a full copy of the model alive on rank 0 for the rest of the run. The bodies below measure, with
``tracemalloc`` (numpy reports its data buffers to it), what the process holds after
construction beyond what it held before the model was built: the shards (``memory_stats()``'s
``params``, padding included) plus a small, model-independent slack. TCP keeps no scratch
buffer between collectives: what a collective allocates is released when it completes.
"""
from __future__ import annotations

import gc
import threading
import tracemalloc
from typing import Any

import numpy as np
import pytest

import hpcdp
from conftest import run_ranks
from hpcdp.testing.fixtures import World, worlds
from hpcdp import nn
from hpcdp.fsdp import FSDP

pytestmark = pytest.mark.timeout(300)

#: bytes a rank may hold after construction beyond its shards: the group's bookkeeping, the
#: FSDP units' metadata, small collective scratch (recursive doubling, barrier tokens). Far
#: below the model size, so a full copy of any one layer cannot hide in it.
SLACK = 1 << 20


class MemNet(nn.Module):
    """Three float64 layers (4 MiB each) and a float32 one (2 MiB): two dtypes, two broadcasts."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(512, 1024, dtype=np.float64, seed=1)
        self.b = nn.Linear(1024, 512, dtype=np.float64, seed=2)
        self.c = nn.Linear(512, 1024, dtype=np.float64, seed=3)
        self.d = nn.Linear(1024, 512, dtype=np.float32, seed=4)

    def forward(self, x: Any) -> Any:
        return self.d(self.c(self.b(self.a(x))).astype(np.float32))

    def backward(self, g: Any) -> Any:
        return self.a.run_backward(self.b.run_backward(self.c.run_backward(
            self.d.run_backward(g).astype(np.float64))))


def _wrap() -> tuple[FSDP, int]:
    """The model and its FSDP (one unit per layer, so each unit has one dtype)."""
    model = MemNet()
    model_bytes = sum(int(p.data.nbytes) for _, p in model.named_parameters())
    fsdp = FSDP(model, strategy="full_shard", auto_wrap={nn.Linear})
    return fsdp, model_bytes


def _expected(fsdp: FSDP) -> int:
    """What one rank must hold: its flat shards (``params``: the documented padding included)."""
    return int(fsdp.memory_stats()["params"])


def body_process_held(rank: int) -> dict[str, int]:
    """One process per rank (TCP, MPI): this process's traced bytes after construction."""
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        fsdp, model_bytes = _wrap()
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    out = {"held": held, "own": _expected(fsdp), "model": model_bytes}
    hpcdp.barrier()  # no rank leaves (and finalizes) while a peer still measures
    return out


def _start_measuring(rank: int, sync: threading.Barrier) -> int:
    """Rank 0 starts tracemalloc with every rank waiting; its baseline (0 on the others)."""
    if rank == 0:
        gc.collect()
        tracemalloc.start()
    sync.wait()
    base = tracemalloc.get_traced_memory()[0] if rank == 0 else 0
    sync.wait()
    return base


def body_job_held(rank: int, sync: threading.Barrier, owns: dict[int, int]) -> dict[str, int]:
    """Sim: every rank is a thread of this process; rank 0 measures the whole job's bytes. The
    threads meet at ``sync``, not at a collective of the group: a later collective would
    replace (and so release) whatever the backend kept of the broadcast."""
    base = _start_measuring(rank, sync)
    fsdp, model_bytes = _wrap()
    owns[rank] = _expected(fsdp)
    sync.wait()
    out = {"held": 0, "own": sum(owns.values()), "model": model_bytes}
    if rank == 0:
        gc.collect()
        out["held"] = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
    sync.wait()  # the others keep their FSDP alive until rank 0 has measured
    del fsdp
    return out


def _check_held(results: list[dict[str, int]], n: int, ranks: list[int], share: int,
           slack: int) -> None:
    """``held`` of each of ``ranks`` is within ``slack`` of its shards, which are ``share`` of
    the model (1/N per process; the whole model for the sim job) up to padding."""
    fails = []
    for r in ranks:
        res = results[r]
        assert res["model"] >= 12 << 20, res
        assert res["model"] * share <= res["own"] * n <= res["model"] * share + (64 << 10) * n, res
        if res["held"] > res["own"] + slack:
            fails.append(f"rank {r} holds {res['held']:,} B after construction; its shards are "
                         f"{res['own']:,} B of a {res['model']:,} B model on {n} ranks "
                         f"(allowed slack {slack:,} B)")
    assert not fails, "\n".join(fails)


@pytest.mark.parametrize("world", worlds("tcp-2", "tcp-3", "mpi"), indirect=True)
def test_rank_holds_its_shards_only(world: World) -> None:
    """A rank of its own process (TCP, MPI) holds its shards and little else."""
    n = world.size
    _check_held(world.run(body_process_held, join_timeout=240), n, list(range(n)), 1, SLACK)


@pytest.mark.parametrize("algorithms", ["rendezvous", "p2p"])
@pytest.mark.parametrize("n", [2, 3])
def test_sim_job_holds_the_shards_only(n: int, algorithms: str, monkeypatch) -> None:
    """Sim's rendezvous, and ``HPCDP_SIM_ALGORITHMS=p2p`` (TCP's algorithms and worker thread)."""
    if algorithms == "p2p":
        monkeypatch.setenv("HPCDP_SIM_ALGORITHMS", "p2p")
    else:
        monkeypatch.delenv("HPCDP_SIM_ALGORITHMS", raising=False)
    # one process: the job's bytes are every rank's shards (``own`` is their sum) and slack each
    _check_held(run_ranks("sim", n, body_job_held, threading.Barrier(n, timeout=120), {},
                          join_timeout=240), n, [0], n, n * SLACK)


def body_kept_work(rank: int, sync: threading.Barrier, nbytes: int) -> int:
    """Sim: each rank keeps the ``Work`` of an 8 MiB broadcast; rank 0 measures the job's bytes
    beyond the ranks' own arrays. The rendezvous slot the work points to held every rank's
    buffer and a copy of the root's (the combined result) for as long as the work lived."""
    g = hpcdp.get_default_group()
    base = _start_measuring(rank, sync)
    buf = np.full(nbytes // 8, float(rank))
    work = g.broadcast(buf, root=0, async_op=True)
    work.wait()
    sync.wait()
    held = 0
    if rank == 0:
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base - g.size * buf.nbytes
        tracemalloc.stop()
    sync.wait()
    del work, buf
    return held


@pytest.mark.parametrize("n", [2, 3])
def test_sim_kept_work_does_not_keep_the_buffers(n: int, monkeypatch) -> None:
    monkeypatch.delenv("HPCDP_SIM_ALGORITHMS", raising=False)
    nbytes = 8 << 20
    held = run_ranks("sim", n, body_kept_work, threading.Barrier(n, timeout=120), nbytes,
                     join_timeout=240)[0]
    assert held <= SLACK, f"{held:,} B held beyond the ranks' {nbytes:,} B arrays"


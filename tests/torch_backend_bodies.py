"""torch.distributed over hpcdp (``init_process_group("hpcdp")``): bodies run on every rank of a
TCP or MPI world, each returning a list of failure strings.

Each body starts torch's default group on hpcdp's group of the world it runs in and destroys it
before returning: torch keeps one default group per process, which is why these bodies run in
processes (TCP) and MPI ranks, never on simulated ranks (threads of one process).
"""
from __future__ import annotations

import contextlib
import datetime
import os
import threading
import time
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist

import hpcdp
import hpcdp.torch_backend  # noqa: F401 - registers "hpcdp" with torch
from hpcdp.errors import CollectiveMismatchError, CommTimeoutError, HpcdpError

GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4 ranks
STEPS = 5
TOL = 1e-10
# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (the old names warn)
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


@contextlib.contextmanager
def torch_world(timeout: float = 60.0) -> Iterator[Any]:
    """torch's default group on the "hpcdp" backend, destroyed on the way out."""
    dist.init_process_group("hpcdp", init_method="hpcdp://",
                            timeout=datetime.timedelta(seconds=timeout))
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _rank_data(r: int, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """Rank ``r``'s values: small integers (exact in any summation order), distinct per rank."""
    n = int(np.prod(shape))
    return ((np.arange(n) * 3 + 7 * r) % 11 + 1 + r).reshape(shape).astype(dtype)


def body_collectives(rank: int, gave_up: str) -> list[str]:
    """Every collective torch's DDP and FSDP2 use, against a numpy reference, through torch's
    own API: in-place results, every op, async Work, strides, lists and the op refusals.
    ``gave_up``: a file (in a directory every rank sees) rank 0 writes once its short wait gave
    up, so that the other ranks join after it did."""
    bad: list[str] = []

    def expect(what: str, got: Any, want: Any) -> None:
        if isinstance(got, torch.Tensor):
            got = got.detach().to(torch.float64).numpy()
        got = np.asarray(got)
        if got.shape != np.shape(want) or not np.allclose(got, want, rtol=1e-12, atol=0):
            bad.append(f"rank {rank}: {what}: got {got.tolist()}, want {np.asarray(want).tolist()}")

    with torch_world() as pg:
        n = dist.get_world_size()
        if dist.get_backend() != "hpcdp" or pg.getBackendName() != "hpcdp":
            bad.append(f"rank {rank}: backend {dist.get_backend()!r} / {pg.getBackendName()!r}")
        if dist.get_rank() != rank or n != hpcdp.get_default_group().size:
            bad.append(f"rank {rank}: torch says rank {dist.get_rank()} of {n}")
        every = np.stack([_rank_data(r, (2, 3), np.float64) for r in range(n)])
        refs = {dist.ReduceOp.SUM: every.sum(0), dist.ReduceOp.AVG: every.mean(0),
                dist.ReduceOp.PRODUCT: every.prod(0), dist.ReduceOp.MIN: every.min(0),
                dist.ReduceOp.MAX: every.max(0)}
        for op, want in refs.items():
            t = torch.from_numpy(_rank_data(rank, (2, 3), np.float64))
            dist.all_reduce(t, op=op)
            expect(f"all_reduce {op}", t, want)
        ints = torch.from_numpy(_rank_data(rank, (5,), np.int64))
        dist.all_reduce(ints, op=dist.ReduceOp.MAX)
        expect("all_reduce int64 MAX", ints,
               np.stack([_rank_data(r, (5,), np.int64) for r in range(n)]).max(0))
        # a strided tensor (a transposed view) is reduced in place through its strides
        base = torch.from_numpy(_rank_data(rank, (3, 2), np.float64).copy())
        view = base.t()
        dist.all_reduce(view)
        expect("all_reduce of a transposed view", base,
               np.stack([_rank_data(r, (3, 2), np.float64) for r in range(n)]).sum(0))
        # async: the result is there once wait() returns
        a = torch.from_numpy(_rank_data(rank, (4,), np.float32))
        work = dist.all_reduce(a, async_op=True)
        work.wait()
        expect("async all_reduce float32", a,
               np.stack([_rank_data(r, (4,), np.float32) for r in range(n)]).sum(0))
        # wait(timeout=) gives up on waiting, not on the call: rank 0 waits too briefly for
        # ranks that join late, then waits again and gets the sum. "Late" is ordered by the
        # file rank 0 writes after its short wait, not by a fixed sleep: on a loaded machine
        # rank 0 reached its call more than a 0.5 s sleep after the others
        if rank != 0:
            deadline = time.monotonic() + 15  # (under the run's timeout: a crash shows as itself)
            while not os.path.exists(gave_up) and time.monotonic() < deadline:
                time.sleep(0.01)
        c = torch.full((2,), float(rank), dtype=torch.float64)
        work = dist.all_reduce(c, async_op=True)
        if rank == 0:
            try:
                work.wait(timeout=datetime.timedelta(seconds=0.05))
                bad.append("rank 0: wait(timeout=0.05 s) returned before the late ranks joined")
            except CommTimeoutError as exc:
                if "all_reduce" not in str(exc) and "allreduce" not in str(exc):
                    bad.append(f"rank 0: the short wait's error does not name the call: {exc}")
            finally:
                open(gave_up, "w").close()
        work.wait()
        expect("all_reduce after a short wait", c, np.full(2, n * (n - 1) / 2))
        fut = dist.all_reduce(torch.ones(3, dtype=torch.float64), async_op=True).get_future()
        expect("get_future().wait()", fut.wait()[0], np.full(3, float(n)))
        # bfloat16 (numpy lacks it): hpcdp's tensor rules, reduced in float32 and rounded once
        b = torch.full((4,), float(rank + 1), dtype=torch.bfloat16)
        dist.all_reduce(b)
        expect("all_reduce bfloat16", b, np.full(4, n * (n + 1) / 2))
        # broadcast from the last rank
        src = n - 1
        t = torch.from_numpy(_rank_data(rank, (7,), np.float64))
        dist.broadcast(t, src=src)
        expect("broadcast from the last rank", t, _rank_data(src, (7,), np.float64))
        # torch's list all_gather (DDP's parameter checks use it)
        outs = [torch.zeros(2, 3, dtype=torch.float64) for _ in range(n)]
        dist.all_gather(outs, torch.from_numpy(_rank_data(rank, (2, 3), np.float64)))
        for r in range(n):
            expect(f"all_gather part {r}", outs[r], _rank_data(r, (2, 3), np.float64))
        # all_gather_into_tensor / reduce_scatter_tensor (FSDP2's pair)
        out = torch.empty(n * 4, dtype=torch.float64)
        all_gather_single(out, torch.from_numpy(_rank_data(rank, (4,), np.float64)))
        expect("all_gather_into_tensor", out,
               np.concatenate([_rank_data(r, (4,), np.float64) for r in range(n)]))
        full = np.stack([_rank_data(r, (n * 3,), np.float64) for r in range(n)])
        for op, reduce in ((dist.ReduceOp.SUM, full.sum(0)), (dist.ReduceOp.AVG, full.mean(0))):
            part = torch.empty(3, dtype=torch.float64)
            reduce_scatter_single(part, torch.from_numpy(_rank_data(rank, (n * 3,), np.float64)),
                                  op=op)
            expect(f"reduce_scatter_tensor {op}", part, reduce[rank * 3:(rank + 1) * 3])
        dist.barrier()
        # refused, on every rank alike, before anything is sent
        try:
            dist.all_reduce(torch.ones(2, dtype=torch.int64), op=dist.ReduceOp.BAND)
            bad.append(f"rank {rank}: BAND was accepted")
        except (ValueError, RuntimeError) as exc:
            if "BAND" not in str(exc) and "hpcdp backend" not in str(exc):
                bad.append(f"rank {rank}: BAND refused with an unclear message: {exc}")
        # still in step after the refusal
        t = torch.ones(2, dtype=torch.float64)
        dist.all_reduce(t)
        expect("all_reduce after a refusal", t, np.full(2, float(n)))
        if not any(th.name.startswith("hpcdp-torch") for th in threading.enumerate()):
            bad.append(f"rank {rank}: no thread completes the group's calls")
    # destroy_process_group stops the group's completer thread
    deadline = time.monotonic() + 10
    while any(th.name.startswith("hpcdp-torch") for th in threading.enumerate()):
        if time.monotonic() > deadline:
            bad.append(f"rank {rank}: the completer thread outlived destroy_process_group")
            break
        time.sleep(0.01)
    return bad


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8),
                               torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    return [(torch.randn(GLOBAL_BATCH, 6, generator=g, dtype=torch.float64),
             torch.randn(GLOBAL_BATCH, 3, generator=g, dtype=torch.float64)) for _ in range(STEPS)]


def _reference() -> list[torch.Tensor]:
    """Plain single-process torch on the whole global batch: what the ranks must reproduce."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in _batches():
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _compare(rank: int, what: str, got: list[torch.Tensor], want: list[torch.Tensor]) -> list[str]:
    bad = []
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        err = float((g - w).abs().max())
        if not err <= TOL:
            bad.append(f"rank {rank}: {what}: parameter {i} differs from single-process torch "
                       f"by {err:.3g}")
    return bad


def body_ddp_parity(rank: int) -> list[str]:
    """torch's own DistributedDataParallel over "hpcdp": 5 SGD-momentum steps, the global batch
    split across ranks, equal (1e-10, float64) to one process of plain torch. Ranks start from
    different weights, so DDP's start-up broadcast must make them rank 0's; buckets are small,
    so each backward reduces several."""
    want = _reference()
    with torch_world():
        per = GLOBAL_BATCH // dist.get_world_size()
        model = _mlp()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(float(rank))  # undone by DDP's broadcast from rank 0
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=200 / 2**20)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        for x, y in _batches():
            opt.zero_grad()
            mine = slice(rank * per, (rank + 1) * per)
            torch.nn.functional.mse_loss(ddp(x[mine]), y[mine]).backward()
            opt.step()
        got = [p.detach().clone() for p in model.parameters()]
    return _compare(rank, "torch DDP over hpcdp", got, want)


def body_powersgd(rank: int) -> list[str]:
    """torch's PowerSGD comm hook, whose future callbacks post collectives and wait for them
    (they run on the thread that completes the first future: the backend's completer thread,
    which must then not wait for itself): 4 steps finish, and every rank holds the same
    parameters."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    with torch_world(timeout=30):
        n, per = dist.get_world_size(), GLOBAL_BATCH // dist.get_world_size()
        model = _mlp()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                       start_powerSGD_iter=2, warm_start=False)
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for x, y in _batches()[:4]:
            opt.zero_grad()
            mine = slice(rank * per, (rank + 1) * per)
            torch.nn.functional.mse_loss(ddp(x[mine]), y[mine]).backward()
            opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        every = [torch.empty_like(flat) for _ in range(n)]
        dist.all_gather(every, flat)
    start = torch.cat([p.detach().reshape(-1) for p in _mlp().parameters()])
    bad = [f"rank {rank}: rank {r}'s parameters differ by {float((e - flat).abs().max()):.3g}"
           for r, e in enumerate(every) if not float((e - flat).abs().max()) <= 1e-12]
    if float((flat - start).abs().max()) == 0:
        bad.append(f"rank {rank}: the parameters never moved")
    return bad


def body_fsdp2_parity(rank: int) -> list[str]:
    """torch's FSDP2 (``fully_shard``) on CPU over "hpcdp": parameters sharded over the ranks,
    gathered for forward and backward, gradients reduce-scattered; 5 SGD-momentum steps equal
    (1e-10) to one process of plain torch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    want = _reference()
    with torch_world():
        n, per = dist.get_world_size(), GLOBAL_BATCH // dist.get_world_size()
        model = _mlp()
        mesh = init_device_mesh("cpu", (n,))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for x, y in _batches():
            opt.zero_grad()
            mine = slice(rank * per, (rank + 1) * per)
            torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
            opt.step()
        shards = [p.to_local().numel() for p in model.parameters()]
        got = [p.full_tensor().detach().clone() for p in model.parameters()]
        full = [p.numel() for p in want]
        if n > 1 and sum(shards) >= sum(full):
            return [f"rank {rank}: parameters not sharded ({shards} of {full})"]
    return _compare(rank, "torch FSDP2 over hpcdp", got, want)


def body_skipped_allreduce(rank: int, timeout: float) -> list[str]:
    """Rank 1 skips an allreduce inside torch DDP's backward (a comm hook leaves it out): the
    other ranks raise hpcdp's CommTimeoutError within torch's timeout, naming the allreduce."""
    with torch_world(timeout=timeout):
        model = _mlp()
        ddp = torch.nn.parallel.DistributedDataParallel(model)

        def hook(state, bucket):  # type: ignore[no-untyped-def] - torch checks these annotations
            if rank == 1:  # left out: hand DDP the local gradients as if reduced
                fut: torch.futures.Future = torch.futures.Future()
                fut.set_result(bucket.buffer())
                return fut
            return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(
                lambda f: f.value()[0])

        ddp.register_comm_hook(None, hook)
        x, y = _batches()[0]
        t0 = time.monotonic()
        try:
            torch.nn.functional.mse_loss(ddp(x), y).backward()
        except (CommTimeoutError, RuntimeError) as exc:
            took = time.monotonic() - t0
            if rank == 1:
                return [f"rank 1 (which skipped) raised: {exc}"]
            text = f"{type(exc).__name__}: {exc}"
            # through DDP's C++ reducer the error arrives as a RuntimeError quoting hpcdp's
            if not isinstance(exc, CommTimeoutError) and "CommTimeoutError" not in text:
                return [f"rank {rank}: not hpcdp's timeout: {text}"]
            if "allreduce" not in text or "timed out" not in text:
                return [f"rank {rank}: the timeout does not name the allreduce: {text}"]
            if not timeout * 0.9 <= took <= timeout + 10:
                return [f"rank {rank}: raised after {took:.1f} s, timeout {timeout} s"]
            return []
        if rank == 1:
            # stay until the others have timed out: leaving would be noticed sooner (a peer
            # that shut down), which is not what this test is about
            time.sleep(timeout + 2)
            return []
        return [f"rank {rank}: an allreduce rank 1 skipped went unnoticed"]


def body_refusals(rank: int) -> list[str]:
    """What the backend refuses rather than gets wrong: torch told another rank than hpcdp's
    (refused at init, naming both), a sub-group of only some ranks, and, with hpcdp's
    cross-rank checks on (``debug = "detail"``), an all_reduce whose shapes differ between
    ranks (CollectiveMismatchError on every rank, before any data moves)."""
    bad: list[str] = []
    n = hpcdp.get_default_group().size
    wrong = (rank + 1) % n
    try:
        dist.init_process_group("hpcdp", store=dist.HashStore(), rank=wrong, world_size=n)
        bad.append(f"rank {rank}: torch rank {wrong} on hpcdp rank {rank} was accepted")
    except (HpcdpError, RuntimeError) as exc:
        if f"torch's rank {wrong} of {n} is not hpcdp's rank {rank}" not in str(exc):
            bad.append(f"rank {rank}: unclear refusal: {exc}")
    if dist.is_initialized():
        dist.destroy_process_group()
    with torch_world(timeout=30) as pg:
        # a sub-group of some ranks: torch asks only its members (here rank 0) to build it
        try:
            sub = dist.new_group([0])
            if rank == 0:
                bad.append(f"rank 0: a torch sub-group of rank 0 alone was accepted: {sub}")
        except NotImplementedError as exc:
            if rank != 0 or "sub-group of 1 of" not in str(exc):
                bad.append(f"rank {rank}: unexpected refusal of new_group([0]): {exc}")
        pg.hpcdp_group.debug = "detail"
        t = torch.ones(3 + (rank == 0), dtype=torch.float64)
        try:
            dist.all_reduce(t)
            bad.append(f"rank {rank}: all_reduce of shapes (4,) and (3,) went unnoticed")
        except CollectiveMismatchError as exc:
            if "allreduce" not in str(exc):
                bad.append(f"rank {rank}: the mismatch does not name the allreduce: {exc}")
    return bad


def main() -> int:
    """A job of its own (``hpcdp-run -n 2 tests/torch_backend_bodies.py``, or the same under
    ``mpirun``): hpcdp is not started, so torch's ``hpcdp://`` rendezvous starts it from the
    environment. Torch DDP's parity, then the skipped allreduce (which leaves the flight
    recorder's dump behind in ``HPCDP_TRACE_DIR``); one line per rank, exit status 1 on failure."""
    import sys

    if hpcdp.is_initialized():
        print("hpcdp was started before torch", file=sys.stderr)
        return 1
    with torch_world():
        rank = dist.get_rank()
    bad = body_ddp_parity(rank) + body_skipped_allreduce(rank, 1.0)
    print(f"torch_backend job rank {rank}: " + ("ok" if not bad else "; ".join(bad)), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Training that survives failures and preemption: resume from the newest checkpoint, save on SIGUSR1.

    hpcdp-run -n 4 --max-restarts 1 examples/06_resume.py --crash-at 5    # rank 1 fails once
    sbatch jobs/preempt_requeue.sbatch          # Slurm: preempted, saved, requeued, resumed

Every run starts from ``hpcdp.checkpoint.latest(--ckpt-dir)`` when there is one. The batch of
step ``s`` is a function of ``s`` and the seed alone, and the checkpoint holds the model, Adam's
state and the step, so a run that crashed or was preempted and resumed ends with bit-identical
parameters to one that never stopped. ``hpcdp.checkpoint.on_preempt`` turns SIGUSR1 (Slurm's
``--signal=USR1@60``) into a save at the next step boundary, a ``scontrol requeue`` under Slurm,
and exit 0.

Fault injection, to see it work: ``--crash-at S`` makes ``--crash-rank`` raise before step S, and
``--self-preempt-at S`` makes rank 0 signal the job after step S (``scancel --signal=USR1`` under
Slurm, its own process otherwise); both only on a job's first run, not after a restart/requeue.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from typing import Any

import numpy as np

import hpcdp
from hpcdp import nn, optim
from hpcdp.checkpoint.preempt import on_preempt, restart_count, slurm_job_id
from hpcdp.data import DistributedSampler


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="optimizer steps in all")
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-dir", default="checkpoints/resume")
    p.add_argument("--save-every", type=int, default=50, help="0: only when preempted")
    p.add_argument("--keep", type=int, default=2, help="checkpoints kept")
    p.add_argument("--out", default=None, help="rank 0 writes the final parameters here (.npz)")
    p.add_argument("--crash-at", type=int, default=None, help="fail before this step (first run)")
    p.add_argument("--crash-rank", type=int, default=1)
    p.add_argument("--self-preempt-at", type=int, default=None,
                   help="rank 0 sends SIGUSR1 to the job after this step (first run)")
    p.add_argument("--step-time", type=float, default=0.0,
                   help="seconds each step sleeps, to stand for a bigger model")
    return p.parse_args(argv)


def make_data(seed: int, n: int = 2048, dim: int = 32, classes: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """Points labelled by a fixed random linear teacher: learnable, deterministic, no download."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, dim)).astype(np.float32)
    teacher = rng.standard_normal((dim, classes))
    y = (x @ teacher + 0.3 * rng.standard_normal((n, classes))).argmax(axis=1).astype(np.int64)
    return x, y


def _signal_job(preempt: Any) -> None:
    """Rank 0 plays the scheduler: SIGUSR1 to every task (Slurm) or to itself, then waits for it."""
    job = slurm_job_id()
    if job is not None:
        subprocess.run(["scancel", "--signal=USR1", job], check=True, timeout=60,
                       stdin=subprocess.DEVNULL)
    else:
        os.kill(os.getpid(), signal.SIGUSR1)
    deadline = time.monotonic() + 60
    while not preempt.requested:  # so the very next boundary sees it
        if time.monotonic() > deadline:
            raise RuntimeError("06_resume: rank 0: SIGUSR1 did not arrive within 60 s")
        time.sleep(0.01)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train to ``--steps``, resuming and saving as described above; return the final state."""
    args = parse_args(argv)
    hpcdp.init()
    rank, world = hpcdp.rank(), hpcdp.world_size()
    x, y = make_data(args.seed)
    model = nn.Sequential(nn.Linear(x.shape[1], 64, seed=args.seed), nn.ReLU(),
                          nn.Linear(64, 4, seed=args.seed + 1))
    ddp = hpcdp.DDP(model)
    opt = optim.Adam(ddp.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()
    sampler = DistributedSampler(len(y), shuffle=True, seed=args.seed)
    per_epoch = sampler.num_batches(args.batch_size)

    def state(step: int) -> dict[str, Any]:
        return {"model": ddp.state_dict(), "optim": opt.state_dict(), "step": step}

    step, saved, resumed_from = 0, -1, None
    path = hpcdp.checkpoint.latest(args.ckpt_dir)
    if path is not None:
        loaded = hpcdp.checkpoint.load(path, like=state(0))
        ddp.load_state_dict(loaded["model"])
        opt.load_state_dict(loaded["optim"])
        step = saved = int(loaded["step"])
        resumed_from = path
    if rank == 0:
        how = f"resumed from {path} at step {step}" if path else "starting at step 0"
        print(f"run {restart_count()} on {world} rank(s): {how}", flush=True)

    def save() -> None:
        nonlocal saved
        if saved != step:  # a preemption right after a periodic save has nothing new
            hpcdp.checkpoint.save(os.path.join(args.ckpt_dir, f"step-{step}"), state(step),
                                  keep_last=args.keep)
            saved = step
            if rank == 0:
                print(f"saved step-{step}", flush=True)

    preempt = on_preempt(save)
    first_run = restart_count() == 0
    loss = float("nan")
    while step < args.steps:
        if first_run and step == args.crash_at and rank == args.crash_rank:
            raise RuntimeError(f"06_resume: rank {rank}: injected failure before step {step}")
        epoch, i = divmod(step, per_epoch)
        sampler.set_epoch(epoch)
        idx = next(b for j, b in enumerate(sampler.batches(args.batch_size)) if j == i)
        out = ddp(x[idx])
        loss = float(loss_fn(out, y[idx]))
        ddp.backward(loss_fn.backward())
        opt.step()
        opt.zero_grad()
        step += 1
        if args.step_time:
            time.sleep(args.step_time)
        if args.save_every and step % args.save_every == 0:
            save()
        if first_run and step == args.self_preempt_at and rank == 0:
            _signal_job(preempt)
        preempt.check()  # the step boundary: a preemption saves, requeues and exits here
    preempt.close()

    params = {k: np.array(v, copy=True) for k, v in model.state_dict().items()}
    checksum = float(sum(np.abs(v).sum() for v in params.values()))
    if rank == 0:
        print(f"done: {step} steps, last loss {loss:.4f}, parameter checksum {checksum:.6f}",
              flush=True)
        if args.out:
            np.savez(args.out, **params)
    return {"step": step, "params": params, "resumed_from": resumed_from}


if __name__ == "__main__":
    main(sys.argv[1:])
    hpcdp.finalize()

"""A DDP job that checkpoints every few steps on the shared directory and resumes from the newest
checkpoint: what ``test_link_cut.py`` runs under ``hpcdp-run --max-restarts`` on every node.

    hpcdp-run -n 2 --nnodes 2 --node-rank K --master-addr hpcdp-n0 --max-restarts 1 \\
        train_link.py CKPT_DIR STEPS SAVE_EVERY STEP_TIME

Every blocking call runs under the job's ``HPCDP_TIMEOUT`` (no longer timeout of its own), so a
rank cut off from the others fails within it. Rank 0 prints one line per checkpoint, where it
started from, and a checksum of the final parameters (which a run that never stopped also gives:
the batch of step s depends on s alone).
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

import hpcdp
from hpcdp import nn, optim


def main(ckpt: str, steps: int, save_every: int, step_time: float) -> None:
    hpcdp.init()
    rank, world = hpcdp.rank(), hpcdp.world_size()
    model = nn.Sequential(nn.Linear(16, 32, seed=1), nn.ReLU(), nn.Linear(32, 4, seed=2))
    ddp = hpcdp.DDP(model)
    opt = optim.SGD(ddp.parameters(), lr=0.05)
    loss_fn = nn.CrossEntropyLoss()

    def state(step: int) -> dict:
        return {"model": ddp.state_dict(), "optim": opt.state_dict(), "step": step}

    step = 0
    path = hpcdp.checkpoint.latest(ckpt)
    if path is not None:
        loaded = hpcdp.checkpoint.load(path, like=state(0))
        ddp.load_state_dict(loaded["model"])
        opt.load_state_dict(loaded["optim"])
        step = int(loaded["step"])
    if rank == 0:
        print(f"attempt {os.environ.get('HPCDP_RESTART_COUNT', '0')} on {world} ranks: "
              f"{'resumed from ' + os.path.basename(path) if path else 'fresh'} at step {step}",
              flush=True)
    while step < steps:
        rng = np.random.default_rng(1000 * step + rank)
        x = rng.standard_normal((8, 16)).astype(np.float32)
        y = rng.integers(0, 4, 8)
        loss_fn(ddp(x), y)
        ddp.backward(loss_fn.backward())
        opt.step()
        opt.zero_grad()
        step += 1
        time.sleep(step_time)
        if step % save_every == 0:
            hpcdp.checkpoint.save(os.path.join(ckpt, f"step-{step}"), state(step), keep_last=2)
            if rank == 0:
                print(f"saved step-{step}", flush=True)
    total = float(sum(np.abs(v).sum() for v in model.state_dict().values()))
    if rank == 0:
        print(f"done: {steps} steps, checksum {total:.9f}", flush=True)
    hpcdp.finalize()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))

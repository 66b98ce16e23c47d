"""Train a small torch CNN on scikit-learn's digits (8x8 images, no download) with hpcdp.DDP or FSDP.

A torch user's loop, unchanged but for one wrapper: ``torch.optim.AdamW``, ``loss.backward()``
(gradients are averaged, or reduced into the shards, when it returns), ``opt.step()``. hpcdp
carries the gradients over MPI, TCP or simulated ranks, with its timeouts, mismatch checks and
flight recorder:

    python examples/07_torch_cnn.py                                    # one simulated rank
    mpirun -n 4 python -m hpcdp.run examples/07_torch_cnn.py           # DDP on 4 MPI ranks
    mpirun -n 4 python -m hpcdp.run examples/07_torch_cnn.py --parallel fsdp --strategy full_shard
    hpcdp-run -n 4 examples/07_torch_cnn.py                            # TCP ranks

Each rank trains on its DistributedSampler shard (``--batch-size`` per rank). Prints
``test accuracy: 0.9xxx``; ``--check`` exits with status 1 below 0.95. ``--ckpt-dir`` saves the
model and AdamW's state at the end with ``hpcdp.checkpoint`` (parallel HDF5, loadable at any world
size and into a plain torch module).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

import hpcdp
from hpcdp.data import DistributedSampler
from hpcdp.progress import progress

TEST_FRACTION = 0.2


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parallel", choices=["ddp", "fsdp"], default="ddp")
    p.add_argument("--strategy", default="full_shard",
                   help="FSDP strategy: full_shard, shard_grad_op, no_shard, hybrid_shard")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=16, help="per rank")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="exit 1 if test accuracy < 0.95")
    p.add_argument("--ckpt-dir", default=None, help="save model and optimizer here at the end")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def load_data(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Digits as (N, 1, 8, 8) float32 images, split train/test by ``seed``, standardised."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(y))
    n_test = int(len(y) * TEST_FRACTION)
    test, train = order[:n_test], order[n_test:]
    x = ((x - x[train].mean()) / x[train].std()).astype(np.float32).reshape(-1, 1, 8, 8)
    y = y.astype(np.int64)
    return (torch.from_numpy(x[train]), torch.from_numpy(y[train]),
            torch.from_numpy(x[test]), torch.from_numpy(y[test]))


def build_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)   # every rank builds the same model (DDP/FSDP broadcast rank 0's anyway)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(inplace=True), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(inplace=True), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(32 * 2 * 2, 64), torch.nn.ReLU(inplace=True),
        torch.nn.Linear(64, 10),
    )


def wrap(model: torch.nn.Module, args: argparse.Namespace) -> Any:
    if args.parallel == "ddp":
        return hpcdp.DDP(model)
    # one FSDP unit per layer with parameters: each is gathered only around its own compute
    return hpcdp.FSDP(model, strategy=args.strategy,
                      auto_wrap={torch.nn.Conv2d, torch.nn.Linear})


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train and evaluate; return the test accuracy, steps and world size."""
    args = parse_args(argv)
    hpcdp.init()
    rank, world = hpcdp.rank(), hpcdp.world_size()
    # ranks of one node share its cores: one torch thread each unless cores are to spare
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // (hpcdp.local_world_size() or world)))
    x_train, y_train, x_test, y_test = load_data(args.seed)

    model = wrap(build_model(args.seed), args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sampler = DistributedSampler(len(y_train), shuffle=True, seed=args.seed)
    per_epoch = sampler.num_batches(args.batch_size)

    step = 0
    bar = progress(total=args.epochs * per_epoch, desc=f"{args.parallel} ({world} ranks)",
                   disable=args.no_progress)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        running = None
        for idx in sampler.batches(args.batch_size):
            idx = torch.from_numpy(np.asarray(idx))
            loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
            loss.backward()          # gradients averaged (DDP) or reduced into shards (FSDP) here
            opt.step()
            opt.zero_grad()
            step += 1
            value = loss.item()
            running = value if running is None else 0.9 * running + 0.1 * value
            bar.set_postfix(epoch=epoch, loss=f"{running:.3f}", refresh=False)
            bar.update()
    bar.close()

    model.eval()
    with torch.no_grad():
        acc = float((model(x_test).argmax(dim=1) == y_test).float().mean())
    model.train()
    if args.ckpt_dir:
        import hpcdp.checkpoint as ckpt
        ckpt.save(os.path.join(args.ckpt_dir, f"step-{step}"),
                  {"model": model.state_dict(), "optim": model.optim_state_dict(opt), "step": step})
    if rank == 0:
        print(f"test accuracy: {acc:.4f}  ({world} rank(s), {args.parallel}"
              f"{'/' + args.strategy if args.parallel == 'fsdp' else ''}, {step} steps)", flush=True)
    if args.check and acc < 0.95:
        raise SystemExit(1)
    return {"test_accuracy": acc, "step": step, "world_size": world}


if __name__ == "__main__":
    main(sys.argv[1:])
    hpcdp.finalize()

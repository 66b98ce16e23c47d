"""Train an MLP on scikit-learn's bundled digits (8x8 images, no download) with DDP.

Runs unchanged on any backend:
    python examples/02_ddp_train.py                       # one simulated rank
    mpirun -n 4 python -m hpcdp.run examples/02_ddp_train.py
    hpcdp-run -n 4 examples/02_ddp_train.py               # TCP ranks

Each rank trains on its DistributedSampler shard with a per-rank batch of ``--batch-size``; DDP
averages gradients, so every rank holds the same model. Prints ``test accuracy: 0.97xx``;
``--check`` exits with status 1 below 0.95.

Checkpoints (``--ckpt-dir DIR --save-every N``, then ``--resume``) hold the model, the optimizer
(including Adam's step counts), the epoch and the position inside it; the sampler's order is a
function of (seed, epoch), and the model has no dropout, so a resumed run ends with bit-identical
parameters to an uninterrupted one.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import numpy as np

import hpcdp
from hpcdp import nn, optim
from hpcdp.data import DistributedSampler
from hpcdp.progress import progress

TEST_FRACTION = 0.2


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=16, help="per rank")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--check", action="store_true", help="exit 1 if test accuracy < 0.95")
    p.add_argument("--ckpt-dir", default=None, help="directory for checkpoints")
    p.add_argument("--save-every", type=int, default=0, help="save every N optimizer steps")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: no limit)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def load_data(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Digits, split train/test by ``seed``, standardised with the training statistics."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(y))
    n_test = int(len(y) * TEST_FRACTION)
    test, train = order[:n_test], order[n_test:]
    mean, std = x[train].mean(axis=0), x[train].std(axis=0)
    std[std == 0] = 1.0   # corner pixels are always blank
    x = ((x - mean) / std).astype(np.float32)
    return x[train], y[train].astype(np.int64), x[test], y[test].astype(np.int64)


def build_model(hidden: int, seed: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, hidden, seed=seed), nn.ReLU(),
        nn.Linear(hidden, hidden, seed=seed + 1), nn.ReLU(),
        nn.Linear(hidden, 10, seed=seed + 2),
    )


def _checkpoint_module(given: Any) -> Any:
    if given is not None:
        return given
    try:
        import hpcdp.checkpoint as ckpt
    except ImportError as exc:
        raise SystemExit(f"--ckpt-dir/--resume need hpcdp.checkpoint, which is not available: {exc}")
    return ckpt


def main(argv: list[str] | None = None, *, checkpoint: Any = None) -> dict[str, Any]:
    """Train and evaluate; return the accuracy, the step counts, the checkpoint resumed from (or
    None) and the final parameters.

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``).
        checkpoint: a module with ``save``, ``load``, ``latest`` (default ``hpcdp.checkpoint``).
    """
    args = parse_args(argv)
    hpcdp.init()
    rank, world = hpcdp.rank(), hpcdp.world_size()
    x_train, y_train, x_test, y_test = load_data(args.seed)

    model = build_model(args.hidden, args.seed)
    ddp = hpcdp.DDP(model)
    opt = optim.Adam(ddp.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()
    sampler = DistributedSampler(len(y_train), shuffle=True, seed=args.seed)
    per_epoch = sampler.num_batches(args.batch_size)

    ckpt = None
    if args.ckpt_dir or args.resume:
        if not args.ckpt_dir:
            raise SystemExit("--resume needs --ckpt-dir")
        ckpt = _checkpoint_module(checkpoint)

    def state(epoch: int, batch: int, step: int) -> dict[str, Any]:
        return {"model": ddp.state_dict(), "optim": opt.state_dict(), "step": step,
                "epoch": epoch, "batch": batch}

    step, start_epoch, start_batch, resumed_from = 0, 0, 0, None
    if args.resume:
        path = ckpt.latest(args.ckpt_dir)
        if path is not None:
            loaded = ckpt.load(path, like=state(0, 0, 0))
            ddp.load_state_dict(loaded["model"])
            opt.load_state_dict(loaded["optim"])
            step, start_epoch, start_batch = int(loaded["step"]), int(loaded["epoch"]), int(loaded["batch"])
            resumed_from = path
            if rank == 0:
                print(f"resumed from {path} at step {step} (epoch {start_epoch}, batch {start_batch})")
    start_step = step

    bar = progress(total=args.epochs * per_epoch, initial=step, desc=f"train ({world} ranks)",
                   disable=args.no_progress)
    stop = False
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        seen = correct = 0
        running = 0.0
        for i, idx in enumerate(sampler.batches(args.batch_size)):
            if epoch == start_epoch and i < start_batch:
                continue
            out = ddp(x_train[idx])
            loss = loss_fn(out, y_train[idx])
            ddp.backward(loss_fn.backward())
            opt.step()
            opt.zero_grad()
            step += 1
            running = 0.9 * running + 0.1 * float(loss) if seen else float(loss)
            correct += int((out.argmax(axis=1) == y_train[idx]).sum())
            seen += len(idx)
            bar.set_postfix(epoch=epoch, loss=f"{running:.3f}", acc=f"{correct / seen:.3f}", refresh=False)
            bar.update()
            if ckpt is not None and args.save_every and step % args.save_every == 0:
                nxt = (epoch, i + 1) if i + 1 < per_epoch else (epoch + 1, 0)
                ckpt.save(os.path.join(args.ckpt_dir, f"step-{step}"), state(nxt[0], nxt[1], step))
            if args.max_steps and step >= args.max_steps:
                stop = True
                break
        if stop:
            break
    bar.close()

    ddp.eval()
    acc = float((ddp(x_test).argmax(axis=1) == y_test).mean())
    ddp.train()
    if rank == 0:
        print(f"test accuracy: {acc:.4f}  ({world} rank(s), {step} steps)", flush=True)
    if args.check and acc < 0.95:
        raise SystemExit(1)
    return {"test_accuracy": acc, "step": step, "world_size": world,
            # what --resume did: the checkpoint and step it started from, the steps run here
            "resumed_from": resumed_from, "start_step": start_step, "steps_run": step - start_step,
            "params": {k: np.array(v, copy=True) for k, v in model.state_dict().items()}}


if __name__ == "__main__":
    main(sys.argv[1:])
    hpcdp.finalize()

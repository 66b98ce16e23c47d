"""A parameter server with hpcdp.rpc: asynchronous SGD on scikit-learn's digits (no download).

Rank 0 is the server: it holds the model and its Adam optimizer in a ``ParameterServer``
object created with ``rpc.remote`` (an RRef it owns) and hands that RRef to every other rank.
Each trainer, on its own shard, pulls the current parameters, computes a gradient on a batch
and pushes it; the server applies each gradient as it arrives, so trainers never wait for one
another (staleness is at most one step per trainer). The server then reports test accuracy.

    mpirun -n 4 python -m hpcdp.run examples/05_parameter_server.py
    hpcdp-run -n 4 examples/05_parameter_server.py           # TCP ranks
    python examples/05_parameter_server.py                   # one rank trains against itself

Prints ``test accuracy: 0.97xx``; ``--check`` exits with status 1 below 0.95.
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from typing import Any

import numpy as np

import hpcdp
import hpcdp.rpc as rpc
from hpcdp import nn, optim

TEST_FRACTION = 0.2


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=10, help="passes of each trainer over its shard")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="exit 1 if test accuracy < 0.95")
    return p.parse_args(argv)


def load_data(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Digits, split train/test by ``seed``, standardised with the training statistics."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(y))
    n_test = int(len(y) * TEST_FRACTION)
    test, train = order[:n_test], order[n_test:]
    mean, std = x[train].mean(axis=0), x[train].std(axis=0)
    std[std == 0] = 1.0
    x = ((x - mean) / std).astype(np.float32)
    return x[train], y[train].astype(np.int64), x[test], y[test].astype(np.int64)


def build_model(hidden: int, seed: int) -> nn.Module:
    return nn.Sequential(nn.Linear(64, hidden, seed=seed), nn.ReLU(),
                         nn.Linear(hidden, 10, seed=seed + 1))


@rpc.register
class ParameterServer:
    """The model and its optimizer; trainers call ``pull`` and ``push`` on it concurrently."""

    def __init__(self, hidden: int, seed: int, lr: float) -> None:
        self.model = build_model(hidden, seed)
        self.params = dict(self.model.named_parameters())
        self.opt = optim.Adam(self.model.parameters(), lr=lr)
        self.lock = threading.Lock()
        self.steps = 0

    def pull(self) -> dict[str, np.ndarray]:
        """A copy of the parameters (results are sent from the arrays returned, so never the
        live ones that ``push`` updates)."""
        with self.lock:
            return {k: p.data.copy() for k, p in self.params.items()}

    def push(self, grads: dict[str, np.ndarray]) -> int:
        """Apply one trainer's gradient at once (asynchronous SGD); returns the step count."""
        with self.lock:
            for k, p in self.params.items():
                p.grad = grads[k]
            self.opt.step()
            self.opt.zero_grad()
            self.steps += 1
            return self.steps

    def accuracy(self, x: np.ndarray, y: np.ndarray) -> float:
        with self.lock:
            self.model.eval()
            acc = float((self.model(x).argmax(axis=1) == y).mean())
            self.model.train()
            return acc


@rpc.register
def train(ps: rpc.RRef, shard: int, n_shards: int, epochs: int, batch: int, hidden: int,
          seed: int) -> dict[str, Any]:
    """A trainer's loop: pull, forward, backward, push; on shard ``shard`` of ``n_shards``."""
    x, y, _, _ = load_data(seed)
    idx = np.arange(shard, len(y), n_shards)
    model = build_model(hidden, seed)
    loss_fn = nn.CrossEntropyLoss()
    rng = np.random.default_rng(seed + 1000 * shard)
    steps, loss = 0, float("nan")
    for _ in range(epochs):
        order = rng.permutation(idx)
        for i in range(0, len(order), batch):
            b = order[i:i + batch]
            model.load_state_dict(ps.rpc_sync().pull())
            out = model(x[b])
            loss = float(loss_fn(out, y[b]))
            model.zero_grad()
            model.backward(loss_fn.backward())
            ps.rpc_sync().push({k: p.grad for k, p in model.named_parameters()})
            steps += 1
    return {"steps": steps, "last_loss": loss}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train and evaluate; return the accuracy (every rank gets it) and the step counts."""
    args = parse_args(argv)
    hpcdp.init()
    rank, world = hpcdp.rank(), hpcdp.world_size()
    rpc.init_rpc("ps" if rank == 0 else f"trainer{rank}", rpc_timeout=600)
    result: dict[str, Any] = {}
    if rank == 0:
        t0 = time.perf_counter()
        ps = rpc.remote("ps", ParameterServer, args=(args.hidden, args.seed, args.lr))
        job = (args.epochs, args.batch_size, args.hidden, args.seed)
        if world == 1:
            stats = [train(ps, 0, 1, *job)]
        else:
            futs = [rpc.rpc_async(f"trainer{r}", train, args=(ps, r - 1, world - 1, *job))
                    for r in range(1, world)]
            stats = [f.wait() for f in futs]
        _, _, x_test, y_test = load_data(args.seed)
        acc = ps.rpc_sync().accuracy(x_test, y_test)
        server_steps = ps.local_value().steps
        print(f"test accuracy: {acc:.4f}  ({max(world - 1, 1)} trainer(s), {server_steps} "
              f"asynchronous updates, {time.perf_counter() - t0:.1f} s)", flush=True)
        result = {"test_accuracy": acc, "updates": server_steps, "trainers": stats}
        del ps
        for r in range(1, world):
            rpc.rpc_sync(f"trainer{r}", _set_result, args=(acc,))
    rpc.shutdown()
    if rank != 0:
        result = {"test_accuracy": _RESULT.get("acc")}
    if args.check and not (result["test_accuracy"] or 0) >= 0.95:
        raise SystemExit(1)
    return result


_RESULT: dict[str, float] = {}


@rpc.register
def _set_result(acc: float) -> None:
    """The server tells each trainer the final accuracy (so ``--check`` works on every rank)."""
    _RESULT["acc"] = acc


if __name__ == "__main__":
    main(sys.argv[1:])
    hpcdp.finalize()

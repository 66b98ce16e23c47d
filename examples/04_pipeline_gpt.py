"""Train a small character-level GPT split into pipeline stages, and check it against one process.

Runs unchanged on any backend:
    python examples/04_pipeline_gpt.py                              # 4 simulated ranks (threads)
    mpirun -n 4 python -m hpcdp.run examples/04_pipeline_gpt.py     # 4 pipeline stages
    mpirun -n 4 python -m hpcdp.run examples/04_pipeline_gpt.py --dp 2   # 2 stages x 2 replicas
    hpcdp-run -n 4 examples/04_pipeline_gpt.py --schedule zero_bubble

The text is Python's own documentation (``pydoc_data.topics``, part of the standard library: no
download). The model is a ``Sequential`` of a token + position embedding, pre-norm transformer
blocks (causal multi-head attention after an RMSNorm, a GELU MLP after a LayerNorm), a final
LayerNorm and the vocabulary head; ``PipelineStage`` cuts it between those children, balanced by
parameter count. Every replica takes its part of each global batch.

Rank 0 also trains the unpipelined model on the whole global batches, with the same optimizer,
and prints both loss curves side by side: in float64 they agree to rounding (the pipeline only
changes the order in which microbatch gradients are summed). ``--check`` exits with status 1 if
they differ by more than 1e-6 or the loss did not go down.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np

import hpcdp
import hpcdp.pipeline as pipeline
from hpcdp import nn, optim


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas (ranks = stages x dp)")
    p.add_argument("--schedule", default="1f1b", choices=pipeline.available_schedules())
    p.add_argument("--virtual", type=int, default=1, help="stages per rank (interleaved_1f1b)")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per replica per step")
    p.add_argument("--block", type=int, default=32, help="context length")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dtype", default="float64", choices=["float32", "float64"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sim-ranks", type=int, default=4,
                   help="ranks to simulate when started without a launcher")
    p.add_argument("--check", action="store_true", help="exit 1 unless the curves match")
    return p.parse_args(argv)


# -- data -------------------------------------------------------------------------------------------
def load_text() -> tuple[np.ndarray, int]:
    """The documentation of every Python topic, as int64 character ids, and the vocabulary size."""
    from pydoc_data.topics import topics

    text = "".join(topics[k] for k in sorted(topics))
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    return np.fromiter((index[c] for c in text), np.int64, len(text)), len(chars)


def batch(data: np.ndarray, step: int, n: int, block: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` random windows (the same on every rank for a given step): inputs and next characters."""
    starts = np.random.default_rng((seed, step)).integers(0, len(data) - block - 1, n)
    x = np.stack([data[s: s + block] for s in starts])
    y = np.stack([data[s + 1: s + block + 1] for s in starts])
    return x, y


# -- model ------------------------------------------------------------------------------------------
class Embed(nn.Module):
    """Token plus learned position embedding: ``(B, T)`` ids -> ``(B, T, D)``."""

    def __init__(self, vocab: int, dim: int, block: int, dtype: Any, seed: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim, dtype=dtype, seed=seed)
        self.pos = nn.Embedding(block, dim, dtype=dtype, seed=seed + 1)
        for emb in (self.tok, self.pos):
            emb.weight.data *= 0.02   # GPT-2's initial scale

    def forward(self, idx: Any) -> Any:
        return self.tok(idx) + self.pos(np.arange(idx.shape[1]))[None]

    def backward_input(self, g: Any) -> None:
        self.tok.run_backward_input(g)
        self.pos.run_backward_input(g.sum(axis=0))
        return None   # token ids have no gradient

    def backward_weight(self) -> None:
        self.pos.backward_weight()
        self.tok.backward_weight()

    def backward(self, g: Any) -> None:
        self.tok.run_backward(g)
        self.pos.run_backward(g.sum(axis=0))
        return None


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(rms(x))``, then ``h + mlp(ln(h))``."""

    def __init__(self, dim: int, heads: int, dtype: Any, seed: int) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(dim, dtype=dtype)
        self.attn = nn.MultiheadAttention(dim, heads, causal=True, dtype=dtype, seed=seed)
        self.norm2 = nn.LayerNorm(dim, dtype=dtype)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim, dtype=dtype, seed=seed + 1), nn.GELU(),
                                 nn.Linear(4 * dim, dim, dtype=dtype, seed=seed + 2))

    def forward(self, x: Any) -> Any:
        h = x + self.attn(self.norm1(x))
        return h + self.mlp(self.norm2(h))

    def _backward(self, g: Any, split: bool) -> Any:
        run = (lambda m, v: m.run_backward_input(v)) if split else (lambda m, v: m.run_backward(v))
        gh = g + run(self.norm2, run(self.mlp, g))
        return gh + run(self.norm1, run(self.attn, gh))

    def backward_input(self, g: Any) -> Any:
        return self._backward(g, True)

    def backward_weight(self) -> None:
        for m in (self.mlp, self.norm2, self.attn, self.norm1):   # reverse order of forward
            m.backward_weight()

    def backward(self, g: Any) -> Any:
        return self._backward(g, False)


def build_gpt(vocab: int, args: argparse.Namespace) -> nn.Sequential:
    """Embedding, blocks, final norm and head: the children a pipeline splits between."""
    dt = np.dtype(args.dtype)
    s = args.seed
    return nn.Sequential(
        Embed(vocab, args.dim, args.block, dt, s),
        *[Block(args.dim, args.heads, dt, s + 10 * (i + 1)) for i in range(args.layers)],
        nn.LayerNorm(args.dim, dtype=dt),
        nn.Linear(args.dim, vocab, dtype=dt, seed=s + 1000),
    )


# -- training -------------------------------------------------------------------------------------
def train(args: argparse.Namespace) -> dict[str, Any]:
    """Train on this rank's stages; rank 0 also trains the plain model. Returns both curves."""
    data, vocab = load_text()
    world, rank = hpcdp.world_size(), hpcdp.rank()
    if world % args.dp:
        raise SystemExit(f"--dp {args.dp} does not divide {world} ranks")
    grid = pipeline.grid(world // args.dp, args.dp)
    stage = pipeline.PipelineStage(build_gpt(vocab, args), virtual=args.virtual, group=grid.pp_group)
    pipe = pipeline.Pipeline(stage, schedule=args.schedule, n_microbatches=args.microbatches,
                             loss_fn=nn.CrossEntropyLoss(), dp_group=grid.dp_group)
    opt = optim.AdamW(stage.parameters(), lr=args.lr, weight_decay=0.01)
    ref = ref_opt = None
    if rank == 0:
        ref = build_gpt(vocab, args)
        ref_opt = optim.AdamW(ref.parameters(), lr=args.lr, weight_decay=0.01)
        print(f"{world} ranks: {world // args.dp} pipeline stages x {args.dp} replicas, schedule "
              f"{args.schedule}, {args.microbatches} microbatches; vocabulary {vocab}, "
              f"{sum(p.data.size for p in ref.parameters())} parameters", flush=True)
        print(f"{pipe.report}", flush=True)
    losses, ref_losses = [], []
    mine = slice(grid.dp_rank * args.batch_size, (grid.dp_rank + 1) * args.batch_size)
    for step in range(args.steps):
        x, y = batch(data, step, args.dp * args.batch_size, args.block, args.seed)
        loss = pipe.step(x[mine], y[mine])
        opt.step()
        opt.zero_grad()
        losses.append(loss)
        if ref is not None:
            loss_fn = nn.CrossEntropyLoss()
            ref_losses.append(float(loss_fn(ref(x), y)))
            ref.run_backward(loss_fn.backward())
            ref_opt.step()
            ref_opt.zero_grad()
            print(f"step {step:3d}  pipeline loss {loss:.6f}  unpipelined {ref_losses[-1]:.6f}",
                  flush=True)
    result: dict[str, Any] = {"losses": losses, "reference": ref_losses,
                              "peak_activations": pipe.peak_activations,
                              "predicted_peak": pipe.predicted_peak_activations}
    if ref is not None:
        diff = max(abs(a - b) for a, b in zip(losses, ref_losses)) if losses else 0.0
        result["max_diff"] = diff
        print(f"max |pipeline - unpipelined| loss difference over {args.steps} steps: {diff:.2e}; "
              f"loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    return result


def _check(result: dict[str, Any]) -> bool:
    losses = result["losses"]
    return result.get("max_diff", 0.0) <= 1e-6 and (len(losses) < 10 or losses[-1] < losses[0])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train (on simulated ranks when started alone); return rank 0's result."""
    args = parse_args(argv)
    hpcdp.init()
    if hpcdp.world_size() == 1 and args.sim_ranks > 1 and \
            hpcdp.get_default_group().backend.name == "sim":
        hpcdp.finalize()
        result = hpcdp.spawn(lambda r: train(args), args.sim_ranks, backend="sim")[0]
    else:
        result = train(args)
    if args.check and hpcdp.rank() == 0 and not _check(result):
        print("FAILED: the pipelined loss curve differs from the unpipelined one", file=sys.stderr)
        sys.exit(1)
    return result


if __name__ == "__main__":
    main()

"""Train a small character-level GPT with FSDP on the documentation text every Python ships.

The text is the standard library's ``pydoc_data.topics`` (about 460k characters of English, no
download). The model has token and position embeddings, causal self-attention blocks
(``nn.MultiheadAttention``, pre-LayerNorm, a GELU MLP) and a linear head; each block is its own
FSDP unit, the root unit holds the embeddings, the final norm and the head.

    python examples/03_fsdp_gpt.py --steps 50                   # one simulated rank
    mpirun -n 4 python -m hpcdp.run examples/03_fsdp_gpt.py     # 4 MPI ranks (make demo-fsdp)
    hpcdp-run -n 4 examples/03_fsdp_gpt.py                      # TCP ranks

Each rank draws its own random windows of the training split. AdamW with a cosine schedule and
linear warm-up, gradients clipped to a global norm of 1 (``fsdp.clip_grad_norm_``), a tqdm bar on
rank 0. At the end it prints the held-out loss next to the unigram baseline (the entropy of the
character frequencies: what a model that ignores context achieves), the memory table, and writes
a sharded checkpoint (``--ckpt-dir``; every rank writes its own rows).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

import numpy as np

import hpcdp
from hpcdp import nn, optim
from hpcdp.fsdp import FSDP, MixedPrecision
from hpcdp.progress import progress


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="optimizer steps (CI runs a short version)")
    p.add_argument("--batch-size", type=int, default=16, help="windows per rank per step")
    p.add_argument("--context", type=int, default=64, help="characters per window")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=0, help="warm-up steps (default: 5%% of --steps)")
    p.add_argument("--clip", type=float, default=1.0, help="global gradient norm bound")
    p.add_argument("--strategy", default="full_shard",
                   choices=["full_shard", "shard_grad_op", "no_shard", "hybrid_shard"])
    p.add_argument("--shard-size", type=int, default=None, help="hybrid_shard: ranks per shard group")
    p.add_argument("--bf16", action="store_true", help="gather and compute in (emulated) bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-windows", type=int, default=32, help="held-out windows per rank")
    p.add_argument("--ckpt-dir", default="ckpt/03_fsdp_gpt", help="where the final checkpoint goes")
    p.add_argument("--no-ckpt", action="store_true", help="do not write a checkpoint")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--parallel", default="fsdp", choices=["fsdp", "ddp", "zero1"],
                   help="FSDP (--strategy), DDP, or DDP with ZeroRedundancyOptimizer (ZeRO-1)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP's bucket size (--parallel ddp/zero1)")
    p.add_argument("--dropout", type=float, default=0.0, help="dropout after attention and MLP")
    p.add_argument("--deterministic-chunk", type=int, default=0, metavar="C",
                   help="bit-identical training for any world size: chunks of C windows added "
                        "exactly (needs --global-batch divisible by C x world size)")
    p.add_argument("--global-batch", type=int, default=0,
                   help="windows per step over all ranks, drawn from one generator per step and "
                        "split by rank (default: --batch-size per rank, each rank its own draws)")
    p.add_argument("--sha", action="store_true", help="print the SHA-256 of the final parameters")
    return p.parse_args(argv)


# -- data ------------------------------------------------------------------------------------------
def load_text() -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(train ids, held-out ids, alphabet): the topics in a fixed order, the last 10% held out."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    alphabet = sorted(set(text))
    lookup = {c: i for i, c in enumerate(alphabet)}
    ids = np.fromiter((lookup[c] for c in text), dtype=np.int64, count=len(text))
    cut = int(len(ids) * 0.9)
    return ids[:cut], ids[cut:], alphabet


def unigram_baseline(train: np.ndarray, held: np.ndarray, vocab: int) -> float:
    """Cross-entropy (nats) of the held-out text under the training character frequencies."""
    counts = np.bincount(train, minlength=vocab).astype(np.float64) + 1.0   # add-one: no zero probability
    logp = np.log(counts / counts.sum())
    return float(-logp[held].mean())


def windows(ids: np.ndarray, starts: np.ndarray, t: int) -> tuple[np.ndarray, np.ndarray]:
    idx = starts[:, None] + np.arange(t + 1)[None, :]
    chunk = ids[idx]
    return chunk[:, :-1], chunk[:, 1:]


# -- model -----------------------------------------------------------------------------------------
class Block(nn.Module):
    """Pre-norm transformer block: ``h = x + attn(ln1(x))``, ``out = h + mlp(ln2(h))``."""

    def __init__(self, d: int, heads: int, seed: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, causal=True, seed=seed)
        self.ln2 = nn.LayerNorm(d)
        layers = [nn.Linear(d, 4 * d, seed=seed + 1), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d, seed=seed + 2)]
        self.drop = None
        if dropout:   # residual dropout, as GPT-2 (only when asked: it changes nothing else)
            self.drop = nn.Dropout(dropout, seed=seed + 3)
            layers.append(nn.Dropout(dropout, seed=seed + 4))
        self.mlp = nn.Sequential(*layers)

    def forward(self, x: Any) -> Any:
        a = self.attn(self.ln1(x))
        h = x + (a if self.drop is None else self.drop(a))
        return h + self.mlp(self.ln2(h))

    def backward(self, g: Any) -> Any:
        gh = g + self.ln2.run_backward(self.mlp.run_backward(g))
        ga = gh if self.drop is None else self.drop.run_backward(gh)
        return gh + self.ln1.run_backward(self.attn.run_backward(ga))


class GPT(nn.Module):
    """Token and position embeddings, ``layers`` blocks, a final LayerNorm and a linear head."""

    def __init__(self, vocab: int, context: int, d: int, heads: int, layers: int, seed: int,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(vocab, d, seed=seed)
        self.pos = nn.Embedding(context, d, seed=seed + 1)
        self.tok.weight.data *= 0.1   # small embeddings, as GPT-2 initialises them (std 0.02-0.1)
        self.pos.weight.data *= 0.1
        self.blocks = nn.ModuleList([Block(d, heads, seed + 10 * (k + 1), dropout) for k in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, seed=seed + 2)

    def forward(self, idx: Any) -> Any:
        t = idx.shape[1]
        # positions per window (not one row broadcast over the batch): a window's gradient
        # then never mixes with another's, which chunked (deterministic) training relies on
        x = self.tok(idx) + self.pos(np.broadcast_to(np.arange(t), idx.shape))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))

    def backward(self, g: Any) -> Any:
        g = self.ln_f.run_backward(self.head.run_backward(g))
        for b in reversed(list(self.blocks)):
            g = b.run_backward(g)
        self.pos.run_backward(g)
        self.tok.run_backward(g)
        return None


# -- training --------------------------------------------------------------------------------------
def evaluate(fsdp: Any, held: np.ndarray, args: argparse.Namespace, rank: int, world: int) -> float:
    """Mean held-out loss over ``eval_windows`` windows per rank (the same windows for any seed)."""
    rng = np.random.default_rng(10_000 + rank)
    starts = rng.integers(0, len(held) - args.context - 1, size=args.eval_windows)
    x, y = windows(held, starts, args.context)
    loss_fn = nn.CrossEntropyLoss()
    fsdp.eval()
    loss = float(loss_fn(fsdp(x), y))
    fsdp.module.free_saved()   # forward-only: drop what backward would have used
    fsdp.train()
    total = hpcdp.allreduce(np.array([loss]), "sum", group=fsdp.group)
    return float(total[0]) / world


def parameters_sha(wrapper: Any, parallel: str) -> str | None:
    """SHA-256 over every parameter (name, then bytes, in name order); None off rank 0 (FSDP)."""
    import hashlib

    state = wrapper.full_state_dict() if parallel == "fsdp" else wrapper.module.state_dict()
    if not state:
        return None
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(np.ascontiguousarray(state[k]).tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train, evaluate and checkpoint; return the losses, the baseline and the memory table."""
    args = parse_args(argv)
    chunk = args.deterministic_chunk or None
    hpcdp.init(**({"deterministic": True} if chunk else {}))
    rank, world = hpcdp.rank(), hpcdp.world_size()
    gbatch = args.global_batch
    if gbatch and gbatch % world:
        raise SystemExit(f"--global-batch {gbatch} does not split over {world} ranks")
    local = gbatch // world if gbatch else args.batch_size
    train, held, alphabet = load_text()
    vocab = len(alphabet)
    base = unigram_baseline(train, held, vocab)

    nn.manual_seed(args.seed)
    model = GPT(vocab, args.context, args.dim, args.heads, args.layers, args.seed, args.dropout)
    mp = MixedPrecision(param_dtype="bfloat16", reduce_dtype="float32") if args.bf16 else None
    if args.parallel == "fsdp":
        fsdp: Any = FSDP(model, strategy=args.strategy, auto_wrap={Block}, mixed_precision=mp,
                         shard_size=args.shard_size, deterministic_chunk=chunk)
    else:
        fsdp = hpcdp.DDP(model, deterministic_chunk=chunk, bucket_cap_mb=args.bucket_mb)
    decay = [p for n, p in fsdp.named_parameters() if p.ndim >= 2 and not n.endswith(("tok.weight", "pos.weight"))]
    other = [p for n, p in fsdp.named_parameters() if all(p is not q for q in decay)]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}]
    if args.parallel == "zero1":
        opt: Any = optim.ZeroRedundancyOptimizer(groups, optim.AdamW, lr=args.lr, betas=(0.9, 0.95))
    else:
        opt = optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    warmup = args.warmup or max(1, args.steps // 20)
    sched = optim.lr_scheduler.CosineWarmupLR(opt, warmup_steps=warmup, total_steps=args.steps,
                                              min_lr=args.lr * 0.1)
    loss_fn = nn.CrossEntropyLoss()
    rng = np.random.default_rng(args.seed * 1000 + rank)
    if rank == 0:
        how = (f"{args.strategy}, {sum(u.F for u in fsdp.units):,} parameters in {len(fsdp.units)} units"
               if args.parallel == "fsdp" else
               f"{args.parallel}, {sum(p.size for _, p in model.named_parameters()):,} parameters")
        print(f"{world} rank(s), {how}; vocabulary {vocab}; unigram baseline {base:.3f} nats "
              f"(uniform {math.log(vocab):.3f})" + (f"; deterministic, chunks of {chunk}" if chunk else ""),
              flush=True)
    bar = progress(range(args.steps), desc="train", disable=args.no_progress)
    history: list[float] = []
    running = 0.0
    for step in bar:
        if gbatch:   # one draw for the whole step, split by rank: any world size sees the same
            starts = np.random.default_rng([args.seed, step]).integers(0, len(train) - args.context - 1,
                                                                      size=gbatch)[rank * local:(rank + 1) * local]
        else:
            starts = rng.integers(0, len(train) - args.context - 1, size=args.batch_size)
        x, y = windows(train, starts, args.context)
        # dropout masks keyed by each window's place in the global batch, not by this rank
        with nn.chunking.sample_keys(np.arange(rank * local, (rank + 1) * local), step):
            loss = float(loss_fn(fsdp(x), y))
        fsdp.backward(loss_fn.backward())
        if args.parallel == "fsdp":
            norm = fsdp.clip_grad_norm_(args.clip)
        else:
            norm = nn.utils.clip_grad_norm_(list(fsdp.parameters()), args.clip)
        opt.step()
        opt.zero_grad()
        sched.step()
        history.append(loss)
        running = loss if step == 0 else 0.95 * running + 0.05 * loss
        bar.set_postfix(loss=f"{running:.3f}", norm=f"{norm:.2f}", lr=f"{sched.get_last_lr()[0]:.2e}",
                        refresh=False)
    bar.close()
    held_loss = evaluate(fsdp, held, args, rank, world)
    stats = fsdp.memory_stats(opt) if args.parallel == "fsdp" else {}
    sha = parameters_sha(fsdp, args.parallel) if args.sha else None
    if rank == 0:
        print(f"held-out loss {held_loss:.3f} nats after {args.steps} steps (unigram baseline {base:.3f}, "
              f"first training loss {history[0]:.3f})", flush=True)
        if stats:
            print(stats, flush=True)
        if sha:
            print(f"parameters sha256 {sha}", flush=True)
    path = None
    if not args.no_ckpt and args.parallel != "zero1":
        path = os.path.join(args.ckpt_dir, f"step-{args.steps}")
        hpcdp.checkpoint.save(path, {"model": fsdp.state_dict(), "optim": fsdp.optim_state_dict(opt),
                                     "step": args.steps}, group=fsdp.group)
        if rank == 0:
            print(f"sharded checkpoint: {path}", flush=True)
    return {"unigram": base, "first_loss": history[0], "last_losses": history[-10:],
            "held_out": held_loss, "memory": dict(stats), "checkpoint": path, "world_size": world,
            "sha256": sha}


if __name__ == "__main__":
    main(sys.argv[1:])
    hpcdp.finalize()

"""Memory accounting: the bytes each rank holds, from the arrays actually held.

``Tracker`` is told of every gathered buffer allocated or dropped (all-gather receive buffers
and the parameter-major copies) and keeps the current total and its peak. ``memory_stats`` adds
the sharded parameters, gradients and optimizer state, counting each underlying buffer once.
"""
from __future__ import annotations

from typing import Any, Iterable

__all__ = ["Tracker", "MemoryStats", "optimizer_state_bytes", "distinct_nbytes", "zero_formula"]


class Tracker:
    """Current and peak bytes of gathered (unsharded) parameters on this rank."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    def __call__(self, delta: int) -> None:
        self.now += int(delta)
        if self.now > self.peak:
            self.peak = self.now

    def reset_peak(self) -> None:
        self.peak = self.now


def distinct_nbytes(arrays: Iterable[Any]) -> int:
    """Bytes of the distinct memory blocks behind ``arrays`` (views of one buffer count once)."""
    seen: set[int] = set()
    total = 0
    for a in arrays:
        if a is None or not hasattr(a, "nbytes"):
            continue
        base = a
        while getattr(base, "base", None) is not None and hasattr(base.base, "nbytes"):
            base = base.base
        if id(base) not in seen:
            seen.add(id(base))
            total += int(base.nbytes)
    return total


def optimizer_state_bytes(optimizer: Any, params: Iterable[Any]) -> int:
    """Bytes of ``optimizer``'s per-parameter state arrays for ``params``."""
    arrays = []
    state = getattr(optimizer, "state", {})
    for p in params:
        for v in state.get(p, {}).values():
            if hasattr(v, "nbytes"):
                arrays.append(v)
    return distinct_nbytes(arrays)


class MemoryStats(dict):
    """Bytes per rank: ``params``, ``grads``, ``optim_state``, ``gathered_peak`` (and a few more).

    A plain dict whose ``str`` is a table, so ``print(fsdp.memory_stats(opt))`` reads well.
    """

    ORDER = ("params", "grads", "optim_state", "gathered_peak", "gathered_now", "padding",
             "full_params", "buffer_cache")
    LABELS = {
        "params": "sharded parameters",
        "grads": "gradients",
        "optim_state": "optimizer state",
        "gathered_peak": "peak gathered parameters",
        "gathered_now": "gathered now",
        "padding": "padding in the shards",
        "full_params": "unsharded model (for scale)",
        "buffer_cache": "step buffers kept for reuse",
    }

    def __str__(self) -> str:
        head = f"FSDP memory, rank {self.get('rank', '?')} ({self.get('strategy', '?')}, " \
               f"{self.get('world', '?')} ranks)"
        lines = [head, f"  {'what':<30} {'bytes':>14} {'MiB':>10}"]
        for k in self.ORDER:
            v = self.get(k)
            if v is None:
                lines.append(f"  {self.LABELS[k]:<30} {'n/a':>14} {'':>10}  (pass the optimizer)")
            else:
                lines.append(f"  {self.LABELS[k]:<30} {v:>14,d} {v / 2**20:>10.3f}")
        return "\n".join(lines)


def zero_formula(stage: int, params: int, world: int, *, param_bytes: int = 4, grad_bytes: int = 4,
                 state_bytes: int = 8) -> dict[str, float]:
    """Bytes per rank the ZeRO paper predicts for ``params`` elements on ``world`` ranks.

    Stage 0 is DDP; 1 shards the optimizer state, 2 also the gradients, 3 also the parameters.
    ``state_bytes`` is the optimizer state per element (Adam in float32: two moments, 8 B).
    """
    n = max(1, int(world))
    shard = {0: (1, 1, 1), 1: (1, 1, n), 2: (1, n, n), 3: (n, n, n)}[stage]
    return {"params": params * param_bytes / shard[0], "grads": params * grad_bytes / shard[1],
            "optim_state": params * state_bytes / shard[2]}

"""DDP's ``deterministic_chunk``: gradients whose bits do not depend on the world size.

Between a training forward and the end of its backward, ``nn.chunking`` is on: each layer
leaves one gradient per chunk of ``c`` samples in ``Parameter.chunk_grads`` instead of a sum
over its batch. At the end of a synced backward this component adds every chunk of every
rank exactly, bucket by bucket (``comm.reproducible.sum_rows``), divides once by the number of
chunks in the global batch and writes the result into ``.grad`` (the bucket views when
``gradient_as_bucket_view``). A global batch of ``B`` samples thus gives the same gradients,
to the bit, on every world size that divides ``B / c``; ``no_sync`` passes keep their chunks
and the next synced pass adds them with its own.

The gradient is the mean over chunks of each chunk's gradient: for a mean-reduced loss, the
gradient of the mean loss of the global batch, as without chunks. The reduction runs after
backward (no overlap): the exact sum needs every chunk's grid first.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .._arrays import xp_of
from ..comm import reproducible
from ..nn import chunking

__all__ = ["ChunkedGradients"]


class ChunkedGradients:
    """The chunk bookkeeping and exact reduction of one DDP.

    Args:
        chunk: samples per chunk (axis 0 of the module's first array argument).
        group: the DDP's group.
        buckets: the DDP's buckets (their parameters, in reduction order).
    """

    def __init__(self, chunk: int, group: Any, buckets: Sequence[Any]) -> None:
        self.count = chunking.ChunkCount(chunk, "DDP")
        self.group = group
        self.buckets = buckets

    def begin_forward(self, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        """Count the chunks of this forward's batch and turn chunked gradients on."""
        self.count.begin_forward(args, kwargs, self.group.rank)

    @staticmethod
    def end_backward() -> None:
        chunking.set_chunk_size(None)

    def reduce(self, timeout: float | None = None) -> None:
        """Collective: every chunk of every rank added exactly; the mean over chunks into .grad."""
        g = self.group
        chunks = self.count.agree(g)
        for b in self.buckets:
            params = list(b.params)
            stacks = [_stack(p) for p in params]
            rows = max(s.shape[0] if s is not None else 0 for s in stacks)
            xp = xp_of(b.flat)
            numel = [int(np.prod(p.data.shape, dtype=np.int64)) for p in params]
            flat = xp.zeros((rows, sum(numel)), dtype=b.flat.dtype)
            at = 0
            for s, n in zip(stacks, numel):
                if s is not None:
                    flat[:s.shape[0], at:at + n] = s.reshape(s.shape[0], n)
                at += n
            mean = reproducible.sum_rows(g, flat, divisor=chunks, dtype=b.flat.dtype, timeout=timeout)
            at = 0
            for p, n, v in zip(params, numel, b.views):
                piece = mean[at:at + n].reshape(p.data.shape)
                at += n
                if p.grad is not None and p.grad.shape == piece.shape:
                    p.grad[...] = piece
                else:
                    v[...] = piece
                    p.grad = v
                p.chunk_grads = None


def _stack(p: Any) -> Any:
    """A parameter's chunk gradients of every pass since the last reduction, stacked."""
    got = p.chunk_grads
    if not got:
        return None
    if len(got) == 1:
        return got[0]
    return xp_of(got[0]).concatenate(got, axis=0)

"""Chunked gradients: the per-chunk arithmetic of deterministic training.

A floating-point gradient summed over a batch depends on how the batch is cut: one rank adding
8 samples rounds differently from two ranks adding 4 each. With ``chunked(c)`` active, every
layer with parameters computes, instead of one gradient summed over the batch, one gradient
per chunk of ``c`` consecutive samples (axis 0 of its input), stacked ``(k, *param.shape)``
for the batch's ``k`` chunks; ``Parameter.accumulate_grad`` keeps those stacks in
``chunk_grads`` and DDP or FSDP adds all chunks of all ranks exactly (``comm.reproducible``).
A chunk's gradient is computed by the same floating-point operations whichever rank holds it
and however many chunks that rank has, so the exact total is the same bits for any world size.

What makes a chunk's arithmetic independent of its neighbours:

* matrix products run batched, one BLAS call per chunk with the chunk's own row count (a
  single call over the whole batch may pick another kernel, and other rounding, for another
  number of rows: it does for float32 in OpenBLAS);
* sums over samples stop at the chunk boundary;
* a mean-reduced loss divides by the chunk's own count (the division by the number of chunks
  happens once, after the exact sum).

Row-wise operations (activations, softmax, normalisation over features, attention within a
sample) need nothing: they never mix samples.

The setting is per thread (simulated ranks are threads). DDP and FSDP turn it on at a training
forward and off after the backward, so the loss computed between them sees it too.

Randomness must not depend on which rank holds a sample either: inside ``sample_keys(keys,
step)`` a ``Dropout`` draws each sample's mask from a generator seeded by (its own seed, the
step, the sample's key, how many times it ran in this context), so the same sample gets the
same mask on any rank. Keys are global sample identities: the dataset indices a
``DistributedSampler`` hands out, or a window's position in the global batch. In chunked
training a ``Dropout`` without keys raises rather than silently depending on the rank.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

__all__ = ["chunk_size", "chunked", "set_chunk_size", "chunks_in", "matmul_t", "matmul",
           "weight_grad", "sample_sum", "sample_keys", "current_sample_keys", "next_call",
           "ChunkCount"]

class _State(threading.local):
    """This thread's chunking state. Class defaults: a thread that never set one reads the
    default without ``getattr``'s raised and caught AttributeError (asked per layer per step)."""

    c: int | None = None
    keys: Any = None


_tls = _State()


def chunk_size() -> int | None:
    """Samples per chunk while chunked gradients are on in this thread; None when off."""
    return _tls.c


def set_chunk_size(c: int | None) -> None:
    """Turn chunked gradients on (``c`` samples per chunk) or off (None) in this thread."""
    if c is not None:
        c = int(c)
        if c < 1:
            raise ValueError(f"chunk size must be >= 1, got {c}")
    _tls.c = c


@contextlib.contextmanager
def chunked(c: int | None) -> Iterator[None]:
    """Compute per-chunk gradients of ``c`` samples inside (None: off); restores on exit."""
    old = chunk_size()
    set_chunk_size(c)
    try:
        yield
    finally:
        _tls.c = old


def chunks_in(a: Any, what: str = "input") -> int:
    """How many chunks axis 0 of ``a`` holds; ValueError unless the chunk size divides it."""
    c = chunk_size()
    n = int(a.shape[0]) if a.ndim else 0
    if c is None or n % c:
        raise ValueError(f"chunked gradients: {what} of shape {tuple(a.shape)} does not split into "
                         f"chunks of {c} samples along axis 0")
    return n // c


def matmul_t(x: Any, w: Any) -> Any:
    """``x @ w.T`` over the trailing axis, one product per chunk when chunked (see module doc)."""
    c = chunk_size()
    if c is None or x.ndim < 2:
        return x @ w.T
    k = chunks_in(x)
    return (x.reshape(k, -1, x.shape[-1]) @ w.T).reshape(*x.shape[:-1], w.shape[0])


def matmul(x: Any, w: Any) -> Any:
    """``x @ w`` over the trailing axis, one product per chunk when chunked."""
    c = chunk_size()
    if c is None or x.ndim < 2:
        return x @ w
    k = chunks_in(x)
    return (x.reshape(k, -1, x.shape[-1]) @ w).reshape(*x.shape[:-1], w.shape[1])


def weight_grad(g: Any, x: Any) -> Any:
    """``sum over rows of outer(g, x)``: ``g2.T @ x2`` of shape (out, in); when chunked, one per
    chunk, shape (k, out, in)."""
    c = chunk_size()
    if c is None:
        return g.reshape(-1, g.shape[-1]).T @ x.reshape(-1, x.shape[-1])
    k = chunks_in(g, "gradient")
    gk = g.reshape(k, -1, g.shape[-1])
    xk = x.reshape(k, -1, x.shape[-1])
    return gk.transpose(0, 2, 1) @ xk


def sample_sum(a: Any, feature_ndim: int) -> Any:
    """Sum of ``a`` over every axis but its trailing ``feature_ndim``; when chunked, one sum per
    chunk, stacked on a new axis 0."""
    c = chunk_size()
    lead = a.ndim - feature_ndim
    if c is None:
        return a.reshape(-1, *a.shape[lead:]).sum(axis=0)
    k = chunks_in(a, "gradient")
    feat = a.shape[lead:]
    return a.reshape(k, -1, *feat).sum(axis=1)


@contextlib.contextmanager
def sample_keys(keys: Any, step: int) -> Iterator[None]:
    """Key the randomness of the forwards inside by sample (see module doc).

    Args:
        keys: one int per sample of the batch (axis 0), unique within the step, the same for a
            sample whichever rank holds it (e.g. its dataset index).
        step: the training step (or any int that changes between steps).
    """
    import numpy as np

    old = _tls.keys
    _tls.keys = (np.asarray(keys, dtype=np.int64).reshape(-1), int(step), {})
    try:
        yield
    finally:
        _tls.keys = old


def current_sample_keys() -> tuple[Any, int] | None:
    """(keys, step) inside ``sample_keys``; None outside."""
    got = _tls.keys
    return None if got is None else (got[0], got[1])


def next_call(owner: int) -> int:
    """How many times ``owner`` (a module's id) drew inside the current ``sample_keys`` before."""
    calls = _tls.keys[2]
    n = calls.get(owner, 0)
    calls[owner] = n + 1
    return n


class ChunkCount:
    """The chunks a data-parallel layer (DDP, FSDP) saw since its last synced backward: each
    training forward counts its batch's chunks and turns chunked gradients on; before the
    reduction every rank learns the global count, which the exact sum is divided by.

    Args:
        chunk: samples per chunk.
        owner: the layer's name, for messages ("DDP", "FSDP").
    """

    def __init__(self, chunk: int, owner: str) -> None:
        import numpy as np

        if not isinstance(chunk, (int, np.integer)) or isinstance(chunk, bool) or chunk < 1:
            raise ValueError(f"{owner}: deterministic_chunk must be an int >= 1, got {chunk!r}")
        self.chunk = int(chunk)
        self.owner = owner
        self.local = 0   # this rank's chunks since the last synced backward
        self.total = 0   # every rank's, as of the last agree()

    def begin_forward(self, args: Any, kwargs: dict[str, Any], rank: int) -> None:
        """Count the chunks of the forward's batch (axis 0 of its first array argument)."""
        batch = next((a for a in list(args) + list(kwargs.values()) if hasattr(a, "shape")), None)
        if batch is None or not getattr(batch, "ndim", 0):
            raise ValueError(f"{self.owner}(deterministic_chunk=...): the forward needs an array "
                             "argument whose axis 0 is the samples")
        n = int(batch.shape[0])
        if n % self.chunk:
            raise ValueError(f"{self.owner}(deterministic_chunk={self.chunk}) on rank {rank}: a "
                             f"local batch of {n} samples does not split into chunks of {self.chunk}")
        self.local += n // self.chunk
        set_chunk_size(self.chunk)

    def agree(self, group: Any) -> int:
        """Collective over ``group``: the chunks of the global batch (then counted afresh)."""
        import numpy as np

        self.total = int(group.allreduce(np.asarray([self.local], dtype=np.int64), "sum")[0])
        self.local = 0
        if self.total == 0:
            raise ValueError(f"{self.owner} (rank {group.rank}): a synced backward without any "
                             "chunked forward on any rank")
        return self.total

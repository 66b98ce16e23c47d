"""Shape and mask layers without parameters (Dropout, Flatten); re-exports the parameter layers.

``Linear``/``Embedding`` live in :mod:`.linear` and ``LayerNorm``/``RMSNorm`` in
:mod:`.normalization`; they are importable from here too, where they used to be.
"""
from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from . import chunking, init
from .backend import xp_of
from .linear import Embedding, Linear
from .module import Module
from .normalization import LayerNorm, RMSNorm

__all__ = ["Linear", "LayerNorm", "RMSNorm", "Embedding", "Dropout", "Flatten"]


class Dropout(Module):
    """Zero each element with probability ``p`` in training and scale the rest by 1/(1-p).

    In eval mode it is the identity. The mask comes from this module's own numpy Generator
    (``self.generator``, seeded by ``seed`` or drawn from the global one), sampled on the host, so a
    run is reproducible given the seed whatever the array module. Backward reuses the mask of the
    forward of the same microbatch.

    Inside ``nn.chunking.sample_keys(keys, step)`` each sample's mask comes instead from a
    generator seeded by (this module's seed, step, the sample's key, the call's number), so a
    sample gets the same mask whichever rank holds it: what world-size-independent training
    (``deterministic_chunk``) needs, and requires while chunked gradients are on.
    """

    def __init__(self, p: float = 0.5, seed: int | np.random.Generator | None = None) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"Dropout probability must be in [0, 1], got {p}")
        self.p = float(p)
        if isinstance(seed, np.random.Generator):
            self.generator = seed
            self.key_seed = zlib.crc32(repr(seed.bit_generator.state).encode())
        elif seed is None:
            self.key_seed = int(init.default_generator().integers(2**63))
            self.generator = np.random.default_rng(self.key_seed)
        else:
            self.key_seed = int(seed)
            self.generator = np.random.default_rng(seed)

    def forward(self, x: Any) -> Any:
        """Return ``x * mask / (1 - p)`` in training, ``x`` in eval."""
        if not self.training or self.p == 0.0:
            self.save_for_backward(None)
            return x
        keyed = chunking.current_sample_keys()
        if keyed is not None:
            keep = self._keyed_keep(x, *keyed)
        elif chunking.chunk_size() is not None:
            raise ValueError("Dropout in chunked (deterministic) training needs its samples' keys: "
                             "run the forward inside hpcdp.nn.chunking.sample_keys(keys, step)")
        else:
            keep = self.generator.random(x.shape) >= self.p
        scale = 0.0 if self.p == 1.0 else 1.0 / (1.0 - self.p)
        mask = xp_of(x).asarray((keep * scale).astype(x.dtype))
        self.save_for_backward(mask)
        return x * mask

    def _keyed_keep(self, x: Any, keys: Any, step: int) -> Any:
        """Per sample, a mask drawn from (seed, step, key, call): the same on every rank."""
        if keys.shape[0] != x.shape[0]:
            raise ValueError(f"Dropout: {keys.shape[0]} sample keys for a batch of {x.shape[0]} samples")
        call = chunking.next_call(id(self))
        rows = [np.random.default_rng([self.key_seed, step, int(k), call]).random(x.shape[1:])
                for k in keys.tolist()]
        return (np.stack(rows) if rows else np.zeros(x.shape)) >= self.p

    def backward_input(self, grad_output: Any) -> Any:
        """Apply the same mask (and scale) as this microbatch's forward."""
        (mask,) = self.saved_tensors()
        return grad_output if mask is None else grad_output * mask

    def extra_repr(self) -> str:
        return f"p={self.p}"


class Flatten(Module):
    """Reshape axes ``start_dim..end_dim`` into one (default: all but the batch axis)."""

    def __init__(self, start_dim: int = 1, end_dim: int = -1) -> None:
        super().__init__()
        self.start_dim, self.end_dim = start_dim, end_dim

    def forward(self, x: Any) -> Any:
        """Return ``x`` with the chosen axes merged."""
        self.save_for_backward(tuple(x.shape))
        nd = x.ndim
        s, e = self.start_dim % nd, self.end_dim % nd
        return x.reshape(x.shape[:s] + (-1,) + x.shape[e + 1:])

    def backward_input(self, grad_output: Any) -> Any:
        """Reshape the gradient back to the input's shape."""
        (shape,) = self.saved_tensors()
        return grad_output.reshape(shape)

    def extra_repr(self) -> str:
        return f"start_dim={self.start_dim}, end_dim={self.end_dim}"

"""Layers with weight matrices: Linear and Embedding, with a split backward.

``backward_input`` returns the input gradient and keeps (per microbatch) what the weight gradient
needs; ``backward_weight`` accumulates the gradients in reverse registration order (bias before
weight), so gradient hooks fire in reverse parameter order over the whole model.
"""
from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from . import chunking, init
from .backend import scatter_add, xp_of
from .module import Module
from .parameter import Parameter

__all__ = ["Linear", "Embedding"]


class Linear(Module):
    """y = x @ W.T + b on input of shape (..., in_features); W has torch's (out, in) layout.

    Args:
        in_features: size of the last input axis.
        out_features: size of the last output axis.
        bias: whether to add a learnable bias.
        dtype: parameter dtype (float32 or float64).
        seed: own Generator seed; None draws from the global one set by ``nn.manual_seed``.
        xp: array module for the parameters (numpy or cupy).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, dtype: Any = np.float32,
                 seed: int | np.random.Generator | None = None, xp: ModuleType = np) -> None:
        super().__init__()
        self.in_features, self.out_features = int(in_features), int(out_features)
        gen = init.generator_for(seed)
        # torch's default: kaiming_uniform(a=sqrt(5)) on W and U(+-1/sqrt(fan_in)) on b, both bound 1/sqrt(in).
        self.weight = Parameter(init.kaiming_uniform((out_features, in_features), in_features,
                                                     dtype=dtype, xp=xp, generator=gen))
        if bias:
            self.bias = Parameter(init.kaiming_uniform((out_features,), in_features, dtype=dtype, xp=xp, generator=gen))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: Any) -> Any:
        """Return ``x @ W.T + b``."""
        if x.ndim < 1 or x.shape[-1] != self.in_features:
            raise ValueError(f"Linear({self.in_features}, {self.out_features}) got input of shape {tuple(x.shape)}")
        self.save_for_backward(x)
        y = chunking.matmul_t(x, self.weight.data)
        if self.bias is not None:
            y = y + self.bias.data
        return y

    def backward_input(self, grad_output: Any) -> Any:
        """Return dL/dx = g @ W; keep x and g for the weight gradient."""
        (x,) = self.saved_tensors()
        if self._needs_weight_grad():
            self.save_for_weight(x, grad_output)
        else:
            self.save_for_weight()
        return chunking.matmul(grad_output, self.weight.data)

    def backward_weight(self) -> None:
        """Accumulate dL/db then dL/dW (firing their hooks); per chunk when chunked."""
        kept = self.saved_for_weight()
        if not kept:
            return
        x, grad_output = kept
        if self.bias is not None and self.bias.requires_grad:
            self.bias.accumulate_grad(chunking.sample_sum(grad_output, 1))
        if self.weight.requires_grad:
            self.weight.accumulate_grad(chunking.weight_grad(grad_output, x))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Embedding(Module):
    """Look up rows of a (num_embeddings, embedding_dim) table by integer index.

    The input is an index array, which has no gradient: ``backward_input`` returns ``None`` and
    ``backward_weight`` scatter-adds into the table's gradient (repeated indices sum). Initialised
    N(0, 1) like torch; the ``padding_idx`` row starts at zero and never gets a gradient.

    Args:
        num_embeddings: number of rows; indices must lie in ``[0, num_embeddings)``.
        embedding_dim: length of each row.
        padding_idx: a row (negative counts from the end) excluded from gradient updates.
        dtype: parameter dtype.
        seed: own Generator seed; None draws from the global one.
        xp: array module for the table.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None, *,
                 dtype: Any = np.float32, seed: int | np.random.Generator | None = None,
                 xp: ModuleType = np) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = int(num_embeddings), int(embedding_dim)
        if padding_idx is not None:
            padding_idx = int(padding_idx)
            if not -self.num_embeddings <= padding_idx < self.num_embeddings:
                raise ValueError(f"Embedding padding_idx {padding_idx} outside [-{num_embeddings}, {num_embeddings})")
            padding_idx %= self.num_embeddings
        self.padding_idx = padding_idx
        self.weight = Parameter(init.normal((num_embeddings, embedding_dim), dtype=dtype, xp=xp,
                                            generator=init.generator_for(seed)))
        if padding_idx is not None:
            self.weight.data[padding_idx] = 0

    def forward(self, idx: Any) -> Any:
        """Return ``weight[idx]`` of shape ``idx.shape + (embedding_dim,)``."""
        if not np.issubdtype(np.dtype(idx.dtype), np.integer):
            raise TypeError(f"Embedding expects integer indices, got dtype {idx.dtype}")
        # Negative indices would silently wrap around: an index outside the table is an error.
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= self.num_embeddings):
            raise IndexError(f"Embedding({self.num_embeddings}, {self.embedding_dim}): indices must be in "
                             f"[0, {self.num_embeddings}), got range [{int(idx.min())}, {int(idx.max())}]")
        self.save_for_backward(idx)
        return self.weight.data[idx]

    def backward_input(self, grad_output: Any) -> None:
        """Keep the indices and gradient for the table gradient; return None (indices have none)."""
        (idx,) = self.saved_tensors()
        if self._needs_weight_grad():
            self.save_for_weight(idx, grad_output)
        else:
            self.save_for_weight()
        return None

    def backward_weight(self) -> None:
        """Accumulate the scatter-added table gradient (zero in the padding row)."""
        kept = self.saved_for_weight()
        if not kept or not self.weight.requires_grad:
            return
        idx, grad_output = kept
        xp = xp_of(self.weight.data)
        rows = idx.reshape(-1)
        if chunking.chunk_size() is not None:  # one table per chunk: row v of chunk j is j*V + v
            k = chunking.chunks_in(idx, "indices")
            rows = rows + xp.repeat(xp.arange(k) * self.num_embeddings, rows.shape[0] // k)
            dw = xp.zeros((k * self.num_embeddings, self.embedding_dim), self.weight.data.dtype)
        else:
            dw = xp.zeros_like(self.weight.data)
        scatter_add(dw, rows, grad_output.reshape(-1, self.embedding_dim))
        if chunking.chunk_size() is not None:
            dw = dw.reshape(-1, self.num_embeddings, self.embedding_dim)
        if self.padding_idx is not None:
            dw[..., self.padding_idx, :] = 0
        self.weight.accumulate_grad(dw)

    def extra_repr(self) -> str:
        pad = "" if self.padding_idx is None else f", padding_idx={self.padding_idx}"
        return f"{self.num_embeddings}, {self.embedding_dim}{pad}"

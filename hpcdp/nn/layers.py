"""Layers with parameters (Linear, LayerNorm, Embedding) and shape/mask layers (Dropout, Flatten).

Every backward accumulates its parameters' gradients in reverse registration order (bias before
weight) right after computing them and before computing the input gradient, so gradient hooks fire
in reverse parameter order over the whole model and as early as possible.
"""
from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from . import init
from ._backend import scatter_add, xp_of
from .module import Module
from .parameter import Parameter

__all__ = ["Linear", "LayerNorm", "Embedding", "Dropout", "Flatten"]


def _missing(layer: Module) -> RuntimeError:
    return RuntimeError(f"{type(layer).__name__}.backward called without a preceding forward")


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
        self._x: Any = None

    def forward(self, x: Any) -> Any:
        """Return ``x @ W.T + b``."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"Linear({self.in_features}, {self.out_features}) got input of shape {tuple(x.shape)}")
        self._x = x
        y = x @ self.weight.data.T
        if self.bias is not None:
            y = y + self.bias.data
        return y

    def backward(self, grad_output: Any) -> Any:
        """Accumulate dL/db then dL/dW (firing their hooks), then return dL/dx."""
        if self._x is None:
            raise _missing(self)
        x, self._x = self._x, None
        g2 = grad_output.reshape(-1, self.out_features)
        if self.bias is not None and self.bias.requires_grad:
            self.bias.accumulate_grad(g2.sum(axis=0))
        if self.weight.requires_grad:
            self.weight.accumulate_grad(g2.T @ x.reshape(-1, self.in_features))
        return grad_output @ self.weight.data

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class LayerNorm(Module):
    """Normalise over the trailing ``normalized_shape`` axes, then scale and shift (torch semantics).

    Args:
        normalized_shape: size (or sizes) of the trailing axes to normalise over.
        eps: added to the biased variance for stability.
        elementwise_affine: learn a per-element weight (ones) and bias (zeros).
        dtype: parameter dtype.
        xp: array module for the parameters.
    """

    def __init__(self, normalized_shape: int | tuple[int, ...], eps: float = 1e-5, elementwise_affine: bool = True,
                 *, dtype: Any = np.float32, xp: ModuleType = np) -> None:
        super().__init__()
        shape = (normalized_shape,) if isinstance(normalized_shape, (int, np.integer)) else tuple(normalized_shape)
        self.normalized_shape = tuple(int(s) for s in shape)
        self.eps = float(eps)
        if elementwise_affine:
            self.weight = Parameter(xp.ones(self.normalized_shape, dtype=dtype))
            self.bias = Parameter(xp.zeros(self.normalized_shape, dtype=dtype))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self._cache: tuple[Any, Any] | None = None

    def _axes(self, x: Any) -> tuple[int, ...]:
        n = len(self.normalized_shape)
        if tuple(x.shape[x.ndim - n:]) != self.normalized_shape:
            raise ValueError(f"LayerNorm{self.normalized_shape} got input of shape {tuple(x.shape)}")
        return tuple(range(x.ndim - n, x.ndim))

    def forward(self, x: Any) -> Any:
        """Return ``(x - mean) / sqrt(var + eps) * weight + bias``."""
        xp = xp_of(x)
        axes = self._axes(x)
        mu = x.mean(axis=axes, keepdims=True)
        xc = x - mu
        rstd = 1.0 / xp.sqrt((xc * xc).mean(axis=axes, keepdims=True) + self.eps)
        xhat = xc * rstd
        self._cache = (xhat, rstd)
        if self.weight is None:
            return xhat
        return xhat * self.weight.data + self.bias.data

    def backward(self, grad_output: Any) -> Any:
        """Accumulate dL/dbias then dL/dweight, then return dL/dx."""
        if self._cache is None:
            raise _missing(self)
        (xhat, rstd), self._cache = self._cache, None
        axes = self._axes(xhat)
        batch_axes = tuple(range(xhat.ndim - len(axes)))
        g = grad_output
        if self.weight is not None:
            if self.bias.requires_grad:
                self.bias.accumulate_grad(g.sum(axis=batch_axes))
            if self.weight.requires_grad:
                self.weight.accumulate_grad((g * xhat).sum(axis=batch_axes))
            g = g * self.weight.data
        # dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) over the normalised axes.
        return rstd * (g - g.mean(axis=axes, keepdims=True) - xhat * (g * xhat).mean(axis=axes, keepdims=True))

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.weight is not None}"


class Embedding(Module):
    """Look up rows of a (num_embeddings, embedding_dim) table by integer index.

    The input is an index array, which has no gradient: ``backward`` scatter-adds into the table's
    gradient (repeated indices sum) and returns ``None``. Initialised N(0, 1) like torch.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, dtype: Any = np.float32,
                 seed: int | np.random.Generator | None = None, xp: ModuleType = np) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = int(num_embeddings), int(embedding_dim)
        self.weight = Parameter(init.normal((num_embeddings, embedding_dim), dtype=dtype, xp=xp,
                                            generator=init.generator_for(seed)))
        self._idx: Any = None

    def forward(self, idx: Any) -> Any:
        """Return ``weight[idx]`` of shape ``idx.shape + (embedding_dim,)``."""
        if not np.issubdtype(np.dtype(idx.dtype), np.integer):
            raise TypeError(f"Embedding expects integer indices, got dtype {idx.dtype}")
        self._idx = idx
        return self.weight.data[idx]

    def backward(self, grad_output: Any) -> None:
        """Accumulate the scatter-added table gradient; return None (indices have no gradient)."""
        if self._idx is None:
            raise _missing(self)
        idx, self._idx = self._idx, None
        if self.weight.requires_grad:
            xp = xp_of(self.weight.data)
            dw = xp.zeros_like(self.weight.data)
            scatter_add(dw, idx.reshape(-1), grad_output.reshape(-1, self.embedding_dim))
            self.weight.accumulate_grad(dw)
        return None

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class Dropout(Module):
    """Zero each element with probability ``p`` in training and scale the rest by 1/(1-p).

    In eval mode it is the identity. The mask comes from this module's own numpy Generator
    (``self.generator``, seeded by ``seed`` or drawn from the global one), sampled on the host, so a
    run is reproducible given the seed whatever the array module. Backward reuses the forward mask.
    """

    def __init__(self, p: float = 0.5, seed: int | np.random.Generator | None = None) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"Dropout probability must be in [0, 1], got {p}")
        self.p = float(p)
        if isinstance(seed, np.random.Generator):
            self.generator = seed
        elif seed is None:
            self.generator = np.random.default_rng(init.default_generator().integers(2**63))
        else:
            self.generator = np.random.default_rng(seed)
        self._mask: Any = None

    def forward(self, x: Any) -> Any:
        """Return ``x * mask / (1 - p)`` in training, ``x`` in eval."""
        if not self.training or self.p == 0.0:
            self._mask = 1.0
            return x
        keep = self.generator.random(x.shape) >= self.p
        scale = 0.0 if self.p == 1.0 else 1.0 / (1.0 - self.p)
        self._mask = xp_of(x).asarray((keep * scale).astype(x.dtype))
        return x * self._mask

    def backward(self, grad_output: Any) -> Any:
        """Apply the same mask (and scale) as the last forward."""
        if self._mask is None:
            raise _missing(self)
        mask, self._mask = self._mask, None
        return grad_output if isinstance(mask, float) else grad_output * mask

    def extra_repr(self) -> str:
        return f"p={self.p}"


class Flatten(Module):
    """Reshape axes ``start_dim..end_dim`` into one (default: all but the batch axis)."""

    def __init__(self, start_dim: int = 1, end_dim: int = -1) -> None:
        super().__init__()
        self.start_dim, self.end_dim = start_dim, end_dim
        self._shape: tuple[int, ...] | None = None

    def forward(self, x: Any) -> Any:
        """Return ``x`` with the chosen axes merged."""
        self._shape = tuple(x.shape)
        nd = x.ndim
        s, e = self.start_dim % nd, self.end_dim % nd
        return x.reshape(x.shape[:s] + (-1,) + x.shape[e + 1:])

    def backward(self, grad_output: Any) -> Any:
        """Reshape the gradient back to the input's shape."""
        if self._shape is None:
            raise _missing(self)
        shape, self._shape = self._shape, None
        return grad_output.reshape(shape)

    def extra_repr(self) -> str:
        return f"start_dim={self.start_dim}, end_dim={self.end_dim}"

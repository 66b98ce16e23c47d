"""Normalisation layers over the trailing axes: LayerNorm and RMSNorm (torch semantics), split backward."""
from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from . import chunking
from .backend import xp_of
from .module import Module
from .parameter import Parameter

__all__ = ["LayerNorm", "RMSNorm"]


def _shape_of(normalized_shape: int | tuple[int, ...]) -> tuple[int, ...]:
    shape = (normalized_shape,) if isinstance(normalized_shape, (int, np.integer)) else tuple(normalized_shape)
    return tuple(int(s) for s in shape)


class _Norm(Module):
    """Shared parts: the normalised axes, and the weight part of backward (``sum g``, ``sum g * xhat``)."""

    normalized_shape: tuple[int, ...]

    def _axes(self, x: Any) -> tuple[int, ...]:
        n = len(self.normalized_shape)
        if tuple(x.shape[x.ndim - n:]) != self.normalized_shape:
            raise ValueError(f"{type(self).__name__}{self.normalized_shape} got input of shape {tuple(x.shape)}")
        return tuple(range(x.ndim - n, x.ndim))

    def _affine_input_grad(self, grad_output: Any, xhat: Any) -> Any:
        """Keep what the affine parameters' gradients need; return the gradient wrt ``xhat``."""
        if self.weight is None:
            self.save_for_weight()
            return grad_output
        if self._needs_weight_grad():
            self.save_for_weight(xhat, grad_output)
        else:
            self.save_for_weight()
        return grad_output * self.weight.data

    def backward_weight(self) -> None:
        """Accumulate dL/dbias (when present) then dL/dweight."""
        kept = self.saved_for_weight()
        if not kept:
            return
        xhat, g = kept
        batch_axes = tuple(range(xhat.ndim - len(self.normalized_shape)))
        bias = self._parameters.get("bias")
        if chunking.chunk_size() is not None:  # one sum per chunk of samples
            nd = len(self.normalized_shape)
            if bias is not None and bias.requires_grad:
                bias.accumulate_grad(chunking.sample_sum(g, nd))
            if self.weight.requires_grad:
                self.weight.accumulate_grad(chunking.sample_sum(g * xhat, nd))
            return
        if bias is not None and bias.requires_grad:
            bias.accumulate_grad(g.sum(axis=batch_axes))
        if self.weight.requires_grad:
            self.weight.accumulate_grad((g * xhat).sum(axis=batch_axes))


class LayerNorm(_Norm):
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
        self.normalized_shape = _shape_of(normalized_shape)
        self.eps = float(eps)
        if elementwise_affine:
            self.weight = Parameter(xp.ones(self.normalized_shape, dtype=dtype))
            self.bias = Parameter(xp.zeros(self.normalized_shape, dtype=dtype))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def forward(self, x: Any) -> Any:
        """Return ``(x - mean) / sqrt(var + eps) * weight + bias``."""
        xp = xp_of(x)
        axes = self._axes(x)
        mu = x.mean(axis=axes, keepdims=True)
        xc = x - mu
        rstd = 1.0 / xp.sqrt((xc * xc).mean(axis=axes, keepdims=True) + self.eps)
        xhat = xc * rstd
        self.save_for_backward(xhat, rstd)
        if self.weight is None:
            return xhat
        return xhat * self.weight.data + self.bias.data

    def backward_input(self, grad_output: Any) -> Any:
        """Return dL/dx; keep ``xhat`` and ``g`` for the affine parameters."""
        xhat, rstd = self.saved_tensors()
        axes = self._axes(xhat)
        g = self._affine_input_grad(grad_output, xhat)
        # dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) over the normalised axes.
        return rstd * (g - g.mean(axis=axes, keepdims=True) - xhat * (g * xhat).mean(axis=axes, keepdims=True))

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.weight is not None}"


class RMSNorm(_Norm):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the trailing axes (torch's ``nn.RMSNorm``, no bias).

    Args:
        normalized_shape: size (or sizes) of the trailing axes to normalise over.
        eps: added to the mean square; None uses the input dtype's machine epsilon, as torch.
        elementwise_affine: learn a per-element weight (ones).
        dtype: parameter dtype.
        xp: array module for the parameters.
    """

    def __init__(self, normalized_shape: int | tuple[int, ...], eps: float | None = None,
                 elementwise_affine: bool = True, *, dtype: Any = np.float32, xp: ModuleType = np) -> None:
        super().__init__()
        self.normalized_shape = _shape_of(normalized_shape)
        self.eps = None if eps is None else float(eps)
        if elementwise_affine:
            self.weight = Parameter(xp.ones(self.normalized_shape, dtype=dtype))
        else:
            self.register_parameter("weight", None)

    def forward(self, x: Any) -> Any:
        """Return ``x * rsqrt(mean(x^2) + eps) * weight``."""
        xp = xp_of(x)
        axes = self._axes(x)
        eps = float(np.finfo(x.dtype).eps) if self.eps is None else self.eps
        rstd = 1.0 / xp.sqrt((x * x).mean(axis=axes, keepdims=True) + eps)
        xhat = x * rstd
        self.save_for_backward(xhat, rstd)
        return xhat if self.weight is None else xhat * self.weight.data

    def backward_input(self, grad_output: Any) -> Any:
        """Return dL/dx = rstd * (g - xhat * mean(g * xhat)); keep ``xhat`` and ``g`` for the weight."""
        xhat, rstd = self.saved_tensors()
        axes = self._axes(xhat)
        g = self._affine_input_grad(grad_output, xhat)
        return rstd * (g - xhat * (g * xhat).mean(axis=axes, keepdims=True))

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.weight is not None}"

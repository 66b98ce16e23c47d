"""Elementwise activations and (log-)softmax; each saves, per microbatch, only what its derivative needs.

None has parameters, so each implements ``backward_input`` and inherits an empty ``backward_weight``.
"""
from __future__ import annotations

import math
from typing import Any

from .backend import erf, xp_of
from .module import Module

__all__ = ["ReLU", "GELU", "Tanh", "Sigmoid", "SiLU", "Identity", "Softmax", "LogSoftmax"]


class Identity(Module):
    """Pass the input through unchanged (a placeholder layer)."""

    def forward(self, x: Any) -> Any:
        """Return ``x``."""
        return x

    def backward_input(self, grad_output: Any) -> Any:
        """Return ``grad_output``."""
        return grad_output


class ReLU(Module):
    """max(x, 0)."""

    def forward(self, x: Any) -> Any:
        """Return ``max(x, 0)`` and remember where ``x > 0``."""
        mask = x > 0
        self.save_for_backward(mask)
        return x * mask

    def backward_input(self, grad_output: Any) -> Any:
        """Pass the gradient where the input was positive."""
        (mask,) = self.saved_tensors()
        return grad_output * mask


_GELU_C = math.sqrt(2.0 / math.pi)
_GELU_K = 0.044715
_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


class GELU(Module):
    """GELU as torch: exact ``x * Phi(x) = 0.5 x (1 + erf(x / sqrt 2))`` by default.

    Args:
        approximate: ``"none"`` (exact, erf) or ``"tanh"``:
            ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` as in GPT-2.
    """

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"GELU approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    def forward(self, x: Any) -> Any:
        """Return GELU of ``x``."""
        if self.approximate == "tanh":
            t = xp_of(x).tanh(_GELU_C * (x + _GELU_K * x * x * x))
            self.save_for_backward(x, t)
            return 0.5 * x * (1.0 + t)
        cdf = 0.5 * (1.0 + erf(x * _INV_SQRT2))
        self.save_for_backward(x, cdf)
        return x * cdf

    def backward_input(self, grad_output: Any) -> Any:
        """Return ``grad_output * d gelu/dx``."""
        x, aux = self.saved_tensors()
        if self.approximate == "tanh":
            inner = _GELU_C * (1.0 + 3.0 * _GELU_K * x * x)
            d = 0.5 * (1.0 + aux) + 0.5 * x * (1.0 - aux * aux) * inner
        else:
            # d/dx x Phi(x) = Phi(x) + x phi(x)
            d = aux + x * (_INV_SQRT_2PI * xp_of(x).exp(-0.5 * x * x))
        return grad_output * d

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class Tanh(Module):
    """tanh(x)."""

    def forward(self, x: Any) -> Any:
        """Return ``tanh(x)`` and remember it (the derivative is 1 - y^2)."""
        y = xp_of(x).tanh(x)
        self.save_for_backward(y)
        return y

    def backward_input(self, grad_output: Any) -> Any:
        """Return ``grad_output * (1 - tanh(x)^2)``."""
        (y,) = self.saved_tensors()
        return grad_output * (1.0 - y * y)


def _sigmoid(x: Any) -> Any:
    # Via tanh, which never overflows (exp(-x) does for very negative x).
    return 0.5 * (1.0 + xp_of(x).tanh(0.5 * x))


class Sigmoid(Module):
    """1 / (1 + exp(-x))."""

    def forward(self, x: Any) -> Any:
        """Return the logistic sigmoid of ``x``."""
        y = _sigmoid(x)
        self.save_for_backward(y)
        return y

    def backward_input(self, grad_output: Any) -> Any:
        """Return ``grad_output * y (1 - y)``."""
        (y,) = self.saved_tensors()
        return grad_output * y * (1.0 - y)


class SiLU(Module):
    """x * sigmoid(x) (swish), the gate of LLaMA-style MLPs."""

    def forward(self, x: Any) -> Any:
        """Return ``x * sigmoid(x)``."""
        s = _sigmoid(x)
        self.save_for_backward(x, s)
        return x * s

    def backward_input(self, grad_output: Any) -> Any:
        """Return ``grad_output * s (1 + x (1 - s))`` with ``s = sigmoid(x)``."""
        x, s = self.saved_tensors()
        return grad_output * (s * (1.0 + x * (1.0 - s)))


class Softmax(Module):
    """exp(x) / sum(exp(x)) along ``dim`` (max-shifted, so large inputs do not overflow).

    Args:
        dim: the axis that sums to one.
    """

    def __init__(self, dim: int = -1) -> None:
        super().__init__()
        self.dim = int(dim)

    def forward(self, x: Any) -> Any:
        """Return the softmax of ``x`` along ``dim``."""
        y = softmax(x, self.dim)
        self.save_for_backward(y)
        return y

    def backward_input(self, grad_output: Any) -> Any:
        """Return ``y * (g - sum(g * y))`` along ``dim``."""
        (y,) = self.saved_tensors()
        return y * (grad_output - (grad_output * y).sum(axis=self.dim, keepdims=True))

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class LogSoftmax(Module):
    """x - logsumexp(x) along ``dim`` (max-shifted).

    Args:
        dim: the axis normalised over.
    """

    def __init__(self, dim: int = -1) -> None:
        super().__init__()
        self.dim = int(dim)

    def forward(self, x: Any) -> Any:
        """Return the log-softmax of ``x`` along ``dim``."""
        y = log_softmax(x, self.dim)
        self.save_for_backward(y)
        return y

    def backward_input(self, grad_output: Any) -> Any:
        """Return ``g - exp(y) * sum(g)`` along ``dim``."""
        (y,) = self.saved_tensors()
        return grad_output - xp_of(y).exp(y) * grad_output.sum(axis=self.dim, keepdims=True)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


def log_softmax(x: Any, dim: int = -1) -> Any:
    """Return ``x - logsumexp(x)`` along ``dim``, max-shifted (fully masked -inf rows give nan)."""
    xp = xp_of(x)
    shifted = x - x.max(axis=dim, keepdims=True)
    return shifted - xp.log(xp.exp(shifted).sum(axis=dim, keepdims=True))


def softmax(x: Any, dim: int = -1) -> Any:
    """Return the softmax of ``x`` along ``dim``, max-shifted."""
    xp = xp_of(x)
    e = xp.exp(x - x.max(axis=dim, keepdims=True))
    return e / e.sum(axis=dim, keepdims=True)

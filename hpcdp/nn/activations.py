"""Elementwise activations with explicit backward; each caches only what its derivative needs."""
from __future__ import annotations

import math
from typing import Any

from ._backend import xp_of
from .module import Module

__all__ = ["ReLU", "GELU", "Tanh", "Sigmoid", "Identity"]


def _missing(layer: Module) -> RuntimeError:
    return RuntimeError(f"{type(layer).__name__}.backward called without a preceding forward")


class Identity(Module):
    """Pass the input through unchanged (a placeholder layer)."""

    def forward(self, x: Any) -> Any:
        """Return ``x``."""
        return x

    def backward(self, grad_output: Any) -> Any:
        """Return ``grad_output``."""
        return grad_output


class ReLU(Module):
    """max(x, 0)."""

    def __init__(self) -> None:
        super().__init__()
        self._mask: Any = None

    def forward(self, x: Any) -> Any:
        """Return ``max(x, 0)`` and remember where ``x > 0``."""
        self._mask = x > 0
        return x * self._mask

    def backward(self, grad_output: Any) -> Any:
        """Pass the gradient where the input was positive."""
        if self._mask is None:
            raise _missing(self)
        g = grad_output * self._mask
        self._mask = None
        return g


_GELU_C = math.sqrt(2.0 / math.pi)
_GELU_K = 0.044715


class GELU(Module):
    """GELU with the tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).

    This is torch's ``GELU(approximate="tanh")`` (as in GPT-2); it avoids needing erf on cupy and numpy.
    """

    def __init__(self) -> None:
        super().__init__()
        self._x: Any = None
        self._t: Any = None

    def forward(self, x: Any) -> Any:
        """Return the tanh-approximated GELU of ``x``."""
        xp = xp_of(x)
        t = xp.tanh(_GELU_C * (x + _GELU_K * x * x * x))
        self._x, self._t = x, t
        return 0.5 * x * (1.0 + t)

    def backward(self, grad_output: Any) -> Any:
        """Return ``grad_output * d gelu/dx``."""
        if self._x is None:
            raise _missing(self)
        x, t = self._x, self._t
        inner = _GELU_C * (1.0 + 3.0 * _GELU_K * x * x)
        d = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * inner
        self._x = self._t = None
        return grad_output * d


class Tanh(Module):
    """tanh(x)."""

    def __init__(self) -> None:
        super().__init__()
        self._y: Any = None

    def forward(self, x: Any) -> Any:
        """Return ``tanh(x)`` and remember it (the derivative is 1 - y^2)."""
        self._y = xp_of(x).tanh(x)
        return self._y

    def backward(self, grad_output: Any) -> Any:
        """Return ``grad_output * (1 - tanh(x)^2)``."""
        if self._y is None:
            raise _missing(self)
        y, self._y = self._y, None
        return grad_output * (1.0 - y * y)


class Sigmoid(Module):
    """1 / (1 + exp(-x))."""

    def __init__(self) -> None:
        super().__init__()
        self._y: Any = None

    def forward(self, x: Any) -> Any:
        """Return the logistic sigmoid of ``x`` (computed via tanh, which never overflows)."""
        self._y = 0.5 * (1.0 + xp_of(x).tanh(0.5 * x))
        return self._y

    def backward(self, grad_output: Any) -> Any:
        """Return ``grad_output * y (1 - y)``."""
        if self._y is None:
            raise _missing(self)
        y, self._y = self._y, None
        return grad_output * y * (1.0 - y)

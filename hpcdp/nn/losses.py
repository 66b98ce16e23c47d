"""Losses as Modules: ``loss = loss_fn(out, y)`` then ``model.backward(loss_fn.backward())``."""
from __future__ import annotations

from typing import Any

import numpy as np

from ._backend import xp_of
from .module import Module

__all__ = ["MSELoss", "CrossEntropyLoss"]

_REDUCTIONS = ("mean", "sum", "none")


def _check_reduction(reduction: str) -> str:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    return reduction


class _Loss(Module):
    def __init__(self, reduction: str = "mean") -> None:
        super().__init__()
        self.reduction = _check_reduction(reduction)
        self._cache: Any = None

    def __call__(self, input: Any, target: Any) -> Any:  # noqa: A002 - torch's argument name
        return self.forward(input, target)

    def _reduce(self, per_elem: Any, dtype: Any) -> Any:
        # A 0-d array of the input dtype (not a numpy scalar), so float(loss) works for numpy and cupy.
        xp = xp_of(per_elem)
        if self.reduction == "none":
            return per_elem
        total = per_elem.sum() if self.reduction == "sum" else per_elem.mean()
        return xp.asarray(total, dtype=dtype)

    def _grad_scale(self, grad_output: Any, n: int) -> Any:
        if grad_output is None:
            if self.reduction == "none":
                raise ValueError(f"{type(self).__name__}(reduction='none').backward needs grad_output")
            grad_output = 1.0
        if self.reduction == "mean":
            return grad_output / n if isinstance(grad_output, float) else grad_output * (1.0 / n)
        return grad_output

    def extra_repr(self) -> str:
        return f"reduction={self.reduction!r}"


class MSELoss(_Loss):
    """Mean (or summed) squared error between ``input`` and ``target`` of the same shape."""

    def forward(self, input: Any, target: Any) -> Any:  # noqa: A002
        """Return the reduced squared error and cache the difference."""
        if tuple(input.shape) != tuple(target.shape):
            raise ValueError(f"MSELoss: input shape {tuple(input.shape)} != target shape {tuple(target.shape)}")
        diff = input - target
        self._cache = diff
        return self._reduce(diff * diff, input.dtype)

    def backward(self, grad_output: Any = None) -> Any:
        """Return dLoss/dinput (``grad_output`` defaults to 1 for reduced losses)."""
        if self._cache is None:
            raise RuntimeError("MSELoss.backward called without a preceding forward")
        diff, self._cache = self._cache, None
        scale = self._grad_scale(grad_output, diff.size)
        return (2.0 * diff * scale).astype(diff.dtype, copy=False)


class CrossEntropyLoss(_Loss):
    """Softmax cross-entropy of logits (N, C) (or (..., C)) against integer class targets (N,) (or (...)).

    Uses a max-shifted log-softmax, so large logits neither overflow nor lose precision.
    """

    def forward(self, input: Any, target: Any) -> Any:  # noqa: A002
        """Return the reduced negative log-likelihood and cache the softmax."""
        xp = xp_of(input)
        if input.ndim < 1 or tuple(input.shape[:-1]) != tuple(target.shape):
            raise ValueError(
                f"CrossEntropyLoss: logits {tuple(input.shape)} need targets of shape {tuple(input.shape[:-1])}, "
                f"got {tuple(target.shape)}"
            )
        if not np.issubdtype(np.dtype(target.dtype), np.integer):
            raise TypeError(f"CrossEntropyLoss expects integer class targets, got dtype {target.dtype}")
        c = input.shape[-1]
        logits = input.reshape(-1, c)
        t = target.reshape(-1)
        if t.size and (int(t.min()) < 0 or int(t.max()) >= c):
            raise ValueError(f"CrossEntropyLoss: targets must be in [0, {c}), got range [{int(t.min())}, {int(t.max())}]")
        shifted = logits - logits.max(axis=1, keepdims=True)
        lse = xp.log(xp.exp(shifted).sum(axis=1, keepdims=True))
        logp = shifted - lse
        rows = xp.arange(t.shape[0])
        nll = -logp[rows, t]
        self._cache = (logp, t, tuple(input.shape))
        return self._reduce(nll.reshape(target.shape), input.dtype)

    def backward(self, grad_output: Any = None) -> Any:
        """Return dLoss/dlogits = (softmax - onehot) * scale, shaped like the logits."""
        if self._cache is None:
            raise RuntimeError("CrossEntropyLoss.backward called without a preceding forward")
        (logp, t, shape), self._cache = self._cache, None
        xp = xp_of(logp)
        grad = xp.exp(logp)
        grad[xp.arange(t.shape[0]), t] -= 1.0
        scale = self._grad_scale(grad_output, t.shape[0])
        if self.reduction == "none":
            grad *= xp.asarray(scale, dtype=grad.dtype).reshape(-1, 1)
        else:
            grad *= scale
        return grad.reshape(shape)

"""Losses as Modules: ``loss = loss_fn(out, y)`` then ``model.backward(loss_fn.backward())``.

Like layers, a loss saves what its backward needs under the current ``nn.microbatch``, so a
pipeline's last stage can hold the losses of several microbatches at once.

With chunked gradients on (``nn.chunking``, deterministic training), a ``mean`` loss is the mean
of each chunk of samples on its own: the gradient of a sample is divided by its chunk's count,
the same on any rank, and the division by the number of chunks comes after the exact sum. The
per-chunk values are kept in ``chunk_values``; the value returned is their plain mean (for
display; ``comm.reproducible.exact_total`` of ``chunk_values`` over the ranks divided by the
number of chunks is the reproducible global loss).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import chunking
from .backend import xp_of
from .activations import log_softmax
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
        self.chunk_values: Any = None   # per-chunk losses of the last chunked forward

    def _chunks(self, input: Any) -> int | None:  # noqa: A002
        """Chunks of samples in ``input`` when chunked gradients are on and this loss averages."""
        if chunking.chunk_size() is None or self.reduction != "mean":
            return None
        return chunking.chunks_in(input, "loss input")

    def backward(self, grad_output: Any = None) -> Any:
        """Return dLoss/dinput (``grad_output`` defaults to 1 for reduced losses)."""
        return self.backward_input(grad_output)

    def _grad_scale(self, grad_output: Any, n: int) -> Any:
        """Combine ``grad_output`` (None: 1) with the 1/n of a mean reduction."""
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

    def forward(self, input: Any, target: Any) -> Any:  # noqa: A002 - torch's argument name
        """Return the reduced squared error and save the difference."""
        if tuple(input.shape) != tuple(target.shape):
            raise ValueError(f"MSELoss: input shape {tuple(input.shape)} != target shape {tuple(target.shape)}")
        diff = input - target
        k = self._chunks(input)
        self.save_for_backward(diff, k)
        per = diff * diff
        if self.reduction == "none":
            return per
        if k is not None:  # each chunk's own mean
            self.chunk_values = per.reshape(k, -1).mean(axis=1)
            return xp_of(per).asarray(self.chunk_values.mean(), dtype=input.dtype)
        # A 0-d array of the input dtype (not a numpy scalar), so float(loss) works for numpy and cupy.
        total = per.sum() if self.reduction == "sum" else per.mean()
        return xp_of(per).asarray(total, dtype=input.dtype)

    def backward_input(self, grad_output: Any = None) -> Any:
        """Return dLoss/dinput = 2 (input - target) * scale."""
        diff, k = self.saved_tensors()
        scale = self._grad_scale(grad_output, diff.size if k is None else diff.size // k)
        return (2.0 * diff * scale).astype(diff.dtype, copy=False)


class CrossEntropyLoss(_Loss):
    """Softmax cross-entropy of logits against integer class targets, as torch's.

    Accepted layouts (decided by the target's shape):

    * torch's: logits ``(N, C)`` or ``(N, C, d1, ...)`` with targets ``(N,)`` or ``(N, d1, ...)``;
      unbatched ``(C,)`` with a 0-d target;
    * class axis last: logits ``(..., C)`` with targets ``(...)``, e.g. a language model's
      ``(B, T, C)`` against ``(B, T)`` (the same as flattening both to ``(B*T, C)`` and ``(B*T,)``).

    A shape that fits both (``(N, C, C)`` against ``(N, C)``) is refused as ambiguous: flatten it.

    Args:
        reduction: ``"mean"`` (over targets that are not ignored), ``"sum"`` or ``"none"``.
        ignore_index: targets equal to it add no loss and get zero gradient.
        label_smoothing: in [0, 1]; the target distribution is ``(1 - s) onehot + s / C``.
    """

    def __init__(self, reduction: str = "mean", *, ignore_index: int = -100, label_smoothing: float = 0.0) -> None:
        super().__init__(reduction)
        if not 0.0 <= float(label_smoothing) <= 1.0:
            raise ValueError(f"CrossEntropyLoss label_smoothing must be in [0, 1], got {label_smoothing}")
        self.ignore_index = int(ignore_index)
        self.label_smoothing = float(label_smoothing)

    def _class_last(self, input: Any, target: Any) -> bool:  # noqa: A002
        shape, tshape = tuple(input.shape), tuple(target.shape)
        last = input.ndim >= 1 and shape[:-1] == tshape
        second = input.ndim >= 3 and shape[:1] + shape[2:] == tshape
        if last and second:
            raise ValueError(f"CrossEntropyLoss: logits {shape} against targets {tshape} are ambiguous (class axis 1 "
                             f"or last); reshape them to (N, C) and (N,)")
        if not (last or second):
            raise ValueError(f"CrossEntropyLoss: logits {shape} need targets of shape {shape[:-1]} (classes last) "
                             f"or {shape[:1] + shape[2:]} (classes on axis 1), got {tshape}")
        return last

    def forward(self, input: Any, target: Any) -> Any:  # noqa: A002
        """Return the reduced loss and save the log-probabilities."""
        xp = xp_of(input)
        if not np.issubdtype(np.dtype(target.dtype), np.integer):
            raise TypeError(f"CrossEntropyLoss expects integer class targets, got dtype {target.dtype}")
        class_last = self._class_last(input, target)
        x = input if class_last else xp.moveaxis(input, 1, -1)
        c = x.shape[-1]
        t = target.reshape(-1)
        valid = t != self.ignore_index
        tv = t[valid]
        if tv.size and (int(tv.min()) < 0 or int(tv.max()) >= c):
            raise ValueError(f"CrossEntropyLoss: targets must be in [0, {c}) or ignore_index {self.ignore_index}, "
                             f"got range [{int(tv.min())}, {int(tv.max())}]")
        t = xp.where(valid, t, 0)
        logp = log_softmax(x.reshape(-1, c), -1)
        per = -logp[xp.arange(t.shape[0]), t]
        if self.label_smoothing:
            per = (1.0 - self.label_smoothing) * per - self.label_smoothing * logp.mean(axis=1)
        per = xp.where(valid, per, 0.0).astype(input.dtype, copy=False)
        count = int(valid.sum())
        k = self._chunks(input)
        if k is not None:  # each chunk's own mean over its non-ignored targets
            counts = valid.reshape(k, -1).sum(axis=1)
            with np.errstate(invalid="ignore", divide="ignore"):
                self.chunk_values = (per.reshape(k, -1).sum(axis=1) / counts).astype(input.dtype)
            count = xp.repeat(xp.maximum(counts, 1), t.shape[0] // k)   # per row: its chunk's count
        self.save_for_backward(logp, t, valid, count, tuple(input.shape), class_last)
        if self.reduction == "none":
            return per.reshape(target.shape)
        if k is not None:
            return xp.asarray(self.chunk_values.mean(), dtype=input.dtype)
        if self.reduction == "sum":
            return xp.asarray(per.sum(), dtype=input.dtype)
        # torch's mean is over non-ignored targets: nan when every target is ignored.
        return xp.asarray(per.sum() / count if count else math.nan, dtype=input.dtype)

    def backward_input(self, grad_output: Any = None) -> Any:
        """Return dLoss/dlogits = (softmax - target distribution) * scale, shaped like the logits."""
        logp, t, valid, count, shape, class_last = self.saved_tensors()
        xp = xp_of(logp)
        grad = xp.exp(logp)
        grad[xp.arange(t.shape[0]), t] -= 1.0 - self.label_smoothing
        if self.label_smoothing:
            grad -= self.label_smoothing / grad.shape[1]
        grad *= valid[:, None]
        if not isinstance(count, int):   # chunked: each row times 1/its chunk's count (as below)
            grad *= (1.0 / count).astype(grad.dtype)[:, None]
            if grad_output is not None:
                grad *= self._grad_scale(grad_output, 1)
            return self._shaped(grad, shape, class_last)
        # All targets ignored: no gradient (rather than 0/0).
        scale = self._grad_scale(grad_output, max(count, 1))
        if self.reduction == "none":
            grad *= xp.asarray(scale, dtype=grad.dtype).reshape(-1, 1)
        else:
            grad *= scale
        return self._shaped(grad, shape, class_last)

    @staticmethod
    def _shaped(grad: Any, shape: tuple[int, ...], class_last: bool) -> Any:
        """The (rows, classes) gradient in the logits' layout."""
        if class_last:
            return grad.reshape(shape)
        moved = shape[:1] + shape[2:] + shape[1:2]
        return xp_of(grad).moveaxis(grad.reshape(moved), -1, 1)

    def extra_repr(self) -> str:
        extra = f", ignore_index={self.ignore_index}" if self.ignore_index != -100 else ""
        if self.label_smoothing:
            extra += f", label_smoothing={self.label_smoothing}"
        return super().extra_repr() + extra

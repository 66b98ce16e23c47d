"""Functional helpers on parameter lists: gradient clipping and flat-vector views."""
from __future__ import annotations

import math
from typing import Any, Iterable

from .backend import xp_of
from .parameter import Parameter

__all__ = ["clip_grad_norm_", "parameters_to_vector", "vector_to_parameters"]


def _as_list(params: Iterable[Parameter] | Parameter) -> list[Parameter]:
    return [params] if isinstance(params, Parameter) else list(params)


def clip_grad_norm_(parameters: Iterable[Parameter] | Parameter, max_norm: float,
                    norm_type: float = 2.0) -> float:
    """Scale gradients in place so their joint norm is at most ``max_norm``; return the norm before.

    Args:
        parameters: parameters whose ``.grad`` (if any) are clipped together.
        max_norm: largest allowed total norm.
        norm_type: p of the p-norm; ``math.inf`` for the max-abs norm.
    """
    grads = [p.grad for p in _as_list(parameters) if p.grad is not None]
    if not grads:
        return 0.0
    xp = xp_of(grads[0])
    if norm_type == math.inf:
        total = max(float(xp.abs(g).max()) if g.size else 0.0 for g in grads)
    else:
        # Accumulate in float64 so the norm of many float32 gradients does not lose precision.
        acc = sum(float((xp.abs(g.astype(xp.float64)) ** norm_type).sum()) for g in grads)
        total = acc ** (1.0 / norm_type)
    coef = float(max_norm) / (total + 1e-6)
    if coef < 1.0:
        for g in grads:
            g *= coef
    return total


def parameters_to_vector(parameters: Iterable[Parameter]) -> Any:
    """Return a new 1-D array holding every parameter's data, in iteration order."""
    ps = _as_list(parameters)
    if not ps:
        raise ValueError("parameters_to_vector got no parameters")
    xp = xp_of(ps[0].data)
    return xp.concatenate([p.data.reshape(-1) for p in ps])


def vector_to_parameters(vec: Any, parameters: Iterable[Parameter]) -> None:
    """Copy consecutive slices of the 1-D ``vec`` into each parameter's data, in place."""
    ps = _as_list(parameters)
    total = sum(p.size for p in ps)
    if vec.ndim != 1 or vec.shape[0] != total:
        raise ValueError(f"vector_to_parameters: vector of shape {tuple(vec.shape)} for {total} parameter elements")
    offset = 0
    for p in ps:
        p.data[...] = vec[offset:offset + p.size].reshape(p.shape)
        offset += p.size

"""Deterministic parameter initialisation: one global seeded Generator, host-side sampling.

Values are drawn on the host with numpy in float64 and then cast and moved, so a given seed gives
bit-identical parameters on every rank, run, backend and array module (numpy or cupy).
"""
from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import numpy as np

from .backend import copy_into
from .parameter import Parameter

__all__ = [
    "manual_seed", "default_generator", "generator_for", "uniform", "normal",
    "kaiming_uniform", "uniform_", "normal_", "zeros_", "ones_",
]

# A fixed default seed (torch does the same) keeps unseeded scripts reproducible.
_DEFAULT_SEED = 0
_generator = np.random.default_rng(_DEFAULT_SEED)


def manual_seed(seed: int) -> np.random.Generator:
    """Reset the global Generator used by layers created without ``seed=``; return it."""
    global _generator
    _generator = np.random.default_rng(seed)
    return _generator


def default_generator() -> np.random.Generator:
    """Return the global Generator (its state advances as layers are created)."""
    return _generator


def generator_for(seed: int | np.random.Generator | None) -> np.random.Generator:
    """Return a Generator for a layer: its own from ``seed``, else the global one."""
    if seed is None:
        return _generator
    if isinstance(seed, np.random.Generator):
        return seed
    return np.random.default_rng(seed)


def uniform(shape: tuple[int, ...], low: float, high: float, *, dtype: Any = np.float32,
            xp: ModuleType = np, generator: np.random.Generator | None = None) -> Any:
    """Return a new array of U(low, high) samples from ``generator`` (default: the global one)."""
    gen = generator or _generator
    return xp.asarray(gen.uniform(low, high, size=shape).astype(dtype))


def normal(shape: tuple[int, ...], mean: float = 0.0, std: float = 1.0, *, dtype: Any = np.float32,
           xp: ModuleType = np, generator: np.random.Generator | None = None) -> Any:
    """Return a new array of N(mean, std^2) samples from ``generator`` (default: the global one)."""
    gen = generator or _generator
    return xp.asarray(gen.normal(mean, std, size=shape).astype(dtype))


def kaiming_uniform(shape: tuple[int, ...], fan_in: int, *, dtype: Any = np.float32, xp: ModuleType = np,
                    generator: np.random.Generator | None = None) -> Any:
    """Return torch's default Linear init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (kaiming, a=sqrt(5))."""
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    return uniform(shape, -bound, bound, dtype=dtype, xp=xp, generator=generator)


def _arr(x: Any) -> Any:
    # Not getattr(x, "data"): numpy arrays have a .data buffer attribute of their own.
    return x.data if isinstance(x, Parameter) else x


def uniform_(array: Any, low: float = 0.0, high: float = 1.0, generator: np.random.Generator | None = None) -> Any:
    """Fill ``array`` (or a Parameter's data) in place with U(low, high); return it."""
    a = _arr(array)
    gen = generator or _generator
    copy_into(a, gen.uniform(low, high, size=a.shape).astype(a.dtype))
    return array


def normal_(array: Any, mean: float = 0.0, std: float = 1.0, generator: np.random.Generator | None = None) -> Any:
    """Fill ``array`` (or a Parameter's data) in place with N(mean, std^2); return it."""
    a = _arr(array)
    gen = generator or _generator
    copy_into(a, gen.normal(mean, std, size=a.shape).astype(a.dtype))
    return array


def zeros_(array: Any) -> Any:
    """Fill ``array`` (or a Parameter's data) with zeros in place; return it."""
    _arr(array)[...] = 0
    return array


def ones_(array: Any) -> Any:
    """Fill ``array`` (or a Parameter's data) with ones in place; return it."""
    _arr(array)[...] = 1
    return array

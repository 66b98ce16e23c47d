"""FSDP's public policies: frozen dataclasses validated on construction, as PyTorch's ``_fsdp_api``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

__all__ = ["MixedPrecision", "SizeBasedPolicy", "size_based", "STRATEGIES", "Event", "resolve_dtype",
           "BF16"]

#: sharding strategies and the ZeRO stage each one is
STRATEGIES = {
    "full_shard": "ZeRO-3: parameters, gradients and optimizer state sharded; gathered per unit "
                  "for forward and again for backward",
    "shard_grad_op": "ZeRO-2: gradients and optimizer state sharded; parameters gathered in "
                     "forward and kept until the unit's backward",
    "no_shard": "DDP through the same code: every rank holds everything, gradients allreduced",
    "hybrid_shard": "full_shard inside sub-groups of shard_size consecutive ranks, replicated "
                    "across them (gradients reduce-scattered inside, then allreduced across)",
}

#: bfloat16 has no numpy dtype here: it is emulated (float32 values rounded to bfloat16, moved
#: as their uint16 bit patterns), and named by this string
BF16 = "bfloat16"

_LOW = {np.dtype(np.float16)}


def resolve_dtype(value: Any, what: str) -> Any:
    """``np.dtype`` of a floating type, or the string ``"bfloat16"``; raise on anything else."""
    if value is None:
        return None
    if isinstance(value, str) and value.lower() in ("bfloat16", "bf16"):
        return BF16
    try:
        dt = np.dtype(value)
    except TypeError:
        raise ValueError(f"MixedPrecision: {what} {value!r} is not a dtype") from None
    if dt.name == "bfloat16":  # ml_dtypes' type, if installed: same emulation, same bits
        return BF16
    if dt not in (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)):
        raise ValueError(f"MixedPrecision: {what} must be float16, bfloat16, float32 or float64, got {dt}")
    return dt


def is_low_precision(dtype: Any) -> bool:
    """float16 and bfloat16: sums are pre-divided by the world size so they cannot overflow."""
    return dtype == BF16 or dtype in _LOW


@dataclass(frozen=True)
class MixedPrecision:
    """Compute in ``param_dtype``, reduce gradients in ``reduce_dtype``, keep the master in float32.

    Each unit's parameters are all-gathered in ``param_dtype`` (half the bytes of float32 for
    float16/bfloat16) and forward and backward run on them; gradients are cast to
    ``reduce_dtype`` (default: ``param_dtype``) for the reduce-scatter, and the result is added to
    the sharded master gradient. The sharded master parameters and the optimizer state keep the
    model's dtype, upgraded to float32 if the model was built in half precision.

    ``"bfloat16"`` is emulated, since numpy has no bfloat16 arithmetic: values are rounded to
    bfloat16 (nearest even) and travel as their 16-bit patterns, compute happens in float32 on
    those rounded values, and a bfloat16 gradient reduction is an ``all_to_all`` of bf16 chunks
    summed in float32 (what a bf16 reduce-scatter moves: half the bytes of float32).

    Args:
        param_dtype: dtype of the gathered parameters and of forward/backward compute.
        reduce_dtype: dtype of the gradient reduction (None: ``param_dtype``).
        cast_forward_inputs: cast the root's floating inputs to ``param_dtype``.
    """

    param_dtype: Any = None
    reduce_dtype: Any = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        p = resolve_dtype(self.param_dtype, "param_dtype")
        r = resolve_dtype(self.reduce_dtype, "reduce_dtype")
        if p is None and r is None:
            raise ValueError("MixedPrecision needs param_dtype or reduce_dtype")
        object.__setattr__(self, "param_dtype", p)
        object.__setattr__(self, "reduce_dtype", r if r is not None else p)


@dataclass(frozen=True)
class SizeBasedPolicy:
    """Wrap every submodule holding at least ``min_params`` parameters not already in a unit below it.

    As torch's ``size_based_auto_wrap_policy``: decided bottom-up, so a large block becomes a unit
    and its parent counts only what the block leaves behind.
    """

    min_params: int

    def __post_init__(self) -> None:
        if isinstance(self.min_params, bool) or not isinstance(self.min_params, (int, np.integer)) \
                or self.min_params < 1:
            raise ValueError(f"size_based: min_params must be a positive int, got {self.min_params!r}")
        object.__setattr__(self, "min_params", int(self.min_params))


def size_based(min_params: int) -> SizeBasedPolicy:
    """Return an ``auto_wrap`` policy: a unit per submodule with >= ``min_params`` unwrapped parameters."""
    return SizeBasedPolicy(min_params)


class Event(NamedTuple):
    """One entry of ``FSDP.events``: what happened to which unit, and who was gathered right after.

    ``kind`` is one of ``ag_post`` (all-gather posted), ``ag_done`` (gathered and installed),
    ``fwd_begin``/``fwd_end``, ``bwd_begin``/``bwd_end`` (the unit's forward or backward started
    or ended), ``reshard`` (gathered parameters dropped), ``rs_post`` (gradient reduction posted)
    and ``rs_done``. ``prefetch`` marks an all-gather posted ahead of the unit's own hook.
    ``gathered`` are the units holding (or receiving) full parameters after the event and
    ``active`` the units whose forward or backward is running, outermost first.
    """

    kind: str
    unit: str
    phase: str
    prefetch: bool
    gathered: tuple[str, ...]
    active: tuple[str, ...]

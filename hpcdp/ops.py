"""Reduction operators: names users type, and the numpy ufuncs that define their results."""
from __future__ import annotations

import enum

import numpy as np

__all__ = ["ReduceOp", "as_op", "check_op_dtype"]


class ReduceOp(str, enum.Enum):
    """Reduction applied elementwise across ranks; the result keeps the input dtype.

    On bool arrays sum/max are logical or and prod/min logical and, as numpy's ufuncs give them.
    """

    SUM = "sum"
    MEAN = "mean"
    MAX = "max"
    MIN = "min"
    PROD = "prod"

    @property
    def ufunc(self) -> np.ufunc:
        return _UFUNCS[self]

    def __str__(self) -> str:
        return self.value

    # Enum's own __hash__ is Python code (hash of the name); the str one is C, agrees with
    # ``ReduceOp.SUM == "sum"`` and keeps table lookups on the latency path cheap.
    __hash__ = str.__hash__


_UFUNCS = {
    ReduceOp.SUM: np.add,
    ReduceOp.MEAN: np.add,
    ReduceOp.MAX: np.maximum,
    ReduceOp.MIN: np.minimum,
    ReduceOp.PROD: np.multiply,
}


def as_op(op: ReduceOp | str, where: str = "") -> ReduceOp:
    """Accept a ReduceOp or its name ("sum", "SUM", "avg" for mean as torch users say).

    ``where`` (the operation and rank) starts the error message.
    """
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str):
        name = op.lower()
        if name == "avg":
            name = "mean"
        try:
            return ReduceOp(name)
        except ValueError:
            pass
    raise ValueError(
        f"{where + ': ' if where else ''}unknown reduction op {op!r}; expected one of "
        f"{[o.value for o in ReduceOp]}"
    )


def check_op_dtype(op: ReduceOp, dtype: np.dtype, where: str) -> None:
    """Reject combinations numpy would answer badly or not at all, before anything is sent."""
    if op is ReduceOp.MEAN and dtype.kind not in "fc":
        raise TypeError(
            f"{where}: op 'mean' needs a floating or complex dtype, got {dtype}; "
            "use op='sum' and divide, or cast first"
        )
    if op in (ReduceOp.MAX, ReduceOp.MIN) and dtype.kind == "c":
        raise TypeError(f"{where}: op '{op.value}' is not defined for complex dtype {dtype}")

"""Pipeline actions: what one rank does at one step of a schedule, printable as ``"2F0"``.

An action names a stage, an operation and a microbatch. Compute actions run a stage's module;
communication actions move an activation (``*_F``) or a gradient (``*_B``) between neighbouring
stages on different ranks. Text form: ``{stage}{op}{microbatch}``, e.g. ``"1F3"`` (forward of
stage 1 on microbatch 3), ``"0W2"`` (weight gradient), ``"2RECV_B0"`` (post the receive of the
gradient stage 2 needs for microbatch 0).
"""
from __future__ import annotations

import enum
import re
from typing import NamedTuple

__all__ = ["Op", "Action", "COMPUTE_OPS", "COMM_OPS"]


class Op(enum.Enum):
    """The kinds of action; the value is the action's text code."""

    FORWARD = "F"
    BACKWARD = "B"            # full backward: input and weight gradients
    BACKWARD_INPUT = "I"      # input gradient only (zero-bubble split)
    BACKWARD_WEIGHT = "W"     # weight gradient of an earlier BACKWARD_INPUT
    SEND_F = "SEND_F"         # send this stage's output activation to the next stage
    RECV_F = "RECV_F"         # post the receive of this stage's input activation
    SEND_B = "SEND_B"         # send this stage's input gradient to the previous stage
    RECV_B = "RECV_B"         # post the receive of this stage's output gradient

    @property
    def description(self) -> str:
        return _DESCRIPTION[self]


_DESCRIPTION = {
    Op.FORWARD: "forward",
    Op.BACKWARD: "backward",
    Op.BACKWARD_INPUT: "input gradient",
    Op.BACKWARD_WEIGHT: "weight gradient",
    Op.SEND_F: "send of the activation",
    Op.RECV_F: "receive of the activation",
    Op.SEND_B: "send of the gradient",
    Op.RECV_B: "receive of the gradient",
}

COMPUTE_OPS = frozenset({Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT})
COMM_OPS = frozenset({Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B})
_BY_CODE = {op.value: op for op in Op}
# Longest codes first so "SEND_F" is not read as something shorter.
_PATTERN = re.compile(r"(\d+)(" + "|".join(sorted(map(re.escape, _BY_CODE), key=len, reverse=True))
                      + r")(\d+)")


class Action(NamedTuple):
    """One step of one rank: ``op`` on ``stage`` for microbatch ``mb``."""

    stage: int
    op: Op
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.op.value}{self.mb}"

    def __repr__(self) -> str:
        return f"Action({self})"

    @property
    def is_compute(self) -> bool:
        return self.op in COMPUTE_OPS

    def describe(self) -> str:
        """``"2F3 (forward of stage 2, microbatch 3)"``: how errors name an action."""
        return f"{self} ({self.op.description} of stage {self.stage}, microbatch {self.mb})"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Read ``"2F0"``-style text back into an action."""
        m = _PATTERN.fullmatch(text.strip())
        if m is None:
            codes = ", ".join(op.value for op in Op)
            raise ValueError(f"not a pipeline action: {text!r} (expected <stage><op><microbatch> "
                             f"with op one of {codes}, e.g. '2F0')")
        return cls(int(m.group(1)), _BY_CODE[m.group(2)], int(m.group(3)))


def F(stage: int, mb: int) -> Action:  # noqa: N802 - reads like the text form
    return Action(stage, Op.FORWARD, mb)


def B(stage: int, mb: int) -> Action:  # noqa: N802
    return Action(stage, Op.BACKWARD, mb)


def I(stage: int, mb: int) -> Action:  # noqa: N802, E743
    return Action(stage, Op.BACKWARD_INPUT, mb)


def W(stage: int, mb: int) -> Action:  # noqa: N802
    return Action(stage, Op.BACKWARD_WEIGHT, mb)

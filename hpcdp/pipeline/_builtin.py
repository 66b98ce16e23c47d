"""The built-in schedules: ``gpipe``, ``1f1b``, ``interleaved_1f1b`` and ``zero_bubble`` (ZB-H1).

Each returns a compute-only :class:`Schedule` (the runtime and ``verify`` add the transfers).
``p`` is the number of pipeline ranks, ``m`` the number of microbatches, ``v`` the virtual stages
per rank. Every builder's output is checked deadlock-free on the simulated clock before it is
returned, so a formula that does not cover some (p, m, v) fails loudly instead of hanging a job.
"""
from __future__ import annotations

from typing import Callable

from ._actions import Action, B, F, I, W
from ._schedule import Schedule
from ._verify import ScheduleError, simulate

__all__ = ["schedule", "register_schedule", "available_schedules",
           "gpipe", "one_f_one_b", "interleaved_1f1b", "zero_bubble"]


def _check(p: int, m: int, v: int, name: str, virtual_ok: bool = False) -> None:
    for field, value in (("stages", p), ("microbatches", m), ("virtual", v)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"schedule {name!r}: {field} must be a positive int, got {value!r}")
    if v != 1 and not virtual_ok:
        raise ValueError(f"schedule {name!r} runs one stage per rank (virtual=1); "
                         f"use 'interleaved_1f1b' for virtual={v}")


def gpipe(p: int, m: int, v: int = 1) -> Schedule:
    """All forwards, then all backwards (peak activations: m on every rank)."""
    _check(p, m, v, "gpipe")
    rows = [[F(r, k) for k in range(m)] + [B(r, k) for k in range(m)] for r in range(p)]
    return Schedule.from_lists(rows, m, 1, "gpipe")


def one_f_one_b(p: int, m: int, v: int = 1) -> Schedule:
    """PipeDream-flush 1F1B: ``p - 1 - r`` warm-up forwards, then one forward one backward
    (peak activations: ``min(p - r, m)`` on rank r)."""
    _check(p, m, v, "1f1b")
    rows = []
    for r in range(p):
        warm = min(p - 1 - r, m)
        row = [F(r, k) for k in range(warm)]
        for k in range(m - warm):
            row += [F(r, warm + k), B(r, k)]
        row += [B(r, k) for k in range(m - warm, m)]
        rows.append(row)
    return Schedule.from_lists(rows, m, 1, "1f1b")


def _interleaved_order(p: int, m: int, v: int, rank: int, backward: bool) -> list[tuple[int, int]]:
    """(stage, microbatch) in Megatron's order: rounds of ``min(p, m)`` microbatches, each round
    through every local stage (last stage first when going backward); the last round may be short."""
    per_round = min(p, m)
    seq = []
    for first in range(0, m, per_round):
        group = range(first, min(first + per_round, m))
        chunks = range(v - 1, -1, -1) if backward else range(v)
        seq += [(c * p + rank, mb) for c in chunks for mb in group]
    return seq


def _interleaved_rows(p: int, m: int, v: int, warm: list[int]) -> list[list[Action]]:
    rows = []
    total = m * v
    for r in range(p):
        fwd = _interleaved_order(p, m, v, r, False)
        bwd = _interleaved_order(p, m, v, r, True)
        w = min(warm[r], total)
        row = [F(*fwd[k]) for k in range(w)]
        for k in range(total - w):
            row += [F(*fwd[w + k]), B(*bwd[k])]
        row += [B(*bwd[k]) for k in range(total - w, total)]
        rows.append(row)
    return rows


def interleaved_1f1b(p: int, m: int, v: int = 2) -> Schedule:
    """Megatron's interleaved 1F1B with ``v`` stages per rank (stage s on rank s % p).

    Warm-up forwards on rank r: ``(v - 1) * min(p, m) + 2 * (p - 1 - r)``. When ``m`` is not a
    multiple of ``p`` the last round is short; a rank whose warm-up is then too small to keep the
    pipeline moving gets one more warm-up forward until the schedule is deadlock-free (at most all
    of them, which is deadlock-free by construction).
    """
    _check(p, m, v, "interleaved_1f1b", virtual_ok=True)
    if v == 1:
        s = one_f_one_b(p, m)
        return Schedule(s.actions, m, 1, "interleaved_1f1b")
    warm = [(v - 1) * min(p, m) + 2 * (p - 1 - r) for r in range(p)]
    for _ in range(p * m * v + 1):
        s = Schedule.from_lists(_interleaved_rows(p, m, v, warm), m, v, "interleaved_1f1b")
        sim = simulate(s.with_comms())
        if not sim.stuck:
            return s
        for r, i in sim.stuck.items():
            warm[r] += 1
    raise ScheduleError(f"interleaved_1f1b(p={p}, m={m}, v={v}): no deadlock-free warm-up found")


def zero_bubble(p: int, m: int, v: int = 1) -> Schedule:
    """ZB-H1 (Qi et al., 2023): backward split into input gradient ``I`` and weight gradient ``W``.

    Forwards and input gradients in 1F1B's order (``p - 1 - r`` warm-up forwards on rank r); the
    weight gradient of microbatch ``k`` runs right after the input gradient of ``k + r``, so the
    last ranks, which would otherwise finish early, hold back their weight gradients and the input
    gradients travel up the pipeline without waiting for them. With ``m >= p`` and equal F, I and W
    times the step takes ``3m + p - 1`` units: the bubble shrinks from 1F1B's
    ``(p - 1)(t_F + t_I + t_W)`` to ``(p - 1)(t_F + t_I - t_W)``, and every rank stashes at most
    ``min(p, m)`` microbatches (1F1B's rank 0).
    """
    _check(p, m, v, "zero_bubble")
    rows = []
    for r in range(p):
        warm = min(p - 1 - r, m)
        row = [F(r, k) for k in range(warm)]

        def backward(k: int) -> list[Action]:
            return [I(r, k)] + ([W(r, k - r)] if k - r >= 0 else [])

        for k in range(m - warm):
            row += [F(r, warm + k)] + backward(k)
        for k in range(m - warm, m):
            row += backward(k)
        row += [W(r, k) for k in range(max(0, m - r), m)]
        rows.append(row)
    return Schedule.from_lists(rows, m, 1, "zero_bubble")


_REGISTRY: dict[str, Callable[[int, int, int], Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
    "zero_bubble": zero_bubble,
}


def register_schedule(name: str, builder: Callable[[int, int, int], Schedule]) -> None:
    """Make ``schedule(name, ...)`` and ``Pipeline(schedule=name)`` call ``builder(p, m, v)``."""
    if not callable(builder):
        raise TypeError(f"register_schedule: builder for {name!r} is not callable")
    _REGISTRY[name] = builder


def available_schedules() -> list[str]:
    """Names ``schedule`` accepts."""
    return list(_REGISTRY)


def schedule(name: str, stages: int, microbatches: int, virtual: int = 1) -> Schedule:
    """A built-in (or registered) schedule by name.

    Args:
        name: "gpipe", "1f1b", "interleaved_1f1b" or "zero_bubble".
        stages: pipeline ranks.
        microbatches: microbatches per step.
        virtual: stages per rank; only interleaved_1f1b takes more than 1 (with 1 it is 1f1b).
    """
    try:
        builder = _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown pipeline schedule {name!r}; available: {available_schedules()}") from None
    s = builder(stages, microbatches, virtual)
    if not isinstance(s, Schedule):
        raise TypeError(f"schedule builder {name!r} returned {type(s).__name__}, not a Schedule")
    return s

"""``step_breakdown``: where one training step's time goes, phase by phase.

A step time over DDP's says that a strategy is slower, not why. This times the phases of a few
steps on every rank: forward, backward, the time blocked on all-gathers and on gradient
reductions within them, the optimizer step and ``zero_grad``, with the page faults
and the kernel time of the step beside them, since a step that allocates its buffers afresh pays
for them there (the kernel zero-fills every page it hands back). Each figure is the median over
the steps, then the largest over the ranks (the slowest rank sets the pace).
"""
from __future__ import annotations

import resource
import statistics
import time
from typing import Any

import numpy as np

from ..comm.world import group_or_default

__all__ = ["StepBreakdown", "step_breakdown"]

_PHASES = ("forward", "all_gather_wait", "backward", "reduce_wait", "optimizer", "zero_grad", "step")


class StepBreakdown(dict):
    """Seconds per phase (``forward``, ``all_gather_wait``, ``backward``, ``reduce_wait``,
    ``optimizer``, ``zero_grad``, ``step``), ``page_faults`` and ``sys_seconds`` per step.

    A plain dict whose ``str`` is one line in milliseconds. The waits are FSDP's ``comm_wait``:
    all-gathers in forward (and in backward for full_shard), reductions in backward; 0 for a
    model that does not report them.
    """

    def __str__(self) -> str:
        ms = {k: 1e3 * self.get(k, 0.0) for k in _PHASES}
        return (f"forward {ms['forward']:.2f} ms (all-gather wait {ms['all_gather_wait']:.2f}), "
                f"backward {ms['backward']:.2f} (reduce wait {ms['reduce_wait']:.2f}), optimizer "
                f"{ms['optimizer']:.2f}, zero_grad {ms['zero_grad']:.2f}; step {ms['step']:.2f} ms, "
                f"{self.get('page_faults', 0.0):.0f} page faults, "
                f"{1e3 * self.get('sys_seconds', 0.0):.2f} ms in the kernel")


def _now() -> tuple[float, float, int]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), r.ru_stime, r.ru_minflt


def step_breakdown(model: Any, optimizer: Any, x: Any, loss_fn: Any, target: Any = None, *,
                   steps: int = 5, group: Any = None) -> StepBreakdown:
    """Run ``steps`` training steps and return the slowest rank's median time per phase.

    One step is ``out = model(x)``, ``loss_fn(out, target)``, ``model.backward(loss_fn.backward())``,
    ``optimizer.step()``, ``optimizer.zero_grad()`` (the loop of ``hpcdp.DDP`` and ``FSDP``).
    Collective over ``group`` (default: the default group): every member calls it, with its own
    batch; the steps train the model.

    Args:
        model: an ``FSDP`` (its ``comm_wait`` splits out the waits), ``hpcdp.DDP`` or anything
            with ``__call__`` and ``backward``.
        optimizer: built on ``model.parameters()``.
        x: the batch; ``target`` defaults to ``x`` (an autoencoder's loss).
        loss_fn: an ``hpcdp.nn`` loss (called, then ``backward()`` gives the output gradient).
        steps: steps to time (at least 1).
    """
    if steps < 1:
        raise ValueError(f"step_breakdown: steps must be >= 1, got {steps}")
    group = group_or_default(group)
    target = x if target is None else target
    rows: dict[str, list[float]] = {k: [] for k in (*_PHASES, "page_faults", "sys_seconds")}
    for _ in range(steps):
        t0, s0, f0 = _now()
        out = model(x)
        loss_fn(out, target)
        t1 = time.perf_counter()
        model.backward(loss_fn.backward())
        t2 = time.perf_counter()
        optimizer.step()
        t3 = time.perf_counter()
        optimizer.zero_grad()
        t4, s4, f4 = _now()
        waits = getattr(model, "comm_wait", None) or {}
        for k, v in (("forward", t1 - t0), ("backward", t2 - t1), ("optimizer", t3 - t2),
                     ("zero_grad", t4 - t3), ("step", t4 - t0), ("page_faults", float(f4 - f0)),
                     ("sys_seconds", s4 - s0), ("all_gather_wait", waits.get("all_gather", 0.0)),
                     ("reduce_wait", waits.get("reduce", 0.0))):
            rows[k].append(v)
    mine = np.array([statistics.median(v) for v in rows.values()], dtype=np.float64)
    slowest = group.allreduce(mine, "max") if group.size > 1 else mine
    return StepBreakdown(zip(rows, (float(v) for v in slowest)))

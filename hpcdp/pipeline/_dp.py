"""Pipeline x data parallelism: the 2-D rank layout and gradient averaging across replicas.

``grid(pp, dp)`` lays ``pp * dp`` ranks out as ``rank = replica * pp + stage_rank``: each row of
``pp`` consecutive ranks is one pipeline, each column of ``dp`` ranks holds the same stages of every
replica. A ``Pipeline`` given ``dp_group=`` averages its stages' gradients over that column,
starting each stage's (asynchronous) allreduce as soon as this rank's last backward action for it
has run, so the reduction overlaps with the rest of the schedule.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .._arrays import xp_of
from ..comm.world import get_default_group
from ._actions import Action, Op

__all__ = ["Grid", "grid", "DataParallelGrads"]


@dataclass(frozen=True)
class Grid:
    """This rank's place in a ``pp x dp`` layout."""

    pp_group: Any     # the ranks of this pipeline (pass to PipelineStage)
    dp_group: Any     # the replicas of this rank's stages (pass to Pipeline(dp_group=...))
    pp_rank: int
    dp_rank: int


def grid(pp: int, dp: int | None = None, *, group: Any = None) -> Grid:
    """Split ``group`` (default: the default group) into pipelines of ``pp`` ranks and ``dp``
    replicas; collective over ``group``.

    Args:
        pp: ranks per pipeline.
        dp: replicas (default: ``group.size // pp``); ``pp * dp`` must equal the group size.
    """
    if group is None:
        group = get_default_group()
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise ValueError(f"grid: pp must be a positive int, got {pp!r}")
    dp = group.size // pp if dp is None else dp
    if pp * dp != group.size:
        raise ValueError(f"grid: pp={pp} x dp={dp} != {group.size} ranks of group {group.name}")
    me = group.rank
    pp_groups = [group.new_group([d * pp + i for i in range(pp)], name=f"{group.name}.pp{d}")
                 for d in range(dp)]
    dp_groups = [group.new_group([d * pp + i for d in range(dp)], name=f"{group.name}.dp{i}")
                 for i in range(pp)]
    return Grid(pp_groups[me // pp], dp_groups[me % pp], me % pp, me // pp)


class DataParallelGrads:
    """Average one rank's stage gradients over ``group`` once per step (see the module docstring)."""

    def __init__(self, stage: Any, actions: Sequence[Action], group: Any) -> None:
        self.group = group
        self.stage = stage
        self._works: list[tuple[Any, list[Any], Any]] = []
        last: dict[int, int] = {}
        for i, a in enumerate(actions):
            if a.op in (Op.BACKWARD, Op.BACKWARD_WEIGHT, Op.BACKWARD_INPUT):
                last[a.stage] = i
        self._launch_at: dict[int, int] = {i: s for s, i in last.items()}
        if group.size > 1:
            for _, p in stage._named_params():   # replicas start equal, as with DDP
                group.broadcast(p.data, 0)

    def after(self, index: int) -> None:
        """Called after action ``index``: start the allreduce of a stage whose backward is done."""
        s = self._launch_at.get(index)
        if s is None or self.group.size == 1:
            return
        params = [p for p in self.stage.modules[s].parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = xp_of(p.data).zeros_like(p.data)
        by_dtype: dict[Any, list[Any]] = {}
        for p in params:
            by_dtype.setdefault(np.dtype(p.grad.dtype), []).append(p)
        for ps in by_dtype.values():
            xp = xp_of(ps[0].grad)
            flat = xp.concatenate([p.grad.reshape(-1) for p in ps])
            self._works.append((self.group.allreduce(flat, "mean", out=flat, async_op=True), ps, flat))

    def finish(self, loss: float) -> float:
        """Wait for the gradient averages, write them back; return the replicas' mean loss."""
        if self.group.size == 1:
            return loss
        for work, ps, flat in self._works:
            work.wait()
            off = 0
            for p in ps:
                n = p.grad.size
                p.grad[...] = flat[off:off + n].reshape(p.grad.shape)
                off += n
        self._works = []
        return float(self.group.allreduce(np.array([loss], np.float64), "mean")[0])

"""Pipeline parallelism: schedules as data, a verifier on a simulated clock, and the runtime.

    stage = hpcdp.pipeline.PipelineStage(model)            # this rank's stages of a Sequential
    pipe = hpcdp.pipeline.Pipeline(stage, schedule="1f1b", n_microbatches=8, loss_fn=nn.CrossEntropyLoss())
    loss = pipe.step(x, y)                                 # the full batch's loss, on every rank
    s = hpcdp.pipeline.schedule("zero_bubble", stages=4, microbatches=8); print(s)
    hpcdp.pipeline.verify(s)                               # deadlocks, order, memory, bubble

A ``torch.nn.Sequential`` works the same way: ``PipelineStage(torch_model)``, a torch loss
(``loss_fn=torch.nn.CrossEntropyLoss()``), ``torch.optim`` on ``stage.parameters()``.
"""
from __future__ import annotations

from ._actions import Action, Op
from ._builtin import available_schedules, register_schedule, schedule
from ._dp import Grid, grid
from ._runtime import Pipeline
from ._schedule import Schedule
from ._stage import PipelineStage, balanced_split
from ._torch import TorchLoss
from ._verify import Costs, Report, ScheduleError, verify

__all__ = [
    "PipelineStage", "Pipeline", "Schedule", "Action", "Op", "schedule", "verify", "Report",
    "Costs", "ScheduleError", "register_schedule", "available_schedules", "grid", "Grid",
    "balanced_split", "TorchLoss",
]

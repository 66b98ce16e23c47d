"""Optimizers (SGD, Adam, AdamW) that update parameters in place, and learning-rate schedules."""
from __future__ import annotations

from . import lr_scheduler
from .names import get_optimizer_state_dict, name_keyed, set_optimizer_state_dict
from .adam import Adam, AdamW
from .optimizer import Optimizer
from .sgd import SGD
from .zero import ZeroRedundancyOptimizer

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "lr_scheduler", "ZeroRedundancyOptimizer",
           "name_keyed", "get_optimizer_state_dict", "set_optimizer_state_dict"]

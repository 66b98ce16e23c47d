"""Sharded checkpoints in one parallel-HDF5 file: atomic, verified, loadable on any number of ranks.

    save("ckpt/step-100", {"model": ddp.state_dict(), "optim": opt.state_dict(), "step": 100})
    state = load("ckpt/step-100", like=current_state)    # any world size; reshards
    latest("ckpt")                                       # newest committed checkpoint or None
    on_preempt(save_fn)                                  # Slurm --signal=USR1: save, requeue, exit
    save(path, state_of(ddp, opt, step=5)); load_into(path, model, opt)   # model + optimizer, torch too
"""
from __future__ import annotations

from ._commit import latest, list_checkpoints
from ._format import Shard
from ._reader import load
from ._save import AsyncSave, save
from .preempt import Preemption, on_preempt, restart_count
from .training import load_into, state_of

__all__ = ["save", "load", "latest", "list_checkpoints", "Shard", "AsyncSave",
           "on_preempt", "Preemption", "restart_count", "state_of", "load_into"]

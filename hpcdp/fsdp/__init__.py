"""Fully sharded data parallelism (ZeRO-3/2), its DDP and hybrid variants, and their policies.

    fsdp = hpcdp.fsdp.FSDP(model, strategy="full_shard", auto_wrap={Block},
                           mixed_precision=hpcdp.fsdp.MixedPrecision("bfloat16", "float32"))
    opt = optim.AdamW(fsdp.parameters(), lr=3e-4)        # the shards
    out = fsdp(x); fsdp.backward(loss_fn.backward()); fsdp.clip_grad_norm_(1.0); opt.step()

    fsdp = hpcdp.fsdp.FSDP(torch_model, auto_wrap={torch.nn.Linear})   # a torch model
    opt = torch.optim.AdamW(fsdp.parameters())           # torch tensors over the shards
    loss_fn(fsdp(x), y).backward(); opt.step()           # reduced when backward returns

Modules by concern: ``_api`` (policies), ``_wrap`` (units), ``_param`` (one parameter's layout),
``_unit`` (a unit's buffers), ``_collectives``, ``_state`` (the per-step schedule and event log),
``_checkpoint``, ``_memory``, ``_pool`` (the step's buffers, reused across steps), ``_breakdown``
(a step's time per phase), ``_torch`` (what differs for torch models), and the ``fsdp`` facade.
"""
from __future__ import annotations

from ._api import STRATEGIES, Event, MixedPrecision, SizeBasedPolicy, size_based
from ._breakdown import StepBreakdown, step_breakdown
from ._memory import MemoryStats, distinct_nbytes, optimizer_state_bytes, zero_formula
from ._param import FreedGrad
from .fsdp import FSDP

__all__ = ["FSDP", "MixedPrecision", "SizeBasedPolicy", "size_based", "STRATEGIES", "Event",
           "MemoryStats", "FreedGrad", "zero_formula", "distinct_nbytes", "optimizer_state_bytes",
           "StepBreakdown", "step_breakdown"]

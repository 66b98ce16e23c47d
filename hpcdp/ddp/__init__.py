"""Distributed data parallel: ``DDP`` wraps a model so backward averages gradients across ranks.

Buckets are filled in reverse parameter order (first bucket capped at 1 MiB, then
``bucket_cap_mb``; one cap for all where starting early cannot overlap anything, see ``ddp.py``)
and each starts its allreduce as soon as its last gradient is ready. See
``ddp.py`` for the iteration protocol (the user-facing facade), ``_reducer.py`` for the buckets
and gradient hooks behind it, ``join.py`` for uneven inputs and ``comm_hooks.py`` for fp16/bf16
compression.
"""
from __future__ import annotations

from . import comm_hooks
from .comm_hooks import GradBucket, bf16_compress_hook, fp16_compress_hook
from .ddp import DDP
from .join import Join

DistributedDataParallel = DDP

__all__ = ["DDP", "DistributedDataParallel", "Join", "GradBucket", "comm_hooks",
           "fp16_compress_hook", "bf16_compress_hook"]

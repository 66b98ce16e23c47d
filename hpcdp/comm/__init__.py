"""The collectives core: process groups, collectives, point-to-point, ``Work``, the world.

Everything above (``nn``, ``ddp``, ``fsdp``, ``pipeline``, ``rpc``,
``checkpoint``, ``launch``) gets its group from here, never through ``import hpcdp``; this
package reaches down only to ``backends`` (the transports), ``trace`` (its recording hooks,
``trace.hooks``) and the foundation modules (``errors``, ``ops``, ``_arrays``, ``_config``).
"""
from __future__ import annotations

from .group import ProcessGroup
from .topology import CartGroup, dims_create
from .work import Work
from .world import (
    finalize, get_default_group, init, is_initialized, local_rank, local_world_size, new_group, rank,
    world_size,
)

__all__ = ["ProcessGroup", "Work", "init", "finalize", "is_initialized", "get_default_group",
           "new_group", "rank", "world_size", "local_rank", "local_world_size", "CartGroup", "dims_create"]

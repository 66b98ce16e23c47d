"""hpcdp: data, model and pipeline parallelism for numpy/cupy on HPC clusters.

One API over MPI, TCP and simulated (threads) backends; see ``hpcdp.init``.
"""
from __future__ import annotations

from typing import Any

from .launch import spawn
from .comm.world import (
    finalize, get_default_group, init, is_initialized, local_rank, local_world_size, new_group, rank,
    world_size,
)
from .backends import available_backends, register_backend
from .comm.collectives import (
    all_gather, all_gather_into_tensor, all_gather_object, all_reduce, all_to_all,
    all_to_all_single, allgather, allreduce, alltoall, barrier, broadcast, broadcast_object,
    broadcast_object_list, gather, gather_object, get_rank, get_world_size, irecv, isend, recv,
    reduce, reduce_scatter, reduce_scatter_tensor, scatter, send, sendrecv,
)
from .comm.p2p import (
    ANY_SOURCE, ANY_TAG, P2POp, Status, batch_isend_irecv, iprobe, probe, recv_any, wait_all,
)
from .errors import (
    AuthError, BackendUnavailableError, CheckpointError, CollectiveMismatchError,
    CommTimeoutError, HpcdpError, PeerFailureError, ProtocolError,
)
from .comm.group import ProcessGroup
from .comm.topology import PROC_NULL, UNDEFINED, CartGroup, dims_create
from .ops import ReduceOp
# eager, not lazy: importing the submodule hpcdp.progress (get_logger, "from hpcdp.progress
# import ...") would bind the module over the lazily loaded function of the same name
from .progress import get_logger, progress
from .comm.stragglers import report_stragglers
from .comm.work import Work

from ._version import __version__

# Heavier layers load on first use, so `import hpcdp` stays fast and MPI-free.
_LAZY = {
    "DDP": ("hpcdp.ddp", "DDP"),
    "DistributedDataParallel": ("hpcdp.ddp", "DDP"),
    "nn": ("hpcdp.nn", None),
    "optim": ("hpcdp.optim", None),
    "data": ("hpcdp.data", None),
    "checkpoint": ("hpcdp.checkpoint", None),
    "FSDP": ("hpcdp.fsdp", "FSDP"),
    "FullyShardedDataParallel": ("hpcdp.fsdp", "FSDP"),
    "fsdp": ("hpcdp.fsdp", None),
    "pipeline": ("hpcdp.pipeline", None),
    "rpc": ("hpcdp.rpc", None),
    "trace": ("hpcdp.trace", None),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        mod_name, attr = _LAZY[name]
        mod = importlib.import_module(mod_name)
        value = mod if attr is None else getattr(mod, attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hpcdp' has no attribute {name!r}")


__all__ = [
    "init", "finalize", "is_initialized", "rank", "world_size", "local_rank", "local_world_size", "new_group",
    "get_default_group", "spawn", "available_backends", "register_backend", "ProcessGroup",
    "ReduceOp", "Work", "allreduce", "all_reduce", "broadcast", "reduce", "all_gather",
    "allgather", "gather", "scatter", "reduce_scatter", "all_to_all", "alltoall", "barrier",
    "send", "recv", "sendrecv", "isend", "irecv", "ANY_SOURCE", "ANY_TAG", "Status", "P2POp",
    "batch_isend_irecv", "wait_all", "probe", "iprobe", "recv_any", "broadcast_object", "all_gather_object", "gather_object",
    "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
    "broadcast_object_list", "get_rank", "get_world_size",
    "HpcdpError", "BackendUnavailableError", "CommTimeoutError", "CollectiveMismatchError",
    "PeerFailureError", "AuthError", "ProtocolError", "CheckpointError", "DDP",
    "DistributedDataParallel", "progress", "get_logger", "nn", "optim", "data", "checkpoint",
    "FSDP", "FullyShardedDataParallel", "fsdp", "pipeline", "rpc", "trace", "report_stragglers",
    "CartGroup", "dims_create", "PROC_NULL", "UNDEFINED",
]

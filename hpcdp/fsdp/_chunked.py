"""FSDP's ``deterministic_chunk``: each unit's per-chunk gradients added exactly.

With chunked gradients on (``nn.chunking``) a model parameter keeps one gradient per chunk of
samples (``Parameter.chunk_grads``) instead of writing into the unit's unsharded gradient.
When the unit's reduction is due, :func:`exact_reduction` lays every chunk out rank-major,
exactly as ``Unit.launch_reduction`` lays out the one summed gradient, and adds all chunks of
all ranks with ``comm.reproducible.sum_rows`` (a reduce-scatter of integer limbs over the
shard group, then over the replicas for hybrid sharding), divided once by the number of chunks
in the global batch. The shard gradient is then the same bits for every world size and every
strategy. The reduction completes when posted (the exact sum's two exchanges depend on each
other); the schedule around it is unchanged.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .._arrays import xp_of
from ..comm import reproducible

__all__ = ["ExactReduction", "exact_reduction"]


class ExactReduction:
    """A finished reduction with ``Reduction``'s interface (the schedule polls and waits)."""

    awaiting_second = False
    scale = 1.0   # the exact sum is already divided by the number of chunks

    def __init__(self, result: Any) -> None:
        self._result = result

    def advance(self) -> None:
        return None

    def poll(self) -> bool:
        return True

    def wait(self) -> Any:
        return self._result


def exact_reduction(unit: Any, chunks: int, staging: Any) -> ExactReduction:
    """Add the chunk gradients of ``unit``'s parameters exactly; this rank's piece (S + flags)."""
    comm = unit.comm
    stacks = []
    for i in unit.trainable:
        p = unit.slots[i].param
        got = p.chunk_grads or []
        stacks.append(None if not got else (got[0] if len(got) == 1 else xp_of(got[0]).concatenate(got)))
        p.chunk_grads = None
    rows = max([s.shape[0] for s in stacks if s is not None], default=0)
    xp = unit.xp
    n, k = comm.n, len(unit.slots)
    send = xp.zeros((max(rows, 1), n, unit.S + k), staging)
    for i, s in zip(unit.trainable, stacks):
        if s is None:
            continue
        slot = unit.slots[i]
        if n == 1:   # no_shard: the flat shard is the whole unit, parameter-major
            send[:s.shape[0], 0, slot.full_offset:slot.full_offset + slot.numel] = s.reshape(s.shape[0], -1)
        else:
            slot.copy_in_stack(s, send[:s.shape[0]])
    flags = np.zeros(k, staging)
    flags[sorted(unit.used)] = 1
    send[0, :, unit.S:] = xp.asarray(flags)
    if comm.shard is not None:
        piece = reproducible.sum_rows(comm.shard, send, mode="scatter", divisor=chunks,
                                      replicate=comm.replicate)[0]
    else:
        group = comm.replicate if comm.replicate is not None else comm.group
        piece = reproducible.sum_rows(group, send[:, 0], divisor=chunks)
    return ExactReduction(piece)

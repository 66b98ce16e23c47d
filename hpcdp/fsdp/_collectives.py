"""The collectives of a unit: one all-gather of the flat shards, one gradient reduction.

Groups: ``shard`` holds the ``n`` ranks a unit is split over (None when n == 1, as in no_shard),
``replicate`` the ``m`` ranks holding the same shard (None when m == 1: full_shard and
shard_grad_op). hybrid_shard has both; a gradient is reduce-scattered inside ``shard`` and the
result allreduced across ``replicate``.

Every collective is posted at a point fixed by the program (a hook, the recorded unit order, the
gather limit), never by timing, so every rank of a group posts the same collectives in the same
order (and ``HPCDP_DEBUG=detail``'s blocking cross-check of each call cannot deadlock). A hybrid
reduction's allreduce is posted when the next unit's reduction is launched (waiting for its own
reduce-scatter, which had that unit's backward to complete), or at the end of backward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .._arrays import xp_of
from ..ddp.comm_hooks import from_bf16, to_bf16
from ._api import BF16

__all__ = ["ShardComm", "Reduction", "comm_dtype", "encode", "decode"]


def comm_dtype(dtype: Any) -> Any:
    """What travels for ``dtype``: bfloat16 as its uint16 bit patterns."""
    return np.dtype(np.uint16) if dtype == BF16 else np.dtype(dtype)


def encode(x: Any, dtype: Any) -> Any:
    """``x`` as it travels in ``dtype`` (a copy unless it already is that dtype)."""
    if dtype == BF16:
        return to_bf16(x)
    return x if x.dtype == dtype else x.astype(dtype)


def decode(x: Any, dtype: Any) -> Any:
    """Values of a received ``x`` of ``dtype`` as numbers (bf16 bits widened to float32)."""
    return from_bf16(x) if dtype == BF16 else x


@dataclass
class ShardComm:
    """The groups one FSDP instance communicates over, and this rank's place in them."""

    group: Any               # the whole FSDP group
    shard: Any               # n ranks sharing one copy of the model, or None (n == 1)
    replicate: Any           # m ranks holding the same shard, or None (m == 1)

    @property
    def n(self) -> int:
        return 1 if self.shard is None else self.shard.size

    @property
    def m(self) -> int:
        return 1 if self.replicate is None else self.replicate.size

    @property
    def shard_rank(self) -> int:
        return 0 if self.shard is None else self.shard.rank

    @property
    def replica(self) -> int:
        """Which copy of the model this rank belongs to (0 for the copy that checkpoints)."""
        return 0 if self.replicate is None else self.replicate.rank

    @property
    def world(self) -> int:
        return self.n * self.m

    def all_gather(self, send: Any, out: Any) -> Any:
        """Post the all-gather of ``send`` (S,) into ``out`` (n, S); return its Work or None."""
        if self.shard is None:
            out[0] = send
            return None
        return self.shard.all_gather(send, out=out, async_op=True)


class Reduction:
    """A unit's gradient reduction in flight: reduce-scatter, then (hybrid) allreduce.

    ``send`` is the rank-major (n, S) gradient in the travelling dtype; the result is this rank's
    (S,) piece, summed over all ``n * m`` ranks; it still has to be multiplied by ``scale`` (one
    over that number, or 1 when ``predivided``), which the caller does while copying it out.
    A bfloat16 reduce-scatter is an ``all_to_all`` of bf16 chunks summed here in float32 (no
    transport has a bfloat16 sum); across replicas a bf16 partial is allreduced in float32.
    """

    def __init__(self, comm: ShardComm, send: Any, dtype: Any, predivided: bool, label: str,
                 pool: Any = None) -> None:
        self.comm, self.dtype, self.label = comm, dtype, label
        self.scale = 1.0 / comm.world if not predivided and comm.world > 1 else 1.0
        self._send: Any = send
        self._first: Any = None       # shard-group work
        self._second: Any = None      # replicate-group work
        self._partial: Any = None     # result of the first stage
        self._result: Any = None
        xp = xp_of(send)
        if comm.shard is None:
            self._partial = decode(send[0], dtype)
        elif dtype == BF16:
            self._first = comm.shard.all_to_all(send, async_op=True)
        else:
            shape = (1, send.shape[1])
            out = xp.empty(shape, send.dtype) if pool is None else pool.take(xp, shape, send.dtype)
            self._first = comm.shard.reduce_scatter(send, "sum", out=out, async_op=True)
        if self._first is None:
            self._start_second()

    def _take_first(self) -> None:
        res = self._first.wait()
        self._first = None
        self._send = None
        if self.dtype == BF16:  # (n, S) bf16 chunks of the piece this rank owns, from every rank
            res = from_bf16(res).sum(axis=0, dtype=np.float32)
        self._partial = res.reshape(-1)
        self._start_second()

    def _start_second(self) -> None:
        self._send = None
        if self.comm.replicate is not None:
            part = self._partial
            self._second = self.comm.replicate.allreduce(part, "sum", out=part, async_op=True)

    @property
    def awaiting_second(self) -> bool:
        """Whether the reduce-scatter is posted but the allreduce across replicas is not yet."""
        return self._first is not None and self.comm.replicate is not None

    def advance(self) -> None:
        """Wait for the reduce-scatter and post the allreduce across replicas (a fixed program point)."""
        if self._first is not None:
            self._take_first()

    def poll(self) -> bool:
        """Test the transport without blocking or posting anything; True when done."""
        if self._first is not None:
            return bool(self._first.is_completed()) and self.comm.replicate is None
        if self._second is not None:
            return bool(self._second.is_completed())
        return True

    def wait(self) -> Any:
        """Block until done; return this rank's summed piece (S,) as numbers (times ``scale``
        is the mean)."""
        if self._result is not None:
            return self._result
        if self._first is not None:
            self._take_first()
        if self._second is not None:
            self._second.wait()
            self._second = None
        res = self._partial
        self._result = res
        self._partial = None
        return res

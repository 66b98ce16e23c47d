"""Bucket assignment and the flat gradient buffers DDP reduces.

Parameters are taken in reverse registration order (the order backward produces their gradients),
split by (array module, dtype), and packed greedily into buckets: the first bucket of the model is
capped at ``first_cap_bytes`` (1 MiB by default, as torch does) so that the first allreduce starts
after only a little of backward has run; later buckets are capped at ``cap_bytes``. A parameter is
never split across buckets, so one larger than the cap gets a bucket of its own.

Buckets are numbered in the order their last gradient is expected to arrive, and DDP launches them
strictly in that order on every rank, so the sequence of collectives is the same everywhere even
when gradients arrive in a different order (unused parameters, tied weights).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from .._arrays import xp_of

__all__ = ["Bucket", "assign_buckets", "build_buckets", "FIRST_BUCKET_BYTES"]

#: Size cap of the first bucket (the one holding the last layers' gradients), like torch's.
FIRST_BUCKET_BYTES = 1 << 20


def assign_buckets(sizes_bytes: Sequence[int], keys: Sequence[Any], cap_bytes: int,
                   first_cap_bytes: int | None = None) -> list[list[int]]:
    """Group parameter positions into buckets; positions are given in reverse parameter order.

    Args:
        sizes_bytes: bytes of each parameter, in the order gradients are expected to arrive.
        keys: a hashable per parameter (array module, dtype); only equal keys share a bucket.
        cap_bytes: a bucket is closed once it holds at least this many bytes.
        first_cap_bytes: the cap of the first bucket closed (default ``min(1 MiB, cap_bytes)``).

    Returns:
        Lists of positions, ordered by the position of each bucket's last parameter, which is
        the order in which buckets become ready during backward.
    """
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap must be positive, got {cap_bytes} bytes")
    first = min(FIRST_BUCKET_BYTES, cap_bytes) if first_cap_bytes is None else first_cap_bytes
    open_: dict[Any, tuple[list[int], int]] = {}
    closed: list[list[int]] = []
    for pos, (nbytes, key) in enumerate(zip(sizes_bytes, keys)):
        members, total = open_.get(key, ([], 0))
        members.append(pos)
        total += int(nbytes)
        cap = first if not closed else cap_bytes
        if total >= cap:
            closed.append(members)
            open_.pop(key, None)
        else:
            open_[key] = (members, total)
    closed.extend(m for m, _ in open_.values())
    closed.sort(key=lambda m: m[-1])
    return closed


@dataclass
class Bucket:
    """One flat buffer and the parameters whose gradients live in it.

    ``params`` are in the order their gradients arrive; ``views[i]`` is the slice of ``flat``
    shaped like ``params[i]``.
    """

    index: int
    params: list[Any]
    names: list[str]
    flat: Any
    views: list[Any]
    offsets: list[int]
    #: hook calls still expected this pass before the bucket is complete
    pending: int = 0
    #: per parameter: hook calls seen this pass
    seen: list[int] = field(default_factory=list)
    #: per parameter: hook calls a pass makes (learnt on the first synced pass; None before)
    expected: list[int] | None = None
    work: Any = None
    launched: bool = False
    #: torch parameters: their tensors, and each one's gradient tensor as last pointed at its
    #: view (one identity test per tensor tells that the gradients are still the views)
    tensors: list[Any] | None = None
    pointed: list[Any] | None = None

    @property
    def dtype(self) -> Any:
        return self.flat.dtype

    @property
    def nbytes(self) -> int:
        return int(self.flat.nbytes)


def build_buckets(named: Sequence[tuple[str, Any]], cap_bytes: int,
                  first_cap_bytes: int | None = None) -> list[Bucket]:
    """Allocate zeroed flat buffers for ``named`` parameters (given in registration order)."""
    rev = list(reversed(named))
    sizes = [int(p.data.nbytes) for _, p in rev]
    keys = [(xp_of(p.data).__name__, np.dtype(p.data.dtype).str) for _, p in rev]
    buckets: list[Bucket] = []
    for bi, members in enumerate(assign_buckets(sizes, keys, cap_bytes, first_cap_bytes)):
        params = [rev[i][1] for i in members]
        xp = xp_of(params[0].data)
        total = sum(int(p.data.size) for p in params)
        flat = xp.zeros(total, dtype=params[0].data.dtype)
        views, offsets, off = [], [], 0
        for p in params:
            n = int(p.data.size)
            views.append(flat[off:off + n].reshape(p.data.shape))
            offsets.append(off)
            off += n
        buckets.append(Bucket(bi, params, [rev[i][0] for i in members], flat, views, offsets,
                              seen=[0] * len(params)))
    return buckets

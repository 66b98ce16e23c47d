"""Who writes which slab: the write plan every rank derives from the same gathered specs.

A *slab* is a block of a dataset (offsets + shape) written by one rank and checksummed on its own.
- Shards: each rank's block is its slab; the blocks must tile the global shape exactly.
- Replicated arrays of at least ``SPLIT_MIN`` bytes: rows split into near-equal slabs, one per
  rank, so every rank writes (these are written collectively).
- Smaller replicated arrays: written whole by one owner rank, owners balanced by bytes
  (written independently: no collective for a few KiB).
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Sequence

import numpy as np

from .._arrays import shard_bounds
from ..errors import CheckpointError
from ._format import Leaf

__all__ = ["Slab", "DatasetPlan", "make_plan", "check_tiling", "row_bounds", "SPLIT_MIN"]

#: replicated arrays at least this big are split by rows across all ranks
SPLIT_MIN = 1 << 20


@dataclass(frozen=True)
class Slab:
    rank: int
    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    def as_json(self, checksum: int) -> dict:
        return {"rank": self.rank, "offsets": list(self.offsets), "shape": list(self.shape),
                "checksum": checksum}


@dataclass(frozen=True)
class DatasetPlan:
    path: str
    kind: str               # "replicated" or "shard"
    shape: tuple[int, ...]
    dtype: str
    note: str
    mode: str               # "split" / "shard" (collective) or "owned" (one rank, independent)
    slabs: tuple[Slab, ...]

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * np.dtype(self.dtype).itemsize

    def slab_of(self, rank: int) -> Slab | None:
        for s in self.slabs:
            if s.rank == rank:
                return s
        return None


def row_bounds(rows: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` near-equal [lo, hi) row ranges (numpy.array_split's rule, ``_arrays.shard_bounds``)."""
    return shard_bounds(rows, parts)


def check_tiling(path: str, shape: tuple[int, ...], blocks: Sequence[tuple[tuple, tuple]]) -> None:
    """Raise unless the (offsets, shape) blocks cover ``shape`` exactly: no overlap, no hole."""
    boxes = []
    for r, (off, bshape) in enumerate(blocks):
        if len(off) != len(shape) or len(bshape) != len(shape):
            raise CheckpointError(f"save: shard {path!r}: rank {r}'s block has {len(bshape)} axes, "
                                  f"the global shape {shape} has {len(shape)}")
        if any(o < 0 or o + n > g for o, n, g in zip(off, bshape, shape)):
            raise CheckpointError(f"save: shard {path!r}: rank {r}'s block {tuple(bshape)} at "
                                  f"{tuple(off)} falls outside the global shape {shape}")
        if prod(bshape) > 0:
            boxes.append((r, off, bshape))
    for i, (ri, oi, si) in enumerate(boxes):
        for rj, oj, sj in boxes[i + 1:]:
            if all(a < b + m and b < a + n for a, n, b, m in zip(oi, si, oj, sj)):
                raise CheckpointError(f"save: shard {path!r}: the blocks of rank {ri} ({tuple(si)} at "
                                      f"{tuple(oi)}) and rank {rj} ({tuple(sj)} at {tuple(oj)}) overlap")
    covered = sum(prod(s) for _, _, s in boxes)
    if covered != prod(shape):
        raise CheckpointError(f"save: shard {path!r}: the blocks cover {covered} of {prod(shape)} "
                              f"elements of {shape}: there is a hole")


def make_plan(specs: Sequence[tuple], blocks: Sequence[Sequence[tuple]], size: int) -> list[DatasetPlan]:
    """The write plan from the agreed specs and every rank's shard blocks.

    Args:
        specs: ``Leaf.spec()`` of every leaf, in order (identical on all ranks).
        blocks: ``blocks[r][i]`` = (offsets, shape) of rank r's leaf i (shards; None otherwise).
    """
    load = [0] * size
    plans = []
    for i, (path, kind, shape, dtype, note) in enumerate(specs):
        item = np.dtype(dtype).itemsize
        nbytes = prod(shape) * item
        if kind == "shard":
            per_rank = [tuple(blocks[r][i]) for r in range(size)]
            check_tiling(path, shape, per_rank)
            slabs = tuple(Slab(r, tuple(o), tuple(s)) for r, (o, s) in enumerate(per_rank) if prod(s) > 0)
            plans.append(DatasetPlan(path, kind, shape, dtype, note, "shard", slabs))
            for s in slabs:
                load[s.rank] += prod(s.shape) * item
        elif nbytes >= SPLIT_MIN and len(shape) >= 1 and shape[0] >= 2 and size > 1:
            parts = min(size, shape[0])
            slabs = tuple(Slab(r, (lo,) + (0,) * (len(shape) - 1), (hi - lo,) + tuple(shape[1:]))
                          for r, (lo, hi) in enumerate(row_bounds(shape[0], parts)))
            plans.append(DatasetPlan(path, kind, shape, dtype, note, "split", slabs))
            for s in slabs:
                load[s.rank] += prod(s.shape) * item
        else:
            owner = 0 if len(shape) == 0 else min(range(size), key=lambda r: (load[r], r))
            load[owner] += nbytes
            slabs = (Slab(owner, (0,) * len(shape), tuple(shape)),) if nbytes or not shape else ()
            plans.append(DatasetPlan(path, kind, shape, dtype, note, "owned", slabs))
    return plans


def slab_data(leaf: Leaf, plan: DatasetPlan, rank: int) -> np.ndarray | None:
    """This rank's bytes for its slab of ``plan`` (a view when it can be), or None."""
    s = plan.slab_of(rank)
    if s is None:
        return None
    if leaf.kind == "shard":
        return leaf.data
    if plan.mode == "split":
        lo = s.offsets[0]
        return leaf.data[lo: lo + s.shape[0]]
    return leaf.data

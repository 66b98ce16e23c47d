"""DistributedSampler: each rank gets a disjoint, equally sized slice of a shuffled index list.

The semantics follow torch.utils.data.DistributedSampler exactly (pad by repeating indices from
the start, or drop the tail; rank r takes every num_replicas-th index starting at r), so recipes
ported from torch keep their per-rank batches. The permutation comes from
``np.random.default_rng(seed + epoch)``: the same on every rank, run, backend and machine, which is
what makes the shards disjoint without any communication.
"""
from __future__ import annotations

import math
from typing import Any, Iterator

import numpy as np

from .comm import world as comm_world

__all__ = ["DistributedSampler"]


def _world() -> tuple[int, int]:
    # hpcdp.data works before (or without) hpcdp.init(): one process, rank 0
    try:
        if comm_world.is_initialized():
            return int(comm_world.world_size()), int(comm_world.rank())
    except Exception:  # noqa: BLE001 - no usable runtime means single-process use
        pass
    return 1, 0


class DistributedSampler:
    """Split ``range(dataset_len)`` across ranks, reshuffled per epoch via ``set_epoch``.

    Args:
        dataset_len: number of samples, or any object with ``len()``.
        num_replicas: number of ranks; None reads ``hpcdp.world_size()`` when used (1 if not initialised).
        rank: this rank; None reads ``hpcdp.rank()`` when used (0 if not initialised).
        shuffle: permute with ``default_rng(seed + epoch)``; False keeps index order.
        seed: base seed; must be the same on every rank.
        drop_last: drop the tail so every rank gets ``len // num_replicas`` distinct samples instead
            of padding with repeated indices.
    """

    def __init__(self, dataset_len: int | Any, num_replicas: int | None = None, rank: int | None = None, *,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        n = dataset_len if isinstance(dataset_len, (int, np.integer)) else len(dataset_len)
        if n < 0:
            raise ValueError(f"DistributedSampler: dataset length must be >= 0, got {n}")
        if num_replicas is not None and num_replicas < 1:
            raise ValueError(f"DistributedSampler: num_replicas must be >= 1, got {num_replicas}")
        self.dataset_len = int(n)
        self._num_replicas = num_replicas
        self._rank = rank
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        if num_replicas is not None and rank is not None:
            self._check_rank(num_replicas, rank)

    @staticmethod
    def _check_rank(world: int, rank: int) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"DistributedSampler: rank {rank} is outside [0, {world})")

    @property
    def num_replicas(self) -> int:
        """Number of ranks sharing the dataset (read lazily from hpcdp when not given)."""
        return self._num_replicas if self._num_replicas is not None else _world()[0]

    @property
    def rank(self) -> int:
        """This rank's index (read lazily from hpcdp when not given)."""
        return self._rank if self._rank is not None else _world()[1]

    @property
    def num_samples(self) -> int:
        """Indices each rank receives per epoch (equal on every rank, so loops stay in lock step)."""
        world, n = self.num_replicas, self.dataset_len
        if self.drop_last and n % world != 0:
            return math.ceil((n - world) / world)
        return math.ceil(n / world)

    @property
    def total_size(self) -> int:
        """Indices handed out per epoch over all ranks (dataset length padded or trimmed)."""
        return self.num_samples * self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose permutation the next iteration uses (call it every epoch on every rank)."""
        self.epoch = int(epoch)

    def indices(self) -> np.ndarray:
        """Return this rank's indices for the current epoch as an int64 array."""
        world, rank = self.num_replicas, self.rank
        self._check_rank(world, rank)
        n, total = self.dataset_len, self.total_size
        if self.shuffle:
            order = np.random.default_rng(self.seed + self.epoch).permutation(n).astype(np.int64)
        else:
            order = np.arange(n, dtype=np.int64)
        if not self.drop_last:
            pad = total - n
            if pad > 0:
                # Repeat from the start (whole copies when the padding exceeds the dataset), as torch does.
                order = np.concatenate([order, np.tile(order, math.ceil(pad / n))[:pad]])
        else:
            order = order[:total]
        assert order.shape[0] == total
        return order[rank:total:world]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        return self.num_samples

    def batches(self, batch_size: int, drop_last: bool = False) -> Iterator[np.ndarray]:
        """Yield this rank's indices in int64 arrays of ``batch_size`` (last one shorter unless dropped).

        Every rank yields the same number of batches, which DDP needs (one allreduce per batch).
        """
        if batch_size < 1:
            raise ValueError(f"batches: batch_size must be >= 1, got {batch_size}")
        idx = self.indices()
        stop = (idx.shape[0] // batch_size) * batch_size if drop_last else idx.shape[0]
        for start in range(0, stop, batch_size):
            yield idx[start:start + batch_size]

    def num_batches(self, batch_size: int, drop_last: bool = False) -> int:
        """Return how many batches ``batches(batch_size, drop_last)`` yields."""
        n = self.num_samples
        return n // batch_size if drop_last else math.ceil(n / batch_size)

    def state_dict(self) -> dict[str, Any]:
        """Return the epoch and seed, so a resumed run continues the same sequence of permutations."""
        return {"epoch": self.epoch, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the epoch and seed from ``state_dict()``."""
        self.epoch, self.seed = int(state["epoch"]), int(state["seed"])

    def __repr__(self) -> str:
        return (f"DistributedSampler(len={self.dataset_len}, num_replicas={self.num_replicas}, rank={self.rank}, "
                f"shuffle={self.shuffle}, seed={self.seed}, drop_last={self.drop_last}, epoch={self.epoch})")

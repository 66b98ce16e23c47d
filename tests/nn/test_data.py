"""hpcdp.data.DistributedSampler: disjoint complete shards, torch's padding rules, determinism, batches."""
from __future__ import annotations

import collections

import numpy as np
import pytest

import hpcdp
from hpcdp.data import DistributedSampler


def shards(n, world, **kw):
    return [DistributedSampler(n, world, r, **kw).indices() for r in range(world)]


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("n,world", [(12, 4), (12, 1), (10, 4), (3, 5), (1, 3), (7, 7), (100, 3)])
def test_every_index_once_per_epoch(n, world, shuffle):
    parts = shards(n, world, shuffle=shuffle, seed=3)
    per_rank = -(-n // world)
    assert all(len(p) == per_rank for p in parts)
    assert all(p.dtype == np.int64 for p in parts)
    counts = collections.Counter(np.concatenate(parts).tolist())
    assert set(counts) == set(range(n))
    pad = per_rank * world - n
    # Only the padding repeats: the extra copies are the first `pad` indices of the permutation.
    order = np.random.default_rng(3).permutation(n) if shuffle else np.arange(n)
    expected_extra = collections.Counter(np.tile(order, -(-pad // n) if n else 0)[:pad].tolist())
    assert sum(counts.values()) == n + pad
    assert counts - collections.Counter(range(n)) == expected_extra


def test_matches_torch_layout():
    # torch: indices += indices[:pad]; rank r takes indices[r::world].
    order = np.random.default_rng(5 + 2).permutation(10)
    padded = np.concatenate([order, order[:2]])
    for r in range(4):
        s = DistributedSampler(10, 4, r, seed=5)
        s.set_epoch(2)
        np.testing.assert_array_equal(s.indices(), padded[r::4])
        assert list(s) == padded[r::4].tolist() and len(s) == 3


@pytest.mark.parametrize("n,world", [(10, 4), (12, 4), (3, 5)])
def test_drop_last(n, world):
    parts = shards(n, world, drop_last=True)
    per_rank = n // world
    assert all(len(p) == per_rank for p in parts)
    flat = np.concatenate(parts)
    assert len(set(flat.tolist())) == len(flat) == per_rank * world  # no duplicates
    assert set(flat.tolist()) <= set(range(n))
    assert len(DistributedSampler(n, world, 0, drop_last=True)) == per_rank


def test_epochs_and_seeds():
    s = DistributedSampler(50, 2, 0, seed=1)
    e0 = s.indices()
    s.set_epoch(1)
    e1 = s.indices()
    assert not np.array_equal(e0, e1) and set(e0) | set(DistributedSampler(50, 2, 1, seed=1).indices()) == set(range(50))
    s.set_epoch(0)
    np.testing.assert_array_equal(s.indices(), e0)  # deterministic: same seed and epoch, same order
    np.testing.assert_array_equal(DistributedSampler(50, 2, 0, seed=1).indices(), e0)
    assert not np.array_equal(DistributedSampler(50, 2, 0, seed=2).indices(), e0)
    np.testing.assert_array_equal(DistributedSampler(50, 2, 0, shuffle=False).indices(), np.arange(0, 50, 2))
    t = DistributedSampler(50, 2, 0, seed=1)
    t.load_state_dict({"epoch": 1, "seed": 1})
    np.testing.assert_array_equal(t.indices(), e1)


@pytest.mark.parametrize("drop_last", [False, True])
def test_batches(drop_last):
    s = DistributedSampler(23, 2, 1, seed=0)  # 12 indices on this rank
    batches = list(s.batches(5, drop_last=drop_last))
    assert [len(b) for b in batches] == ([5, 5] if drop_last else [5, 5, 2])
    assert len(batches) == s.num_batches(5, drop_last=drop_last)
    assert all(isinstance(b, np.ndarray) and b.dtype == np.int64 for b in batches)
    np.testing.assert_array_equal(np.concatenate(batches), s.indices()[: 10 if drop_last else 12])
    with pytest.raises(ValueError):
        list(s.batches(0))


def test_world_defaults_and_validation(monkeypatch):
    monkeypatch.setattr(hpcdp, "is_initialized", lambda: False)
    s = DistributedSampler(range(9))  # any sized object works; no runtime means one rank
    assert (s.num_replicas, s.rank, len(s)) == (1, 0, 9)
    with pytest.raises(ValueError):
        DistributedSampler(10, 2, 2)
    with pytest.raises(ValueError):
        DistributedSampler(10, 0, 0)
    with pytest.raises(ValueError):
        DistributedSampler(-1, 1, 0)


def test_world_read_lazily_from_hpcdp_on_sim_ranks():
    found = {}

    def body(rank):
        s = DistributedSampler(10, seed=4)  # created inside each rank: world and rank come from hpcdp
        found[rank] = (s.num_replicas, s.rank, s.indices().tolist())

    hpcdp.spawn(body, world_size=3, backend="sim")
    results = [found[r] for r in range(3)]
    assert [(w, r) for w, r, _ in results] == [(3, 0), (3, 1), (3, 2)]
    assert sorted(set(i for _, _, idx in results for i in idx)) == list(range(10))

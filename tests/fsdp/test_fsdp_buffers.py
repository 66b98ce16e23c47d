"""shard_grad_op's step buffers reused from step to step (never one the user still holds), and
``step_breakdown``'s per-phase figures, on every backend."""
from __future__ import annotations

import numpy as np
import pytest

from hpcdp.testing import check
from hpcdp.testing.fixtures import World
from fsdp_bodies import body_step_breakdown, body_zero2_buffers

pytestmark = pytest.mark.timeout(180)


def test_zero2_reuses_its_step_buffers(world: World) -> None:
    check(world.run(body_zero2_buffers))


@pytest.mark.parametrize("kind", ["ddp", "shard_grad_op", "full_shard"])
def test_step_breakdown(world: World, kind: str) -> None:
    check(world.run(body_step_breakdown, kind))


def test_pool_hands_out_only_free_buffers_and_forgets_idle_ones() -> None:
    """The pool's rules on their own: a buffer comes back only once nothing else refers to it
    (a view counts), one not handed out during a whole step is dropped at the next, and a pool
    that does not keep allocates every time."""
    from hpcdp.fsdp._pool import BufferPool

    pool = BufferPool()
    a = pool.take(np, (2, 3), np.float32)
    addr = a.__array_interface__["data"][0]
    view = a[1]
    del a
    b = pool.take(np, (2, 3), np.float32)          # the view keeps the first one busy
    assert b.__array_interface__["data"][0] != addr and pool.allocated == 2
    del view
    c = pool.take(np, (2, 3), np.float32)          # free again: the same memory
    assert c.__array_interface__["data"][0] == addr and pool.reused == 1
    assert pool.take(np, (3, 2), np.float32) is not c   # another shape is another buffer
    assert pool.zeros(np, 4, np.float64).tolist() == [0.0] * 4
    del b, c
    assert pool.idle_bytes() == pool.held_bytes() == 2 * 24 + 24 + 32
    pool.new_step()                   # everything was handed out in the step that ended: kept
    assert pool.held_bytes() == 104
    d = pool.take(np, (2, 3), np.float32)
    pool.new_step()                   # only d's kind was handed out: the rest is dropped
    assert pool.held_bytes() == 24 and pool.idle_bytes() == 0
    del d
    assert pool.idle_bytes() == 24
    pool.clear()
    assert pool.held_bytes() == 0
    off = BufferPool(keep=False)
    e = off.take(np, 5, np.float32)
    del e
    off.take(np, 5, np.float32)
    assert off.allocated == 2 and off.reused == 0 and off.held_bytes() == 0

"""DDP applies the mean's 1/n in the copy back into ``.grad`` (``_average(scale_later=)``, one
pass over the bucket fewer): the gradients must have the very bits of the two-pass way (scale
the bucket, then copy), whatever the dtype, bucket views, unused parameters, accumulation under
``no_sync``, uneven inputs under ``join`` (divisors of the active ranks) and gradients reset to
None; and a user hook's future is never scaled by a ``scale`` of its own."""
from __future__ import annotations

import contextlib
import itertools
from typing import Any

import numpy as np
import pytest

import hpcdp
from hpcdp import nn
from hpcdp.ddp.comm_hooks import HookFuture
from hpcdp.testing import check
from hpcdp.testing.fixtures import World, worlds

from ddp_bodies import data, make_mlp


def _grads(rank: int, dtype: Any, view: bool, unused: bool, accum: int, none: bool,
           scale_on_copy: bool) -> list[Any]:
    """The gradients' bytes after each of a few steps (uneven per rank under ``join``)."""
    m = make_mlp(21 + rank, dtype=dtype)
    ddp = hpcdp.DDP(m, bucket_cap_mb=300 / 2**20, gradient_as_bucket_view=view,
                    find_unused_parameters=unused)
    ddp._reducer._scale_on_copy = scale_on_copy and not view
    x, y = data(200, seed=9 + rank, dtype=dtype)
    loss = nn.CrossEntropyLoss()
    out = []
    with ddp.join(divide_by_initial_world_size=False):
        for t in range(rank + 2):
            for a in range(accum):
                with ddp.no_sync() if a < accum - 1 else contextlib.nullcontext():
                    loss(ddp(x[8 * t + a:8 * t + a + 4]), y[8 * t + a:8 * t + a + 4])
                    ddp.backward(loss.backward())
            out.append([None if p.grad is None else p.grad.tobytes() for p in m.parameters()])
            for p in m.parameters():
                if p.grad is not None:
                    p.data -= (0.1 * p.grad).astype(p.data.dtype)
                if none:
                    p.grad = None
    ddp.close()
    return out


def body_same_bits(rank: int) -> list[str]:
    fails = []
    for dtype, view, unused, accum, none in itertools.product(
            (np.float64, np.float32, np.float16), (False, True), (False, True), (1, 2), (False, True)):
        if _grads(rank, dtype, view, unused, accum, none, True) != \
                _grads(rank, dtype, view, unused, accum, none, False):
            fails.append(f"{np.dtype(dtype).name} view={view} unused={unused} accum={accum} none={none}")
    return fails


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", worlds("sim-2", "sim-3", "sim-4", "mpi"), indirect=True)
def test_scaling_in_the_copy_back_gives_the_same_bits(world: World) -> None:
    check(world.run(body_same_bits))


def body_user_future_scale(rank: int) -> list[str]:
    """A comm hook whose future has an attribute ``scale`` (say, a compression ratio): the
    gradients are the hook's result, not multiplied by it."""
    g = hpcdp.get_default_group()

    class Future:
        scale = 1000.0

        def __init__(self, value: Any) -> None:
            self.value = value

        def wait(self) -> Any:
            return self.value

    def hook(state: Any, bucket: Any) -> Any:
        flat = bucket.buffer()
        return Future(g.allreduce(flat, "mean"))

    m = make_mlp(5)
    ddp = hpcdp.DDP(m)
    ddp.register_comm_hook(None, hook)
    x, y = data(8, seed=3 + rank)
    loss = nn.CrossEntropyLoss()
    loss(ddp(x), y)
    ddp.backward(loss.backward())
    got = [p.grad.copy() for p in m.parameters()]
    m2 = make_mlp(5)
    ddp2 = hpcdp.DDP(m2)
    loss(ddp2(x), y)
    ddp2.backward(loss.backward())
    want = [p.grad for p in m2.parameters()]
    ddp.close()
    ddp2.close()
    assert not isinstance(Future(0), HookFuture)
    return [f"parameter {i}: the hook's result was scaled" for i, (a, b) in enumerate(zip(got, want))
            if not np.allclose(a, b, rtol=1e-12, atol=0)]


@pytest.mark.parametrize("world", worlds("sim-2", "mpi"), indirect=True)
def test_a_user_futures_scale_is_not_applied(world: World) -> None:
    check(world.run(body_user_future_scale))

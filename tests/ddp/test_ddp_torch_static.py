"""DDP over a torch model whose graph is static (every parameter used, hook counts learnt): the
buckets, not the adapter, tell when ``loss.backward()`` is over. The gradients stay views of the
buckets step after step (torch accumulates straight into them); a ``.grad`` replaced between
forward and backward (``zero_grad`` after forward, a user's own tensor) is copied into its bucket
before the bucket is reduced; a backward that stops half way, a forward without backward and
``no_sync`` keep their meaning; a DDP that is closed or dropped stops reducing."""
from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import hpcdp
from hpcdp.errors import HpcdpError
from hpcdp.testing import check
from hpcdp.testing.fixtures import World, worlds

from ddp_torch_bodies import GLOBAL_BATCH, _compare, data, make, make_opt, reference

torch.set_num_threads(1)


def _in_bucket(ddp: Any, t: torch.Tensor) -> bool:
    """Whether gradient tensor ``t`` lies inside one of ``ddp``'s bucket buffers."""
    lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    for b in ddp.buckets:
        start = b.flat.ctypes.data
        if start <= lo and hi <= start + b.flat.nbytes:
            return True
    return False


def _views(ddp: Any, model: torch.nn.Module, when: str, rank: int) -> list[str]:
    return [f"rank {rank}: {when}, {name}'s gradient is not a view of its bucket"
            for name, p in model.named_parameters() if p.grad is None or not _in_bucket(ddp, p.grad)]


def body_bucket_views(rank: int, zero: str) -> list[str]:
    """Five SGD-momentum steps on the global batch split over the ranks match single-process
    torch to 1e-10 with ``zero`` = "before" (zero_grad(set_to_none=True) before forward: DDP
    points the gradients at the buckets again), "after" (zero_grad after forward, before
    backward: torch makes new gradient tensors, copied into the buckets at launch) or "replace"
    (the user sets every .grad to a fresh zero tensor after forward). After every step each
    gradient is a view of its bucket, and the fast end-of-backward was in use (on more than one
    rank)."""
    n = hpcdp.get_world_size()
    model = make("mlp")
    ddp = hpcdp.DDP(model, bucket_cap_mb=200 / 2**20)   # several buckets
    opt = make_opt("sgd", ddp.parameters())
    x, y = data("mlp")
    b = GLOBAL_BATCH // n
    xs, ys = x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]
    fails = []
    fast_steps = 0
    for step in range(5):
        if zero == "before":
            opt.zero_grad(set_to_none=True)
        out = ddp(xs)
        fast_steps += bool(ddp._torch_fast)
        if zero == "after":
            opt.zero_grad(set_to_none=True)
        elif zero == "replace":
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
        F.cross_entropy(out, ys).backward()
        if n > 1:   # (a group of one leaves torch its own gradients: nothing to reduce)
            fails += _views(ddp, model, f"after step {step}", rank)
        opt.step()
    if len(ddp.buckets) < 2:
        fails.append(f"rank {rank}: expected several buckets, got {len(ddp.buckets)}")
    if n > 1 and fast_steps < 3:
        fails.append(f"rank {rank}: the buckets told the end of backward in only {fast_steps} of 5 steps")
    return fails + _compare(model, reference("mlp", "sgd", 5), 1e-10, f"rank {rank} zero_grad {zero}")


def body_storage_kept(rank: int) -> list[str]:
    """With zero_grad(set_to_none=False) the gradient tensors are the same objects over the same
    bucket memory every step: torch accumulates into the buckets, nothing is re-pointed."""
    model = make("cnn")
    ddp = hpcdp.DDP(model)
    opt = make_opt("sgd", ddp.parameters())
    x, y = data("cnn")
    F.cross_entropy(ddp(x), y).backward()
    opt.zero_grad(set_to_none=False)
    F.cross_entropy(ddp(x), y).backward()
    first = [(p.grad, p.grad.data_ptr()) for p in model.parameters()]
    fails = []
    for step in range(3):
        opt.step()
        opt.zero_grad(set_to_none=False)
        F.cross_entropy(ddp(x), y).backward()
        for (name, p), (g, ptr) in zip(model.named_parameters(), first):
            if p.grad is not g or p.grad.data_ptr() != ptr:
                fails.append(f"rank {rank} step {step}: {name}'s gradient tensor was replaced")
    return fails + _views(ddp, model, "at the end", rank)


def body_half_backward_after_steps(rank: int) -> list[str]:
    """After two full steps (the fast end of backward in use), a loss that uses one of two
    outputs leaves head b's bucket unreduced: the next forward names b.weight on every rank and
    the step after it trains normally, to the average of the ranks' gradients."""
    n = hpcdp.get_world_size()
    model = make("twoheads")
    model.use = "both"
    ddp = hpcdp.DDP(model)
    x, y = data("mlp")
    b = GLOBAL_BATCH // n
    xs, ys = x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]
    for _ in range(2):
        a, h = ddp(xs)
        (F.cross_entropy(a, ys) + F.cross_entropy(h, ys)).backward()
    a, _h = ddp(xs)
    if not ddp._torch_fast:
        return [f"rank {rank}: the third step did not use the buckets' end of backward"]
    F.cross_entropy(a, ys).backward()
    try:
        ddp(xs)
    except HpcdpError as exc:
        msg = str(exc)
        if "b.weight" not in msg or "previous backward" not in msg or "find_unused_parameters" not in msg:
            return [f"rank {rank}: unhelpful message: {msg}"]
    else:
        return [f"rank {rank}: a half-finished backward went unnoticed"]
    ddp.zero_grad()
    a, h = ddp(xs)
    (F.cross_entropy(a, ys) + F.cross_entropy(h, ys)).backward()
    ref = make("twoheads")
    ref.use = "both"
    ra, rh = ref(x)
    # the mean over ranks of each rank's mean loss: the global batch's mean loss (equal shares)
    (F.cross_entropy(ra, y) + F.cross_entropy(rh, y)).backward()
    fails = []
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        err = float((p.grad - q.grad).abs().max())
        if not err <= 1e-12:
            fails.append(f"rank {rank}: {name}'s gradient after the recovered step is off by {err:.3g}")
    return fails


def body_forward_without_backward_after_steps(rank: int) -> list[str]:
    """A training forward whose output is dropped, after the fast end of backward is in use, is
    forgotten: no error, and the next step's gradients are the ranks' average."""
    n = hpcdp.get_world_size()
    model = make("mlp")
    ddp = hpcdp.DDP(model)
    x, y = data("mlp")
    b = GLOBAL_BATCH // n
    xs, ys = x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]
    for _ in range(2):
        ddp.zero_grad()
        F.cross_entropy(ddp(xs), ys).backward()
    ddp(xs)   # dropped
    ddp.zero_grad()
    F.cross_entropy(ddp(xs), ys).backward()
    ref = make("mlp")
    F.cross_entropy(ref(x), y).backward()
    fails = []
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        err = float((p.grad - q.grad).abs().max())
        if not err <= 1e-12:
            fails.append(f"rank {rank}: {name}'s gradient after a dropped forward is off by {err:.3g}")
    return fails


def body_closed_stops_reducing(rank: int) -> list[str]:
    """A closed DDP, and a dropped one, leave the model's gradients alone: a plain torch step on
    the model afterwards gives this rank's own gradients, not an average (the ranks' data differ)."""
    fails = []
    for how in ("close", "drop"):
        model = make("mlp")
        ddp = hpcdp.DDP(model)
        x, y = data("mlp", seed=7 + rank)
        for _ in range(2):
            ddp.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
        if how == "close":
            ddp.close()
        del ddp
        gc.collect()
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        ref = make("mlp")
        ref.load_state_dict(model.state_dict())
        F.cross_entropy(ref(x), y).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            if not torch.equal(p.grad, q.grad):
                fails.append(f"rank {rank}: after {how}, {name}'s gradient is not this rank's own")
    return fails


@pytest.mark.parametrize("zero", ["before", "after", "replace"])
@pytest.mark.parametrize("world", worlds("sim-1", "sim-2", "tcp-2", "mpi"), indirect=True)
def test_gradients_are_bucket_views(world: World, zero: str) -> None:
    check(world.run(body_bucket_views, zero, timeout=60))


@pytest.mark.parametrize("world", worlds("sim-2", "mpi"), indirect=True)
def test_gradient_storage_kept_across_steps(world: World) -> None:
    check(world.run(body_storage_kept))


@pytest.mark.parametrize("world", worlds("sim-2", "tcp-2", "mpi"), indirect=True)
def test_half_finished_backward_after_steps(world: World) -> None:
    check(world.run(body_half_backward_after_steps))


@pytest.mark.parametrize("world", worlds("sim-2", "mpi"), indirect=True)
def test_forward_without_backward_after_steps(world: World) -> None:
    check(world.run(body_forward_without_backward_after_steps))


@pytest.mark.parametrize("world", worlds("sim-2", "mpi"), indirect=True)
def test_closed_or_dropped_ddp_stops_reducing(world: World) -> None:
    check(world.run(body_closed_stops_reducing))


def _body_subclass_forward(rank: int) -> list[str]:
    from ddp_torch_bodies import data, make

    class Counted(hpcdp.DDP):
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            self.calls = getattr(self, "calls", 0) + 1
            return super().forward(*args, **kwargs)

    d = Counted(make("mlp"))
    x, _ = data("mlp")
    d(x[:2])
    return [] if getattr(d, "calls", 0) == 1 else [f"a subclass's forward ran {getattr(d, 'calls', 0)} times"]


def test_a_subclass_forward_runs_on_call() -> None:
    """``ddp(x)`` runs ``forward`` as the object has it (a subclass's override), as torch does."""
    from conftest import run_ranks

    assert run_ranks("sim", 2, _body_subclass_forward, timeout=60) == [[], []]

"""FSDP cases found in review: parameters no rank used keep ``grad=None`` (as in one process), one
used on some ranks only gets the right gradient, and an exception in forward or backward leaves
no full parameters or gradients behind while a rank that stays silent makes its peers time out."""
from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import hpcdp
from conftest import run_mpi, run_ranks
from hpcdp.testing import check
from hpcdp.testing.fixtures import World, worlds
from fsdp_bodies import F64, WRAPS, Block, OddNet, compare, data, make_opt, only_shards_left, snapshot
from hpcdp import nn, optim
from hpcdp.errors import CommTimeoutError, HpcdpError, PeerFailureError
from hpcdp.fsdp import FSDP, FreedGrad

pytestmark = pytest.mark.timeout(180)


class TanhThenExtra(nn.Module):
    """``h = tanh(x)``, then ``h + extra(h)`` when ``use_extra``: a layer only some ranks run."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.tanh = nn.Tanh()
        self.extra = nn.Linear(7, 7, dtype=F64, seed=seed)
        self.use_extra = False

    def forward(self, x: Any) -> Any:
        h = self.tanh(x)
        return h + self.extra(h) if self.use_extra else h

    def backward(self, g: Any) -> Any:
        if self.use_extra:
            g = g + self.extra.run_backward(g)
        return self.tanh.run_backward(g)


class BranchNet(OddNet):
    """OddNet whose activation after ``inp`` holds an ``extra`` layer (``act.extra``)."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.act = TanhThenExtra(seed + 77)

    @property
    def use_extra(self) -> bool:
        return self.act.use_extra

    @use_extra.setter
    def use_extra(self, value: bool) -> None:
        self.act.use_extra = value


def body_unused(rank: int, strategy: str, users: tuple[int, ...], shard_size: int | None = None,
                group: Any = None) -> list[str]:
    """AdamW (weight decay) for 3 steps; ``extra`` is used by the samples of ``users`` only.

    The reference runs each rank's slice in one process and averages the gradients, which is what
    the N-rank loss means; a layer nobody used must not move (AdamW skips a None gradient).
    """
    g = group or hpcdp.get_default_group()
    n, r = g.size, g.rank
    model = BranchNet(seed=11 + r)
    fsdp = FSDP(model, strategy=strategy, group=g, auto_wrap=WRAPS["nested"], shard_size=shard_size)
    ref = BranchNet(seed=11)
    opt, ref_opt = make_opt("adamw", fsdp.parameters()), make_opt("adamw", ref.parameters())
    loss_fn, ref_loss = nn.CrossEntropyLoss(), nn.CrossEntropyLoss()
    b = 4
    x, y = data(3 * n * b)
    extra_shards = [p for name, p in fsdp.named_parameters() if name.startswith("act.extra.")]
    fails: list[str] = []
    for s in range(3):
        base = s * n * b
        model.use_extra = r in users
        loss_fn(fsdp(x[base + r * b:base + (r + 1) * b]), y[base + r * b:base + (r + 1) * b])
        fsdp.backward(loss_fn.backward())
        for j in range(n):
            ref.use_extra = j in users
            ref_loss(ref(x[base + j * b:base + (j + 1) * b]), y[base + j * b:base + (j + 1) * b])
            ref.backward(ref_loss.backward() / n)
        got = [p.grad is None for p in extra_shards]
        if not users and not all(got):
            fails.append(f"step {s + 1}: a layer no rank used got a gradient")
        if users and any(got):
            fails.append(f"step {s + 1}: a layer used on ranks {users} has no gradient on rank {r}")
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        if s == 0:
            fails += only_shards_left(fsdp)
    with fsdp.summon_full_params():
        fails += compare(snapshot(ref), snapshot(model), 1e-10, f"{strategy} users={users} N={n}")
    return fails


@pytest.mark.parametrize("users", [(), (0,)], ids=["unused", "rank0-only"])
@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op", "no_shard"])
def test_unused_parameters_match_one_process(strategy: str, users: tuple[int, ...]) -> None:
    check(run_ranks("sim", 3, body_unused, strategy, users))


def test_unused_parameters_hybrid() -> None:
    check(run_ranks("sim", 4, body_unused, "hybrid_shard", (), 2))
    check(run_ranks("sim", 4, body_unused, "hybrid_shard", (3,), 2))


def test_unused_parameters_under_no_sync() -> None:
    """Used only in the first of two accumulated passes: the synced reduction still carries it;
    a pass discarded by ``fsdp.zero_grad()`` does not count."""
    def body(rank: int) -> list[str]:
        model = BranchNet(seed=5)
        fsdp = FSDP(model, auto_wrap={Block})
        loss_fn = nn.CrossEntropyLoss()
        x, y = data(8, seed=rank)
        model.use_extra = True
        with fsdp.no_sync():
            loss_fn(fsdp(x), y)
            fsdp.backward(loss_fn.backward())
        model.use_extra = False
        loss_fn(fsdp(x), y)
        fsdp.backward(loss_fn.backward())
        extra = [p for n, p in fsdp.named_parameters() if n.startswith("act.extra.")]
        fails = [] if all(p.grad is not None for p in extra) else \
            ["act.extra lost the gradient accumulated under no_sync"]
        # fsdp.zero_grad() forgets a no_sync pass entirely, its use of the layer included
        fsdp.zero_grad()
        model.use_extra = True
        with fsdp.no_sync():
            loss_fn(fsdp(x), y)
            fsdp.backward(loss_fn.backward())
        fsdp.zero_grad()
        model.use_extra = False
        loss_fn(fsdp(x), y)
        fsdp.backward(loss_fn.backward())
        if any(p.grad is not None for p in extra):
            fails.append("act.extra got a gradient from a no_sync pass that zero_grad() discarded")
        return fails

    check(run_ranks("sim", 2, body))


# Not a world of the test above: there rank 0 alone uses a parameter on 3 ranks; here rank 1,
# which on the MPI world of 2 is the last rank.
@pytest.mark.mpi(min_size=2)
def test_unused_parameters_mpi(mpi_world) -> None:
    check(run_mpi(body_unused, "full_shard", ()))
    check(run_mpi(body_unused, "full_shard", (1,)))


def _failing(model: OddNet, which: str) -> Any:
    """Make ``blocks[2]``'s forward or backward raise; return a function that undoes it."""
    blk = model.blocks[2]
    orig = getattr(blk, which)

    def bad(*args: Any) -> Any:
        raise RuntimeError(f"injected {which} failure")

    setattr(blk, which, bad)
    return lambda: setattr(blk, which, orig)


def body_exception(rank: int, which: str, strategy: str) -> list[str]:
    """After an exception in a unit's forward (backward) nothing full-size is left; the next step works."""
    model = OddNet(seed=3, n_blocks=4)
    fsdp = FSDP(model, strategy=strategy, auto_wrap={Block})
    opt = optim.SGD(fsdp.parameters(), lr=0.05)
    loss_fn = nn.CrossEntropyLoss()
    x, y = data(8, seed=rank)
    for _ in range(2):   # the second step prefetches, so an all-gather is in flight when it fails
        loss_fn(fsdp(x), y)
        fsdp.backward(loss_fn.backward())
        opt.step()
        opt.zero_grad()
    undo = _failing(model, which)
    fails: list[str] = []
    try:
        loss_fn(fsdp(x), y)
        fsdp.backward(loss_fn.backward())
        fails.append("the injected failure did not raise")
    except RuntimeError as exc:
        if "injected" not in str(exc):
            fails.append(f"the injected failure came back as {exc!r}")
    undo()
    left = fsdp.memory_stats()["gathered_now"]
    if left:
        fails.append(f"{left} B of gathered parameters left after the {which} failed")
    if any(u.state != "free" for u in fsdp.units):
        fails.append(f"units left gathered: {[(u.name, u.state) for u in fsdp.units]}")
    held = [n for n, p in model.named_parameters()
            if p.data.size or (p.grad is not None and not isinstance(p.grad, FreedGrad))]
    if held:
        fails.append(f"model parameters {held} still hold full data or gradient views")
    loss_fn(fsdp(x), y)
    fsdp.backward(loss_fn.backward())
    opt.step()
    opt.zero_grad()
    return fails + only_shards_left(fsdp)


@pytest.mark.parametrize("world", worlds("sim-2", "mpi"), indirect=True)
@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op"])
@pytest.mark.parametrize("which", ["forward", "backward"])
def test_exception_leaves_only_shards(world: World, which: str, strategy: str) -> None:
    check(world.run(body_exception, which, strategy))


def body_one_rank_fails(rank: int, rank0_done: threading.Event) -> str:
    """Rank 1's forward raises and it stays alive but silent: rank 0 gets a clear timeout, no hang."""
    model = OddNet(seed=3, n_blocks=4)
    fsdp = FSDP(model, strategy="full_shard", auto_wrap={Block})
    loss_fn = nn.CrossEntropyLoss()
    x, y = data(8, seed=rank)
    loss_fn(fsdp(x), y)
    fsdp.backward(loss_fn.backward())
    if rank == 1:
        _failing(model, "forward")
    try:
        loss_fn(fsdp(x), y)
        fsdp.backward(loss_fn.backward())
        return "no error"
    except RuntimeError as exc:
        if rank == 1:   # outlive rank 0's wait, so it sees silence rather than a death
            rank0_done.wait(60.0)
        kind = "timeout" if isinstance(exc, CommTimeoutError) else \
            "peer" if isinstance(exc, (PeerFailureError, HpcdpError)) else "other"
        return f"{kind}: {exc}"
    finally:
        if rank == 0:
            rank0_done.set()


def test_one_rank_failing_in_forward_times_out_the_others() -> None:
    msgs = run_ranks("sim", 2, body_one_rank_fails, threading.Event(), timeout=3.0)
    assert msgs[1].startswith("other: injected forward failure"), msgs
    assert msgs[0].startswith("timeout:") and "rank 0" in msgs[0] and "all_gather" in msgs[0], msgs


# -- ZeRO-1 with param groups ------------------------------------------------------------------------
def _param_groups(m: OddNet) -> list[dict[str, Any]]:
    ps = dict(m.named_parameters())
    first = [p for n, p in ps.items() if n.startswith("blocks.0")]
    head = [p for n, p in ps.items() if n.startswith("head")]
    rest = [p for n, p in ps.items() if not n.startswith(("blocks.0", "head"))]
    return [{"params": first, "lr": 0.05, "weight_decay": 0.0}, {"params": head, "lr": 0.001}, {"params": rest}]


def body_zero_groups(rank: int, cls_name: str) -> list[str]:
    """Three param groups (one small enough to live on one rank), a frozen weight: same as DDP + the
    plain optimizer, and every rank's ``param_groups`` carry the class's defaults."""
    from hpcdp.optim import ZeroRedundancyOptimizer

    g = hpcdp.get_default_group()
    n, r = g.size, g.rank
    a, b_ = OddNet(seed=9 + r), OddNet(seed=9 + r)
    for m in (a, b_):
        m.blocks[1].sub[0].weight.requires_grad = False
    da, db = hpcdp.DDP(a), hpcdp.DDP(b_)
    cls = getattr(optim, cls_name)
    zero = ZeroRedundancyOptimizer(_param_groups(a), cls, lr=0.01, weight_decay=0.1)
    plain = cls(_param_groups(b_), lr=0.01, weight_decay=0.1)
    la, lb = nn.CrossEntropyLoss(), nn.CrossEntropyLoss()
    x, y = data(3 * 4 * n)
    for s in range(3):
        mine = slice(s * 4 * n + 4 * r, s * 4 * n + 4 * r + 4)
        la(da(x[mine]), y[mine])
        da.backward(la.backward())
        lb(db(x[mine]), y[mine])
        db.backward(lb.backward())
        for o in (zero, plain):
            o.step()
            o.zero_grad()
    fails = compare(snapshot(b_), snapshot(a), 1e-12, f"ZeRO-1 param groups N={n}")
    for i, (mine_g, want_g) in enumerate(zip(zero.param_groups, plain.param_groups)):
        diff = {k: (mine_g.get(k), v) for k, v in want_g.items() if k != "params" and mine_g.get(k) != v}
        if diff:
            fails.append(f"param group {i} differs from the plain optimizer's: {diff}")
    full = zero.consolidate_state_dict(to=0)
    if r == 0:
        want = plain.state_dict()
        if sorted(full["state"]) != sorted(want["state"]):
            fails.append(f"consolidated state keys {sorted(full['state'])}, plain {sorted(want['state'])}")
    return fails


@pytest.mark.parametrize("cls_name", ["AdamW", "SGD"])
def test_zero1_param_groups(cls_name: str) -> None:
    check(run_ranks("sim", 3, body_zero_groups, cls_name))


def test_load_state_dict_refuses_a_buffer_of_another_shape() -> None:
    """A checkpoint's buffer of the wrong shape raises instead of being broadcast into the model's."""
    def body(rank: int) -> list[str]:
        model = OddNet(seed=1)
        model.register_buffer("scale", np.arange(3.0))
        fsdp = FSDP(model, auto_wrap={Block})
        sd = {k: v for k, v in fsdp.state_dict().items()}
        sd["scale"] = np.array([5.0])
        try:
            fsdp.load_state_dict(sd)
        except ValueError as exc:
            return [] if "scale" in str(exc) and f"rank {rank}" in str(exc) else [f"unclear: {exc}"]
        return [f"a (1,) buffer loaded into a (3,) one: now {model.scale}"]

    check(run_ranks("sim", 2, body))


def test_zero1_add_param_group_after_construction_raises() -> None:
    """A group added later would be owned by no rank and never updated: it raises instead."""
    def body(rank: int) -> list[str]:
        from hpcdp.optim import ZeroRedundancyOptimizer

        a, b_ = nn.Linear(4, 4, dtype=F64, seed=1), nn.Linear(4, 4, dtype=F64, seed=2)
        zero = ZeroRedundancyOptimizer(hpcdp.DDP(a).parameters(), optim.SGD, lr=0.1)
        try:
            zero.add_param_group({"params": list(b_.parameters())})
        except HpcdpError as exc:
            return [] if f"rank {rank}" in str(exc) else [f"unclear: {exc}"]
        return ["add_param_group after construction was accepted"]

    check(run_ranks("sim", 2, body))


@pytest.mark.parametrize("strategy,world_size", [("no_shard", 2), ("full_shard", 1), ("full_shard", 2)])
def test_summon_without_writeback_leaves_the_shards(strategy: str, world_size: int) -> None:
    """``summon_full_params(writeback=False)`` discards changes even where the shard is the whole
    parameter (no_shard, one rank) and the gathered views could have aliased it."""
    def body(rank: int) -> list[str]:
        model = OddNet(seed=4)
        fsdp = FSDP(model, strategy=strategy, auto_wrap={Block})
        with fsdp.summon_full_params():
            before = snapshot(model)
        with fsdp.summon_full_params(writeback=False):
            model.inp.weight.data[...] = -1.0
            model.blocks[0].norm.weight.data[...] = 3.0
        with fsdp.summon_full_params():
            return compare(before, snapshot(model), 0.0, f"{strategy} N={world_size} after writeback=False")

    check(run_ranks("sim", world_size, body))


def test_sync_module_states_must_agree() -> None:
    """One rank without ``sync_module_states`` would skip the construction broadcast the others
    post: every rank raises a clear mismatch naming the option instead."""
    def body(rank: int) -> str:
        try:
            FSDP(OddNet(seed=rank), auto_wrap={Block}, sync_module_states=rank != 1)
        except hpcdp.CollectiveMismatchError as exc:
            return str(exc)
        return "no error"

    msgs = run_ranks("sim", 3, body, timeout=5.0)
    for r, m in enumerate(msgs):
        assert f"rank {r}" in m and "sync_module_states" in m and "rank 1:" in m, msgs

"""FSDP / ZeRO test bodies: each runs on every rank of a group and returns a list of failure strings."""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import numpy as np

import hpcdp
from hpcdp import nn, optim
from hpcdp.errors import CollectiveMismatchError, HpcdpError
from hpcdp.fsdp import FSDP, FreedGrad, MixedPrecision, size_based

F64 = np.float64


class Sub(nn.Sequential):
    """Two layers with a tanh between: a unit of its own under ``auto_wrap={Sub}`` (nesting)."""

    def __init__(self, d: int, h: int, seed: int, dtype: Any = F64) -> None:
        super().__init__(nn.Linear(d, h, dtype=dtype, seed=seed), nn.Tanh(),
                         nn.Linear(h, d, dtype=dtype, seed=seed + 1))


class Block(nn.Module):
    """``x + sub(norm(x))``: children run through ``m(x)`` and ``m.run_backward(g)``, so hooks fire."""

    def __init__(self, d: int, seed: int, dtype: Any = F64) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d, dtype=dtype)
        self.sub = Sub(d, 2 * d + 1, seed, dtype)

    def forward(self, x: Any) -> Any:
        return x + self.sub(self.norm(x))

    def backward(self, g: Any) -> Any:
        return g + self.norm.run_backward(self.sub.run_backward(g))


class OddNet(nn.Module):
    """Odd shapes on purpose: a 7x15 input weight, blocks of width 7, a head with a bias of 3.

    The root keeps ``inp`` and ``head`` (so the root unit has parameters of its own).
    """

    def __init__(self, seed: int, dtype: Any = F64, n_blocks: int = 2, d: int = 7) -> None:
        super().__init__()
        self.inp = nn.Linear(15, d, dtype=dtype, seed=seed)
        self.act = nn.Tanh()
        self.blocks = nn.ModuleList([Block(d, seed + 10 * (k + 1), dtype) for k in range(n_blocks)])
        self.head = nn.Linear(d, 3, dtype=dtype, seed=seed + 5)

    def forward(self, x: Any) -> Any:
        h = self.act(self.inp(x))
        for b in self.blocks:
            h = b(h)
        return self.head(h)

    def backward(self, g: Any) -> Any:
        g = self.head.run_backward(g)
        for b in reversed(list(self.blocks)):
            g = b.run_backward(g)
        return self.inp.run_backward(self.act.run_backward(g))


WRAPS: dict[str, Any] = {"none": None, "blocks": {Block}, "nested": {Block, Sub}, "size": size_based(60)}


def make_opt(name: str, params: Any) -> Any:
    if name == "sgd":
        return optim.SGD(params, lr=0.1, momentum=0.9)
    return optim.AdamW(params, lr=0.01, weight_decay=0.05)


def data(n: int, seed: int = 0, dtype: Any = F64) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 15)).astype(dtype), rng.integers(0, 3, size=n)


def compare(ref: dict[str, Any], got: dict[str, Any], tol: float, what: str) -> list[str]:
    fails = []
    for k, v in ref.items():
        if k not in got:
            fails.append(f"{what}: {k} missing")
            continue
        g = np.asarray(got[k])
        if g.shape != v.shape:
            fails.append(f"{what}: {k} shape {g.shape} != {v.shape}")
            continue
        err = float(np.max(np.abs(g - v))) if v.size else 0.0
        if not err <= tol:
            fails.append(f"{what}: {k} differs by {err:.3g} (tol {tol:g})")
    return fails


def snapshot(model: nn.Module) -> dict[str, np.ndarray]:
    return {k: np.array(v, copy=True) for k, v in model.state_dict().items()}


def only_shards_left(fsdp: FSDP) -> list[str]:
    """After a step: no model parameter holds data or a usable gradient; nothing is gathered."""
    fails = []
    for n, p in fsdp.module.named_parameters():
        if p.data.size:
            fails.append(f"{n}: the model parameter still holds {p.data.size} elements")
        if p.grad is not None and not isinstance(p.grad, FreedGrad):
            fails.append(f"{n}: the model parameter still holds a gradient")
    stats = fsdp.memory_stats()
    if stats["gathered_now"] != 0:
        fails.append(f"{stats['gathered_now']} B of gathered parameters left after the step")
    per_unit = sum(u.S for u in fsdp.units) * 8
    if stats["params"] != per_unit:
        fails.append(f"shard parameters hold {stats['params']} B, expected {per_unit}")
    n = fsdp.comm.n
    total = sum(u.F for u in fsdp.units) * 8
    pad = sum(u.S * n - u.F for u in fsdp.units) * 8
    if stats["params"] * n > total + pad:
        fails.append(f"{stats['params']} B per rank is more than 1/{n} of {total} B plus padding {pad}")
    return fails


def body_parity(rank: int, strategy: str = "full_shard", opt_name: str = "sgd", wrap: str = "nested",
                steps: int = 3, b: int = 4, accum: int = 1, shard_size: int | None = None,
                group: Any = None, check_memory: bool = True) -> list[str]:
    """N ranks x batch b == 1 process x batch N*b after ``steps`` optimizer steps (float64)."""
    g = group or hpcdp.get_default_group()
    n, r = g.size, g.rank
    model = OddNet(seed=11 + r)   # different on every rank: FSDP broadcasts rank 0's
    fsdp = FSDP(model, strategy=strategy, group=g, auto_wrap=WRAPS[wrap], shard_size=shard_size)
    ref = OddNet(seed=11)
    opt, ref_opt = make_opt(opt_name, fsdp.parameters()), make_opt(opt_name, ref.parameters())
    loss_fn, ref_loss = nn.CrossEntropyLoss(), nn.CrossEntropyLoss()
    x, y = data(steps * accum * n * b)
    fails: list[str] = []
    for s in range(steps):
        for j in range(accum):
            base = (s * accum + j) * n * b
            mine = slice(base + r * b, base + (r + 1) * b)
            ctx = fsdp.no_sync() if j < accum - 1 else contextlib.nullcontext()
            with ctx:
                loss_fn(fsdp(x[mine]), y[mine])
                fsdp.backward(loss_fn.backward())
            whole = slice(base, base + n * b)
            ref_loss(ref(x[whole]), y[whole])
            ref.backward(ref_loss.backward())
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        if check_memory and s == 0:
            fails += only_shards_left(fsdp)
    want = snapshot(ref)
    with fsdp.summon_full_params():
        fails += compare(want, snapshot(model), 1e-10, f"{strategy}/{wrap} N={n} summon")
    full = fsdp.full_state_dict()
    if g.rank == 0:
        fails += compare(want, full, 1e-10, f"{strategy}/{wrap} N={n} full_state_dict")
    elif full:
        fails.append("full_state_dict returned arrays on a rank other than 0")
    return fails


def body_parity_first3(rank: int, *args: Any) -> list[str]:
    """``body_parity`` on the sub-group of ranks 0, 1, 2 (N = 3 inside a larger world)."""
    g3 = hpcdp.new_group([0, 1, 2])
    return body_parity(rank, *args, group=g3) if rank < 3 else []


# -- the schedule: prefetch, limits, async reduction -------------------------------------------------
def _index(events: list[Any], kind: str, unit: str, phase: str) -> int:
    for i, e in enumerate(events):
        if e.kind == kind and e.unit == unit and e.phase == phase:
            return i
    return -1


def body_prefetch(rank: int, prefetch: bool = True, limit: bool = True) -> list[str]:
    """Unit k+1's all-gather is posted before unit k's forward (backward) ends, within the limit."""
    model = OddNet(seed=3, n_blocks=4)
    fsdp = FSDP(model, strategy="full_shard", auto_wrap={Block}, prefetch=prefetch, limit_all_gathers=limit)
    opt = optim.SGD(fsdp.parameters(), lr=0.05)
    loss_fn = nn.CrossEntropyLoss()
    x, y = data(8, seed=rank)
    fails: list[str] = []
    blocks = [f"blocks.{k}" for k in range(4)]
    root = "<root>"
    for step in range(3):
        loss_fn(fsdp(x), y)
        fsdp.backward(loss_fn.backward())
        opt.step()
        opt.zero_grad()
        ev = fsdp.events
        ahead = max(len(set(e.gathered) - set(e.active)) for e in ev)
        most = max(len(e.gathered) for e in ev)
        pre = [e for e in ev if e.kind == "ag_post" and e.prefetch]
        if step == 0:
            if pre:
                fails.append(f"step 1 prefetched {[e.unit for e in pre]} before any order was recorded")
            continue
        if not prefetch:
            if pre or ahead:
                fails.append(f"prefetch=False still gathered ahead: {[e.unit for e in pre]}")
            continue
        cap = 1 if limit else 2
        if ahead > cap:
            fails.append(f"step {step + 1}: {ahead} units gathered ahead of use (limit {cap})")
        if limit and most > 3:   # the root (enclosing all) + the unit computing + the one prefetched
            fails.append(f"step {step + 1}: {most} units gathered at once")
        if limit and ahead != 1:
            fails.append(f"step {step + 1}: prefetch never had a unit gathered ahead (max {ahead})")
        for phase, order in (("fwd", blocks), ("bwd", blocks[::-1])):
            for cur, nxt in zip(order, order[1:]):
                post = _index(ev, "ag_post", nxt, phase)
                end = _index(ev, f"{phase}_end", cur, phase)
                if post < 0 or end < 0 or post > end:
                    fails.append(f"step {step + 1} {phase}: all-gather of {nxt} (event {post}) not posted "
                                 f"before {cur}'s {phase} ended (event {end})")
        # the reduction of a block starts when its backward ends, before the next block's backward
        for cur, nxt in zip(blocks[::-1], blocks[::-1][1:]):
            rs = _index(ev, "rs_post", cur, "bwd")
            nb = _index(ev, "bwd_begin", nxt, "bwd")
            if rs < 0 or nb < 0 or rs > nb:
                fails.append(f"step {step + 1}: reduction of {cur} (event {rs}) not posted before "
                             f"{nxt}'s backward began (event {nb})")
        if ev[-1].gathered:
            fails.append(f"still gathered at the end of the step: {ev[-1].gathered}")
        for unit in [root] + blocks:   # ZeRO-3: gathered for forward and for backward, reduced once
            n_ag = sum(1 for e in ev if e.kind == "ag_post" and e.unit == unit)
            n_rs = sum(1 for e in ev if e.kind == "rs_post" and e.unit == unit)
            if (n_ag, n_rs) != (2, 1):
                fails.append(f"step {step + 1}: {unit} gathered {n_ag} times and reduced {n_rs} times")
    if fails:
        fails.append("events: " + ", ".join(f"{e.kind}:{e.unit}{'*' if e.prefetch else ''}" for e in fsdp.events))
    return fails


def body_memory_peak(rank: int) -> list[str]:
    """The peak of gathered parameters stays within root + two blocks (full_shard, limit on)."""
    model = OddNet(seed=3, n_blocks=4)
    fsdp = FSDP(model, strategy="full_shard", auto_wrap={Block})
    opt = optim.SGD(fsdp.parameters(), lr=0.05)
    loss_fn = nn.CrossEntropyLoss()
    x, y = data(8, seed=rank)
    sizes = {u.name: u.F * 8 for u in fsdp.units}
    n = fsdp.comm.n
    ag = {u.name: u.S * n * 8 for u in fsdp.units}   # the receive buffer while copying out
    bound = sizes["<root>"] + 2 * max(sizes[f"blocks.{k}"] for k in range(4)) + max(ag.values())
    fails = []
    for _ in range(2):
        loss_fn(fsdp(x), y)
        fsdp.backward(loss_fn.backward())
        opt.step()
        opt.zero_grad()
    stats = fsdp.memory_stats(opt)
    if not 0 < stats["gathered_peak"] <= bound:
        fails.append(f"peak gathered {stats['gathered_peak']} B, bound {bound} B")
    if stats["gathered_peak"] >= sum(sizes.values()) and n > 1:
        fails.append(f"peak gathered {stats['gathered_peak']} B is the whole model")
    state = stats["optim_state"]
    if state != 0:   # plain SGD keeps no state
        fails.append(f"SGD without momentum holds {state} B of state")
    text = str(stats)
    for word in ("sharded parameters", "gradients", "optimizer state", "peak gathered"):
        if word not in text:
            fails.append(f"memory_stats table lacks {word!r}")
    return fails


# -- features -----------------------------------------------------------------------------------
def body_clip(rank: int, strategy: str = "full_shard") -> list[str]:
    """``clip_grad_norm_`` over the shards returns and applies the global norm."""
    g = hpcdp.get_default_group()
    n, r = g.size, g.rank
    model = OddNet(seed=2)
    fsdp = FSDP(model, strategy=strategy, auto_wrap={Block})
    ref = OddNet(seed=2)
    opt, ref_opt = optim.SGD(fsdp.parameters(), lr=0.5), optim.SGD(ref.parameters(), lr=0.5)
    loss_fn, ref_loss = nn.CrossEntropyLoss(), nn.CrossEntropyLoss()
    x, y = data(4 * n)
    loss_fn(fsdp(x[4 * r:4 * r + 4]), y[4 * r:4 * r + 4])
    fsdp.backward(loss_fn.backward())
    ref_loss(ref(x), y)
    ref.backward(ref_loss.backward())
    total = fsdp.clip_grad_norm_(0.01)
    want = nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    fails = []
    if not abs(total - want) <= 1e-12 * want:
        fails.append(f"global norm {total} != {want}")
    opt.step()
    ref_opt.step()
    with fsdp.summon_full_params():
        fails += compare(snapshot(ref), snapshot(model), 1e-12, "after clipping")
    return fails


def body_summon_writeback(rank: int) -> list[str]:
    """Changes to summoned parameters reach the shards; ``writeback=False`` discards them."""
    model = OddNet(seed=4)
    fsdp = FSDP(model, strategy="full_shard", auto_wrap={Block, Sub})
    with fsdp.summon_full_params():
        before = snapshot(model)
        out_full = model(np.ones((2, 15)))   # the model runs directly while summoned
        model.head.bias.data[...] = 7.0
    with fsdp.summon_full_params(writeback=False):
        fails = [] if np.all(model.head.bias.data == 7.0) else ["head.bias not written back"]
        model.inp.weight.data[...] = -1.0
    with fsdp.summon_full_params():
        if np.any(model.inp.weight.data == -1.0):
            fails.append("writeback=False changed the shards")
        before["head.bias"][...] = 7.0
        fails += compare(before, snapshot(model), 0.0, "summon round trip")
    out = fsdp(np.ones((2, 15)))
    model.free_saved()
    if out.shape != out_full.shape:
        fails.append(f"output shape {out.shape} != {out_full.shape}")
    return fails


# -- errors ---------------------------------------------------------------------------------------
def body_models_differ(rank: int, what: str) -> str:
    """Every rank raises the same kind of error naming the rank that differs."""
    d = 9 if (what == "shape" and rank == 1) else 7
    model = OddNet(seed=0, d=d)
    if what == "dtype" and rank == 1:
        model.astype(np.float32)
    strategy = "shard_grad_op" if (what == "options" and rank == 1) else "full_shard"
    try:
        FSDP(model, strategy=strategy, auto_wrap={Block})
    except CollectiveMismatchError as exc:
        return str(exc)
    return "no error"


def body_misuse(rank: int) -> list[str]:
    """Backward without forward, a second backward, and an optimizer on the full parameters raise."""
    model = OddNet(seed=1)
    full_params = list(model.parameters())
    fsdp = FSDP(model, strategy="full_shard", auto_wrap={Block})
    loss_fn = nn.CrossEntropyLoss()
    x, y = data(4, seed=rank)
    fails = []

    def expect(fn: Callable[[], Any], what: str) -> None:
        try:
            fn()
        except HpcdpError as exc:
            if f"rank {hpcdp.rank()}" not in str(exc):
                fails.append(f"{what}: message does not name the rank: {exc}")
            return
        fails.append(f"{what} did not raise")

    expect(lambda: fsdp.backward(np.ones((4, 3))), "backward without forward")
    try:
        FSDP(model)
        fails.append("wrapping the same model twice did not raise")
    except ValueError:
        pass
    loss_fn(fsdp(x), y)
    fsdp.backward(loss_fn.backward())
    expect(lambda: fsdp.backward(np.ones((4, 3))), "a second backward")
    wrong = optim.SGD(full_params, lr=0.1)
    try:
        wrong.step()
        fails.append("an optimizer on the full parameters stepped without error")
    except HpcdpError as exc:
        if "fsdp.parameters()" not in str(exc):
            fails.append(f"unclear message: {exc}")
    try:
        fsdp.optim_state_dict(wrong)
        fails.append("optim_state_dict accepted an optimizer on the full parameters")
    except ValueError:
        pass
    return fails


# -- mixed precision -------------------------------------------------------------------------------
def body_mixed(rank: int, param_dtype: str, reduce_dtype: str | None, strategy: str = "full_shard",
               shard_size: int | None = None) -> tuple[list[str], float]:
    """3 SGD steps with low-precision compute against float32 FSDP; return (fails, max error)."""
    g = hpcdp.get_default_group()
    n, r = g.size, g.rank
    f32 = np.float32
    mp = MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    model, ref = OddNet(seed=6, dtype=f32), OddNet(seed=6, dtype=f32)
    fsdp = FSDP(model, strategy=strategy, auto_wrap={Block}, mixed_precision=mp, shard_size=shard_size)
    fref = FSDP(ref, strategy=strategy, auto_wrap={Block}, shard_size=shard_size)
    seen: list[Any] = []
    model.blocks[0].sub[0].register_forward_hook(
        lambda mod, args, out: seen.append((mod.weight.data.dtype, out.dtype)))
    opt = optim.SGD(fsdp.parameters(), lr=0.2)
    ref_opt = optim.SGD(fref.parameters(), lr=0.2)
    loss_fn, ref_loss = nn.CrossEntropyLoss(), nn.CrossEntropyLoss()
    x, y = data(3 * 4 * n, dtype=f32)
    for s in range(3):
        mine = slice(s * 4 * n + 4 * r, s * 4 * n + 4 * r + 4)
        loss_fn(fsdp(x[mine]), y[mine])
        fsdp.backward(loss_fn.backward())
        ref_loss(fref(x[mine]), y[mine])
        fref.backward(ref_loss.backward())
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    fails = []
    compute = np.dtype(np.float16) if param_dtype == "float16" else np.dtype(np.float32)
    if not seen or any(w != compute for w, _ in seen):
        fails.append(f"forward saw parameter dtypes {seen}, expected {compute}")
    for name, p in fsdp.named_parameters():
        if p.data.dtype != f32 or (p.grad is not None and p.grad.dtype != f32):
            fails.append(f"shard {name} is {p.data.dtype}, not the float32 master")
    with fsdp.summon_full_params(), fref.summon_full_params():
        got, want = snapshot(model), snapshot(ref)
    err = max(float(np.max(np.abs(got[k] - want[k]))) for k in want)
    return fails, err


# -- ZeRO-1 --------------------------------------------------------------------------------------
def body_zero(rank: int, opt_name: str = "adam", steps: int = 3) -> list[str]:
    """DDP + ZeroRedundancyOptimizer == DDP + the plain optimizer, bit for bit up to 1e-12."""
    from hpcdp.optim import ZeroRedundancyOptimizer

    g = hpcdp.get_default_group()
    n, r = g.size, g.rank
    a, b_ = OddNet(seed=9 + r), OddNet(seed=9 + r)
    da, db = hpcdp.DDP(a), hpcdp.DDP(b_)
    cls, kw = (optim.Adam, {"lr": 0.01}) if opt_name == "adam" else (optim.SGD, {"lr": 0.1, "momentum": 0.9})
    zero = ZeroRedundancyOptimizer(da.parameters(), cls, **kw)
    plain = cls(db.parameters(), **kw)
    sched = optim.lr_scheduler.StepLR(zero, step_size=2, gamma=0.5)   # the scheduler sees all groups
    sched_p = optim.lr_scheduler.StepLR(plain, step_size=2, gamma=0.5)
    la, lb = nn.CrossEntropyLoss(), nn.CrossEntropyLoss()
    x, y = data(steps * 4 * n)
    for s in range(steps):
        mine = slice(s * 4 * n + 4 * r, s * 4 * n + 4 * r + 4)
        la(da(x[mine]), y[mine])
        da.backward(la.backward())
        lb(db(x[mine]), y[mine])
        db.backward(lb.backward())
        zero.step()
        plain.step()
        zero.zero_grad()
        plain.zero_grad()
        sched.step()
        sched_p.step()
    fails = compare(snapshot(b_), snapshot(a), 1e-12, f"ZeRO-1 N={n}")
    owned = sum(v.nbytes for st in zero.local_optimizer_state().values() for v in st.values()
                if hasattr(v, "nbytes"))
    total = sum(v.nbytes for st in plain.state.values() for v in st.values() if hasattr(v, "nbytes"))
    if n > 1 and not owned < total:
        fails.append(f"rank {r} holds {owned} B of optimizer state, the whole is {total} B")
    full = zero.consolidate_state_dict(to=0)
    if r == 0:
        want = plain.state_dict()
        for i, st in want["state"].items():
            for k, v in st.items():
                got = full["state"][i][k]
                if not np.allclose(got, v, rtol=0, atol=1e-12):
                    fails.append(f"consolidated state {i}.{k} differs")
    # The whole state loads back into a fresh ZeRO optimizer: each rank keeps its own share.
    full = hpcdp.broadcast_object(full, root=0)
    again = ZeroRedundancyOptimizer(list(a.parameters()), cls, **kw)
    again.load_state_dict(full)
    for p, st in zero.local_optimizer_state().items():
        for k, v in st.items():
            if not np.array_equal(np.asarray(again.state[p][k]), np.asarray(v)):
                fails.append(f"reloaded state {k} of a parameter of shape {p.data.shape} differs")
    if again.param_groups[0]["lr"] != zero.param_groups[0]["lr"]:
        fails.append("reloaded learning rate differs")
    return fails


class Foreign:
    """Not an ``nn.Module``: only ``named_parameters``, ``forward`` and ``backward`` (one unit)."""

    training = True

    def __init__(self, seed: int) -> None:
        self.lin = nn.Linear(15, 3, dtype=F64, seed=seed)

    def named_parameters(self) -> Any:
        return self.lin.named_parameters()

    def forward(self, x: Any) -> Any:
        return self.lin.forward(x)

    def backward(self, g: Any) -> Any:
        return self.lin.backward(g)


def body_foreign(rank: int) -> list[str]:
    """A foreign model trains in parity with a plain one (FSDP gathers around its forward/backward)."""
    g = hpcdp.get_default_group()
    n, r = g.size, g.rank
    model = Foreign(seed=3 + r)
    fsdp = FSDP(model)
    ref = nn.Linear(15, 3, dtype=F64, seed=3)
    opt, ref_opt = optim.SGD(fsdp.parameters(), lr=0.3), optim.SGD(ref.parameters(), lr=0.3)
    loss_fn, ref_loss = nn.CrossEntropyLoss(), nn.CrossEntropyLoss()
    x, y = data(2 * 4 * n)
    for s in range(2):
        base = s * 4 * n
        loss_fn(fsdp(x[base + 4 * r:base + 4 * r + 4]), y[base + 4 * r:base + 4 * r + 4])
        fsdp.backward(loss_fn.backward())
        ref_loss(ref(x[base:base + 4 * n]), y[base:base + 4 * n])
        ref.backward(ref_loss.backward())
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    fails = [] if model.lin.weight.data.size == 0 else ["the foreign model still holds its weight"]
    full = fsdp.full_state_dict()
    if r == 0:
        fails += compare({"weight": ref.weight.data, "bias": ref.bias.data}, full, 1e-12, "foreign model")
    return fails


# -- the step's buffers and its breakdown -------------------------------------------------------
def _address(a: Any) -> int:
    return int(a.__array_interface__["data"][0])


def body_zero2_buffers(rank: int) -> list[str]:
    """shard_grad_op keeps its step buffers: a steady-state step gathers into the memory the step
    before used and reduces into the same shard gradients (after ``zero_grad``), so it allocates
    none; an array the user still holds (a gradient, a gathered parameter) is never reused or
    written to; full_shard keeps nothing; ``close`` drops the cache."""
    fails: list[str] = []
    model = nn.Sequential(nn.Linear(16, 32, dtype=F64, seed=1), nn.Tanh(), nn.Linear(32, 16, dtype=F64, seed=2))
    fsdp = FSDP(model, strategy="shard_grad_op", auto_wrap={nn.Linear})
    opt = optim.Adam(fsdp.parameters(), lr=0.01)
    loss_fn = nn.MSELoss()
    x = np.random.default_rng(rank).normal(size=(4, 16))
    gathered: list[Any] = []
    model[0].register_forward_hook(lambda m, a, o: gathered.append(m.weight.data))

    def step() -> list[int]:
        loss_fn(fsdp(x), x)
        fsdp.backward(loss_fn.backward())
        opt.step()
        return [_address(p.grad) for p in fsdp.parameters()]

    def settle() -> int:
        """Drop every reference the test holds; the bytes cached for the next step."""
        opt.zero_grad()
        gathered.clear()
        return int(fsdp.memory_stats()["buffer_cache"])

    first = step()
    w_first = _address(gathered[-1])
    gathered.clear()
    opt.zero_grad()
    second = step()
    if second != first:
        fails.append("the shard gradients of a steady-state step are new arrays, not the last step's")
    if _address(gathered[-1]) != w_first:
        fails.append("a steady-state step gathered into new memory, not the last step's buffer")
    cached = settle()
    if cached <= 0:
        fails.append("memory_stats reports no cached step buffers under shard_grad_op")
    third = step()
    held = [p.grad for p in fsdp.parameters()]       # the user keeps the gradients ...
    held_values = [g.copy() for g in held]
    held_w = gathered[-1]                             # ... and a gathered weight (a view)
    held_w_values = held_w.copy()
    settle()
    fourth = step()
    if any(a == b for a, b in zip(third, fourth)):
        fails.append("a gradient array the user still holds was reused for the next step's gradient")
    if any(not np.array_equal(g, v) for g, v in zip(held, held_values)):
        fails.append("a gradient array the user still holds was overwritten by the next step")
    if _address(gathered[-1]) == _address(held_w) or not np.array_equal(held_w, held_w_values):
        fails.append("a gathered weight the user still holds was reused by the next step's gather")
    fsdp.close()
    if fsdp.memory_stats()["buffer_cache"] != 0:
        fails.append("close() left cached step buffers")
    f3 = FSDP(nn.Sequential(nn.Linear(16, 16, dtype=F64, seed=3)), strategy="full_shard", auto_wrap={nn.Linear})
    opt3 = optim.SGD(f3.parameters(), lr=0.1)
    for _ in range(2):
        loss_fn(f3(x), x)
        f3.backward(loss_fn.backward())
        opt3.step()
        opt3.zero_grad()
    if f3.memory_stats()["buffer_cache"] != 0:
        fails.append("full_shard kept step buffers (it promises to free what it gathered)")
    return fails


def body_step_breakdown(rank: int, kind: str) -> list[str]:
    """``step_breakdown`` times every phase, the waits inside them, the same figures on every
    rank, and trains the model; DDP reports no waits."""
    from hpcdp.fsdp import step_breakdown

    fails: list[str] = []
    model = nn.Sequential(nn.Linear(16, 32, dtype=F64, seed=1), nn.Tanh(), nn.Linear(32, 16, dtype=F64, seed=2))
    w: Any = (hpcdp.DDP(model) if kind == "ddp"
              else FSDP(model, strategy=kind, auto_wrap={nn.Linear}))
    opt = optim.SGD(w.parameters(), lr=0.1)
    x = np.random.default_rng(rank).normal(size=(4, 16))
    before = [np.array(p.data, copy=True) for p in w.parameters()]
    b = step_breakdown(w, opt, x, nn.MSELoss(), steps=1)
    keys = ("forward", "all_gather_wait", "backward", "reduce_wait", "optimizer", "zero_grad", "step",
            "page_faults", "sys_seconds")
    if sorted(b) != sorted(keys):
        return [f"step_breakdown keys {sorted(b)}"]
    if any(b[k] < 0 for k in keys):
        fails.append(f"negative figures: {dict(b)}")
    parts = b["forward"] + b["backward"] + b["optimizer"] + b["zero_grad"]
    if not parts >= b["step"] * (1 - 1e-9) or not b["step"] > 0:   # one step: the phases tile it
        fails.append(f"phases {parts} s do not add up to the step {b['step']} s")
    if b["reduce_wait"] > b["backward"] or b["all_gather_wait"] > b["forward"] + b["backward"]:
        fails.append(f"a wait is longer than the phase that contains it: {dict(b)}")
    sharded = kind != "ddp" and hpcdp.get_default_group().size > 1
    if sharded != (b["all_gather_wait"] > 0 and b["reduce_wait"] > 0):
        fails.append(f"{kind}: waits {b['all_gather_wait']}, {b['reduce_wait']}")
    mine = np.array([b[k] for k in keys])
    every = hpcdp.all_gather(mine)
    if not np.array_equal(every[0], every[rank]):
        fails.append("ranks report different figures (the slowest rank's, everywhere, expected)")
    if all(np.array_equal(p0, p.data) for p0, p in zip(before, w.parameters())):
        fails.append("the timed step did not train the model")
    if "forward" not in str(b) or " ms" not in str(b):
        fails.append(f"str: {b}")
    try:
        step_breakdown(w, opt, x, nn.MSELoss(), steps=0)
        fails.append("steps=0 did not raise")
    except ValueError:
        pass
    return fails

"""DDP test bodies: each runs on every rank of a group and returns a list of failure strings."""
from __future__ import annotations

import os
import weakref
from typing import Any, Callable

import numpy as np

import hpcdp
from hpcdp import nn, optim
from hpcdp.ddp import bf16_compress_hook, fp16_compress_hook

F64 = np.float64
SMALL_CAP = 200 / 2**20   # bucket cap in MiB: one or two parameters per bucket


def make_mlp(seed: int, dtype: Any = F64) -> nn.Module:
    return nn.Sequential(
        nn.Linear(6, 16, dtype=dtype, seed=seed), nn.Tanh(),
        nn.Linear(16, 16, dtype=dtype, seed=seed + 100), nn.LayerNorm(16, dtype=dtype), nn.ReLU(),
        nn.Linear(16, 4, dtype=dtype, seed=seed + 200),
    )


class Tied(nn.Module):
    """One weight used twice per forward (two gradient hooks per backward), then a head."""

    def __init__(self, seed: int, dtype: Any = F64) -> None:
        super().__init__()
        rng = np.random.default_rng(seed)
        self.w = nn.Parameter(rng.normal(scale=0.4, size=(6, 6)).astype(dtype))
        self.head = nn.Linear(6, 4, dtype=dtype, seed=seed + 1)

    def forward(self, x: Any) -> Any:
        self._x = x
        self._h = np.tanh(x @ self.w.data)
        return self.head(self._h @ self.w.data)

    def backward(self, g: Any) -> Any:
        g2 = self.head.backward(g)
        self.w.accumulate_grad(self._h.T @ g2)
        dpre = (g2 @ self.w.data.T) * (1 - self._h ** 2)
        self.w.accumulate_grad(self._x.T @ dpre)
        return dpre @ self.w.data.T


class Branchy(nn.Module):
    """``a(x) + b(x)`` where the ``b`` branch can be switched off (its parameters get no gradient)."""

    def __init__(self, seed: int, dtype: Any = F64) -> None:
        super().__init__()
        self.a = nn.Linear(6, 4, dtype=dtype, seed=seed)
        self.b = nn.Linear(6, 4, dtype=dtype, seed=seed + 1)
        self.use_b = True

    def forward(self, x: Any) -> Any:
        self._used = self.use_b
        h = self.a(x)
        return h + self.b(x) if self._used else h

    def backward(self, g: Any) -> Any:
        gx = self.a.backward(g)
        if self._used:
            gx = gx + self.b.backward(g)
        return gx


class Penalized(nn.Module):
    """Two layers; the head's backward adds an L2 penalty's gradient ``wd * w``.

    That term does not scale with ``grad_output``: averaging must happen after the gradients
    are summed, not by scaling what backward is given.
    """

    def __init__(self, seed: int, dtype: Any = F64, wd: float = 0.3) -> None:
        super().__init__()
        rng = np.random.default_rng(seed)
        self.body = nn.Sequential(nn.Linear(6, 8, dtype=dtype, seed=seed), nn.Tanh())
        self.w = nn.Parameter(rng.normal(scale=0.4, size=(8, 4)).astype(dtype))
        self.b = nn.Parameter(np.zeros(4, dtype=dtype))
        self.wd = wd

    def forward(self, x: Any) -> Any:
        self._h = self.body(x)
        return self._h @ self.w.data + self.b.data

    def backward(self, g: Any) -> Any:
        self.b.accumulate_grad(g.sum(axis=0))
        self.w.accumulate_grad(self._h.T @ g + self.wd * self.w.data)
        return self.body.backward(g @ self.w.data.T)


def make_frozen(seed: int, dtype: Any = F64) -> nn.Module:
    """The MLP with its first layer frozen (a pretrained encoder): broadcast, but no bucket."""
    m = make_mlp(seed, dtype)
    m[0].requires_grad_(False)
    return m


MODELS: dict[str, Callable[..., nn.Module]] = {
    "mlp": make_mlp, "tied": Tied, "penalized": Penalized, "frozen": make_frozen,
}
#: how many buckets each model has at least with ``SMALL_CAP``
MIN_BUCKETS = {"mlp": 4, "tied": 2, "penalized": 2, "frozen": 3}


def data(n: int, seed: int = 7, dtype: Any = F64) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 6)).astype(dtype), rng.integers(0, 4, n)


def make_opt(name: str, params: Any) -> optim.Optimizer:
    if name == "sgd":
        return optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3)
    return optim.Adam(params, lr=1e-2)


def _params(m: nn.Module) -> dict[str, np.ndarray]:
    return {k: np.array(v, copy=True) for k, v in m.state_dict().items()}


def _compare(a: dict[str, np.ndarray], b: dict[str, np.ndarray], tol: float, what: str) -> list[str]:
    fails = []
    for k in a:
        err = float(np.max(np.abs(a[k] - b[k])))
        if not err <= tol:
            fails.append(f"{what}: {k} differs by {err:.3g} (tol {tol:g})")
    return fails


def body_parity(rank: int, model: str = "mlp", opt_name: str = "sgd", cap_mb: float = 25.0,
                accum: int = 1, steps: int = 3, b: int = 4, bucket_view: bool = True,
                group: Any = None) -> list[str]:
    """N ranks x batch b == 1 rank x batch N*b after ``steps`` optimizer steps (float64)."""
    g = group or hpcdp.get_default_group()
    n, r = g.size, g.rank
    # Different initial weights per rank: DDP must broadcast rank 0's.
    m = MODELS[model](seed=11 + r)
    ddp = hpcdp.DDP(m, bucket_cap_mb=cap_mb, group=g, gradient_as_bucket_view=bucket_view)
    ref = MODELS[model](seed=11)
    fails = _compare(_params(ref), _params(m), 0.0, "after construction")
    opt, ref_opt = make_opt(opt_name, ddp.parameters()), make_opt(opt_name, ref.parameters())
    loss_fn, ref_loss = nn.CrossEntropyLoss(), nn.CrossEntropyLoss()
    x, y = data(steps * accum * n * b)
    for s in range(steps):
        for j in range(accum):
            base = (s * accum + j) * n * b
            mine = slice(base + r * b, base + (r + 1) * b)
            ctx = ddp.no_sync() if j < accum - 1 else _null()
            with ctx:
                out = ddp(x[mine])
                loss_fn(out, y[mine])
                ddp.backward(loss_fn.backward())
            whole = slice(base, base + n * b)
            ref_loss(ref(x[whole]), y[whole])
            ref.backward(ref_loss.backward())
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    fails += _compare(_params(ref), _params(m), 1e-10, f"after {steps} steps")
    nbytes = sum(int(p.data.nbytes) for p in m.parameters() if p.requires_grad)
    if cap_mb * 2**20 >= nbytes and len(ddp.buckets) != 1:
        fails.append(f"a {cap_mb} MiB cap holds all {nbytes} B, yet {len(ddp.buckets)} buckets")
    if cap_mb == SMALL_CAP and len(ddp.buckets) < MIN_BUCKETS[model]:
        fails.append(f"{model} with a {SMALL_CAP * 2**20:.0f} B cap: {len(ddp.buckets)} buckets, "
                     f"expected >= {MIN_BUCKETS[model]}")
    return fails


def body_parity_first3(rank: int, *args: Any) -> list[str]:
    """``body_parity`` on the sub-group of ranks 0, 1, 2 (N = 3 inside a larger world)."""
    g3 = hpcdp.new_group([0, 1, 2])
    return body_parity(rank, *args, group=g3) if rank < 3 else []


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: Any) -> None:
        return None


def body_many_buckets(rank: int) -> list[str]:
    """A tiny bucket cap gives several buckets, none larger than needed."""
    m = make_mlp(0)
    ddp = hpcdp.DDP(m, bucket_cap_mb=SMALL_CAP)
    fails = []
    if len(ddp.buckets) < 4:
        fails.append(f"expected >= 4 buckets, got {len(ddp.buckets)}")
    order = [name for bk in ddp.buckets for name in bk.names]
    want = [name for name, _ in reversed(list(m.named_parameters()))]
    if order != want:
        fails.append(f"bucket order {order} is not reverse parameter order {want}")
    return fails


def body_overlap(rank: int) -> list[str]:
    """The first bucket's reduction starts before backward produced the last gradient."""
    m = nn.Sequential(*[layer for k in range(4) for layer in
                        (nn.Linear(32, 32, dtype=F64, seed=k), nn.Tanh())])
    ddp = hpcdp.DDP(m, bucket_cap_mb=(32 * 33 * 8) / 2**20)   # about one layer per bucket
    events: list[tuple[str, int]] = []
    real = ddp.group.allreduce

    def logged(x: Any, *a: Any, **k: Any) -> Any:
        events.append(("allreduce", int(x.size)))
        return real(x, *a, **k)

    ddp.group.allreduce = logged  # instance attribute: only this DDP's group is instrumented
    first = next(iter(m.parameters()))   # registered first, so its gradient arrives last
    first.register_hook(lambda p: events.append(("last-grad", 0)))
    x = np.random.default_rng(0).normal(size=(8, 32))
    fails = []
    try:
        for it in range(2):   # the first synced backward counts hooks; the second overlaps
            events.clear()
            ddp(x)
            ddp.backward(np.ones((8, 32)))
    finally:
        del ddp.group.allreduce
    nb = len(ddp.buckets)
    if nb < 3:
        fails.append(f"expected several buckets, got {nb}")
    kinds = [e[0] for e in events]
    if "last-grad" not in kinds or "allreduce" not in kinds:
        return fails + [f"events missing: {events}"]
    last = kinds.index("last-grad")
    launched_before = [e for e in events[:last] if e[0] == "allreduce"]
    if not launched_before or launched_before[0][1] != ddp.buckets[0].flat.size:
        fails.append(f"bucket 0 was not launched before the last gradient arrived: {events}")
    if len(launched_before) < nb - 1:
        fails.append(f"only {len(launched_before)} of {nb} buckets launched before the last gradient: {events}")
    return fails


def _local_grads(model: nn.Module, x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    loss = nn.CrossEntropyLoss()
    model.zero_grad()
    loss(model(x), y)
    model.backward(loss.backward())
    out = {k: (np.zeros_like(p.data) if p.grad is None else p.grad.copy()) for k, p in model.named_parameters()}
    model.zero_grad()
    return out


def body_unused(rank: int, find_unused: bool) -> list[str]:
    """Branch b unused on rank 1 only (iteration 1), then on every rank (iteration 2)."""
    g = hpcdp.get_default_group()
    n = g.size
    m = Branchy(3)
    ddp = hpcdp.DDP(m, find_unused_parameters=find_unused, bucket_cap_mb=100 / 2**20)
    ref = Branchy(3)
    x, y = data(8 * n, seed=5)
    mine = slice(8 * rank, 8 * rank + 8)
    loss = nn.CrossEntropyLoss()
    fails: list[str] = []
    for it, use in enumerate([lambda r: True, lambda r: r != 1, lambda r: False]):
        m.use_b = ref.use_b = use(rank)
        loss(ddp(x[mine]), y[mine])
        ddp.backward(loss.backward())
        local = _local_grads(ref, x[mine], y[mine])
        every = hpcdp.all_gather_object(local)
        want = {k: sum(e[k] for e in every) / n for k in local}
        anyone_used_b = any(use(r) for r in range(n))
        for k, p in m.named_parameters():
            if k.startswith("b.") and not anyone_used_b and find_unused:
                if p.grad is not None:
                    fails.append(f"iteration {it}: {k} unused everywhere but grad is not None")
                continue
            if p.grad is None:
                fails.append(f"iteration {it}: {k} has no grad")
                continue
            err = float(np.max(np.abs(p.grad - want[k])))
            if err > 1e-12:
                fails.append(f"iteration {it}: {k} grad differs by {err:.3g}")
        ddp.zero_grad()
    if not find_unused and not ddp._reducer.warned_unused:
        fails.append("no warning about unused parameters with find_unused_parameters=False")
    if find_unused and ddp._reducer.warned_unused:
        fails.append("warned although find_unused_parameters=True")
    return fails


def body_join(rank: int, divide_initial: bool) -> list[str]:
    """Rank r has r + 2 batches; the result equals a single-process replay of the same averaging."""
    g = hpcdp.get_default_group()
    n = g.size
    counts = [r + 2 for r in range(n)]
    m = make_mlp(21 + rank)
    ddp = hpcdp.DDP(m, bucket_cap_mb=800 / 2**20)
    opt = optim.SGD(ddp.parameters(), lr=0.1)
    x, y = data(4 * sum(counts) + 4 * n * max(counts), seed=9)

    def batch(r: int, t: int) -> slice:
        start = 4 * (t * n + r)
        return slice(start, start + 4)

    loss = nn.CrossEntropyLoss()
    with ddp.join(divide_by_initial_world_size=divide_initial):
        for t in range(counts[rank]):
            loss(ddp(x[batch(rank, t)]), y[batch(rank, t)])
            ddp.backward(loss.backward())
            opt.step()
            opt.zero_grad()
    # Replay: at iteration t the ranks with more than t batches contribute.
    ref = make_mlp(21)
    ref_opt = optim.SGD(ref.parameters(), lr=0.1)
    for t in range(max(counts)):
        active = [r for r in range(n) if counts[r] > t]
        grads = [_local_grads(ref, x[batch(r, t)], y[batch(r, t)]) for r in active]
        div = n if divide_initial else len(active)
        for k, p in ref.named_parameters():
            p.grad = sum(gr[k] for gr in grads) / div
        ref_opt.step()
        ref_opt.zero_grad()
    return _compare(_params(ref), _params(m), 1e-10, f"join(divide_by_initial_world_size={divide_initial})")


def body_comm_hook(rank: int, kind: str) -> list[str]:
    """fp16/bf16 compression: averaged gradients within the format's tolerance, bytes compressed."""
    g = hpcdp.get_default_group()
    n = g.size
    m = make_mlp(4, dtype=np.float32)
    ref = make_mlp(4, dtype=np.float32)
    ddp = hpcdp.DDP(m, bucket_cap_mb=2000 / 2**20)
    hook = {"fp16": fp16_compress_hook, "bf16": bf16_compress_hook}[kind]
    ddp.register_comm_hook(None, hook)
    seen: list[str] = []
    for name in ("allreduce", "all_to_all", "all_gather"):
        real = getattr(ddp.group, name)

        def logged(x: Any, *a: Any, _real: Any = real, _name: str = name, **k: Any) -> Any:
            seen.append(f"{_name}:{x.dtype}")
            return _real(x, *a, **k)

        setattr(ddp.group, name, logged)
    x, y = data(8 * n, seed=3, dtype=np.float32)
    mine = slice(8 * rank, 8 * rank + 8)
    loss = nn.CrossEntropyLoss()
    fails: list[str] = []
    try:
        for _ in range(2):
            loss(ddp(x[mine]), y[mine])
            ddp.backward(loss.backward())
            local = _local_grads(ref, x[mine], y[mine])
            grads = {k: p.grad.copy() for k, p in m.named_parameters()}
            ddp.zero_grad()
            every = hpcdp.all_gather_object(local)
            for k in local:
                want = sum(e[k].astype(np.float64) for e in every) / n
                scale = max(float(np.max(np.abs(want))), 1e-3)
                err = float(np.max(np.abs(grads[k] - want))) / scale
                tol = 2e-3 if kind == "fp16" else 1.6e-2
                if err > tol:
                    fails.append(f"{kind}: {k} relative error {err:.3g} > {tol}")
    finally:
        for name in ("allreduce", "all_to_all", "all_gather"):
            g.__dict__.pop(name, None)
    wire = {"fp16": "float16", "bf16": "uint16"}[kind]
    grad_calls = [s for s in seen if not s.endswith(("int32", "int64", "uint8"))]  # not *_object calls
    if not grad_calls or any(not s.endswith(wire) for s in grad_calls):
        fails.append(f"{kind}: gradients did not travel as {wire}: {seen}")
    return fails


def body_subgroups(rank: int) -> list[str]:
    """Two DDP groups [0, 2] and [1, 3] train independently, each in parity with one process."""
    g02 = hpcdp.new_group([0, 2])
    g13 = hpcdp.new_group([1, 3])
    mine = g02 if rank in (0, 2) else g13
    return body_parity(rank, "mlp", "adam", 800 / 2**20, 1, 2, 4, True, mine)


def body_fp16_large(rank: int, kind: str = "fp16") -> list[str]:
    """Per-rank gradients beyond float16's range (up to ~1.3e5) whose mean (65000) fits."""
    from hpcdp.ddp.comm_hooks import GradBucket

    g = hpcdp.get_default_group()
    n, r = g.size, g.rank
    pattern = np.linspace(-1.0, 1.0, 1001)
    scales = [130000.0 * (k + 1) / (n + 1) for k in range(n)]   # mean of the scales: 65000
    flat = (scales[r] * pattern).astype(np.float32)
    want = sum((s * pattern).astype(np.float32).astype(F64) for s in scales) / n
    hook = {"fp16": fp16_compress_hook, "bf16": bf16_compress_hook}[kind]
    got = hook(None, GradBucket(0, flat, [], [], g, n, True)).wait()
    if not np.all(np.isfinite(got)):
        return [f"{kind}: {int(np.sum(~np.isfinite(got)))} non-finite averaged values"]
    err = float(np.max(np.abs(got - want))) / 65000.0
    tol = 2e-3 if kind == "fp16" else 1.6e-2
    return [] if err <= tol else [f"{kind}: relative error {err:.3g} > {tol}"]


def body_hooks_see_local(rank: int) -> list[str]:
    """A user's parameter hook sees this rank's own gradient and backward returns the unscaled
    input gradient, exactly as without DDP."""
    n = hpcdp.get_default_group().size
    m, plain = Penalized(5), Penalized(5)
    seen: dict[str, np.ndarray] = {}
    for name, p in m.named_parameters():   # registered before DDP's hooks: fire first
        p.register_hook(lambda q, _k=name: seen.__setitem__(_k, q.grad.copy()))
    ddp = hpcdp.DDP(m, bucket_cap_mb=SMALL_CAP)
    x, y = data(4 * n, seed=2)
    mine = slice(4 * rank, 4 * rank + 4)
    loss, ref_loss = nn.CrossEntropyLoss(), nn.CrossEntropyLoss()
    fails: list[str] = []
    for it in range(2):   # the second backward overlaps (hook counts learnt in the first)
        loss(ddp(x[mine]), y[mine])
        gx = ddp.backward(loss.backward())
        ref_loss(plain(x[mine]), y[mine])
        want_gx = plain.backward(ref_loss.backward())
        if not np.array_equal(gx, want_gx):
            fails.append(f"iteration {it}: backward returned a different input gradient")
        for k, p in plain.named_parameters():
            if not np.array_equal(seen[k], p.grad):
                fails.append(f"iteration {it}: the hook on {k} saw {seen[k].ravel()[:2]}, "
                             f"not the local gradient {p.grad.ravel()[:2]}")
        ddp.zero_grad()
        plain.zero_grad()
    return fails


def body_join_frozen(rank: int) -> list[str]:
    """After ``join`` every rank holds the longest-running rank's parameters, frozen ones too."""
    g = hpcdp.get_default_group()
    n = g.size
    m = make_frozen(30 + rank)
    ddp = hpcdp.DDP(m, bucket_cap_mb=SMALL_CAP)
    opt = optim.SGD(ddp.parameters(), lr=0.1)
    x, y = data(8 * n, seed=4)
    loss = nn.CrossEntropyLoss()
    with ddp.join():
        for t in range(rank + 1):
            loss(ddp(x[4 * t:4 * t + 4]), y[4 * t:4 * t + 4])
            ddp.backward(loss.backward())
            opt.step()
            opt.zero_grad()
            m[0].weight.data += 0.5   # a frozen parameter updated by hand (an EMA, say)
    last = hpcdp.broadcast_object(_params(m) if rank == n - 1 else None, root=n - 1)
    return _compare(last, _params(m), 0.0, "after join (rank n-1 ran longest)")


def body_join_no_sync(rank: int, divide_initial: bool) -> list[str]:
    """``join`` with ``no_sync`` accumulation and a buffer: rank r runs r + 1 steps of two
    micro-batches (the first under ``no_sync``); equals a single-process replay."""
    g = hpcdp.get_default_group()
    level = g.debug  # restored after the replay's first part
    g.debug = "detail"   # a collective sequence that differs across ranks raises, not hangs
    n = g.size
    counts = [r + 1 for r in range(n)]
    m = make_mlp(41 + rank)
    m.register_buffer("stamp", np.full(3, float(rank)))
    ddp = hpcdp.DDP(m, bucket_cap_mb=800 / 2**20)
    opt = optim.SGD(ddp.parameters(), lr=0.1)
    x, y = data(8 * n * max(counts), seed=6)

    def batch(r: int, t: int, j: int) -> slice:
        start = 4 * ((t * n + r) * 2 + j)
        return slice(start, start + 4)

    loss = nn.CrossEntropyLoss()
    fails: list[str] = []
    with ddp.join(divide_by_initial_world_size=divide_initial):
        for t in range(counts[rank]):
            m.stamp[...] = 100.0 + rank + t   # each forward overwrites it with rank 0's
            with ddp.no_sync():
                loss(ddp(x[batch(rank, t, 0)]), y[batch(rank, t, 0)])
                ddp.backward(loss.backward())
            rank0 = 100.0 + min(t, counts[0] - 1)   # a joined rank 0 still broadcasts its last
            if not np.all(m.stamp == rank0):
                fails.append(f"step {t}: buffer {m.stamp} is not rank 0's ({rank0})")
            loss(ddp(x[batch(rank, t, 1)]), y[batch(rank, t, 1)])
            ddp.backward(loss.backward())
            opt.step()
            opt.zero_grad()
    g.debug = level
    ref = make_mlp(41)
    ref_opt = optim.SGD(ref.parameters(), lr=0.1)
    for t in range(max(counts)):
        active = [r for r in range(n) if counts[r] > t]
        grads = [_local_grads(ref, x[batch(r, t, j)], y[batch(r, t, j)]) for r in active for j in (0, 1)]
        div = n if divide_initial else len(active)
        for k, p in ref.named_parameters():
            p.grad = sum(gr[k] for gr in grads) / div
        ref_opt.step()
        ref_opt.zero_grad()
    want = {k: v for k, v in _params(ref).items()}
    got = {k: v for k, v in _params(m).items() if k != "stamp"}
    return fails + _compare(want, got, 1e-10, f"join+no_sync(divide_by_initial_world_size={divide_initial})")


def body_rewrap(rank: int) -> list[str]:
    """Wrapping a model again drops the old DDP's hooks; ``close()`` detaches explicitly."""
    n = hpcdp.get_default_group().size
    m = make_mlp(50 + rank)
    ddp = hpcdp.DDP(m, bucket_cap_mb=SMALL_CAP)
    old = weakref.ref(ddp)
    ddp = hpcdp.DDP(m, bucket_cap_mb=SMALL_CAP)
    fails: list[str] = []
    if old() is not None:
        fails.append("the first DDP is still alive after the model was wrapped again")
    counts = sorted({len(p._hooks) for p in m.parameters()})
    if counts != [1]:
        fails.append(f"parameters carry {counts} hooks, expected exactly 1 (the new DDP's)")
    x, y = data(4 * n, seed=8)
    mine = slice(4 * rank, 4 * rank + 4)
    loss = nn.CrossEntropyLoss()
    for _ in range(2):
        loss(ddp(x[mine]), y[mine])
        ddp.backward(loss.backward())
        ref = make_mlp(50)
        local = _local_grads(ref, x[mine], y[mine])
        every = hpcdp.all_gather_object(local)
        for k, p in m.named_parameters():
            want = sum(e[k] for e in every) / n
            if p.grad is None or not np.allclose(p.grad, want, rtol=0, atol=1e-12):
                fails.append(f"after re-wrapping: {k} is not the averaged gradient")
            if p.grad is not None and not any(np.shares_memory(p.grad, b.flat) for b in ddp.buckets):
                fails.append(f"after re-wrapping: {k}.grad is not a view of the new DDP's buckets")
        ddp.zero_grad()
    ddp.close()
    ddp.close()   # idempotent
    if any(p._hooks for p in m.parameters()):
        fails.append("close() left gradient hooks on the parameters")
    try:
        ddp(x[mine])
        fails.append("forward on a closed DDP did not raise")
    except hpcdp.HpcdpError:
        pass
    local = _local_grads(make_mlp(50), x[mine], y[mine])
    if _compare(local, _local_grads(m, x[mine], y[mine]), 0.0, "closed"):
        fails.append("after close() the bare model's backward is not plain local backward")
    return fails


def body_progress_thread(rank: int, thread_multiple: bool) -> list[str]:
    """The MPI progress thread runs only with MPI_THREAD_MULTIPLE and stops on ``close()``;
    with it, find_unused_parameters and join (collectives beside the buckets') still match."""
    backend = hpcdp.get_default_group().backend
    real = backend.thread_level
    old_env = os.environ.get("HPCDP_DDP_PROGRESS_THREAD")
    backend.thread_level = "multiple" if thread_multiple else "serialized"
    os.environ["HPCDP_DDP_PROGRESS_THREAD"] = "1"
    try:
        m = make_mlp(60 + rank)
        m.register_buffer("stamp", np.zeros(2))
        ddp = hpcdp.DDP(m, bucket_cap_mb=SMALL_CAP, find_unused_parameters=True)
    finally:
        backend.thread_level = real
        if old_env is None:
            os.environ.pop("HPCDP_DDP_PROGRESS_THREAD", None)
        else:
            os.environ["HPCDP_DDP_PROGRESS_THREAD"] = old_env
    fails: list[str] = []
    progress = ddp._reducer.progress
    if thread_multiple != (progress is not None):
        fails.append(f"thread_multiple={thread_multiple} but progress thread {progress}")
    n = hpcdp.get_default_group().size
    x, y = data(8 * n, seed=1)
    loss = nn.CrossEntropyLoss()
    with ddp.join():
        for t in range(rank + 2):
            loss(ddp(x[4 * t:4 * t + 4]), y[4 * t:4 * t + 4])
            ddp.backward(loss.backward())
            ddp.zero_grad()
    ddp.close()
    if progress is not None and progress.thread.is_alive():
        fails.append("close() did not stop the progress thread")
    return fails

"""DDP test bodies: each runs on every rank of a group and returns a list of failure strings."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

import hpcdp
from hpcdp import nn, optim
from hpcdp.ddp import bf16_compress_hook, fp16_compress_hook

F64 = np.float64


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


MODELS: dict[str, Callable[..., nn.Module]] = {"mlp": make_mlp, "tied": Tied}


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
    if len(ddp.buckets) < 1:
        fails.append("no buckets")
    return fails


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: Any) -> None:
        return None


def body_many_buckets(rank: int) -> list[str]:
    """A tiny bucket cap gives several buckets, none larger than needed."""
    m = make_mlp(0)
    ddp = hpcdp.DDP(m, bucket_cap_mb=200 / 2**20)
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
    if not find_unused and not ddp._warned_unused:
        fails.append("no warning about unused parameters with find_unused_parameters=False")
    if find_unused and ddp._warned_unused:
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

"""DDP over torch models: bodies run on every rank, each returning a list of failure strings.

The reference in every parity body is plain torch in this one process, on the whole global batch
with the same seed: what a torch user would have trained without hpcdp.
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

import hpcdp
from hpcdp.errors import HpcdpError

GLOBAL_BATCH = 12
# tiny tensors on ranks that share a few cores: torch's own thread pool would only contend
torch.set_num_threads(1)
# torch.manual_seed seeds one generator per process; simulated ranks are threads, so models are
# made one at a time
_MAKE = threading.Lock()


class TwoHeads(torch.nn.Module):
    """A trunk and two heads; ``use`` picks which heads the forward runs."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = torch.nn.Linear(6, 8)
        self.a = torch.nn.Linear(8, 4)
        self.b = torch.nn.Linear(8, 4)
        self.use = "a"

    def forward(self, x: Any) -> Any:
        h = torch.tanh(self.trunk(x))
        if self.use == "both":
            return self.a(h), self.b(h)
        return self.a(h)


class Tied(torch.nn.Module):
    """One weight used twice per forward: torch accumulates both uses before its hook fires."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(6, 6) * 0.4)
        self.head = torch.nn.Linear(6, 4)

    def forward(self, x: Any) -> Any:
        return self.head(torch.tanh(x @ self.w) @ self.w)


def make(kind: str, seed: int = 0) -> torch.nn.Module:
    with _MAKE:
        torch.manual_seed(seed)
        return _make(kind)


def _make(kind: str) -> torch.nn.Module:
    if kind == "mlp":
        m: torch.nn.Module = torch.nn.Sequential(
            torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
            torch.nn.ReLU(inplace=True), torch.nn.Linear(16, 4))
    elif kind == "cnn":
        m = torch.nn.Sequential(
            torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(4, 6, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(24, 4))
    elif kind == "tied":
        m = Tied()
    elif kind == "twoheads":
        m = TwoHeads()
    else:
        raise ValueError(kind)
    return m.double()


def data(kind: str, n: int = GLOBAL_BATCH, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (n, 1, 8, 8) if kind == "cnn" else (n, 6)
    return torch.randn(*shape, generator=g, dtype=torch.float64), torch.randint(0, 4, (n,), generator=g)


def make_opt(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.01)


def reference(kind: str, opt_name: str, steps: int) -> list[np.ndarray]:
    m = make(kind)
    opt = make_opt(opt_name, m.parameters())
    x, y = data(kind)
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(m(x), y).backward()
        opt.step()
    return [p.detach().numpy().copy() for p in m.parameters()]


def _compare(model: torch.nn.Module, ref: list[np.ndarray], tol: float, what: str) -> list[str]:
    bad = []
    for (name, p), r in zip(model.named_parameters(), ref):
        err = float(np.max(np.abs(p.detach().numpy() - r))) if r.size else 0.0
        if not err <= tol:
            bad.append(f"{what}: {name} differs from single-process torch by {err:.3g}")
    return bad


def _numpy_step(ddp: Any, x: torch.Tensor, y: torch.Tensor, scale: float) -> None:
    """hpcdp's protocol: arrays in and out, ddp.backward(loss gradient)."""
    out = ddp(x.numpy())
    t = torch.from_numpy(out).requires_grad_(True)
    (F.cross_entropy(t, y) * scale).backward()
    ddp.backward(t.grad.numpy())


def body_parity(rank: int, kind: str, opt_name: str, mode: str, cap_mb: float = 25.0,
                accum: int = 1, steps: int = 5) -> list[str]:
    n = hpcdp.get_world_size()
    model = make(kind)
    ddp = hpcdp.DDP(model, bucket_cap_mb=cap_mb)
    opt = make_opt(opt_name, ddp.parameters())
    if [id(p) for p in opt.param_groups[0]["params"]] != [id(p) for p in model.parameters()]:
        return [f"rank {rank}: ddp.parameters() are not the torch model's parameters"]
    x, y = data(kind)
    b = GLOBAL_BATCH // n
    xs, ys = x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]
    for _ in range(steps):
        opt.zero_grad()
        pieces = list(zip(xs.chunk(accum), ys.chunk(accum)))
        for i, (xi, yi) in enumerate(pieces):
            ctx = ddp.no_sync() if i < len(pieces) - 1 else _nothing()
            with ctx:
                share = len(xi) / len(xs)   # the local mean, from pieces of unequal size
                if mode == "torch":
                    (F.cross_entropy(ddp(xi), yi) * share).backward()
                else:
                    _numpy_step(ddp, xi, yi, share)
        opt.step()
    return _compare(model, reference(kind, opt_name, steps), 1e-10, f"rank {rank} {kind}/{opt_name}/{mode}")


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def body_averaged_when_backward_returns(rank: int) -> list[str]:
    """``loss.backward()`` returns with every gradient averaged (as torch's DDP), and a hook
    registered by the user on a torch parameter sees the local gradient first."""
    n = hpcdp.get_world_size()
    model = make("mlp")
    ddp = hpcdp.DDP(model, bucket_cap_mb=200 / 2**20)
    x, y = data("mlp")
    b = GLOBAL_BATCH // n
    seen: list[float] = []
    model[0].weight.register_hook(lambda g: seen.append(float(g.abs().sum())))
    F.cross_entropy(ddp(x[rank * b:(rank + 1) * b]), y[rank * b:(rank + 1) * b]).backward()
    got = [p.grad.detach().numpy().copy() for p in model.parameters()]
    want = []
    for r in range(n):
        m = make("mlp")
        F.cross_entropy(m(x[r * b:(r + 1) * b]), y[r * b:(r + 1) * b]).backward()
        want.append([p.grad.numpy() for p in m.parameters()])
    bad = []
    for k, g in enumerate(got):
        avg = sum(w[k] for w in want) / n
        err = float(np.max(np.abs(g - avg)))
        if err > 1e-12:
            bad.append(f"rank {rank}: gradient {k} is not the average when backward returned (err {err:.3g})")
    if not seen:
        bad.append(f"rank {rank}: the user's tensor hook did not run")
    return bad


def body_unused(rank: int, find_unused: bool) -> list[str]:
    """Head b is never used. find_unused_parameters=True leaves its grads None (torch's DDP does,
    and torch's optimizers then skip it); False gives zeros and one warning."""
    model = make("twoheads")
    ddp = hpcdp.DDP(model, find_unused_parameters=find_unused)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    x, y = data("mlp")
    before = model.b.weight.detach().clone()
    for _ in range(2):   # (warnings.catch_warnings is process-wide: the reducer's flag tells)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
    bad = []
    warned = ddp._reducer.warned_unused
    if find_unused:
        if model.b.weight.grad is not None:
            bad.append(f"rank {rank}: unused parameter got a gradient with find_unused_parameters=True")
        if warned:
            bad.append(f"rank {rank}: warned although find_unused_parameters=True")
    else:
        if model.b.weight.grad is None or float(model.b.weight.grad.abs().max()) != 0.0:
            bad.append(f"rank {rank}: unused parameter should get a zero gradient")
        if not warned:
            bad.append(f"rank {rank}: no warning naming the unused parameters")
    if not torch.equal(before, model.b.weight.detach()):
        bad.append(f"rank {rank}: the unused head moved")
    if model.trunk.weight.grad is None:
        bad.append(f"rank {rank}: the trunk got no gradient")
    return bad


def body_partial_backward(rank: int) -> list[str]:
    """The loss uses one of two outputs: the other head's buckets never fill. The next forward
    says so on every rank (torch's DDP: "Expected to have finished reduction...")."""
    model = make("twoheads")
    model.use = "both"
    ddp = hpcdp.DDP(model)
    x, y = data("mlp")
    a, _b = ddp(x)
    F.cross_entropy(a, y).backward()
    try:
        ddp(x)
    except HpcdpError as exc:
        msg = str(exc)
        if "b.weight" not in msg or "previous backward" not in msg:
            return [f"rank {rank}: unhelpful message: {msg}"]
        return []
    return [f"rank {rank}: a half-finished backward went unnoticed"]


def body_forward_without_backward(rank: int) -> list[str]:
    """A training forward whose output is dropped (validation without eval()) is forgotten; under
    torch.no_grad() nothing is awaited either; the next step trains normally."""
    model = make("mlp")
    ddp = hpcdp.DDP(model)
    x, y = data("mlp")
    ddp(x)
    with torch.no_grad():
        ddp(x)
    ddp.eval()
    ddp(x)
    ddp.train()
    F.cross_entropy(ddp(x), y).backward()
    if any(p.grad is None for p in model.parameters()):
        return [f"rank {rank}: no gradients after a normal step"]
    return []


def body_comm_hook(rank: int) -> list[str]:
    """A comm hook (fp16 compression) reduces the buckets of a torch model too."""
    from hpcdp.ddp import fp16_compress_hook
    n = hpcdp.get_world_size()
    model = make("mlp")
    ddp = hpcdp.DDP(model)
    ddp.register_comm_hook(None, fp16_compress_hook)
    x, y = data("mlp")
    b = GLOBAL_BATCH // n
    F.cross_entropy(ddp(x[rank * b:(rank + 1) * b]), y[rank * b:(rank + 1) * b]).backward()
    ref = make("mlp")
    F.cross_entropy(ref(x), y).backward()
    bad = []
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        err = float((p.grad - q.grad).abs().max())
        if err > 2e-3:
            bad.append(f"rank {rank}: {name} fp16-compressed gradient off by {err:.3g}")
    return bad


def body_split_backward(rank: int) -> list[str]:
    """The adapter's split backward (input gradient, then weights over the kept graph) gives the
    fused backward's gradients and input gradient, with microbatches in flight."""
    from hpcdp import nn
    model = make("mlp")
    fused = nn.from_torch(make("mlp"))
    split = nn.from_torch(model, split_backward=True)
    x, _ = data("mlp")
    g = np.random.default_rng(rank).standard_normal((GLOBAL_BATCH, 4))
    bad = []
    outs = []
    for i in range(3):   # three microbatches in flight
        with nn.microbatch(i):
            outs.append(split(x.numpy() * (i + 1)))
    gis = []
    for i in reversed(range(3)):
        with nn.microbatch(i):
            gis.append(split.backward_input(g))
    if any(p.grad is not None for p in model.parameters()):
        bad.append("split backward_input already wrote weight gradients")
    for i in range(3):
        with nn.microbatch(i):
            split.backward_weight()
    for i in range(3):
        out = fused(x.numpy() * (i + 1))
        if not np.array_equal(out, outs[i]):
            bad.append(f"microbatch {i}: outputs differ")
        gi = fused.backward(g)
        if not np.allclose(gi, gis[2 - i], rtol=0, atol=1e-14):
            bad.append(f"microbatch {i}: input gradients differ")
    for p, q in zip(model.parameters(), fused.torch.parameters()):
        if not torch.allclose(p.grad, q.grad, rtol=0, atol=1e-13):
            bad.append("split and fused weight gradients differ")
    if split.saved_count() or fused.saved_count():
        bad.append("saved activations left behind")
    return bad


def skipping_hook(rank: int, skip_rank: int, skip_step: int, step: list[int]) -> Any:
    """A comm hook with which rank ``skip_rank`` leaves out bucket 1's allreduce at ``skip_step``."""
    from hpcdp.ddp.comm_hooks import Ready, allreduce_hook

    def hook(state: Any, bucket: Any) -> Any:
        if rank == skip_rank and step[0] == skip_step and bucket.index() == 1:
            return Ready(bucket.buffer())   # the bucket keeps this rank's own gradients
        return allreduce_hook(state, bucket)
    return hook


def body_skipped_bucket(rank: int) -> list[str]:
    """One rank skips a bucket's allreduce inside ``loss.backward()``: every rank raises."""
    model = make("mlp")
    ddp = hpcdp.DDP(model, bucket_cap_mb=300 / 2**20)
    step = [0]
    ddp.register_comm_hook(None, skipping_hook(rank, 1, 2, step))
    x, y = data("mlp", n=4)
    try:
        for step[0] in range(4):
            F.cross_entropy(ddp(x), y).backward()
    except HpcdpError:
        return []
    return [f"rank {rank}: a skipped bucket allreduce went unnoticed ({len(ddp.buckets)} buckets)"]


def body_backward_raises(rank: int, kind: str) -> list[str]:
    """A torch backward that raises (before any parameter's gradient, then half way) leaves no
    wrapper stuck: the step after an early raise trains; after a half-way raise the next forward
    says the step was forgotten, and the one after trains, matching a run that skipped those
    batches."""
    def wrap(m: torch.nn.Module) -> Any:
        return hpcdp.DDP(m) if kind == "ddp" else hpcdp.FSDP(m, auto_wrap={torch.nn.Linear})

    model, ref = make("mlp"), make("mlp")
    w = wrap(model)
    opt = make_opt("sgd", w.parameters())
    ref_opt = make_opt("sgd", ref.parameters())
    x, y = data("mlp")
    mode = [None]

    def boom(_g: Any) -> None:
        if mode[0] == "mid":
            raise RuntimeError("boom mid")
    model[2].weight.register_hook(boom)
    got = []
    for step in range(6):
        mode[0] = "mid" if step == 2 else None
        try:
            out = w(x)
            if step == 0:
                out.register_hook(lambda _g: (_ for _ in ()).throw(RuntimeError("boom early")))
            F.cross_entropy(out, y).backward()
            opt.step()
            opt.zero_grad()
            got.append("ok")
        except (RuntimeError, HpcdpError) as exc:
            got.append(type(exc).__name__)
            opt.zero_grad()
    want = ["RuntimeError", "ok", "RuntimeError", "HpcdpError", "ok", "ok"]
    if got != want:
        return [f"rank {rank} {kind}: steps went {got}, expected {want}"]
    for _ in range(3):   # the reference trains on the steps that completed
        ref_opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()
    want_p = [p.detach().numpy() for p in ref.parameters()]
    if kind == "ddp":
        return _compare(model, want_p, 1e-12, f"rank {rank} ddp after the aborted steps")
    full = w.full_state_dict()   # collective: whole parameters on rank 0
    if rank != 0:
        return []
    bad = []
    for (name, _), r in zip(ref.named_parameters(), want_p):
        err = float(np.max(np.abs(np.asarray(full[name]) - r)))
        if not err <= 1e-12:
            bad.append(f"rank 0 fsdp after the aborted steps: {name} off by {err:.3g}")
    return bad


def body_parity_cases(rank: int, cases: list[tuple]) -> list[str]:
    """``body_parity`` for several cases in one launch (a spawned world starts torch once)."""
    return [f for case in cases for f in body_parity(rank, *case)]


def body_dynamic_graph(rank: int, find_unused: bool) -> list[str]:
    """Step 1 uses both heads, step 2 only one. DDP stops walking the graph once a step used every
    parameter (torch's DDP assumes a static graph the same way), so without
    find_unused_parameters the half-reduced step 2 is named at step 3 with the option to pass;
    with it, every step walks and step 2 leaves head b's gradient None."""
    model = make("twoheads")
    ddp = hpcdp.DDP(model, find_unused_parameters=find_unused)
    x, y = data("mlp")
    model.use = "both"
    a, b = ddp(x)
    (F.cross_entropy(a, y) + F.cross_entropy(b, y)).backward()
    model.use = "a"
    F.cross_entropy(ddp(x), y).backward()
    grad_b = model.b.weight.grad
    try:
        F.cross_entropy(ddp(x), y).backward()
    except HpcdpError as exc:
        if find_unused:
            return [f"rank {rank}: find_unused_parameters=True still raised: {exc}"]
        if "find_unused_parameters=True" not in str(exc) or "b.weight" not in str(exc):
            return [f"rank {rank}: unhelpful message: {exc}"]
        return []
    if not find_unused:
        return [f"rank {rank}: a step that left head b unreduced went unnoticed"]
    if grad_b is not None:
        return [f"rank {rank}: head b got a gradient in a step that did not use it"]
    return []

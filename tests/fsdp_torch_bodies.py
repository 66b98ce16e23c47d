"""Bodies for tests/fsdp/test_fsdp_torch.py: FSDP over torch models, run on every rank (spawned
worlds and MPI ranks import them from here), compared with one process of plain torch."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

import hpcdp
from hpcdp.fsdp import FSDP, MixedPrecision

BATCH = 12            # global batch: divisible by 1, 2, 3 and 4 ranks
STEPS = 5
STRATEGIES = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard")


def data(shape: tuple[int, ...] = (5,), seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(BATCH * 3, *shape, dtype=torch.float64, generator=g),
            torch.randn(BATCH * 3, 3, dtype=torch.float64, generator=g))


def seeded(m: torch.nn.Module) -> torch.nn.Module:
    """``m`` in float64 with parameters from a generator of its own: simulated ranks are threads
    sharing torch's global generator, so ``torch.manual_seed`` would race between them."""
    g = torch.Generator().manual_seed(0)
    m = m.double()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_((torch.rand(p.shape, dtype=torch.float64, generator=g) - 0.5) * 0.8)
    return m


def mlp() -> torch.nn.Module:
    """7 rows on 4 ranks leave rank 3 one row; a bias of 3 leaves it none (padding paths)."""
    return seeded(torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(inplace=True),
                                      torch.nn.Linear(7, 3)))


class Cnn(torch.nn.Module):
    """A convolution (autograd saves its weight itself, not a view: it must be re-gathered for
    backward) and a parameter used outside any submodule (owned by the root unit)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 4, 3)
        self.fc = torch.nn.Linear(4 * 16, 3)
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 3))
        self.register_buffer("shift", torch.full((3,), 0.25))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(x)).flatten(1)) * self.scale + self.shift


def cnn() -> torch.nn.Module:
    return seeded(Cnn())


def frozen() -> torch.nn.Module:
    """A frozen layer between trainable ones: gradients flow through it to the first layer, so
    its weights must stay gathered through its backward although it has nothing to reduce (and
    a unit mixing frozen and trainable parameters, for auto_wrap=None and the callable)."""
    m = seeded(torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 6),
                                   torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 3))))
    m[2].requires_grad_(False)
    m[3][0].requires_grad_(False)
    return m


MODELS = {"mlp": (mlp, (5,)), "cnn": (cnn, (2, 6, 6)), "frozen": (frozen, (5,))}


def make_opt(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.02, weight_decay=0.05)


def reference(model: str, opt_name: str, steps: int = STEPS) -> dict[str, np.ndarray]:
    """One process of plain torch on the whole batch: the state after ``steps`` steps."""
    make, shape = MODELS[model]
    m = make()
    opt = make_opt(opt_name, [p for p in m.parameters() if p.requires_grad])
    x, y = data(shape)
    for s in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(m(x[s * BATCH:(s + 1) * BATCH]), y[s * BATCH:(s + 1) * BATCH]).backward()
        opt.step()
    return {k: v.detach().numpy().copy() for k, v in m.state_dict().items()}


def train(fsdp: FSDP, opt: Any, mode: str, shape: tuple[int, ...], start: int, stop: int,
          group: Any = None) -> None:
    """Steps [start, stop): this rank's slice of each global batch, in ``mode``: "torch" (tensors,
    ``loss.backward()``) or "numpy" (arrays, ``fsdp.backward(grad of the global mean loss)``)."""
    g = group or hpcdp.get_default_group()
    n, r = g.size, g.rank
    b = BATCH // n
    x, y = data(shape)
    for s in range(start, stop):
        mine = slice(s * BATCH + r * b, s * BATCH + (r + 1) * b)
        opt.zero_grad()
        if mode == "torch":
            # the mean over this rank's rows; FSDP averages over ranks: the global mean's gradient
            torch.nn.functional.mse_loss(fsdp(x[mine]), y[mine]).backward()
        else:
            out = fsdp(x[mine].numpy())
            if not isinstance(out, np.ndarray):
                raise AssertionError(f"numpy in, {type(out).__name__} out")
            fsdp.backward(2.0 * (out - y[mine].numpy()) / out.size)
        opt.step()


def wrap_policy(kind: str) -> Any:
    return {"classes": {torch.nn.Linear, torch.nn.Conv2d},
            "callable": lambda m: isinstance(m, torch.nn.Conv2d) or (
                isinstance(m, torch.nn.Sequential) and len(m) == 2) or (
                isinstance(m, torch.nn.Linear) and m.in_features == 5),
            "none": None}[kind]


def compare(want: dict[str, np.ndarray], got: dict[str, Any], tol: float, what: str) -> list[str]:
    fails = []
    if set(want) != set(got):
        return [f"{what}: keys {sorted(got)}, want {sorted(want)}"]
    for k in want:
        a = np.asarray(got[k])
        if a.shape != want[k].shape:
            fails.append(f"{what}: {k} shape {a.shape}, want {want[k].shape}")
            continue
        err = float(np.abs(a - want[k]).max()) if a.size else 0.0
        if not err <= tol:
            fails.append(f"{what}: {k} differs from single-process torch by {err:.3g} (tol {tol})")
    return fails


def configs(n: int) -> list[tuple[str, str, str, str]]:
    """(strategy, optimizer, mode, auto_wrap) for an ``n``-rank world: every strategy with both
    optimizers and both calling modes; hybrid needs an even world (shard groups of 2, or of 1
    at 2 ranks: replicas only)."""
    out = []
    for strategy in STRATEGIES:
        if strategy == "hybrid_shard" and n not in (2, 4):
            continue
        for opt_name, mode, wrap in (("sgd", "torch", "classes"), ("adamw", "torch", "none"),
                                     ("sgd", "numpy", "none"), ("adamw", "numpy", "callable")):
            out.append((strategy, opt_name, mode, wrap))
    return out


def body_parity(rank: int, model: str = "mlp", only: str | None = None) -> list[str]:
    """Every config of ``configs`` (or the strategy ``only``): full_state_dict and this rank's own
    shards against single-process torch after 5 steps, within 1e-10."""
    n = hpcdp.get_world_size()
    make, shape = MODELS[model]
    refs = {o: reference(model, o) for o in ("sgd", "adamw")}
    fails: list[str] = []
    for strategy, opt_name, mode, wrap in configs(n):
        if only is not None and strategy != only:
            continue
        what = f"{model} {strategy} {opt_name} {mode} auto_wrap={wrap} on {n} ranks"
        fsdp = FSDP(make(), strategy=strategy, auto_wrap=wrap_policy(wrap),
                    shard_size=(n // 2 if n == 4 else 1) if strategy == "hybrid_shard" else None)
        params = list(fsdp.parameters())
        if not all(isinstance(p, torch.Tensor) for p in params):
            fails.append(f"{what}: fsdp.parameters() gives {sorted({type(p).__name__ for p in params})}")
        opt = make_opt(opt_name, [p for p in params if p.requires_grad])
        train(fsdp, opt, mode, shape, 0, STEPS)
        full = fsdp.full_state_dict()
        if rank == 0:
            fails += compare(refs[opt_name], full, 1e-10, what)
        for name, v in fsdp.state_dict().items():   # this rank's own rows, not only rank 0's gather
            block = v.local if hasattr(v, "local") else v
            lo = v.offsets[0] if hasattr(v, "offsets") else 0
            fails += compare({name: refs[opt_name][name][lo:lo + len(block)] if np.ndim(block) else
                              refs[opt_name][name]}, {name: block}, 1e-10, f"{what}, rank {rank}'s block")
        fsdp.close()
    return fails


def body_units_and_grads(rank: int) -> list[str]:
    """auto_wrap by torch classes and by a callable makes the torch submodules units (hooks firing
    from torch's); after ``loss.backward()`` returns the shards' ``.grad`` are the averaged
    gradients (no step needed to see them) and the model's own gradients are gone."""
    n = hpcdp.get_world_size()
    fails = []
    x, y = data()
    ref = mlp()
    torch.nn.functional.mse_loss(ref(x[:BATCH]), y[:BATCH]).backward()
    want = {k: p.grad.numpy() for k, p in ref.named_parameters()}
    for policy, units in (({torch.nn.Linear}, ["<root>", "0", "2"]),
                          (lambda t: isinstance(t, torch.nn.Linear) and t.out_features == 3, ["<root>", "2"]),
                          (None, ["<root>"])):
        fsdp = FSDP(mlp(), auto_wrap=policy)
        if fsdp.unit_names != units:
            fails.append(f"auto_wrap {policy}: units {fsdp.unit_names}, want {units}")
        b = BATCH // n
        torch.nn.functional.mse_loss(fsdp(x[rank * b:(rank + 1) * b]), y[rank * b:(rank + 1) * b]).backward()
        kinds = [e.kind for e in fsdp.events]
        if kinds.count("rs_done") != sum(1 for u in fsdp.units if u.slots):
            fails.append(f"auto_wrap {policy}: events {kinds}")
        slots = {s.name: s for u in fsdp.units for s in u.slots}
        norm = float(np.sqrt(sum(float((g ** 2).sum()) for g in want.values())))
        got_norm = fsdp.clip_grad_norm_(1e9)   # over the shards' .grad (numpy views of torch's)
        if abs(got_norm - norm) > 1e-12 * norm:
            fails.append(f"auto_wrap {policy}: clip_grad_norm_ gives {got_norm}, the gradients' norm is {norm}")
        for name, sp in fsdp.named_parameters():
            lo, hi = slots[name].bounds()
            if sp.grad is None:
                fails.append(f"auto_wrap {policy}: shard of {name} has no gradient after loss.backward()")
                continue
            fails += compare({name: want[name][lo:hi]}, {name: sp.grad.numpy()}, 1e-12,
                             f"auto_wrap {policy}: shard gradient")
        if any(p.grad is not None for p in fsdp.module.torch.parameters()):
            fails.append(f"auto_wrap {policy}: the torch model's own parameters kept gradients")
        if any(p.numel() for p in fsdp.module.torch.parameters()):
            fails.append(f"auto_wrap {policy}: the torch model holds full parameters after the step")
        if len(units) == 3:   # a second step prefetches in the orders the first one recorded
            torch.nn.functional.mse_loss(fsdp(x[rank * b:(rank + 1) * b]), y[rank * b:(rank + 1) * b]).backward()
            got = [(e.unit, e.phase) for e in fsdp.events if e.kind == "ag_post" and e.prefetch]
            if got != [("0", "fwd"), ("2", "fwd"), ("0", "bwd")]:   # the root holds no parameters
                fails.append(f"auto_wrap {policy}: prefetches {got}, want 0 and 2 in forward, 0 in backward")
        fsdp.close()
    return fails


def body_mixed(rank: int) -> list[str]:
    """param_dtype float32 (and emulated bfloat16) over float64 masters, both calling modes:
    forward computes in the low dtype (weights and outputs), the shards and the optimizer stay
    float64, and training follows float64 torch within the low precision's error."""
    n = hpcdp.get_world_size()
    fails = []
    want = reference("mlp", "adamw")
    for param_dtype, tol in (("float32", 1e-5), ("bfloat16", 5e-2)):
        for mode in ("torch", "numpy"):
            what = f"MixedPrecision({param_dtype}) {mode} on {n} ranks"
            fsdp = FSDP(mlp(), auto_wrap={torch.nn.Linear}, mixed_precision=MixedPrecision(param_dtype))
            seen: list[Any] = []
            lin = fsdp.module.torch[0]
            h = lin.register_forward_hook(lambda mod, args, out: seen.append((mod.weight.dtype, args[0].dtype,
                                                                              mod.weight.detach().clone())))
            opt = make_opt("adamw", fsdp.parameters())
            train(fsdp, opt, mode, (5,), 0, STEPS)
            h.remove()
            wdt, xdt, w = seen[-1]
            if wdt != torch.float32 or xdt != torch.float32:
                fails.append(f"{what}: forward computed with weight {wdt}, input {xdt}")
            if param_dtype == "bfloat16" and not torch.equal(w, w.to(torch.bfloat16).float()):
                fails.append(f"{what}: gathered weights are not bfloat16 values")
            if any(p.dtype != torch.float64 for p in fsdp.parameters()):
                fails.append(f"{what}: shards {[p.dtype for p in fsdp.parameters()]}, want float64")
            full = fsdp.full_state_dict()
            if rank == 0:
                fails += compare(want, full, tol, what)
                if param_dtype == "float32":   # the low precision did take effect
                    err = max(float(np.abs(full[k] - want[k]).max()) for k in want)
                    if err < 1e-12:
                        fails.append(f"{what}: identical to float64 ({err}): no float32 compute?")
            fsdp.close()
    return fails


def body_segment(rank: int, strategy: str, start: int, stop: int, load_from: str | None,
                 save_to: str | None, group: Any = None, mode: str = "torch") -> dict[str, Any]:
    """Train AdamW steps [start, stop) of the CNN under FSDP (loading model and optimizer state
    from ``load_from`` first, saving after to ``save_to``); return rank 0's full_state_dict."""
    from hpcdp.checkpoint import load, save

    g = group or hpcdp.get_default_group()
    fsdp = FSDP(cnn(), strategy=strategy, group=g, auto_wrap={torch.nn.Conv2d},
                shard_size=2 if strategy == "hybrid_shard" else None)
    opt = make_opt("adamw", fsdp.parameters())
    if load_from is not None:
        like = {"model": fsdp.state_dict(), "optim": fsdp.optim_state_dict(opt)}
        got = load(load_from, like=like, group=g)
        fsdp.load_state_dict(got["model"])
        fsdp.load_optim_state_dict(opt, got["optim"])
    train(fsdp, opt, mode, (2, 6, 6), start, stop, group=g)
    if save_to is not None:
        save(save_to, {"model": fsdp.state_dict(), "optim": fsdp.optim_state_dict(opt)}, group=g)
    full = fsdp.full_state_dict()
    fsdp.close()
    return full if g.rank == 0 else {}


def plain_torch_load(path: str) -> dict[str, np.ndarray]:
    """The checkpoint's model into a plain torch module in one process (hpcdp.checkpoint.load's
    whole arrays, no pickle), then the state a plain torch AdamW loaded from the saved optimizer
    state reaches after one more step."""
    from hpcdp.checkpoint import load

    got = load(path)
    m = cnn()
    m.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in got["model"].items()})
    names = [n for n, _ in m.named_parameters()]
    opt = make_opt("adamw", m.parameters())
    osd = got["optim"]
    opt.load_state_dict({
        "state": {names.index(k): {kk: torch.tensor(vv) if np.ndim(vv) == 0 else torch.from_numpy(np.asarray(vv))
                                   for kk, vv in st.items()} for k, st in osd["state"].items()},
        "param_groups": [{**g, "params": [names.index(n) for n in g["params"]]} for g in osd["param_groups"]]})
    saved = {k: np.array(v) for k, v in got["model"].items()}
    x, y = data((2, 6, 6))
    s = 2
    opt.zero_grad()
    torch.nn.functional.mse_loss(m(x[s * BATCH:(s + 1) * BATCH]), y[s * BATCH:(s + 1) * BATCH]).backward()
    opt.step()
    return {"saved": saved, "after": {k: v.detach().numpy().copy() for k, v in m.state_dict().items()}}


def body_mpi_checkpoint(rank: int, path: str) -> list[str]:
    """Save the CNN under full_shard on the whole MPI world after 2 steps; load on sub-groups of
    other sizes (and strategies), train one more step, compare with single-process torch."""
    n = hpcdp.world_size()
    body_segment(rank, "full_shard", 0, 2, None, path)
    want = reference("cnn", "adamw", 3)
    fails = []
    for strategy, size in (("full_shard", max(1, n - 1)), ("shard_grad_op", n), ("no_shard", 1)):
        sub = hpcdp.new_group(list(range(size)))
        if rank < size:
            full = body_segment(rank, strategy, 2, 3, path, None, group=sub, mode="numpy")
            if sub.rank == 0:
                fails += compare(want, full, 1e-10, f"saved at {n} ranks, loaded under {strategy} at {size}")
    return fails


def body_misuse(rank: int) -> list[str]:
    """Errors a torch user can meet, each naming what to do."""
    fails = []
    x, y = data()
    fsdp = FSDP(mlp(), auto_wrap={torch.nn.Linear})
    out = fsdp(x[:4])
    try:
        fsdp.backward(np.ones((4, 3)))
        fails.append("fsdp.backward after a tensor forward did not raise")
    except hpcdp.HpcdpError as e:
        if "loss.backward()" not in str(e):
            fails.append(f"fsdp.backward after a tensor forward: {e}")
    del out
    # a forward whose outputs got no backward is forgotten; the next step trains normally
    opt = make_opt("sgd", fsdp.parameters())
    with torch.no_grad():
        fsdp(x[:4])
    fsdp(x[:4])
    torch.nn.functional.mse_loss(fsdp(x[:4]), y[:4]).backward()
    if any(p.grad is None for p in fsdp.parameters() if p.numel()):
        fails.append("after an abandoned forward, loss.backward() left shards without gradients")
    opt.step()
    held = sum(p.numel() * p.element_size() for p in fsdp.parameters())
    stats = fsdp.memory_stats(opt)   # torch.optim's state is keyed by the shard tensors
    if stats["optim_state"] != held:   # SGD momentum: one buffer per shard
        fails.append(f"memory_stats counts {stats['optim_state']} bytes of optimizer state, want {held}")
    try:
        FSDP(mlp(), deterministic_chunk=2)
        fails.append("deterministic_chunk with a torch model did not raise")
    except TypeError:
        pass
    return fails


def body_saved_memory(rank: int) -> list[str]:
    """full_shard frees a unit's gathered parameters after its forward even though autograd saved
    views of them (``Linear`` saves ``weight.t()``): they are held as markers and re-made from the
    parameters gathered again for backward. shard_grad_op keeps them (the measurement's control).
    Measured with tracemalloc (numpy's allocations): one process, one rank."""
    import gc
    import tracemalloc

    fails = []
    gathered = 2 * 400 * 400 * 4   # both weights in float32 (a real gather even on one rank)
    x = torch.linspace(-1, 1, 4 * 400, dtype=torch.float64).reshape(4, 400)
    grads = {}
    for strategy in ("full_shard", "shard_grad_op"):
        m = seeded(torch.nn.Sequential(torch.nn.Linear(400, 400), torch.nn.Tanh(), torch.nn.Linear(400, 400)))
        fsdp = FSDP(m, strategy=strategy, auto_wrap={torch.nn.Linear},
                    mixed_precision=MixedPrecision("float32"))
        gc.collect()
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            out = fsdp(x)
            gc.collect()
            kept = tracemalloc.get_traced_memory()[0] - base
        finally:
            tracemalloc.stop()
        (out * out).sum().backward()
        grads[strategy] = [p.grad.numpy().copy() for p in fsdp.parameters()]
        if strategy == "full_shard" and kept > gathered // 10:
            fails.append(f"full_shard keeps {kept} bytes after forward (gathered: {gathered})")
        if strategy == "shard_grad_op" and kept < gathered:
            fails.append(f"shard_grad_op keeps {kept} bytes after forward, expected the gathered "
                         f"{gathered}: the measurement does not see gathered parameters")
        fsdp.close()
    for a, b in zip(grads["full_shard"], grads["shard_grad_op"]):   # markers re-made the same views
        if not np.array_equal(a, b):
            fails.append(f"full_shard's gradients differ from shard_grad_op's by {np.abs(a - b).max()}")
    return fails


def body_no_sync(rank: int) -> list[str]:
    """Gradient accumulation in the torch loop: half of each rank's rows under ``no_sync`` (kept
    unsharded), the other half synced; the same 5 steps as single-process torch."""
    n = hpcdp.get_world_size()
    b = BATCH // n
    x, y = data()
    fails = []
    for strategy in ("full_shard", "shard_grad_op"):
        fsdp = FSDP(mlp(), strategy=strategy, auto_wrap={torch.nn.Linear})
        opt = make_opt("sgd", fsdp.parameters())
        for s in range(STEPS):
            lo = s * BATCH + rank * b
            opt.zero_grad()
            h = b // 2   # rows of the first microbatch; each loss weighted by its share of b
            with fsdp.no_sync():
                (h / b * torch.nn.functional.mse_loss(fsdp(x[lo:lo + h]), y[lo:lo + h])).backward()
            ((b - h) / b * torch.nn.functional.mse_loss(fsdp(x[lo + h:lo + b]), y[lo + h:lo + b])).backward()
            opt.step()
        full = fsdp.full_state_dict()
        if rank == 0:
            fails += compare(reference("mlp", "sgd"), full, 1e-10, f"no_sync {strategy} on {n} ranks")
        fsdp.close()
    return fails

"""Bodies for tests/checkpoint/test_checkpoint_torch.py: a torch model under DDP saved with its
torch optimizer's state, resumed at another world size or in one process of plain torch.

Every rank builds the same model from a numpy generator (simulated ranks are threads of one
process and share torch's global generator, so ``torch.manual_seed`` would not do), trains on
its slice of a global batch that every world size divides, and compares with plain torch
trained in one process on the whole batch.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

import hpcdp
from hpcdp.checkpoint import load, load_into, state_of

BATCH = 12          # divisible by 1, 2, 3 and 4 ranks
STEPS = 5           # the uninterrupted run
SAVED_AT = 3        # the saved run stops here; the resumed one does the rest
TOL = 1e-12


def make_model() -> torch.nn.Module:
    m = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(inplace=True),
                            torch.nn.Linear(7, 3)).double()
    rng = np.random.default_rng(7)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.from_numpy(rng.standard_normal(tuple(p.shape)) * 0.5))
    return m


def make_opt(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=0.05, betas=(0.8, 0.95), weight_decay=0.01)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    raise ValueError(kind)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(1000 + step)
    return (torch.from_numpy(rng.standard_normal((BATCH, 5))),
            torch.from_numpy(rng.standard_normal((BATCH, 3))))


def train(model: Any, opt: Any, steps: range, rank: int = 0, n: int = 1) -> None:
    b = BATCH // n
    for step in steps:
        x, y = batch(step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[rank * b:(rank + 1) * b]), y[rank * b:(rank + 1) * b]).backward()
        opt.step()


def reference(kind: str, steps: int = STEPS) -> list[np.ndarray]:
    """Parameters after ``steps`` steps of plain torch in one process on the whole batch."""
    m = make_model()
    train(m, make_opt(kind, m.parameters()), range(steps))
    return [p.detach().numpy().copy() for p in m.parameters()]


def compare(got: list[np.ndarray], want: list[np.ndarray], what: str) -> list[str]:
    fails = []
    for i, (a, b) in enumerate(zip(got, want)):
        err = float(np.max(np.abs(a - b)))
        if not err <= TOL:
            fails.append(f"{what}: parameter {i} differs by {err:.3g} from the uninterrupted run")
    return fails


def body_save(rank: int, kind: str, path: str) -> list[str]:
    """DDP(torch model) + torch optimizer, SAVED_AT steps, saved with ``state_of``."""
    n = hpcdp.get_world_size()
    ddp = hpcdp.DDP(make_model())
    opt = make_opt(kind, ddp.parameters())
    train(ddp, opt, range(SAVED_AT), rank, n)
    hpcdp.checkpoint.save(path, state_of(ddp, opt, step=SAVED_AT))
    fails = compare([p.detach().numpy() for p in ddp.parameters()], reference(kind, SAVED_AT),
                    f"saved at {n} ranks")
    saved = load(path)   # the optimizer's state went out as it is, keyed by name
    names = [nm for nm, _ in ddp.named_parameters()]
    for nm, p in ddp.named_parameters():
        for key, v in opt.state[p].items():
            got = saved["optim"]["state"][nm][key]
            if np.asarray(got).dtype != v.detach().numpy().dtype or not np.array_equal(got, v.detach().numpy()):
                fails.append(f"saved state {nm}[{key!r}] is {got!r}, the optimizer holds {v!r}")
    if saved["optim"]["param_groups"][0]["params"] != names:
        fails.append(f"saved param group lists {saved['optim']['param_groups'][0]['params']}")
    return fails


def _check_loaded(opt: Any, params: list[Any], kind: str) -> list[str]:
    """The loaded torch state is torch's own layout: tensors, a 0-d float32 ``step``."""
    fails = []
    for p in params:
        st = opt.state[p]
        want = {"adamw": {"step", "exp_avg", "exp_avg_sq"}, "sgd": {"momentum_buffer"}}[kind]
        if set(st) != want:
            fails.append(f"loaded state keys {sorted(st)}, want {sorted(want)}")
        for k, v in st.items():
            if not isinstance(v, torch.Tensor):
                fails.append(f"loaded state {k!r} is a {type(v).__name__}, not a tensor")
            elif k == "step" and (v.dtype != torch.float32 or v.dim() != 0 or float(v) != SAVED_AT):
                fails.append(f"loaded step {v!r}")
            elif k != "step" and (v.dtype != p.dtype or v.shape != p.shape):
                fails.append(f"loaded {k!r}: {v.dtype} {tuple(v.shape)} for {p.dtype} {tuple(p.shape)}")
    g = opt.param_groups[0]
    if kind == "adamw" and (g["betas"] != (0.8, 0.95) or g["lr"] != 0.05 or g["weight_decay"] != 0.01
                            or g["foreach"] is not None or g["amsgrad"] is not False):
        fails.append(f"loaded param group {({k: v for k, v in g.items() if k != 'params'})}")
    return fails


def body_resume(rank: int, kind: str, path: str) -> list[str]:
    """DDP at this world size: ``load_into`` a fresh model and optimizer (other hyper-parameters,
    no state yet), then the remaining steps: where the uninterrupted run ends."""
    n = hpcdp.get_world_size()
    model = make_model()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    ddp = hpcdp.DDP(model)
    opt = make_opt(kind, ddp.parameters())
    opt.param_groups[0]["lr"] = 1.0   # the checkpoint's must win
    state = load_into(path, ddp, opt)
    fails = [] if state["step"] == SAVED_AT else [f"loaded step {state['step']!r}"]
    fails += _check_loaded(opt, list(ddp.parameters()), kind)
    train(ddp, opt, range(SAVED_AT, STEPS), rank, n)
    return fails + compare([p.detach().numpy() for p in ddp.parameters()], reference(kind),
                           f"resumed at {n} ranks")


def resume_plain(kind: str, path: str) -> list[str]:
    """One process, plain torch: the documented two-liner, then ``load_into``, then the rest."""
    fails = []
    m = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3)).double()
    state = load(path)
    m.load_state_dict({k: torch.from_numpy(v) for k, v in state["model"].items()})
    fails += compare([p.detach().numpy() for p in m.parameters()], reference(kind, SAVED_AT),
                     "two-liner load")
    m2 = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3)).double()
    opt = make_opt(kind, m2.parameters())
    load_into(path, m2, opt)
    fails += _check_loaded(opt, list(m2.parameters()), kind)
    train(m2, opt, range(SAVED_AT, STEPS))
    return fails + compare([p.detach().numpy() for p in m2.parameters()], reference(kind),
                           "resumed in one process of plain torch")


def save_plain(kind: str, path: str, steps: int = SAVED_AT) -> tuple[torch.nn.Module, Any]:
    """One process of plain torch, ``steps`` steps, saved with ``state_of`` (no hpcdp layer)."""
    m = make_model()
    opt = make_opt(kind, m.parameters())
    train(m, opt, range(steps))
    hpcdp.checkpoint.save(path, state_of(m, opt, step=steps))
    return m, opt

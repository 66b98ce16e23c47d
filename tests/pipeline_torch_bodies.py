"""Pipeline bodies for torch models (issue 23): a split ``torch.nn.Sequential`` under every schedule
against one process of plain torch on the whole batch. Module level, so sim threads, TCP processes
and mpirun ranks can all run them; each returns a list of failure strings."""
from __future__ import annotations

import functools
import multiprocessing
from typing import Any

import numpy as np
import torch

import hpcdp
import hpcdp.pipeline as pp

BATCH = 24           # a multiple of every microbatch count used (1, 2, 3, 4, 8)
IN, OUT = 5, 3
STEPS = 5
TOL = 1e-10
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("zero_bubble", 1), ("interleaved_1f1b", 2)]

if multiprocessing.parent_process() is not None:
    # a spawned rank (TCP world): the tensors are tiny and ranks share a few cores, where torch's
    # intra-op pool spins against the other ranks' (the test module does the same for its process)
    torch.set_num_threads(1)


def make_model(seed: int = 0) -> torch.nn.Sequential:
    """Nine children of several kinds (in-place ReLU, LayerNorm, Tanh), enough for 4 ranks x 2
    virtual stages; float64. Initialised from numpy's generator with ``seed``: simulated ranks are
    threads sharing torch's global generator, so ``torch.manual_seed`` would race."""
    model = torch.nn.Sequential(
        torch.nn.Linear(IN, 6), torch.nn.ReLU(inplace=True),
        torch.nn.Linear(6, 6), torch.nn.Tanh(),
        torch.nn.Linear(6, 6), torch.nn.LayerNorm(6),
        torch.nn.Linear(6, 6), torch.nn.ReLU(inplace=True),
        torch.nn.Linear(6, OUT),
    ).double()
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for t in model.parameters():
            t.copy_(torch.from_numpy(rng.uniform(-0.5, 0.5, tuple(t.shape))))
    return model


def make_loss(kind: str) -> Any:
    if kind == "mse":
        return torch.nn.functional.mse_loss
    if kind == "mse_sum":
        return torch.nn.MSELoss(reduction="sum")
    if kind == "ce_ignore":   # mean over the targets not ignored: uneven across microbatches
        return functools.partial(torch.nn.functional.cross_entropy, ignore_index=-1, label_smoothing=0.1)
    return torch.nn.CrossEntropyLoss()


def make_data(kind: str, step: int, batch: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(200 + step)
    x = torch.from_numpy(rng.normal(size=(batch, IN)))
    if kind.startswith("mse"):
        return x, torch.from_numpy(rng.normal(size=(batch, OUT)))
    y = rng.integers(0, OUT, batch)
    if kind == "ce_ignore":
        y[: batch // 3] = -1
        y[batch // 2] = -1
    return x, torch.from_numpy(y)


def make_opt(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def reference(kind: str, opt_name: str, steps: int = STEPS, batch: int = BATCH) -> list[tuple[float, dict]]:
    """Plain torch, one process, the whole batch: per step (loss, parameters after the update)."""
    model = make_model()
    opt = make_opt(opt_name, model.parameters())
    loss_fn = make_loss(kind)
    out = []
    for step in range(steps):
        x, y = make_data(kind, step, batch)
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        out.append((float(loss.detach()), {n: p.detach().clone() for n, p in model.named_parameters()}))
    return out


def _subgroup(p: int) -> Any:
    g = hpcdp.get_default_group()
    return g if p == g.size else g.new_group(list(range(p)))


def _differs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b).abs().max())


def body_torch_parity(rank: int, schedule: str, p: int, m: int, v: int, opt_name: str,
                      kind: str = "ce", steps: int = STEPS) -> list[str]:
    """``steps`` torch-optimizer steps through a ``p``-rank pipeline of a torch Sequential equal
    plain torch on the whole batch (loss and parameters within 1e-10); nothing is left stashed."""
    group = _subgroup(p)
    if not group.is_member:
        return []
    ref = reference(kind, opt_name, steps)
    stage = pp.PipelineStage(make_model(), virtual=v, group=group)
    pipe = pp.Pipeline(stage, schedule=schedule, n_microbatches=m, loss_fn=make_loss(kind))
    opt = make_opt(opt_name, stage.parameters())
    tag = f"torch {schedule} p={p} m={m} v={v} {opt_name} {kind}"
    fails = []
    if not all(isinstance(t, torch.nn.Parameter) for t in stage.parameters()):
        fails.append(f"{tag}: stage.parameters() should be torch parameters")
    for step in range(steps):
        x, y = make_data(kind, step)
        opt.zero_grad()
        loss = pipe.step(x, y)
        opt.step()
        rloss, rparams = ref[step]
        if abs(loss - rloss) > TOL * max(1.0, abs(rloss)):
            fails.append(f"{tag} step {step}: loss {loss!r} != {rloss!r}")
        for n, t in stage.named_parameters():
            d = _differs(t, rparams[n])
            if not d <= TOL:
                fails.append(f"{tag} step {step}: parameter {n} differs by {d:.3g}")
        if stage.saved_count():
            fails.append(f"{tag}: {stage.saved_count()} saved entries left after the step")
        if pipe.peak_activations != pipe.predicted_peak_activations:
            fails.append(f"{tag}: measured peak {pipe.peak_activations}, verify predicted "
                         f"{pipe.predicted_peak_activations}")
    return fails


def body_torch_cases(rank: int, cases: list[tuple]) -> list[str]:
    """``body_torch_parity`` for each case in one launch (process backends start slowly)."""
    return [f for case in cases for f in body_torch_parity(rank, *case)]


def body_torch_pp_dp(rank: int, schedule: str, pp_size: int, opt_name: str, kind: str = "ce",
                     steps: int = STEPS) -> list[str]:
    """``pp_size`` stages x (world / pp_size) replicas, each replica its part of the global batch,
    equal plain torch on the whole batch. Replica 1 starts from other weights (the pipeline
    broadcasts replica 0's)."""
    g = pp.grid(pp_size)
    dp = hpcdp.get_world_size() // pp_size
    ref = reference(kind, opt_name, steps, batch=dp * BATCH)
    stage = pp.PipelineStage(make_model(seed=0 if g.dp_rank == 0 else 7), group=g.pp_group)
    pipe = pp.Pipeline(stage, schedule=schedule, n_microbatches=4, loss_fn=make_loss(kind),
                       dp_group=g.dp_group)
    opt = make_opt(opt_name, stage.parameters())
    tag = f"torch pp x dp {schedule} pp={pp_size} dp={dp} {opt_name} {kind}"
    fails = []
    part = slice(g.dp_rank * BATCH, (g.dp_rank + 1) * BATCH)
    for step in range(steps):
        x, y = make_data(kind, step, dp * BATCH)
        opt.zero_grad()
        loss = pipe.step(x[part], y[part])
        opt.step()
        rloss, rparams = ref[step]
        if abs(loss - rloss) > TOL * max(1.0, abs(rloss)):
            fails.append(f"{tag} step {step}: loss {loss!r} != {rloss!r}")
        for n, t in stage.named_parameters():
            d = _differs(t, rparams[n])
            if not d <= TOL:
                fails.append(f"{tag} step {step}: parameter {n} differs by {d:.3g}")
    return fails


def body_torch_deferral(rank: int, split_backward: bool) -> list[str]:
    """Under zero_bubble, a split torch stage accumulates every weight gradient in a ``W`` action
    (deferred), an unsplit one in the ``I`` action; each parameter once per microbatch."""
    stage = pp.PipelineStage(make_model(), split_backward=split_backward)
    m = 4
    pipe = pp.Pipeline(stage, schedule="zero_bubble", n_microbatches=m, loss_fn=make_loss("ce"))
    seen: list[str] = []
    handles = [t.register_post_accumulate_grad_hook(lambda _t: seen.append(pipe._doing.op.value))
               for t in stage.parameters()]
    x, y = make_data("ce", 0)
    pipe.step(x, y)
    for h in handles:
        h.remove()
    want = "W" if split_backward else "I"
    n = len(list(stage.parameters()))
    fails = []
    if sorted(set(seen)) != [want] or len(seen) != m * n:
        fails.append(f"split_backward={split_backward}: gradients accumulated in actions "
                     f"{sorted(set(seen))} ({len(seen)} times), expected only {want!r} ({m * n} times)")
    return fails


def body_torch_ckpt(rank: int, path: str, saved_steps: int = 2) -> list[str]:
    """A pipeline of the whole world trains ``saved_steps`` AdamW steps and saves model and
    optimizer state with ``hpcdp.checkpoint``; then (every rank, one process's work) a plain torch
    Sequential and AdamW load it with ``checkpoint.load_into`` and train on: after STEPS steps in
    all, within 1e-10 of plain torch trained uninterrupted."""
    ref = reference("ce", "adamw", STEPS)
    stage = pp.PipelineStage(make_model())
    pipe = pp.Pipeline(stage, schedule="1f1b", n_microbatches=4, loss_fn=make_loss("ce"))
    opt = make_opt("adamw", stage.parameters())
    for step in range(saved_steps):
        x, y = make_data("ce", step)
        opt.zero_grad()
        pipe.step(x, y)
        opt.step()
    hpcdp.checkpoint.save(path, {"model": pipe.state_dict(), "optim": pipe.optim_state_dict(opt)})
    plain = make_model(seed=5)    # other weights: all must come from the file
    plain_opt = make_opt("adamw", plain.parameters())
    hpcdp.checkpoint.load_into(path, plain, plain_opt)
    fails = []
    mine = dict(stage.named_parameters())
    for n, t in plain.named_parameters():
        if n in mine and not torch.equal(t.detach(), mine[n].detach()):
            fails.append(f"loaded {n} differs from the pipeline's")
    loss_fn = make_loss("ce")
    for step in range(saved_steps, STEPS):
        x, y = make_data("ce", step)
        plain_opt.zero_grad()
        loss_fn(plain(x), y).backward()
        plain_opt.step()
    for n, t in plain.named_parameters():
        d = _differs(t, ref[-1][1][n])
        if not d <= TOL:
            fails.append(f"resumed {n} differs from the uninterrupted run by {d:.3g}")
    return fails


def body_torch_ckpt_resume(rank: int, path: str, saved_steps: int = 2) -> list[str]:
    """Resume ``body_torch_ckpt``'s checkpoint under a pipeline of this world (any split) with a
    fresh AdamW: model and optimizer state loaded by name, then the remaining steps: within 1e-10
    of plain torch trained uninterrupted."""
    ref = reference("ce", "adamw", STEPS)
    stage = pp.PipelineStage(make_model(seed=5), split_points=None)
    pipe = pp.Pipeline(stage, schedule="zero_bubble", n_microbatches=3, loss_fn=make_loss("ce"))
    opt = make_opt("adamw", stage.parameters())
    state = hpcdp.checkpoint.load(path, like={"model": pipe.state_dict()})
    pipe.load_state_dict(state["model"])
    pipe.load_optim_state_dict(opt, state["optim"])
    for step in range(saved_steps, STEPS):
        x, y = make_data("ce", step)
        opt.zero_grad()
        pipe.step(x, y)
        opt.step()
    fails = []
    for n, t in stage.named_parameters():
        d = _differs(t, ref[-1][1][n])
        if not d <= TOL:
            fails.append(f"resumed under {stage!r}: {n} differs from the uninterrupted run by {d:.3g}")
    return fails

"""Pipeline test bodies: each runs on every rank of a group and returns a list of failure strings
(module level, so sim threads, TCP processes and mpirun ranks can all run them)."""
from __future__ import annotations

import time
from typing import Any

import numpy as np

import hpcdp
import hpcdp.pipeline as pp
from hpcdp import nn, optim

F64 = np.float64
BATCH = 24          # a multiple of every microbatch count tested (1, 2, 3, 8)
IN, OUT = 5, 3
RTOL, ATOL = 1e-10, 1e-12


def make_model(seed: int = 0) -> nn.Sequential:
    """Nine layers of several kinds (each saves activations), enough for 4 ranks x 2 virtual."""
    return nn.Sequential(
        nn.Linear(IN, 6, dtype=F64, seed=seed), nn.Tanh(),
        nn.Linear(6, 6, dtype=F64, seed=seed + 1), nn.GELU(),
        nn.Linear(6, 6, dtype=F64, seed=seed + 2), nn.LayerNorm(6, dtype=F64),
        nn.Linear(6, 6, dtype=F64, seed=seed + 3), nn.Tanh(),
        nn.Linear(6, OUT, dtype=F64, seed=seed + 4),
    )


def make_loss(kind: str) -> Any:
    if kind == "mse":
        return nn.MSELoss()
    if kind == "ce_ignore":   # mean over the targets that are not ignored: uneven across microbatches
        return nn.CrossEntropyLoss(ignore_index=-1, label_smoothing=0.1)
    return nn.CrossEntropyLoss()


def make_data(kind: str, step: int, batch: int = BATCH) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + step)
    x = rng.normal(size=(batch, IN))
    if kind == "mse":
        return x, rng.normal(size=(batch, OUT))
    y = rng.integers(0, OUT, batch)
    if kind == "ce_ignore":
        y[: batch // 3] = -1          # the first microbatches lose most of their targets
        y[batch // 2] = -1
    return x, y


def reference(kind: str, steps: int, lr: float = 0.1, batch: int = BATCH,
              seed: int = 0) -> list[tuple[float, dict[str, np.ndarray], dict[str, np.ndarray]]]:
    """The unpipelined model on the whole batch: per step (loss, gradients, parameters after SGD)."""
    model, loss_fn = make_model(seed), make_loss(kind)
    opt = optim.SGD(model.parameters(), lr=lr)
    out = []
    for step in range(steps):
        x, y = make_data(kind, step, batch)
        loss = float(loss_fn(model(x), y))
        model.run_backward(loss_fn.backward())
        grads = {n: p.grad.copy() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        out.append((loss, grads, {n: p.data.copy() for n, p in model.named_parameters()}))
    return out


def _close(a: Any, b: Any) -> bool:
    return np.allclose(a, b, rtol=RTOL, atol=ATOL)


def _subgroup(p: int) -> Any:
    """The first ``p`` ranks of the default group (itself when it has ``p``); collective."""
    g = hpcdp.get_default_group()
    return g if p == g.size else g.new_group(list(range(p)))


def body_parity(rank: int, schedule: str, p: int, m: int, v: int, kind: str = "ce",
                steps: int = 2) -> list[str]:
    """Two SGD steps through the pipeline equal the unpipelined model: loss, gradients, parameters;
    the measured peak of stashed activations equals verify's; nothing is left stashed."""
    group = _subgroup(p)
    if not group.is_member:
        return []
    ref = reference(kind, steps)
    stage = pp.PipelineStage(make_model(), virtual=v, group=group)
    pipe = pp.Pipeline(stage, schedule=schedule, n_microbatches=m, loss_fn=make_loss(kind))
    opt = optim.SGD(stage.parameters(), lr=0.1)
    fails = []
    tag = f"{schedule} p={p} m={m} v={v} {kind}"
    for step in range(steps):
        x, y = make_data(kind, step)
        loss = pipe.step(x if stage.is_first else None, y if stage.is_last else None)
        rloss, rgrads, rparams = ref[step]
        if not np.isclose(loss, rloss, rtol=RTOL, atol=ATOL):
            fails.append(f"{tag} step {step}: loss {loss!r} != {rloss!r}")
        for n, prm in stage.named_parameters():
            if prm.grad is None or not _close(prm.grad, rgrads[n]):
                fails.append(f"{tag} step {step}: gradient of {n} differs")
        if pipe.peak_activations != pipe.predicted_peak_activations:
            fails.append(f"{tag}: measured peak {pipe.peak_activations} stashed activations, "
                         f"verify predicted {pipe.predicted_peak_activations}")
        if stage.saved_count():
            fails.append(f"{tag}: {stage.saved_count()} saved tensors left after the step")
        opt.step()
        opt.zero_grad()
        for n, prm in stage.named_parameters():
            if not _close(prm.data, rparams[n]):
                fails.append(f"{tag} step {step}: parameter {n} differs after the update")
    return fails


def body_parity_cases(rank: int, cases: list[tuple]) -> list[str]:
    """``body_parity`` for each case in one launch (process backends start slowly)."""
    return [f for case in cases for f in body_parity(rank, *case)]


def body_pp_dp(rank: int, schedule: str, pp_size: int = 2, steps: int = 3, v: int = 1,
               kind: str = "ce") -> list[str]:
    """``pp_size`` pipeline ranks x (world / pp_size) replicas equal one process training on the
    whole batch (each replica takes its part of it). With ``kind="ce_ignore"`` the replicas hold
    different numbers of ignored targets: the mean is still over the whole batch's."""
    g = pp.grid(pp_size)
    dp = hpcdp.world_size() // pp_size
    ref = reference(kind, steps, batch=dp * BATCH)
    # Replica 1 starts from other weights: the pipeline must broadcast replica 0's.
    stage = pp.PipelineStage(make_model(seed=0 if g.dp_rank == 0 else 7), virtual=v, group=g.pp_group)
    pipe = pp.Pipeline(stage, schedule=schedule, n_microbatches=4, loss_fn=make_loss(kind),
                       dp_group=g.dp_group)
    opt = optim.SGD(stage.parameters(), lr=0.1)
    fails = []
    for step in range(steps):
        x, y = make_data(kind, step, dp * BATCH)
        part = slice(g.dp_rank * BATCH, (g.dp_rank + 1) * BATCH)
        loss = pipe.step(x[part], y[part])
        rloss, rgrads, rparams = ref[step]
        if not np.isclose(loss, rloss, rtol=RTOL, atol=ATOL):
            fails.append(f"pp x dp {schedule} step {step}: loss {loss!r} != {rloss!r}")
        for n, prm in stage.named_parameters():
            if not _close(prm.grad, rgrads[n]):
                fails.append(f"pp x dp {schedule} step {step}: gradient of {n} differs")
        opt.step()
        opt.zero_grad()
        for n, prm in stage.named_parameters():
            if not _close(prm.data, rparams[n]):
                fails.append(f"pp x dp {schedule} step {step}: parameter {n} differs")
    return fails


# -- failures ---------------------------------------------------------------------------------------
class Boom(nn.Module):
    """The identity, until armed: then it raises in the forward or backward of one microbatch."""

    def __init__(self) -> None:
        super().__init__()
        self.armed: tuple[str, int] | None = None
        self.hang_s = 0.0

    def forward(self, x: Any) -> Any:
        if self.armed == ("forward", nn.current_microbatch()):
            raise ValueError("boom in forward")
        if self.armed == ("hang", nn.current_microbatch()):
            time.sleep(self.hang_s)   # longer than the timeout: the next stage gives up waiting
        return x

    def backward(self, g: Any) -> Any:
        if self.armed == ("backward", nn.current_microbatch()):
            raise ValueError("boom in backward")
        return g


def _boom_model() -> tuple[nn.Sequential, Boom]:
    boom = Boom()
    model = nn.Sequential(nn.Linear(IN, 6, dtype=F64, seed=1), nn.Linear(6, 6, dtype=F64, seed=2),
                          nn.Sequential(boom, nn.Linear(6, 6, dtype=F64, seed=3)),
                          nn.Linear(6, OUT, dtype=F64, seed=4))
    return model, boom


def body_stage_failure(rank: int, schedule: str, phase: str, mb: int) -> dict[str, Any]:
    """Stage 2 of 4 (or the last of fewer) raises in ``phase`` of microbatch ``mb``; every rank
    reports what it raised. Then every rank builds a new pipeline and a step succeeds."""
    g = hpcdp.get_default_group()
    model, boom = _boom_model()
    stage = pp.PipelineStage(model, split_points=[1, 2, 3][: g.size - 1] if g.size > 1 else [])
    pipe = pp.Pipeline(stage, schedule=schedule, n_microbatches=4, loss_fn=make_loss("ce"))
    x, y = make_data("ce", 0, 8)
    boom.armed = (phase, mb)
    out: dict[str, Any] = {"rank": g.rank, "boom_here": 2 in stage.modules or (
        g.size < 3 and stage.is_last)}
    try:
        pipe.step(x, y)
        out["error"] = None
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["error"] = (type(exc).__name__, str(exc), getattr(exc, "peers", None))
    out["saved_left"] = stage.saved_count()
    try:
        pipe.step(x, y)
        out["reuse"] = "no error"
    except hpcdp.HpcdpError as exc:
        out["reuse"] = str(exc)
    boom.armed = None
    stage.zero_grad()
    pipe2 = pp.Pipeline(stage, schedule=schedule, n_microbatches=4, loss_fn=make_loss("ce"))
    out["recovered_loss"] = pipe2.step(x, y)
    return out


def body_stage_hang(rank: int, timeout: float) -> dict[str, Any]:
    """Stage 2 of 4 stalls in a forward for 4 x ``timeout``: stage 3 times out waiting for it and
    every rank raises, the stalled one as soon as its forward returns."""
    model, boom = _boom_model()
    stage = pp.PipelineStage(model, split_points=[1, 2, 3])
    # the first step under a long timeout: it is not about stalls, and on a loaded machine a
    # healthy wait can take longer than ``timeout``; the stalled step under ``timeout``
    pipe = pp.Pipeline(stage, schedule="1f1b", n_microbatches=4, loss_fn=make_loss("ce"),
                       timeout=60.0)
    x, y = make_data("ce", 0, 8)
    pipe.step(x, y)
    pipe.timeout = pipe._channel.timeout = timeout
    boom.armed, boom.hang_s = ("hang", 1), 4 * timeout
    try:
        pipe.step(x, y)
        return {"rank": rank, "error": None}
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"rank": rank, "error": (type(exc).__name__, str(exc))}


def body_failure_cases(rank: int, cases: list[tuple]) -> list[dict[str, Any]]:
    """``body_stage_failure`` for each case in one launch."""
    return [body_stage_failure(rank, *case) for case in cases]


def body_mismatch_cases(rank: int, cases: list[tuple]) -> list[dict[str, Any]]:
    """``body_shape_mismatch`` for each case in one launch."""
    return [body_shape_mismatch(rank, *case) for case in cases]


def body_shape_mismatch(rank: int, schedule: str, which: str) -> dict[str, Any]:
    """A second step whose x (or y) has other microbatch shapes raises before any compute."""
    stage = pp.PipelineStage(make_model())
    pipe = pp.Pipeline(stage, schedule=schedule, n_microbatches=4, loss_fn=make_loss("ce"))
    x, y = make_data("ce", 0, 8)
    pipe.step(x, y)
    before = [p.grad.copy() for p in stage.parameters()]
    calls = []
    for mod in stage.modules.values():
        mod.register_forward_pre_hook(lambda m, args: calls.append(1))
    if which == "x":
        x = np.concatenate([x, x], axis=1)[:, : IN + 1]      # one feature too many
    else:
        y = y[:4]                                             # fewer targets than samples
    out: dict[str, Any] = {"rank": hpcdp.rank()}
    try:
        pipe.step(x, y)
        out["error"] = None
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["error"] = (type(exc).__name__, str(exc))
    out["computed"] = len(calls)
    out["grads_unchanged"] = all(np.array_equal(b, p.grad) for b, p in zip(before, stage.parameters()))
    return out


# -- checkpoints ----------------------------------------------------------------------------------
def body_ckpt_save(rank: int, path: str) -> dict[str, np.ndarray]:
    """One training step on a pipeline of every rank, then save; return this rank's parameters."""
    stage = pp.PipelineStage(make_model(seed=3))
    pipe = pp.Pipeline(stage, schedule="1f1b", n_microbatches=4, loss_fn=make_loss("ce"))
    opt = optim.SGD(stage.parameters(), lr=0.5)
    x, y = make_data("ce", 0)
    pipe.step(x, y)
    opt.step()
    hpcdp.checkpoint.save(path, {"model": pipe.state_dict(), "step": 1})
    return {n: p.data.copy() for n, p in stage.named_parameters()}


def body_ckpt_load(rank: int, path: str, expected: dict[str, np.ndarray], p: int | None = None) -> list[str]:
    """Load the checkpoint into a pipeline of ``p`` ranks (default: all); compare with ``expected``."""
    group = _subgroup(p or hpcdp.world_size())
    if not group.is_member:
        return []
    stage = pp.PipelineStage(make_model(seed=11), group=group)
    state = hpcdp.checkpoint.load(path, like={"model": stage.state_dict(), "step": 0}, group=group)
    stage.load_state_dict(state["model"])
    fails = [f"rank {rank}: {n} differs after loading" for n, prm in stage.named_parameters()
             if not np.array_equal(prm.data, expected[n])]
    if int(state["step"]) != 1:
        fails.append(f"step {state['step']!r}")
    # and it still trains: the pipeline's loss equals the plain model's with the loaded weights
    plain = make_model(seed=11)
    plain.load_state_dict(expected)
    x, y = make_data("ce", 5)
    ref = float(make_loss("ce")(plain(x), y))
    loss = pp.Pipeline(stage, schedule="zero_bubble", n_microbatches=3,
                       loss_fn=make_loss("ce")).step(x, y)
    if not np.isclose(loss, ref, rtol=RTOL):
        fails.append(f"loss after loading {loss} != {ref}")
    return fails


def body_ckpt_plain(rank: int, path: str, expected: dict[str, np.ndarray]) -> list[str]:
    """Rank 0 alone loads the checkpoint into the plain, unsplit model."""
    group = _subgroup(1)
    if not group.is_member:
        return []
    plain = make_model(seed=11)
    state = hpcdp.checkpoint.load(path, like={"model": plain.state_dict(), "step": 0}, group=group)
    plain.load_state_dict(state["model"])
    return [f"{n} differs in the plain model" for n, prm in plain.named_parameters()
            if not np.array_equal(prm.data, expected[n])]


def body_ckpt_ddp(rank: int, path: str, expected: dict[str, np.ndarray]) -> list[str]:
    """Every rank loads the pipeline's checkpoint into a DDP-wrapped plain model."""
    ddp = hpcdp.DDP(make_model(seed=11))
    state = hpcdp.checkpoint.load(path, like={"model": ddp.state_dict(), "step": 0})
    ddp.load_state_dict(state["model"])
    return [f"{n} differs under DDP" for n, prm in ddp.named_parameters()
            if not np.array_equal(prm.data, expected[n])]


def body_failure_with_an_unreachable_peer(rank: int) -> dict[str, Any]:
    """Stage 2 of 4 raises in a forward while its control message to rank 0 cannot be sent (that
    peer looks gone): rank 2 still raises its own error, ranks 1 and 3 still hear of it from rank 2
    (not by timing out), and nothing stays stashed on any rank (the loss's included)."""
    g = hpcdp.get_default_group()
    model, boom = _boom_model()
    stage = pp.PipelineStage(model, split_points=[1, 2, 3])
    loss_fn = make_loss("ce")
    pipe = pp.Pipeline(stage, schedule="gpipe", n_microbatches=4, loss_fn=loss_fn, timeout=30)
    x, y = make_data("ce", 0, 8)
    if g.rank == 2:
        comm = pipe._channel.comm
        send = comm.isend

        def isend(buf: Any, dst: int, tag: int = 0, **kw: Any) -> Any:
            if dst == 0 and tag == 0:
                raise hpcdp.PeerFailureError("isend to rank 0: connection closed", peers=[0])
            return send(buf, dst, tag, **kw)

        comm.isend = isend
        boom.armed = ("forward", 3)
    out: dict[str, Any] = {"rank": g.rank}
    try:
        pipe.step(x, y)
        out["error"] = None
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["error"] = (type(exc).__name__, str(exc))
    out["saved_left"] = stage.saved_count() + loss_fn.saved_count()
    return out


def body_traced_step(rank: int, schedule: str) -> list[str]:
    """One step with HPCDP_TRACE timelines on (simulated ranks bind their rank, as ``install`` does);
    returns this rank's compute actions in order."""
    hpcdp.trace.bind_rank(rank)
    stage = pp.PipelineStage(make_model())
    pipe = pp.Pipeline(stage, schedule=schedule, n_microbatches=2, loss_fn=make_loss("ce"))
    x, y = make_data("ce", 0, 4)
    pipe.step(x, y)
    return [str(a) for a in pipe.schedule.actions[rank] if a.is_compute]

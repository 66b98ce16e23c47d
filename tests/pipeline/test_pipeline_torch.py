"""Pipelines over torch models (issue 23): a split ``torch.nn.Sequential`` under every schedule,
trained by torch's own optimizers (SGD with momentum, AdamW) for 5 steps, equals one process of
plain torch on the whole batch within 1e-10 (sim 1-4 ranks, TCP, MPI); pipeline x data parallel;
zero-bubble's weight work really deferred (torch split backward); torch losses; checkpoints that
load into a plain torch model and optimizer."""
from __future__ import annotations

import functools
import os

import numpy as np
import pytest
import torch

import hpcdp.pipeline as pp
from conftest import run_mpi, run_ranks
from hpcdp.testing import check
from hpcdp.testing.fixtures import World, worlds
from pipeline_torch_bodies import (
    SCHEDULES, body_torch_cases, body_torch_ckpt, body_torch_ckpt_resume, body_torch_deferral,
    body_torch_pp_dp, make_data, make_model,
)

OPTS = ("sgd", "adamw")


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Ranks here are threads (or processes) sharing a few cores, and the tensors are tiny: torch's
    intra-op thread pool then spins against the other ranks' and a 50 ms case takes seconds."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _cases(p: int, m: int = 4) -> list[tuple]:
    return [(schedule, p, m, v, opt) for schedule, v in SCHEDULES for opt in OPTS]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", worlds("sim-1", "sim-2", "sim-3", "sim-4", "tcp-2", "mpi"), indirect=True)
def test_torch_parity_every_schedule(world: World) -> None:
    # p stages on p ranks; under mpirun on sub-groups of the first p ranks (p >= 2)
    for p in range(2, world.size + 1) if world.is_mpi else [world.size]:
        check(world.run(body_torch_cases, _cases(p), timeout=60))


@pytest.mark.timeout(120)
def test_torch_losses_and_microbatch_counts_sim() -> None:
    # a functional MSE, a summed MSE module, a cross-entropy partial with ignored targets (uneven
    # shares, one microbatch with none counted); 3 stages, several microbatch counts
    cases = [(schedule, 3, m, v, "adamw", kind) for kind in ("mse", "mse_sum", "ce_ignore")
             for schedule, v in SCHEDULES for m in (1, 3, 8)]
    check(run_ranks("sim", 3, body_torch_cases, cases))


@pytest.mark.timeout(120)
def test_torch_pp_dp_sim() -> None:
    for schedule in ("1f1b", "zero_bubble"):
        check(run_ranks("sim", 4, body_torch_pp_dp, schedule, 2, "adamw"))          # 2 stages x 2
    check(run_ranks("sim", 4, body_torch_pp_dp, "gpipe", 2, "sgd", "ce_ignore"))
    check(run_ranks("sim", 3, body_torch_pp_dp, "zero_bubble", 1, "sgd"))           # 1 stage x 3


# Not a world of the test above: its layouts follow the MPI world's size (size // 2 stages).
@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
def test_torch_pp_dp_mpi(mpi_world) -> None:
    for schedule in ("1f1b", "zero_bubble"):
        check(run_mpi(body_torch_pp_dp, schedule, mpi_world.size // 2, "adamw"))
    check(run_mpi(body_torch_pp_dp, "gpipe", mpi_world.size // 2, "sgd", "ce_ignore"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", worlds("sim-2", "mpi"), indirect=True)
def test_zero_bubble_defers_torch_weight_gradients(world: World) -> None:
    check(world.run(body_torch_deferral, True))
    check(world.run(body_torch_deferral, False))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", worlds("sim-2", "mpi"), indirect=True)
def test_torch_checkpoint_loads_into_plain_torch(world: World, shared_tmp_path: str) -> None:
    # saved by a pipeline of the world, resumed by plain torch (every rank), then by pipelines
    # of this world and (spawned worlds) of 4 and 1 ranks: each equals an uninterrupted run
    path = os.path.join(shared_tmp_path, "ck", "step-2")
    check(world.run(body_torch_ckpt, path))
    check(world.run(body_torch_ckpt_resume, path))
    if not world.is_mpi:
        check(run_ranks("sim", 4, body_torch_ckpt_resume, path))
        check(run_ranks("sim", 1, body_torch_ckpt_resume, path))


def test_torch_loss_reads_reduction_and_ignore_index() -> None:
    F = torch.nn.functional
    for fn, want in [(torch.nn.CrossEntropyLoss(), ("mean", -100)),
                     (torch.nn.CrossEntropyLoss(reduction="sum", ignore_index=3), ("sum", 3)),
                     (F.cross_entropy, ("mean", -100)),
                     (functools.partial(F.nll_loss, reduction="sum", ignore_index=-1), ("sum", -1)),
                     (F.mse_loss, ("mean", None)),
                     (torch.nn.MSELoss(reduction="sum"), ("sum", None)),
                     (lambda o, t: ((o - t) ** 2).sum(), ("mean", None))]:
        loss = pp.TorchLoss(fn)
        assert (loss.reduction, loss.ignore_index) == want, fn
    assert pp.TorchLoss(lambda o, t: ((o - t) ** 2).sum(), reduction="sum").reduction == "sum"
    # the gradient is scale * dloss/doutput, a numpy array over the output's shape
    out, tgt = np.arange(6.0).reshape(2, 3), np.ones((2, 3))
    loss = pp.TorchLoss(F.mse_loss)
    assert loss(out, tgt) == pytest.approx(np.mean((out - tgt) ** 2))
    np.testing.assert_allclose(loss.backward(0.5), 0.5 * 2 * (out - tgt) / out.size, rtol=1e-15)
    with pytest.raises(RuntimeError, match="without a preceding"):
        loss.backward()
    with pytest.raises(ValueError, match="reduction"):
        pp.TorchLoss(torch.nn.MSELoss(reduction="none"))
    with pytest.raises(ValueError, match="class-weighted"):
        pp.TorchLoss(torch.nn.CrossEntropyLoss(weight=torch.ones(3, dtype=torch.float64)))
    with pytest.raises(TypeError, match="one value"):
        pp.TorchLoss(functools.partial(F.mse_loss, reduction="none"), reduction="mean")(out, tgt)


def _body_torch_errors(rank: int) -> list[str]:
    fails = []

    def expect(exc: type, text: str, fn: object) -> None:
        try:
            fn()   # type: ignore[operator]
        except exc as e:
            if text not in str(e):
                fails.append(f"{exc.__name__} without {text!r}: {e}")
        else:
            fails.append(f"no {exc.__name__} ({text})")

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(2, 2)

    expect(TypeError, "torch.nn.Sequential", lambda: pp.PipelineStage(Net()))
    seq = torch.nn.Sequential(torch.nn.Linear(2, 2))
    seq.register_parameter("scale", torch.nn.Parameter(torch.ones(1)))
    expect(ValueError, "parameters or buffers of its own", lambda: pp.PipelineStage(seq))
    tied = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    tied[1].weight = tied[0].weight
    expect(ValueError, "shared by stages", lambda: pp.PipelineStage(tied))
    stage = pp.PipelineStage(make_model())
    expect(TypeError, "torch loss", lambda: pp.Pipeline(stage, n_microbatches=2, loss_fn=object()))
    expect(ValueError, "reduction", lambda: pp.Pipeline(stage, n_microbatches=2, loss_fn=functools.partial(
        torch.nn.functional.cross_entropy, reduction="none")))
    pipe = pp.Pipeline(stage, n_microbatches=2, loss_fn=lambda out, target:
                       torch.nn.functional.cross_entropy(out, target, reduction="none"))
    x, y = make_data("ce", 0)
    # the last stage's loss returns a vector: it raises; its peer learns of it and gives up too
    expect(TypeError if stage.is_last else Exception, "one value", lambda: pipe.step(x, y))
    return fails


def test_torch_stage_and_loss_errors_sim() -> None:
    check(run_ranks("sim", 2, _body_torch_errors))

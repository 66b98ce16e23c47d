"""DDP over torch models (``hpcdp.DDP(torch_module)``): float64 parity with single-process torch
after 5 steps of torch's own optimizers, in both calling modes (``loss.backward()`` and hpcdp's
``ddp.backward(grad)``), on simulated ranks 1-4, TCP and MPI; gradients averaged when
``loss.backward()`` returns; unused parameters; a half-finished backward named; comm hooks; the
adapter's split backward."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hpcdp.testing import check, run_ranks, spawn_backends
from hpcdp.testing.fixtures import World, worlds
from ddp_torch_bodies import (
    body_averaged_when_backward_returns, body_comm_hook, body_forward_without_backward,
    body_backward_raises, body_parity_cases, body_partial_backward, body_skipped_bucket, body_split_backward,
    body_unused,
)
from hpcdp.trace._analyze import analyze

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)

PARITY = [  # (model, optimizer, mode, bucket cap MiB, accumulation steps with no_sync)
    ("mlp", "sgd", "torch", 25.0, 1),
    ("mlp", "adamw", "torch", 200 / 2**20, 1),
    ("cnn", "adamw", "torch", 25.0, 2),
    ("cnn", "sgd", "numpy", 200 / 2**20, 1),
    ("tied", "adamw", "numpy", 25.0, 2),
    ("tied", "sgd", "torch", 200 / 2**20, 1),
]


@pytest.mark.parametrize("world", worlds("sim-1", "sim-2", "sim-3", "sim-4", "tcp-2", "mpi"), indirect=True)
def test_parity(world: World) -> None:
    check(world.run(body_parity_cases, PARITY, timeout=60))


@pytest.mark.parametrize("world", worlds("sim-2", "tcp-3", "mpi"), indirect=True)
def test_averaged_when_backward_returns(world: World) -> None:
    check(world.run(body_averaged_when_backward_returns))


@pytest.mark.parametrize("find_unused", [True, False])
@pytest.mark.parametrize("world", worlds("sim-2", "mpi"), indirect=True)
def test_unused_parameters(world: World, find_unused: bool) -> None:
    check(world.run(body_unused, find_unused))


@pytest.mark.parametrize("world", worlds("sim-2", "mpi"), indirect=True)
def test_half_finished_backward_is_named(world: World) -> None:
    check(world.run(body_partial_backward))


@pytest.mark.parametrize("world", worlds("sim-2", "mpi"), indirect=True)
def test_forward_without_backward_is_forgotten(world: World) -> None:
    check(world.run(body_forward_without_backward))


@pytest.mark.parametrize("world", worlds("sim-3", "mpi"), indirect=True)
def test_comm_hook(world: World) -> None:
    check(world.run(body_comm_hook))


def test_split_backward_matches_fused() -> None:
    check(run_ranks("sim", 1, body_split_backward))


@pytest.mark.parametrize("world", worlds("sim-2", "mpi"), indirect=True)
def test_skipped_bucket_raises_everywhere(world: World) -> None:
    check(world.run(body_skipped_bucket, timeout=10, mpi_timeout=20))


_SKIPPING_JOB = """
import sys
sys.path.insert(0, {tests!r})
import torch.nn.functional as F
import hpcdp
from ddp_torch_bodies import data, make, skipping_hook

def body(rank):
    ddp = hpcdp.DDP(make("mlp"), bucket_cap_mb=300 / 2**20)
    step = [0]
    ddp.register_comm_hook(None, skipping_hook(rank, 1, 2, step))
    x, y = data("mlp", n=4)
    for step[0] in range(4):
        F.cross_entropy(ddp(x), y).backward()   # LINE-BACKWARD

if __name__ == "__main__":
    hpcdp.spawn(body, 2, backend="tcp", timeout=10, join_timeout=90)
"""


@pytest.mark.timeout(180)
def test_skipped_bucket_is_named_by_analyze(tmp_path) -> None:
    """A real 2-process TCP job of a torch model under DDP, where rank 1 leaves out one bucket's
    allreduce: both ranks raise, and ``hpcdp.trace analyze`` names the first divergent allreduce
    at the user's ``loss.backward()`` line (not a line inside torch's autograd engine)."""
    script = tmp_path / "job.py"
    script.write_text(_SKIPPING_JOB.format(tests=TESTS))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               HPCDP_TRACE_DIR=str(tmp_path / "trace"))
    for k in ("HPCDP_BACKEND", "RANK", "WORLD_SIZE", "HPCDP_MASTER_ADDR", "MASTER_ADDR", "HPCDP_TRACE"):
        env.pop(k, None)
    job = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=150,
                         env=env, stdin=subprocess.DEVNULL, cwd=tmp_path)
    assert job.returncode != 0 and "CollectiveMismatchError" in job.stderr, job.stdout + job.stderr
    for r in (0, 1):
        doc = json.loads((tmp_path / "trace" / f"flight-rank{r}.json").read_text())
        assert "uncaught CollectiveMismatchError" in doc["reason"], doc["reason"]
    text = analyze(str(tmp_path / "trace"))
    line = next(i for i, t in enumerate(_SKIPPING_JOB.split("\n"), 1) if "LINE-BACKWARD" in t)
    lines = text.splitlines()
    assert lines[0].startswith("First divergence: allreduce #") and "on group world" in lines[0], text
    assert lines[1].startswith("Reached by rank 0 (failed) at") and lines[1].endswith(f"job.py:{line} (body)"), text
    assert any(ln.startswith("  rank 1: called allreduce #") and ln.endswith(f"job.py:{line} (body)")
               for ln in lines), text


@pytest.mark.parametrize("world", worlds("sim-2", "mpi"), indirect=True)
def test_backward_that_raises_leaves_nothing_stuck(world: World) -> None:
    check(world.run(body_backward_raises, "ddp"))


@pytest.mark.parametrize("find_unused", [True, False])
@pytest.mark.parametrize("world", worlds("sim-2", "mpi"), indirect=True)
def test_graph_that_changes_between_steps(world: World, find_unused: bool) -> None:
    from ddp_torch_bodies import body_dynamic_graph
    check(world.run(body_dynamic_graph, find_unused))

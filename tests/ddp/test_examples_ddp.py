"""examples/02_ddp_train.py as tests: accuracy on 4 simulated ranks, under mpirun, and exact resume."""
from __future__ import annotations

import copy
import os
import runpy
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

import hpcdp
from hpcdp.testing import run_ranks
from hpcdp.testing.fixtures import World, worlds

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "02_ddp_train.py")


def _main() -> Any:
    return runpy.run_path(EXAMPLE, run_name="example")["main"]


def body_train(rank: int, argv: list[str]) -> float:
    return _main()(argv)["test_accuracy"]


@pytest.mark.parametrize("world", worlds("sim-4", "mpi"), indirect=True)
def test_02_ddp_train(world: World) -> None:
    accs = world.run(body_train, ["--no-progress"], timeout=60)
    assert len(set(accs)) == 1, accs          # every rank holds the same model
    assert accs[0] >= 0.95, accs


def test_02_ddp_train_plain_python() -> None:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI", "PMIX", "SLURM", "HPCDP_", "MASTER_"))}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, EXAMPLE, "--epochs", "6", "--check"], capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert "test accuracy: 0.9" in out.stdout and "1 rank(s)" in out.stdout


class MemoryCheckpoints:
    """Stand-in for hpcdp.checkpoint with the same three calls, shared by the simulated ranks."""

    def __init__(self) -> None:
        self.store: dict[str, Any] = {}
        self.order: list[str] = []

    def save(self, path: str, state: dict[str, Any]) -> None:
        if hpcdp.rank() == 0:
            self.store[path] = copy.deepcopy(state)
            self.order.append(path)
        hpcdp.barrier()

    def load(self, path: str, like: Any = None) -> dict[str, Any]:
        return copy.deepcopy(self.store[path])

    def latest(self, directory: str) -> str | None:
        mine = [p for p in self.order if p.startswith(directory)]
        return mine[-1] if mine else None


def body_resume(rank: int, ckpt: MemoryCheckpoints, argv: list[str]) -> dict[str, Any]:
    out = _main()(argv, checkpoint=ckpt)
    return {k: out[k] for k in ("params", "step", "start_step", "steps_run", "resumed_from")}


@pytest.mark.parametrize("stop_after", [5, 8])   # mid-epoch, and exactly at the end of epoch 0 (8 batches)
def test_02_resume_is_bit_identical(stop_after: int) -> None:
    base = ["--no-progress", "--epochs", "2", "--batch-size", "60", "--ckpt-dir", "ck",
            "--save-every", "1"]
    whole = run_ranks("sim", 3, body_resume, MemoryCheckpoints(), base)[0]
    total = whole["step"]
    assert (whole["start_step"], whole["steps_run"]) == (0, total)
    ckpt = MemoryCheckpoints()
    run_ranks("sim", 3, body_resume, ckpt, base + ["--max-steps", str(stop_after)])
    assert ckpt.latest("ck") == f"ck/step-{stop_after}"
    resumed = run_ranks("sim", 3, body_resume, ckpt, base + ["--resume"])
    for r, out in enumerate(resumed):   # --resume really started from the saved step
        assert out["resumed_from"] == f"ck/step-{stop_after}", (r, out["resumed_from"])
        assert (out["start_step"], out["steps_run"], out["step"]) == (stop_after, total - stop_after, total), \
            (r, out["start_step"], out["steps_run"], out["step"])
    for k in whole["params"]:
        assert np.array_equal(whole["params"][k], resumed[0]["params"][k]), k

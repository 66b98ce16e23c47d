"""The numbered examples run as tests: on simulated ranks, as a plain script, and under mpirun."""
from __future__ import annotations

import os
import runpy
import subprocess
import sys

import pytest

from hpcdp.testing.fixtures import World, worlds

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")


def _load(name: str) -> dict:
    return runpy.run_path(os.path.join(EXAMPLES, name), run_name="example")


def body_example_01(rank: int) -> bool:
    return all(_load("01_collectives.py")["main"]().values())


@pytest.mark.parametrize("world", worlds("sim-1", "sim-2", "sim-3", "sim-4", "mpi"), indirect=True)
def test_01_collectives(world: World) -> None:
    assert all(world.run(body_example_01))


def test_01_collectives_plain_python() -> None:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI", "PMIX", "SLURM", "HPCDP_", "MASTER_"))}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, os.path.join(EXAMPLES, "01_collectives.py")],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert "all correct" in out.stdout and "1 sim rank" in out.stdout


def test_info_command() -> None:
    out = subprocess.run([sys.executable, "-m", "hpcdp", "info"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    for key in ("hpcdp", "numpy", "mpi4py", "MPI library", "MPI CUDA-aware", "h5py MPI support",
                "backends"):
        assert key in out.stdout

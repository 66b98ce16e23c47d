"""examples/07_task_farm.py counts the same points as a serial numpy loop written here: on
simulated ranks, ``hpcdp-run -n 4`` (TCP), one plain process, and the MPI world under mpirun."""
from __future__ import annotations

import os
import re
import runpy
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from conftest import run_mpi, run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "07_task_farm.py")
ARGS = ["--tasks", "24", "--samples", "20000", "--seed", "7"]
_module: dict[str, Any] = {}


def _serial_hits(tasks: int = 24, samples: int = 20000, seed: int = 7) -> int:
    """The example's sum, one task after another in this process (seeds ``[seed, task]``)."""
    total = 0
    for t in range(tasks):
        x, y = np.random.default_rng([seed, t]).random((samples, 2)).T
        total += int(np.count_nonzero(x * x + y * y < 1.0))
    return total


def _main() -> Any:
    """The example's ``main``, from one execution of the file per process (its registered
    function is then the same object on every simulated rank)."""
    if not _module:
        _module.update(runpy.run_path(EXAMPLE, run_name="example07"))
    return _module["main"]


def body_farm(rank: int, main: Any, argv: list[str]) -> dict[str, Any]:
    return main(argv)


def _check_root(out: list[dict[str, Any]], workers: int) -> None:
    assert out[0]["hits"] == _serial_hits(), out[0]
    assert out[0]["workers"] == workers and abs(out[0]["pi"] - np.pi) < 0.05, out[0]
    assert all(o == {} for o in out[1:]), out  # the other ranks served


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI", "PMIX", "SLURM", "HPCDP_", "MASTER_"))}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _printed_hits(stdout: str, workers: int) -> int:
    m = re.search(r"pi ~ 3\.1\d+  \((\d+) of 480000 points inside; 24 tasks on (\d) worker",
                  stdout)
    assert m and int(m.group(2)) == workers, stdout
    return int(m.group(1))


@pytest.mark.timeout(120)
def test_07_task_farm_sim_4_ranks() -> None:
    _check_root(run_ranks("sim", 4, body_farm, _main(), ARGS, timeout=60, join_timeout=100), 3)


@pytest.mark.timeout(120)
def test_07_task_farm_hpcdp_run_4() -> None:
    out = subprocess.run([sys.executable, "-m", "hpcdp.run", "-n", "4", EXAMPLE, *ARGS, "--check"],
                         capture_output=True, text=True, timeout=100, env=_env())
    assert out.returncode == 0, out.stdout + out.stderr
    assert _printed_hits(out.stdout, 3) == _serial_hits(), out.stdout
    assert "(same)" in out.stdout, out.stdout


@pytest.mark.timeout(120)
def test_07_task_farm_one_process() -> None:
    out = subprocess.run([sys.executable, EXAMPLE, *ARGS],
                         capture_output=True, text=True, timeout=100, env=_env())
    assert out.returncode == 0, out.stdout + out.stderr
    assert _printed_hits(out.stdout, 1) == _serial_hits(), out.stdout


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_07_task_farm_mpi(mpi_world) -> None:
    _check_root(run_mpi(body_farm, _main(), ARGS), mpi_world.size - 1)

"""examples/05_parameter_server.py reaches its accuracy: simulated ranks, ``hpcdp-run -n 4``
(TCP), one plain process, and the MPI world under mpirun."""
from __future__ import annotations

import os
import runpy
import subprocess
import sys
from typing import Any

import pytest

from conftest import run_mpi, run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "05_parameter_server.py")
_module: dict[str, Any] = {}


def _main() -> Any:
    """The example's ``main``, from one execution of the file per process (its registered
    classes and functions are then the same objects on every simulated rank)."""
    if not _module:
        _module.update(runpy.run_path(EXAMPLE, run_name="example05"))
    return _module["main"]


def body_train(rank: int, main: Any, argv: list[str]) -> float:
    return main(argv)["test_accuracy"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI", "PMIX", "SLURM", "HPCDP_", "MASTER_"))}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.mark.timeout(300)
def test_05_parameter_server_sim_4_ranks() -> None:
    accs = run_ranks("sim", 4, body_train, _main(), ["--epochs", "6"], timeout=120,
                     join_timeout=280)
    assert accs[0] >= 0.95 and all(a == accs[0] for a in accs), accs


@pytest.mark.timeout(300)
def test_05_parameter_server_hpcdp_run_4() -> None:
    out = subprocess.run([sys.executable, "-m", "hpcdp.run", "-n", "4", EXAMPLE, "--check"],
                         capture_output=True, text=True, timeout=280, env=_env())
    assert out.returncode == 0, out.stdout + out.stderr
    assert "[rank 0] test accuracy: 0.9" in out.stdout and "3 trainer(s)" in out.stdout, out.stdout


@pytest.mark.timeout(300)
def test_05_parameter_server_one_process() -> None:
    out = subprocess.run([sys.executable, EXAMPLE, "--epochs", "4", "--check"],
                         capture_output=True, text=True, timeout=280, env=_env())
    assert out.returncode == 0, out.stdout + out.stderr
    assert "test accuracy: 0.9" in out.stdout and "1 trainer(s)" in out.stdout, out.stdout


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
def test_05_parameter_server_mpi(mpi_world) -> None:
    accs = run_mpi(body_train, _main(), [])
    assert accs[0] >= 0.95 and all(a == accs[0] for a in accs), accs

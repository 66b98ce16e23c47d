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


# -- 08_heat2d: cartesian grid, halo exchange, checkpoint and restart on another rank count -----
def body_heat2d(rank: int, argv: list[str]) -> dict:
    return _load("08_heat2d.py")["main"](argv)


@pytest.mark.parametrize("world", worlds("sim-1", "sim-3", "sim-4", "tcp-3", "mpi"), indirect=True)
def test_08_heat2d_matches_serial_numpy(world: World) -> None:
    """Every rank's blocks, gathered, equal the serial run bit for bit (3 ranks: a 3x1 grid with
    uneven blocks; 4: 2x2, so every rank has PROC_NULL on two sides and real neighbours on two)."""
    out = world.run(body_heat2d, ["--check", "--steps", "40", "--ny", "23", "--nx", "31"])
    assert all(o["matches_serial"] and o["steps"] == 40 for o in out), out
    assert len({o["heat"] for o in out}) == 1, out


def test_08_heat2d_restarts_on_another_rank_count(tmp_path) -> None:
    """Saved by 4 simulated ranks (2x2 blocks) at steps 30 and 60, continued by 3 TCP ranks
    (3x1 blocks) from step 60 to 100: equal to 100 serial steps, bit for bit."""
    from conftest import run_ranks

    ckpt = str(tmp_path / "heat")
    first = run_ranks("sim", 4, body_heat2d, ["--steps", "60", "--save-every", "30",
                                               "--ckpt-dir", ckpt], timeout=120)
    assert first[0]["resumed_from"] is None and first[0]["dims"] == [2, 2], first
    assert sorted(os.listdir(ckpt)) == ["step-30", "step-60"]
    second = run_ranks("tcp", 3, body_heat2d, ["--steps", "100", "--check", "--ckpt-dir", ckpt],
                       timeout=120)
    for o in second:
        assert o["resumed_from"] == 60 and o["dims"] == [3, 1] and o["matches_serial"], second


def test_08_heat2d_plain_python() -> None:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI", "PMIX", "SLURM", "HPCDP_", "MASTER_"))}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, os.path.join(EXAMPLES, "08_heat2d.py"), "--check",
                          "--steps", "20"], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert "heat2d: 20 steps on a 1x1 grid of 1 rank(s)" in out.stdout, out.stdout
    assert "matches serial numpy: True" in out.stdout, out.stdout


# -- 07_torch_cnn: a torch CNN under hpcdp.DDP and FSDP, torch's own optimizer and loss.backward()
def body_torch_cnn(rank: int, argv: list[str]) -> dict:
    return _load("07_torch_cnn.py")["main"](argv)


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
@pytest.mark.parametrize("world", worlds("sim-2", "mpi"), indirect=True)
def test_07_torch_cnn_learns(world: World, parallel: str) -> None:
    out = world.run(body_torch_cnn, ["--epochs", "3", "--no-progress", "--parallel", parallel],
                    timeout=120)
    accs = {o["test_accuracy"] for o in out}
    assert len(accs) == 1, f"ranks disagree: {accs}"   # every rank evaluates the same model
    assert accs.pop() >= 0.9

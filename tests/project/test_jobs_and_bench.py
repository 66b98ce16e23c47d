"""The SLURM scripts parse and follow the house rules; the benchmarks run end to end.

Benchmarks are run on tiny sizes here only to prove they work and report finite figures: timing
assertions do not belong in tests (the figures themselves come from ``make bench``).
"""
from __future__ import annotations

import glob
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOBS = sorted(glob.glob(os.path.join(ROOT, "jobs", "*.sbatch")))


def test_there_are_job_scripts() -> None:
    assert JOBS, "jobs/ has no SLURM scripts"


@pytest.mark.parametrize("path", JOBS, ids=os.path.basename)
def test_job_script_is_valid_bash_with_slurm_header(path: str) -> None:
    text = open(path).read()
    assert text.startswith("#!"), "no shebang"
    assert subprocess.run(["bash", "-n", path], capture_output=True).returncode == 0
    lines = text.splitlines()
    first_cmd = next(i for i, l in enumerate(lines) if l.strip() and not l.startswith("#"))
    assert any(l.startswith("#SBATCH --") for l in lines[:first_cmd]), "#SBATCH header after commands"
    assert "set -euo pipefail" in text
    assert text.index("python -m hpcdp info") < text.index("srun "), "info is not logged first"
    assert "python -m hpcdp.run" in text, "ranks must run under hpcdp.run (abort on error)"


def _mpirun_env() -> dict[str, str]:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("HPCDP_BACKEND", "HPCDP_DEBUG"):
        env.pop(k, None)
    return env


def _json_lines(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_collectives_benchmark_smoke(tmp_path) -> None:
    out = tmp_path / "bench.jsonl"
    proc = subprocess.run(
        ["mpirun", "-n", "2", "--oversubscribe", sys.executable, "-m", "hpcdp.bench",
         "collectives", "--max-size", "4096", "--trials", "1", "--min-time", "0.001",
         "--json", str(out)],
        capture_output=True, text=True, timeout=240, env=_mpirun_env(), stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "# allreduce: bandwidth" in proc.stdout and "# Avg bus bandwidth" in proc.stdout
    rows = _json_lines(str(out))
    sizes = {r["size"] for r in rows if r.get("op") == "allreduce" and "busbw_gbs" in r}
    assert {8, 1024, 2048} <= sizes, sizes
    summary = {r["name"].split()[0]: r["value"] for r in rows if r.get("bench") == "summary"}
    for key in ("A2", "A5"):
        assert math.isfinite(summary[key]), summary


def test_sim_benchmark_smoke(tmp_path) -> None:
    out = tmp_path / "sim.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "hpcdp.bench", "collectives", "--backend", "sim", "--ranks", "2",
         "--min-size", "1024", "--max-size", "4096", "--trials", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=240, env=_mpirun_env(), stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _json_lines(str(out)), proc.stdout

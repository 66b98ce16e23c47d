"""Smoke test of ``mpirun -n 2 python -m hpcdp.bench checkpoint`` on a tiny state: ``--only``
runs one part, ``--breakdown`` prints where a load spends its time. Timings are never asserted
(the machine is shared and noisy)."""
from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*(?:e[-+]?\d+)?|nan|inf)", re.IGNORECASE)
PARTS = ("raw Read_at_all", "load(out=) total", "open", "manifest", "survey", "walk", "close",
         "bulk", "agree", "other")


def _bench(tmp_path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("HPCDP_BACKEND", "HPCDP_DEBUG", "HPCDP_TIMEOUT", "HPCDP_TRACE"):
        env.pop(k, None)
    cmd = ["mpirun", "-n", "2", "--oversubscribe", sys.executable, "-m", "hpcdp.bench", "checkpoint",
           "--total", str(4 << 20), "--trials", "1", "--dir", str(tmp_path / "b"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env,
                          stdin=subprocess.DEVNULL, cwd=str(tmp_path))


def _mpi_h5py() -> bool:
    try:
        import h5py
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return bool(h5py.get_config().mpi) and shutil.which("mpirun") is not None


@pytest.mark.timeout(300)
@pytest.mark.skipif(not _mpi_h5py(), reason="needs mpirun, mpi4py and MPI-enabled h5py")
def test_bench_load_only_with_breakdown(tmp_path) -> None:
    proc = _bench(tmp_path, "--only", "load", "--breakdown")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert not [ln for ln in lines if "G1" in ln], proc.stdout  # --only load: no save figure
    assert [ln for ln in lines if ln.startswith("# G2 page cache: median bandwidth ratio")], proc.stdout
    rows = {}
    for ln in lines:
        for part in PARTS:
            if ln.startswith(f"#   {part} ") or ln.startswith(f"#   {part}  "):
                rows[part] = [float(x) for x in NUMBER.findall(ln[len(f"#   {part}"):])]
    assert set(rows) == set(PARTS), proc.stdout
    for part, values in rows.items():  # one figure per rank, each a time in ms
        assert len(values) == 2, (part, values)
        if part != "other":
            assert all(math.isfinite(v) and v >= 0 for v in values), (part, values)
    assert not os.path.exists(tmp_path / "b"), "the benchmark removes its files"


@pytest.mark.timeout(300)
@pytest.mark.skipif(not _mpi_h5py(), reason="needs mpirun, mpi4py and MPI-enabled h5py")
def test_bench_save_only(tmp_path) -> None:
    proc = _bench(tmp_path, "--only", "save")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert [ln for ln in lines if ln.startswith("# G1: median bandwidth ratio")], proc.stdout
    assert not [ln for ln in lines if "G2" in ln], proc.stdout

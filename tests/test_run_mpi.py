"""``mpirun ... python -m hpcdp.run script.py`` aborts the whole job when one rank fails.

These launch mpirun as a subprocess with a hard wall-clock cap and check the exit code, so a
regression shows as a failure, never as a hung CI job.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs Open MPI's mpirun")


def _mpirun(tmp_path, body: str, n: int = 2, cap: float = 60.0) -> tuple[int, str, float]:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(body))
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("HPCDP_BACKEND", None)
    t0 = time.monotonic()
    proc = subprocess.run(
        ["mpirun", "-n", str(n), "--oversubscribe", sys.executable, "-m", "hpcdp.run", str(script)],
        capture_output=True, text=True, timeout=cap, env=env, stdin=subprocess.DEVNULL)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - t0


def test_raising_rank_aborts_job(tmp_path) -> None:
    code, out, elapsed = _mpirun(tmp_path, """
        import numpy as np, hpcdp
        hpcdp.init()
        if hpcdp.rank() == 1:
            raise RuntimeError("rank one gives up")
        hpcdp.allreduce(np.ones(3))   # rank 0 would wait here for 30 minutes without the abort
    """)
    assert code != 0, out
    assert "[rank 1]" in out and "rank one gives up" in out, out
    assert elapsed < 30, f"abort took {elapsed:.1f} s"


def test_timeout_aborts_job(tmp_path) -> None:
    code, out, elapsed = _mpirun(tmp_path, """
        import time, numpy as np, hpcdp
        hpcdp.init(timeout=2)
        if hpcdp.rank() == 1:
            time.sleep(120)           # a stuck rank
        hpcdp.allreduce(np.ones(3))
    """)
    assert code != 0, out
    assert "CommTimeoutError" in out and "allreduce #1" in out and "timed out after 2 s" in out, out
    assert elapsed < 40, f"timeout + abort took {elapsed:.1f} s"


def test_clean_job_exits_zero(tmp_path) -> None:
    code, out, _ = _mpirun(tmp_path, """
        import sys, numpy as np, hpcdp
        hpcdp.init()
        assert hpcdp.allreduce(np.ones(2))[0] == hpcdp.world_size()
        # one write per line: mpirun forwards each rank's pipe as it comes, so print()'s
        # separate writes of "done", " ", ... from two ranks can interleave mid-line
        sys.stdout.write(f"done {hpcdp.rank()} {sys.argv[1:]}\\n"); sys.stdout.flush()
    """)
    assert code == 0, out
    assert "done 0" in out and "done 1" in out

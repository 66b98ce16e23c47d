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

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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
        # init's own agreement check runs under a long timeout (a loaded machine can start
        # the ranks seconds apart); the allreduce under 1 s
        hpcdp.init(timeout=60).timeout = 1
        if hpcdp.rank() == 1:
            time.sleep(120)           # a stuck rank
        hpcdp.allreduce(np.ones(3))
    """)
    assert code != 0, out
    assert "CommTimeoutError" in out and "allreduce #1" in out and "timed out after 1 s" in out, out
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


# -- tests/run_mpi.py itself: a run that tests nothing must not pass ----------------------------
RUN_MPI = os.path.join(ROOT, "tests", "run_mpi.py")
_NOT_MPI = """
def test_plain():
    assert True
"""
_THREE_MPI = """
import pytest

@pytest.mark.mpi
@pytest.mark.parametrize("i", range(3))
def test_mpi(i):
    assert i >= 0

@pytest.mark.mpi(min_size=64)
def test_needs_a_big_world():
    assert False, "must be skipped, never run"
"""


def _fake_repo(tmp_path, files: dict[str, str]):
    """A copy of run_mpi.py in ``tmp_path/tests`` beside ``files``: its default selection is then
    ``tmp_path/tests``, whose contents the test chooses."""
    tests = tmp_path / "tests"
    tests.mkdir()
    shutil.copy(RUN_MPI, tests / "run_mpi.py")
    for name, text in files.items():
        (tests / name).write_text(textwrap.dedent(text))
    return tests


def _run_mpi_py(tests, *args: str, n: int = 0, cap: float = 120.0) -> tuple[int, str]:
    """``tests/run_mpi.py args`` in its fake repo: one process (``n=0``) or under mpirun -n."""
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PY_COLORS="0")
    for k in ("HPCDP_BACKEND", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK",
              "PMI_SIZE", "PMIX_RANK", "SLURM_PROCID", "SLURM_NTASKS", "PYTEST_ADDOPTS"):
        env.pop(k, None)
    cmd = [sys.executable, str(tests / "run_mpi.py"), *args]
    if n:
        cmd = ["mpirun", "-n", str(n), "--oversubscribe", *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=cap, env=env,
                          cwd=tests.parent, stdin=subprocess.DEVNULL)
    return proc.returncode, proc.stdout + proc.stderr


def test_run_mpi_fails_when_the_default_selection_collects_nothing(tmp_path) -> None:
    tests = _fake_repo(tmp_path, {"test_plain.py": _NOT_MPI})
    code, out = _run_mpi_py(tests)
    assert code == 5, out
    assert "no MPI test collected" in out and "rank 0" in out, out


def test_run_mpi_named_paths_without_mpi_tests_still_pass(tmp_path) -> None:
    tests = _fake_repo(tmp_path, {"test_plain.py": _NOT_MPI})
    code, out = _run_mpi_py(tests, "tests/test_plain.py", "--min-tests", "50")
    assert code == 0, out
    assert "--min-tests 50 not checked" in out, out


def test_run_mpi_fails_below_the_minimum_and_passes_at_it(tmp_path) -> None:
    tests = _fake_repo(tmp_path, {"test_plain.py": _NOT_MPI, "test_three.py": _THREE_MPI})
    code, out = _run_mpi_py(tests, "--min-tests", "4")   # 3 ran, 1 skipped: skips do not count
    assert code == 6, out
    assert "only 3 test(s) ran" in out and "at least 4" in out, out
    code, out = _run_mpi_py(tests, "--min-tests=3")
    assert code == 0, out
    assert "3 passed" in out, out
    code, out = _run_mpi_py(tests, "--min-tests", "x")
    assert code != 0 and "--min-tests needs a count" in out, out


def test_run_mpi_checks_the_minimum_on_every_rank(tmp_path) -> None:
    """Under mpirun every rank checks its own count; rank 1's verdict reaches the real stderr."""
    tests = _fake_repo(tmp_path, {"test_three.py": _THREE_MPI})
    code, out = _run_mpi_py(tests, "--min-tests", "4", n=2)
    assert code != 0, out
    assert "rank 0: only 3 test(s) ran" in out and "rank 1: only 3 test(s) ran" in out, out


def test_make_test_mpi_stages_ask_for_a_minimum() -> None:
    """Both MPI stages of ``make test`` pass ``--min-tests``: each runs ~180 MPI tests today."""
    import re

    with open(os.path.join(ROOT, "Makefile")) as fh:
        text = fh.read()
    recipe = text[text.index("\ntest: "):]
    recipe = recipe[:recipe.index("\n\n")]
    stages = [line for line in recipe.splitlines() if "tests/run_mpi.py" in line]
    assert len(stages) == 2, stages
    for line in stages:
        m = re.search(r"tests/run_mpi\.py --min-tests (\d+)", line)
        assert m and int(m.group(1)) >= 150, line

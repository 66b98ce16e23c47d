"""``hpcdp-run``: exit codes, rank prefixes, a failing rank stops the job, in-process mode."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from hpcdp.run import parse_nodelist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args: list[str], tmp_path, script: str, timeout: float = 60) -> subprocess.CompletedProcess:
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(script))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "SLURM_JOB_ID"):
        env.pop(k, None)
    return subprocess.run([sys.executable, "-m", "hpcdp.run", *args, str(path), "--lr", "0.1"],
                          env=env, capture_output=True, text=True, timeout=timeout)


ALLREDUCE = """
    import sys
    import numpy as np
    import hpcdp
    hpcdp.init()
    x = hpcdp.allreduce(np.full(5, hpcdp.rank() + 1.0))
    print("args", sys.argv[1:], "sum", x[0], "backend", hpcdp.get_default_group().backend.name)
    hpcdp.finalize()
"""


def test_ranks_run_with_prefixes_and_args(tmp_path) -> None:
    res = _run(["-n", "3"], tmp_path, ALLREDUCE)
    assert res.returncode == 0, res.stderr
    lines = sorted(res.stdout.splitlines())
    assert lines == [f"[rank {r}] args ['--lr', '0.1'] sum 6.0 backend tcp" for r in range(3)]


def test_exit_code_of_failing_rank_is_returned(tmp_path) -> None:
    res = _run(["-n", "2"], tmp_path, """
        import os, sys
        sys.exit(3 if os.environ["RANK"] == "1" else 0)
    """)
    assert res.returncode == 3


def test_one_failing_rank_stops_the_job_quickly(tmp_path) -> None:
    t0 = time.monotonic()
    res = _run(["-n", "3", "--grace", "1"], tmp_path, """
        import os, sys, time
        if os.environ["RANK"] == "2":
            time.sleep(0.3)
            print("failing now", flush=True)
            sys.exit(7)
        time.sleep(60)
    """)
    assert res.returncode == 7
    assert time.monotonic() - t0 < 15
    assert "[rank 2] failing now" in res.stdout


def test_rank_that_ignores_sigterm_is_killed(tmp_path) -> None:
    t0 = time.monotonic()
    res = _run(["-n", "2", "--grace", "0.5"], tmp_path, """
        import os, signal, sys, time
        if os.environ["RANK"] == "0":
            time.sleep(0.3)
            raise RuntimeError("boom")
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(60)
    """)
    assert res.returncode == 1
    assert time.monotonic() - t0 < 15
    assert "[rank 0] RuntimeError: boom" in res.stderr


def test_in_process_mode_runs_script_as_main(tmp_path) -> None:
    res = _run([], tmp_path, """
        import sys
        print(__name__, sys.argv[1:])
    """)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "__main__ ['--lr', '0.1']"


def test_in_process_mode_reports_unhandled_error(tmp_path) -> None:
    res = _run([], tmp_path, """
        def f():
            raise ValueError("bad input")
        f()
    """)
    assert res.returncode != 0
    assert "Traceback" in res.stderr and "ValueError: bad input" in res.stderr


@pytest.mark.parametrize("spec, hosts", [
    ("node[01-03],gpu7", ["node01", "node02", "node03", "gpu7"]),
    ("a1", ["a1"]),
    ("c[1,3-4]", ["c1", "c3", "c4"]),
])
def test_parse_nodelist(spec: str, hosts: list[str]) -> None:
    assert parse_nodelist(spec) == hosts

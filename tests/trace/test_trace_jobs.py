"""Whole jobs on sim, TCP and MPI: rank 2 skips a collective; every rank dumps; ``analyze`` names
rank 2, the operation and the lines; ``merge`` and ``plot`` read what the job left.

The job script only runs collectives: recording, the dumps on ``CommTimeoutError`` and the
installed hooks all come from the collective layer's own wiring (``hpcdp.init``/``spawn``).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from conftest import job_env


JOB = textwrap.dedent('''
    import os, sys, threading, time
    import numpy as np
    import hpcdp
    from hpcdp import trace
    from hpcdp.errors import CommTimeoutError
    # no recording here: the collective layer records, dumps and arms the hooks by itself

    SKIP, OTHERS_TIMEOUT, SKIP_TIMEOUT = 2, 2.5, 0.5
    LAUNCHED = "RANK" in os.environ or "OMPI_COMM_WORLD_SIZE" in os.environ  # hpcdp-run or mpirun

    OTHERS_DONE = threading.Semaphore(0)  # simulated ranks: released by each that timed out

    def wait_for_the_others():
        """Until every other rank has timed out (bounded): simulated ranks are threads of this
        process that say so; a launched rank waits for its launcher to stop it, once the others
        failed (returning would rewrite its record at exit)."""
        if LAUNCHED:
            time.sleep(OTHERS_TIMEOUT + 30)
            return
        deadline = time.monotonic() + OTHERS_TIMEOUT + 30
        for _ in range(3):
            OTHERS_DONE.acquire(timeout=max(0.0, deadline - time.monotonic()))

    def body(rank):
        world = hpcdp.get_default_group()
        side = world.new_group(list(range(world.size)), name="side")
        x = np.ones(4)
        for step in range(3):
            with trace.span("step", "train", step=step):
                if rank == SKIP and step == 2:
                    try:
                        side.barrier(timeout=SKIP_TIMEOUT)  # LINE-SIDE
                    except CommTimeoutError:
                        wait_for_the_others()  # they time out and dump meanwhile
                    return "skipped"
                try:
                    world.allreduce(x, timeout=OTHERS_TIMEOUT)  # LINE-ALLREDUCE
                except CommTimeoutError:
                    OTHERS_DONE.release()
                    raise
        return "done"

    if LAUNCHED:
        hpcdp.init()
        body(hpcdp.rank())
    else:
        hpcdp.spawn(body, 4, backend="sim", timeout=30, join_timeout=60)
''')


def _line(marker: str) -> int:
    return next(i for i, t in enumerate(JOB.split("\n"), 1) if marker in t)


LAUNCH = {
    "sim": lambda script: [sys.executable, script],
    "tcp": lambda script: [sys.executable, "-m", "hpcdp.run", "-n", "4", script],
    "mpirun": lambda script: ["mpirun", "-n", "4", "--oversubscribe", sys.executable, "-m", "hpcdp.run", script],
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend, tracing", [("sim", True), ("sim", False), ("tcp", True),
                                              ("mpirun", True)])  # not "mpi": pytest-mpi would skip it
def test_skipped_collective_is_found(tmp_path, backend: str, tracing: bool) -> None:
    """With HPCDP_TRACE=1 every line is recorded; without, the lines come from the error path."""
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = job_env(HPCDP_TRACE_DIR=str(tmp_path / "trace"), HPCDP_TRACE="1" if tracing else "0")
    job = subprocess.run(LAUNCH[backend](str(script)), capture_output=True, text=True, timeout=180,
                         env=env, stdin=subprocess.DEVNULL, cwd=tmp_path)
    out = job.stdout + job.stderr
    assert job.returncode != 0, out  # the job failed: ranks 0, 1 and 3 timed out
    assert "CommTimeoutError" in out, out
    d = tmp_path / "trace"
    assert sorted(p for p in os.listdir(d) if p.startswith("flight-")) == \
        [f"flight-rank{r}.json" for r in range(4)], out

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "hpcdp.trace", *args], capture_output=True,
                              text=True, timeout=120, env=env, stdin=subprocess.DEVNULL)

    an = cli("analyze", str(d))
    assert an.returncode == 0, an.stderr
    text = an.stdout
    # the world group's own numbering: new_group's exchanges come first, then three allreduces
    m = re.search(r"First divergence: allreduce #(\d+) on group world \(shape \(4,\), float64\)\nReached by "
                  r"ranks 0, 1, 3 \([a-z ]+\) at (\S+) \(body\)\n", text)
    assert m is not None, text
    seq = int(m.group(1))
    assert seq >= 3 and m.group(2) == f"{script}:{_line('LINE-ALLREDUCE')}", text
    assert f"\n  rank 2: was in barrier #1 on group side (timed out) at {script}:{_line('LINE-SIDE')} (body)\n" \
        f"  rank 2: its last operation on group world was allreduce #{seq - 1}" in text, text

    merged = tmp_path / "merged.json"
    m = cli("merge", str(d), "-o", str(merged))
    assert m.returncode == 0, m.stderr
    doc = json.loads(merged.read_text())
    assert doc["otherData"]["source"] == ("timelines" if tracing else "flight records")
    timed = [e for e in doc["traceEvents"] if e["ph"] != "M"]
    assert {e["pid"] for e in timed} == {0, 1, 2, 3}
    assert [e["ts"] for e in timed] == sorted(e["ts"] for e in timed)
    for r in range(4):  # each rank's own events stay in their order: steps 0, 1, ... then the op
        assert any(e["pid"] == r and e.get("cat") == "collective" for e in timed), r
        if not tracing:
            continue
        steps = [e["args"]["step"] for e in timed if e["pid"] == r and e["name"] == "step"]
        assert steps == sorted(steps) and steps[:2] == [0, 1], (r, steps)
    png = tmp_path / "phases.png"
    pl = cli("plot", str(d), "-o", str(png))
    assert pl.returncode == 0, pl.stderr
    assert png.read_bytes()[:4] == b"\x89PNG"

"""``analyze`` names point-to-point deadlocks (issue 25, item 5): ranks that each timed out in a
receive from the other used to read "No divergence found ... completed". Synthetic records, records
made on simulated ranks, and a real TCP job with a short timeout and warning interval."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import hpcdp
from hpcdp import trace
from hpcdp.errors import CommTimeoutError
from hpcdp.trace import COMPLETED, TIMED_OUT, hooks
from hpcdp.trace import _dump as _dump_module
from hpcdp.trace._analyze import analyze

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.abspath(__file__)

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(autouse=True)
def fresh():
    trace.reset()
    _dump_module.reset_hooks_for_tests()
    trace.configure(lines=True)
    yield
    trace.reset()


class _G:
    def __init__(self, ranks: tuple[int, ...], rank: int) -> None:
        self.name, self.ranks, self.rank = "world", ranks, ranks.index(rank)


@hooks.hide_frames
def _p2p(r: int, world: int, op: str, peer: int, state: str) -> None:
    rec = trace.recorder(r)
    tok = rec.begin(op, _G(tuple(range(world)), r), 0, (3,), np.dtype("float64"), peer)
    if state != "started":
        rec.end(tok, state)


def _line_of(marker: str, path: str = HERE) -> int:
    with open(path) as fh:
        return next(i for i, t in enumerate(fh, 1) if marker in t and "_line_of" not in t)


def test_a_ring_of_receives_is_a_deadlock(tmp_path) -> None:
    for r in range(3):
        _p2p(r, 3, "send", (r + 1) % 3, COMPLETED)
        _p2p(r, 3, "recv", (r + 2) % 3, TIMED_OUT)  # MARK-RING
    trace.dump("CommTimeoutError", directory=tmp_path)
    lines = analyze(str(tmp_path)).splitlines()
    at = f"at {HERE}:{_line_of('MARK-RING')} (test_a_ring_of_receives_is_a_deadlock)"
    assert lines[:4] == [
        "Deadlock: ranks 0, 2, 1 waited on each other in point-to-point calls (cycle 0 -> 2 -> 1 "
        "-> 0); none could go on (timed out)",
        f"  rank 0: recv(peer 2) on group world (timed out) {at}, waiting for rank 2 to send",
        f"  rank 2: recv(peer 1) on group world (timed out) {at}, waiting for rank 1 to send",
        f"  rank 1: recv(peer 0) on group world (timed out) {at}, waiting for rank 0 to send"], lines
    assert not any(ln.startswith("No divergence") for ln in lines), lines


def test_a_receive_from_a_rank_that_finished_is_no_deadlock(tmp_path) -> None:
    _p2p(0, 2, "recv", 1, TIMED_OUT)
    _p2p(1, 2, "send", 0, COMPLETED)
    trace.dump("CommTimeoutError", directory=tmp_path)
    assert "Deadlock" not in analyze(str(tmp_path))


def body_recv_deadlock(rank: int, directory: str) -> str:
    g = hpcdp.get_default_group()
    try:
        g.irecv(np.zeros(3), 1 - rank).wait(timeout=1.0)  # LINE-SIM
        out = "received"
    except CommTimeoutError as exc:
        out = type(exc).__name__
    g.barrier()  # both timed out before either leaves
    if rank == 0:
        trace.dump("test", directory=directory)
    return out


def test_records_of_simulated_ranks_that_waited_on_each_other(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HPCDP_WARN_AFTER", "0.5")
    res = hpcdp.spawn(body_recv_deadlock, 2, backend="sim", args=(str(tmp_path),), timeout=20,
                      join_timeout=60)
    assert res == ["CommTimeoutError"] * 2, res
    lines = analyze(str(tmp_path)).splitlines()
    at = f"at {HERE}:{_line_of('LINE-SIM')} (body_recv_deadlock)"
    assert lines[0].startswith("Deadlock: ranks 0, 1 waited on each other in point-to-point "
                               "calls (cycle 0 -> 1 -> 0)"), lines
    assert lines[1] == f"  rank 0: recv(peer 1) on group world (timed out) {at}, waiting for rank 1 to send", lines
    assert lines[2] == f"  rank 1: recv(peer 0) on group world (timed out) {at}, waiting for rank 0 to send", lines


_DEADLOCK_JOB = """
import numpy as np
import hpcdp
from hpcdp.errors import HpcdpError

def body(rank):
    g = hpcdp.get_default_group()
    g.allreduce(np.ones(4))
    try:
        g.recv(np.zeros(3), 1 - rank)  # LINE-RECV
    except HpcdpError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "received"

if __name__ == "__main__":
    for r in hpcdp.spawn(body, 2, backend="tcp", join_timeout=60):  # HPCDP_TIMEOUT: 3 s
        print(r)
"""


def test_a_tcp_job_whose_ranks_wait_on_each_other(tmp_path) -> None:
    """A real TCP job, as ``_FINISHING_JOB`` in test_trace_analyze: both ranks block in a
    receive from the other until ``HPCDP_TIMEOUT``; each warns once after ``HPCDP_WARN_AFTER``,
    each error names the cycle, and the analysis of their records says "Deadlock"."""
    script = tmp_path / "job.py"
    script.write_text(_DEADLOCK_JOB)
    d = tmp_path / "trace"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               HPCDP_TIMEOUT="3", HPCDP_WARN_AFTER="1", HPCDP_TRACE_DIR=str(d))
    for k in ("HPCDP_BACKEND", "RANK", "WORLD_SIZE", "HPCDP_MASTER_ADDR", "MASTER_ADDR", "HPCDP_TRACE"):
        env.pop(k, None)
    job = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=150,
                         env=env, stdin=subprocess.DEVNULL, cwd=tmp_path)
    out = job.stdout + job.stderr
    line = next(i for i, t in enumerate(_DEADLOCK_JOB.split("\n"), 1) if "LINE-RECV" in t)
    assert job.returncode == 0, out
    for r in (0, 1):
        p = 1 - r
        assert (f"rank {r} waits for rank {p} in recv(src={p}, tag=0) #1 at job.py:{line}, rank {p} "
                f"waits for rank {r} in recv(src={r}, tag=0) #1 at job.py:{line}") in job.stdout, out
        warned = [ln for ln in job.stderr.splitlines() if ln.startswith(f"[rank {r}] WARNING hpcdp: blocked")]
        assert len(warned) == 1, out
        assert (f"in recv(src={p}, tag=0) #1 at job.py:{line} on group world: waiting for rank {p} to "
                f"send; rank {p} is itself blocked in recv(src={r}, tag=0) #1 at job.py:{line} (a "
                f"deadlock cycle: {r} -> {p} -> {r})") in warned[0], out
    lines = analyze(str(d)).splitlines()
    at = f"at {script}:{line} (body)"
    assert lines[:3] == [
        "Deadlock: ranks 0, 1 waited on each other in point-to-point calls (cycle 0 -> 1 -> 0); "
        "none could go on (timed out)",
        f"  rank 0: recv(peer 1) on group world (timed out) {at}, waiting for rank 1 to send",
        f"  rank 1: recv(peer 0) on group world (timed out) {at}, waiting for rank 0 to send"], lines
    assert not any(ln.startswith("No divergence") for ln in lines), lines

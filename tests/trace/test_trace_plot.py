"""``python -m hpcdp.trace plot``: each rank's step split into compute, communication and waiting
(issue 21, item 12), from synthetic events and from a recorded job."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from hpcdp.trace._plot import KINDS, load_events, step_breakdown

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PNG = b"\x89PNG\r\n\x1a\n"


def _op(rank: int, seq: int, ts: float, dur: float, name: str = "allreduce", group: str = "world") -> dict:
    return {"name": name, "ph": "X", "cat": "collective", "pid": rank, "tid": 0, "ts": ts, "dur": dur,
            "args": {"group": group, "group_ranks": [0, 1], "seq": seq, "state": "completed"}}


def _step(rank: int, ts: float, dur: float) -> dict:
    return {"name": "step", "ph": "X", "cat": "train", "pid": rank, "tid": 0, "ts": ts, "dur": dur}


def _check_sums(steps) -> None:
    for s in steps:
        assert s.compute + s.communication + s.waiting == pytest.approx(s.duration, abs=1e-9), s
        assert s.compute >= 0 and s.communication >= 0 and s.waiting >= 0, s


def test_waiting_is_time_before_the_last_rank_arrived() -> None:
    """Times in microseconds. Step 0: rank 0 computes 100, enters allreduce #1 at 100; rank 1
    computes 400 and enters at 400; both leave at 450. Rank 0 waited 300 and communicated 50."""
    ev = [_step(0, 0, 500), _op(0, 1, 100, 350), _step(1, 0, 500), _op(1, 1, 400, 50),
          # step 1: a p2p op (no arrival to compare) and an async op overlapping the next one
          _step(0, 600, 400), {"name": "send", "ph": "X", "cat": "p2p", "pid": 0, "tid": 0, "ts": 650,
                               "dur": 100, "args": {"group": "world", "seq": 0, "peer": 1}},
          _op(0, 2, 700, 200), _step(1, 600, 400), _op(1, 2, 700, 200)]
    steps, source = step_breakdown(ev)
    assert source == "step spans"
    got = {(s.rank, s.step): (round(s.compute * 1e6, 6), round(s.communication * 1e6, 6), round(s.waiting * 1e6, 6))
           for s in steps}
    assert got == {(0, 0): (150, 50, 300), (1, 0): (450, 50, 0),
                   (0, 1): (150, 250, 0), (1, 1): (200, 200, 0)}, got
    _check_sums(steps)
    # the pieces drawn: rank 0's step 0 waits from 100 to 400 us, then communicates to 450
    (s00,) = [s for s in steps if (s.rank, s.step) == (0, 0)]
    assert [(round(a * 1e6), round(b * 1e6), k) for a, b, k in s00.segments] == [
        (100, 400, "waiting"), (400, 450, "communication")]


def test_steps_from_marks_and_ops_crossing_a_boundary() -> None:
    """Without step spans, the time between two ``trace.step()`` marks is a step; an operation that
    spans a boundary is cut there, so every step still sums to its duration."""
    marks = [{"name": "step", "ph": "i", "cat": "step", "pid": r, "tid": 0, "ts": t}
             for r in (0, 1) for t in (0.0, 1000.0, 2000.0)]
    ev = marks + [_op(0, 1, 800, 400), _op(1, 1, 1100, 100), _op(0, 2, 1500, 100), _op(1, 2, 1500, 100)]
    steps, source = step_breakdown(ev)
    assert source == "trace.step() marks" and sorted((s.rank, s.step) for s in steps) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    _check_sums(steps)
    s = {(x.rank, x.step): x for x in steps}
    assert s[(0, 0)].waiting == pytest.approx(200e-6) and s[(0, 1)].waiting == pytest.approx(100e-6)
    assert s[(0, 1)].communication == pytest.approx(200e-6) and s[(1, 0)].communication == 0


def test_whole_trace_is_one_step_without_step_information() -> None:
    steps, source = step_breakdown([_op(0, 1, 0, 10), _op(1, 1, 5, 5)])
    assert source == "whole trace" and len(steps) == 2
    _check_sums(steps)


JOB = textwrap.dedent('''
    import time
    import numpy as np
    import hpcdp
    from hpcdp import trace

    def body(rank):
        g = hpcdp.get_default_group()
        x = np.ones(1024)
        for step in range(5):
            time.sleep(0.005 + (0.03 if rank == 0 else 0.0))   # rank 0 computes longer
            g.allreduce(x)
            trace.step()

    hpcdp.spawn(body, 2, backend="sim", timeout=30, join_timeout=60)
''')


@pytest.mark.timeout(240)
def test_plot_of_a_recorded_job(tmp_path) -> None:
    """HPCDP_TRACE=1 on 2 simulated ranks: rank 0 computes 30 ms longer per step, so rank 1 waits
    for it in every allreduce; the plot command writes a PNG of it."""
    script = tmp_path / "job.py"
    script.write_text(JOB)
    d = tmp_path / "trace"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               HPCDP_TRACE="1", HPCDP_TRACE_DIR=str(d))
    for k in ("HPCDP_BACKEND", "RANK", "WORLD_SIZE", "HPCDP_MASTER_ADDR", "MASTER_ADDR"):
        env.pop(k, None)
    job = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, env=env,
                         stdin=subprocess.DEVNULL, cwd=tmp_path)
    assert job.returncode == 0, job.stdout + job.stderr
    steps, source = step_breakdown(load_events(str(d)))
    assert source == "trace.step() marks"
    assert sorted((s.rank, s.step) for s in steps) == [(r, k) for r in (0, 1) for k in range(4)]
    _check_sums(steps)
    for s in steps:
        assert s.duration >= 0.03, s                  # lower bounds only: the machine may be slow
        if s.rank == 1:
            assert s.waiting >= 0.015, s              # waited for rank 0's longer compute
        else:
            assert s.compute >= 0.03, s
    png = tmp_path / "steps.png"
    p = subprocess.run([sys.executable, "-m", "hpcdp.trace", "plot", str(d), "-o", str(png)], capture_output=True,
                       text=True, timeout=120, env=env, stdin=subprocess.DEVNULL)
    assert p.returncode == 0 and p.stdout.strip() == str(png), p.stderr
    assert png.read_bytes()[:8] == PNG and png.stat().st_size > 10_000
    assert set(KINDS) == {"compute", "communication", "waiting"}

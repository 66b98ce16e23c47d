"""Faults on the TCP backend: a SIGKILLed rank, a rank that is late past the timeout."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import hpcdp
from cases import body_late_timeout, on_time_ok
from hpcdp.testing import run_ranks
from hpcdp.launch._processes import spawn_processes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def killed_mid_allreduce(rank: int, info: str) -> dict:
    x = np.ones(8 << 20, np.float64)  # 64 MiB: the kill lands inside the ring
    hpcdp.allreduce(x[:1000])
    if rank == 2:
        work = hpcdp.allreduce(x, async_op=True)
        time.sleep(0.05)
        Path(info, "killed").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
        work.wait()
    out: dict = {"rank": rank}
    try:
        for _ in range(50):
            hpcdp.allreduce(x)
        out["result"] = "finished"
    except hpcdp.PeerFailureError as exc:
        out["result"], out["message"], out["at"] = "peer-failure", str(exc), time.time()
    except hpcdp.CommTimeoutError as exc:
        out["result"], out["message"] = "timeout", str(exc)
    Path(info, f"rank{rank}").write_text(repr(out))
    return out


def test_sigkill_makes_survivors_raise_peer_failure_fast(tmp_path) -> None:
    with pytest.raises(hpcdp.HpcdpError, match="rank 2"):
        spawn_processes(killed_mid_allreduce, 3, args=(str(tmp_path),), timeout=60, join_timeout=60)
    killed = float((tmp_path / "killed").read_text())
    for r in (0, 1):
        out = eval((tmp_path / f"rank{r}").read_text())  # noqa: S307 - written by this test
        assert out["result"] == "peer-failure", out
        assert "rank 2" in out["message"]
        assert out["at"] - killed < 5.0, out


def test_launcher_exits_nonzero_when_a_rank_is_killed(tmp_path) -> None:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import os, signal, numpy as np, hpcdp
        hpcdp.init()
        x = np.ones(4 << 20)
        if hpcdp.rank() == 1:
            w = hpcdp.allreduce(x, async_op=True)
            os.kill(os.getpid(), signal.SIGKILL)
        for _ in range(100):
            hpcdp.allreduce(x)
    """))
    env = dict(os.environ, PYTHONPATH=ROOT)
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "hpcdp.run", "-n", "2", str(script)], env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0
    assert time.monotonic() - t0 < 30


def test_late_rank_makes_others_time_out_in_time() -> None:
    # rank 2 joins only after the others gave up (message-ordered, not a sleep); lower bound only
    res = run_ranks("tcp", 3, body_late_timeout, 2, 1.0)
    assert any(out["result"] == "timeout" for out in res[:2]), res
    for out in res[:2]:
        assert on_time_ok(out, 2, 1.0), out
        if out["result"] == "timeout":
            assert "no collective message from rank" in out["message"], out
    assert res[2]["result"] in ("timeout", "peer-failure")


def test_send_to_finished_rank_is_a_peer_failure() -> None:
    res = run_ranks("tcp", 2, _recv_from_finished)
    assert res[1].startswith("PeerFailureError"), res


def _recv_from_finished(rank: int) -> str:
    if rank == 0:
        hpcdp.finalize()
        return "done"
    try:
        hpcdp.recv(np.empty(3), 0, timeout=10)
    except hpcdp.PeerFailureError as exc:
        return f"PeerFailureError: {exc}"
    return "no error"

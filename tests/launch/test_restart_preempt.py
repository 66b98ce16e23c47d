"""``hpcdp.checkpoint.preempt.on_preempt``: a signal saves at the next step boundary, exits 0 and,
under Slurm, requeues the job (``scontrol`` is a fake on PATH here)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import hpcdp
from hpcdp.checkpoint.preempt import on_preempt, restart_count, slurm_job_id
from hpcdp.errors import HpcdpError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def slurm(tmp_path, monkeypatch):
    """A fake ``scontrol`` first on PATH that logs its arguments; SLURM_JOB_ID=4242."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "scontrol.log"
    fake = bin_dir / "scontrol"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {log}\nexit "${{FAKE_SCONTROL_RC:-0}}"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for k in ("SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    return log


def _signal_self(sig: int = signal.SIGUSR1) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(0.05)  # Python runs the handler at the next bytecode boundary; give it one


def _train(preempt, steps: int = 10, signal_at: int = 3, sig: int = signal.SIGUSR1) -> int:
    """Steps 1..steps; the signal arrives during step ``signal_at``; returns the last step run."""
    step = 0
    while step < steps:
        step += 1
        if step == signal_at:
            _signal_self(sig)
        if preempt.check():
            break
    return step


def test_signal_saves_at_next_boundary_requeues_and_exits_0(slurm) -> None:
    saves: list[int] = []
    state = {"step": 0}
    preempt = on_preempt(lambda: saves.append(state["step"]))
    try:
        with pytest.raises(SystemExit) as exc:
            for step in range(1, 11):
                state["step"] = step
                if step == 3:
                    _signal_self()
                    assert saves == []  # the handler itself saves nothing
                preempt.check()
        assert exc.value.code == 0
        assert saves == [3]
        assert slurm.read_text().split("\n")[0] == "requeue 4242"
    finally:
        preempt.close()


def test_no_signal_no_save(slurm) -> None:
    saves: list[int] = []
    with on_preempt(lambda: saves.append(1)) as preempt:
        assert not any(preempt.check() for _ in range(5))
    assert saves == [] and not slurm.exists()


def test_exit_false_returns_true_once(slurm) -> None:
    saves: list[int] = []
    with on_preempt(lambda: saves.append(1), exit=False, requeue=False) as preempt:
        last = _train(preempt, signal_at=4)
        assert last == 4 and saves == [1]
        assert preempt.check() is False  # handled: no second save without a second signal
    assert not slurm.exists()  # requeue=False


def test_outside_slurm_saves_and_exits_without_scontrol(slurm, monkeypatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID")
    saves: list[int] = []
    with on_preempt(lambda: saves.append(1)) as preempt:
        with pytest.raises(SystemExit) as exc:
            _train(preempt)
    assert exc.value.code == 0 and saves == [1]
    assert not slurm.exists()


def test_array_job_requeues_its_task(slurm, monkeypatch) -> None:
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "77")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    with on_preempt(lambda: None, exit=False) as preempt:
        assert _train(preempt) == 3
    assert slurm.read_text().strip() == "requeue 77_3"


def test_failed_requeue_is_a_clear_error(slurm, monkeypatch) -> None:
    monkeypatch.setenv("FAKE_SCONTROL_RC", "1")
    saves: list[int] = []
    with on_preempt(lambda: saves.append(1)) as preempt:
        with pytest.raises(HpcdpError, match=r"on_preempt: rank 0: 'scontrol requeue 4242' "
                                             r"exited with 1.*checkpoint was saved"):
            _train(preempt)
    assert saves == [1]


def test_missing_scontrol_is_a_clear_error(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "9")
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol anywhere
    with on_preempt(lambda: None) as preempt:
        with pytest.raises(HpcdpError, match="scontrol is not on PATH"):
            _train(preempt)


@pytest.mark.parametrize("name, sig", [("USR2", signal.SIGUSR2), ("SIGTERM", signal.SIGTERM)])
def test_other_signals_by_name(slurm, name: str, sig: int) -> None:
    with on_preempt(lambda: None, signal=name, exit=False, requeue=False) as preempt:
        assert _train(preempt, signal_at=2, sig=sig) == 2


def test_close_restores_the_previous_handler() -> None:
    seen: list[int] = []
    before = signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))
    try:
        first = on_preempt(lambda: None, exit=False)
        second = on_preempt(lambda: None, exit=False)
        _signal_self()
        assert seen == [signal.SIGUSR1]  # the user's handler still runs, chained
        assert first.requested and second.requested
        first.close()
        assert signal.getsignal(signal.SIGUSR1).__name__ == "_handler"  # second still listens
        second.close()
        _signal_self()
        assert seen == [signal.SIGUSR1, signal.SIGUSR1]
        assert signal.getsignal(signal.SIGUSR1).__name__ == "<lambda>"
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown signal"):
        on_preempt(lambda: None, signal="NOPE")
    with pytest.raises(ValueError, match="cannot be caught"):
        on_preempt(lambda: None, signal=signal.SIGKILL)


def test_restart_count_and_job_id(monkeypatch) -> None:
    for k in ("HPCDP_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(k, raising=False)
    assert restart_count() == 0
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    assert restart_count() == 2
    monkeypatch.setenv("HPCDP_RESTART_COUNT", "3")
    assert restart_count() == 3
    assert slurm_job_id({}) is None
    assert slurm_job_id({"SLURM_JOB_ID": "5"}) == "5"
    assert slurm_job_id({"SLURM_JOB_ID": "5", "SLURM_ARRAY_JOB_ID": "4",
                         "SLURM_ARRAY_TASK_ID": "1"}) == "4_1"


# Two TCP ranks; only rank 1 is signalled. The boundary is agreed collectively, so both ranks
# save at the same step, and only rank 0 runs scontrol.
TWO_RANKS = """
    import os, signal, time
    import numpy as np
    import hpcdp
    from hpcdp.checkpoint.preempt import on_preempt
    hpcdp.init()
    rank, out = hpcdp.rank(), os.environ["OUT"]
    step = 0
    def save():
        open(os.path.join(out, f"saved{rank}"), "w").write(str(step))
    preempt = on_preempt(save)
    while step < 1000:
        step += 1
        hpcdp.allreduce(np.array([step]))
        if rank == 1 and step == 7:
            os.kill(os.getpid(), signal.SIGUSR1)
            while not preempt.requested:
                time.sleep(0.001)
        preempt.check()
    open(os.path.join(out, f"finished{rank}"), "w").write("")
"""


def test_ranks_agree_on_the_boundary(tmp_path, slurm) -> None:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(TWO_RANKS))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI", "PMIX", "HPCDP_", "MASTER_"))}
    env.update(PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OUT=str(tmp_path), HPCDP_TIMEOUT="60")
    res = subprocess.run([sys.executable, "-m", "hpcdp.run", "-n", "2", "--nnodes", "1",
                          "--node-rank", "0", "--master-addr", "127.0.0.1", str(script)],
                         env=env, capture_output=True, text=True, timeout=90,
                         stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "saved0").read_text() == "7" and (tmp_path / "saved1").read_text() == "7"
    assert not list(tmp_path.glob("finished*"))  # both exited at the boundary
    assert slurm.read_text() == "requeue 4242\n"  # once, from rank 0
    assert "[rank 0] hpcdp: preempted (SIGUSR1): saving at this step boundary" in res.stderr
    assert "[rank 0] hpcdp: job 4242 requeued" in res.stderr


def _preempt_body(rank: int) -> int:
    """MPI: rank 1 alone is signalled at step 3; every rank must stop at step 3."""
    saved: list[int] = []
    step = 0
    with on_preempt(lambda: saved.append(step), exit=False, requeue=False) as preempt:
        while step < 50:
            step += 1
            if rank == 1 and step == 3:
                _signal_self()
            if preempt.check():
                break
    return step * 100 + len(saved)


@pytest.mark.mpi(min_size=2)
def test_ranks_agree_on_the_boundary_mpi(mpi_world) -> None:
    from conftest import run_mpi

    assert run_mpi(_preempt_body) == [301] * hpcdp.world_size()

"""``hpcdp-run``: exit codes, rank prefixes, a failing rank stops the job, in-process mode."""
from __future__ import annotations

import os
import signal
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


def _start(args: list[str], tmp_path, script: str) -> subprocess.Popen:
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(script))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OUT=str(tmp_path))
    for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "SLURM_JOB_ID"):
        env.pop(k, None)
    return subprocess.Popen([sys.executable, "-m", "hpcdp.run", *args, str(path)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(paths, proc: subprocess.Popen, within: float = 30) -> None:
    deadline = time.monotonic() + within
    while not all(p.exists() for p in paths):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"ranks did not start (rc {proc.returncode}):\n{out}\n{err}")
        time.sleep(0.02)


# Each rank traps SIGTERM, takes 0.5 s to "save a checkpoint", then exits 0.
CHECKPOINT_ON_SIGTERM = """
    import os, signal, sys, time
    out, rank = os.environ["OUT"], os.environ["RANK"]
    def on_term(*_):
        time.sleep(0.5)
        open(os.path.join(out, "saved" + rank), "w").write("ok")
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    open(os.path.join(out, "up" + rank), "w").write("")
    time.sleep(60)
"""


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_to_launcher_gives_ranks_the_grace_period(tmp_path, sig, code) -> None:
    """SLURM preemption: SIGTERM reaches the launcher; ranks get ``--grace`` seconds to save."""
    script = CHECKPOINT_ON_SIGTERM
    if sig == signal.SIGINT:  # the launcher forwards the signal it got
        script = script.replace("signal.signal(signal.SIGTERM", "signal.signal(signal.SIGINT")
    proc = _start(["-n", "2", "--grace", "20"], tmp_path, script)
    _wait_for([tmp_path / "up0", tmp_path / "up1"], proc)
    t0 = time.monotonic()
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert (tmp_path / "saved0").read_text() == "ok", err
    assert (tmp_path / "saved1").read_text() == "ok", err
    assert time.monotonic() - t0 < 15  # ranks that exit end the grace period early


def test_rank_that_ignores_sigterm_is_killed_after_grace(tmp_path) -> None:
    proc = _start(["-n", "2", "--grace", "0.5"], tmp_path, """
        import os, signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        open(os.path.join(os.environ["OUT"], "up" + os.environ["RANK"]), "w").write("")
        time.sleep(60)
    """)
    _wait_for([tmp_path / "up0", tmp_path / "up1"], proc)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == 143
    assert time.monotonic() - t0 < 15


def _exit_without_report(rank: int) -> str:
    if rank == 1:
        os._exit(3)
    return "done"


def test_spawn_rank_dying_without_report_is_an_error() -> None:
    """Rank 1 vanishes, rank 0 needs nothing from it: spawn must raise, not wait forever."""
    import threading

    import hpcdp
    from hpcdp.errors import HpcdpError

    out: dict = {}

    def run() -> None:
        try:
            out["res"] = hpcdp.spawn(_exit_without_report, 2, backend="tcp", timeout=10)
        except BaseException as exc:  # noqa: BLE001
            out["err"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "spawn hung"
    assert isinstance(out.get("err"), HpcdpError), out
    assert "rank 1 exited with code 3" in str(out["err"])


def test_spawn_collect_sentinel_before_eof(monkeypatch) -> None:
    """The sentinel of a rank is seen before its pipe's EOF: still reported, no hang."""
    import multiprocessing as mp
    import threading

    from hpcdp.backends import _tcp_spawn
    from hpcdp.errors import HpcdpError

    class Proc:
        def __init__(self, exitcode: int) -> None:
            r, w = os.pipe()
            os.close(w)  # readable at once, like the sentinel of an exited process
            self.sentinel, self.exitcode = r, exitcode

        def join(self, timeout=None) -> None:
            pass

    procs = [Proc(0), Proc(3)]
    conns, ends = [], []
    for _ in procs:
        a, b = mp.Pipe()
        conns.append(a)
        ends.append(b)
    ends[0].send_bytes(__import__("pickle").dumps(("ok", "r0")))
    for e in ends:
        e.close()  # rank 1 exits without reporting: EOF

    real_wait = _tcp_spawn.mp_wait
    sentinels = {p.sentinel for p in procs}

    def sentinels_first(objs, timeout=None):
        ready = real_wait(objs, timeout)
        return sorted(ready, key=lambda o: o not in sentinels)

    monkeypatch.setattr(_tcp_spawn, "mp_wait", sentinels_first)
    out: dict = {}

    def run() -> None:
        try:
            out["res"] = _tcp_spawn._collect(procs, conns, None)
        except BaseException as exc:  # noqa: BLE001
            out["err"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(30)
    for p in procs:
        os.close(p.sentinel)
    assert not t.is_alive(), "_collect hung"
    assert isinstance(out.get("err"), HpcdpError), out
    assert "rank 1 exited with code 3 without reporting a result" in str(out["err"])

"""``hpcdp-run --max-restarts``: a failed rank restarts every rank, a resumed run ends where an
uninterrupted one does, and a job whose restarts run out fails cleanly."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from hpcdp.launch._local import attempt_secret

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "06_resume.py")
pytestmark = pytest.mark.timeout(300)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI", "PMIX", "SLURM", "HPCDP_", "MASTER_"))}
    env.update({"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                "HPCDP_TIMEOUT": "60", **extra})
    return env


def _launch(args: list[str], script: str, *script_args: str, timeout: float = 180,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpcdp.run", *args, script, *script_args],
                          env=env or _env(), capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_crash_once_then_restart_ends_like_an_uninterrupted_run(tmp_path) -> None:
    """Rank 1 raises before step 5 on the first run; the restart resumes from step-4."""
    common = ["--steps", "12", "--save-every", "2", "--batch-size", "16"]
    clean = _launch(["-n", "2"], EXAMPLE, *common, "--ckpt-dir", str(tmp_path / "a"),
                    "--out", str(tmp_path / "a.npz"))
    assert clean.returncode == 0, clean.stderr
    assert "restarting" not in clean.stderr

    crashed = _launch(["-n", "2", "--max-restarts", "1"], EXAMPLE, *common,
                      "--ckpt-dir", str(tmp_path / "b"), "--out", str(tmp_path / "b.npz"),
                      "--crash-at", "5", "--crash-rank", "1")
    assert crashed.returncode == 0, crashed.stderr
    assert "[rank 1] RuntimeError: 06_resume: rank 1: injected failure before step 5" in crashed.stderr
    assert "hpcdp-run: rank 1 exited with code 1; restarting all 2 rank(s) (restart 1 of 1)" \
        in crashed.stderr
    assert "[rank 0] run 1 on 2 rank(s): resumed from " in crashed.stdout
    assert f"{os.sep}step-4 at step 4" in crashed.stdout
    assert "[rank 0] done: 12 steps" in crashed.stdout

    a, b = np.load(tmp_path / "a.npz"), np.load(tmp_path / "b.npz")
    assert sorted(a.files) == sorted(b.files) and a.files
    for k in a.files:
        assert np.array_equal(a[k], b[k]), f"{k} differs after the restart"


# Rank 1 fails on every attempt. Each rank records its attempt, a digest of its secret, and (rank
# 0) the pids of itself and of a child it started; each rank 0 first checks that the previous
# attempt's rank 0 and its child are gone.
ALWAYS_FAILS = """
    import hashlib, os, subprocess, sys, time
    out, rank, n = os.environ["OUT"], os.environ["RANK"], os.environ["HPCDP_RESTART_COUNT"]
    digest = hashlib.sha256(os.environ["HPCDP_SECRET"].encode()).hexdigest()[:16]
    with open(os.path.join(out, f"attempt{n}-rank{rank}"), "w") as f:
        f.write(f"{digest} {os.environ['MASTER_PORT']} {os.environ['HPCDP_MAX_RESTARTS']}")
    def _alive(pid):
        try:  # a killed orphan may linger as a zombie until init reaps it: that is dead
            return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False
    if rank == "0":
        if n != "0":
            prev = open(os.path.join(out, f"pids{int(n) - 1}")).read().split()
            alive = [pid for pid in prev if _alive(pid)]
            open(os.path.join(out, f"stale{n}"), "w").write(" ".join(map(str, alive)))
        child = subprocess.Popen(["sleep", "600"])
        open(os.path.join(out, f"pids{n}"), "w").write(f"{os.getpid()} {child.pid}")
        time.sleep(600)
    # fails once rank 0 has recorded its pids (a fixed 0.3 s was not enough on a loaded
    # machine: rank 0 was stopped before it wrote its files)
    stop = time.monotonic() + 60
    while time.monotonic() < stop:
        try:
            if os.path.getsize(os.path.join(out, f"pids{n}")):
                break
        except OSError:
            pass
        time.sleep(0.01)
    sys.exit(3)
"""


def test_restarts_exhausted_fail_cleanly(tmp_path) -> None:
    script = _write(tmp_path, ALWAYS_FAILS)
    t0 = time.monotonic()
    res = _launch(["-n", "2", "--max-restarts", "2", "--grace", "1"], script, env=_env(OUT=str(tmp_path)))
    assert res.returncode == 3, res.stderr
    assert time.monotonic() - t0 < 120
    assert res.stderr.count("hpcdp-run: rank 1 exited with code 3; restarting all 2 rank(s)") == 2
    assert "(restart 1 of 2)" in res.stderr and "(restart 2 of 2)" in res.stderr
    assert "hpcdp-run: rank 1 exited with code 3; no restarts left (--max-restarts 2), giving up" \
        in res.stderr
    # three attempts, numbered 0..2, each with a secret of its own shared by its two ranks
    secrets_seen = []
    for n in range(3):
        r0 = (tmp_path / f"attempt{n}-rank0").read_text().split()
        r1 = (tmp_path / f"attempt{n}-rank1").read_text().split()
        assert r0 == r1 and r0[2] == "2", (n, r0, r1)
        secrets_seen.append(r0[0])
    assert len(set(secrets_seen)) == 3, secrets_seen
    assert not (tmp_path / "attempt3-rank0").exists()
    # the previous attempt's rank 0 and its child were dead before the next attempt started
    assert (tmp_path / "stale1").read_text() == "" and (tmp_path / "stale2").read_text() == ""
    for pid in (tmp_path / "pids2").read_text().split():
        assert not _alive(pid), f"pid {pid} of the last attempt outlived the launcher"


def _alive(pid: str) -> bool:
    try:  # a killed orphan may linger as a zombie until init reaps it: that is dead
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_without_max_restarts_a_failure_ends_the_job(tmp_path) -> None:
    script = _write(tmp_path, ALWAYS_FAILS)
    res = _launch(["-n", "2", "--grace", "1"], script, env=_env(OUT=str(tmp_path)))
    assert res.returncode == 3, res.stderr
    assert "restarting" not in res.stderr and "giving up" not in res.stderr
    assert not (tmp_path / "attempt1-rank0").exists()


def _start_and_wait_up(tmp_path, script: str, max_restarts: str) -> subprocess.Popen:
    """``hpcdp-run -n 2`` of ``script``, once both ranks of its first attempt wrote their
    ``up<rank>-0`` file (each sleeps then, waiting for a signal)."""
    proc = subprocess.Popen([sys.executable, "-m", "hpcdp.run", "-n", "2", "--max-restarts",
                             max_restarts, "--grace", "1", script], env=_env(OUT=str(tmp_path)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not ((tmp_path / "up0-0").exists() and (tmp_path / "up1-0").exists()):
        if proc.poll() is not None or time.monotonic() >= deadline:
            proc.kill()
            raise AssertionError(f"the ranks did not start: {proc.communicate()}")
        time.sleep(0.02)
    return proc


def test_signal_to_launcher_is_never_restarted(tmp_path) -> None:
    """SIGTERM (Slurm preemption or time limit) ends the job even with restarts left."""
    script = _write(tmp_path, """
        import os, time
        open(os.path.join(os.environ["OUT"], "up" + os.environ["RANK"] + "-"
                          + os.environ["HPCDP_RESTART_COUNT"]), "w").close()
        time.sleep(600)
    """)
    proc = _start_and_wait_up(tmp_path, script, "3")
    try:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, err
    assert "restarting" not in err
    assert sorted(p.name for p in tmp_path.glob("up*")) == ["up0-0", "up1-0"]


def test_sigusr1_is_forwarded_and_not_fatal(tmp_path) -> None:
    """``--signal=USR1@60`` reaches a launcher run by srun: ranks get it, the launcher lives on."""
    script = _write(tmp_path, """
        import os, signal, sys, time
        out, rank = os.environ["OUT"], os.environ["RANK"]
        got = []
        signal.signal(signal.SIGUSR1, lambda *_: got.append(1))
        open(os.path.join(out, "up" + rank), "w").close()
        deadline = time.monotonic() + 60
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
        open(os.path.join(out, "usr1-" + rank), "w").write("yes" if got else "no")
    """)
    proc = subprocess.Popen([sys.executable, "-m", "hpcdp.run", "-n", "2", script],
                            env=_env(OUT=str(tmp_path)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not ((tmp_path / "up0").exists() and (tmp_path / "up1").exists()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        proc.send_signal(signal.SIGUSR1)
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert (tmp_path / "usr1-0").read_text() == "yes" and (tmp_path / "usr1-1").read_text() == "yes"


def test_negative_max_restarts_is_refused(tmp_path) -> None:
    script = _write(tmp_path, "print('never')\n")
    res = _launch(["-n", "1", "--max-restarts", "-1"], script)
    assert res.returncode != 0 and "--max-restarts must be >= 0" in res.stderr
    assert "never" not in res.stdout


def test_attempt_secrets_are_shared_across_nodes_and_fresh_per_attempt() -> None:
    base = "s3cret"
    assert attempt_secret(base, 0) == base
    derived = [attempt_secret(base, k) for k in range(1, 5)]
    assert len(set(derived + [base])) == 5
    assert derived == [attempt_secret(base, k) for k in range(1, 5)]  # every node agrees
    assert attempt_secret("other", 1) != derived[0]


# Two launchers on this machine form one world of 2 nodes x 1 rank; rank 1 (node 1) fails once
# mid-job. Node 0's rank sees its peer go, fails, and both launchers restart on port + 1.
NODES_JOB = """
    import os, sys
    import numpy as np
    import hpcdp
    hpcdp.init()
    for i in range(200):
        x = hpcdp.allreduce(np.ones(4))
        if i == 20 and hpcdp.rank() == 1 and os.environ["HPCDP_RESTART_COUNT"] == "0":
            sys.exit(5)
    print("attempt", os.environ["HPCDP_RESTART_COUNT"], "port", os.environ["MASTER_PORT"],
          "sum", x[0], flush=True)
    hpcdp.finalize()
"""


def test_two_nodes_restart_together(tmp_path) -> None:
    from hpcdp.launch._processes import free_port

    script = _write(tmp_path, NODES_JOB)
    port = free_port()
    procs = []
    for node in (0, 1):
        env = _env(HPCDP_SECRET="multi-node-restart-secret", HPCDP_TIMEOUT="30")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "hpcdp.run", "-n", "1", "--nnodes", "2", "--node-rank",
             str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
             "--max-restarts", "2", "--grace", "1", script],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=150)
            results.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    (rc0, out0, err0), (rc1, out1, err1) = results
    assert rc0 == 0 and rc1 == 0, (err0, err1)
    assert "rank 1 exited with code 5; restarting" in err1
    assert "restarting" in err0  # node 0's rank failed too (its peer went) and restarted
    assert out0.strip() == f"[rank 0] attempt 1 port {port + 1} sum 2.0"
    assert out1.strip() == f"[rank 1] attempt 1 port {port + 1} sum 2.0"


# A preemption notice that reaches a rank before any Python of its own runs: a sitecustomize on
# PYTHONPATH (imported by the interpreter before the script) makes rank 1 send itself SIGUSR1. The
# rank must not die of it (exit 138, which --max-restarts would restart, forgetting the notice):
# the signal is remembered, ``on_preempt`` sees it, and both ranks save at the first boundary.
EARLY_SITECUSTOMIZE = """
    import os, signal
    if os.environ.get("HPCDP_RESTART_COUNT") is not None and os.environ.get("RANK") == "1":
        os.kill(os.getpid(), signal.SIGUSR1)
"""

EARLY_PREEMPT_JOB = """
    import os
    import numpy as np
    import hpcdp
    from hpcdp.checkpoint.preempt import on_preempt
    out, attempt = os.environ["OUT"], os.environ["HPCDP_RESTART_COUNT"]
    hpcdp.init()
    rank, step = hpcdp.rank(), 0
    def save():
        open(os.path.join(out, f"saved{rank}-{attempt}"), "w").write(str(step))
    preempt = on_preempt(save, requeue=False)
    open(os.path.join(out, f"requested{rank}-{attempt}"), "w").write(str(preempt.requested))
    while step < 50:
        step += 1
        hpcdp.allreduce(np.array([step]))
        preempt.check()
    open(os.path.join(out, f"finished{rank}-{attempt}"), "w").write("")
"""


def test_signal_before_the_script_runs_is_remembered_not_fatal(tmp_path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(EARLY_SITECUSTOMIZE))
    script = _write(tmp_path, EARLY_PREEMPT_JOB)
    env = _env(OUT=str(tmp_path), HPCDP_TRACE_DIR=str(tmp_path / "trace"))
    env["PYTHONPATH"] = str(site) + os.pathsep + env["PYTHONPATH"]
    res = _launch(["-n", "2", "--max-restarts", "2", "--grace", "1"], script, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "restarting" not in res.stderr and "exited with code 138" not in res.stderr
    assert (tmp_path / "requested1-0").read_text() == "True"  # seen by the preempt API
    assert (tmp_path / "requested0-0").read_text() == "False"  # rank 0 was never signalled
    # the boundary is agreed: both ranks save after step 1 of the first attempt and stop there
    assert (tmp_path / "saved0-0").read_text() == "1" and (tmp_path / "saved1-0").read_text() == "1"
    assert not list(tmp_path.glob("finished*")) and not list(tmp_path.glob("*-1"))
    assert "[rank 0] hpcdp: preempted (SIGUSR1): saving at this step boundary" in res.stderr


def test_rank_killed_by_a_forwarded_signal_is_not_restarted(tmp_path) -> None:
    """A rank that dies of the SIGUSR1 the launcher forwarded (here: it restored the default
    action) was preempted, not failed: restarting it would lose the notice."""
    script = _write(tmp_path, """
        import os, signal, time
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
        open(os.path.join(os.environ["OUT"], "up" + os.environ["RANK"] + "-"
                          + os.environ["HPCDP_RESTART_COUNT"]), "w").close()
        time.sleep(600)
    """)
    proc = _start_and_wait_up(tmp_path, script, "2")
    try:
        proc.send_signal(signal.SIGUSR1)
        # a restarted attempt would sleep for 10 minutes: stop as soon as one shows up
        deadline = time.monotonic() + 60
        while proc.poll() is None and not list(tmp_path.glob("up*-1")):
            assert time.monotonic() < deadline, "the launcher neither exited nor restarted"
            time.sleep(0.02)
        restarted = sorted(p.name for p in tmp_path.glob("up*-1"))
    finally:
        if proc.poll() is None:
            proc.kill()
        out, err = proc.communicate()
    assert not restarted, (restarted, err)
    assert "restarting all" not in err, err
    assert proc.returncode == 128 + signal.SIGUSR1, err
    assert "was killed by SIGUSR1, which hpcdp-run forwarded to it; not restarting" in err, err

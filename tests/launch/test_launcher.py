"""``hpcdp-run``: exit codes, rank prefixes, a failing rank stops the job, in-process mode."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from hpcdp.launch._slurm import expand_nodelist, node_layout, parse_nodelist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


# Ranks run through the bootstrap (hpcdp/launch/_boot.py), which must be invisible to the script:
# ``__main__``, argv, ``sys.path[0]`` (the script's directory, or the cwd for -m), sibling imports,
# the preemption signals unblocked again (and the exit code of ``sys.exit``, tested above).
AS_PYTHON_RUNS_IT = """
    import os, signal, sys
    import helper
    print(__name__, sys.argv[1:], sys.path[0] == EXPECTED_PATH0, helper.VALUE,
          sorted(s.name for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])
                 if s in (signal.SIGUSR1, signal.SIGUSR2)), flush=True)
"""


@pytest.mark.parametrize("module", [False, True])
def test_ranks_see_the_script_as_python_runs_it(tmp_path, module: bool) -> None:
    (tmp_path / "helper.py").write_text("VALUE = 'helper-ok'\n")
    path0 = "os.getcwd()" if module else "os.path.dirname(os.path.realpath(__file__))"
    (tmp_path / "job.py").write_text(textwrap.dedent(AS_PYTHON_RUNS_IT).replace(
        "EXPECTED_PATH0", path0))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    target = ["-m", "job"] if module else [str(tmp_path / "job.py")]
    res = subprocess.run([sys.executable, "-m", "hpcdp.run", "-n", "2", *target, "--lr", "0.1"],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == [
        f"[rank {r}] __main__ ['--lr', '0.1'] True helper-ok []" for r in range(2)], res.stderr


@pytest.mark.parametrize("spec, hosts", [
    ("node[01-03],gpu7", ["node01", "node02", "node03", "gpu7"]),
    ("a1", ["a1"]),
    ("c[1,3-4]", ["c1", "c3", "c4"]),
])
def test_parse_nodelist(spec: str, hosts: list[str]) -> None:
    assert parse_nodelist(spec) == hosts  # scontrol's expansion where it is installed
    assert expand_nodelist(spec) == hosts  # the built-in fallback everywhere


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

    from hpcdp.launch import _processes as _tcp_spawn
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


@pytest.mark.parametrize("spec, hosts", [
    ("r[1-2]-n[1-2]", ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]),
    ("node[1-2]-ib,x", ["node1-ib", "node2-ib", "x"]),
    ("127.0.0.1", ["127.0.0.1"]),
])
def test_parse_nodelist_suffixes_and_several_brackets(spec: str, hosts: list[str]) -> None:
    assert parse_nodelist(spec) == hosts
    assert expand_nodelist(spec) == hosts


# -- multi-node: two launchers on this machine form one world --------------------------------

NODE_JOB = """
    import os, sys
    import numpy as np
    import hpcdp
    hpcdp.init()
    x = hpcdp.allreduce(np.arange(100_000, dtype=np.float64) * (hpcdp.rank() + 1))
    ok = np.array_equal(x, np.arange(100_000) * 10.0)  # 1 + 2 + 3 + 4
    print("rank", hpcdp.rank(), "size", hpcdp.world_size(), "env", os.environ["RANK"],
          os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"], "ok", ok)
    if hpcdp.rank() == int(os.environ.get("FAIL_RANK", "-1")):
        sys.exit(4)
    for _ in range(int(os.environ.get("ROUNDS", "0"))):
        hpcdp.allreduce(x)
    hpcdp.finalize()
"""


def _slurm_env(node: int) -> dict[str, str]:
    return {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "127.0.0.1,127.0.0.1",
            "SLURM_NNODES": "2", "SLURM_STEP_NODELIST": "127.0.0.1,127.0.0.1",
            "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NODEID": str(node)}


def _run_nodes(tmp_path, mode: str, extra: dict[str, str],
               within: float = 60) -> tuple[list[subprocess.CompletedProcess], float]:
    """Start one launcher per node (2 nodes x 2 ranks) on this machine; wait for both."""
    from hpcdp.launch._processes import free_port

    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(NODE_JOB))
    port = str(free_port())
    procs = []
    t0 = time.monotonic()
    for node in (0, 1):
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("OMPI_", "PMI", "SLURM", "HPCDP_", "MASTER_"))}
        env.update(extra, PYTHONPATH=ROOT, HPCDP_SECRET="multi-node-test-secret")
        args = ["-n", "2", "--master-port", port]
        if mode == "flags":
            args += ["--nnodes", "2", "--node-rank", str(node), "--master-addr", "127.0.0.1"]
        else:
            env.update(_slurm_env(node))
        procs.append(subprocess.Popen([sys.executable, "-m", "hpcdp.run", *args, str(path)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, within - (time.monotonic() - t0)))
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return results, time.monotonic() - t0


@pytest.mark.parametrize("mode", ["flags", "slurm"])
def test_two_launchers_form_one_world(tmp_path, mode: str) -> None:
    (n0, n1), _ = _run_nodes(tmp_path, mode, {})
    assert n0.returncode == 0 and n1.returncode == 0, (n0.stderr, n1.stderr)
    lines = sorted(n0.stdout.splitlines() + n1.stdout.splitlines())
    assert lines == [f"[rank {r}] rank {r} size 4 env {r} 4 {r % 2} ok True" for r in range(4)]
    assert all(line.startswith(("[rank 0]", "[rank 1]")) for line in n0.stdout.splitlines())
    assert all(line.startswith(("[rank 2]", "[rank 3]")) for line in n1.stdout.splitlines())


def test_failing_rank_on_one_node_fails_both_nodes(tmp_path) -> None:
    """Rank 3 (node 1) exits 4: node 1's launcher stops rank 2 and exits 4; node 0's ranks
    see their peers go and raise PeerFailureError (not a timeout), so node 0 fails too."""
    (n0, n1), elapsed = _run_nodes(tmp_path, "flags", {"FAIL_RANK": "3", "ROUNDS": "100000"})
    assert n1.returncode == 4, n1.stderr
    assert n0.returncode != 0, n0.stderr
    assert "PeerFailureError" in n0.stderr, n0.stderr
    assert "CommTimeoutError" not in n0.stderr, n0.stderr
    assert elapsed < 30


# -- SLURM: nodes, node rank and master from the environment ---------------------------------

@pytest.mark.parametrize("flags, env, expected", [
    ((None, None, None), {}, (1, 0, "127.0.0.1")),
    ((2, 1, "10.0.0.5"), {}, (2, 1, "10.0.0.5")),
    # a SLURM variable without a SLURM job is not a SLURM job
    ((None, None, None), {"SLURM_NODELIST": "n[1-4]", "SLURM_NODEID": "2"}, (1, 0, "127.0.0.1")),
    # the batch script itself: the job's nodes
    ((None, None, None), {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node[01-04]",
                          "SLURM_NNODES": "4", "SLURM_NODEID": "0"}, (4, 0, "node01")),
    ((None, None, None), {"SLURM_JOB_ID": "7", "SLURM_NODELIST": "gpu[3-5]",
                          "SLURM_JOB_NUM_NODES": "3", "SLURM_NODEID": "2"}, (3, 2, "gpu3")),
    # inside an srun step on part of the job: the step's nodes, not the job's
    ((None, None, None), {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node[01-04]",
                          "SLURM_NNODES": "4", "SLURM_STEP_NODELIST": "node[03-04]",
                          "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2",
                          "SLURM_NODEID": "1"}, (2, 1, "node03")),
    # no node count: the length of the nodelist
    ((None, None, None), {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "a,b",
                          "SLURM_NODEID": "1"}, (2, 1, "a")),
    # flags win over SLURM
    ((1, 0, "127.0.0.1"), {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node[01-04]",
                           "SLURM_NNODES": "4", "SLURM_NODEID": "3"}, (1, 0, "127.0.0.1")),
    ((None, None, "10.1.1.1"), {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node[01-02]",
                                "SLURM_NNODES": "2", "SLURM_NODEID": "1"}, (2, 1, "10.1.1.1")),
])
def test_node_layout_from_slurm(flags, env, expected) -> None:
    assert node_layout(*flags, env) == expected


@pytest.mark.parametrize("env, message", [
    ({"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_NUM_NODES": "2",
      "SLURM_STEP_NUM_TASKS": "8", "SLURM_NODEID": "0"}, "one launcher per node"),
    ({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NNODES": "2",
      "SLURM_NODEID": "x"}, "SLURM_NODEID='x' is not a number"),
    ({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NNODES": "2",
      "SLURM_NODEID": "2"}, "--node-rank 2 is outside --nnodes 2"),
])
def test_node_layout_rejects_bad_slurm_environment(env, message) -> None:
    with pytest.raises(SystemExit, match=message):
        node_layout(None, None, None, env)


def test_main_launches_with_the_slurm_layout(monkeypatch) -> None:
    import hpcdp.launch.cli as run

    calls = []
    monkeypatch.setattr(run, "launch", lambda cmd, nproc, **kw: calls.append((cmd, nproc, kw)) or 0)
    for k in [k for k in os.environ if k.startswith("SLURM")]:
        monkeypatch.delenv(k)
    for k, v in {"SLURM_JOB_ID": "9", "SLURM_STEP_NODELIST": "cn[100-101]",
                 "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2",
                 "SLURM_NODEID": "1"}.items():
        monkeypatch.setenv(k, v)
    assert run.main(["-n", "4", "--master-port", "29999", "train.py", "--lr", "1"]) == 0
    (cmd, nproc, kw), = calls
    assert cmd[-3:] == ["train.py", "--lr", "1"] and nproc == 4
    assert kw == {"nnodes": 2, "node_rank": 1, "master_addr": "cn100", "master_port": 29999,
                  "grace": run.GRACE, "max_restarts": 0}

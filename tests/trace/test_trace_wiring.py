"""The collective layer's own recording: what ``ProcessGroup``/``Work``/p2p put in the flight
recorder (no test code calls ``begin``/``end`` here), the dumps its errors trigger, the switch
``HPCDP_FLIGHT_RECORDER=0``, and a real DDP job's timeline, straggler report and checkpoint spans."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import hpcdp
from hpcdp import trace
from hpcdp.errors import CommTimeoutError

from conftest import SPAWN_BACKENDS, job_env, run_ranks



@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    monkeypatch.setenv("HPCDP_TRACE_DIR", str(tmp_path / "trace"))
    monkeypatch.setenv("HPCDP_TRACE_DUMP_INTERVAL", "0")  # every error dumps: no rate limit between tests
    trace.reset()
    trace._dump.reset_hooks_for_tests()
    yield
    trace.reset()


def _ops_body(rank: int) -> list[tuple]:
    g = hpcdp.get_default_group()
    x = np.arange(3, dtype=np.float32)
    g.allreduce(x)                                  # the latency path
    g.allreduce(x.reshape(3, 1), op="mean")         # the general path
    g.broadcast(x, root=1)
    g.allreduce(x, async_op=True).wait()            # Work
    if rank == 0:
        g.send(x, 1, tag=5)
        g.isend(x, 1, tag=6).wait()
    else:
        g.recv(np.empty(3, np.float32), 0, tag=5)
        g.irecv(np.empty(3, np.float32), 0, tag=6).wait()
    rec = trace.recorder(g.ranks[g.rank])
    return [(o.op, o.seq, tuple(o.shape) if o.shape is not None else None, str(o.dtype), o.peer, o.state,
             o.end_ns is not None and o.end_ns >= o.start_ns) for o in rec.snapshot()]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", SPAWN_BACKENDS)
def test_every_call_is_recorded_by_the_collective_layer(backend: str) -> None:
    out = run_ranks(backend, 2, _ops_body)
    for rank, ops in enumerate(out):
        coll = [o for o in ops if o[1] > 0]
        assert [(o[0], o[1]) for o in coll] == [("allreduce", 1), ("allreduce", 2), ("broadcast", 3),
                                                ("allreduce", 4)], ops
        assert coll[0][2] == (3,) and coll[1][2] == (3, 1) and coll[0][3] == "float32"
        assert coll[2][4] == 1 and coll[0][4] == -1  # root, or -1
        p2p = [o for o in ops if o[1] == 0 and o[0] in ("send", "recv")]
        want = "send" if rank == 0 else "recv"
        assert [(o[0], o[4]) for o in p2p] == [(want, 1 - rank)] * 2, ops
        assert all(o[5] == trace.COMPLETED and o[6] for o in ops), ops


def _timeout_body(rank: int, directory: str, given_up: threading.Event) -> tuple[str, str, bool]:
    g = hpcdp.get_default_group()
    if rank == 1:
        given_up.wait(30)  # never joins; stays alive until rank 0 has given up (simulated ranks)
        return "", "", True
    try:
        w = g.allreduce(np.ones(2), async_op=True)
        try:
            w.wait(timeout=0.3)
        except CommTimeoutError:
            pass
        else:
            raise AssertionError("rank 1 never joined: the wait must time out")
        last = trace.recorder(0).snapshot()[-1]
        return last.op, last.state, os.path.exists(os.path.join(directory, "flight-rank0.json"))
    finally:
        given_up.set()


@pytest.mark.timeout(120)
def test_a_timed_out_work_is_marked_and_dumped(tmp_path) -> None:
    d = str(tmp_path / "trace")
    (op, state, dumped), _ = hpcdp.spawn(_timeout_body, 2, args=(d, threading.Event()), timeout=30,
                                         join_timeout=60)
    assert (op, state, dumped) == ("allreduce", trace.TIMED_OUT, True)
    doc = json.loads((tmp_path / "trace" / "flight-rank0.json").read_text())
    assert doc["reason"].startswith("CommTimeoutError: allreduce #1 on group world (rank 0 of 2)")
    (e,) = [e for e in doc["entries"] if e["op"] == "allreduce"]
    assert e["state"] == "timed out" and e["line"].startswith(f"{__file__}:")  # the caller's line


def _count_body(rank: int) -> tuple[bool, int]:
    g = hpcdp.get_default_group()
    g.allreduce(np.ones(2))
    g.barrier()
    return g._rec is None, trace.recorder(rank).total()


@pytest.mark.timeout(120)
def test_recorder_off_records_nothing(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("HPCDP_FLIGHT_RECORDER", "0")
    trace.reset()
    assert run_ranks("sim", 2, _count_body) == [(True, 0), (True, 0)]
    assert trace.dump("requested") == [] and not (tmp_path / "trace").exists()


def _raising_body(rank: int) -> None:
    hpcdp.allreduce(np.ones(2))
    if rank == 1:
        raise RuntimeError("boom")
    hpcdp.barrier()  # rank 1 never comes: PeerFailureError


@pytest.mark.timeout(120)
def test_spawn_dumps_every_rank_when_one_raises(tmp_path) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        hpcdp.spawn(_raising_body, 3, timeout=30, join_timeout=60)
    d = tmp_path / "trace"
    assert sorted(os.listdir(d)) == [f"flight-rank{r}.json" for r in range(3)]
    reasons = json.loads((d / "flight-rank1.json").read_text())["reasons"]
    assert any(r.startswith("uncaught RuntimeError on simulated rank 1: boom") for r in reasons), reasons


# -- a real job: DDP, HPCDP_TRACE timeline, HPCDP_STRAGGLER report, checkpoint phases ------------

JOB = textwrap.dedent('''
    import os, time
    import numpy as np
    import hpcdp
    from hpcdp import nn, optim

    hpcdp.init()
    rank = hpcdp.rank()
    model = nn.Sequential(nn.Linear(8, 16, seed=0), nn.ReLU(), nn.Linear(16, 4, seed=1))
    ddp = hpcdp.DDP(model)
    opt = optim.SGD(ddp.parameters(), lr=0.1)
    loss_fn = nn.CrossEntropyLoss()
    x = np.random.default_rng(rank).standard_normal((4, 8)).astype(np.float32)
    y = np.arange(4) % 4
    for step in range(4):
        if rank == 1:
            time.sleep(0.1)  # the straggler
        loss_fn(ddp(x), y)
        ddp.backward(loss_fn.backward())
        opt.step(); opt.zero_grad()
    hpcdp.checkpoint.save(os.path.join(os.environ["CKPT"], "step-4"), {"model": ddp.state_dict()})
    hpcdp.finalize()
''')

LAUNCH = {
    "tcp": lambda s: [sys.executable, "-m", "hpcdp.run", "-n", "2", s],
    "mpirun": lambda s: ["mpirun", "-n", "2", "--oversubscribe", sys.executable, "-m", "hpcdp.run", s],
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("launcher", list(LAUNCH))  # not "mpi": pytest-mpi would skip it
def test_ddp_job_timeline_stragglers_and_checkpoint_spans(tmp_path, launcher: str) -> None:
    script = tmp_path / "train.py"
    script.write_text(JOB)
    env = job_env(HPCDP_TRACE="1", HPCDP_STRAGGLER="2", CKPT=str(tmp_path / "ckpt"),
                  HPCDP_TRACE_DIR=str(tmp_path / "trace"))
    job = subprocess.run(LAUNCH[launcher](str(script)), capture_output=True, text=True, timeout=200,
                         env=env, stdin=subprocess.DEVNULL, cwd=tmp_path)
    out = job.stdout + job.stderr
    assert job.returncode == 0, out
    # HPCDP_STRAGGLER=2: rank 0 reports after steps 2 and 4, and rank 1 is the late one
    reports = [l for l in out.splitlines() if "hpcdp stragglers steps" in l]
    assert len(reports) == 2 and "steps 1-2" in reports[0] and "steps 3-4" in reports[1], out
    assert all(l.split(": ", 1)[1].startswith("rank 1 arrives") for l in reports), reports
    for r in range(2):
        doc = json.loads((tmp_path / "trace" / f"trace-rank{r}.json").read_text())
        evs = [e for e in doc["traceEvents"] if e["ph"] != "M"]
        names = [e["name"] for e in evs]
        assert names.count("backward") == 4 and names.count("wait gradients") == 4, names
        ready = [e for e in evs if e["name"] == "bucket ready"]
        assert len(ready) >= 4 and all(e["args"]["in_flight"] >= 1 for e in ready), ready[:2]
        assert {"checkpoint.plan", "checkpoint.write", "checkpoint.fsync", "checkpoint.commit"} <= set(names)
        ar = [e for e in evs if e.get("cat") == "collective" and e["name"] == "allreduce"]
        assert len(ar) >= 4 and all(e["args"]["line"] for e in ar), ar[:2]
        assert {e["args"].get("peer") for e in evs if e.get("cat") == "p2p"} <= {0, 1}  # clock sync
        assert doc["otherData"]["rank"] == r
    merged = subprocess.run([sys.executable, "-m", "hpcdp.trace", "merge", str(tmp_path / "trace"), "-o",
                             str(tmp_path / "merged.json")], capture_output=True, text=True, timeout=120,
                            env=env)
    assert merged.returncode == 0, merged.stderr
    evs = [e for e in json.loads((tmp_path / "merged.json").read_text())["traceEvents"] if e["ph"] != "M"]
    assert {e["pid"] for e in evs} == {0, 1}


def _small_ring_body(rank: int) -> list[tuple[int, str]]:
    g = hpcdp.get_default_group()
    for _ in range(10):
        g.allreduce(np.ones(2, np.float32))  # the latency path writes the ring inline
    return [(o.seq, o.state) for o in trace.recorder(rank).snapshot()]


@pytest.mark.timeout(120)
def test_the_latency_path_keeps_the_last_n_in_a_small_ring(monkeypatch) -> None:
    monkeypatch.setenv("HPCDP_FLIGHT_RECORDER", "4")
    trace.reset()
    for ops in run_ranks("sim", 2, _small_ring_body):
        assert ops == [(s, trace.COMPLETED) for s in (7, 8, 9, 10)], ops

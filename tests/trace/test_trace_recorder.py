"""The flight recorder: ring semantics, thread safety, dumps and the hooks that trigger them."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

from hpcdp import trace
from hpcdp.trace import hooks
from hpcdp.trace import COMPLETED, FAILED, STARTED, TIMED_OUT, Recorder
from hpcdp.trace._dump import reset_hooks_for_tests

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.abspath(__file__)


@pytest.fixture(autouse=True)
def fresh():
    trace.reset()
    reset_hooks_for_tests()
    yield
    trace.reset()
    reset_hooks_for_tests()


class FakeGroup:
    def __init__(self, name: str, ranks: tuple[int, ...], rank: int) -> None:
        self.name, self.ranks, self.rank = name, ranks, rank


def test_begin_end_records_every_field() -> None:
    rec = Recorder(3, 8)
    g = FakeGroup("world", (0, 1, 2, 3), 3)
    tok = rec.begin("broadcast", g, 7, (2, 5), np.dtype("float32"), 0)
    rec.end(tok)
    tok2 = rec.begin("recv", g, 0, (4,), np.dtype("int64"), 1)
    (a, b) = rec.snapshot()
    assert (a.id, a.op, a.group, a.seq, a.shape, str(a.dtype), a.peer, a.state) == \
        (tok, "broadcast", g, 7, (2, 5), "float32", 0, COMPLETED)
    assert a.end_ns is not None and a.end_ns >= a.start_ns
    assert a.thread == threading.get_ident()
    assert a.line is None  # lines are off by default: the hot path does not walk the stack
    assert (b.id, b.state, b.end_ns) == (tok2, STARTED, None)


def test_ring_keeps_last_n_and_counts_total() -> None:
    rec = Recorder(0, 4)
    toks = [rec.begin("allreduce", "world", i + 1) for i in range(10)]
    for t in toks:
        rec.end(t)
    snap = rec.snapshot()
    assert [o.seq for o in snap] == [7, 8, 9, 10]
    assert all(o.state == COMPLETED for o in snap)
    assert rec.total() == 10


def test_end_of_an_overwritten_entry_is_not_misattributed() -> None:
    rec = Recorder(0, 2)
    old = rec.begin("allreduce", "world", 1)
    newer = [rec.begin("allreduce", "world", s) for s in (2, 3)]  # slot of `old` reused by seq 3
    rec.end(old, TIMED_OUT)
    snap = {o.seq: o for o in rec.snapshot()}
    assert set(snap) == {2, 3}
    assert snap[3].state == STARTED, "the late end of seq 1 must not finish seq 3"
    rec.end(newer[1])
    assert {o.seq: o.state for o in rec.snapshot()}[3] == COMPLETED


def test_failure_states_record_the_callers_line() -> None:
    rec = Recorder(0, 8)
    t1 = rec.begin("allreduce", "world", 1)
    rec.end(t1, TIMED_OUT); line_timeout = sys._getframe().f_lineno
    t2 = rec.begin("barrier", "world", 2)
    rec.end(t2, FAILED)
    a, b = rec.snapshot()
    assert a.state == TIMED_OUT and a.line and a.line.startswith(f"{HERE}:{line_timeout} ")
    assert b.state == FAILED and f"{HERE}:" in b.line
    with pytest.raises(ValueError, match="state must be one of"):
        rec.end(rec.begin("x", "world"), "exploded")


def test_lines_mode_records_every_callers_line() -> None:
    rec = Recorder(0, 8, lines=True)
    tok = rec.begin("allreduce", "world", 1); here = sys._getframe().f_lineno
    rec.end(tok)
    (o,) = rec.snapshot()
    assert o.line.startswith(f"{HERE}:{here} (test_lines_mode_records_every_callers_line)")


def test_lines_are_kept_per_call_site_not_per_function() -> None:
    """Source lines are looked up once per call site (by code and instruction offset): repeated
    calls from one site share one entry, while other sites of the same function, on other lines
    or on the same line, get their own."""
    rec = Recorder(0, 16, lines=True)

    @hooks.hide_frames  # a wrapper: the line is its caller's
    def call() -> None:
        rec.end(rec.begin("allreduce", "world", 1))

    first = sys._getframe().f_lineno + 2
    for _ in range(3):
        call()
    call(); call(); second = sys._getframe().f_lineno  # noqa: E702
    ops = rec.snapshot()
    assert [o.where[1] for o in ops] == [first] * 3 + [second] * 2, [o.line for o in ops]
    me = sys._getframe().f_code
    assert all(o.where[0] is me for o in ops)
    assert ops[0].where is ops[1].where is ops[2].where  # one site, one entry
    assert ops[3].where is not ops[4].where  # two calls on one line: two sites
    assert ops[0].line.startswith(f"{HERE}:{first} (test_lines_are_kept_per_call_site_not_per_function)")


def test_pinned_line_names_the_call_around_what_it_starts() -> None:
    """Operations started deep inside a ``pinned_line`` block take the block's line (DDP's backward:
    one shallow stack walk instead of one deep walk per bucket); outside it, their own caller's."""
    trace.configure(lines=True)
    rec = Recorder(0, 8, lines=True)

    def deep(n: int) -> int:
        return deep(n - 1) if n else rec.begin("allreduce", "world", 1)

    pin = sys._getframe().f_lineno + 1
    with hooks.pinned_line():
        rec.end(deep(5))
        with hooks.pinned_line():  # nested: the outer call stays the user's line
            rec.end(deep(3))
    rec.end(deep(2))
    inner = deep.__code__.co_firstlineno + 1
    lines = [o.line for o in rec.snapshot()]
    assert lines[0].startswith(f"{HERE}:{pin} ") and lines[1].startswith(f"{HERE}:{pin} "), lines
    assert lines[2].startswith(f"{HERE}:{inner} (deep)"), lines


def test_pinned_line_costs_nothing_without_lines() -> None:
    trace.configure(lines=False)
    rec = Recorder(0, 8, lines=True)
    with hooks.pinned_line():
        tok = rec.begin("allreduce", "world", 1); here = sys._getframe().f_lineno  # noqa: E702
    rec.end(tok)
    assert rec.snapshot()[0].line.startswith(f"{HERE}:{here} ")


def test_capacity_zero_is_off() -> None:
    rec = Recorder(0, 0)
    assert rec.begin("allreduce", "world", 1) == 0
    rec.end(0)
    assert rec.snapshot() == [] and rec.total() == 0


def test_concurrent_threads_lose_nothing() -> None:
    rec = Recorder(0, 4096)
    per, nthreads = 400, 8

    def work(k: int) -> None:
        for i in range(per):
            t = rec.begin("allreduce", f"g{k}", i + 1)
            rec.end(t, COMPLETED if i % 2 == 0 else FAILED)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(nthreads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    snap = rec.snapshot()
    assert len(snap) == per * nthreads and len({o.id for o in snap}) == per * nthreads
    for k in range(nthreads):
        mine = [o for o in snap if o.group == f"g{k}"]
        assert [o.seq for o in mine] == list(range(1, per + 1))
        assert all(o.state == (COMPLETED if o.seq % 2 == 1 else FAILED) for o in mine)


def test_registry_env_and_rank_binding(monkeypatch) -> None:
    monkeypatch.setenv("HPCDP_FLIGHT_RECORDER", "16")
    trace.reset()
    assert trace.recorder(5).capacity == 16 and trace.recorder(5) is trace.recorder(5)
    assert hooks.active_recorder(5) is trace.recorder(5)
    seen = {}

    def thread() -> None:
        trace.bind_rank(9)
        seen["rec"] = trace.recorder()

    t = threading.Thread(target=thread)
    t.start()
    t.join(10)
    assert seen["rec"].rank == 9
    monkeypatch.setenv("HPCDP_FLIGHT_RECORDER", "0")
    trace.reset()
    assert hooks.active_recorder(1) is None
    monkeypatch.setenv("HPCDP_FLIGHT_RECORDER", "lots")
    trace.reset()
    with pytest.raises(ValueError, match="HPCDP_FLIGHT_RECORDER='lots'"):
        trace.recorder(0)


def test_dump_writes_one_valid_file_per_rank(tmp_path) -> None:
    g = FakeGroup("world", (0, 1), 0)
    for r in (0, 1):
        rec = trace.recorder(r)
        rec.end(rec.begin("allreduce", FakeGroup("world", (0, 1), r), 1, (3,), np.dtype("float64")))
    trace.recorder(0).begin("barrier", g, 2)
    paths = trace.dump("unit test", directory=tmp_path)
    assert sorted(os.path.basename(p) for p in paths) == ["flight-rank0.json", "flight-rank1.json"]
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
    doc = json.loads((tmp_path / "flight-rank0.json").read_text())
    assert doc["format"] == "hpcdp.flight/1" and doc["rank"] == 0 and doc["reason"] == "unit test"
    e0, e1 = doc["entries"]
    assert e0 == {**e0, "op": "allreduce", "seq": 1, "group": "world", "group_ranks": [0, 1],
                  "group_rank": 0, "shape": [3], "dtype": "float64", "peer": -1, "state": "completed"}
    assert e1["state"] == "started" and e1["end_ns"] is None
    # the dump was called by this test, not from inside a blocked operation: no line is guessed
    assert e1["line"] is None
    assert doc["threads"][0]["name"] == threading.current_thread().name


def _blocked_body(rank: int, directory: str) -> int:
    """Rank 1 blocks in a real allreduce; rank 0 dumps while it waits, then joins it."""
    import time

    import hpcdp

    if rank == 1:  # recorded by the collective layer itself
        line = sys._getframe().f_lineno + 1
        hpcdp.allreduce(np.ones(2))
        return line
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # until rank 1's thread is inside hpcdp's wait
        ops = trace.recorder(1).snapshot()
        frame = sys._current_frames().get(ops[0].thread) if ops else None
        if frame is not None and trace._dump._in_pkg(frame) is False and any(
                trace._dump._in_pkg(f) for f in _frames(frame)):
            break
        time.sleep(0.01)
    trace.dump("while rank 1 waits", directory=directory)
    hpcdp.allreduce(np.ones(2))
    return 0


def _frames(f):
    while f is not None:
        yield f
        f = f.f_back


@pytest.mark.timeout(120)
def test_dump_takes_a_blocked_ranks_line_from_its_stack(tmp_path) -> None:
    import hpcdp

    _, line = hpcdp.spawn(_blocked_body, 2, args=(str(tmp_path),), timeout=30, join_timeout=60)
    doc = json.loads((tmp_path / "flight-rank1.json").read_text())
    (e,) = doc["entries"]
    assert e["state"] == "started", e
    assert e["line"].startswith(f"{HERE}:{line} (_blocked_body)"), e
    (t,) = doc["threads"]
    assert t["in_hpcdp"] and t["line"] == e["line"]


def test_dump_never_raises_into_the_error_path(tmp_path, capsys) -> None:
    trace.recorder(0).begin("allreduce", "world", 1)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert trace.dump("timeout", directory=blocker) == []
    assert "could not write the flight record" in capsys.readouterr().err
    with pytest.raises(NotADirectoryError):
        trace.dump("timeout", directory=blocker, raise_errors=True)


def test_on_error_ends_dumps_and_rate_limits(tmp_path, monkeypatch) -> None:
    from hpcdp.errors import CollectiveMismatchError, CommTimeoutError, PeerFailureError

    monkeypatch.setenv("HPCDP_TRACE_DIR", str(tmp_path))
    monkeypatch.setenv("HPCDP_TRACE_DUMP_INTERVAL", "3600")
    rec = trace.recorder(0)
    t1, t2, t3 = (rec.begin("allreduce", "world", s) for s in (1, 2, 3))
    hooks.on_error(rec, t1, CollectiveMismatchError("allreduce #1: shapes differ"))
    assert not os.listdir(tmp_path)  # a mismatch raises on every rank at once: no dump needed
    hooks.on_error(rec, t2, CommTimeoutError("allreduce #2 timed out"))
    doc = json.loads((tmp_path / "flight-rank0.json").read_text())
    assert doc["reason"] == "CommTimeoutError: allreduce #2 timed out"
    assert [e["state"] for e in doc["entries"]] == ["failed", "timed out", "started"]
    hooks.on_error(rec, t3, PeerFailureError("rank 1 died"))  # within the interval: not rewritten
    assert json.loads((tmp_path / "flight-rank0.json").read_text())["reason"] == doc["reason"]
    assert rec.snapshot()[2].state == FAILED
    monkeypatch.setenv("HPCDP_TRACE_DUMP_INTERVAL", "0")
    hooks.on_error(None, 0, PeerFailureError("rank 1 died"))
    assert json.loads((tmp_path / "flight-rank0.json").read_text())["reason"] == "PeerFailureError: rank 1 died"


def _run(code: str, tmp_path, timeout: float = 60, **popen) -> subprocess.CompletedProcess:
    env = dict(os.environ, HPCDP_TRACE_DIR=str(tmp_path / "dumps"),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env, stdin=subprocess.DEVNULL, **popen)


@pytest.mark.timeout(120)
def test_uncaught_exception_dumps_at_exit(tmp_path) -> None:
    proc = _run("""
        from hpcdp import trace
        from hpcdp.trace import hooks
        hooks.install(0, 2)
        rec = trace.recorder()
        rec.end(rec.begin("allreduce", "world", 1))
        rec.begin("barrier", "world", 2)
        raise RuntimeError("boom on purpose")
    """, tmp_path)
    assert proc.returncode == 1 and "boom on purpose" in proc.stderr, proc.stderr
    doc = json.loads((tmp_path / "dumps" / "flight-rank0.json").read_text())
    assert doc["world_size"] == 2
    assert doc["reason"].startswith("exit after uncaught RuntimeError: boom on purpose")
    assert [e["state"] for e in doc["entries"]] == ["completed", "started"]


@pytest.mark.timeout(120)
def test_sigusr1_dumps_and_chains_to_the_previous_handler(tmp_path) -> None:
    proc = _run("""
        import os, signal, sys, time
        got = []
        signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))   # e.g. a preemption helper
        from hpcdp import trace
        from hpcdp.trace import hooks
        hooks.install(1, 2)
        rec = trace.recorder()
        rec.begin("allreduce", "world", 1)
        os.kill(os.getpid(), signal.SIGUSR1)
        for _ in range(500):
            if got:
                break
            time.sleep(0.01)
        print("chained" if got else "not chained")
    """, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "chained" in proc.stdout.split()
    doc = json.loads((tmp_path / "dumps" / "flight-rank1.json").read_text())
    assert doc["reason"] == "signal SIGUSR1" and doc["entries"][0]["op"] == "allreduce"


def test_install_from_a_thread_only_binds_the_rank() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    err = []

    def thread() -> None:
        try:
            hooks.install(2, 4)
            assert trace.recorder().rank == 2
        except BaseException as exc:  # noqa: BLE001 - reported below
            err.append(exc)

    t = threading.Thread(target=thread)
    t.start()
    t.join(10)
    assert not err, err
    assert signal.getsignal(signal.SIGUSR1) is before
    with pytest.raises(ValueError, match="rank 4 is not in"):
        hooks.install(4, 4)


def test_late_end_of_a_forgotten_entry_keeps_the_newer_ones_end() -> None:
    rec = Recorder(0, 2)
    old = rec.begin("allreduce", "world", 1)
    mid = rec.begin("allreduce", "world", 2)
    new = rec.begin("allreduce", "world", 3)     # takes the slot of seq 1
    rec.end(new)
    rec.end(mid)
    rec.end(old)                                 # an async op finishing after newer ones
    assert {o.seq: o.state for o in rec.snapshot()} == {2: COMPLETED, 3: COMPLETED}
    rec2 = Recorder(0, 2)
    old = rec2.begin("allreduce", "world", 1)
    new = [rec2.begin("allreduce", "world", s) for s in (2, 3)]
    rec2.end(new[1])
    rec2.end(old, FAILED)                        # the error path too
    assert {o.seq: o.state for o in rec2.snapshot()}[3] == COMPLETED


def test_dump_never_writes_through_a_planted_symlink(tmp_path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("precious")
    d = tmp_path / "trace"
    d.mkdir()
    rec = trace.recorder(0)
    rec.end(rec.begin("allreduce", "world", 1))
    tmp = d / f".flight-rank0.{os.getpid()}.{threading.get_ident()}.tmp"   # the name once used
    os.symlink(outside, tmp)
    os.symlink(outside, d / "flight-rank0.json")
    # the temporary is a fresh random name created exclusively; the link at the final name is
    # replaced by the rename, never followed
    assert trace.dump("t", directory=d) == [str(d / "flight-rank0.json")]
    assert outside.read_text() == "precious"
    assert not os.path.islink(d / "flight-rank0.json") and os.path.islink(tmp)
    assert sorted(os.listdir(d)) == sorted([tmp.name, "flight-rank0.json"])

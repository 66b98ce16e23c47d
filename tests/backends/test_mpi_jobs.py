"""Whole MPI jobs as subprocesses, for what a test inside one job cannot see: how ranks exit,
whether ``MPI_Finalize`` crashes, and what a script that imports mpi4py before hpcdp gets.

Each job runs under ``mpirun`` with a hard wall-clock cap and the test checks every exit code, so
a regression shows as a failure (a segfault is exit code 139 or signal 11), never as a hung job.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CAP = 120.0


def _job(tmp_path, body: str, n: int = 2, env: dict[str, str] | None = None,
         module: list[str] | None = None) -> tuple[int, str]:
    """Run ``body`` (or ``python -m module...``) on ``n`` MPI ranks; (exit code, all output)."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(body))
    full_env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                    PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                    PYTHONFAULTHANDLER="1")
    for k in ("HPCDP_BACKEND", "HPCDP_DEBUG", "HPCDP_TIMEOUT"):
        full_env.pop(k, None)
    full_env.update(env or {})
    cmd = ["mpirun", "-n", str(n), "--oversubscribe", sys.executable]
    cmd += ["-m", *module] if module else [str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=CAP, env=full_env,
                          stdin=subprocess.DEVNULL, cwd=str(tmp_path))
    return proc.returncode, proc.stdout + proc.stderr


def _results(tmp_path) -> list[str]:
    """What each rank wrote to ``result-<rank>.txt`` (stdout lines of ranks can interleave)."""
    return [p.read_text() for p in sorted(tmp_path.glob("result-*.txt"))]


def _no_crash(code: int, out: str) -> None:
    assert code not in (139, -11, 134, -6), out
    for sign in ("Segmentation fault", "signal 11", "Fatal Python error", "Aborted"):
        assert sign not in out, out


# Rank 0 starts a 32 MiB allreduce and leaves while it is in flight; rank 1 joins it later. Before
# the fix, rank 0's buffer was freed during interpreter shutdown and MPI_Finalize wrote into it.
_LEAVE = """
    import os, sys, time
    import numpy as np
    import hpcdp

    hpcdp.init("mpi", timeout=60)
    {grace}
    if hpcdp.rank() == 0:
        work = hpcdp.allreduce(np.ones({count}), async_op=True)
        pending_recv = hpcdp.irecv(np.empty(1 << 16), 1, tag=5)   # never sent: withdrawn at exit
        {leave}
    else:
        {late}
        try:
            text = f"rank 1 result {{hpcdp.allreduce(np.ones({count}))[0]}}"
        except hpcdp.PeerFailureError as exc:
            text = f"rank 1 told: {{exc}}"
        with open("result-1.txt", "w") as fh:
            fh.write(text)
"""


# Rank 0 writes ``gave-up`` at the end of its exit handler (``_requests._at_exit``, whose last
# step is ``_tuning.release``): after it stopped waiting for what is in flight and told the
# others so (a file written when the wait ended, before the notice, let rank 1 join in between)
_GAVE_UP_FILE = ("from hpcdp.backends.mpi import _requests, _tuning; _rel = _tuning.release; "
                 "_tuning.release = lambda: (_rel(), open('gave-up', 'w').close())[0]")

# 32 MiB: an Iallreduce; 3 elements: a persistent request (``mpi._fastpath``)
_COUNTS = pytest.mark.parametrize("count", ["4 << 20", "3"], ids=["ring", "persistent"])


@pytest.mark.timeout(CAP + 30)
@pytest.mark.parametrize("leave,code", [
    ("sys.exit(0)", 0),
    ("raise RuntimeError('rank 0 gives up')", 1),
    ("hpcdp.finalize(); sys.exit(0)", 0),
])
@_COUNTS
def test_leaving_with_an_operation_in_flight_does_not_crash(tmp_path, leave: str, code: int,
                                                           count: str) -> None:
    """Rank 1 joins within the exit grace period: the operation completes, both exit cleanly.
    Where rank 0 exits cleanly the grace is long (30 s, not the default 2 s) so that a loaded
    machine cannot make rank 1 late; rank 0 waits only until the operation completes, so the
    test takes no longer. (A rank 0 that raised waits out its whole grace, and only the exit
    code and message are checked there: its grace stays the default.)"""
    grace = ("from hpcdp.backends.mpi import _requests; _requests.EXIT_GRACE = 30.0"
             if code == 0 else "pass")
    rc, out = _job(tmp_path, _LEAVE.format(leave=leave, late="time.sleep(0.5)", count=count,
                                           grace=grace))
    _no_crash(rc, out)
    assert rc == code, out
    if code == 0:
        assert _results(tmp_path) == ["rank 1 result 2.0"], out
    else:
        assert "rank 0 gives up" in out, out


@pytest.mark.timeout(CAP + 30)
@pytest.mark.parametrize("leave", ["sys.exit(0)", "hpcdp.finalize(); sys.exit(0)"])
@_COUNTS
def test_peer_joining_after_the_grace_period_is_told(tmp_path, leave: str, count: str) -> None:
    """Rank 1 joins only after rank 0 stopped waiting: rank 0 kept the buffer alive through
    MPI_Finalize and told rank 1, whose call fails at once instead of after its 60 s timeout.
    The grace period is shortened to 1 s here. Rank 1 joins once rank 0's exit handler has
    ended (a file written then), not after a fixed sleep: on a loaded machine rank 0 could
    still be in its grace period when a 3 s sleep ended, and the operation completed."""
    grace = _GAVE_UP_FILE + "; _requests.EXIT_GRACE = 1.0"
    late = ("t0 = time.monotonic()\n"
            "        while not os.path.exists('gave-up') and time.monotonic() - t0 < 60:\n"
            "            time.sleep(0.01)")
    rc, out = _job(tmp_path, _LEAVE.format(leave=leave, late=late, count=count, grace=grace))
    _no_crash(rc, out)
    assert rc == 0, out
    [told] = _results(tmp_path)
    assert told.startswith("rank 1 told:") and "rank 0 left this group" in told, out
    assert "unfinished" in told and "allreduce" in told, out


@pytest.mark.timeout(CAP + 30)
def test_a_lean_send_kept_pending_to_the_end_is_drained(tmp_path) -> None:
    """A lean ``isend`` (a plain array: ``QuickWork``, its MPI request held bare) kept in a
    global and never received: the exit handler registers it with the rest, waits its grace
    period, keeps the buffer through MPI_Finalize and names it; nothing crashes or hangs."""
    rc, out = _job(tmp_path, """
        import numpy as np
        import hpcdp
        from hpcdp.backends.mpi import _requests
        from hpcdp.comm.work import QuickWork

        _requests.EXIT_GRACE = 0.5
        g = hpcdp.init("mpi", timeout=60)
        if g.rank == 0:
            pending = g.isend(np.ones(1 << 20), 1, tag=7)   # 8 MiB: never eager; never received
            print("lean:", type(pending) is QuickWork, flush=True)
        g.barrier()
    """)
    _no_crash(rc, out)
    assert rc == 0, out
    assert "lean: True" in out, out
    assert "exits with 1 MPI operation(s) unfinished (send to rank 1 (tag 7))" in out, out


@pytest.mark.timeout(CAP + 30)
def test_group_used_after_finalize_raises_hpcdp_error(tmp_path) -> None:
    rc, out = _job(tmp_path, """
        import numpy as np
        import hpcdp

        world = hpcdp.init("mpi")
        sub = hpcdp.new_group([0, 1])
        hpcdp.finalize()
        lines = []
        for name, call in [("world allreduce", lambda: world.allreduce(np.ones(2))),
                           ("world barrier", lambda: world.barrier()),
                           ("sub-group allreduce", lambda: sub.allreduce(np.ones(2))),
                           ("world send", lambda: world.send(np.ones(2), 1 - world.rank)),
                           ("world new_group", lambda: world.new_group([0]))]:
            try:
                call()
                lines.append(f"{name}: accepted")
            except hpcdp.HpcdpError as exc:
                ok = "shut down" in str(exc) and f"rank {world.rank}" in str(exc)
                lines.append(f"{name}: refused" if ok else f"{name}: unclear: {exc}")
        again = hpcdp.init("mpi")          # a new world works
        lines.append(f"again {again.allreduce(np.ones(2))[0]}")
        with open(f"result-{again.rank}.txt", "w") as fh:
            fh.write(chr(10).join(lines))
    """)
    _no_crash(rc, out)
    assert rc == 0, out
    results = _results(tmp_path)
    assert len(results) == 2, out
    for text in results:
        assert text.count(": refused") == 5 and text.endswith("again 2.0"), text


_TUNING = """
    import json, sys
    {first}
    import numpy as np
    import hpcdp
    from hpcdp.backends.mpi import _tuning as _mpi_tuning

    g = hpcdp.init("mpi")
    tuner = g.backend._nbc
    seen = {{"tuned": tuner is not None}}
    if tuner is not None:
        sets = []
        real_set = tuner.set
        tuner.set = lambda v: (sets.append(v), real_set(v))[1]

        def run(key, fn):  # the values set while posting, and the value left afterwards
            sets.clear()
            fn()
            seen[key] = [list(sets), tuner.current]

        run("big", lambda: hpcdp.allreduce(np.ones(1 << 18, np.float32)))   # 1 MiB: ring
        run("small", lambda: hpcdp.allreduce(np.ones(2, np.float32)))       # 8 B: libnbc's own
        run("async",  # the general path
            lambda: hpcdp.allreduce(np.ones(1 << 18), async_op=True).wait())
        hpcdp.new_group([0, 1]).barrier()  # MPI's own allreduce (context ids) sees the default
    with open(f"result-{{g.rank}}.txt", "w") as fh:
        json.dump(seen, fh)
"""


@pytest.mark.timeout(CAP + 30)
@pytest.mark.parametrize("first", ["from mpi4py import MPI", "pass"], ids=["mpi4py-first", "hpcdp-first"])
def test_allreduce_algorithm_is_chosen_whatever_the_import_order(tmp_path, first: str) -> None:
    """libnbc's ring from 8 KiB up and its default below, set through MPI_T after MPI_Init, so
    a script that imported mpi4py first gets the same allreduce as one that imported hpcdp first.
    Ring only while such a call is posted: MPI's own nonblocking allreduces read it too."""
    rc, out = _job(tmp_path, _TUNING.format(first=first))
    assert rc == 0, out
    seen = [json.loads(text) for text in _results(tmp_path)]
    want = {"tuned": True, "big": [[1, 0], 0], "small": [[], 0], "async": [[1, 0], 0]}
    assert seen == [want] * 2, (seen, out)


_THREADED_POSTS = """
    import json, threading
    import numpy as np
    import hpcdp

    g = hpcdp.init("mpi", timeout=60)
    small, big = hpcdp.new_group([0, 1]), hpcdp.new_group([0, 1])
    tuner = g.backend._nbc
    seen = {"tuned": tuner is not None}
    if tuner is not None:
        main = threading.get_ident()

        class Counting:  # counts the main thread's acquisitions of the algorithm lock
            def __init__(self, lock):
                self.lock, self.n = lock, 0
            def acquire(self, *a):
                self.n += threading.get_ident() == main
                return self.lock.acquire(*a)
            def release(self):
                self.lock.release()
            def __enter__(self):
                self.acquire()
                return self
            def __exit__(self, *exc):
                self.release()
        tuner.lock = Counting(tuner.lock)
        for i in range(200):  # alone: small posts skip the lock
            small.allreduce(np.full(2, i, np.float32))
        seen["alone"] = tuner.lock.n
        bad = []

        started, overlapped = threading.Event(), threading.Event()

        def rings():  # 128 KiB: ring, set and reset around each post
            for i in range(40):
                r = big.allreduce(np.full(1 << 14, i, np.float64))
                if not (r == 2 * i).all():
                    bad.append(("big", i))
                if i == 0:  # the small posts below run beside this thread for certain (on a
                    started.set()  # busy machine it could finish before the main thread ran)
                    overlapped.wait(60)

        t = threading.Thread(target=rings)
        t.start()
        started.wait(60)
        i = 0
        while True:
            for _ in range(20):
                r = small.allreduce(np.full(2, i, np.float32))
                if not (r == 2 * i).all():
                    bad.append(("small", i))
                i += 1
            overlapped.set()
            # stop together: each rank sees its own thread end at its own moment, and a rank
            # that posted one call more than its peer would wait for it until the timeout
            alive = small.allreduce(np.full(2, float(t.is_alive()), np.float32))
            if i >= 200 and alive[0] == 0:
                break
        t.join()
        seen["bad"] = bad
        seen["beside"] = tuner.lock.n - seen["alone"]  # taken by small posts beside the thread
        seen["left"] = tuner.current
    with open(f"result-{g.rank}.txt", "w") as fh:
        json.dump(seen, fh)
"""


@pytest.mark.timeout(CAP + 30)
@pytest.mark.parametrize("persistent", ["1", "0"])
def test_small_allreduces_beside_a_posting_thread_take_the_algorithm_lock(tmp_path,
                                                                        persistent: str) -> None:
    """No small allreduce runs an algorithm that another thread's ring-sized post chose: every
    result is right, nothing hangs, while a thread posts ring allreduces on another group.

    Persistent requests (the default) read libnbc's algorithm variable once, when made, under
    the lock: the main thread takes it once (one request) and never again. Without them
    (``HPCDP_MPI_FASTPATH=0``) each small ``Iallreduce`` reads it when posted: the only
    thread posts without the lock, and takes it again once another thread exists."""
    rc, out = _job(tmp_path, _THREADED_POSTS, env={"HPCDP_MPI_FASTPATH": persistent})
    _no_crash(rc, out)
    assert rc == 0, out
    seen = [json.loads(text) for text in _results(tmp_path)]
    for s in seen:
        assert s["tuned"] and s["bad"] == [] and s["left"] == 0, (seen, out)
        if persistent == "1":
            assert s["alone"] == 1 and s["beside"] == 0, (seen, out)
        else:
            assert s["alone"] == 0 and s["beside"] > 0, (seen, out)
    assert len(seen) == 2, out


# Rank 0 gives up on a ring-sized allreduce that rank 1, told rank 0 left, never posts; then a
# new group. Before the fix rank 0 left libnbc's algorithm variable at ring and rank 1 at the
# default, and MPI's own allreduce inside Comm_split (context ids) hung between the two.
_SKIPPED_RING = """
    import numpy as np
    import hpcdp

    g = hpcdp.init("mpi", timeout=60)
    sub = hpcdp.new_group([0, 1])
    if g.rank == 0:
        try:
            sub.allreduce(np.ones(1 << 18), timeout=0.5)   # 2 MiB: ring; rank 1 never joins
        except hpcdp.CommTimeoutError:
            pass
        hpcdp.send(np.zeros(1), 1, tag=5, timeout=60)
    else:
        hpcdp.recv(np.empty(1), 0, tag=5, timeout=60)
    again = hpcdp.new_group([0, 1])
    total = again.allreduce(np.ones(1 << 18), timeout=60)[0]
    with open(f"result-{g.rank}.txt", "w") as fh:
        fh.write(str(total))
"""


@pytest.mark.timeout(CAP + 30)
def test_new_group_after_a_ring_allreduce_one_rank_skipped(tmp_path) -> None:
    rc, out = _job(tmp_path, _SKIPPED_RING)
    _no_crash(rc, out)
    assert rc == 0, out
    assert _results(tmp_path) == ["2.0", "2.0"], out


@pytest.mark.timeout(CAP + 30)
def test_users_own_algorithm_choice_wins(tmp_path) -> None:
    rc, out = _job(tmp_path, _TUNING.format(first="pass"),
                   env={"OMPI_MCA_coll_libnbc_iallreduce_algorithm": "2"})
    assert rc == 0, out
    assert [json.loads(text) for text in _results(tmp_path)] == [{"tuned": False}] * 2, out


@pytest.mark.timeout(CAP + 30)
def test_collectives_bench_reports_its_import_order(tmp_path) -> None:
    out_file = tmp_path / "rows.jsonl"
    rc, out = _job(tmp_path, "", module=[
        "hpcdp.bench", "collectives", "--import-order", "mpi4py-first", "--ops", "allreduce",
        "--max-size", "32", "--trials", "1", "--min-time", "0.001", "--json", str(out_file)])
    assert rc == 0, out
    rows = [json.loads(line) for line in out_file.read_text().splitlines()]
    summaries = {r["name"]: r for r in rows if r.get("bench") == "summary"}
    a1 = [r for k, r in summaries.items() if k.startswith("A1")]
    a2 = [r for k, r in summaries.items() if k.startswith("A2")]
    assert a1 and a2 and all(r["import_order"] == "mpi4py-first" for r in a1 + a2), rows
    assert "import order mpi4py-first" in out, out


_MISMATCH = """
    import json
    import numpy as np
    import hpcdp

    hpcdp.init("mpi", timeout=60)   # an error must come at once, not after a timeout
    r = hpcdp.rank()
    sub = hpcdp.new_group(list(range(hpcdp.world_size())))

    def outcome(fn):
        try:
            fn()
            return ["ok", ""]
        except Exception as exc:
            return [f"{{type(exc).__module__}}.{{type(exc).__name__}}", str(exc)]

    call = outcome(lambda: sub.allreduce(np.ones({count} + 5 * r)))  # rank 0's buffer is smallest
    after = outcome(lambda: sub.barrier())
    hpcdp.barrier()                 # the world group is untouched
    with open(f"result-{{r}}.txt", "w") as fh:
        json.dump({{"rank": r, "call": call, "after": after}}, fh)
"""


@pytest.mark.timeout(CAP + 30)
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("count", [3, 1 << 16], ids=["latency-path", "bandwidth-path"])
def test_collective_size_mismatch_is_an_hpcdp_error_on_every_rank(tmp_path, n: int,
                                                                   count: int) -> None:
    """With the call checks off (HPCDP_DEBUG=off): the rank whose buffer was too small gets MPI's
    truncation as an hpcdp error naming the call and the rank; every other rank fails at once too
    (on the call or the group's next one), never with a raw mpi4py.MPI.Exception and never after
    the timeout. (By default the sampled checks catch the call before it runs: below.)"""
    rc, out = _job(tmp_path, _MISMATCH.format(count=count), n=n, env={"HPCDP_DEBUG": "off"})
    _no_crash(rc, out)
    assert rc == 0, out
    outs = [json.loads(text) for text in _results(tmp_path)]
    assert len(outs) == n, out
    first_errors = [o["call"] if o["call"][0] != "ok" else o["after"] for o in outs]
    for o, (kind, msg) in zip(outs, first_errors):
        assert kind.startswith("hpcdp.errors."), o
        assert kind != "hpcdp.errors.CommTimeoutError", o
        assert f"rank {o['rank']}" in msg and "#" in msg, o
    # who hits the truncation depends on the algorithm; libnbc reports it as MPI_ERR_TRUNCATE
    # or, on some runs, as MPI_ERR_OTHER: both name the cause the user should look for
    seen = [m for k, m in first_errors if "MPI_ERR_" in m and "PeerFailure" not in k]
    assert seen, outs
    for msg in seen:
        assert "allreduce #" in msg and "different sizes" in msg, msg


@pytest.mark.timeout(CAP + 30)
def test_collective_size_mismatch_is_caught_before_it_runs_by_default(tmp_path) -> None:
    """The same job with HPCDP_DEBUG unset (the sampled checks): every rank raises
    ``CollectiveMismatchError`` naming each rank's call before any rank posts it, and the group
    stays usable (its barrier passes)."""
    rc, out = _job(tmp_path, _MISMATCH.format(count=3), n=4)
    _no_crash(rc, out)
    assert rc == 0, out
    outs = [json.loads(text) for text in _results(tmp_path)]
    assert len(outs) == 4, out
    for o in outs:
        kind, msg = o["call"]
        assert kind == "hpcdp.errors.CollectiveMismatchError", o
        assert "allreduce #1" in msg and all(f"rank {r}: allreduce(float64, shape ({3 + 5 * r},)"
                                             in msg for r in range(4)), o
        assert o["after"] == ["ok", ""], o


# Rank 1 joins an allreduce only after the others gave up on it (it is told they left and
# never posts), on a group of its own that is then shut down; then a communicator whose
# context id this rank picks alone. Before the fix rank 1 freed the group's communicator while
# the others' abandoned calls still sent to it, and Open MPI handed those messages to the next
# communicator given that context id: rank 1 crashed in Comm_dup (7 of 7 runs of
# tests/backends/test_mpi_harness.py on 4 ranks).
_FREED_WHILE_SENT_TO = """
    import sys
    import numpy as np
    import hpcdp
    from hpcdp.backends import mpi
    from hpcdp.testing import run_mpi
    sys.path.insert(0, {tests!r})
    from test_mpi_harness import _time_out_on_the_default_group, _sum

    g = hpcdp.init("mpi", timeout=60)
    for round in range(2):
        run_mpi(_time_out_on_the_default_group)
        run_mpi(_sum)
        own = mpi.MPIBackend(mpi.get_mpi().COMM_SELF.Dup(), [g.rank])
        own.shutdown()
    with open(f"result-{{g.rank}}.txt", "w") as fh:
        fh.write(str(run_mpi(_sum)[0]))
"""


@pytest.mark.timeout(CAP + 30)
def test_late_rank_does_not_free_a_communicator_its_peers_still_send_on(tmp_path) -> None:
    rc, out = _job(tmp_path, _FREED_WHILE_SENT_TO.format(tests=os.path.dirname(os.path.abspath(__file__))), n=4)
    _no_crash(rc, out)
    assert rc == 0, out
    assert _results(tmp_path) == ["10.0"] * 4, out

"""Point-to-point's quick path keeps the general path's guarantees: a lean ``isend``/``irecv``
(``comm.work.QuickWork`` on MPI's quick lane) dropped while pending, waited on together with
general Works, timing out with its name; a blocked receive named in the flight record; and the
per-pair message counts every flight record lists. Written once, run on simulated, TCP and MPI
ranks (on sim and TCP the same calls take the general path: the properties are the same).
"""
from __future__ import annotations

import gc
import json
import os
import shutil
import tempfile
import threading
import time

import numpy as np
import pytest

import hpcdp
from hpcdp import PROC_NULL, trace
from hpcdp.comm.work import QuickWork, Work
from hpcdp.testing.fixtures import World, worlds


def _quick(g: hpcdp.ProcessGroup) -> bool:
    """Whether this group's plain-array isend/irecv are lean (MPI's quick lane)."""
    return g.backend.quick_p2p is not None and g._fast


def body_dropped_while_pending(rank: int) -> list[str]:
    """A receive dropped before its message came still gets it (the transport keeps the buffer
    alive and takes the message), and later messages of the pair are not mixed up with it."""
    g = hpcdp.get_default_group()
    fails: list[str] = []
    if rank == 0:
        buf = np.zeros(16)
        w = g.irecv(buf, 1, tag=7)
        if _quick(g) and type(w) is not QuickWork:
            fails.append(f"a plain irecv on the quick lane is {type(w).__name__}")
        if w.is_completed():
            fails.append("completed before anything was sent")
        del w
        gc.collect()
        if g.backend.name == "mpi":
            from hpcdp.backends.mpi import _requests
            what = [r.what for r in _requests.pending_of(g.backend)]
            if "recv from rank 1 (tag 7)" not in what:
                fails.append(f"the dropped receive is not registered: {what}")
        g.barrier()  # now rank 1 sends
        got = g.recv(np.zeros(16), 1, tag=8, timeout=30)  # after tag 7's, on the same pair
        if not (got == 2.0).all():
            fails.append(f"tag 8: {got}")
        deadline = time.monotonic() + 10
        while not (buf == 1.0).all() and time.monotonic() < deadline:
            g.iprobe()  # progress
            time.sleep(1e-3)
        if not (buf == 1.0).all():
            fails.append(f"the dropped receive's buffer: {buf}")
        # a dropped send completes too (the peer takes it)
        g.isend(np.full(4, 3.0), 1, tag=9)
        gc.collect()
    elif rank == 1:
        g.barrier()
        g.send(np.full(16, 1.0), 0, tag=7)
        g.send(np.full(16, 2.0), 0, tag=8)
        got = g.recv(np.zeros(4), 0, tag=9, timeout=30)
        if not (got == 3.0).all():
            fails.append(f"dropped send: {got}")
    else:
        g.barrier()
    g.barrier()
    return fails


def body_wait_all_mixed(rank: int) -> list[str]:
    """``wait_all`` over lean Works, general ones (a strided buffer, a null neighbour, an
    asynchronous collective) and a completed one returns each result in order."""
    g = hpcdp.get_default_group()
    n = g.size
    right, left = (rank + 1) % n, (rank - 1) % n
    fails: list[str] = []
    for step in range(3):
        flat = np.zeros(5)
        strided = np.zeros((5, 2))[:, 0]  # not contiguous: the general path
        done = g.isend(np.ones(1), PROC_NULL)
        ws = [g.irecv(flat, left, tag=1), g.irecv(strided, left, tag=2),
              g.isend(np.full(5, rank + 1.0), right, tag=1),
              g.isend(np.full(5, rank + 10.0), right, tag=2),
              g.allreduce(np.ones(2), async_op=True), done]
        kinds = {type(w).__name__ for w in ws}
        if _quick(g) and "QuickWork" not in kinds:
            fails.append(f"no lean Work on the quick lane: {kinds}")
        if not all(isinstance(w, Work) for w in ws):
            fails.append(f"not Works: {kinds}")
        if step == 1:
            ws[0].is_completed()  # progressed on its own first
        out = hpcdp.wait_all(ws, timeout=30)
        if out[0] is not flat or not (flat == left + 1.0).all():
            fails.append(f"lean irecv: {out[0]}")
        if not (out[1] == left + 10.0).all():
            fails.append(f"strided irecv: {out[1]}")
        if out[2] is not None or out[3] is not None or out[5] is not None:
            fails.append(f"sends: {out[2:4]}, {out[5]}")
        if not (np.asarray(out[4]) == n).all():
            fails.append(f"allreduce: {out[4]}")
        if not all(w.is_completed() for w in ws) or ws[0].wait() is not flat:
            fails.append("a Work waited on by wait_all is not complete")
    # batch_isend_irecv: the same Works
    a, b = np.zeros(3), np.full(3, rank * 1.0)
    ws = hpcdp.batch_isend_irecv([hpcdp.P2POp("irecv", a, left, 4), hpcdp.P2POp("isend", b, right, 4)])
    hpcdp.wait_all(ws)
    if not (a == left).all():
        fails.append(f"batch: {a}")
    return fails


def body_lean_timeout(rank: int) -> list[str]:
    """A lean irecv that never gets its message times out naming ``recv(src=.., tag=..) #k``
    (the k-th receive of that pair and tag), from ``wait`` and from ``wait_all``."""
    g = hpcdp.get_default_group()
    fails: list[str] = []
    if rank == 0:
        g.irecv(np.zeros(2), 1, tag=3).wait(timeout=30)  # #1 arrives
        w = g.irecv(np.zeros(2), 1, tag=3)  # #2 never does
        t0 = time.monotonic()
        try:
            w.wait(timeout=0.3)
            fails.append("no timeout")
        except hpcdp.CommTimeoutError as exc:
            took = time.monotonic() - t0
            msg = str(exc)
            if "recv(src=1, tag=3) #2" not in msg or "rank 0" not in msg or not 0.25 <= took < 10:
                fails.append(f"after {took:.2f} s: {msg}")
        ws = [g.isend(np.ones(2), 1, tag=4), g.irecv(np.zeros(2), 1, tag=5)]  # #1 of tag 5: never
        try:
            hpcdp.wait_all(ws, timeout=0.3)
            fails.append("wait_all: no timeout")
        except hpcdp.CommTimeoutError as exc:
            if "recv(src=1, tag=5) #1" not in str(exc):
                fails.append(f"wait_all: {exc}")
    elif rank == 1:
        g.send(np.ones(2), 0, tag=3)
        g.recv(np.zeros(2), 0, tag=4, timeout=30)
    g.barrier()
    return fails


def body_stuck_recv_record(rank: int) -> dict:
    """Rank 0 exchanges messages with rank 1, then blocks in a receive rank 1 never matches: a
    dump taken while it waits names that receive (started), the one its timeout leaves names
    it timed out, and both list the messages each pair exchanged before."""
    g = hpcdp.get_default_group()
    me = g.ranks[g.rank]
    out: dict = {}
    start = trace.recorder(me).total()
    if rank == 0:
        for i in range(5):
            g.send(np.full(2, i * 1.0), 1, tag=0)
            g.recv(np.zeros(2), 1, tag=1)
        d = tempfile.mkdtemp(prefix="hpcdp-a7-")
        path = os.path.join(d, f"flight-rank{me}.json")
        during: dict = {}
        returned = threading.Event()

        def waiting() -> bool:
            return any(o.op == "recv" and list(o.shape or ()) == [13] and o.id > start
                       and o.state == "started" for o in trace.recorder(me).snapshot())

        def look() -> None:
            # dump once the receive is recorded as waiting, or at once if it already returned
            # (then the check below fails): a timer's fixed 0.4 s fired, on a loaded machine,
            # before this thread's receive had begun
            deadline = time.monotonic() + 30  # bounded: a recv that failed otherwise ends it
            while not waiting() and not returned.is_set() and time.monotonic() < deadline:
                time.sleep(0.005)
            trace.dump("while stuck", directory=d, rank=me)
            with open(path) as fh:
                during.update(json.load(fh))

        t = threading.Thread(target=look, daemon=True)
        t.start()
        try:
            g.recv(np.zeros(13), 1, tag=9, timeout=1.2)  # LINE-STUCK
            out["error"] = "no timeout"
        except hpcdp.CommTimeoutError as exc:
            out["error"] = str(exc)
        finally:
            returned.set()  # (whatever the recv raised: ``look`` stops waiting for it)
        t.join(60)
        trace.dump("after", directory=d, rank=me)
        with open(path) as fh:
            after = json.load(fh)
        shutil.rmtree(d, ignore_errors=True)
        mine = lambda doc: [  # noqa: E731
            (e["op"], e["peer"], e["state"], e["line"]) for e in doc["entries"] if e["op"] == "recv"
            and e["shape"] == [13] and e["id"] > start]
        counts = lambda doc: sorted(  # noqa: E731
            (c["op"], c["peer"], c["tag"], c["messages"]) for c in doc["p2p_counts"]
            if c["group"] == g.name)
        out.update(during=mine(during), after=mine(after), counts_during=counts(during),
                   counts_after=counts(after), peer_rank=[c["peer_rank"] for c in after["p2p_counts"]
                                                           if c["group"] == g.name])
    elif rank == 1:
        for i in range(5):
            g.recv(np.zeros(2), 0, tag=0)
            g.send(np.full(2, i * 1.0), 0, tag=1)
    g.barrier()
    return out


def body_lines_record_every_call(rank: int) -> list:
    """With source lines on (as ``HPCDP_TRACE`` sets), every point-to-point call is in the
    ring, quick or not."""
    g = hpcdp.get_default_group()
    rec = trace.recorder(g.ranks[g.rank])
    trace.configure(lines=True)
    try:
        start = rec.total()
        if rank < 2:
            peer = 1 - rank
            x, y = np.ones(2), np.zeros(2)
            for _ in range(3):
                if rank == 0:
                    g.send(x, peer, tag=2)
                    g.recv(y, peer, tag=2)
                else:
                    g.recv(y, peer, tag=2)
                    g.send(x, peer, tag=2)
            hpcdp.wait_all([g.isend(x, peer, tag=3), g.irecv(y, peer, tag=3)])
            g.sendrecv(x, peer, y, peer, sendtag=4, recvtag=4)
        ops = [(o.op, o.peer, o.state) for o in rec.snapshot() if o.id > start and o.seq == 0]
        g.barrier()  # (simulated ranks share the setting: every rank is done before it goes off)
    finally:
        trace.configure(lines=False)
    return ops


@pytest.mark.parametrize("world", worlds("sim-2", "tcp-3", "mpi"), indirect=True)
def test_a_lean_work_dropped_while_pending_still_completes(world: World) -> None:
    out = world.run(body_dropped_while_pending, timeout=60)
    assert out == [[]] * world.size, out


@pytest.mark.parametrize("world", worlds("sim-2", "sim-4", "tcp-3", "mpi"), indirect=True)
def test_wait_all_mixes_lean_and_general_works(world: World) -> None:
    out = world.run(body_wait_all_mixed, timeout=60)
    assert out == [[]] * world.size, out


@pytest.mark.parametrize("world", worlds("sim-2", "tcp-3", "mpi"), indirect=True)
def test_a_lean_irecv_times_out_naming_the_message(world: World) -> None:
    out = world.run(body_lean_timeout, timeout=60)
    assert out == [[]] * world.size, out


@pytest.mark.parametrize("world", worlds("sim-2", "tcp-3", "mpi"), indirect=True)
def test_a_stuck_quick_recv_is_in_the_flight_record_with_the_pair_counts(world: World) -> None:
    out = world.run(body_stuck_recv_record, timeout=60)[0]
    assert "recv(src=1, tag=9) #1" in out["error"] and "timed out" in out["error"], out
    (during,) = out["during"]
    assert during[:3] == ("recv", 1, "started"), out
    assert during[3] is not None and during[3].startswith(f"{__file__}:"), out  # the test's line
    assert [e[:3] for e in out["after"]] == [("recv", 1, "timed out")], out
    want = [("recv", 1, 1, 5), ("recv", 1, 9, 1), ("send", 1, 0, 5)]
    assert out["counts_during"] == want and out["counts_after"] == want, out
    assert out["peer_rank"] == [1, 1, 1], out


@pytest.mark.parametrize("world", worlds("sim-2", "tcp-3", "mpi"), indirect=True)
def test_with_lines_on_every_p2p_call_is_recorded(world: World) -> None:
    out = world.run(body_lines_record_every_call, timeout=60)
    for rank in (0, 1):
        peer = 1 - rank
        ops = [o for o in out[rank] if o[0] in ("send", "recv", "sendrecv")]
        assert sorted(ops) == sorted([("send", peer, "completed")] * 4 + [("recv", peer, "completed")] * 4
                                     + [("sendrecv", peer, "completed")]), (rank, out[rank])

"""``batch_isend_irecv`` keeps every promise of the calls it stands for: every op checked before
any is posted (a bad op anywhere posts nothing, and raises what its ``isend``/``irecv`` would),
messages numbered as those calls number them (the flight record's per-pair counts), receives
posted before sends whatever the order given, works returned in the order of the ops, and
``PROC_NULL``, strided and read-only arrays taken as ``isend``/``irecv`` take them. On MPI a
plain batch goes straight to the quick lane (``_p2p_batch.post_batch``) and ``wait_all`` tests
it as posted (``comm.work.QuickBatch``); a batch changed or partly waited on is still waited on
correctly. Written once, run on simulated, TCP and MPI ranks.
"""
from __future__ import annotations

import numpy as np
import pytest

import hpcdp
from hpcdp import PROC_NULL, P2POp
from hpcdp.comm.work import QuickBatch, QuickWork
from hpcdp.trace._dump import p2p_counts
from hpcdp.testing.fixtures import World, worlds


def _error(fn, *args) -> tuple[str, str] | None:  # type: ignore[no-untyped-def]
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - compared by type and text
        return type(exc).__name__, str(exc)
    return None


def body_bad_op_posts_nothing(rank: int) -> list[str]:
    """A batch with one bad op anywhere (first, middle, last) raises the error its
    ``isend``/``irecv`` raises and posts nothing: no message number taken, no message sent (a
    stray send would be matched by the next receive of its pair and tag)."""
    g = hpcdp.get_default_group()
    n = g.size
    fails: list[str] = []
    right, left = (rank + 1) % n, (rank - 1) % n
    inn, out = np.zeros(4), np.full(4, -1.0)  # -1: what a stray send of a failed batch carries
    frozen = np.zeros(4)
    frozen.flags.writeable = False
    bads = [  # (the bad op, the per-op call that raises the same error)
        (P2POp("isend", out, n + 3, 1), lambda: g.isend(out, n + 3, 1)),
        (P2POp("irecv", inn, left, -1), lambda: g.irecv(inn, left, -1)),
        (P2POp("isend", out, right, "1"), lambda: g.isend(out, right, "1")),
        (P2POp("isend", [1.0, 2.0], right, 1), lambda: g.isend([1.0, 2.0], right, 1)),
        (P2POp("irecv", frozen, left, 1), lambda: g.irecv(frozen, left, 1)),
        (P2POp("isend", out, PROC_NULL, -5), lambda: g.isend(out, PROC_NULL, -5)),
    ]
    good = [P2POp("irecv", inn, left, 1), P2POp("isend", out, right, 1)]
    before = g._p2p.counts()
    for bad, single in bads:
        want = _error(single)
        if want is None:
            fails.append(f"the per-op call of {bad} raised nothing")
            continue
        for ops in ([bad] + good, good[:1] + [bad] + good[1:], good + [bad]):
            got = _error(hpcdp.batch_isend_irecv, ops)
            if got != want:
                fails.append(f"batch with {bad} at {ops.index(bad)}: {got}, not {want}")
    got = _error(hpcdp.batch_isend_irecv, good + [("isend", out, right)])
    if got is None or got[0] != "TypeError" or "P2POp" not in got[1]:
        fails.append(f"a tuple among P2POps: {got}")
    if g._p2p.counts() != before:
        fails.append(f"failed batches took message numbers: {before} -> {g._p2p.counts()}")
    g.barrier()
    out[:] = rank  # the real exchange: a stray message of tag 1 would be received first
    hpcdp.wait_all(hpcdp.batch_isend_irecv(good), timeout=30)
    if not (inn == left).all():
        fails.append(f"received {inn} from rank {left}, not its values: a failed batch posted a send")
    g.barrier()
    return fails


def _step(g: hpcdp.ProcessGroup, rank: int, batch: bool, order: str) -> tuple[list[str], list]:
    """One halo step with both neighbours, tags 2 and 3, as a batch listed in ``order``
    ("recv-first", "send-first", "mixed") or as the calls one by one."""
    n = g.size
    right, left = (rank + 1) % n, (rank - 1) % n
    ins = {t: np.zeros(3) for t in (2, 3)}
    outs = {2: np.full(3, rank * 10.0 + 2), 3: np.full(3, rank * 10.0 + 3)}
    recvs = [P2POp("irecv", ins[2], left, 2), P2POp("irecv", ins[3], right, 3)]
    sends = [P2POp("isend", outs[2], right, 2), P2POp(hpcdp.isend, outs[3], left, 3)]
    ops = {"recv-first": recvs + sends, "send-first": sends + recvs,
           "mixed": [sends[0], recvs[0], sends[1], recvs[1]]}[order]
    fails: list[str] = []
    if batch:
        ws = hpcdp.batch_isend_irecv(ops)
        if not isinstance(ws, list) or len(ws) != len(ops):
            fails.append(f"{order}: {type(ws).__name__} of {len(ws)} for {len(ops)} ops")
    else:
        ws = [(g.isend if o.op == "isend" else g.irecv)(o.buf, o.peer, o.tag) for o in ops]
    res = hpcdp.wait_all(ws, timeout=30)
    for o, r in zip(ops, res):  # each work is its own op's
        if (r is not o.buf) if o.op == "irecv" else (r is not None):
            fails.append(f"{order}: the work of {o.op} tag {o.tag} returned {r!r}")
    if not (ins[2] == left * 10 + 2).all() or not (ins[3] == right * 10 + 3).all():
        fails.append(f"{order} batch={batch}: received {ins}")
    return fails, ws


def body_numbered_as_per_op(rank: int) -> list[str]:
    """Batches in any order number their messages as the calls one by one do (the flight
    record's per-pair counts) and return one work per op, in the order of the ops."""
    g = hpcdp.get_default_group()
    fails: list[str] = []
    n = g.size
    right, left = (rank + 1) % n, (rank - 1) % n
    counts = []
    for batch in (False, True):
        before = g._p2p.counts()
        for order in ("recv-first", "send-first", "mixed"):
            f, ws = _step(g, rank, batch, order)
            fails += f
            if batch and g._fast and g.backend.quick_p2p is not None:
                if not all(type(w) is QuickWork for w in ws):
                    fails.append(f"{order}: not lean on the quick lane: {[type(w).__name__ for w in ws]}")
                if type(ws) is not QuickBatch:
                    fails.append(f"{order}: a {type(ws).__name__}, not a QuickBatch")
        after = g._p2p.counts()
        counts.append({k: after[k] - before.get(k, 0) for k in after})
    want = {("recv", left, 2): 3, ("recv", right, 3): 3, ("send", right, 2): 3, ("send", left, 3): 3}
    if n == 2:  # (left and right are one rank)
        want = {("recv", left, 2): 3, ("recv", left, 3): 3, ("send", left, 2): 3, ("send", left, 3): 3}
    if counts[0] != want or counts[1] != counts[0]:
        fails.append(f"messages counted one by one {counts[0]}, by batch {counts[1]}, want {want}")
    recorded = {(c["op"], c["peer"], c["tag"]): c["messages"]
                for c in p2p_counts(hpcdp.rank()) if c["group"] == g.name}
    if g._rec is not None and recorded != g._p2p.counts():
        fails.append(f"the flight record counts {recorded}, the group {g._p2p.counts()}")
    g.barrier()
    return fails


def body_general_ops_in_a_batch(rank: int) -> list[str]:
    """``PROC_NULL``, a strided receive buffer, a strided and a read-only send buffer in one
    batch with plain ops: each taken as ``isend``/``irecv`` take it."""
    g = hpcdp.get_default_group()
    n = g.size
    fails: list[str] = []
    right, left = (rank + 1) % n, (rank - 1) % n
    wide = np.zeros((3, 4))
    strided_in = wide[:, 1]  # a column: not contiguous
    src = np.arange(12.0).reshape(3, 4) + rank * 100
    frozen = np.full(5, float(rank))
    frozen.flags.writeable = False
    plain_in = np.zeros(5)
    null_buf = np.full(2, 7.0)
    ops = [P2POp("irecv", strided_in, left, 4), P2POp("irecv", plain_in, right, 5),
           P2POp("irecv", null_buf, PROC_NULL, 6), P2POp("isend", src[:, 2], right, 4),
           P2POp("isend", frozen, left, 5), P2POp("isend", np.ones(2), PROC_NULL, 6)]
    res = hpcdp.wait_all(hpcdp.batch_isend_irecv(ops), timeout=30)
    if not np.array_equal(wide[:, 1], np.arange(12.0).reshape(3, 4)[:, 2] + left * 100):
        fails.append(f"strided receive: {wide}")
    if res[0] is not strided_in or res[1] is not plain_in or res[2] is not null_buf:
        fails.append(f"receive results: {res[:3]}")
    if not (plain_in == right).all():
        fails.append(f"read-only send received as {plain_in}")
    if not (null_buf == 7.0).all():
        fails.append(f"a PROC_NULL receive wrote its buffer: {null_buf}")
    g.barrier()
    return fails


def body_batch_waited_other_ways(rank: int) -> list[str]:
    """A batch's works waited on one by one, partly before ``wait_all``, or in a list changed
    after the batch (reordered, extended): each completes with its result."""
    g = hpcdp.get_default_group()
    n = g.size
    fails: list[str] = []
    right, left = (rank + 1) % n, (rank - 1) % n
    for how in ("one by one", "first waited", "reversed", "extended", "is_completed", "timeout",
                "generator", "twice"):
        inn = np.zeros(6)
        ops = [P2POp("irecv", inn, left, 9), P2POp("isend", np.full(6, float(rank)), right, 9)]
        ws = hpcdp.batch_isend_irecv(iter(ops) if how == "generator" else ops)
        if how == "twice":  # the second wait_all finds every work done: the same results
            first = hpcdp.wait_all(ws)
            res = hpcdp.wait_all(ws)
            if res[0] is not first[0]:
                fails.append(f"{how}: the second wait_all returned {res[0]!r}")
        elif how == "one by one":
            res = [w.wait(timeout=30) for w in ws]
        elif how == "first waited":
            ws[0].wait(timeout=30)
            res = hpcdp.wait_all(ws)
        elif how == "reversed":
            ws.reverse()
            res = hpcdp.wait_all(ws)[::-1]
        elif how == "extended":
            ws.append(g.allreduce(np.ones(1), async_op=True))
            res = hpcdp.wait_all(ws)
            if not (np.asarray(res[2]) == n).all():
                fails.append(f"{how}: allreduce {res[2]}")
        elif how == "is_completed":
            ws[1].is_completed()
            res = hpcdp.wait_all(ws)
        else:
            res = hpcdp.wait_all(ws, timeout=30)
        if len(ws) < 2 or res[0] is not inn or res[1] is not None or not (inn == left).all():
            fails.append(f"{how}: {res[:2]}, received {inn}")
        if not all(w.is_completed() for w in ws):
            fails.append(f"{how}: a work not complete after its wait")
    if hpcdp.batch_isend_irecv([]) != [] or hpcdp.wait_all(hpcdp.batch_isend_irecv(iter(()))) != []:
        fails.append("an empty batch is not an empty list of works")
    g.barrier()
    return fails


@pytest.mark.parametrize("world", worlds("sim-2", "sim-4", "tcp-3", "mpi"), indirect=True)
def test_a_bad_op_anywhere_in_a_batch_posts_nothing(world: World) -> None:
    out = world.run(body_bad_op_posts_nothing, timeout=60)
    assert out == [[]] * world.size, out


@pytest.mark.parametrize("world", worlds("sim-2", "sim-4", "tcp-3", "mpi"), indirect=True)
def test_a_batch_numbers_messages_as_the_calls_one_by_one(world: World) -> None:
    out = world.run(body_numbered_as_per_op, timeout=60)
    assert out == [[]] * world.size, out


@pytest.mark.parametrize("world", worlds("sim-2", "tcp-3", "mpi"), indirect=True)
def test_proc_null_strided_and_read_only_arrays_in_a_batch(world: World) -> None:
    out = world.run(body_general_ops_in_a_batch, timeout=60)
    assert out == [[]] * world.size, out


@pytest.mark.parametrize("world", worlds("sim-2", "tcp-3", "mpi"), indirect=True)
def test_a_batch_waited_on_other_ways(world: World) -> None:
    out = world.run(body_batch_waited_other_ways, timeout=60)
    assert out == [[]] * world.size, out


def body_lean_exactly_where_isend_is(rank: int) -> list[str]:
    """The batch's quick checks (a copy of ``isend``/``irecv``'s, kept inline: a shared helper
    costs every call a frame) pick the quick lane for exactly the arrays those calls do."""
    g = hpcdp.get_default_group()
    fails: list[str] = []
    frozen = np.zeros(4)
    frozen.flags.writeable = False
    cases = {
        "float64": (np.zeros(4), np.ones(4)), "int8": (np.zeros(4, np.int8), np.ones(4, np.int8)),
        "2-D": (np.zeros((2, 3)), np.ones((2, 3))), "0-d": (np.zeros(()), np.ones(())),
        "strided": (np.zeros(8)[::2], np.ones(8)[::2]), "read-only recv": (frozen, np.ones(4)),
        "big-endian": (np.zeros(4, ">f8"), np.ones(4, ">f8")),
        "max tag": (np.zeros(2), np.ones(2)),
    }
    for name, (rbuf, sbuf) in cases.items():
        tag = g._max_tag if name == "max tag" else 11
        kinds = []
        for batch in (False, True):
            try:
                if batch:
                    ws = hpcdp.batch_isend_irecv([P2POp("irecv", rbuf, rank, tag),
                                                  P2POp("isend", sbuf, rank, tag)])
                else:
                    ws = [g.irecv(rbuf, rank, tag), g.isend(sbuf, rank, tag)]
            except Exception as exc:  # noqa: BLE001 - compared between the two spellings
                kinds.append(f"{type(exc).__name__}: {exc}")
                continue
            hpcdp.wait_all(ws, timeout=30)
            kinds.append([type(w).__name__ for w in ws])
        if kinds[0] != kinds[1]:
            fails.append(f"{name}: one by one {kinds[0]}, batched {kinds[1]}")
    g.barrier()
    return fails


@pytest.mark.parametrize("world", worlds("sim-2", "tcp-3", "mpi"), indirect=True)
def test_a_batch_is_lean_exactly_where_isend_and_irecv_are(world: World) -> None:
    out = world.run(body_lean_exactly_where_isend_is, timeout=60)
    assert out == [[]] * world.size, out

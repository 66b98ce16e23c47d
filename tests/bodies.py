"""Test bodies for the API semantics (out=, async, groups, errors), run on every backend."""
from __future__ import annotations

from typing import Any

import numpy as np

import hpcdp


def body_out_and_inplace(rank: int) -> list[str]:
    n = hpcdp.world_size()
    fails: list[str] = []
    x = np.arange(6, dtype=np.float64) + rank
    want = sum(np.arange(6, dtype=np.float64) + r for r in range(n))
    out = np.empty(6)
    res = hpcdp.allreduce(x, out=out)
    if res is not out or not np.allclose(out, want):
        fails.append("allreduce out= not filled/returned")
    y = x.copy()
    res = hpcdp.allreduce(y, out=y)
    if res is not y or not np.allclose(y, want):
        fails.append("allreduce in place (out is x) wrong")
    # non-contiguous out and in place on a strided view
    big = np.zeros((6, 2))
    res = hpcdp.allreduce(x, out=big[:, 0])
    if not np.allclose(big[:, 0], want) or np.any(big[:, 1]):
        fails.append("allreduce into a strided out= wrong")
    z = np.stack([x, x], axis=1)[:, 0]
    res = hpcdp.allreduce(z, out=z)
    if not np.allclose(z, want):
        fails.append("in place on a strided view wrong")
    # broadcast fills x in place when writable, copies when read-only
    b = np.full(3, float(rank))
    res = hpcdp.broadcast(b, root=n - 1)
    if res is not b or not np.all(b == n - 1):
        fails.append("broadcast did not fill x in place")
    ro = np.full(3, float(rank))
    ro.flags.writeable = False
    res = hpcdp.broadcast(ro, root=0)
    if not np.all(res == 0) or (rank != 0 and np.all(ro == 0)):
        fails.append("broadcast of a read-only array wrong")
    g = np.empty((n, 2), np.int32)
    res = hpcdp.all_gather(np.full(2, rank, np.int32), out=g)
    if res is not g or not np.array_equal(g[:, 0], np.arange(n)):
        fails.append("all_gather out= wrong")
    r = hpcdp.reduce_scatter(np.ones((n, 3)), "mean")
    if r.shape != (1, 3) or not np.allclose(r, 1.0):
        fails.append(f"reduce_scatter mean wrong: {r}")
    a = np.arange(2 * n).reshape(n, 2) + 100 * rank
    res = hpcdp.all_to_all(a, out=a)
    if not np.array_equal(a[:, 0], np.array([100 * j + 2 * rank for j in range(n)])):
        fails.append(f"all_to_all in place wrong: {a}")
    s = hpcdp.scatter(None if rank else np.arange(2 * n), root=0, out=np.empty(2, np.int64)) \
        if rank else hpcdp.scatter(np.arange(2 * n), root=0)
    if not np.array_equal(s, [2 * rank, 2 * rank + 1]):
        fails.append(f"scatter with out= on non-roots wrong: {s}")
    return fails


def body_out_errors(rank: int) -> list[str]:
    """Bad out= is rejected locally, on every rank alike, before any byte moves."""
    fails: list[str] = []
    x = np.ones(4)
    bad: list[tuple[str, Any, type]] = [
        ("shape", np.empty(5), ValueError),
        ("dtype", np.empty(4, np.float32), TypeError),
        ("readonly", np.frombuffer(bytes(32), np.float64), ValueError),
    ]
    for label, out, err in bad:
        try:
            hpcdp.allreduce(x, out=out)
            fails.append(f"out= {label} accepted")
        except err:
            pass
    hpcdp.barrier()
    return fails


def body_async(rank: int) -> list[str]:
    n = hpcdp.world_size()
    fails: list[str] = []
    works = [hpcdp.allreduce(np.full(1000, float(i + rank)), async_op=True) for i in range(5)]
    works.append(hpcdp.all_gather(np.array([rank]), async_op=True))
    works.append(hpcdp.barrier(async_op=True))
    for i, w in enumerate(works[:5]):
        res = w.wait()
        if not np.allclose(res, sum(i + r for r in range(n))):
            fails.append(f"async allreduce {i} wrong")
        if not w.is_completed():
            fails.append("is_completed False after wait")
        if w.result() is not res:
            fails.append("result() differs from wait()")
    if not np.array_equal(works[5].result(), np.arange(n)[:, None]):
        fails.append("async all_gather wrong")
    works[6].wait()
    # is_completed eventually turns True without wait()
    w = hpcdp.allreduce(np.ones(3), async_op=True)
    for _ in range(100000):
        if w.is_completed():
            break
    else:
        w.wait()
    if not np.allclose(w.result(), n):
        fails.append("polling is_completed then result wrong")
    return fails


def body_p2p(rank: int) -> list[str]:
    n = hpcdp.world_size()
    fails: list[str] = []
    if n == 1:
        w = hpcdp.isend(np.arange(3.0), 0, tag=5)
        got = hpcdp.irecv(np.empty(3), 0, tag=5).wait()
        w.wait()
        return [] if np.array_equal(got, np.arange(3.0)) else ["self send/recv wrong"]
    right, left = (rank + 1) % n, (rank - 1) % n
    # two tags in flight at once, received in the opposite order: tag matching, not arrival
    sends = [hpcdp.isend(np.full(4, rank * 10 + t, np.int64), right, tag=t) for t in (1, 2)]
    r2 = hpcdp.irecv(np.empty(4, np.int64), left, tag=2)
    r1 = hpcdp.irecv(np.empty(4, np.int64), left, tag=1)
    for w in sends:
        w.wait()
    if not np.all(r2.wait() == left * 10 + 2) or not np.all(r1.wait() == left * 10 + 1):
        fails.append("tagged isend/irecv mismatched")
    # blocking send/recv, large
    big = np.arange(300_000, dtype=np.float32) + rank
    if rank % 2 == 0:
        hpcdp.send(big, right, tag=9)
        got = hpcdp.recv(np.empty_like(big), left, tag=9)
    else:
        got = hpcdp.recv(np.empty_like(big), left, tag=9)
        hpcdp.send(big, right, tag=9)
    if not np.array_equal(got, np.arange(300_000, dtype=np.float32) + left):
        fails.append("blocking send/recv wrong")
    return fails


def body_subgroups(rank: int) -> list[str]:
    n = hpcdp.world_size()
    fails: list[str] = []
    evens = list(range(0, n, 2))
    g = hpcdp.new_group(evens)
    if rank in evens:
        res = hpcdp.allreduce(np.array([rank]), group=g)
        if res[0] != sum(evens) or g.rank != evens.index(rank) or g.size != len(evens):
            fails.append(f"even group allreduce wrong: {res}")
        if g.ranks != tuple(evens):
            fails.append("group.ranks wrong")
    else:
        if g.is_member:
            fails.append("non-member thinks it is a member")
        try:
            hpcdp.allreduce(np.ones(1), group=g)
            fails.append("non-member collective accepted")
        except ValueError:
            pass
    # overlapping groups in flight, and a reversed order group
    rev = hpcdp.new_group(list(range(n - 1, -1, -1)))
    w = hpcdp.allreduce(np.array([float(rank)]), async_op=True)
    got = hpcdp.all_gather(np.array([rank]), group=rev)
    if not np.array_equal(got[:, 0], np.arange(n - 1, -1, -1)):
        fails.append(f"reversed group order wrong: {got[:, 0]}")
    if w.wait()[0] != sum(range(n)):
        fails.append("world allreduce overlapping a group op wrong")
    # a group of a group: ranks are relative to the parent
    if rank in evens and len(evens) >= 2:
        sub = g.new_group([1, 0])
        res = hpcdp.all_gather(np.array([rank]), group=sub)
        if not np.array_equal(res[:, 0], [evens[1], evens[0]]):
            fails.append(f"group of a group wrong: {res[:, 0]}")
    elif rank in evens:
        g.new_group([0])
    return fails


def body_bad_inputs(rank: int) -> list[str]:
    """Every bad input raises on the calling rank before anything is sent; ranks stay in step."""
    n = hpcdp.world_size()
    fails: list[str] = []
    cases: list[tuple[str, Any, type]] = [
        ("unknown op", lambda: hpcdp.allreduce(np.ones(2), "median"), ValueError),
        ("unhashable op", lambda: hpcdp.allreduce(np.ones(2), np.ones(2)), ValueError),
        ("mean on ints", lambda: hpcdp.allreduce(np.ones(2, np.int32), "mean"), TypeError),
        ("max on complex", lambda: hpcdp.allreduce(np.ones(2, np.complex64), "max"), TypeError),
        ("bad root", lambda: hpcdp.broadcast(np.ones(2), root=n), ValueError),
        ("negative root", lambda: hpcdp.reduce(np.ones(2), root=-1), ValueError),
        ("root type", lambda: hpcdp.gather(np.ones(2), root=1.5), TypeError),
        ("bad dst", lambda: hpcdp.isend(np.ones(2), n), ValueError),
        ("bad tag", lambda: hpcdp.isend(np.ones(2), 0, tag=-1), ValueError),
        ("not an array", lambda: hpcdp.allreduce([1, 2, 3]), TypeError),
        ("scalar", lambda: hpcdp.allreduce(3.0), TypeError),
        ("object dtype", lambda: hpcdp.allreduce(np.array([object()])), TypeError),
        ("string dtype", lambda: hpcdp.all_gather(np.array(["a"])), TypeError),
        ("out= of another dtype", lambda: hpcdp.allreduce(np.ones(2), out=np.ones(2, np.float32)), TypeError),
        # out= is checked on non-roots too, so every rank raises and nobody waits for the root
        ("bad out= on reduce", lambda: hpcdp.reduce(np.ones(4), root=0, out=np.empty(5)), ValueError),
        ("bad out= on gather", lambda: hpcdp.gather(np.ones(4), root=n - 1, out=np.empty((n, 5))), ValueError),
        ("0-d scatter", lambda: hpcdp.scatter(np.array(1.0)), ValueError),
        ("empty group", lambda: hpcdp.new_group([]), ValueError),
        ("duplicate group ranks", lambda: hpcdp.new_group([0, 0]), ValueError),
    ]
    if n > 1:  # every length divides into one part
        cases += [
            ("scatter indivisible", lambda: hpcdp.scatter(np.ones(n + 1), root=0), ValueError),
            ("reduce_scatter indivisible", lambda: hpcdp.reduce_scatter(np.ones(2 * n + 1)), ValueError),
            ("all_to_all indivisible", lambda: hpcdp.all_to_all(np.ones(2 * n + 1)), ValueError),
        ]
    for label, fn, err in cases:
        try:
            fn()
            fails.append(f"{label}: no error")
        except err as exc:
            if "rank" not in str(exc):
                fails.append(f"{label}: message does not name the rank: {exc}")
        except Exception as exc:  # noqa: BLE001
            fails.append(f"{label}: raised {type(exc).__name__}: {exc}")
    res = hpcdp.allreduce(np.ones(1))  # still in step with everyone
    if res[0] != n:
        fails.append("ranks out of step after bad inputs")
    return fails


def body_split_messages(rank: int, limit: int) -> list[str]:
    """Messages over the element limit are split; results must not change (MPI backend)."""
    from hpcdp.backends import mpi

    n = hpcdp.world_size()
    old = mpi.set_max_message_elements(limit)
    fails: list[str] = []
    try:
        x = np.arange(50, dtype=np.float64) + rank
        if not np.allclose(hpcdp.allreduce(x), sum(np.arange(50.0) + r for r in range(n))):
            fails.append("split allreduce")
        if not np.allclose(hpcdp.allreduce(np.arange(50.0, dtype=np.float16), "max"), np.arange(50.0)):
            fails.append("split float16 allreduce")
        if not np.array_equal(hpcdp.broadcast(x.copy(), root=n - 1), np.arange(50.0) + n - 1):
            fails.append("split broadcast")
        red = hpcdp.reduce(x, root=0)
        if rank == 0 and not np.allclose(red, sum(np.arange(50.0) + r for r in range(n))):
            fails.append("split reduce")
        ag = hpcdp.all_gather(x)
        if not np.array_equal(ag, np.stack([np.arange(50.0) + r for r in range(n)])):
            fails.append("split all_gather")
        ga = hpcdp.gather(x, root=n - 1)
        if rank == n - 1 and not np.array_equal(ga, ag):
            fails.append("split gather")
        full = np.arange(50 * n, dtype=np.float64)
        sc = hpcdp.scatter(full, root=0)
        if not np.array_equal(sc, full[50 * rank: 50 * (rank + 1)]):
            fails.append("split scatter")
        rs = hpcdp.reduce_scatter(full + rank)
        if not np.allclose(rs, sum(full + r for r in range(n))[50 * rank: 50 * (rank + 1)]):
            fails.append("split reduce_scatter")
        a2a = hpcdp.all_to_all(full + 1000 * rank)
        want = np.concatenate([(full + 1000 * j)[50 * rank: 50 * (rank + 1)] for j in range(n)])
        if not np.array_equal(a2a, want):
            fails.append("split all_to_all")
        if n > 1:
            if rank == 0:
                hpcdp.send(x, 1, tag=3)
            elif rank == 1:
                got = hpcdp.recv(np.empty(50), 0, tag=3)
                if not np.array_equal(got, np.arange(50.0)):
                    fails.append("split send/recv")
    finally:
        mpi.set_max_message_elements(old)
    return fails


def body_review_regressions(rank: int) -> list[str]:
    """Cases a review found wrong once: float16 mean, aliased out=, pickling and group lists."""
    n = hpcdp.world_size()
    fails: list[str] = []
    # float16 mean whose sum overflows half precision must still average like numpy
    m = hpcdp.allreduce(np.full(3, 3e4, np.float16), "mean")
    if not np.allclose(m.astype(np.float32), 3e4, rtol=1e-3):
        fails.append(f"float16 mean overflowed: {m}")
    rs = hpcdp.reduce_scatter(np.full(2 * n, 3e4, np.float16), "mean")
    if not np.allclose(rs.astype(np.float32), 3e4, rtol=1e-3):
        fails.append(f"float16 reduce_scatter mean overflowed: {rs}")
    # out= overlapping x without being x (a different view of the same memory)
    x = np.arange(8, dtype=np.float64) + rank
    res = hpcdp.allreduce(x, out=x[...])
    want = sum(np.arange(8.0) + r for r in range(n))
    if not np.array_equal(res, want) or not np.array_equal(x, want):
        fails.append(f"aliased out= allreduce wrong: {res}")
    y = np.arange(2 * n, dtype=np.int64) + 10 * rank
    got = hpcdp.all_to_all(y, out=y[...])
    if not np.array_equal(got, np.array([10 * j + 2 * rank + k for j in range(n) for k in range(2)])):
        fails.append(f"aliased out= all_to_all wrong: {got}")
    # one rank cannot pickle: every rank raises TypeError, nobody waits for the timeout
    obj = (lambda: None) if rank == n - 1 else {"ok": rank}
    try:
        hpcdp.all_gather_object(obj)
        fails.append("all_gather_object of an unpicklable object did not raise")
    except TypeError as exc:
        if f"[{n - 1}]" not in str(exc):
            fails.append(f"unclear pickling error: {exc}")
    try:
        hpcdp.broadcast_object(lambda: None if rank == 0 else None, root=0)
        fails.append("broadcast_object of an unpicklable object did not raise")
    except TypeError:
        pass
    # a bad rank list on one rank: every rank raises the same way
    try:
        hpcdp.new_group([0, n] if rank == 0 else [0])
        fails.append("new_group with a bad list on rank 0 did not raise")
    except (ValueError, hpcdp.CollectiveMismatchError):
        pass
    res = hpcdp.allreduce(np.ones(1))  # everyone still in step
    if res[0] != n:
        fails.append("ranks out of step after the error cases")
    return fails


def body_sim_shape_mismatch(rank: int) -> str:
    """Without HPCDP_DEBUG the sim backend still refuses calls that disagree, on every rank."""
    try:
        hpcdp.allreduce(np.ones(3 if rank == 0 else 4))
    except hpcdp.CollectiveMismatchError as exc:
        return str(exc)
    return "no error"


def body_finished_peer(rank: int) -> str:
    """A rank that returned cannot join: a peer waiting on it fails fast, not at the timeout."""
    import time

    if rank == 0:
        return "done"
    time.sleep(0.2)
    t0 = time.monotonic()
    try:
        hpcdp.allreduce(np.ones(2))
    except hpcdp.PeerFailureError:
        return f"peer failure after {time.monotonic() - t0:.1f}s"
    except hpcdp.CommTimeoutError:
        return "timeout"
    return "no error"


def body_timeout_then_late_peer(rank: int) -> str:
    """MPI: after a timed-out collective the late peer completes it; nothing may crash after."""
    import gc
    import time

    sub = hpcdp.new_group(list(range(hpcdp.world_size())))
    x = np.ones(4 << 20)  # 32 MiB: freed memory would be unmapped at once
    if rank == 0:
        try:
            hpcdp.allreduce(x, group=sub, timeout=1.0)
            return "no timeout"
        except hpcdp.CommTimeoutError:
            pass
        gc.collect()
    elif rank == 1:
        time.sleep(2.5)
        hpcdp.allreduce(x, group=sub, timeout=30)
    else:
        try:
            hpcdp.allreduce(x, group=sub, timeout=5.0)  # other ranks join; the op completes late
        except hpcdp.CommTimeoutError:
            pass
    hpcdp.barrier(timeout=30)  # MPI progress on another communicator while sub's op completes
    time.sleep(0.5)
    hpcdp.barrier(timeout=30)
    return "survived"


def body_all_collectives_async_and_out(rank: int) -> list[str]:
    """async_op=True and out= on every collective; object collectives' success paths."""
    n = hpcdp.world_size()
    fails: list[str] = []
    x = np.arange(2 * n, dtype=np.float64) + rank
    total = sum(np.arange(2 * n, dtype=np.float64) + r for r in range(n))
    root = n - 1
    works = {
        "allreduce": hpcdp.allreduce(x, async_op=True),
        "broadcast": hpcdp.broadcast(x.copy(), root=root, async_op=True),
        "reduce": hpcdp.reduce(x, root=root, async_op=True),
        "all_gather": hpcdp.all_gather(x, async_op=True),
        "gather": hpcdp.gather(x, root=root, async_op=True),
        "scatter": hpcdp.scatter(np.arange(2 * n, dtype=np.float64) * (rank == root), root=root,
                                 async_op=True),
        "reduce_scatter": hpcdp.reduce_scatter(x, async_op=True),
        "all_to_all": hpcdp.all_to_all(x, async_op=True),
    }
    stacked = np.stack([np.arange(2 * n, dtype=np.float64) + r for r in range(n)])
    want = {
        "allreduce": total,
        "broadcast": np.arange(2 * n, dtype=np.float64) + root,
        "reduce": total if rank == root else None,
        "all_gather": stacked,
        "gather": stacked if rank == root else None,
        "scatter": np.arange(2 * n, dtype=np.float64)[2 * rank: 2 * rank + 2],
        "reduce_scatter": total[2 * rank: 2 * rank + 2],
        "all_to_all": stacked[:, 2 * rank: 2 * rank + 2].reshape(-1),
    }
    for name in works:  # waited in the order they were started, after all are in flight
        got = works[name].wait()
        if want[name] is None:
            if got is not None:
                fails.append(f"async {name}: non-root got {got!r}")
        elif got is None or not np.allclose(got, want[name]):
            fails.append(f"async {name}: got {got!r}, want {want[name]!r}")
    # out= on the rooted and reduce_scatter calls, a strided out= included
    out = np.empty(2 * n)
    res = hpcdp.reduce(x, root=root, out=out)
    if rank == root and (res is not out or not np.allclose(out, total)):
        fails.append("reduce out= wrong")
    if rank != root and res is not None:
        fails.append("reduce out= on a non-root returned something")
    gout = np.empty((n, 2 * n))
    res = hpcdp.gather(x, root=0, out=gout)
    if rank == 0 and (res is not gout or not np.allclose(gout, stacked)):
        fails.append("gather out= wrong")
    strided = np.zeros((2, 2))
    res = hpcdp.reduce_scatter(x, out=strided[:, 0])
    if not np.allclose(strided[:, 0], total[2 * rank: 2 * rank + 2]) or strided[:, 1].any():
        fails.append("reduce_scatter into a strided out= wrong")
    # object collectives
    if hpcdp.broadcast_object({"from": rank, "x": [1, 2]} if rank == root else None,
                              root=root) != {"from": root, "x": [1, 2]}:
        fails.append("broadcast_object wrong")
    objs = hpcdp.gather_object(("r", rank), root=0)
    if rank == 0 and objs != [("r", r) for r in range(n)]:
        fails.append(f"gather_object wrong: {objs}")
    if rank != 0 and objs is not None:
        fails.append("gather_object on a non-root returned something")
    if hpcdp.all_gather_object(rank * 2) != [2 * r for r in range(n)]:
        fails.append("all_gather_object wrong")
    return fails


def body_medium_all_gather(rank: int) -> list[str]:
    """all_gather results of 64 KiB-8 MiB (MPI moves them point to point), several in flight."""
    n = hpcdp.world_size()
    fails: list[str] = []
    for count, dtype in ((20_000, np.float32), (70_000, np.int64), (300_001, np.float64)):
        works = [hpcdp.all_gather(np.full(count, 10 * rank + k, dtype), async_op=True)
                 for k in range(3)]
        mid = hpcdp.allreduce(np.full(count, rank, dtype))  # a collective between them
        for k, w in enumerate(works):
            got = w.wait()
            want = np.stack([np.full(count, 10 * r + k, dtype) for r in range(n)])
            if got.shape != want.shape or not np.array_equal(got, want):
                fails.append(f"all_gather of {count} {np.dtype(dtype)} #{k} wrong")
        if not np.array_equal(mid, np.full(count, sum(range(n)), dtype)):
            fails.append(f"allreduce between all_gathers of {count} wrong")
    out = np.empty((n, 40_000), np.float32)
    if hpcdp.all_gather(np.arange(40_000, dtype=np.float32) + rank, out=out) is not out \
            or not np.array_equal(out[:, 0], np.arange(n)):
        fails.append("all_gather out= of 160 KB blocks wrong")
    return fails


def body_p2p_timeout(rank: int) -> list[str]:
    """A blocking recv with nobody sending times out naming the call; bad buffers still raise."""
    import time

    fails: list[str] = []
    if hpcdp.world_size() > 1 and rank == 0:
        t0 = time.monotonic()
        try:
            hpcdp.recv(np.empty(3), 1, tag=3, timeout=0.5)
            fails.append("recv with no sender returned")
        except hpcdp.CommTimeoutError as exc:
            if "recv(src=1, tag=3)" not in str(exc) or "rank 0" not in str(exc):
                fails.append(f"recv timeout message unclear: {exc}")
            if not 0.4 <= time.monotonic() - t0 <= 3.0:
                fails.append(f"recv timed out after {time.monotonic() - t0:.2f} s, asked 0.5 s")
    ro = np.zeros(3)
    ro.flags.writeable = False
    for label, fn in (("read-only recv buffer", lambda: hpcdp.recv(ro, 0 if rank else 1 % max(1, hpcdp.world_size()))),
                      ("recv from self", lambda: hpcdp.recv(np.empty(1), rank)),
                      ("send to self", lambda: hpcdp.send(np.empty(1), rank))):
        try:
            fn()
            fails.append(f"{label}: accepted")
        except ValueError:
            pass
    hpcdp.barrier()
    return fails

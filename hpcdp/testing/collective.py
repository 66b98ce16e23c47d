"""Collective conformance bodies: every op, dtype and shape against numpy, out=, async, groups.

A body runs on every rank of a group (``run_ranks``/``run_mpi``) and returns the failures it saw
as strings instead of raising, so one wrong answer never leaves other ranks stuck in a collective.
"""
from __future__ import annotations

import numpy as np

import hpcdp

from ._cases import COLLECTIVES, DTYPES, OPS, REDUCING, call, close, expected_error, make, reference, shapes

__all__ = ["body_collective", "body_out_and_inplace", "body_async", "body_subgroups",
           "body_all_collectives_async_and_out", "COLLECTIVES"]


def body_collective(rank: int, name: str, dtypes: list[str] | None = None,
                    group_ranks: list[int] | None = None) -> list[str]:
    """Every dtype x shape (x op) of one collective against numpy; returns failure messages."""
    group = None
    if group_ranks is not None:
        group = hpcdp.new_group(group_ranks)
        if not group.is_member:
            return []
        rank = group.rank
    n = group.size if group is not None else hpcdp.world_size()
    fails: list[str] = []
    salt = 0
    for dtype in dtypes or DTYPES:
        for shape in shapes(name, n):
            for op in (OPS if name in REDUCING else ["-"]):
                salt += 1
                root = salt % n
                inputs = [make(r, dtype, shape, salt, n) for r in range(n)]
                x = inputs[rank]
                before = x.copy()
                err = expected_error(name, dtype, shape, op)
                label = f"{name}(dtype={dtype}, shape={shape}, op={op}, root={root}, n={n})"
                try:
                    got = call(name, x, op, root, group)
                except Exception as exc:  # noqa: BLE001 - collected and reported
                    if err is None or not isinstance(exc, err):
                        fails.append(f"{label}: raised {type(exc).__name__}: {exc}")
                    continue
                if err is not None:
                    fails.append(f"{label}: expected {err.__name__}, got a result")
                    continue
                want = reference(name, inputs, rank, op, root)
                if name == "broadcast":
                    got = got if got is not None else x
                if not close(got, want, dtype):
                    fails.append(f"{label}: got {got!r}, want {want!r}")
                if name != "broadcast" and not np.array_equal(x, before, equal_nan=True):
                    fails.append(f"{label}: modified its input")
    return fails


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
        if sub.is_member:   # evens[0] and evens[1]; from 5 ranks on, other evens are not
            res = hpcdp.all_gather(np.array([rank]), group=sub)
            if not np.array_equal(res[:, 0], [evens[1], evens[0]]):
                fails.append(f"group of a group wrong: {res[:, 0]}")
    elif rank in evens:
        g.new_group([0])
    return fails


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

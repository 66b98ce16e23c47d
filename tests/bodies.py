"""Test bodies for the API semantics (out=, async, groups, errors), run on every backend."""
from __future__ import annotations

from typing import Any

import numpy as np

import hpcdp
from hpcdp.testing.collective import (  # noqa: F401 - the conformance bodies, re-exported
    body_all_collectives_async_and_out, body_async, body_out_and_inplace, body_subgroups,
)
from hpcdp.testing.failure import body_finished_peer  # noqa: F401
from hpcdp.testing.p2p import body_p2p  # noqa: F401


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


def body_timeout_then_late_peer(rank: int) -> str:
    """MPI: after a timed-out collective the late peer is told at once that rank 0 left (its
    call raises PeerFailureError instead of waiting); nothing may crash after, though rank 0's
    abandoned request still completes into its buffer once the late peer has joined.

    Rank 1 joins only once rank 0 has said it gave up (message-ordered, ``hpcdp.testing.failure``),
    not after a sleep that a loaded machine can outlast; "at once" is judged by the error, not a
    clock: a late peer that waited for its own 30 s timeout would raise CommTimeoutError.
    """
    import gc
    import time

    from hpcdp.testing.failure import tell_late_rank, wait_until_others_gave_up

    sub = hpcdp.new_group(list(range(hpcdp.world_size())))
    x = np.ones(4 << 20)  # 32 MiB: freed memory would be unmapped at once
    result = "survived"
    if rank == 0:
        try:  # (no early return: the barriers below must be reached on every rank)
            hpcdp.allreduce(x, group=sub, timeout=1.0)
            result = "no timeout"
        except hpcdp.CommTimeoutError:
            gc.collect()
        tell_late_rank(1)
    else:
        if rank == 1:  # (from rank 0 only: the other ranks wait for rank 1 in the allreduce)
            wait_until_others_gave_up(1, from_ranks=[0])
        try:  # other ranks join in time; rank 1 joins after rank 0 gave up
            hpcdp.allreduce(x, group=sub, timeout=30)
            result = "late call succeeded"
        except hpcdp.PeerFailureError as exc:
            if "rank 0 left" not in str(exc) or "timed out" not in str(exc) or exc.peers != (0,):
                result = f"unclear error: {exc}"
        except hpcdp.CommTimeoutError as exc:
            result = f"timed out instead of being told: {exc}"
    hpcdp.barrier(timeout=30)  # MPI progress on another communicator while sub's op completes
    time.sleep(0.5)
    hpcdp.barrier(timeout=30)
    return result


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
    """``hpcdp.testing.p2p.body_p2p_timeout``, with the timeout's own bound checked too."""
    from hpcdp.testing.p2p import body_p2p_timeout as body

    return body(rank, max_elapsed=3.0)


def body_bad_timeouts(rank: int) -> list[str]:
    """nan, negative, zero and infinite timeouts are refused on every call, before anything moves."""
    n = hpcdp.world_size()
    fails: list[str] = []
    x = np.ones(3)
    g = hpcdp.get_default_group()
    for bad in (float("nan"), -1, 0, -0.5, float("inf"), True, "5"):
        want = TypeError if isinstance(bad, (bool, str)) else ValueError
        cases: list[tuple[str, Any]] = [
            ("allreduce", lambda: hpcdp.allreduce(x, timeout=bad)),
            ("allreduce async", lambda: hpcdp.allreduce(x, async_op=True, timeout=bad)),
            ("allreduce out=", lambda: hpcdp.allreduce(x, out=np.empty(3), timeout=bad)),
            ("broadcast", lambda: hpcdp.broadcast(x.copy(), timeout=bad)),
            ("all_gather", lambda: hpcdp.all_gather(x, timeout=bad)),
            ("barrier", lambda: hpcdp.barrier(timeout=bad)),
            ("new_group", lambda: hpcdp.new_group([0], timeout=bad)),
            ("group.timeout", lambda: setattr(g, "timeout", bad)),
        ]
        if n > 1:
            cases += [("send", lambda: hpcdp.send(x, (rank + 1) % n, timeout=bad)),
                      ("recv", lambda: hpcdp.recv(np.empty(3), (rank - 1) % n, timeout=bad))]
        for label, fn in cases:
            try:
                fn()
                fails.append(f"{label}(timeout={bad!r}) accepted")
            except want as exc:
                if "timeout" not in str(exc) or (label != "group.timeout" and "rank" not in str(exc)):
                    fails.append(f"{label}(timeout={bad!r}): unclear message: {exc}")
            except Exception as exc:  # noqa: BLE001
                fails.append(f"{label}(timeout={bad!r}) raised {type(exc).__name__}: {exc}")
        w = hpcdp.allreduce(x, async_op=True)
        try:
            w.wait(timeout=bad)
            fails.append(f"Work.wait(timeout={bad!r}) accepted")
        except want:
            pass
        if not np.array_equal(w.wait(), np.full(3, float(n))):  # still completes normally
            fails.append("Work.wait after a refused timeout gave a wrong result")
    if g.timeout <= 0 or g.timeout != g.timeout:
        fails.append(f"group timeout changed to {g.timeout}")
    if hpcdp.allreduce(np.ones(1), timeout=30)[0] != n:
        fails.append("ranks out of step after the refused timeouts")
    return fails


def body_byte_order(rank: int) -> list[str]:
    """A non-native byte order is refused with a message that says so (and how to convert)."""
    n = hpcdp.world_size()
    fails: list[str] = []
    swapped = np.dtype(np.float64).newbyteorder("S")  # big-endian on this little-endian machine
    x = np.ones(4, dtype=swapped)
    for label, fn in [("allreduce", lambda: hpcdp.allreduce(x)),
                      ("broadcast", lambda: hpcdp.broadcast(x)),
                      ("all_gather", lambda: hpcdp.all_gather(x)),
                      ("out=", lambda: hpcdp.allreduce(np.ones(4), out=np.empty(4, swapped))),
                      ("isend", lambda: hpcdp.isend(x, 0))]:
        try:
            fn()
            fails.append(f"{label}: accepted byte order {swapped.str}")
        except TypeError as exc:
            msg = str(exc)
            if "endian" not in msg or "byte order" not in msg or f"rank {rank}" not in msg:
                fails.append(f"{label}: message does not say byte order: {msg}")
            if "float16/32/64" in msg:
                fails.append(f"{label}: blames the dtype, not the byte order: {msg}")
    native = hpcdp.allreduce(x.astype(x.dtype.newbyteorder("=")))
    if not np.array_equal(native, np.full(4, float(n))):
        fails.append(f"converted array reduced wrong: {native}")
    return fails

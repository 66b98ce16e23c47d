"""Point-to-point conformance bodies: tag matching, large messages, timeouts, bad buffers."""
from __future__ import annotations

import time

import numpy as np

import hpcdp

__all__ = ["body_p2p", "body_p2p_timeout", "body_any_source", "body_batch", "body_probe"]


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


def body_p2p_timeout(rank: int, max_elapsed: float | None = None) -> list[str]:
    """A blocking recv with nobody sending times out naming the call, not before its 0.5 s (nor
    after ``max_elapsed`` seconds, when given); bad buffers still raise."""
    fails: list[str] = []
    if hpcdp.world_size() > 1 and rank == 0:
        t0 = time.monotonic()
        try:
            hpcdp.recv(np.empty(3), 1, tag=3, timeout=0.5)
            fails.append("recv with no sender returned")
        except hpcdp.CommTimeoutError as exc:
            if "recv(src=1, tag=3)" not in str(exc) or "rank 0" not in str(exc):
                fails.append(f"recv timeout message unclear: {exc}")
            took = time.monotonic() - t0
            if took < 0.4 or (max_elapsed is not None and took > max_elapsed):
                fails.append(f"recv timed out after {took:.2f} s, asked 0.5 s")
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


def body_any_source(rank: int) -> list[str]:
    """Rank 0 receives from whoever sends first, allocating from the probed size; every other
    rank sends a message of its own length and tag, then a fixed-size one into a given buffer."""
    n = hpcdp.world_size()
    fails: list[str] = []
    if n == 1:
        w = hpcdp.isend(np.arange(5, dtype=np.int32), 0, tag=4)
        got, st = hpcdp.recv_any(dtype=np.int32)
        w.wait()
        if st != hpcdp.Status(0, 4, 20) or not np.array_equal(got, np.arange(5)):
            fails.append(f"self message through ANY_SOURCE wrong: {st} {got}")
        return fails
    if rank == 0:
        seen: dict[int, tuple[int, list[float]]] = {}
        for _ in range(n - 1):
            got, st = hpcdp.recv_any(dtype=np.float64)  # ANY_SOURCE, ANY_TAG, allocated
            seen[st.source] = (st.tag, got.tolist())
            if st.nbytes != got.nbytes or st.count(np.float64) != got.size:
                fails.append(f"status size {st} does not match the array of {got.nbytes} bytes")
        for r in range(1, n):
            want = (100 + r, [float(r)] * (r * 3))
            if seen.get(r) != want:
                fails.append(f"from rank {r}: got {seen.get(r)}, want {want}")
        hpcdp.barrier()  # the second round is sent only now: ANY_TAG above cannot take it
        buf = np.empty(4, np.int64)
        froms = set()
        for _ in range(n - 1):
            out, st = hpcdp.recv_any(buf, tag=7)
            if out is not buf or st.tag != 7 or not np.all(buf == st.source):
                fails.append(f"recv into a buffer from any source wrong: {st} {buf}")
            froms.add(st.source)
        if froms != set(range(1, n)):
            fails.append(f"fixed-size messages came from {sorted(froms)}")
    else:
        hpcdp.send(np.full(rank * 3, float(rank)), 0, tag=100 + rank)
        hpcdp.barrier()
        hpcdp.send(np.full(4, rank, np.int64), 0, tag=7)
    hpcdp.barrier()
    return fails


def body_batch(rank: int) -> list[str]:
    """A ring exchange of several tagged messages each way, all posted by one batch_isend_irecv
    (receives listed before and after sends), completed by wait_all."""
    n = hpcdp.world_size()
    fails: list[str] = []
    right, left = (rank + 1) % n, (rank - 1) % n
    k = 4
    outs = [np.full(1000 * (t + 1), rank * 10 + t, np.float32) for t in range(k)]
    ins_r = [np.empty(1000 * (t + 1), np.float32) for t in range(k)]
    ins_l = [np.empty(1000 * (t + 1), np.float32) for t in range(k)]
    ops = [hpcdp.P2POp("irecv", ins_l[t], left, tag=t) for t in range(k)]
    ops += [hpcdp.P2POp(hpcdp.isend, outs[t], right, tag=t) for t in range(k)]
    ops += [hpcdp.P2POp(hpcdp.isend, outs[t], left, tag=50 + t) for t in range(k)]
    ops += [hpcdp.P2POp(hpcdp.irecv, ins_r[t], right, tag=50 + t) for t in range(k)]
    works = hpcdp.batch_isend_irecv(ops)
    if len(works) != len(ops):
        fails.append(f"{len(works)} works for {len(ops)} ops")
    hpcdp.wait_all(works, timeout=30)
    for t in range(k):
        if not np.all(ins_l[t] == left * 10 + t) or not np.all(ins_r[t] == right * 10 + t):
            fails.append(f"batched transfer with tag {t} wrong")
    for bad in (("send", np.ones(1), 0), ("isend", "not an array", 0)):
        try:
            hpcdp.batch_isend_irecv([hpcdp.P2POp(*bad)])
            fails.append(f"bad op {bad[0]!r} accepted")
        except (TypeError, ValueError):
            pass
    try:
        hpcdp.batch_isend_irecv([("isend", np.ones(1), right)])
        fails.append("a tuple instead of a P2POp accepted")
    except TypeError:
        pass
    hpcdp.barrier()
    return fails


def body_probe(rank: int) -> list[str]:
    """probe/iprobe see a message without taking it, match source and tag, time out naming the
    call, and reject bad arguments."""
    n = hpcdp.world_size()
    fails: list[str] = []
    if hpcdp.iprobe(tag=12345) is not None:
        fails.append("iprobe found a message nobody sent")
    try:
        hpcdp.probe(tag=12345, timeout=0.3)
        fails.append("probe with no sender returned")
    except hpcdp.CommTimeoutError as exc:
        if "probe" not in str(exc) or f"rank {rank}" not in str(exc):
            fails.append(f"probe timeout message unclear: {exc}")
    for label, fn in (("src out of range", lambda: hpcdp.iprobe(n)),
                      ("negative tag", lambda: hpcdp.iprobe(tag=-5))):
        try:
            fn()
            fails.append(f"{label} accepted")
        except ValueError:
            pass
    if n > 1:
        src = (rank - 1) % n
        hpcdp.barrier()
        w = hpcdp.isend(np.arange(6, dtype=np.int16), (rank + 1) % n, tag=3)
        st = hpcdp.probe(src, 3, timeout=30)
        again = hpcdp.iprobe(src, 3)
        if st != hpcdp.Status(src, 3, 12) or again != st:
            fails.append(f"probe status wrong or the probe took the message: {st} {again}")
        if hpcdp.iprobe(src, 4) is not None:
            fails.append("iprobe matched another tag")
        got = hpcdp.recv(np.empty(6, np.int16), src, tag=3)
        w.wait()
        if not np.array_equal(got, np.arange(6)):
            fails.append("message after probe wrong")
    hpcdp.barrier()
    return fails

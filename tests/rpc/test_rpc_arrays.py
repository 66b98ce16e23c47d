"""Large arrays through hpcdp.rpc: the reusable receive buffers (``_wire.RecvBuffers``) never
hand out memory still in use, arrays of every dtype and layout arrive bit-exact as arguments and
results, and an array announced past the receiver's limits is refused before anything is
allocated for it; on simulated and TCP ranks here, and on the MPI world under mpirun."""
from __future__ import annotations

import hashlib
import tracemalloc

import msgpack
import numpy as np
import pytest

import hpcdp
import hpcdp.rpc as rpc
import rpc_bodies as B
from hpcdp.testing.fixtures import worlds
from hpcdp.testing import check
from hpcdp._arrays import SUPPORTED_DTYPES
from hpcdp.rpc import _codec as C, _protocol as P
from hpcdp._arrays import free_refs
from hpcdp.rpc._wire import RECV_BUFFERS, RecvBuffers

pytestmark = pytest.mark.timeout(240)


_KEPT: dict[str, list[np.ndarray]] = {}  # arguments callees kept, per worker (sim: one process)


@rpc.register
def keep(a: np.ndarray) -> int:
    """A callee that keeps its argument: its receive buffer must never be reused under it."""
    _KEPT.setdefault(rpc.get_worker_info().name, []).append(a)
    return int(a.nbytes)


@rpc.register
def kept_digests() -> list[str]:
    return [_digest(a) for a in _KEPT.pop(rpc.get_worker_info().name, [])]


@rpc.register
def make_array(dtype: str, shape: list, seed: int) -> np.ndarray:
    """A large return value, built on the callee."""
    return B._random_array(np.dtype(dtype), tuple(shape), seed)


@rpc.register
def recv_buffers_reused() -> int:
    return RECV_BUFFERS.reused


def _digest(a: np.ndarray) -> str:
    return f"{a.dtype}{a.shape}" + hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def body_big_arrays(rank: int) -> list[str]:
    """Arrays large enough to take the reusable receive buffers, as arguments and results, of
    every dtype and of odd layouts, in bursts: bit-exact, and an array still held (by the
    caller, or kept by a callee) is never overwritten by a later message of the same size."""
    fails = B.start(rank, rpc_timeout=60)
    to = B.peer(rank)
    n = 3 * RECV_BUFFERS.MIN  # bytes per array: over the size where buffers are reused
    held: list[tuple[np.ndarray, np.ndarray]] = []  # (sent, received), all alive to the end
    for i, dt in enumerate(SUPPORTED_DTYPES):
        for shape in [(n // dt.itemsize,), (4, 3, n // (12 * dt.itemsize)), (0, n), ()]:
            a = B._random_array(dt, shape, 1000 * rank + 10 * i + len(shape))
            b = rpc.rpc_sync(to, B.echo, args=(a,))
            B.check(fails, isinstance(b, np.ndarray) and b.dtype == a.dtype and
                    b.shape == a.shape and b.tobytes() == a.tobytes(), f"{dt} {shape} echo")
            held.append((a, b))
        c = rpc.rpc_sync(to, make_array, args=(dt.name, [n // dt.itemsize], i))
        want = B._random_array(dt, (n // dt.itemsize,), i)
        B.check(fails, c.dtype == dt and c.tobytes() == want.tobytes(), f"{dt} returned")
        held.append((want, c))
    base = np.random.default_rng(7 + rank).standard_normal((256, 384))
    for label, a in [("strided", base[::2, ::3]), ("fortran", np.asfortranarray(base)),
                     ("transposed", base.T), ("big-endian", base.astype(">f8")),
                     ("negative strides", base[::-1, ::-2])]:
        b = rpc.rpc_sync(to, B.echo, args=(a,))
        B.check(fails, b.shape == a.shape and b.dtype.isnative and np.array_equal(b, a),
                f"{label} echo")
        held.append((a.astype(np.float64), b))  # arrives in native byte order
    # bursts in flight, results dropped as they come: their buffers serve the next burst
    for burst in range(3):
        sent = [B._random_array(np.dtype(np.int32), (n // 4,), 50 * burst + k)
                for k in range(16)]
        futs = [rpc.rpc_async(to, B.echo, args=(x,)) for x in sent]
        for k, (x, f) in enumerate(zip(sent, futs)):
            B.check(fails, f.wait().tobytes() == x.tobytes(), f"burst {burst} call {k}")
        del futs
    # the callee keeps what it was sent, then receives more of the same size
    kept = [B._random_array(np.dtype(np.uint8), (n,), 900 + k) for k in range(6)]
    for x in kept:
        rpc.rpc_sync(to, keep, args=(x,))
    for k in range(12):
        rpc.rpc_sync(to, B.echo, args=(np.full(n, k, np.uint8),))
    B.check(fails, rpc.rpc_sync(to, kept_digests) == [_digest(x) for x in kept],
            "an argument a callee kept was overwritten")
    for k, (a, b) in enumerate(held):
        B.check(fails, b.tobytes() == np.ascontiguousarray(a).tobytes(),
                f"received array {k} ({a.dtype} {a.shape}) changed after later messages")
    if not hpcdp.get_default_group().backend.shares_process:  # sim: arrays handed over in memory
        B.check(fails, rpc.rpc_sync(to, recv_buffers_reused) > 0 and RECV_BUFFERS.reused > 0,
                "no receive buffer was ever reused")
    hpcdp.barrier()
    rpc.shutdown()
    return fails


def body_oversized_allocates_nothing(rank: int) -> list[str]:
    """An array announced past the receiver's limits (and really sent) is refused from its
    announcement: the receiver allocates nothing of its size, answers, and serves on."""
    n = 32 << 20
    fails = B.start(rank, rpc_timeout=30,
                    limits=rpc.Limits(max_message_bytes=1 << 20) if rank == 1 else None)
    if rank == 1:
        tracemalloc.start()
        tracemalloc.reset_peak()  # tracing already on (-X tracemalloc): start() kept its peak
        base = tracemalloc.get_traced_memory()[0]
    hpcdp.barrier()
    if rank == 0:
        body = msgpack.packb([C.TUPLE, [C.TUPLE, [C.NDARRAY, "uint8", [n], 0]], [C.DICT]])
        for _ in range(2):
            fut = B.raw_request(1, P.CALL, ["echo"], body, (np.ones(n, np.uint8),), timeout=30.0)
            B.raises(fails, rpc.RemoteError, fut.wait, "oversized announcement",
                     "exceeds the limit")
    hpcdp.barrier()
    if rank == 1:
        peak = tracemalloc.get_traced_memory()[1] - base
        tracemalloc.stop()
        # simulated ranks share one process: the sender's own array is counted there too
        if not hpcdp.get_default_group().backend.shares_process:
            B.check(fails, peak < n // 8,
                    f"{peak} bytes allocated for a refused {n}-byte array")
    got = rpc.rpc_sync(B.peer(rank), B.add, args=(np.ones(3), 1))
    B.check(fails, got.tolist() == [2.0] * 3, "serving after the refused array")
    hpcdp.barrier()
    rpc.shutdown()
    return fails


def test_receive_buffers_reused_only_when_nothing_refers_to_them() -> None:
    """A buffer comes back only once every array, view and memoryview of it is gone; the pool
    never holds more than its cap; small parts and a zero cap get fresh memory."""
    assert free_refs() is not None, "this interpreter's reference counts cannot be used"
    n = 4 * RecvBuffers.MIN
    pool = RecvBuffers(8 * n)

    def addr(a: np.ndarray) -> int:
        return a.__array_interface__["data"][0]

    first = pool.take(n)
    where = addr(first)
    assert first.size == n and first.dtype == np.uint8
    holders = [lambda a: a, lambda a: a[1:], lambda a: memoryview(a),
               lambda a: np.frombuffer(memoryview(a), np.float32).reshape(4, -1)[::2],
               lambda a: memoryview(a)[8:16].cast("d")]
    known = {where}
    for hold in holders:
        keep = hold(first)
        del first
        again = pool.take(n)
        assert addr(again) != where, "a buffer in use was handed out again"
        known.add(addr(again))
        del again
        reused = pool.reused
        other = pool.take(n)  # the one just let go
        assert addr(other) in known and addr(other) != where and pool.reused == reused + 1
        del other, keep
        first = pool.take(n)
        where = addr(first)
        assert where in known, "a free buffer was not reused"
    assert pool.take(n + n // 16).size == n + n // 16  # a larger part: new or a bigger one
    assert pool.reused >= len(holders)
    # never more than the cap of buffers held; what is in use stays with its user
    live = [pool.take(n) for _ in range(20)]
    assert pool._bytes <= pool.cap and len({addr(a) for a in live}) == 20
    live[0][:] = 7
    del live[1:]
    assert (live[0] == 7).all()
    small, off = RecvBuffers(8 * n), RecvBuffers(0)
    for p, size in ((small, RecvBuffers.MIN - 1), (off, n)):
        a = p.take(size)
        del a
        b = p.take(size)
        assert p.reused == 0 and not p._entries and b.size == size


#: big arrays whose receive buffers are reused; an oversized one that allocates nothing
BODIES = [body_big_arrays, body_oversized_allocates_nothing]


@pytest.mark.parametrize("body", BODIES, ids=lambda b: b.__name__)
@pytest.mark.parametrize("world", worlds(*B.spawned(2), "mpi"), indirect=True)
def test_array_bodies(world, body) -> None:
    check(world.run(body, timeout=60, join_timeout=180))

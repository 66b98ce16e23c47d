"""``sendrecv`` and the null neighbour ``PROC_NULL`` (mpi4py's ``Sendrecv`` and ``MPI.PROC_NULL``),
written once and run on simulated, TCP and MPI ranks.

Each body checks many properties in one run of its world and returns what failed, so a world is
started once per body, not once per property.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

import hpcdp
from hpcdp import PROC_NULL
from hpcdp.testing.fixtures import World, worlds


def body_ring_and_edges(rank: int) -> list[str]:
    """Rings in both directions, the edges of a non-periodic line, defaults, dtypes and shapes."""
    g = hpcdp.get_default_group()
    n, fails = g.size, []
    right, left = (rank + 1) % n, (rank - 1) % n
    for dtype in (np.float64, np.float32, np.int64, np.uint8, np.complex128, np.bool_):
        x = (np.arange(6) + 10 * rank).astype(dtype).reshape(2, 3)
        got = g.sendrecv(x, right, np.zeros((2, 3), dtype), left, sendtag=3, recvtag=3)
        want = (np.arange(6) + 10 * left).astype(dtype).reshape(2, 3)
        if not np.array_equal(got, want):
            fails.append(f"ring {np.dtype(dtype)}: {got.tolist()} != {want.tolist()}")
    # the defaults: any source, any tag (mpi4py's), here from the left neighbour only
    buf = np.zeros(4)
    if not np.array_equal(g.sendrecv(np.full(4, rank * 1.0), right, buf, sendtag=7), np.full(4, left * 1.0)):
        fails.append(f"any source / any tag: {buf}")
    # 0-d and empty arrays
    z = g.sendrecv(np.array(rank * 1.0), right, np.array(-1.0), left)
    if float(z) != left:
        fails.append(f"0-d: {z}")
    e = g.sendrecv(np.empty(0), right, np.empty(0), left)
    if e.shape != (0,):
        fails.append(f"empty: {e.shape}")
    # a line (not a ring): the ends have PROC_NULL on one side and keep their buffer
    up = rank - 1 if rank > 0 else PROC_NULL
    down = rank + 1 if rank < n - 1 else PROC_NULL
    ghost = np.full(3, -5.0)
    g.sendrecv(np.full(3, rank * 1.0), down, ghost, up)
    want = np.full(3, -5.0) if up == PROC_NULL else np.full(3, up * 1.0)
    if not np.array_equal(ghost, want):
        fails.append(f"line, from above: {ghost} != {want}")
    # large messages both ways at once: blocking send/recv in this order would need buffering
    big = np.full(1 << 18, rank * 1.0)
    out = g.sendrecv(big, right, np.empty(1 << 18), left)
    if not (out == left).all():
        fails.append("1 MiB ring")
    # without a receive buffer: allocated as recv() does (dtype=)
    got = g.sendrecv(np.arange(5.0) + rank, right, None, left, recvtag=0, dtype=np.float64)
    if not np.array_equal(got, np.arange(5.0) + left):
        fails.append(f"recvbuf=None: {got}")
    got, st = g.sendrecv(np.arange(2.0), right, np.empty(2), left, sendtag=9, recvtag=9,
                         return_status=True)
    if (st.source, st.tag, st.nbytes) != (left, 9, 16):
        fails.append(f"status: {st}")
    g.barrier()
    return fails


def body_proc_null(rank: int) -> list[str]:
    """Every point-to-point call accepts PROC_NULL and does nothing, at once."""
    g = hpcdp.get_default_group()
    fails = []
    t0 = time.monotonic()
    x = np.arange(3.0)
    g.send(x, PROC_NULL)
    g.send(x, PROC_NULL, tag=5)
    buf = np.full(3, 7.0)
    if g.recv(buf, PROC_NULL) is not buf or not (buf == 7.0).all():
        fails.append("recv(buf, PROC_NULL) touched or replaced buf")
    if g.recv(None, PROC_NULL) is not None:
        fails.append("recv(None, PROC_NULL) is not None")
    got, st = g.recv(buf, PROC_NULL, return_status=True)
    if st.source != PROC_NULL or st.nbytes != 0:
        fails.append(f"status of a null receive: {st}")
    w = g.isend(x, PROC_NULL)
    if not w.is_completed() or w.wait() is not None:
        fails.append("isend(PROC_NULL) not complete at once")
    w = g.irecv(buf, PROC_NULL)
    if not w.is_completed() or w.wait() is not buf:
        fails.append("irecv(PROC_NULL) not complete, or not buf")
    if g.sendrecv(x, PROC_NULL, buf, PROC_NULL) is not buf or not (buf == 7.0).all():
        fails.append("sendrecv between two null neighbours")
    if g.probe(PROC_NULL).source != PROC_NULL or g.iprobe(PROC_NULL).source != PROC_NULL:
        fails.append("probe(PROC_NULL)")
    works = hpcdp.batch_isend_irecv([hpcdp.P2POp("isend", x, PROC_NULL),
                                     hpcdp.P2POp("irecv", buf, PROC_NULL)])
    hpcdp.wait_all(works)
    if time.monotonic() - t0 > 5:
        fails.append("null calls waited")
    # bad input is still refused: a bad tag, a non-array
    for call in (lambda: g.send(x, PROC_NULL, tag=-5), lambda: g.send([1, 2], PROC_NULL)):
        try:
            call()
            fails.append("bad input to a null send was accepted")
        except (ValueError, TypeError):
            pass
    g.barrier()
    return fails


def body_bad_sendrecv(rank: int) -> list[str]:
    """Overlapping buffers are refused; a partner that never sends times out, naming the call."""
    g = hpcdp.get_default_group()
    fails = []
    a = np.arange(8.0)
    try:
        g.sendrecv(a[:4], 1 - rank if g.size == 2 else (rank + 1) % g.size, a[2:6], PROC_NULL)
        fails.append("overlapping buffers accepted")
    except ValueError as exc:
        if "overlap" not in str(exc):
            fails.append(f"unclear: {exc}")
    if rank == 0:
        t0 = time.monotonic()
        try:
            g.sendrecv(np.ones(2), 1, np.empty(2), 1, sendtag=11, recvtag=12, timeout=0.5)
            fails.append("no timeout")
        except hpcdp.CommTimeoutError as exc:
            took = time.monotonic() - t0
            if not 0.45 <= took < 10 or "recv" not in str(exc) or "rank 0" not in str(exc):
                fails.append(f"timeout after {took:.2f} s: {exc}")
    elif rank == 1:  # take rank 0's message so nothing is left in flight
        g.recv(np.empty(2), 0, tag=11)
    g.barrier()
    return fails


def body_any_tag(rank: int) -> list[str]:
    """mpi4py's default ``recvtag`` (any tag) from one source: messages of any tag, in order,
    one that arrives late, a message of another dtype, and a source that sends nothing."""
    g = hpcdp.get_default_group()
    n, fails = g.size, []
    right, left = (rank + 1) % n, (rank - 1) % n
    for i, tag in enumerate((5, 0, 123, 5)):
        got = g.sendrecv(np.full(3, 10.0 * rank + i), right, np.zeros(3), left, sendtag=tag)
        if not np.array_equal(got, np.full(3, 10.0 * left + i)):
            fails.append(f"tag {tag}: {got}")
    # any source too (mpi4py's default ``source``): here only the left neighbour sends to us
    for i in range(3):
        got = g.sendrecv(np.full(2, rank + 0.25 * i), right, np.zeros(2))
        if not (got == left + 0.25 * i).all():
            fails.append(f"any source, step {i}: {got}")
    # halves of different sizes: a large send still in flight once the small receive is done,
    # and the other way round (the size a rank sends: by its parity)
    def size(r: int) -> int:
        return 3 if r % 2 == 0 else 1 << 17
    for i in range(2):
        got = g.sendrecv(np.full(size(rank), rank + 2.0 + i), right, np.zeros(size(left)), left)
        if not (got == left + 2.0 + i).all():
            fails.append(f"halves of {size(rank)} and {size(left)} elements, step {i}")
    for shape in ((2, 3), (6,), ()):  # n-D and 0-d messages, into buffers of their shape
        got = g.sendrecv(np.full(shape, rank + 0.5), right, np.zeros(shape), left)
        if got.shape != shape or not (got == left + 0.5).all():
            fails.append(f"shape {shape}: {got}")
    if rank == 0:  # rank 0's receive is waited for past the lane's spin
        time.sleep(0.2)
        g.send(np.full(2, 7.0), right, tag=4)
        got = g.recv(np.zeros(2), left, tag=4)
    else:
        got = g.sendrecv(np.full(2, 7.0), right, np.zeros(2), left, sendtag=4)
    if not (got == 7.0).all():
        fails.append(f"late message: {got}")
    g.barrier()
    # another dtype than the buffer's: refused by name, as a receive of its tag is
    try:
        g.sendrecv(np.ones(4, np.float32), right, np.zeros(4), left, sendtag=8, timeout=5)
        fails.append("a float32 message was taken into a float64 buffer")
    except hpcdp.CollectiveMismatchError as exc:
        if "float32" not in str(exc):
            fails.append(f"unclear mismatch: {exc}")
        g.recv(np.zeros(4, np.float32), left, tag=8)  # take it: nothing left in flight
    g.barrier()
    if rank == 0:  # a source that sends nothing: a timeout naming what did not arrive
        t0 = time.monotonic()
        try:
            g.sendrecv(np.ones(2), right, np.empty(2), left, sendtag=6, timeout=0.5)
            fails.append("no timeout")
        except hpcdp.CommTimeoutError as exc:
            took = time.monotonic() - t0
            if not 0.45 <= took < 10 or f"rank {left}" not in str(exc):
                fails.append(f"timeout after {took:.2f} s: {exc}")
    elif rank == 1:  # rank 0's right neighbour takes its message
        g.recv(np.empty(2), 0, tag=6)
    g.barrier()
    return fails


@pytest.mark.parametrize("world", worlds("sim-2", "sim-3", "tcp-3", "mpi"), indirect=True)
def test_sendrecv_any_tag_from_one_source(world: World) -> None:
    out = world.run(body_any_tag, timeout=60)
    assert out == [[]] * world.size, out


@pytest.mark.parametrize("world", worlds("sim-1", "sim-2", "sim-3", "sim-4", "tcp-3", "mpi"),
                         indirect=True)
def test_sendrecv_rings_lines_and_shapes(world: World) -> None:
    out = world.run(body_ring_and_edges, timeout=60)
    assert out == [[]] * world.size, out


@pytest.mark.parametrize("world", worlds("sim-1", "sim-2", "tcp-3", "mpi"), indirect=True)
def test_proc_null_everywhere(world: World) -> None:
    out = world.run(body_proc_null, timeout=60)
    assert out == [[]] * world.size, out


@pytest.mark.parametrize("world", worlds("sim-2", "tcp-3", "mpi"), indirect=True)
def test_sendrecv_refuses_overlap_and_times_out(world: World) -> None:
    out = world.run(body_bad_sendrecv, timeout=60)
    assert out == [[]] * world.size, out


def test_sendrecv_is_exported_like_mpi4py() -> None:
    assert hpcdp.PROC_NULL == -2 and hpcdp.ANY_SOURCE == -1   # MPI's values (Open MPI, MPICH)
    assert "sendrecv" in hpcdp.__all__ and "PROC_NULL" in hpcdp.__all__

"""``recv()`` without a buffer returns the sender's dtype and shape (mpi4py's ``comm.recv()``
gives back what was sent), on simulated, TCP and MPI ranks; a receive into a buffer of another
dtype fails naming both; probes and ``Status`` say what was sent.

Each body checks many properties in one run of its world and returns what failed, so a world is
started once per body, not once per property.
"""
from __future__ import annotations

import numpy as np
import pytest

import hpcdp
from hpcdp import ANY_SOURCE, ANY_TAG
from hpcdp._arrays import SUPPORTED_DTYPES
from hpcdp.errors import CollectiveMismatchError
from hpcdp.testing.fixtures import World, worlds

#: shapes every dtype travels in: 0-d, empty, 1-D of odd length, 2-D, 3-D, an empty 2-D
SHAPES = ((), (0,), (7,), (3, 5), (2, 3, 4), (0, 4))


def _value(dtype: np.dtype, shape: tuple[int, ...], seed: int) -> np.ndarray:
    n = int(np.prod(shape, dtype=np.int64))
    raw = (np.arange(n) * 7 + seed) % 100
    if dtype.kind == "b":
        x = raw % 3 == 0
    elif dtype.kind == "c":
        x = raw + 1j * (raw + 1)
    else:
        x = raw
    return np.asarray(x).astype(dtype).reshape(shape)


def _same(got: object, want: np.ndarray) -> str:
    """'' if ``got`` is an ndarray equal to ``want`` in dtype, shape and values, else why not."""
    if not isinstance(got, np.ndarray):
        return f"got {type(got).__name__}, not an ndarray"
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"got {got.dtype} {got.shape}, want {want.dtype} {want.shape}"
    if not np.array_equal(got, want):
        return f"values differ: {got.ravel()[:6]} vs {want.ravel()[:6]}"
    return ""


def body_dtypes_and_shapes(rank: int) -> list[str]:
    """Every supported dtype in every shape, rank 0 to the last rank, through ``recv()`` without a
    buffer, ``recv(return_status=True)``, ``irecv`` into the probed shape, and ``sendrecv``."""
    g = hpcdp.get_default_group()
    n, fails = g.size, []
    last = n - 1
    cases = [(dt, sh) for dt in SUPPORTED_DTYPES for sh in SHAPES]
    if rank == 0:
        for i, (dt, sh) in enumerate(cases):
            x = _value(dt, sh, i)
            g.send(x, last, tag=i % 5)
            # non-contiguous: a column of a 2-D array, and a strided 3-D block
        g.send(np.arange(24.0).reshape(4, 6)[:, 1], last, tag=9)
        g.send(np.arange(60, dtype=np.int32).reshape(3, 4, 5)[::2, 1:3, ::2], last, tag=9)
    if rank == last:
        for i, (dt, sh) in enumerate(cases):
            want = _value(dt, sh, i)
            if i % 3 == 0:
                got = g.recv(src=0, tag=i % 5)
            elif i % 3 == 1:
                got, st = g.recv(None, 0, i % 5, return_status=True)
                if (st.source, st.tag, st.nbytes) != (0, i % 5, want.nbytes):
                    fails.append(f"status of {dt} {sh}: {st}")
                if st.dtype != dt or st.shape != sh:
                    fails.append(f"status of {dt} {sh} says {st.dtype} {st.shape}")
                if st.count() != want.size or st.count(np.uint8) != want.nbytes:
                    fails.append(f"count of {dt} {sh}: {st.count()} / {st.count(np.uint8)}")
            else:
                got = hpcdp.recv(src=0, tag=i % 5)  # the module-level spelling
            why = _same(got, want)
            if why:
                fails.append(f"{dt} {sh}: {why}")
        got = g.recv(src=0, tag=9)
        why = _same(got, np.arange(24.0).reshape(4, 6)[:, 1])
        if why:
            fails.append(f"column: {why}")
        got = g.recv(src=0, tag=9)
        why = _same(got, np.arange(60, dtype=np.int32).reshape(3, 4, 5)[::2, 1:3, ::2])
        if why:
            fails.append(f"strided block: {why}")
    # sendrecv without a receive buffer, in a ring: the left neighbour's dtype and shape
    right, left = (rank + 1) % n, (rank - 1) % n
    x = _value(np.dtype(np.complex64), (2, 2), rank)
    got = g.sendrecv(x, right, None, left, sendtag=4, recvtag=4)
    why = _same(got, _value(np.dtype(np.complex64), (2, 2), left))
    if why:
        fails.append(f"sendrecv ring: {why}")
    g.barrier()
    return fails


def body_wildcards_and_probes(rank: int) -> list[str]:
    """Any source and any tag, probes before receives, ``dtype=`` reinterpreting the bytes, and
    receives without a buffer mixed with receives into buffers on the same tags."""
    g = hpcdp.get_default_group()
    n, fails = g.size, []
    if rank != 0:
        g.send(np.full((rank, 2), rank, np.int16), 0, tag=20 + rank)
        g.barrier()
        # the same tag: without a buffer, into a buffer, without, into a buffer (in order)
        g.send(np.arange(3.0) + rank, 0, tag=5)
        g.send(np.full((2, 2), rank, np.int64), 0, tag=5)
        g.send(np.array(rank * 1.5), 0, tag=5)
        g.send(np.arange(6, dtype=np.float32).reshape(2, 3) * rank, 0, tag=5)
        g.barrier()
        g.send(np.arange(4, dtype=np.int32), 0, tag=30)
        g.send(np.arange(4, dtype=np.int32).reshape(2, 2), 0, tag=31)
        g.send(np.arange(4.0), 0, tag=32)
        g.barrier()
        return fails
    # any source, any tag: the int16 (rank, 2) arrays, as sent
    seen = set()
    for _ in range(n - 1):
        got, st = hpcdp.recv_any()
        seen.add(st.source)
        if st.tag != 20 + st.source or st.dtype != np.int16 or st.shape != (st.source, 2):
            fails.append(f"any source/tag status: {st} {st.dtype} {st.shape}")
        why = _same(got, np.full((st.source, 2), st.source, np.int16))
        if why:
            fails.append(f"any source/tag from {st.source}: {why}")
    if seen != set(range(1, n)):
        fails.append(f"any source: came from {sorted(seen)}")
    g.barrier()
    for r in range(1, n):
        a = g.recv(src=r, tag=5)
        b = g.recv(np.zeros((2, 2), np.int64), r, 5)
        c = g.recv(src=r, tag=5)
        d = g.recv(np.zeros((2, 3), np.float32), r, 5)
        for what, got, want in (("1-D", a, np.arange(3.0) + r), ("into (2,2)", b, np.full((2, 2), r, np.int64)),
                                ("0-d", c, np.array(r * 1.5)),
                                ("into (2,3)", d, np.arange(6, dtype=np.float32).reshape(2, 3) * r)):
            why = _same(got, want)
            if why:
                fails.append(f"mixed on one tag, {what} from {r}: {why}")
    g.barrier()
    for r in range(1, n):
        st = g.probe(r, 31, timeout=30)
        if (st.source, st.tag, st.dtype, st.shape) != (r, 31, np.dtype(np.int32), (2, 2)):
            fails.append(f"probe: {st} {st.dtype} {st.shape}")
        st = hpcdp.probe(ANY_SOURCE, 30, timeout=30)
        if st.tag != 30 or st.dtype != np.int32 or st.shape != (4,) or st.count() != 4:
            fails.append(f"probe any source: {st} {st.dtype} {st.shape}")
        got = g.recv(src=st.source, tag=30)
        why = _same(got, np.arange(4, dtype=np.int32))
        if why:
            fails.append(f"after a probe: {why}")
        got = g.recv(src=r, tag=31)
        why = _same(got, np.arange(4, dtype=np.int32).reshape(2, 2))
        if why:
            fails.append(f"after a probe, 2-D: {why}")
        # dtype= other than the sender's: the bytes as a 1-D array of that dtype
        got = g.recv(src=r, tag=32, dtype=np.uint8)
        why = _same(got, np.arange(4.0).view(np.uint8))
        if why:
            fails.append(f"dtype=uint8 of float64: {why}")
    if hpcdp.iprobe(ANY_SOURCE, ANY_TAG) is not None:
        fails.append("a message is left over")
    g.barrier()
    return fails


def body_dtype_mismatch(rank: int) -> list[str]:
    """A receive into a buffer of another dtype than the sender's raises
    ``CollectiveMismatchError`` naming both; the message stays for a receive that fits; a
    buffer of the sender's dtype and size but another shape (or 0-d into 1-D) is fine."""
    g = hpcdp.get_default_group()
    fails: list[str] = []
    if rank == 0:
        g.send(np.arange(4.0), 1, tag=3)
        g.send(np.array(2.5), 1, tag=4)
        g.send(np.arange(6, dtype=np.int64).reshape(2, 3), 1, tag=4)
        g.send(np.arange(6, dtype=np.int64), 1, tag=4)
        g.barrier()
    elif rank == 1:
        try:
            g.recv(np.zeros(4, np.float32), 0, 3, timeout=10)
            fails.append("float32 buffer for a float64 message: no error")
        except CollectiveMismatchError as exc:
            if "float64" not in str(exc) or "float32" not in str(exc):
                fails.append(f"mismatch error does not name both dtypes: {exc}")
        except Exception as exc:  # noqa: BLE001 - reported as a failure
            fails.append(f"mismatch: {type(exc).__name__}: {exc}")
        w = g.irecv(np.zeros(2, np.int64), 0, 3)  # nonblocking: the wait raises
        try:
            w.wait(10)
            fails.append("irecv of int64 for a float64 message: no error")
        except CollectiveMismatchError as exc:
            if "float64" not in str(exc) or "int64" not in str(exc):
                fails.append(f"irecv mismatch error does not name both dtypes: {exc}")
        except Exception as exc:  # noqa: BLE001 - reported as a failure
            fails.append(f"irecv mismatch: {type(exc).__name__}: {exc}")
        why = _same(g.recv(np.zeros(4), 0, 3, timeout=30), np.arange(4.0))
        if why:
            fails.append(f"the message after the mismatch: {why}")
        why = _same(g.recv(np.zeros(1), 0, 4, timeout=30), np.array([2.5]))
        if why:
            fails.append(f"0-d into (1,): {why}")
        why = _same(g.recv(np.zeros(6, np.int64), 0, 4, timeout=30), np.arange(6, dtype=np.int64))
        if why:
            fails.append(f"(2,3) into (6,): {why}")
        why = _same(g.recv(np.zeros((3, 2), np.int64), 0, 4, timeout=30),
                    np.arange(6, dtype=np.int64).reshape(3, 2))
        if why:
            fails.append(f"(6,) into (3,2): {why}")
        g.barrier()
    else:
        g.barrier()
    g.barrier()
    return fails


def body_to_oneself(rank: int) -> list[str]:
    """A message to oneself (``isend`` to this rank), received without a buffer: any world size,
    one rank included."""
    g = hpcdp.get_default_group()
    fails: list[str] = []
    x = np.arange(12, dtype=np.float32).reshape(3, 4) + rank
    w = g.isend(x, rank, tag=6)
    got, st = g.recv(src=rank, tag=6, return_status=True)
    w.wait()
    why = _same(got, x)
    if why:
        fails.append(f"to oneself: {why}")
    if (st.source, st.dtype, st.shape, st.count()) != (rank, np.dtype(np.float32), (3, 4), 12):
        fails.append(f"to oneself, status: {st} {st.dtype} {st.shape} {st.count()}")
    w = g.isend(np.array(7, np.uint16), rank, tag=6)
    got, st = hpcdp.recv_any(tag=6)
    w.wait()
    why = _same(got, np.array(7, np.uint16))
    if why:
        fails.append(f"to oneself, any source: {why}")
    g.barrier()
    return fails


def _check(world: World, body, timeout: float = 60.0) -> None:
    fails = [f for res in world.run(body, timeout=timeout) for f in res]
    assert not fails, fails


def test_recv_without_buffer_returns_the_senders_dtype_and_shape(world: World) -> None:
    _check(world, body_dtypes_and_shapes)


def test_wildcards_probes_and_mixed_receives(world: World) -> None:
    _check(world, body_wildcards_and_probes)


@pytest.mark.parametrize("world", worlds("sim-2", "tcp-3", "mpi"), indirect=True)
def test_a_buffer_of_another_dtype_fails_naming_both(world: World) -> None:
    _check(world, body_dtype_mismatch)


@pytest.mark.parametrize("world", worlds("sim-1", "sim-3", "tcp-1", "mpi"), indirect=True)
def test_to_oneself(world: World) -> None:
    _check(world, body_to_oneself)


def test_tcp_header_carries_every_shape_and_refuses_a_lying_one() -> None:
    """The TCP frame header's signature fields round-trip dtype and shape (up to 33 dimensions,
    empty ones included), and a header whose shape does not account for the bytes that arrived
    (a peer's word) gives nothing, so nothing is allocated or viewed past them."""
    from hpcdp.backends.tcp import _wire as wire

    shapes = [(), (0,), (7,), (3, 5), (2, 3, 4), (0, 4), (2, 0, 3), (5, 3, 2, 7), (1,) * 10,
              (2,) * 20, (1,) * 32 + (1000,)]
    for dt in SUPPORTED_DTYPES:
        for sh in shapes:
            x = np.empty(sh, dt)
            sig = wire.p2p_sig(x)
            wire.HEADER.pack(1, 0, *sig, 0, 0, x.nbytes)  # fits the header's fields
            assert wire.p2p_meta(sig, x.nbytes) == (dt, sh), (dt, sh, sig)
            # more bytes than the header says: nothing, or a shape that holds exactly them
            dt2, sh2 = wire.p2p_meta(sig, x.nbytes + dt.itemsize)
            assert dt2 is None or int(np.prod(sh2)) * dt.itemsize == x.nbytes + dt.itemsize, \
                (dt, sh, sh2)
    f8 = np.dtype(np.float64)
    huge = wire.p2p_sig(np.empty((3, 5), f8))[:2] + (2**32 - 1, 2**32 - 1, 2**64 - 1)
    assert wire.p2p_meta(huge, 120) == (None, None)
    assert wire.p2p_meta((2, 200, 0, 0, 0), 8) == (None, None)  # no such dtype
    assert wire.p2p_refuses(wire.recv_sig(np.empty(2, np.float32)), wire.p2p_sig(np.empty(1, f8)))
    assert not wire.p2p_refuses(wire.recv_sig(np.empty(2, f8)), wire.p2p_sig(np.empty((1, 2), f8)))


def test_mpi_tags_fall_back_where_tag_ub_is_small() -> None:
    """An MPI whose TAG_UB leaves fewer than 32767 user tags keeps plain tags (no dtype carried);
    the Open MPI one carries it and gives user tags up to TAG_UB >> 6."""
    from types import SimpleNamespace

    from hpcdp.backends.mpi._meta import SHIFT, TagMeta

    mpi = SimpleNamespace(INT64_T=object())
    small = TagMeta(mpi, None, None, 2**20, True)
    assert (small.on, small.max_tag) == (False, 2**20)
    big = TagMeta(mpi, None, None, 2**31 - 1, True)
    assert (big.on, big.max_tag) == (True, (2**31 - 1) >> SHIFT) and big.max_tag >= 32767
    assert not TagMeta(mpi, None, None, 2**31 - 1, False).on  # a dup's: bytes, plain tags

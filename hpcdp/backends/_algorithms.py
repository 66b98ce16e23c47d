"""Ring and tree collectives written once over a tiny point-to-point interface.

A backend that can move bytes between ranks (TCP, or the simulated backend with
``HPCDP_SIM_ALGORITHMS=p2p``, see ``sim.SimP2PBackend``) gets every collective from here. The interface is duck-typed::

    comm.rank, comm.size
    comm.isend(buf, dst, tag) -> request      # buf: contiguous 1-D array, unmodified until waited
    comm.irecv(buf, src, tag) -> request      # matched per (src, tag), non-overtaking
    comm.wait(reqs)                           # block until all complete; raises on peer failure

Every algorithm is a plain, blocking function of ``comm`` and buffers (no threads, no requests);
``_runner.P2PBackend`` runs them on a worker thread per group and is the base class of every
backend that gets its collectives from here.
Reductions use numpy ufuncs with ``out=`` into preallocated buffers; float16 is reduced in float32
and rounded once, as the simulated and MPI backends do.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .._arrays import shard_bounds
from ..ops import ReduceOp

__all__ = [
    "allreduce", "broadcast", "reduce", "all_gather", "gather", "scatter", "reduce_scatter",
    "all_to_all", "barrier", "SMALL_BYTES", "PIECE_BYTES",
]

#: below this many bytes allreduce uses recursive doubling (latency) instead of the ring (bandwidth)
SMALL_BYTES = 64 * 1024
#: ring and tree messages are cut into pieces of this size so forwarding and reducing overlap
#: (4 MiB: each piece costs thread wake-ups, which outweigh finer pipelining on loaded hosts)
PIECE_BYTES = 4 << 20

TAG = 0


def _pieces(length: int, itemsize: int) -> list[tuple[int, int]]:
    step = max(1, PIECE_BYTES // max(1, itemsize))
    if length == 0:
        return [(0, 0)]
    return [(a, min(a + step, length)) for a in range(0, length, step)]


def _work_dtype(dt: np.dtype) -> np.dtype:
    return np.dtype(np.float32) if dt == np.float16 else dt


# -- allreduce ------------------------------------------------------------------------------
def allreduce(c: Any, send: np.ndarray, recv: np.ndarray, op: ReduceOp) -> None:
    """Every rank gets the elementwise reduction of every rank's ``send`` in ``recv``."""
    wdt = _work_dtype(recv.dtype)
    if (c.size > 1 and recv.nbytes > SMALL_BYTES and recv.size >= c.size and recv.ndim == 1
            and wdt == recv.dtype == send.dtype and send.size == recv.size
            and (send is recv or not np.may_share_memory(send, recv))):
        # ring without the initial copy: reductions read ``send`` and write ``recv``
        bounds = shard_bounds(recv.size, c.size)
        _ring_reduce_scatter(c, recv, bounds, op, src=send.reshape(-1))
        _ring_all_gather(c, recv, bounds)
        return
    work = recv if wdt == recv.dtype else np.empty(recv.shape, wdt)
    if work is not send:
        np.copyto(work, send, casting="unsafe")
    if c.size > 1 and work.size:
        if work.nbytes <= SMALL_BYTES or work.size < c.size:
            _recursive_doubling(c, work, op)
        else:
            bounds = shard_bounds(work.size, c.size)
            _ring_reduce_scatter(c, work, bounds, op)
            _ring_all_gather(c, work, bounds)
    if work is not recv:
        np.copyto(recv, work, casting="unsafe")


def _recursive_doubling(c: Any, work: np.ndarray, op: ReduceOp) -> None:
    """log2(n) exchanges; non-powers of two fold the extra ranks in first and out last."""
    n, r, uf = c.size, c.rank, op.ufunc
    p2 = 1 << (n.bit_length() - 1)
    extra = n - p2
    tmp = np.empty_like(work)
    if r >= p2:  # fold in: hand my data to r - p2, get the result back at the end
        c.wait([c.isend(work, r - p2, TAG)])
        c.wait([c.irecv(work, r - p2, TAG)])
        return
    if r < extra:
        c.wait([c.irecv(tmp, r + p2, TAG)])
        uf(work, tmp, out=work)
    mask = 1
    while mask < p2:
        peer = r ^ mask
        rq = c.irecv(tmp, peer, TAG)
        sq = c.isend(work, peer, TAG)
        c.wait([rq, sq])
        # lower rank puts its own data first, so both partners compute bitwise the same value
        if r < peer:
            uf(work, tmp, out=work)
        else:
            uf(tmp, work, out=work)
        mask <<= 1
    if r < extra:
        c.wait([c.isend(work, r + p2, TAG)])


def _ring_reduce_scatter(c: Any, work: np.ndarray, bounds: Sequence[tuple[int, int]],
                         op: ReduceOp, src: np.ndarray | None = None) -> None:
    """After this, segment ``rank`` of ``work`` holds the full reduction (pipelined by pieces).

    ``src`` (same length and dtype as ``work``) holds this rank's data when it is not already in
    ``work``: it is read, never written, and saves copying it into ``work`` first. Segments of
    ``work`` other than ``rank`` hold partial sums afterwards (or nothing, with ``src``).
    """
    n, r, uf = c.size, c.rank, op.ufunc
    right, left = (r + 1) % n, (r - 1) % n
    mine = work if src is None else src

    def seg(k: int, arr: np.ndarray = work) -> np.ndarray:
        a, b = bounds[k % n]
        return arr[a:b]

    maxlen = max(b - a for a, b in bounds)
    tmp = [np.empty(maxlen, work.dtype), np.empty(maxlen, work.dtype) if n > 2 else None]
    isz = work.dtype.itemsize

    def post(s: int) -> list[Any]:
        length = len(seg(r - s - 2))
        buf = tmp[s % 2]
        return [c.irecv(buf[a:b], left, TAG) for a, b in _pieces(length, isz)]

    posted = {0: post(0)}
    first = seg(r - 1, mine)
    sends = [c.isend(first[a:b], right, TAG) for a, b in _pieces(len(first), isz)]
    for s in range(n - 1):
        if s + 1 < n - 1:
            posted[s + 1] = post(s + 1)
        dst = seg(r - s - 2)
        own = seg(r - s - 2, mine)
        buf = tmp[s % 2]
        for (a, b), rq in zip(_pieces(len(dst), isz), posted.pop(s)):
            c.wait([rq])
            uf(own[a:b], buf[a:b], out=dst[a:b])
            if s < n - 2:
                sends.append(c.isend(dst[a:b], right, TAG))
    c.wait(sends)


def _ring_all_gather(c: Any, work: np.ndarray, bounds: Sequence[tuple[int, int]]) -> None:
    """Each rank owns segment ``rank``; afterwards every rank has all segments (zero copy)."""
    n, r = c.size, c.rank
    right, left = (r + 1) % n, (r - 1) % n
    isz = work.dtype.itemsize

    def seg(k: int) -> np.ndarray:
        a, b = bounds[k % n]
        return work[a:b]

    recvs = []
    for s in range(n - 1):
        dst = seg(r - s - 1)
        recvs.append([(dst[a:b], c.irecv(dst[a:b], left, TAG)) for a, b in _pieces(len(dst), isz)])
    own = seg(r)
    sends = [c.isend(own[a:b], right, TAG) for a, b in _pieces(len(own), isz)]
    for s in range(n - 1):
        for piece, rq in recvs[s]:
            c.wait([rq])
            if s < n - 2:
                sends.append(c.isend(piece, right, TAG))
    c.wait(sends)


# -- reduce_scatter / all_gather ------------------------------------------------------------
def reduce_scatter(c: Any, send: np.ndarray, recv: np.ndarray, op: ReduceOp) -> None:
    """``send`` is (size, m); rank i gets the reduction of every rank's row i in ``recv`` (m,)."""
    n, r, m = c.size, c.rank, recv.size
    wdt = _work_dtype(recv.dtype)
    flat = send.reshape(-1)
    if n > 1 and m and flat.nbytes > SMALL_BYTES and wdt == flat.dtype:
        work = np.empty(flat.shape, wdt)  # only segment r is written; ``send`` is only read
        _ring_reduce_scatter(c, work, [(i * m, (i + 1) * m) for i in range(n)], op, src=flat)
        np.copyto(recv, work[r * m:(r + 1) * m], casting="unsafe")
        return
    work = np.array(flat, dtype=wdt, copy=True)
    if n > 1 and work.size:
        if work.nbytes <= SMALL_BYTES:
            _recursive_doubling(c, work, op)
        else:
            _ring_reduce_scatter(c, work, [(i * m, (i + 1) * m) for i in range(n)], op)
    np.copyto(recv, work[r * m:(r + 1) * m], casting="unsafe")


def all_gather(c: Any, send: np.ndarray, recv: np.ndarray) -> None:
    """``recv`` (size, m) gets every rank's ``send`` (m,) in rank order."""
    n, r, m = c.size, c.rank, send.size
    np.copyto(recv[r], send)
    if n > 1 and m:
        _ring_all_gather(c, recv.reshape(-1), [(i * m, (i + 1) * m) for i in range(n)])


# -- trees -----------------------------------------------------------------------------------
def broadcast(c: Any, buf: np.ndarray, root: int) -> None:
    """Binomial tree from ``root``; pieces are forwarded to children as they arrive."""
    n = c.size
    if n == 1 or buf.size == 0:
        return
    vr = (c.rank - root) % n
    pieces = _pieces(buf.size, buf.dtype.itemsize)
    mask = 1
    recvs: list[Any] = []
    while mask < n:
        if vr & mask:
            parent = (vr - mask + root) % n
            recvs = [c.irecv(buf[a:b], parent, TAG) for a, b in pieces]
            break
        mask <<= 1
    children = []
    mask >>= 1
    while mask > 0:
        if vr + mask < n:
            children.append((vr + mask + root) % n)
        mask >>= 1
    sends = []
    for i, (a, b) in enumerate(pieces):
        if recvs:
            c.wait([recvs[i]])
        sends += [c.isend(buf[a:b], ch, TAG) for ch in children]
    c.wait(sends)


def reduce(c: Any, send: np.ndarray, recv: np.ndarray | None, op: ReduceOp, root: int) -> None:
    """Binomial tree towards ``root``; ``recv`` is only used on root."""
    n, uf = c.size, op.ufunc
    wdt = _work_dtype(send.dtype)
    if c.rank == root and recv is not None and wdt == recv.dtype:
        acc = recv
        if acc is not send:
            np.copyto(acc, send)
    else:
        acc = np.array(send, dtype=wdt, copy=True)
    if n > 1 and acc.size:
        vr = (c.rank - root) % n
        tmp = np.empty_like(acc)
        mask = 1
        while mask < n:
            if vr & mask:
                c.wait([c.isend(acc, (vr - mask + root) % n, TAG)])
                break
            if vr + mask < n:
                c.wait([c.irecv(tmp, (vr + mask + root) % n, TAG)])
                uf(acc, tmp, out=acc)
            mask <<= 1
    if c.rank == root and recv is not None and acc is not recv:
        np.copyto(recv, acc, casting="unsafe")


# -- direct ----------------------------------------------------------------------------------
def gather(c: Any, send: np.ndarray, recv: np.ndarray | None, root: int) -> None:
    """Root posts one receive per rank into its row of ``recv`` (size, m)."""
    if c.rank == root:
        assert recv is not None
        np.copyto(recv[root], send)
        c.wait([c.irecv(recv[i], i, TAG) for i in range(c.size) if i != root])
    else:
        c.wait([c.isend(send, root, TAG)])


def scatter(c: Any, send: np.ndarray | None, recv: np.ndarray, root: int) -> None:
    """Root sends row i of ``send`` (size, m) to rank i."""
    if c.rank == root:
        assert send is not None
        reqs = [c.isend(send[i], i, TAG) for i in range(c.size) if i != root]
        np.copyto(recv, send[root])
        c.wait(reqs)
    else:
        c.wait([c.irecv(recv, root, TAG)])


def all_to_all(c: Any, send: np.ndarray, recv: np.ndarray) -> None:
    """Pairwise exchange: at step s send row r+s, receive row r-s (all posted at once)."""
    n, r = c.size, c.rank
    np.copyto(recv[r], send[r])
    reqs = [c.irecv(recv[(r - s) % n], (r - s) % n, TAG) for s in range(1, n)]
    reqs += [c.isend(send[(r + s) % n], (r + s) % n, TAG) for s in range(1, n)]
    c.wait(reqs)


def barrier(c: Any) -> None:
    """Dissemination barrier: ceil(log2 n) rounds of one tiny message each way."""
    n, r = c.size, c.rank
    token, got = np.zeros(1, np.uint8), np.empty(1, np.uint8)
    k = 1
    while k < n:
        rq = c.irecv(got, (r - k) % n, TAG)
        sq = c.isend(token, (r + k) % n, TAG)
        c.wait([rq, sq])
        k <<= 1

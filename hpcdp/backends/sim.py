"""Simulated backend: ranks are threads of one process that meet at shared rendezvous slots.

Each collective is a slot keyed by the group's call counter: every rank deposits a reference to
its buffer, the last to arrive computes the result once (numpy releases the GIL on large arrays),
and each rank copies its share out. Nothing is mocked: the same validation, timeouts and peer
failure rules apply as on the real transports, so the same test bodies run here.
"""
from __future__ import annotations

import collections
import itertools
import threading
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .._config import setting
from ..errors import CollectiveMismatchError, PeerFailureError
from ..ops import ReduceOp
from ._runner import P2PBackend, Runner
from .base import ANY_SOURCE, ANY_TAG, Backend, Probed, Request, register_backend

__all__ = ["SimWorld", "SimBackend"]


class SimWorld:
    """State shared by the threads of one simulated job: a condition and the dead ranks."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"world size must be >= 1, got {size}")
        self.size = size
        self.cond = threading.Condition()
        self.dead: dict[int, str] = {}  # global rank -> why
        #: global rank -> what it said it is blocked in (``tell_waiting``): the ranks are
        #: threads of this process, so the note is shared, not sent
        self.notes: dict[int, tuple[float, str]] = {}
        self._ids = itertools.count()

    def mark_dead(self, rank: int, why: str) -> None:
        with self.cond:
            self.dead.setdefault(rank, why)
            self.cond.notify_all()

    def next_id(self) -> int:
        return next(self._ids)


class _Comm:
    """What the members of one group share."""

    def __init__(self, world: SimWorld, ranks: tuple[int, ...]) -> None:
        self.world = world
        self.ranks = ranks
        self.slots: dict[int, _Slot] = {}
        self.mail: dict[tuple[int, int, int], collections.deque[np.ndarray]] = (
            collections.defaultdict(collections.deque)
        )
        #: sends of at least this many bytes complete once received (None: at once), so a
        #: sender can bound what it has in flight (a ``dup`` for RPC); ``taken`` holds them
        self.sync_from: int | None = None
        self.taken: dict[int, "_SyncSend"] = {}
        #: receives posted and not yet matched, per (source, dest, tag), oldest first
        self.posted: dict[tuple[int, int, int], collections.deque[_RecvRequest]] = {}


class _Slot:
    __slots__ = ("contribs", "sigs", "arrived", "ready", "result", "departed", "abandoned_by")

    def __init__(self, n: int) -> None:
        self.contribs: list[Any] = [None] * n
        self.sigs: list[Any] = [None] * n
        self.arrived = 0
        self.ready = False
        self.result: Any = None
        self.departed = 0
        self.abandoned_by: int | None = None


def _wait_locked(cond: threading.Condition, ready: Callable[[], bool], timeout: float | None) -> bool:
    """Wait on the world's condition until ``ready()`` (called with it held) or the deadline.

    Wakes at least every second so a peer's death, which also notifies, is never missed.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    with cond:
        while not ready():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            cond.wait(1.0 if left is None else min(left, 1.0))
    return True


def _dead_peers(comm: _Comm) -> list[int]:
    return [r for r in comm.ranks if r in comm.world.dead]


class _FailedRequest(Request):
    """A request that could not start: ``test``/``wait`` raise its error."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def test(self) -> bool:
        raise self.error

    def wait(self, timeout: float | None) -> bool:
        raise self.error


class _SlotRequest(Request):
    def __init__(self, be: SimBackend, key: int, slot: _Slot, extract: Callable[[Any], None]):
        self.be, self.key, self.slot, self.extract = be, key, slot, extract
        self.done = False

    def _finish_locked(self) -> bool:
        slot = self.slot
        if slot.ready:
            if isinstance(slot.result, BaseException):
                raise slot.result
            return True
        # A peer that timed out here only fails ranks that arrive later (see _collective):
        # ranks already waiting time out on their own deadline, as they would under MPI.
        dead = _dead_peers(self.be.comm)
        missing = [self.be.ranks[i] for i, c in enumerate(slot.contribs) if c is None]
        failed = [r for r in dead if r in missing]
        if failed:
            raise PeerFailureError(
                f"rank(s) {failed} died before joining ({self.be.comm.world.dead[failed[0]]})",
                peers=failed,
            )
        return False

    def _complete(self) -> None:
        # Copy out after releasing the lock: copies of large arrays run in parallel threads.
        self.extract(self.slot.result)
        self.done = True
        comm = self.be.comm
        with comm.world.cond:
            self.slot.departed += 1
            if self.slot.departed == self.be.size:
                comm.slots.pop(self.key, None)
                # every rank has its share: a request kept by the caller must not keep every
                # rank's buffers and the combined result (a whole model, for a broadcast)
                self.slot.contribs = [None] * self.be.size
                self.slot.result = None

    def test(self) -> bool:
        if self.done:
            return True
        with self.be.comm.world.cond:
            ready = self._finish_locked()
        if ready:
            self._complete()
        return ready

    def wait(self, timeout: float | None) -> bool:
        if self.done:
            return True
        if not _wait_locked(self.be.comm.world.cond, self._finish_locked, timeout):
            return False
        self._complete()
        return True

    def pending(self) -> str:
        missing = [self.be.ranks[i] for i, c in enumerate(self.slot.contribs) if c is None]
        return f"rank(s) {missing} of the group have not joined" if missing else "combining"

    def abandon(self) -> None:
        with self.be.comm.world.cond:
            if not self.slot.ready:
                self.slot.abandoned_by = self.be.ranks[self.be.rank]
                self.be.comm.world.cond.notify_all()


class _RecvRequest(Request):
    """A posted receive. Receives on one (source, tag) match messages in the order they were
    posted, as MPI's do: ``_deliver_locked`` hands each message to the oldest waiting one, at
    the send, at the post, or at any test, whichever comes first."""

    def __init__(self, be: SimBackend, buf: np.ndarray, src: int, tag: int) -> None:
        self.be, self.buf, self.src, self.tag = be, buf, src, tag
        self.key = (src, be.rank, tag)
        self.done = False
        self.error: Exception | None = None

    def refuses(self, msg: np.ndarray) -> bool:
        """Whether ``msg`` is of another dtype than this receive's buffer (a user tag only: the
        collectives' algorithms move raw views): then this receive fails and the message waits
        for another one, as on MPI, where such a receive never matches it."""
        if msg.dtype == self.buf.dtype or self.tag >= _P2P.TAG_BASE:
            return False
        self.error = CollectiveMismatchError(
            f"recv on rank {self.be.ranks[self.be.rank]}: the message from rank "
            f"{self.be.ranks[self.src]} (tag {self.tag}) is {msg.dtype} {msg.shape}, the "
            f"receive buffer {self.buf.dtype} {self.buf.shape}: a send and its receive must "
            f"have the same dtype")
        self.done = True
        return True

    def deliver_locked(self, msg: np.ndarray) -> None:
        comm = self.be.comm
        sent = comm.taken.pop(id(msg), None) if comm.taken else None
        try:
            if msg.nbytes != self.buf.nbytes:  # (HPCDP_DEBUG names both calls)
                self.error = CollectiveMismatchError(
                    f"recv on rank {self.be.ranks[self.be.rank]}: message from rank "
                    f"{self.be.ranks[self.src]} (tag {self.tag}) has {msg.nbytes} bytes, "
                    f"buffer has {self.buf.nbytes}"
                )
            else:
                np.copyto(self.buf.reshape(-1).view(np.uint8), msg.reshape(-1).view(np.uint8))
        finally:
            # only once received (a synchronous send completes at receipt)
            if sent is not None:  # (its waiters wake within a second, see _wait_locked)
                sent.done = True
            self.done = True

    def _try_locked(self) -> bool:
        if not self.done:
            _deliver_locked(self.be.comm, self.key)
        if self.done:
            if self.error is not None:
                raise self.error
            return True
        glob = self.be.ranks[self.src]
        if glob in self.be.comm.world.dead:
            raise PeerFailureError(
                f"rank {glob} died before sending (tag {self.tag})", peers=[glob]
            )
        return False

    def test(self) -> bool:
        if self.error is not None:
            raise self.error
        if self.done:
            return True
        with self.be.comm.world.cond:
            return self._try_locked()

    def wait(self, timeout: float | None) -> bool:
        if self.error is not None:
            raise self.error
        return self.done or _wait_locked(self.be.comm.world.cond, self._try_locked, timeout)

    def pending(self) -> str:
        return f"no message from rank {self.be.ranks[self.src]} with tag {self.tag}"

    def abandon(self) -> bool:
        """Given up on after a timeout: unposted, so a later message goes to a later receive
        (True when it had completed after all)."""
        comm = self.be.comm
        with comm.world.cond:
            if self.done:
                return self.error is None
            queue = comm.posted.get(self.key)
            if queue is not None and self in queue:
                queue.remove(self)
                if not queue:
                    del comm.posted[self.key]
        return False


def _deliver_locked(comm: _Comm, key: tuple[int, int, int]) -> None:
    """Hand queued messages for ``key`` to its posted receives, oldest to oldest."""
    queue, box = comm.posted.get(key), comm.mail.get(key)
    while queue and box:
        if queue[0].refuses(box[0]):
            queue.popleft()
            continue
        queue.popleft().deliver_locked(box.popleft())
    if queue is not None and not queue:
        del comm.posted[key]
    if box is not None and not box:  # keys come and go (RPC's data tags are unique per message)
        del comm.mail[key]


class _SyncSend(Request):
    """A send that completes once its message is received (``_Comm.sync_from``)."""

    def __init__(self, be: "SimBackend", dst: int) -> None:
        self.be, self.dst = be, dst
        self.done = False

    def _ready_locked(self) -> bool:
        if self.done:
            return True
        glob = self.be.ranks[self.dst]
        if glob in self.be.comm.world.dead:
            raise PeerFailureError(f"rank {glob} died before receiving", peers=[glob])
        return False

    def test(self) -> bool:
        if self.done:
            return True
        with self.be.comm.world.cond:
            return self._ready_locked()

    def wait(self, timeout: float | None) -> bool:
        return self.done or _wait_locked(self.be.comm.world.cond, self._ready_locked, timeout)


class _Done(Request):
    def test(self) -> bool:
        return True

    def wait(self, timeout: float | None) -> bool:
        return True


def _sig(name: str, **call: Any) -> tuple[Any, ...]:
    """A call as the rendezvous compares it: name and arguments (dtype as numpy spells it)."""
    return (name, *((k, str(v) if k == "dtype" else v) for k, v in call.items()))


def _fmt(sig: tuple[Any, ...]) -> str:
    return f"{sig[0]}({', '.join(f'{k}={v}' for k, v in sig[1:])})"


def _reduce_all(op: ReduceOp, bufs: Sequence[np.ndarray]) -> np.ndarray:
    """Reduce rank buffers in rank order into a fresh array of the input dtype."""
    ufunc = op.ufunc
    out = np.array(bufs[0], copy=True)
    if out.dtype == np.float16:  # accumulate half in single, round once, like the MPI path
        acc = out.astype(np.float32)
        for b in bufs[1:]:
            ufunc(acc, b, out=acc)
        return acc.astype(np.float16)
    for b in bufs[1:]:
        ufunc(out, b, out=out)
    return out


class SimBackend(Backend):
    """One rank's view of a simulated group."""

    name = "sim"
    shares_process = True
    carries_meta = True  # a message is the sender's array, copied

    def __init__(self, comm: _Comm, rank: int) -> None:
        self.comm = comm
        self.rank = rank
        self.size = len(comm.ranks)
        self.ranks = comm.ranks
        self._calls = itertools.count()

    def peers_gone(self) -> dict[int, str]:
        dead = self.comm.world.dead
        with self.comm.world.cond:
            return {i: dead[g] for i, g in enumerate(self.ranks) if g in dead}

    def tell_waiting(self, peers: Sequence[int], note: str) -> None:
        # one store, atomic under the GIL
        self.comm.world.notes[self.ranks[self.rank]] = (time.monotonic(), note)

    def waiting_notes(self) -> dict[int, tuple[float, str]]:
        return dict(self.comm.world.notes)

    # -- the rendezvous every collective goes through --------------------------------------
    def _collective(
        self,
        contrib: Any,
        combine: Callable[[list[Any]], Any],
        extract: Callable[[Any], None],
        sig: tuple[Any, ...] = (),
    ) -> Request:
        """Deposit ``contrib``; the last rank to arrive checks that every rank's ``sig`` (from
        ``_sig``: name, op, root, count, dtype) agrees, as the real transports need, then
        combines once."""
        key = next(self._calls)
        comm = self.comm
        with comm.world.cond:
            slot = comm.slots.get(key)
            if slot is None:
                slot = comm.slots[key] = _Slot(self.size)
            if slot.abandoned_by is not None:  # fails at wait(), where the caller names the op
                return _FailedRequest(PeerFailureError(
                    f"rank {slot.abandoned_by} abandoned this collective after a timeout",
                    peers=[slot.abandoned_by],
                ))
            slot.contribs[self.rank] = (contrib,)
            slot.sigs[self.rank] = sig
            slot.arrived += 1
            last = slot.arrived == self.size
        if last:
            try:
                if any(g != slot.sigs[0] for g in slot.sigs):
                    calls = "; ".join(f"rank {self.ranks[i]} called {_fmt(g)}"
                                      for i, g in enumerate(slot.sigs))
                    raise CollectiveMismatchError(
                        f"ranks called different collectives on this group (#{key + 1}): {calls}")
                result = combine([c[0] for c in slot.contribs])
            except BaseException as exc:  # every rank sees the same failure
                result = exc
            with comm.world.cond:
                slot.result = result
                slot.ready = True
                comm.world.cond.notify_all()
        return _SlotRequest(self, key, slot, extract)

    # -- collectives ------------------------------------------------------------------------
    def allreduce(self, sendbuf, recvbuf, op):
        def extract(res):
            np.copyto(recvbuf, res)

        return self._collective(sendbuf, lambda bufs: _reduce_all(op, bufs), extract,
                                _sig("allreduce", op=op.value, shape=sendbuf.shape, dtype=sendbuf.dtype))

    def broadcast(self, buf, root):
        me = self.rank

        def combine(bufs):
            return bufs[root].copy()

        def extract(res):
            if me != root:
                np.copyto(buf, res)

        return self._collective(buf, combine, extract, _sig("broadcast", root=root, shape=buf.shape,
                                                                 dtype=buf.dtype))

    def reduce(self, sendbuf, recvbuf, op, root):
        me = self.rank

        def extract(res):
            if me == root:
                np.copyto(recvbuf, res)

        return self._collective(sendbuf, lambda bufs: _reduce_all(op, bufs), extract,
                                _sig("reduce", op=op.value, root=root, shape=sendbuf.shape,
                                     dtype=sendbuf.dtype))

    def all_gather(self, sendbuf, recvbuf):
        return self._collective(sendbuf, np.stack, lambda res: np.copyto(recvbuf, res),
                                _sig("all_gather", shape=sendbuf.shape, dtype=sendbuf.dtype))

    def gather(self, sendbuf, recvbuf, root):
        me = self.rank

        def extract(res):
            if me == root:
                np.copyto(recvbuf, res)

        return self._collective(sendbuf, np.stack, extract,
                                _sig("gather", root=root, shape=sendbuf.shape, dtype=sendbuf.dtype))

    def scatter(self, sendbuf, recvbuf, root):
        me, n = self.rank, self.size

        def combine(bufs):
            return bufs[root].reshape(n, *recvbuf.shape).copy()

        def extract(res):
            np.copyto(recvbuf, res[me])

        return self._collective(sendbuf, combine, extract,
                                _sig("scatter", root=root, shape=recvbuf.shape, dtype=recvbuf.dtype))

    def reduce_scatter(self, sendbuf, recvbuf, op):
        me = self.rank

        def extract(res):
            np.copyto(recvbuf, res.reshape(self.size, *recvbuf.shape)[me])

        return self._collective(sendbuf, lambda bufs: _reduce_all(op, bufs), extract,
                                _sig("reduce_scatter", op=op.value, shape=sendbuf.shape,
                                     dtype=sendbuf.dtype))

    def all_to_all(self, sendbuf, recvbuf):
        me, n = self.rank, self.size

        def combine(bufs):
            return np.stack([b.reshape(n, -1) for b in bufs])  # [src, dst, ...]

        def extract(res):
            np.copyto(recvbuf.reshape(n, -1), res[:, me])

        return self._collective(sendbuf, combine, extract,
                                _sig("all_to_all", shape=sendbuf.shape, dtype=sendbuf.dtype))

    def barrier(self):
        return self._collective(None, lambda bufs: None, lambda res: None, _sig("barrier"))

    # -- point to point: eager and buffered, like MPI's small-message protocol ---------------
    def send(self, buf, dst, tag):
        # copied here, on the sender's thread and outside the world's lock (numpy lets go of
        # the interpreter for it), so the receiver may take the copy as it is (``take``); a
        # copy made by the receive instead would hold that lock, and every sender, meanwhile
        # kept with its dtype and shape (``carries_meta``): ``recv(None)`` returns what was sent
        msg = np.array(buf, order="C", copy=True)
        comm = self.comm
        req: Request = _Done()
        sync = comm.sync_from is not None and msg.nbytes >= comm.sync_from
        with comm.world.cond:
            if sync:
                req = comm.taken[id(msg)] = _SyncSend(self, dst)
            key = (self.rank, dst, tag)
            comm.mail[key].append(msg)
            if key in comm.posted:  # a receive waits: it gets the message now
                _deliver_locked(comm, key)
            comm.world.cond.notify_all()
        return req

    def recv(self, buf, src, tag):
        req = _RecvRequest(self, buf, src, tag)
        # matched at posting when its message is here, as MPI's are: a later probe must not
        # report that message again (``hpcdp.rpc`` probes, then receives, chunk after chunk)
        comm = self.comm
        with comm.world.cond:
            comm.posted.setdefault(req.key, collections.deque()).append(req)
            _deliver_locked(comm, req.key)
        return req

    def take(self, src: int, tag: int) -> np.ndarray | None:
        """The oldest message from ``src`` with ``tag``, as the copy ``send`` made (the
        receiver's alone from here on), or None."""
        req = _RecvRequest(self, np.empty(0, np.uint8), src, tag)
        comm = self.comm
        with comm.world.cond:
            box = comm.mail.get(req.key)
            if not box:
                return None
            msg = box.popleft()
            if not box:
                del comm.mail[req.key]
            sent = comm.taken.pop(id(msg), None) if comm.taken else None
            if sent is not None:
                sent.done = True
        return msg.reshape(-1).view(np.uint8)

    def probe(self, src: int, tag: int) -> tuple[int, int, int] | None:
        """(source, tag, nbytes) of a queued message for this rank, else None."""
        found = self.probe_meta(src, tag)
        return None if found is None else found[:3]

    def probe_meta(self, src: int, tag: int) -> Probed | None:
        """``probe`` with the dtype and shape the queued message was sent with."""
        world, me = self.comm.world, self.rank
        with world.cond:
            for (s, d, t), box in self.comm.mail.items():
                if box and d == me and src in (ANY_SOURCE, s) and (
                        t == tag or tag == ANY_TAG and t < _P2P.TAG_BASE):
                    m = box[0]
                    return Probed(s, t, m.nbytes, m.dtype, m.shape)
            peers = [g for r, g in enumerate(self.ranks) if r != me and src in (ANY_SOURCE, r)]
            if peers and all(g in world.dead for g in peers):
                raise PeerFailureError(
                    f"probe(src={src}, tag={tag}) on rank {self.ranks[me]}: rank(s) {peers} "
                    f"died and nothing from them is queued", peers=peers)
        return None

    # -- groups -----------------------------------------------------------------------------
    def dup(self) -> "SimBackend":
        """Collective: these ranks again, with a mailbox namespace of their own."""
        box: list[_Comm] = []
        req = self._collective(None, lambda _: _Comm(self.comm.world, self.ranks), box.append,
                               _sig("dup"))
        if not req.wait(None):  # pragma: no cover - wait(None) never times out
            raise RuntimeError("unreachable")
        # large sends complete when received, as MPI's do: a sender can then bound what it
        # holds in flight (every byte sent here lives in this one process until received)
        box[0].sync_from = 64 << 10
        return type(self)(box[0], self.rank)

    def new_group(self, ranks):
        members = tuple(self.ranks[r] for r in ranks)

        def combine(_):
            return _Comm(self.comm.world, members)

        box: list[_Comm] = []
        req = self._collective(None, combine, box.append, _sig("new_group", ranks=tuple(ranks)))
        if not req.wait(None):  # pragma: no cover - wait(None) never times out
            raise RuntimeError("unreachable")
        if self.rank not in ranks:
            return None
        return type(self)(box[0], list(ranks).index(self.rank))

    def split(self, color: int | None, key: int,
              layout: Mapping[int, Sequence[int]]) -> "SimBackend | None":
        """Collective: one rendezvous makes the shared state of every color's group at once."""
        def combine(_):
            return {c: _Comm(self.comm.world, tuple(self.ranks[r] for r in members))
                    for c, members in layout.items()}

        box: list[dict[int, _Comm]] = []
        req = self._collective(None, combine, box.append, _sig("split", colors=len(layout)))
        if not req.wait(None):  # pragma: no cover - wait(None) never times out
            raise RuntimeError("unreachable")
        if color is None:
            return None
        return type(self)(box[0][color], list(layout[color]).index(self.rank))


class _P2P:
    """The ``_algorithms`` p2p interface over a backend's own ``send``/``recv`` (tags above the
    user range): the opt-in (``HPCDP_SIM_ALGORITHMS=p2p``) that tests the algorithms here."""

    TAG_BASE = 1 << 40

    def __init__(self, backend: Any) -> None:
        self.be = backend
        self.rank, self.size = backend.rank, backend.size
        self._aborted: str | None = None
        self._waiting: list[Any] = []

    def isend(self, buf: np.ndarray, dst: int, tag: int) -> Any:
        return self.be.send(np.ascontiguousarray(buf).reshape(-1), dst, self.TAG_BASE + tag)

    def irecv(self, buf: np.ndarray, src: int, tag: int) -> Any:
        return self.be.recv(buf.reshape(-1) if buf.ndim != 1 else buf, src, self.TAG_BASE + tag)

    def wait(self, reqs: Sequence[Any]) -> None:
        try:
            for rq in reqs:
                self._waiting = [rq]
                while not rq.wait(0.2):
                    if self._aborted:
                        raise PeerFailureError(f"rank {self.be.ranks[self.rank]}: "
                                               f"{self._aborted}", peers=[self.be.ranks[self.rank]])
        finally:
            self._waiting = []  # (a failed wait too: the request holds the call's buffer)

    def check_usable(self, what: str) -> None:
        if self._aborted:
            raise PeerFailureError(f"{what} on rank {self.be.ranks[self.rank]}: {self._aborted}")

    def begin(self, seq: int, call: tuple) -> None:
        """Calls are not compared on this test path (the default rendezvous compares them)."""

    def end(self, ok: bool) -> None:
        pass

    def pending(self) -> str:
        return "; ".join(r.pending() for r in self._waiting) or "between messages"

    def abort(self, why: str) -> None:
        self._aborted = why


class SimP2PBackend(P2PBackend, SimBackend):
    """The opt-in ``HPCDP_SIM_ALGORITHMS=p2p``: collectives from the shared ring/tree algorithms
    over this backend's own ``send``/``recv``, so they are tested without sockets."""

    def __init__(self, comm: _Comm, rank: int) -> None:
        SimBackend.__init__(self, comm, rank)
        self._p2p = _P2P(self)
        self._runner = Runner(self._p2p, f"sim-rank{self.ranks[rank]}")


def _backend(comm: _Comm, rank: int) -> SimBackend:
    cls = SimP2PBackend if setting("HPCDP_SIM_ALGORITHMS") == "p2p" else SimBackend
    return cls(comm, rank)


def _sim_factory(*, world: SimWorld | None = None, rank: int = 0,
                 world_size: int | None = None) -> SimBackend:
    if world_size not in (None, 1) and world is None:
        raise ValueError(
            f"init(backend='sim', world_size={world_size}): init runs one rank in this thread; "
            f"run several with hpcdp.spawn(fn, world_size={world_size}, backend='sim')")
    if world is None:
        world = SimWorld(1)
    return _backend(_Comm(world, tuple(range(world.size))), rank)


class ThreadWorld:
    """``size`` simulated ranks that are threads of this process, sharing one world comm:
    what ``hpcdp.launch`` runs a thread per rank on (``spawn(..., backend="sim")``)."""

    def __init__(self, size: int) -> None:
        self.world = SimWorld(size)
        self.size = size
        self._comm = _Comm(self.world, tuple(range(size)))

    def backend(self, rank: int) -> SimBackend:
        """Rank ``rank``'s backend (call once per rank, from any thread)."""
        return _backend(self._comm, rank)

    def mark_dead(self, rank: int, why: str) -> None:
        """Rank ``rank`` is gone (raised, returned, or stuck): its peers fail fast, naming ``why``."""
        self.world.mark_dead(rank, why)


register_backend("sim", _sim_factory, thread_world=ThreadWorld)

"""The Backend contract every transport implements, the backend registry, and request handles."""
from __future__ import annotations

import abc
import time
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np

from .._arrays import SUPPORTED_DTYPES
from ..errors import HpcdpError
from ..ops import ReduceOp

__all__ = [
    "Backend",
    "Request",
    "CompletedRequest",
    "register_backend",
    "available_backends",
    "backend_factory",
    "backend_entry",
    "BackendEntry",
    "spawnable_backends",
    "ANY_SOURCE",
    "ANY_TAG",
    "PROC_NULL",
    "FINALIZED",
    "Probed",
    "DTYPE_CODES",
    "meta_of",
]

#: ``probe``'s ``src`` and ``tag`` that match any source / any tag (``hpcdp.ANY_SOURCE``)
ANY_SOURCE = -1
ANY_TAG = -1
#: the null neighbour (``hpcdp.PROC_NULL``, MPI's value): what a cartesian ``shift`` returns
#: past a non-periodic edge; point-to-point with it completes at once and moves nothing
PROC_NULL = -2

#: What a peer's error says of a rank that called ``hpcdp.finalize`` ("rank 1 has shut down
#: (finalize)"), on transports that tell their peers (TCP); ``python -m hpcdp.trace analyze``
#: reads it to say that a rank without a flight record finished rather than crashed.
FINALIZED = "has shut down (finalize)"

#: a supported dtype's number on the wire (its place in ``SUPPORTED_DTYPES``): how transports
#: that carry an array's dtype with its bytes (``Backend.carries_meta``) spell it
DTYPE_CODES: dict[np.dtype, int] = {dt: i for i, dt in enumerate(SUPPORTED_DTYPES)}


class Probed(NamedTuple):
    """What ``Backend.probe_meta`` found: the message's source, tag and bytes, and the dtype and
    shape it was sent with (None where the transport does not carry them)."""

    source: int
    tag: int
    nbytes: int
    dtype: np.dtype | None = None
    shape: tuple[int, ...] | None = None


def meta_of(nbytes: int, code: int, shape: tuple[int, ...] | None) -> tuple[np.dtype | None,
                                                                          tuple[int, ...] | None]:
    """The (dtype, shape) a peer's message claims, checked against its real size: a code or a
    shape that does not account for exactly ``nbytes`` (a malformed or hostile frame) gives
    ``(None, None)``, so nothing is ever allocated or viewed past what arrived. ``shape`` None
    with a known dtype: a 1-D message of ``nbytes / itemsize`` elements."""
    if not 0 <= code < len(SUPPORTED_DTYPES):
        return None, None
    dt = SUPPORTED_DTYPES[code]
    if shape is None:
        if nbytes % dt.itemsize:
            return None, None
        return dt, (nbytes // dt.itemsize,)
    n = 1
    for d in shape:
        if d < 0:
            return None, None
        n *= d
    if n * dt.itemsize != nbytes:
        return None, None
    return dt, tuple(shape)


class Request(abc.ABC):
    """A pending transport operation; the collectives API wraps it in a user-facing ``Work``."""

    @abc.abstractmethod
    def test(self) -> bool:
        """Make progress without blocking; True once the operation is complete."""

    def wait(self, timeout: float | None) -> bool:
        """Block up to ``timeout`` seconds (None: forever); True if complete, False on timeout.

        Subclasses override this with something better than polling where they can.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        return poll_until(self.test, deadline)

    def pending(self) -> str:
        """What has not arrived yet, for timeout messages ("ranks [1, 3] have not joined")."""
        return "the operation did not complete"

    def abandon(self) -> bool | None:
        """Called after a timeout; lets peers that arrive later fail fast instead of hanging.

        A transport that can tell returns True when the operation completed after all (its last
        bytes came in as the deadline passed): the caller then reports success.
        """


class CompletedRequest(Request):
    def test(self) -> bool:
        return True

    def wait(self, timeout: float | None) -> bool:
        return True


#: Tests between clock reads in ``spin`` (a while loop on ``Test()`` is cheaper than for/range)
SPIN_TESTS = 16
#: how long a quick lane spins before the registered, deadline-checked wait takes over: a peer
#: that arrives a few microseconds later (the usual skew) costs no more than that skew, and a
#: call that outlasts it pays the bookkeeping once, which is small next to such a wait
SPIN_SECONDS = 1e-4


def spin(test: Callable[[], Any], alert: Any, seconds: float) -> bool:
    """Whether ``test()`` turned true within about ``seconds`` of back-to-back tests, stopping
    early once a notice landed (``alert[0]`` non-zero). The quick lanes' wait before a call
    becomes a registered request with the general, deadline-checked wait: a call that completes
    within it pays none of that bookkeeping. Bounded by the clock, not by a count: an
    oversubscribed MPI yields the CPU in every idle test, so a count could last seconds."""
    stop = 0.0
    while True:
        k = SPIN_TESTS
        while not test():
            k -= 1
            if not k:
                break
        else:
            return True
        now = time.monotonic()
        if not stop:
            stop = now + seconds
        elif now >= stop or alert[0]:
            return False


def poll_until(test: Callable[[], bool], deadline: float | None,
               idle: Callable[[], None] | None = None, every: int = 64) -> bool:
    """Spin on ``test`` briefly for latency, then yield the CPU between polls.

    MPI and sockets progress only while polled, so the loop never sleeps long; oversubscribed
    ranks (4 ranks on 2 cores) need the yields to let their peers run. ``idle`` runs, and the
    clock is read, after every ``every`` tests (``idle`` may raise, to stop waiting: a peer said
    it left); fewer where one test may yield the CPU (MPI under ``--oversubscribe``).
    """
    if test():
        return True
    now = time.monotonic
    start = now()
    while True:
        n = every  # (a while loop measured faster than for/range between MPI tests)
        while n:
            if test():
                return True
            n -= 1
        if idle is not None:
            idle()
        t = now()
        if deadline is not None and t >= deadline:
            return test()
        waited = t - start
        if waited > 0.5:
            time.sleep(2e-4)
        elif waited > 2e-3:
            time.sleep(0)


class Backend(abc.ABC):
    """A transport for one group of ranks. The collectives API is its only caller.

    Contract:

    1. Every collective method (``allreduce`` to ``barrier``, ``new_group``, ``split``) must be
       called by all ranks of the group, in the same order, with matching dtypes, shapes, ops
       and roots.
       The API layer validates each rank's arguments before calling; with ``HPCDP_DEBUG=detail``
       it also checks them across ranks first.
    2. Buffers handed in are C-contiguous arrays of one array module (numpy, or cupy where the
       backend says it takes cupy) with a supported dtype; ``sendbuf is recvbuf`` means in place.
       Shapes: ``all_gather``/``gather`` receive ``(size, *send.shape)``; ``scatter``,
       ``reduce_scatter`` and ``all_to_all`` split axis 0 of the send buffer into ``size`` parts.
    3. Every method returns at once with a ``Request``; nothing may block indefinitely. The caller
       waits with a deadline and raises ``CommTimeoutError`` itself. Buffers belong to the
       transport until the request completes.
    4. ``op`` is never MEAN: the API computes it as SUM and divides.
    5. ``send``/``recv`` are tag-matched and non-overtaking per (source, tag); they may be mixed
       freely with collectives on this and other groups, from several threads. Their buffers
       may have any shape (C-contiguous); ``buf.nbytes`` bytes move. A transport that
       ``carries_meta`` also delivers the sent array's dtype and shape to ``probe_meta`` (so
       ``recv(None)`` can return what was sent), and a receive into a buffer of another dtype
       than the message's fails with ``CollectiveMismatchError`` naming both, leaving the
       message for a later receive (MPI notices it while the receive waits). MPI carries them in
       the tag: there the order is kept per (source, tag, dtype, 0-d/1-d/n-d), see
       ``backends/mpi/_meta.py``.
    6. A peer that is known to be dead makes pending and later requests raise
       ``PeerFailureError`` naming it, instead of waiting for the timeout.
    7. ``probe(src, tag)`` never blocks: it reports a message that a ``recv`` from ``src``
       with ``tag`` would take now (``ANY_SOURCE``/``ANY_TAG`` match any), or None.

    Capabilities: what callers may ask a backend instead of its name. A new backend sets the
    class attributes that differ from these defaults.

    - ``max_tag``: the largest tag ``send``/``recv``/``probe`` accept.
    - ``carries_meta``: ``send`` carries the array's dtype and shape (``probe_meta`` reports
      them; a receive into a buffer of another dtype fails, see 5.).
    - ``timeout_poisons_group``: a collective that timed out cannot be cancelled and leaves
      the group out of step; the API then refuses further collectives on that group (MPI).
    - ``needs_progress_thread``: nonblocking operations advance only while the caller is
      inside the transport, so overlapping them with computation (DDP's buckets during
      backward) needs a thread that tests them (MPI); others progress on their own threads.
    - ``thread_level``: ``"single"``, ``"serialized"`` or ``"multiple"``: whether several
      threads may call into the transport at once (``"multiple"``), or one at a time.
    - ``accepts_cupy``: cupy arrays may be handed in directly (CUDA-aware MPI).
    - ``recv_size_checked``: a ``recv`` posted before its message arrives may be of the wrong
      size: the transport then fails that receive cleanly and consumes the message (TCP), where
      MPI would truncate it. RPC posts its data receives early only where this holds.
    - ``native_comm()``: the mpi4py communicator of this group, for libraries that need one
      (parallel HDF5, baselines); None on transports without one.
    - ``shares_process``: the ranks are threads of this one process (simulated ranks), so
      per-rank state (the default group, the RPC agent) is per thread, and in-process queues
      reach every peer.
    - ``peers_gone()``: group ranks known to have died or left, with why (this rank included
      where a rank can end while the process lives on); empty where the transport cannot tell.
    - ``broken_advice``: the way on once a group refuses collectives for good (error text).
    - ``tell_waiting(peers, note)``/``waiting_notes()``: a side channel on which a blocked
      rank says what it waits for, so its peers can name a deadlock (no-ops by default).

    ``hpcdp.rpc`` sends over a ``dup()`` of the group's backend, whatever its ``name``: its
    point-to-point with ``probe``, ``peers_gone()`` for failures, and ``shares_process`` to yield
    the interpreter between idle polls.
    """

    name: str = "?"
    #: this rank in the group, and the group size
    rank: int
    size: int
    #: global (world) rank of each group rank
    ranks: tuple[int, ...]
    #: capabilities (see the class docstring)
    max_tag: int = 2**31 - 1
    carries_meta: bool = False
    timeout_poisons_group: bool = False
    needs_progress_thread: bool = False
    thread_level: str = "multiple"
    accepts_cupy: bool = False
    shares_process: bool = False
    recv_size_checked: bool = False
    #: what works once a group of this backend refuses collectives for good (a collective on
    #: it timed out or mismatched): the end of that error, so it names a way on that works here
    broken_advice: str = ("this group cannot run collectives any more (new_group on it is one "
                          "too): make new groups from a group that still works (hpcdp.new_group "
                          "on the default group, if this is not it), or call hpcdp.finalize() "
                          "then hpcdp.init() on every rank to start a new world")
    #: ``quick_allreduce(send, recv, op, timeout) -> Request | None``: a blocking allreduce of
    #: small host arrays, None once complete, else the request still pending at the deadline
    #: (the caller reports the timeout). None: the caller posts ``allreduce`` and waits on it.
    #: A transport sets it where skipping the request bookkeeping that only asynchronous
    #: callers need pays (MPI's small-message path, ``backends/mpi/_fastpath.py``).
    quick_allreduce: Callable[..., Request | None] | None = None
    #: ``quick_all_gather(send, recv, timeout)`` and ``quick_broadcast(buf, root, timeout)``:
    #: blocking, of host arrays, returning as ``quick_allreduce`` does (latency-bound calls up
    #: to a few MiB, where the general path's bookkeeping shows). None: post and wait.
    quick_all_gather: Callable[..., Request | None] | None = None
    quick_broadcast: Callable[..., Request | None] | None = None
    #: the quick lane of point-to-point (``backends/mpi/_quick_p2p.Lane``): ``send``/``recv``
    #: ``(buf, peer, tag, timeout)`` and ``sendrecv(sbuf, dst, stag, rbuf, src, rtag,
    #: timeout)``, blocking, returning as ``quick_allreduce`` does; ``post(send, buf, peer,
    #: tag)``, nonblocking. None: the caller posts ``send``/``recv`` and waits on them.
    quick_p2p: Any = None

    def check_all_gather(self, sendbuf: np.ndarray, recvbuf: np.ndarray) -> Request:
        """The all_gather of the sampled call checks (``comm.debug``, ``HPCDP_DEBUG=sample``).
        Here the group's own ``all_gather``: a transport that tells a mismatched collective
        apart (simulated ranks, TCP) reports a check met by another call. MPI cannot (a
        mismatched collective is undefined behaviour there), so it runs checks on a
        communicator of their own."""
        return self.all_gather(sendbuf, recvbuf)

    def native_comm(self) -> Any:
        """The mpi4py communicator of this group, or None (not an MPI transport)."""
        return None

    def peers_gone(self) -> dict[int, str]:
        """Group ranks known to be dead or gone, with why; never blocks."""
        return {}

    def tell_waiting(self, peers: Sequence[int], note: str) -> None:
        """Tell group ranks ``peers`` what this rank is blocked in (``note``: a short text the
        collectives layer's watchdog writes and reads, ``comm._watchdog``), on a side channel
        that never mixes with messages; best effort, never blocks. Transports without one
        ignore it: their ranks then only say what they wait for, not what their peers do."""

    def waiting_notes(self) -> dict[int, tuple[float, str]]:
        """The newest ``tell_waiting`` note each world rank sent to this process, with when it
        arrived (``time.monotonic()``); never blocks."""
        return {}

    def probe(self, src: int, tag: int) -> tuple[int, int, int] | None:
        """``(source, tag, nbytes)`` of a message ``recv(src, tag)`` would take now, or None."""
        raise HpcdpError(f"probe (rank {self.rank}): the {self.name} backend cannot probe")

    def probe_meta(self, src: int, tag: int) -> Probed | None:
        """``probe`` with the dtype and shape the message was sent with, where the transport
        carries them (``carries_meta``); here, for one that does not, both None."""
        found = self.probe(src, tag)
        return None if found is None else Probed(*found)

    @abc.abstractmethod
    def allreduce(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: ReduceOp) -> Request: ...

    @abc.abstractmethod
    def broadcast(self, buf: np.ndarray, root: int) -> Request: ...

    @abc.abstractmethod
    def reduce(
        self, sendbuf: np.ndarray, recvbuf: np.ndarray | None, op: ReduceOp, root: int
    ) -> Request: ...

    @abc.abstractmethod
    def all_gather(self, sendbuf: np.ndarray, recvbuf: np.ndarray) -> Request: ...

    @abc.abstractmethod
    def gather(self, sendbuf: np.ndarray, recvbuf: np.ndarray | None, root: int) -> Request: ...

    @abc.abstractmethod
    def scatter(self, sendbuf: np.ndarray | None, recvbuf: np.ndarray, root: int) -> Request: ...

    @abc.abstractmethod
    def reduce_scatter(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: ReduceOp) -> Request: ...

    @abc.abstractmethod
    def all_to_all(self, sendbuf: np.ndarray, recvbuf: np.ndarray) -> Request: ...

    @abc.abstractmethod
    def barrier(self) -> Request: ...

    @abc.abstractmethod
    def send(self, buf: np.ndarray, dst: int, tag: int) -> Request: ...

    @abc.abstractmethod
    def recv(self, buf: np.ndarray, src: int, tag: int) -> Request: ...

    @abc.abstractmethod
    def new_group(self, ranks: Sequence[int]) -> "Backend | None":
        """Collective over this group: a backend for ``ranks`` (group ranks), None on non-members."""

    def split(self, color: int | None, key: int,
              layout: Mapping[int, Sequence[int]]) -> "Backend | None":
        """Collective over this group: disjoint sub-groups at once, as MPI's ``Comm.Split``.

        The caller has already exchanged every rank's ``(color, key)`` and checked them, so
        ``layout`` (the same on every rank) maps each color to the group ranks of its sub-group,
        in new-rank order (by key, then rank); ``color`` is this rank's, None for no sub-group
        (then the result is None). ``key`` is this rank's key, for transports that order the
        members themselves (MPI). This default makes one ``new_group`` per color in color order,
        so any transport with ``new_group`` can split; the built-in ones override it with one
        collective step (MPI: one ``Comm.Split``) or none (TCP: channel ids agreed from
        ``layout``).
        """
        mine = None
        for c in sorted(layout):
            sub = self.new_group(layout[c])
            if c == color:
                mine = sub
        return mine

    def dup(self) -> "Backend":
        """Collective over this group: the same ranks on a communication context of their own.

        Every rank calls it, in the same order as its other collectives. The duplicate has this
        group's ``rank``, ``size`` and ``ranks``; no message sent on it ever matches a receive
        on this backend or on another duplicate, and none of theirs matches one of its own
        (MPI: ``Comm.Dup()``; TCP: a channel id carried in every frame; simulated ranks: a
        mailbox namespace of their own). Its point-to-point (``send``, ``recv``, ``probe`` with
        ``ANY_SOURCE``/``ANY_TAG``) may be used from another thread while this backend is in use
        (``hpcdp.rpc``'s threads beside the user's calls). Authentication, frame caps and
        timeouts are this backend's: TCP reuses its authenticated connections and accepts no new
        one. ``shutdown()`` of the duplicate releases only what it owns; shutting this backend
        down ends its duplicates too.
        """
        raise HpcdpError(f"dup (rank {self.rank}): the {self.name} backend cannot duplicate "
                         "its communication context")

    def take(self, src: int, tag: int) -> Any:
        """The oldest message from ``src`` with ``tag`` that arrived before any receive was
        posted for it, received now as the transport's own buffer (a writable uint8 array of
        the message's size, no copy, memory nobody else uses) where it holds the whole message
        already (a simulated rank's eager copy, the buffer TCP's reader filled); None where it
        cannot or nothing is there: ``recv`` it into a buffer instead. The caller checks the
        size it gets; a message dropped under ``cap_unposted`` is never handed over."""
        return None

    def cap_unposted(self, nbytes: int, tag: int | None = None) -> None:
        """Let the transport drop point-to-point messages of more than ``nbytes`` that arrive
        before a receive is posted for them, rather than store them (``probe`` never reports
        a dropped one). ``tag``: the cap of messages with that tag, winning over the one set
        without a tag (every other tag). For a duplicate whose user checks sizes before
        receiving (RPC's limits: small heads on one tag, large data on others): a peer's
        oversized message then costs this rank no more memory than its cap. Transports that
        leave unreceived messages with their sender (MPI) or in shared memory ignore it."""

    def bound_sends(self, seconds: float) -> None:
        """Let a ``send`` that has to wait for its peer to read (a transport that writes on the
        caller's thread, TCP) wait at most ``seconds`` while the peer takes no byte; then the
        peer is treated as failed (the send, and later ones, raise ``PeerFailureError`` naming
        it). For a duplicate whose callers must never block for good on a stopped peer (RPC).
        Transports whose ``send`` returns at once (MPI, simulated ranks) ignore it."""

    def shutdown(self) -> None:
        """Release transport resources; called once by ``finalize``."""

    def describe(self) -> str:
        return f"{self.name}(rank {self.rank} of {self.size})"


class BackendEntry:
    """What the registry knows of one backend; ``hpcdp.launch`` reads how its ranks start."""

    __slots__ = ("factory", "available", "spawn", "thread_world", "processes")

    def __init__(self, factory: Callable[..., Backend], available: Callable[[], bool] | None,
                 spawn: Callable[..., list[Any]] | None,
                 thread_world: Callable[[int], Any] | None, processes: bool) -> None:
        self.factory, self.available, self.spawn = factory, available, spawn
        self.thread_world, self.processes = thread_world, processes


_REGISTRY: dict[str, BackendEntry] = {}


def register_backend(name: str, factory: Callable[..., Backend], *,
                     available: Callable[[], bool] | None = None,
                     spawn: Callable[..., list[Any]] | None = None,
                     thread_world: Callable[[int], Any] | None = None,
                     processes: bool = False) -> None:
    """Make ``hpcdp.init(backend=name)`` call ``factory(timeout=..., **options)``.

    How ``hpcdp.spawn`` starts fresh ranks of the backend (``hpcdp.launch`` does the starting:
    a backend declares what it supports and never imports the launcher):

    Args:
        available: whether the backend can start here (its libraries import); default: always.
        spawn: ``spawn(fn, world_size, *, args, kwargs, timeout, join_timeout)`` runs ``fn`` on
            fresh ranks of this backend and returns their results (a backend that starts its
            ranks its own way; it takes precedence over the two below).
        thread_world: the backend ``shares_process``: ``thread_world(n)`` makes ``n`` ranks that
            are threads of this process, an object with ``backend(rank)`` and
            ``mark_dead(rank, why)``; the launcher runs one thread per rank.
        processes: ranks may be local processes that each call ``factory`` and meet through the
            launcher's environment (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``,
            ``HPCDP_SECRET``); the launcher starts them. None of the three: ranks come from
            elsewhere (``mpirun``).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_backend: name must be a non-empty string, got {name!r}")
    if not callable(factory):
        raise TypeError(f"register_backend({name!r}): factory must be callable")
    _REGISTRY[name] = BackendEntry(factory, available, spawn, thread_world, bool(processes))


def backend_entry(name: str) -> BackendEntry | None:
    """The registry's entry for ``name`` (None: not registered)."""
    return _REGISTRY.get(name)


def backend_factory(name: str) -> Callable[..., Backend] | None:
    e = _REGISTRY.get(name)
    return e.factory if e is not None else None


def _is_available(e: BackendEntry) -> bool:
    return e.available is None or bool(e.available())


def available_backends() -> list[str]:
    """Names of the registered backends whose libraries import here."""
    return [n for n, e in _REGISTRY.items() if _is_available(e)]


def spawnable_backends() -> list[str]:
    """Available backends whose ranks ``hpcdp.spawn`` can start (also the test matrices)."""
    return [n for n, e in _REGISTRY.items()
            if (e.spawn is not None or e.thread_world is not None or e.processes)
            and _is_available(e)]


def payload(x: Any) -> str:
    """Short description of a buffer for error messages."""
    return f"{type(x).__module__.split('.')[0]}.ndarray{tuple(x.shape)} {x.dtype}"

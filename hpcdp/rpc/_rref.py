"""Remote references: ``RRef`` and the reference counting behind it.

An RRef names a value held by its *owner* worker. The owner frees the value once no worker holds
a reference, following the protocol of PyTorch's RRef design (``rref.html``, "RRef Protocol"):

* Ids: an RRef is ``(creator rank, 16 random bytes)``; every user-side copy of it is a *fork*
  ``(rank that made it, 16 random bytes)``: 128 random bits, never guessed. The owner keeps the
  forks it knows with the worker holding each, plus a count of its own local handles; it serves
  (FETCH, RCALL, a REMOTE on it, FORK) only workers holding a fork it recorded, and only a
  fork's holder may delete it.
* Fork ids are capabilities shared by a fork's holder, its maker and the owner only, so a fork
  id is the key that proves a worker handed a fork on: a user A passing its RRef to B sends B
  ``token = HMAC(A's fork id, rid, B's fork id, B)``; B's FORK carries it and the owner, which
  knows A's fork, checks it before recording B's. A peer that was never sent the RRef (even one
  that learnt its id) cannot make a token, so its FORK is refused, and so are its uses.
* ``remote(owner, fn)`` from worker A: A makes the RRef id and its own fork id; the owner, on
  the REMOTE message, records that fork, acknowledges at once (A's fork is then *confirmed*)
  and computes the value on its pool.
* The owner passes its RRef to B: it adds B's new fork to its set *before* sending, so B's
  fork is confirmed on arrival.
* A user A passes its RRef to B (not the owner): A first waits until the owner has confirmed
  A's own fork (so the owner can check B's token), makes B's fork id and keeps a strong
  reference to its own RRef as a *pending child* until B confirms; B sends FORK to the owner,
  the owner records it and answers; B's fork is then confirmed and B sends ACCEPT to A, which
  drops the pending child. So A's own delete can never reach the owner before B's fork is
  known there, and the owner never sees a count of zero while a reference is in flight.
* A user RRef that Python frees sends DELETE to the owner once confirmed (waiting for the
  confirmation if it is not yet). A handle to an RRef arriving at its owner becomes a local
  handle (accepting the parent's pending child where there is one).
* A peer that fails takes its forks and the pending children sent to it with it.

Messages to the owner about one RRef leave each worker in order (B's FORK is on the wire before
B's first call on that RRef), and every transport keeps per-pair order, so the owner sees a fork
before any use of it; since a user forwards an RRef only once its own fork is confirmed, the
owner knows every RRef a legitimate message names: one it does not know is refused.

Deletions are triggered from ``__del__``, which may run on any thread at any time: it only puts
an item on the agent's control queue.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
import threading
from typing import Any, Callable

from ..comm.validation import check_timeout
from ..errors import CommTimeoutError, HpcdpError, ProtocolError
from ._duty import before_blocking

__all__ = ["RRef", "RRefManager", "OwnerRecord"]

Id = tuple[int, bytes]
#: random bytes of an RRef or fork id
ID_BYTES = 16
_RANKS = struct.Struct("<qqq")


def show(i: Id) -> str:
    """A short printable form of an id (its creator and the first random bytes)."""
    return f"({i[0]}, {i[1][:4].hex()}..)"


def fork_token(parent_fid: Id, rid: Id, fid: Id, holder: int) -> bytes:
    """What the maker of fork ``fid`` (for ``holder``) gives it to prove the owner the hand-over:
    keyed with the maker's own fork id, which only the maker and the owner know."""
    msg = _RANKS.pack(rid[0], fid[0], holder) + rid[1] + fid[1]
    return hmac.new(parent_fid[1], msg, hashlib.sha256).digest()[:16]


class RRef:
    """A reference to a value owned by a (possibly remote) worker.

    Create with ``rpc.remote``; pass it in RPC arguments or results to share it.
    """

    _hpcdp_rref = True  # the codec recognises RRefs by this flag (no import cycle)
    __slots__ = ("_agent", "_rid", "_fid", "_owner", "_state", "__weakref__")

    def __init__(self, agent: Any, rid: Id, fid: Id | None, owner: int, state: Any = None) -> None:
        self._agent, self._rid, self._fid, self._owner, self._state = agent, rid, fid, owner, state

    def owner(self) -> Any:
        """The owner's ``WorkerInfo``."""
        return self._agent.worker_info(self._owner)

    def owner_name(self) -> str:
        return self._agent.names[self._owner]

    def is_owner(self) -> bool:
        """Whether this worker holds the value."""
        return self._fid is None

    def confirmed_by_owner(self) -> bool:
        """Whether the owner knows of this reference (always true on the owner)."""
        return self._fid is None or bool(self._state.confirmed)

    def local_value(self) -> Any:
        """The value itself, on the owner only (waits for it to be computed)."""
        if self._fid is not None:
            raise HpcdpError(f"RRef.local_value on rank {self._agent.rank}: this worker is not "
                             f"the owner ({self.owner_name()} is); use to_here()")
        return self._agent.rrefs.local_value(self._rid, None, "local_value")

    def to_here(self, timeout: float | None = None) -> Any:
        """The value, copied to this worker (on the owner: the value itself)."""
        return self._agent.calls.fetch(self, timeout)

    def rpc_sync(self, timeout: float | None = None) -> "_Proxy":
        """``rref.rpc_sync().method(*args)``: call a method of the value on its owner, wait."""
        return _Proxy(self, "rpc_sync", timeout)

    def rpc_async(self, timeout: float | None = None) -> "_Proxy":
        """``rref.rpc_async().method(*args)``: a ``Future`` of the method's result."""
        return _Proxy(self, "rpc_async", timeout)

    def remote(self, timeout: float | None = None) -> "_Proxy":
        """``rref.remote().method(*args)``: an RRef, on the same owner, to the method's result."""
        return _Proxy(self, "remote", timeout)

    def __del__(self) -> None:
        try:
            self._agent.rrefs.released(self._rid, self._fid)
        except Exception:  # noqa: BLE001 - interpreter teardown; nothing to tell
            pass

    def __reduce__(self) -> Any:
        raise TypeError("an RRef cannot be pickled or copied; pass it as an RPC argument")

    def __copy__(self) -> "RRef":
        raise TypeError("an RRef cannot be copied; pass the same object around")

    __deepcopy__ = lambda self, memo: self.__copy__()  # noqa: E731

    def __repr__(self) -> str:
        kind = "OwnerRRef" if self._fid is None else "UserRRef"
        fid = None if self._fid is None else show(self._fid)
        return f"{kind}(rref_id={show(self._rid)}, fork_id={fid}, owner={self.owner_name()!r})"


class _Proxy:
    __slots__ = ("_rref", "_mode", "_timeout")

    def __init__(self, rref: RRef, mode: str, timeout: float | None) -> None:
        if timeout is not None:  # refused here, not on the first method call
            timeout = check_timeout(f"RRef.{mode}(): timeout={timeout!r}", timeout, named=True)
        self._rref, self._mode, self._timeout = rref, mode, timeout

    def __getattr__(self, method: str) -> Callable[..., Any]:
        if method.startswith("_"):
            raise AttributeError(f"RRef.{self._mode}(): only public methods can be called "
                                 f"remotely, not {method!r}")
        rref, mode, timeout = self._rref, self._mode, self._timeout

        def call(*args: Any, **kwargs: Any) -> Any:
            return rref._agent.calls.method_call(rref, method, args, kwargs, mode, timeout)

        call.__name__ = method
        return call


class OwnerRecord:
    """The owner's state of one RRef: the value (once computed), the forks, local handles."""

    __slots__ = ("rid", "state", "value", "error", "waiters", "forks", "handles")

    def __init__(self, rid: Id, state: str) -> None:
        self.rid, self.state = rid, state  # pending | ready | failed
        self.value: Any = None
        self.error: tuple[str, str, str] | None = None
        self.waiters: list[Callable[["OwnerRecord"], None]] = []
        self.forks: dict[Id, int] = {}  # fork -> the worker holding it
        self.handles = 0


class UserState:
    __slots__ = ("rid", "owner", "confirmed", "deleted", "failed", "fork_sent", "parent",
                 "settled", "token")

    def __init__(self, rid: Id, owner: int, confirmed: bool, parent: int,
                 token: bytes = b"") -> None:
        self.rid, self.owner, self.confirmed, self.parent = rid, owner, confirmed, parent
        self.token = token  # the parent's proof of the hand-over, for the FORK
        self.deleted = False
        self.failed: str | None = None
        self.fork_sent = threading.Event()
        self.settled = threading.Event()  # confirmed by the owner, or failed
        if confirmed or parent == owner:
            self.fork_sent.set()
        if confirmed:
            self.settled.set()

    def settle(self) -> None:
        self.settled.set()


def _id(x: Any) -> Id:
    if type(x) is not list or len(x) != 2 or type(x[0]) is not int or type(x[1]) is not bytes \
            or len(x[1]) != ID_BYTES:
        raise ProtocolError(f"malformed RRef or fork id {str(x)[:60]}")
    return (x[0], x[1])


def _wire_id(i: Id) -> list:
    return [i[0], i[1]]


class RRefManager:
    """Owner records, this worker's forks and its pending children (under one lock)."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self.rank = agent.rank
        self.lock = threading.Lock()
        self.owners: dict[Id, OwnerRecord] = {}
        self.users: dict[Id, UserState] = {}
        self.children: dict[Id, tuple[RRef, int]] = {}

    def next_id(self) -> Id:
        """A fresh RRef or fork id: 128 random bits, so a peer cannot guess one it was not sent."""
        return (self.rank, secrets.token_bytes(ID_BYTES))

    # -- creating ---------------------------------------------------------------------------
    def owner_handle(self, rec: OwnerRecord) -> RRef:
        with self.lock:
            rec.handles += 1
        return RRef(self.agent, rec.rid, None, self.rank)

    def new_local(self) -> OwnerRecord:
        rid = self.next_id()
        rec = OwnerRecord(rid, "pending")
        with self.lock:
            self.owners[rid] = rec
        return rec

    def new_user(self, rid: Id, fid: Id, owner: int) -> RRef:
        st = UserState(rid, owner, False, self.rank)
        st.fork_sent.set()  # the REMOTE itself announces it
        with self.lock:
            self.users[fid] = st
        return RRef(self.agent, rid, fid, owner, st)

    def _record(self, rid: Id, src: int) -> OwnerRecord:
        """The owner record of ``rid`` (lock held). Every RRef a legitimate message names is
        known here by then (see the module docstring), so an unknown one is refused."""
        rec = self.owners.get(rid)
        if rec is None:
            raise ProtocolError(f"rank {self.rank} owns no RRef {show(rid)} (named by rank {src})")
        return rec

    def _check_holder(self, rec: OwnerRecord, src: int, op: str) -> None:
        """``src`` may use ``rec`` only if the owner recorded a fork for it (lock held)."""
        if src != self.rank and src not in rec.forks.values():
            raise ProtocolError(f"{op} from rank {src}: rank {src} holds no reference to RRef "
                                f"{show(rec.rid)} (the owner, rank {self.rank}, never handed it "
                                "one)")

    def remote_created(self, src: int, rid_w: Any, fid_w: Any) -> OwnerRecord:
        """A REMOTE from ``src``: record the RRef and ``src``'s fork."""
        rid, fid = _id(rid_w), _id(fid_w)
        if rid[0] != src or fid[0] != src:
            raise ProtocolError(f"REMOTE from rank {src} with foreign ids {show(rid)}/{show(fid)}")
        with self.lock:
            if rid in self.owners:
                raise ProtocolError(f"REMOTE from rank {src}: RRef {show(rid)} exists already")
            rec = self.owners[rid] = OwnerRecord(rid, "pending")
            rec.forks[fid] = src
        return rec

    def set_value(self, rec: OwnerRecord, value: Any, error: tuple[str, str, str] | None) -> None:
        with self.lock:
            rec.value, rec.error = value, error
            rec.state = "failed" if error else "ready"
            waiters, rec.waiters = rec.waiters, []
            self._maybe_free(rec)
        for w in waiters:
            w(rec)

    def when_ready(self, src: int, rid_w: Any, fn: Callable[[OwnerRecord], None]
                   ) -> OwnerRecord | None:
        """The record of ``rid`` if its value is computed, else None and ``fn(record)`` runs
        once it is; checks that ``src`` may use it."""
        rid = _id(rid_w)
        with self.lock:
            rec = self._record(rid, src)
            self._check_holder(rec, src, "a use of an RRef")
            if rec.state == "pending":
                rec.waiters.append(fn)
                return None
        return rec

    def check_use(self, src: int, rid_w: Any) -> None:
        """``ProtocolError`` unless ``src`` may use the RRef ``rid_w`` (a REMOTE's target is
        checked before anything is recorded for the new RRef)."""
        rid = _id(rid_w)
        with self.lock:
            self._check_holder(self._record(rid, src), src, "a REMOTE on an RRef")

    @staticmethod
    def check_id(x: Any) -> None:
        """``ProtocolError`` unless ``x`` is a well-formed RRef or fork id."""
        _id(x)

    def local_value(self, rid: Id, timeout: float | None, op: str) -> Any:
        with self.lock:
            rec = self.owners.get(rid)
        if rec is None:
            raise HpcdpError(f"RRef.{op} on rank {self.rank}: RRef {show(rid)} was freed")
        done = threading.Event()
        if rec.state == "pending":
            with self.lock:
                pending = rec.state == "pending"
                if pending:
                    rec.waiters.append(lambda r: done.set())
            if pending:
                before_blocking()
            if pending and not done.wait(self.agent.timeout_of(timeout)):
                raise CommTimeoutError(f"RRef.{op} on rank {self.rank}: the value of RRef {show(rid)} "
                                       f"was not computed within {self.agent.timeout_of(timeout):g} s")
        if rec.error is not None:
            raise self.agent.error_from(rec.error, f"RRef.{op} on rank {self.rank}")
        return rec.value

    # -- the wire form ----------------------------------------------------------------------
    def encode_hook(self, dst: int) -> Callable[[RRef], tuple[list, Any]]:
        """For the codec: an RRef sent to ``dst`` travels as a new fork for ``dst``."""

        def hook(rref: RRef) -> tuple[list, Any]:
            if rref._agent is not self.agent:
                raise TypeError("an RRef belongs to the RPC agent that created it")
            st = rref._state
            if st is not None and dst != rref._owner and not st.confirmed:
                self._await_confirmation(rref, st)
            if st is not None and st.failed:
                raise ValueError(f"cannot send RRef {show(rref._rid)}: {st.failed}")
            fid = self.next_id()
            if rref._fid is None:
                info, token = ("owner_fork", rref, fid, dst), b""
            else:
                info = ("child", rref, fid, dst)
                token = fork_token(rref._fid, rref._rid, fid, dst)
            return [rref._owner, *rref._rid, *fid, self.rank, token], info

        return hook

    def _await_confirmation(self, rref: RRef, st: UserState) -> None:
        """A user RRef is forwarded to a third worker only once its owner confirmed our fork:
        the owner checks the new fork's token against ours, so it must know ours first."""
        if not st.settled.is_set():
            before_blocking()
        t = self.agent.default_timeout
        if not st.settled.wait(t):
            raise ValueError(f"cannot send RRef {show(rref._rid)}: its owner "
                             f"({self.agent.names[st.owner]}) did not confirm this worker's "
                             f"reference within {t:g} s")

    def commit(self, infos: list[Any]) -> None:
        """The message with these RRefs is about to go: record forks / pending children."""
        with self.lock:
            for kind, rref, fid, dst in infos:
                if kind == "owner_fork":
                    rec = self.owners.get(rref._rid)
                    if rec is not None:
                        rec.forks[fid] = dst
                else:
                    self.children[fid] = (rref, dst)

    def rollback(self, infos: list[Any]) -> None:
        """The message did not go: undo ``commit``."""
        drop = []
        with self.lock:
            for kind, rref, fid, _dst in infos:
                if kind == "owner_fork":
                    rec = self.owners.get(rref._rid)
                    if rec is not None:
                        rec.forks.pop(fid, None)
                        self._maybe_free(rec)
                else:
                    drop.append(self.children.pop(fid, None))
        del drop  # strong references released outside the lock

    def decode_hook(self, src: int) -> Callable[[list], RRef]:
        def hook(w: list) -> RRef:
            if len(w) != 7 or type(w[5]) is not int or type(w[6]) is not bytes or \
                    len(w[6]) > 64:
                raise ProtocolError("malformed RRef")
            owner, parent = w[0], w[5]
            rid, fid = _id(w[1:3]), _id(w[3:5])
            if type(owner) is not int or parent != src or fid[0] != src or \
                    not 0 <= owner < self.agent.size:
                raise ProtocolError(f"RRef from rank {src} names parent {parent}, fork {show(fid)}")
            return self._arrived(src, owner, rid, fid, w[6])

        return hook

    def _arrived(self, src: int, owner: int, rid: Id, fid: Id, token: bytes) -> RRef:
        agent = self.agent
        if owner == self.rank:
            with self.lock:
                rec = self._record(rid, src)
                rec.handles += 1
                owner_fork = rec.forks.pop(fid, None) is not None
            if not owner_fork:  # a user's fork came home: the parent may drop its pending child
                agent.control(lambda: agent.internal(src, "ACCEPT", [list(fid)]))
            return RRef(agent, rid, None, self.rank)
        with self.lock:
            if fid in self.users:
                raise ProtocolError(f"fork {show(fid)} arrived twice")
            st = self.users[fid] = UserState(rid, owner, src == owner, src, token)
        if src != owner:
            def fork() -> None:
                fut = agent.internal(owner, "FORK", [_wire_id(rid), _wire_id(fid), src, token])
                st.fork_sent.set()
                fut._on_done(lambda f: self._fork_confirmed(fid, st, f))

            agent.control(fork)
        return RRef(agent, rid, fid, owner, st)

    def _fork_confirmed(self, fid: Id, st: UserState, fut: Any) -> None:
        err = fut.exception()
        agent = self.agent
        with self.lock:
            if err is None:
                st.confirmed = True
            else:
                st.failed = f"the owner did not record it ({err})"
            delete = st.deleted
        st.settle()
        if st.parent not in agent.lost:  # accepted or not, the parent may let go of its child
            agent.control(lambda: agent.internal(st.parent, "ACCEPT", [list(fid)]))
        if delete:
            agent.control(lambda: self._send_delete(fid, st))

    def remote_acked(self, fid: Id, st: UserState, fut: Any) -> None:
        err = fut.exception()
        with self.lock:
            if err is None:
                st.confirmed = True
            else:
                st.failed = f"remote() failed: {err}"
            delete = st.deleted
        st.settle()
        if delete:
            self.agent.control(lambda: self._send_delete(fid, st))

    # -- handling protocol messages (on transport threads: state only, replies are queued) --
    def on_fork(self, src: int, rid_w: Any, fid_w: Any, parent: Any, token: Any) -> None:
        """Record ``src``'s fork, made by ``parent``, if ``token`` proves that ``parent`` (a
        holder the owner knows) handed it over."""
        rid, fid = _id(rid_w), _id(fid_w)
        if type(parent) is not int or fid[0] != parent or parent == self.rank:
            raise ProtocolError(f"FORK from rank {src} for fork {show(fid)} made by {parent}")
        if type(token) is not bytes:
            raise ProtocolError(f"FORK from rank {src}: malformed token")
        with self.lock:
            rec = self._record(rid, src)
            if fid in rec.forks:
                raise ProtocolError(f"fork {show(fid)} of RRef {show(rid)} is known already")
            if not any(holder == parent and
                       hmac.compare_digest(fork_token(pf, rid, fid, src), token)
                       for pf, holder in rec.forks.items()):
                raise ProtocolError(
                    f"FORK from rank {src} of RRef {show(rid)}: rank {parent} holds no fork "
                    f"that handed it one (a forged or stale hand-over); refused")
            rec.forks[fid] = src

    def on_accept(self, src: int, fid_w: Any) -> None:
        fid = _id(fid_w)
        with self.lock:
            entry = self.children.get(fid)
            if entry is None or entry[1] != src:
                raise ProtocolError(f"ACCEPT from rank {src} for unknown child fork {show(fid)}")
            del self.children[fid]
        del entry  # may free the parent RRef, which queues its own delete

    def on_delete(self, src: int, rid_w: Any, fid_w: Any) -> None:
        rid, fid = _id(rid_w), _id(fid_w)
        with self.lock:
            rec = self.owners.get(rid)
            if rec is None or rec.forks.get(fid) != src:
                raise ProtocolError(f"DELETE from rank {src} of fork {show(fid)} of RRef "
                                    f"{show(rid)}, which it does not hold")
            del rec.forks[fid]
            self._maybe_free(rec)

    # -- releasing --------------------------------------------------------------------------
    def released(self, rid: Id, fid: Id | None) -> None:
        """From ``RRef.__del__`` (any thread, any time): only queue the work."""
        self.agent.control(lambda: self._release(rid, fid), quiet=True)

    def _release(self, rid: Id, fid: Id | None) -> None:
        if fid is None:
            with self.lock:
                rec = self.owners.get(rid)
                if rec is not None:
                    rec.handles -= 1
                    self._maybe_free(rec)
            return
        with self.lock:
            st = self.users.get(fid)
            if st is None:
                return
            if not st.confirmed and not st.failed:
                st.deleted = True  # sent once the owner confirms
                return
        self._send_delete(fid, st)

    def _send_delete(self, fid: Id, st: UserState) -> None:
        with self.lock:
            if self.users.pop(fid, None) is None:
                return
        if not st.failed and st.owner not in self.agent.lost:
            self.agent.internal(st.owner, "DELETE", [_wire_id(st.rid), _wire_id(fid)])

    def _maybe_free(self, rec: OwnerRecord) -> None:
        if rec.state in ("ready", "failed") and not rec.forks and rec.handles <= 0:
            self.owners.pop(rec.rid, None)
            rec.value = None  # the owner frees the value here

    # -- failures and housekeeping ---------------------------------------------------------
    def peer_lost(self, peer: int, why: str) -> None:
        drop = []
        with self.lock:
            for rec in list(self.owners.values()):
                gone = [f for f, holder in rec.forks.items() if holder == peer]
                for f in gone:
                    del rec.forks[f]
                if gone:
                    self._maybe_free(rec)
            for fid, (rref, dst) in list(self.children.items()):
                if dst == peer:
                    drop.append(self.children.pop(fid))
            settled = []
            for st in self.users.values():
                if st.owner == peer and not st.failed:
                    st.failed = f"its owner (rank {peer}) failed: {why}"
                    settled.append(st)
        for st in settled:
            st.settle()
        del drop

    def stats(self) -> dict[str, int]:
        """Counts for tests and debugging: owned values, their forks, forks held, children."""
        with self.lock:
            return {"owned": len(self.owners),
                    "forks": sum(len(r.forks) for r in self.owners.values()),
                    "handles": sum(r.handles for r in self.owners.values()),
                    "users": len(self.users), "pending_children": len(self.children)}

    def fail_all(self, why: str) -> None:
        with self.lock:
            for st in self.users.values():
                st.failed = st.failed or why
            users = list(self.users.values())
            recs = list(self.owners.values())
        for st in users:
            st.settle()
        for rec in recs:
            if rec.state == "pending":
                rec.error, rec.state = ("HpcdpError", why, ""), "failed"
                for w in rec.waiters:
                    w(rec)
                rec.waiters = []


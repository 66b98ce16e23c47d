"""Registered functions, classes and per-rank bodies of the RPC tests (sim, TCP and MPI ranks).

Each body runs on every rank of a job, starts RPC, does its checks and returns a list of
failure messages (empty when all is well) or a small dict, so one body serves every backend.
"""
from __future__ import annotations

import dataclasses
import heapq
import os
import threading
import time
import weakref
from typing import Any

import numpy as np

import hpcdp
import hpcdp.rpc as rpc
from hpcdp._arrays import SUPPORTED_DTYPES
from hpcdp.errors import CommTimeoutError, HpcdpError, PeerFailureError
from hpcdp.rpc import _context, _protocol as P
from hpcdp.rpc._agent import _Pending
from hpcdp.rpc._wire import pack_envelope


# -- what peers may call ----------------------------------------------------------------------
@rpc.register
def add(a: Any, b: Any) -> Any:
    return a + b


@rpc.register
def echo(*args: Any, **kwargs: Any) -> Any:
    return (args, kwargs) if kwargs else (args[0] if len(args) == 1 else args)


@rpc.register
def noop() -> None:
    return None


@rpc.register
def whoami() -> str:
    return rpc.get_worker_info().name


@rpc.register
def sleep_then(seconds: float, value: Any = None) -> Any:
    time.sleep(seconds)
    return value


@rpc.register
def fail(message: str) -> None:
    raise ValueError(message)


@rpc.register
def nested_add(via: str, a: Any, b: Any) -> Any:
    """A callee that calls a third worker."""
    return rpc.rpc_sync(via, add, args=(a, b))


@rpc.register
def stats() -> dict[str, int]:
    return rpc.stats()


@rpc.register
def live_tables() -> int:
    return len(Table.live)


@rpc.register
def unsendable() -> Any:
    return threading.Lock()


@rpc.register
def die(code: int) -> None:
    os._exit(code)


@rpc.register
class Table:
    """A value that lives on its owner; ``live`` shows when the owner really frees it."""

    live: "weakref.WeakSet[Table]" = weakref.WeakSet()

    def __init__(self, n: int) -> None:
        self.data = np.arange(n, dtype=np.int64) * 2
        self.lock = threading.Lock()
        Table.live.add(self)

    def lookup(self, ids: Any) -> np.ndarray:
        return self.data[ids]

    def size(self) -> int:
        return int(self.data.size)

    def bump(self, k: int) -> int:
        with self.lock:
            self.data += k
        return int(self.data[0])

    def explode(self) -> None:
        raise KeyError("no such row")

    def _secret(self) -> str:
        return "private"


@rpc.register
def use_rref(rref: rpc.RRef, ids: Any) -> dict[str, Any]:
    """On a third worker: use an RRef that came as an argument (in a nested container)."""
    return {"lookup": rref.rpc_sync().lookup(ids), "size": rref.rpc_async().size().wait(),
            "owner": rref.owner_name(), "is_owner": rref.is_owner()}


@rpc.register
def use_nested(box: dict) -> Any:
    (rref,) = box["refs"][0]
    return rref.to_here()


@rpc.register
def make_table_ref(owner: str, n: int) -> rpc.RRef:
    """Return an RRef (owned by ``owner``) from a callee: an RRef of an RRef for remote()."""
    return rpc.remote(owner, Table, args=(n,))


@rpc.register
def forward_rref(rref: rpc.RRef, to: str, ids: Any) -> Any:
    """Pass an RRef on to yet another worker and use it there."""
    return rpc.rpc_sync(to, use_rref, args=(rref, ids))["lookup"]


@rpc.register
@dataclasses.dataclass
class Point:
    x: float
    y: float
    tags: tuple = ()


@dataclasses.dataclass
class Unregistered:
    x: int


def start(rank: int, **kw: Any) -> list[str]:
    rpc.init_rpc(f"worker{rank}", **kw)
    return []


def peer(rank: int, k: int = 1) -> str:
    return f"worker{(rank + k) % hpcdp.world_size()}"


def check(fails: list[str], cond: bool, msg: str) -> None:
    if not cond:
        fails.append(msg)


def raises(fails: list[str], exc: type, fn: Any, label: str, match: str = "") -> Any:
    try:
        fn()
    except exc as e:
        if match and match not in str(e):
            fails.append(f"{label}: {exc.__name__} without {match!r}: {e}")
        return e
    except BaseException as e:  # noqa: BLE001 - reported
        fails.append(f"{label}: expected {exc.__name__}, got {type(e).__name__}: {e}")
        return None
    fails.append(f"{label}: expected {exc.__name__}, nothing raised")
    return None


def raw_request(dst: int, kind: int, fields: list, body: bytes, buffers: tuple = (),
                timeout: float = 10.0) -> Any:
    """A request sent as raw bytes through the transport, past every check of the sender; its
    future (failed after ``timeout`` seconds when no reply comes)."""
    agent = _context.current("test")
    mid = next(agent._ids)
    fut = rpc.Future(f"raw {P.NAMES.get(kind, kind)}", agent)
    with agent._lock:
        agent._pending[mid] = _Pending(fut, dst, fut.what, timeout, False)
        heapq.heappush(agent._deadlines, (time.monotonic() + timeout, mid))
    agent.transport.send(dst, pack_envelope([kind, mid, *fields]), body,
                         [memoryview(np.ascontiguousarray(b).reshape(-1).view(np.uint8))
                          for b in buffers])
    return fut


def wait_until(pred: Any, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


# -- every call form ------------------------------------------------------------------------
def body_call_forms(rank: int) -> list[str]:
    fails = start(rank, rpc_timeout=20)
    n, to = hpcdp.world_size(), peer(rank)
    me = rpc.get_worker_info()
    check(fails, me == rpc.WorkerInfo(f"worker{rank}", rank), f"worker info {me}")
    check(fails, rpc.get_worker_info(to).id == (rank + 1) % n, "get_worker_info(name)")
    r = rpc.rpc_sync(to, add, args=(np.ones(3), 2), timeout=5)
    check(fails, isinstance(r, np.ndarray) and np.array_equal(r, [3.0, 3.0, 3.0]), f"sync {r}")
    check(fails, rpc.rpc_sync(to, "add", args=(1, 2)) == 3, "by name")
    check(fails, rpc.rpc_sync((rank + 1) % n, add, args=("a", "b")) == "ab", "by rank")
    check(fails, rpc.rpc_sync(rpc.get_worker_info(to), add, kwargs={"a": 1, "b": 4}) == 5,
          "by WorkerInfo, kwargs")
    check(fails, rpc.rpc_sync(to, whoami) == to, "runs on the callee")
    check(fails, rpc.rpc_sync(me.name, whoami) == me.name, "call to self")
    fut = rpc.rpc_async(to, add, args=(1, 2), timeout=5)
    check(fails, isinstance(fut, rpc.Future), "rpc_async returns a Future")
    check(fails, fut.wait() == 3 and fut.done() and fut.value() == 3, "fut.wait/done/value")
    chained = rpc.rpc_async(to, add, args=(2, 3)).then(lambda f: f.wait() * 10)
    check(fails, chained.wait(timeout=10) == 50, "fut.then")
    seen: list[Any] = []
    ev = threading.Event()
    f2 = rpc.rpc_async(to, sleep_then, args=(0.05, "late"))
    f2.add_done_callback(lambda f: (seen.append(f.wait()), ev.set()))
    check(fails, ev.wait(10) and seen == ["late"], f"add_done_callback {seen}")
    futs = [rpc.rpc_async(to, add, args=(i, i)) for i in range(32)]
    check(fails, [f.wait() for f in futs] == [2 * i for i in range(32)], "32 in flight")
    if n >= 3:
        check(fails, rpc.rpc_sync(to, nested_add, args=(peer(rank, 2), 5, 6)) == 11,
              "nested call through a third worker")
    # remote + RRef
    rref = rpc.remote(to, Table, args=(10,))
    check(fails, not rref.is_owner() and rref.owner() == rpc.get_worker_info(to), "rref.owner")
    check(fails, rref.owner_name() == to, "rref.owner_name")
    check(fails, np.array_equal(rref.rpc_sync().lookup(np.array([1, 3])), [2, 6]), "rpc_sync()")
    check(fails, rref.rpc_async(timeout=5).size().wait() == 10, "rpc_async()")
    r2 = rref.remote().size()
    check(fails, r2.owner_name() == to and r2.to_here() == 10, "rref.remote() of a method")
    # The owner's acknowledgement of the REMOTE leaves by its control queue, replies to calls by
    # its pool: a call's reply may arrive first, so the flag may lag it, but not by long.
    check(fails, wait_until(rref.confirmed_by_owner, 5), "confirmed after use")
    val = rpc.remote(to, add, args=(5, 6))
    check(fails, val.to_here(timeout=10) == 11, "remote(fn).to_here")
    local = rpc.remote(me.name, Table, args=(4,))
    check(fails, local.is_owner() and local.local_value().size() == 4, "remote to self: owner")
    check(fails, local.rpc_sync().size() == 4, "method call on an owned RRef")
    check(fails, local.to_here().size() == 4, "to_here on the owner gives the value")
    raises(fails, HpcdpError, lambda: rref.local_value(), "local_value on a user")
    raises(fails, AttributeError, lambda: rref.rpc_sync()._secret, "private method via proxy")
    e = raises(fails, rpc.RemoteError, lambda: rpc.rpc_sync(to, "Table._secret"), "not registered")
    del rref, r2, val, local, e
    hpcdp.barrier()
    rpc.shutdown()
    return fails


# -- values ---------------------------------------------------------------------------------
def _random_array(dt: np.dtype, shape: tuple, seed: int) -> np.ndarray:
    raw = np.random.default_rng(seed).integers(0, 256, size=int(np.prod(shape)) * dt.itemsize,
                                               dtype=np.uint8)
    a = raw.view(dt).reshape(shape)
    return np.asarray(a != 0) if dt == np.bool_ else a  # only 0/1 bytes are numpy bools


def body_values(rank: int) -> list[str]:
    fails = start(rank, rpc_timeout=20)
    to = peer(rank)
    for i, dt in enumerate(SUPPORTED_DTYPES):
        for shape in [(), (0,), (7,), (3, 5), (2, 0, 3)]:
            a = _random_array(dt, shape, 100 * i + len(shape))  # random bits: NaNs, subnormals
            b = rpc.rpc_sync(to, echo, args=(a,))
            ok = isinstance(b, np.ndarray) and b.dtype == a.dtype and b.shape == a.shape and \
                b.tobytes() == a.tobytes()
            check(fails, ok, f"{dt} {shape} not bit-exact")
        s = _random_array(dt, (1,), i)[0]
        b = rpc.rpc_sync(to, echo, args=(s,))
        check(fails, type(b) is type(s) and b.tobytes() == s.tobytes(), f"numpy scalar {dt}")
    base = _random_array(np.dtype(np.float64), (6, 8), 7)
    for label, a in [("strided", base[::2, ::3]), ("fortran", np.asfortranarray(base)),
                     ("big-endian", base.astype(">f8")), ("transposed", base.T)]:
        b = rpc.rpc_sync(to, echo, args=(a,))
        check(fails, np.array_equal(b, a, equal_nan=True) and b.shape == a.shape, label)
    value = {"none": None, "t": True, "f": False, "i": -(2**63), "u": 2**64 - 1,
             "big": 3**200, "neg": -(7**90), "x": 1.5, "nan": float("nan"), "c": 1 - 2j,
             "s": "héllo ✓", "b": b"\x00\xff" * 3, "l": [1, [2, (3, "4")]], "t2": (1, (2,), []),
             (1, "k"): "tuple key", 5: "int key", b"raw": "bytes key", None: "none key",
             "empty": ((), [], {}), "p": Point(1.0, -2.5, tags=("a", 1))}
    back = rpc.rpc_sync(to, echo, args=(value,))
    nan = back.pop("nan")
    value.pop("nan")
    check(fails, nan != nan, "nan")
    check(fails, back == value, f"nested value differs: {back} != {value}")
    check(fails, type(back["t2"]) is tuple and type(back["l"][1][1]) is tuple, "tuples kept")
    check(fails, type(back["p"]) is Point, "registered dataclass rebuilt")
    check(fails, rpc.rpc_sync(to, echo, args=(bytearray(b"ab"),)) == b"ab", "bytearray")
    got = rpc.rpc_sync(to, echo, args=(1,), kwargs={"k": np.arange(3)})
    check(fails, got[0] == (1,) and np.array_equal(got[1]["k"], np.arange(3)), "kwargs arrays")
    arr = rpc.rpc_sync(to, echo, args=(np.arange(4.0),))
    arr[0] = 9.0  # a received array is the caller's own, writable
    check(fails, arr.flags.writeable, "received array writable")
    for bad, label in [(threading.Lock(), "lock"), (Unregistered(1), "unregistered dataclass"),
                       (np.array([object()]), "object array"), ({1, 2}, "set"),
                       (np.zeros(2, [("a", "i4")]), "structured dtype"), (1 << 9000, "huge int"),
                       (lambda: 0, "lambda")]:
        exc = ValueError if label == "huge int" else TypeError
        raises(fails, exc, lambda: rpc.rpc_sync(to, echo, args=(bad,)), f"send {label}")
    e = raises(fails, rpc.RemoteError, lambda: rpc.rpc_sync(to, unsendable), "unsendable result")
    check(fails, e is None or "cannot be sent back" in str(e), f"unsendable message: {e}")
    deep: Any = 1
    for _ in range(80):
        deep = [deep]
    raises(fails, ValueError, lambda: rpc.rpc_sync(to, echo, args=(deep,)), "too deep",
           "max_depth")
    cyc: list = []
    cyc.append(cyc)
    raises(fails, ValueError, lambda: rpc.rpc_sync(to, echo, args=(cyc,)), "cycle", "max_depth")
    raises(fails, TypeError, lambda: rpc.rpc_sync(to, Unregistered), "unregistered function",
           "register")
    check(fails, rpc.rpc_sync(to, add, args=(1, 1)) == 2, "serves after refused values")
    hpcdp.barrier()
    rpc.shutdown()
    return fails


# -- RRefs across workers -------------------------------------------------------------------
def body_rrefs(rank: int) -> list[str]:
    """Rank 0 creates RRefs owned by rank 1 and shares them with rank 2 (a third worker) in
    nested containers and as RRefs of RRefs; then every reference goes and the owner frees."""
    fails = start(rank, rpc_timeout=20)
    n = hpcdp.world_size()
    if rank == 0:
        owner, third = "worker1", f"worker{2 % n}"
        ids = np.array([0, 4])
        rref = rpc.remote(owner, Table, args=(8,))
        out = rpc.rpc_sync(third, use_rref, args=(rref, ids))
        check(fails, np.array_equal(out["lookup"], [0, 8]) and out["size"] == 8,
              f"used on a third worker: {out}")
        check(fails, out["owner"] == owner and out["is_owner"] == (third == owner), f"{out}")
        box = {"refs": [(rpc.remote(owner, add, args=(20, 22)),)]}
        check(fails, rpc.rpc_sync(third, use_nested, args=(box,)) == 42, "RRef in a container")
        # an RRef of an RRef: the inner one is owned by the third worker
        outer = rpc.remote(owner, make_table_ref, args=(third, 3))
        inner = outer.to_here()
        check(fails, isinstance(inner, rpc.RRef) and inner.owner_name() == third, f"{inner!r}")
        check(fails, inner.rpc_sync().size() == 3, "RRef of an RRef: inner usable")
        # forwarded twice: 0 -> third -> owner (the RRef comes home to its owner) and back
        check(fails, np.array_equal(rpc.rpc_sync(third, forward_rref, args=(rref, owner, ids)),
                                    [0, 8]), "forwarded to the owner")
        check(fails, np.array_equal(rpc.rpc_sync(third, forward_rref, args=(rref, "worker0", ids)),
                                    [0, 8]), "forwarded back to the creator")
        check(fails, rref.rpc_sync().bump(1) == 1, "method changes the owner's value")
        check(fails, rpc.rpc_sync(owner, live_tables) >= 1, "owner holds the table")
        del rref, box, outer, inner, out
        zero = {"owned": 0, "forks": 0, "handles": 0, "users": 0, "pending_children": 0,
                "pending_requests": 0}
        for w in sorted({owner, third, "worker0"}):
            get = rpc.stats if w == "worker0" else (lambda w=w: rpc.rpc_sync(w, stats))
            ok = wait_until(lambda: get() == zero, 15)
            check(fails, ok, f"{w} did not drop to zero: {get()}")
        check(fails, wait_until(lambda: rpc.rpc_sync(owner, live_tables) == 0, 10),
              "the owner did not free its Table values")
        check(fails, rpc.rpc_sync(third, live_tables) == 0, "third worker freed its Table")
    hpcdp.barrier()
    rpc.shutdown()
    return fails


# -- errors, timeouts, shutdown with calls in flight ------------------------------------------
def body_errors(rank: int) -> list[str]:
    fails = start(rank, rpc_timeout=20)
    to = peer(rank)
    e = raises(fails, rpc.RemoteError, lambda: rpc.rpc_sync(to, fail, args=("boom",)), "raise")
    if e is not None:
        check(fails, e.remote_type == "ValueError" and isinstance(e, ValueError), f"type {e!r}")
        check(fails, "boom" in str(e) and "in fail" in e.remote_traceback and to in str(e),
              f"message/traceback: {e}")
    f = rpc.rpc_async(to, fail, args=("later",))
    raises(fails, ValueError, f.wait, "async raise", "later")
    bad = rpc.remote(to, fail, args=("in remote",))
    raises(fails, rpc.RemoteError, bad.to_here, "remote() that raised: to_here", "in remote")
    t = rpc.remote(to, Table, args=(2,))
    e = raises(fails, KeyError, lambda: t.rpc_sync().explode(), "method that raises")
    raises(fails, rpc.RemoteError, lambda: t.rpc_sync().missing(), "missing method")
    e = raises(fails, CommTimeoutError, lambda: rpc.rpc_sync(to, sleep_then, args=(2.5,),
                                                             timeout=0.2), "timeout")
    if e is not None:
        check(fails, f"rank {rank}" in str(e) and "sleep_then" in str(e), f"timeout text {e}")
    f = rpc.rpc_async(to, sleep_then, args=(2.5,), timeout=0.2)
    raises(fails, CommTimeoutError, f.wait, "async timeout")
    raises(fails, CommTimeoutError, lambda: rpc.rpc_async(to, sleep_then, args=(2.5,)).wait(0.05),
           "wait(timeout) on the future")
    check(fails, rpc.rpc_sync(to, add, args=(2, 2)) == 4, "serves after errors and timeouts")
    raises(fails, ValueError, lambda: rpc.rpc_sync("nobody", add, args=(1, 1)), "unknown worker")
    raises(fails, ValueError, lambda: rpc.rpc_sync(to, add, args=(1, 1), timeout=0), "timeout=0")
    del t, bad
    # graceful shutdown waits for calls still in flight, here and on the peers
    slow = rpc.rpc_async(to, sleep_then, args=(0.5, "done"))
    rpc.shutdown()
    check(fails, slow.done() and slow.wait() == "done", "shutdown did not wait for a call")
    raises(fails, HpcdpError, lambda: rpc.rpc_sync(to, add, args=(1, 1)), "call after shutdown",
           "not initialised")
    return fails


def body_leave_abruptly(rank: int) -> list[str]:
    """Rank 1 leaves with ``graceful=False`` while its calls to rank 0 are in flight."""
    fails = start(rank, rpc_timeout=20)
    if rank == 1:
        futs = [rpc.rpc_async("worker0", sleep_then, args=(0.5, i)) for i in range(3)]
        rpc.shutdown(graceful=False)
        for f in futs:
            raises(fails, HpcdpError, f.wait, "pending call after shutdown(graceful=False)",
                   "shut down")
    elif rank == 0:
        agent = _context.current("test")
        check(fails, wait_until(lambda: 1 in agent.lost, 30), "rank 1's departure not noticed")
        raises(fails, PeerFailureError, lambda: rpc.rpc_sync("worker1", add, args=(1, 1)),
               "call to a worker that left")
        if hpcdp.world_size() > 2:
            check(fails, rpc.rpc_sync("worker2", add, args=(1, 1)) == 2, "others still serve")
    if rank != 1:
        rpc.shutdown()  # the leader leaves the departed worker out
    return fails


def body_killed_callee(rank: int, flag_dir: str) -> list[str]:
    """Rank 1's callee exits the process mid-call (``os._exit``): rank 0's call fails fast."""
    fails = start(rank, rpc_timeout=30)
    if rank == 0:
        slow = rpc.rpc_async("worker1", sleep_then, args=(20.0,))
        raises(fails, PeerFailureError, lambda: rpc.rpc_sync("worker1", die, args=(3,)),
               "call to a callee that died", "worker1")
        raises(fails, PeerFailureError, slow.wait, "other pending call to the dead worker")
        raises(fails, PeerFailureError, lambda: rpc.rpc_sync("worker1", add, args=(1, 1)),
               "later call to the dead worker")
        if hpcdp.world_size() > 2:
            check(fails, rpc.rpc_sync("worker2", add, args=(1, 2)) == 3, "others still serve")
        rpc.shutdown()
        with open(os.path.join(flag_dir, "rank0"), "w") as fh:
            fh.write(repr(fails))
    elif rank == 1:
        time.sleep(60)  # its RPC thread exits the process first
    else:
        rpc.shutdown()
    return fails


def body_sim_rank_dies(rank: int, report: dict) -> None:
    """Simulated ranks: rank 1's thread raises while rank 0's call to it is in flight."""
    start(rank, rpc_timeout=30)
    if rank == 1:
        time.sleep(0.3)
        raise RuntimeError("rank 1 crashes")
    fails: list[str] = []
    slow = rpc.rpc_async("worker1", sleep_then, args=(5.0,))
    raises(fails, PeerFailureError, slow.wait, "pending call to a rank that died", "worker1")
    raises(fails, PeerFailureError, lambda: rpc.rpc_sync("worker1", add, args=(1, 1)),
           "call to a rank that died")
    rpc.shutdown()
    report[rank] = fails


def spawned(size: int) -> list[str]:
    """``world`` names of every backend ``hpcdp.spawn`` can start, at ``size`` ranks."""
    from hpcdp.testing import spawn_backends

    return [f"{b}-{size}" for b in spawn_backends()]

"""hpcdp.rpc refuses what it must, with a clear error, and keeps serving: unregistered names,
forged messages from an authenticated peer, oversized and deeply nested payloads, payloads that
name a class to build; on TCP it opens no port of its own (it travels over the backend's
authenticated connections), and connections that do not authenticate are dropped."""
from __future__ import annotations

import os
import socket
import struct
from typing import Any

import msgpack
import numpy as np
import pytest

import hpcdp
import hpcdp.rpc as rpc
import rpc_bodies as B
from conftest import run_ranks
from hpcdp.testing.fixtures import worlds
from hpcdp.errors import ProtocolError
from hpcdp.rpc import _codec as C, _context, _protocol as P
from hpcdp.rpc._wire import pack_envelope

pytestmark = pytest.mark.timeout(240)

SMALL = dict(max_message_bytes=1 << 20, max_body_bytes=64 << 10, max_depth=16,
             max_elements=1000)


def args_body(*items: Any) -> bytes:
    """A CALL body ((items...), {}) whose items are already in wire form."""
    return msgpack.packb([C.TUPLE, [C.TUPLE, *items], [C.DICT]], use_bin_type=True)


def _nested(depth: int) -> Any:
    v: Any = 1
    for _ in range(depth):
        v = [v]
    return v


def refused(fails: list[str], fut: Any, label: str, match: str) -> None:
    e = B.raises(fails, rpc.RemoteError, fut.wait, label, match)
    if e is not None and e.remote_type != "ProtocolError":
        fails.append(f"{label}: remote type {e.remote_type}, not ProtocolError")


@rpc.register
def forge_replies(target: int, mid: int) -> list[str]:
    """Runs on an authenticated peer: replies to a request that went to another worker."""
    agent = _context.current("test")
    for kind, body in [(P.RESULT, C.encode("forged", agent.limits).body),
                       (P.ERROR, C.encode(("ValueError", "forged", ""), agent.limits).body),
                       (P.CRESULT, C.encode("forged", agent.limits).body),
                       (P.RESULT, C.encode("forged", agent.limits).body)]:
        agent.transport.send(target, pack_envelope([kind, mid]), body, [])
    agent.transport.send(target, pack_envelope([P.RESULT, 10**12]), b"\xc0", [])  # unknown id
    agent.transport.send(target, pack_envelope([77, 1]), b"", [])  # unknown kind
    agent.transport.send(target, b"\xc1\xc1", b"", [])  # not an envelope
    return []


def _rid(rank: int) -> list:
    """A well-formed RRef or fork id of ``rank`` (16 random bytes): one nobody made."""
    return [rank, os.urandom(16)]


@rpc.register
def forge_rref_protocol(owner: int, rid: list, fid: list) -> list[str]:
    """Runs on a worker that holds no fork of ``rid``: every protocol message must be refused,
    and none of them gives it a way to the value (its FETCH and RCALL after them are refused)."""
    fails: list[str] = []
    me = rpc.get_worker_info().id  # this worker (hpcdp.rank() is not set on RPC threads)
    other = 1 - (me % 2)
    for label, kind, fields, match in [
        ("DELETE of another's fork", P.DELETE, [rid, fid], "does not hold"),
        ("FORK with a fork id not made by its parent", P.FORK,
         [rid, _rid(me), other, os.urandom(16)], "made by"),
        ("FORK naming the owner as parent", P.FORK, [rid, _rid(owner), owner, b""], "made by"),
        # the attack of issue 20 item 11: a fork of its own making, for a real RRef
        ("FORK of a real RRef from a worker never given it", P.FORK,
         [rid, _rid(me), me, os.urandom(16)], "holds no fork that handed it one"),
        ("FORK of a real RRef without a token", P.FORK, [rid, _rid(me), me, b""],
         "holds no fork that handed it one"),
        ("FORK of a guessed RRef id", P.FORK, [_rid(owner), _rid(me), me, os.urandom(16)],
         "owns no RRef"),
        ("FORK of a sequential id (the old format)", P.FORK, [[owner, 1], [me, 1], me, b""],
         "malformed"),
        ("FORK with a malformed token", P.FORK, [rid, _rid(me), me, 5], "malformed token"),
        ("ACCEPT of an unknown child", P.ACCEPT, [_rid(owner)], "unknown child"),
        ("REMOTE with a foreign id", P.REMOTE, ["add", _rid(owner), _rid(owner), None, None],
         "foreign ids"),
        # refused before anything is recorded (an RRef that would never get its value)
        ("REMOTE with a malformed target", P.REMOTE,
         ["size", _rid(me), _rid(me), [owner, "x"], "size"], "malformed"),
        ("REMOTE on a real RRef without a reference", P.REMOTE,
         ["size", _rid(me), _rid(me), rid, "size"], "holds no reference"),
        ("FETCH without a reference", P.FETCH, [rid], "holds no reference"),
        ("FETCH of a guessed id", P.FETCH, [_rid(owner)], "owns no RRef"),
        ("RCALL without a reference", P.RCALL, [rid, "size"], "holds no reference"),
        ("malformed id", P.FETCH, [[1, "x"]], "malformed"),
        ("malformed CALL", P.CALL, [5], "malformed CALL"),
    ]:
        body = args_body() if kind in (P.REMOTE, P.RCALL) else b"\xc0"
        refused(fails, B.raw_request(owner, kind, fields, body), label, match)
    return fails


def body_security(rank: int) -> list[str]:
    """Rank 1 runs with small limits; rank 0 attacks it, and rank 1 forges messages to rank 0."""
    fails = B.start(rank, rpc_timeout=20, limits=rpc.Limits(**SMALL) if rank == 1 else None)
    if rank == 0:
        w1 = "worker1"
        for name in ["os.system", "builtins.eval", "subprocess.Popen", "Table.__init__",
                     "Table._secret", "add.__globals__"]:
            e = B.raises(fails, rpc.RemoteError, lambda: rpc.rpc_sync(w1, name, args=("true",)),
                         f"unregistered {name}", "no function or class registered")
            if e is not None and e.remote_type != "LookupError":
                fails.append(f"unregistered {name}: {e.remote_type}")
        # the sender checks the receiver's announced limits before sending anything
        for label, value, match in [
            ("oversized array", np.zeros(2 << 20, np.uint8), "max_message_bytes"),
            ("oversized body", "x" * (100 << 10), "max_body_bytes"),
            ("too many elements", list(range(2000)), "max_elements"),
            ("too deep", _nested(20), "max_depth")]:
            B.raises(fails, ValueError, lambda: rpc.rpc_sync(w1, B.echo, args=(value,)), label,
                     match)
        # raw frames past the sender's checks: the receiver refuses each, with the reason
        deep = [C.LIST, 1]
        for _ in range(40):
            deep = [C.LIST, deep]
        stack = b"\x91" * 5000 + b"\xc0"
        array = [C.NDARRAY, "uint8", [8], 0]
        for label, fields, body, bufs, match in [
            ("oversized buffer", ["echo"], args_body([C.NDARRAY, "uint8", [2 << 20], 0]),
             (np.ones(2 << 20, np.uint8),), "exceeds the limit"),
            ("oversized body", ["echo"], args_body("x" * (100 << 10)), (), "exceeds the limit"),
            ("deep nesting", ["echo"], args_body(deep), (), "nested deeper"),
            ("msgpack stack bomb", ["echo"], stack, (), "malformed message body"),
            ("element flood", ["echo"], args_body([C.LIST, *range(5000)]), (), "elements"),
            ("class to build", ["echo"],
             args_body([C.DATACLASS, "subprocess.Popen", "args", "ls"]), (),
             "not a registered dataclass"),
            ("registered non-dataclass to build", ["echo"],
             args_body([C.DATACLASS, "Table", "n", 3]), (), "not a registered dataclass"),
            ("unknown dataclass field", ["echo"],
             args_body([C.DATACLASS, "Point", "x", 1.0, "__class__", 2]), (), "bad field"),
            ("object dtype", ["echo"], args_body([C.NDARRAY, "object", [1], 0]),
             (np.zeros(8, np.uint8),), "not supported"),
            ("shape/buffer mismatch", ["echo"], args_body([C.NDARRAY, "float64", [9], 0]),
             (np.zeros(8, np.uint8),), "does not match"),
            ("buffer used twice", ["echo"], args_body(array, array), (np.zeros(8, np.uint8),),
             "used twice"),
            ("unused buffer", ["echo"], args_body(1), (np.zeros(8, np.uint8),), "not referenced"),
            ("extension type", ["echo"],
             msgpack.packb([C.TUPLE, [C.TUPLE, msgpack.ExtType(5, b"x")], [C.DICT]]), (),
             "extension"),
            ("msgpack map", ["echo"], msgpack.packb([C.TUPLE, [C.TUPLE, {"a": 1}], [C.DICT]]), (),
             "unexpected msgpack dict"),
            ("unknown tag", ["echo"], args_body([99, 1]), (), "unknown or malformed value tag"),
            ("RRef with a forged parent", ["echo"],
             args_body([C.RREF, 1, *_rid(0), *_rid(1), 2, b""]), (), "names parent"),
            ("RRef to nothing of the owner's", ["echo"],
             args_body([C.RREF, 1, *_rid(0), *_rid(0), 0, b""]), (), "owns no RRef"),
            ("RRef with a sequential id", ["echo"], args_body([C.RREF, 1, 0, 1, 0, 2, 0, b""]),
             (), "malformed"),
            ("garbage body", ["echo"], b"\xc1", (), "malformed message body"),
        ]:
            refused(fails, B.raw_request(1, P.CALL, fields, body, bufs), label, match)
        # forged replies: a request of ours to worker0 (ourselves) answered by worker1
        slow = rpc.rpc_async("worker0", B.sleep_then, args=(2.0, "real"))
        agent = _context.current("test")
        with agent._lock:
            mid = max(agent._pending)
        rpc.rpc_sync(w1, forge_replies, args=(0, mid))
        B.check(fails, slow.wait() == "real", "a forged reply was taken")
        # forged RRef protocol messages about an RRef this worker owns
        mine = rpc.remote("worker0", B.Table, args=(3,))
        mine.local_value()
        before = rpc.stats()
        with agent.rrefs.lock:
            rid = list(mine._rid)
        out = rpc.rpc_sync(w1, forge_rref_protocol, args=(0, rid, _rid(0)))
        fails += [f"worker1: {f}" for f in out]
        B.check(fails, rpc.stats() == before, f"forged protocol changed counts: {rpc.stats()}")
        B.check(fails, mine.rpc_sync().size() == 3, "the RRef still works")
        # and after all that, both still serve
        B.check(fails, np.array_equal(rpc.rpc_sync(w1, B.add, args=(np.ones(2), 1)), [2, 2]),
                "worker1 stopped serving")
        del mine
    hpcdp.barrier()
    B.check(fails, rpc.rpc_sync(B.peer(rank), B.add, args=(1, 1)) == 2, "serving after attacks")
    hpcdp.barrier()
    rpc.shutdown()
    return fails


def _listening_ports() -> set[int]:
    """The TCP ports this process listens on (its sockets in LISTEN state, from /proc)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as fh:
                rows = fh.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if f[3] == "0A" and f[9] in inodes:
                ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return ports


def body_unauthenticated(rank: int) -> list[str]:
    """RPC on TCP travels over the backend's own authenticated connections: ``init_rpc`` opens
    no port of its own, and connections to worker1's one listener that fail the handshake are
    dropped while RPC serves on."""
    from hpcdp.backends.tcp import _wire as wire
    from tcp_helpers import closed_by_server

    before = _listening_ports()
    fails = B.start(rank, rpc_timeout=20)
    B.check(fails, _listening_ports() == before,
            f"init_rpc opened a listener: ports {sorted(before)} -> {sorted(_listening_ports())}")
    world = hpcdp.get_default_group().backend.world
    ports = hpcdp.all_gather(np.array([world.listener.getsockname()[1]]))
    if rank == 0:
        addr = ("127.0.0.1", int(ports[1][0]))
        secret, gen = wire.get_secret(), world.generation
        hello = struct.Struct("<4sBBHii32s")

        def attempt(label: str, payload: bytes) -> None:
            with socket.create_connection(addr, timeout=5) as s:
                s.sendall(payload)
                B.check(fails, closed_by_server(s), f"{label}: connection left open")

        attempt("garbage", os.urandom(64))
        attempt("RPC frame without handshake",
                (struct.pack("<2sBBIII", b"HR", 1, 0, 7, 0, 0) + b"\x93\x01\x01\xa3add").ljust(64, b"\0"))
        attempt("hello for the store role", hello.pack(b"HPCD", 1, wire.ROLE_STORE, gen, 0, 1,
                                                       os.urandom(32)))
        attempt("hello for another rank", hello.pack(b"HPCD", 1, wire.ROLE_PEER, gen, 0, 0,
                                                     os.urandom(32)))
        # right role and target, wrong secret: the client side sees the server refuse
        with socket.create_connection(addr, timeout=5) as s:
            try:
                wire.client_handshake(s, b"not the secret", wire.ROLE_PEER, 0, 1, 5.0, gen)
                fails.append("handshake with a wrong secret accepted")
            except Exception as exc:  # noqa: BLE001 - AuthError or a closed connection
                B.check(fails, isinstance(exc, (hpcdp.AuthError, ConnectionError, OSError)),
                        f"wrong secret: {exc!r}")
        # the secret, but claiming a rank that is already connected: refused after the handshake
        with socket.create_connection(addr, timeout=5) as s:
            wire.client_handshake(s, secret, wire.ROLE_PEER, 0, 1, 5.0, gen)
            B.check(fails, closed_by_server(s), "second connection claiming rank 0 kept open")
        B.check(fails, rpc.rpc_sync("worker1", B.add, args=(2, 3)) == 5, "worker1 stopped serving")
    hpcdp.barrier()
    rpc.shutdown()
    return fails


@pytest.mark.parametrize("world", worlds(*B.spawned(2), "mpi"), indirect=True)
def test_refused_and_still_serving(world) -> None:
    res = world.run(body_security, timeout=60, join_timeout=150)
    assert res == [[]] * world.size, res


def test_rpc_opens_no_port_and_unauthenticated_connections_are_dropped() -> None:
    res = run_ranks("tcp", 2, body_unauthenticated, timeout=60, join_timeout=120)
    assert res == [[], []], res


def test_codec_refuses_without_a_transport() -> None:
    """The decoder alone: what an attacker's body turns into is a ProtocolError, never a value."""
    lim = C.Limits(max_depth=8, max_elements=100)
    for body, bufs in [(msgpack.packb([C.DATACLASS, "os.system", "command", "id"]), []),
                       (msgpack.packb([C.NDARRAY, "O", [1], 0]), [bytearray(8)]),
                       (msgpack.packb([C.NPSCALAR, "float64", b"\0"]), []),
                       (msgpack.packb([C.BIGINT, b"\1" * 5000]), []),
                       (msgpack.packb([C.DICT, 1]), []),
                       (msgpack.packb([C.DICT, [C.LIST], 1]), []),
                       (msgpack.packb([C.RREF, 0, 0, 0, 0, 0, 0]), []),
                       (msgpack.packb([C.LIST] + [0] * 300), [])]:
        with pytest.raises(ProtocolError):
            C.decode(body, bufs, lim)
    with pytest.raises(ProtocolError, match="more than 100 elements"):
        C.decode(msgpack.packb([C.LIST, *[[C.LIST, 1, 2, 3]] * 60]), [], lim)


@rpc.register
def hold_rref(rref: rpc.RRef) -> bool:
    """Keeps ``rref`` on this worker (a legitimate holder) until ``drop_held``."""
    _HELD.append(rref)
    return rref.confirmed_by_owner()


@rpc.register
def drop_held() -> None:
    _HELD.clear()


_HELD: list = []


@rpc.register
def forge_fork_as_third(owner: int, rid: list, holder: int) -> list[str]:
    """On a worker never sent ``rid``: forks naming a real holder as parent, then uses."""
    fails: list[str] = []
    me = rpc.get_worker_info().id
    for label, kind, fields, match in [
        ("FORK naming a real holder as parent, with a made-up token", P.FORK,
         [rid, _rid(holder), holder, os.urandom(16)], "holds no fork that handed it one"),
        ("FORK naming a real holder as parent, without a token", P.FORK,
         [rid, _rid(holder), holder, b""], "holds no fork that handed it one"),
        ("FORK of its own making", P.FORK, [rid, _rid(me), me, os.urandom(16)],
         "holds no fork that handed it one"),
        ("FETCH after the forged FORKs", P.FETCH, [rid], "holds no reference"),
        ("RCALL after the forged FORKs", P.RCALL, [rid, "lookup"], "holds no reference"),
    ]:
        body = args_body() if kind == P.RCALL else b"\xc0"
        refused(fails, B.raw_request(owner, kind, fields, body), label, match)
    return fails


def body_rref_capabilities(rank: int) -> list[str]:
    """Worker0 owns a Table and hands it to worker1 only; worker2 learns the id and forges."""
    fails = B.start(rank, rpc_timeout=20)
    if rank == 0:
        mine = rpc.remote("worker0", B.Table, args=(6,))
        other = rpc.remote("worker0", B.Table, args=(2,))
        for r in (mine, other):  # 128 random bits, not a counter
            B.check(fails, type(r._rid[1]) is bytes and len(r._rid[1]) == 16, f"id {r._rid!r}")
        B.check(fails, mine._rid != other._rid, "two RRefs with one id")
        B.check(fails, rpc.rpc_sync("worker1", hold_rref, args=(mine,)), "worker1 not confirmed")
        before = rpc.stats()
        out = rpc.rpc_sync("worker2", forge_fork_as_third, args=(0, list(mine._rid), 1))
        fails += [f"worker2: {f}" for f in out]
        B.check(fails, rpc.stats() == before, f"forged FORKs changed counts: {rpc.stats()}")
        # the legitimate flows still work: a user RRef created by remote() and passed on at
        # once (before its owner confirmed it) to a third worker, who uses it and passes it on
        t = rpc.remote("worker1", B.Table, args=(8,))
        ids = np.array([1, 3])
        got = rpc.rpc_sync("worker2", B.use_rref, args=(t, ids))
        B.check(fails, np.array_equal(got["lookup"], [2, 6]) and got["size"] == 8, f"{got}")
        B.check(fails, np.array_equal(rpc.rpc_sync("worker2", B.forward_rref,
                                                   args=(t, "worker0", ids)), [2, 6]),
                "forwarded by a third worker")
        B.check(fails, t.rpc_sync().size() == 8, "a method call on the owner")
        B.check(fails, rpc.rpc_sync("worker1", B.forward_rref, args=(mine, "worker2", ids))
                is not None, "a legitimate holder forwarding the RRef")
        rpc.rpc_sync("worker1", drop_held)
        del mine, other, t, r, got
        for w in ("worker0", "worker1", "worker2"):
            get = rpc.stats if w == "worker0" else (lambda w=w: rpc.rpc_sync(w, B.stats))
            B.check(fails, B.wait_until(lambda: get() == _ZERO, 15), f"{w} kept {get()}")
    hpcdp.barrier()
    rpc.shutdown()
    return fails


_ZERO = {"owned": 0, "forks": 0, "handles": 0, "users": 0, "pending_children": 0,
         "pending_requests": 0}


@pytest.mark.parametrize("world", worlds(*B.spawned(3), "mpi", mpi_min_size=3), indirect=True)
def test_rref_served_only_to_workers_handed_a_fork(world) -> None:
    """Issue 20 item 11: a forged FORK (guessed id, or a real id from a worker never sent it)
    is refused, and so are that worker's uses; the legitimate flows still work."""
    res = world.run(body_rref_capabilities, timeout=60, join_timeout=150)
    assert res == [[]] * world.size, res

"""hpcdp.rpc pieces without an agent: the codec, the registry, RemoteError, Future, the channel
on its own, the benchmark's smoke run."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
import time
from typing import Any

import msgpack
import numpy as np
import pytest

import hpcdp.rpc as rpc
from hpcdp._arrays import SUPPORTED_DTYPES
from hpcdp.errors import CommTimeoutError, HpcdpError, ProtocolError
from hpcdp.rpc import _codec as C, _registry
from hpcdp.rpc._errors import remote_error
from hpcdp.testing import check
from hpcdp.testing.fixtures import worlds
from conftest import parse_source  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.timeout(120)


def roundtrip(value, limits=None):
    lim = limits or C.Limits()
    enc = C.encode(value, lim)
    # what a transport delivers: the body's bytes and fresh buffers holding each array's bytes
    bufs = [np.frombuffer(b, np.uint8).copy() for b in enc.buffers]
    return C.decode(bytes(enc.body), bufs, lim), enc, bufs


@rpc.register
@dataclasses.dataclass
class Box:
    label: str
    values: list
    computed: int = dataclasses.field(default=0, init=False)

    def __post_init__(self) -> None:
        self.computed = len(self.values)


def test_every_dtype_bit_exact_and_zero_copy() -> None:
    rng = np.random.default_rng(0)
    for dt in SUPPORTED_DTYPES:
        raw = rng.integers(0, 256, 24 * dt.itemsize, dtype=np.uint8)
        a = (raw.view(dt) != 0) if dt == np.bool_ else raw.view(dt)
        a = a.reshape(4, 6)
        back, enc, bufs = roundtrip(a)
        assert back.dtype == a.dtype and back.shape == a.shape and back.tobytes() == a.tobytes()
        assert np.shares_memory(np.frombuffer(enc.buffers[0], np.uint8), a), "encode copied"
        assert np.shares_memory(back, bufs[0]), "decode copied"


def test_values_keep_their_types() -> None:
    value = ({"k": [1, (2, 3)], (4, "t"): b"x", None: 1.5, 7: 2 + 3j}, [True, None], (),
             np.float32(1.25), np.int8(-3), np.bool_(True), 2**100, -(2**70),
             Box("b", [1, 2]))
    back, _, _ = roundtrip(value)
    assert back == value
    assert type(back[0]["k"][1]) is tuple and type(back[1]) is list
    assert type(back[3]) is np.float32 and type(back[5]) is np.bool_
    assert type(back[8]) is Box and back[8].computed == 2


@pytest.mark.parametrize("bad", [object(), {1, 2}, frozenset(), np.array([None]), range(3),
                                 np.zeros(2, "U3"), np.datetime64("2020-01-01"), print])
def test_unsupported_values_are_type_errors(bad) -> None:
    with pytest.raises(TypeError, match="cannot send"):
        C.encode([1, {"x": bad}], C.Limits())


def test_limits_on_the_sender() -> None:
    lim = C.Limits(max_message_bytes=1000, max_body_bytes=100, max_depth=4, max_elements=10,
                   max_buffers=2)
    for value, match in [(np.zeros(2000, np.uint8), "max_message_bytes"), ("x" * 200, "max_body"),
                         ([[[[[1]]]]], "max_depth"), (list(range(11)), "max_elements"),
                         ([np.zeros(1)] * 3, "max_buffers")]:
        with pytest.raises(ValueError, match=match):
            C.encode(value, lim)
    with pytest.raises(ValueError, match="max_depth"):
        C.Limits(max_depth=10_000)
    with pytest.raises(ValueError):
        C.Limits(max_elements=0)


def test_decoder_checks_limits_too() -> None:
    lim = C.Limits(max_depth=4, max_elements=10, max_body_bytes=64, max_buffers=1)
    body = C.encode([[[[[1]]]]], C.Limits()).body
    with pytest.raises(ProtocolError, match="nested deeper"):
        C.decode(body, [], lim)
    with pytest.raises(ProtocolError, match="exceeds"):
        C.decode(C.encode("y" * 100, C.Limits()).body, [], lim)
    with pytest.raises(ProtocolError, match="arrays exceed"):
        C.decode(b"\xc0", [bytearray(1), bytearray(1)], lim)


def test_registry_names() -> None:
    def f() -> int:
        return 1

    rpc.register(f, name="test_codec.f")
    assert _registry.lookup("test_codec.f").obj is f
    rpc.register(f, name="test_codec.f")  # the same object again: fine

    def g() -> int:
        return 2

    with pytest.raises(ValueError, match="already taken"):
        rpc.register(g, name="test_codec.f")
    with pytest.raises(TypeError):
        rpc.register(42)
    assert _registry.dataclass_name(Box) == "Box" and _registry.is_registered_class(Box)


def test_remote_error_types() -> None:
    e = remote_error("m", "ValueError", "tb")
    assert isinstance(e, rpc.RemoteError) and isinstance(e, ValueError) and isinstance(e, HpcdpError)
    assert e.remote_type == "ValueError" and "tb" in str(e)
    for name in ("KeyError", "OSError", "FileNotFoundError", "StopIteration", "TimeoutError"):
        assert isinstance(remote_error("m", name, ""), rpc.RemoteError)
    e = remote_error("m", "os.system", "")  # a name is only ever text
    assert type(e) is rpc.RemoteError and e.remote_type == "os.system"


def test_future_semantics() -> None:
    f = rpc.Future("test")
    assert not f.done()
    with pytest.raises(ValueError, match="before the future completed"):
        f.value()
    with pytest.raises(CommTimeoutError, match="not complete"):
        f.wait(timeout=0.01)
    chained = f.then(lambda fut: fut.wait() + 1)
    failing = f.then(lambda fut: 1 / 0)
    seen = threading.Event()
    f.add_done_callback(lambda fut: seen.set())
    threading.Timer(0.05, f.set_result, args=(41,)).start()
    assert chained.wait(timeout=10) == 42 and f.value() == 41 and seen.wait(10)
    with pytest.raises(ZeroDivisionError):
        failing.wait(timeout=10)
    assert not f.set_exception(RuntimeError("late"))  # the first outcome wins
    g = rpc.Future("err")
    g.set_exception(KeyError("k"))
    with pytest.raises(KeyError):
        g.wait()
    assert isinstance(g.exception(), KeyError)


def test_calls_need_init() -> None:
    with pytest.raises(HpcdpError, match="not initialised"):
        rpc.rpc_sync("worker1", "add")
    assert not rpc.is_initialized()


def test_bench_smoke_sim() -> None:
    out = subprocess.run([sys.executable, "-m", "hpcdp.bench.rpc", "--backend", "sim",
                          "--trials", "1", "--iters", "20", "--window", "4", "--rounds", "1"],
                         capture_output=True, text=True, timeout=100,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0, out.stderr
    assert "# R1 sim: rpc_sync no-op" in out.stdout and "# R2 sim: 4 rpc_async" in out.stdout


# -- review fixes: each of these failed before ---------------------------------------------------
def test_array_headers_cannot_preallocate() -> None:
    """msgpack reserves room for each array header's announced items (up to 80 KiB each): a
    body of nested headers announcing a million items that never come must be refused before
    it reserves thousands of times its own size."""
    import tracemalloc

    header = b"\xdd" + (1_000_000).to_bytes(4, "big")  # an array of a million items, announced
    body = (header + b"\xc0" * 4) * 200  # 1.8 KB: each array holds a few nils and the next one
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError):
            C.decode(body, [], C.Limits())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"decoding {len(body)} bytes reserved {peak} bytes"


@pytest.mark.parametrize("shape", [[0, 2**62, 2**62], [2**40, 0], [0] + [2**16] * 31])
def test_shapes_larger_than_any_message(shape) -> None:
    """With a zero in the shape the size matches an empty buffer, but numpy cannot build the
    rest (or would have to reserve it): a ProtocolError, never numpy's ValueError."""
    body = msgpack.packb([C.NDARRAY, "float64", shape, 0])
    with pytest.raises(ProtocolError, match="larger than any message"):
        C.decode(body, [bytearray(0)], C.Limits())


def test_bool_bytes_must_be_0_or_1() -> None:
    with pytest.raises(ProtocolError, match="bool"):
        C.decode(msgpack.packb([C.NDARRAY, "bool", [3], 0]), [bytearray(b"\x00\x01\x02")],
                 C.Limits())
    with pytest.raises(ProtocolError, match="numpy scalar"):
        C.decode(msgpack.packb([C.NPSCALAR, "bool", b"\x07"]), [], C.Limits())
    ok = C.decode(msgpack.packb([C.NDARRAY, "bool", [2], 0]), [bytearray(b"\x01\x00")],
                  C.Limits())
    assert ok.tolist() == [True, False]


def test_rrefs_in_a_value_that_fails_are_still_taken_in() -> None:
    """A value that fails to decode after (or before) an RRef: each RRef in it still reaches
    the hook, so the worker can confirm and release the fork its sender recorded."""
    seen: list[list] = []
    ref = [C.RREF, 1, 0, 5, 0, 6, 0]
    body = msgpack.packb([C.TUPLE, [C.DATACLASS, "not.registered", "x", 1], [C.LIST, ref],
                          [C.DICT, "r", ref]])
    with pytest.raises(ProtocolError, match="not a registered dataclass"):
        C.decode(body, [], C.Limits(), lambda w: seen.append(w))
    assert seen == [ref[1:], ref[1:]]


def body_channel_frames(rank: int) -> list[str]:
    """Messages sent whole come out whole and in order on the channel (``_channel``, over the
    backend's duplicate); a refused one (a body past the limit, an absurd announced array size
    whose data never comes) is reported with its envelope and nothing else, and the channel
    delivers what follows it."""
    import time

    import hpcdp
    from hpcdp.rpc._channel import HEAD_TAG, TAG, Channel
    from hpcdp.rpc._wire import pack_envelope, pack_prefix

    fails: list[str] = []
    lim = C.Limits(max_message_bytes=1 << 20, max_body_bytes=1 << 10)
    got: list[Any] = []
    ch = Channel(hpcdp.get_default_group(), lim, lambda src, f, _i: got.append((src, f)),
                 lambda *_a: None)
    arrays = [np.arange(5_000, dtype=np.float64), np.zeros(0, np.uint8), np.ones(3, np.int8)]
    if rank == 0:
        for i, (body, bufs) in enumerate([(b"b" * 10, []), (b"x" * 2_000, []),
                                          (b"", [a.view(np.uint8) for a in arrays]),
                                          (b"y" * 9_000, [])]):
            ch.send(1, pack_envelope([1, i]), body, [memoryview(b) for b in bufs])
        env = pack_envelope([1, 4])
        head = pack_prefix(env, b"", [1 << 62]) + TAG.pack(77) + env
        ch.be.send(np.frombuffer(head, np.uint8), 1, HEAD_TAG)
        ch.send(1, pack_envelope([1, 5]), b"after", [])
    hpcdp.barrier()
    if rank == 0:  # after the barrier: on MPI the larger sends complete only as rank 1 receives
        deadline = time.monotonic() + 30
        while ch._sends and time.monotonic() < deadline:
            ch.poll()
    if rank == 1:
        deadline = time.monotonic() + 30
        while (len(got) < 6 or [d for d in ch._discards if d[1] != 77]) and \
                time.monotonic() < deadline:
            ch.poll()  # (the refused body's data taken off the channel too; tag 77's never comes)
        if [s for s, _ in got] != [0] * 6:
            fails.append(f"{len(got)} messages, from {[s for s, _ in got]}")
        frames = [f for _, f in got]
        envs = [f.env for f in frames]
        if envs != [pack_envelope([1, i]) for i in range(6)]:
            fails.append(f"envelopes out of order or changed: {envs}")
        refused = [f.refused for f in frames]
        want = [None, "message body of 2000 bytes exceeds the limit of 1024", None,
                "message body of 9000 bytes exceeds the limit of 1024",
                f"message of {1 << 62} bytes exceeds the limit of {1 << 20}", None]
        if refused != want:
            fails.append(f"refused: {refused}")
        elif not (bytes(frames[0].body) == b"b" * 10 and frames[1].body is None and
                  frames[3].body is None and frames[4].buffers == [] and
                  bytes(frames[5].body) == b"after"):
            fails.append("bodies changed")
        elif [np.asarray(x).tobytes() for x in frames[2].buffers] != \
                [a.view(np.uint8).tobytes() for a in arrays]:
            fails.append("arrays changed")
    hpcdp.barrier()
    ch.close(True, 5.0)
    return fails


@pytest.mark.parametrize("world", worlds("sim-2", "tcp-2", "mpi"), indirect=True)
def test_channel_delivers_whole_messages_in_order(world) -> None:
    check(world.run(body_channel_frames))


def test_a_long_inline_callee_releases_the_rest_of_its_batch() -> None:
    """The MPI leader runs the short callees one poll found, in turn; when one runs long and
    its duty is handed off (by the agent's timer), the others go to the pool at once instead
    of waiting behind it."""
    from hpcdp.rpc._duty import Lent
    from hpcdp.rpc._pool import Pool

    blocked, release, quick = threading.Event(), threading.Event(), threading.Event()

    class Progress:
        pumpers = 0
        batches: list = []

        def parked(self) -> bool:
            return False

        def poll(self, tasks: list | None = None) -> bool:
            if self.batches and tasks is not None:
                tasks.extend(self.batches.pop())
                return True
            return False

        def idle_pause(self, idle: float, others: bool) -> None:
            time.sleep(1e-3)

    class Agent:
        rank = 0
        current = None

        def lent_started(self, lent) -> None:
            self.current = lent

        def lent_ended(self, lent, seconds: float) -> None:
            pool.end_inline()

        def requeue(self, lent) -> None:
            pool.submit(lent.fn, force=True)

    def slow() -> None:
        blocked.set()
        release.wait(20)

    agent, progress = Agent(), Progress()
    pool = agent.pool = Pool("test-pool", 4, 16, agent, progress)
    try:
        progress.batches.append([Lent(agent, slow, "slow"), Lent(agent, quick.set, "quick")])
        assert blocked.wait(20)
        agent.current.hand_off()  # what the agent's timer does to a callee past its grace
        assert quick.wait(20), "the rest of the batch waited for the long callee"
    finally:
        release.set()
        pool.close(5.0)


def test_rpc_reaches_backends_only_through_their_public_contract() -> None:
    """RPC sends over ``Backend.dup()``: no module of ``hpcdp.rpc`` imports a backend's
    private modules, a particular backend (``backends.tcp``, ``backends.mpi``), or any private
    module outside ``hpcdp.rpc``."""
    import ast
    import glob

    bad = []
    for path in sorted(glob.glob(os.path.join(ROOT, "hpcdp", "rpc", "*.py"))):
        with open(path) as fh:
            tree = parse_source(fh.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level >= 2 and node.module:
                parts = node.module.split(".")
                names = [a.name for a in node.names]
                if parts[0] == "backends" and (len(parts) > 2 or parts[1:] != ["base"]) or \
                        any(p.startswith("_") and p not in ("_config", "_arrays") for p in parts) \
                        or parts[0] == "backends" and any(n.startswith("_") for n in names):
                    bad.append(f"{os.path.basename(path)}:{node.lineno}: from "
                               f"{'.' * node.level}{node.module} import {', '.join(names)}")
    assert not bad, bad

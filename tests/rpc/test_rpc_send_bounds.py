"""RPC's channel never waits without a bound, and never allocates what a peer only announced.

- a large send waiting for its window (bytes in flight to one peer, ``_channel.WINDOW``) gives
  up at its call's deadline with ``CommTimeoutError`` naming the ranks, and a peer that left
  meanwhile fails the send instead of taking it;
- a message ``probe`` reported whose receive does not complete is abandoned (left posted, it
  would take the next message in its place) and its sender treated as failed;
- a TCP peer that stops reading (SIGSTOP) blocks only the caller that writes to it, for the
  channel's send bound, then fails as ``PeerFailureError``: calls to the other peers go on and
  ``rpc.shutdown`` returns;
- on TCP, a forged head of megabytes is drained by the transport, never stored nor copied.

The first two run the channel over a stub backend whose requests never complete (MPI's large
sends to a callee that does not receive, a receive that never finishes), so each outcome is
deterministic.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
import tracemalloc
from typing import Any

import numpy as np
import pytest

import hpcdp
from hpcdp import rpc
from hpcdp.errors import CommTimeoutError, HpcdpError, PeerFailureError
from hpcdp.rpc import _channel
from hpcdp.rpc._channel import HEAD_TAG, Channel
from hpcdp.rpc._codec import Limits
from hpcdp.rpc._wire import pack_envelope
from hpcdp.testing import check
from hpcdp.testing.fixtures import worlds
from tcp_helpers import stopped


class _Req:
    def __init__(self, done: bool) -> None:
        self.done, self.abandoned = done, False

    def test(self) -> bool:
        return self.done

    def wait(self, timeout: float | None) -> bool:
        if not self.done:
            time.sleep(min(timeout or 0.0, 0.01))
        return self.done

    def abandon(self) -> bool:
        self.abandoned = True
        return False


class _Stub:
    """Two ranks' point-to-point as the channel sees it: sends of more than 64 KiB complete
    only when received (never, here), receives complete only if ``recv_completes``."""

    name, thread_level, max_tag = "stub", "multiple", 2**31 - 1
    shares_process = recv_size_checked = needs_progress_thread = False

    def __init__(self) -> None:
        self.rank, self.size = 0, 2
        self.sent: list[tuple[int, int, int]] = []
        self.recvs: list[_Req] = []
        self.probes: list[tuple[int, int, int]] = []
        self.recv_completes = False
        self.caps: dict[Any, int] = {}

    def dup(self) -> "_Stub":
        return self

    def cap_unposted(self, nbytes: int, tag: int | None = None) -> None:
        self.caps[tag] = nbytes

    def bound_sends(self, seconds: float) -> None:
        self.bound = seconds

    def send(self, buf: np.ndarray, dst: int, tag: int) -> _Req:
        self.sent.append((dst, tag, buf.nbytes))
        return _Req(buf.nbytes <= 64 << 10)

    def recv(self, buf: np.ndarray, src: int, tag: int) -> _Req:
        req = _Req(self.recv_completes)
        self.recvs.append(req)
        return req

    def probe(self, src: int, tag: int) -> tuple[int, int, int] | None:
        for i, (s, t, n) in enumerate(self.probes):
            if tag in (t, -1) and src in (s, -1):
                return self.probes.pop(i)
        return None

    def take(self, src: int, tag: int) -> None:
        return None

    def peers_gone(self) -> dict[int, str]:
        return {}

    def shutdown(self) -> None:
        pass


class _Group:
    def __init__(self, be: _Stub) -> None:
        self.rank, self.size, self.backend = be.rank, be.size, be


def _channel_over(be: _Stub, lost: list) -> Channel:
    return Channel(_Group(be), Limits(), lambda *_a: None,
                   lambda peer, why, graceful: lost.append((peer, why, graceful)))


def test_send_window_wait_ends_at_the_call_deadline(monkeypatch) -> None:
    monkeypatch.setattr(_channel, "WINDOW", 1 << 20)
    be, lost = _Stub(), []
    ch = _channel_over(be, lost)
    big = [memoryview(np.zeros(768 << 10, np.uint8))]
    env = pack_envelope([1, 1])
    ch.send(1, env, b"", big, time.monotonic() + 5)  # in flight for good: never received
    t0 = time.monotonic()
    with pytest.raises(CommTimeoutError, match=r"rank 0 to rank 1: .*window.*rank 1 has not "
                                               r"received 786432 bytes"):
        ch.send(1, env, b"", big, time.monotonic() + 0.3)
    assert 0.25 <= time.monotonic() - t0 < 3.0
    assert len(be.sent) == 2  # the head and data of the first message only

    # the peer leaves while a sender waits for its window: the send fails, nothing is posted
    threading.Timer(0.2, lambda: ch._gone(1, "it left", False)).start()
    with pytest.raises(PeerFailureError, match="rank 0 to rank 1: it left"):
        ch.send(1, env, b"", big, time.monotonic() + 10)
    assert len(be.sent) == 2 and lost == [(1, "it left", False)]
    ch.close(False, 0.1)


def test_receive_of_a_probed_message_that_never_completes_fails_its_sender(monkeypatch) -> None:
    monkeypatch.setattr(_channel, "_RECV_WAIT", 0.1, raising=False)
    be, lost = _Stub(), []
    ch = _channel_over(be, lost)
    be.probes.append((1, HEAD_TAG, 64))
    ch.poll()
    assert len(be.recvs) == 1 and be.recvs[0].abandoned, "the stuck receive was left posted"
    assert [(p, g) for p, _w, g in lost] == [(1, False)] and 1 in ch.gone
    assert "was not received within 0.1 s" in ch.gone[1]
    with pytest.raises(PeerFailureError, match="rank 0 to rank 1: a head it sent"):
        ch.send(1, pack_envelope([1, 2]), b"x", [])

    # the data of a refused message, taken into the scratch buffer: the same
    be2, lost2 = _Stub(), []
    ch2 = _channel_over(be2, lost2)
    scratch = ch2._scratch
    ch2._add_discard(1, 99, 2)
    be2.probes.append((1, 99, 100))
    ch2.poll()
    assert len(be2.recvs) == 1 and be2.recvs[0].abandoned
    assert 1 in ch2.gone and ch2._scratch is not scratch  # the old one may still be written
    assert not ch2._discards
    ch.close(False, 0.1)
    ch2.close(False, 0.1)


def test_head_cap_is_set_per_tag() -> None:
    """The channel caps what its duplicate may store unasked: heads at the largest head a
    message can have, other tags at a chunk (or the message limit)."""
    be = _Stub()
    lim = Limits(max_message_bytes=8 << 20)
    ch = Channel(_Group(be), lim, lambda *_a: None, lambda *_a: None)
    assert be.caps == {None: 8 << 20, HEAD_TAG: ch._max_head}
    assert ch._max_head < 64 << 10
    ch.close(False, 0.1)


# -- TCP: a forged head is never stored -----------------------------------------------------
def body_forged_head_allocates_nothing(rank: int) -> list[str]:
    """Rank 1 sends rank 0's channel an 8 MiB head (a head is 40 KiB at most), then a real
    message: rank 0 delivers the real one without ever holding memory of the forged size."""
    fails: list[str] = []
    got: list[Any] = []
    ch = Channel(hpcdp.get_default_group(), Limits(), lambda src, f, _i: got.append(f),
                 lambda *_a: None)
    hpcdp.barrier()
    if rank == 1:
        ch.be.send(np.full(8 << 20, 7, np.uint8), 0, HEAD_TAG).wait(30)
        ch.send(0, pack_envelope([1, 1]), b"after", [])
    elif rank == 0:
        tracemalloc.start()
        try:
            deadline = time.monotonic() + 30
            while not got and time.monotonic() < deadline:
                ch.poll()
                time.sleep(1e-3)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        if [bytes(f.body) for f in got] != [b"after"]:
            fails.append(f"delivered {[(f.env, f.refused) for f in got]}")
        if peak > 2 << 20:
            fails.append(f"receiving an 8 MiB forged head took {peak} bytes at its peak")
    hpcdp.barrier()
    ch.close(True, 5.0)
    return fails


@pytest.mark.parametrize("world", worlds("tcp-2"), indirect=True)
def test_forged_head_is_drained_not_stored(world) -> None:
    check(world.run(body_forged_head_allocates_nothing))


# -- TCP: a callee that stops reading ----------------------------------------------------------
@rpc.register
def bounds_echo(x: Any) -> Any:
    return x


def body_stopped_callee(rank: int, out: str) -> str:
    """Rank 2 stops (SIGSTOP) for good. Rank 0 sends it 64 MiB (its socket fills, the write
    blocks on the caller's thread) while another thread calls rank 1: those calls go on, the
    blocked call fails with PeerFailureError after the channel's send bound, and a
    non-graceful shutdown returns."""
    _channel._MIN_SEND_BOUND = 1.0  # bound: max(this, rpc_timeout)
    pids = hpcdp.all_gather_object(os.getpid())
    rpc.init_rpc(f"w{rank}", rpc_timeout=1.5)  # the bound; calls below name their own timeouts
    hpcdp.barrier()
    if rank == 2:
        os.kill(os.getpid(), signal.SIGSTOP)
        return "resumed"
    res: dict[str, Any] = {}
    if rank == 0:
        # rank 2 has stopped: waited for (its state in /proc), not assumed after a fixed 0.3 s
        deadline = time.monotonic() + 30
        while not stopped(pids[2]) and time.monotonic() < deadline:
            time.sleep(0.01)
        big = np.ones(64 << 20, np.uint8)

        def stuck() -> None:
            t0 = time.monotonic()
            try:
                rpc.rpc_sync("w2", bounds_echo, args=(big,), timeout=60)
                res["big"] = "returned"
            except Exception as exc:  # noqa: BLE001 - reported to the test
                res["big"] = f"{type(exc).__name__}: {exc}"
            res["big_s"] = time.monotonic() - t0

        th = threading.Thread(target=stuck, daemon=True)
        th.start()
        time.sleep(0.5)
        ok = 0
        t0 = time.monotonic()
        for i in range(5):
            box: dict = {}
            c = threading.Thread(target=lambda: box.update(
                v=rpc.rpc_sync("w1", bounds_echo, args=(i,), timeout=4)), daemon=True)
            c.start()
            c.join(5)
            ok += box.get("v") == i
        res["others_ok"], res["others_s"] = ok, time.monotonic() - t0
        th.join(20)
        res["big_done"] = not th.is_alive()
        with open(out, "w") as f:
            json.dump(res, f)
    else:  # rank 1 serves until rank 0 is done
        deadline = time.monotonic() + 60
        while not os.path.exists(out) and time.monotonic() < deadline:
            time.sleep(0.05)
    t0 = time.monotonic()
    done = threading.Event()
    threading.Thread(target=lambda: (rpc.shutdown(graceful=False), done.set()),
                     daemon=True).start()
    res["shutdown"] = done.wait(30)
    res["shutdown_s"] = time.monotonic() - t0
    with open(f"{out}.{rank}", "w") as f:
        json.dump(res, f)
    if rank == 0:
        os.kill(pids[2], signal.SIGKILL)  # the stopped rank ends here, not at join_timeout
    return "done"


@pytest.mark.timeout(240)
def test_callee_that_stops_reading_blocks_only_its_caller(tmp_path) -> None:
    out = str(tmp_path / "rank0.json")
    with pytest.raises(HpcdpError, match=r"rank\(?s?\)? \[?2"):  # killed by rank 0 (or spawn)
        hpcdp.spawn(body_stopped_callee, 3, backend="tcp", args=(out,), timeout=60,
                    join_timeout=90)
    with open(out) as f:
        res = json.load(f)
    assert res["others_ok"] == 5, res  # calls to rank 1 went on while a write was blocked
    assert res["others_s"] < 20, res
    assert res["big_done"], res
    assert res["big"].startswith("PeerFailureError") and "rank 2" in res["big"] and \
        "stopped reading" in res["big"] and "rpc_sync" in res["big"], res
    assert res["big_s"] < 20, res
    with open(f"{out}.0") as f:
        end = json.load(f)
    assert end["shutdown"] and end["shutdown_s"] < 10, end

"""TCP sends that a peer never reads, and unexpected messages past a tag's cap.

- ``bound_sends``: a write on a bounded channel to a peer that takes no byte for the bound
  fails that peer (``PeerFailureError`` naming the send and the peer, "stopped reading")
  instead of blocking its thread for good; a send queued behind it ends too (no deadlock
  between the failing writer and the sender thread).
- ``cap_unposted(nbytes, tag)``: an unexpected message past its tag's cap is drained without
  memory of its size, while other tags keep the channel's cap.

The transport is driven over a real socket whose other end is read (or not) by hand.
"""
from __future__ import annotations

import select
import socket
import threading
import time
import tracemalloc
from typing import Iterator

import numpy as np
import pytest

from hpcdp.backends.tcp import _wire as wire
from hpcdp.backends.tcp._backend import TCPBackend
from hpcdp.backends.tcp._frames import P2P
from hpcdp.backends.tcp._transport import Transport
from tcp_helpers import raw_peer_transport
from hpcdp.errors import PeerFailureError

CH, OTHER = 5, 6


@pytest.fixture
def pair() -> Iterator[tuple[Transport, socket.socket]]:
    """A transport of rank 0 whose peer 1 is ``raw`` (read only where a test does)."""
    with raw_peer_transport(park_receiver=False, flush_timeout=0.5) as got:
        yield got


class _Group:
    """``TCPBackend``'s methods under test need only its transport and channel."""

    def __init__(self, t: Transport, channel: int) -> None:
        self.transport, self.channel = t, channel


def test_send_to_a_peer_that_stops_reading_fails_it_at_the_bound(pair) -> None:
    t, raw = pair
    TCPBackend.bound_sends(_Group(t, CH), 0.5)  # type: ignore[arg-type]
    big = np.zeros(32 << 20, np.uint8)  # far more than the socket buffers hold
    out: dict = {}

    def send(key: str, buf: np.ndarray, channel: int) -> None:
        t0 = time.monotonic()
        out[key] = t.isend(buf, 1, P2P, channel, 7, f"send to rank 1 tag 7 ({key})")
        out[key + "_s"] = time.monotonic() - t0

    first = threading.Thread(target=send, args=("big", big, CH), daemon=True)
    first.start()
    # the big write has begun (its thread holds the socket, and rank 1 has bytes of it): the
    # second send queues behind it. Waited for, not slept on: under load the first thread
    # started later than a fixed 0.2 s, the small send went first and succeeded
    poller = select.poll()
    poller.register(raw, select.POLLIN)
    deadline = time.monotonic() + 10
    while (not (t.peers[1].send_lock.locked() and poller.poll(0)) and first.is_alive()
           and time.monotonic() < deadline):
        time.sleep(1e-3)
    second = threading.Thread(target=send, args=("small", np.ones(16, np.uint8), OTHER),
                              daemon=True)
    second.start()
    first.join(15)
    second.join(15)
    assert not first.is_alive(), "a send to a peer that reads nothing blocked past its bound"
    assert not second.is_alive(), "a send queued behind the stalled one never returned"
    assert 0.4 <= out["big_s"] < 5.0, out
    with pytest.raises(PeerFailureError, match=r"send to rank 1 tag 7 \(big\): rank 1 stopped "
                                               r"reading: it took no byte .* \(send limit 0.5 s\)"):
        out["big"].wait(5.0)
    with pytest.raises(PeerFailureError, match="rank 1 stopped reading"):
        out["small"].wait(5.0)
    assert 1 in t.dead and "stopped reading" in t.dead[1]
    raw.settimeout(5.0)
    while raw.recv(1 << 20):  # the connection was shut: the peer, when it reads, sees the cut
        pass


def test_bound_is_per_channel_and_fast_sends_unchanged(pair) -> None:
    """A channel without a bound waits as long as it takes (a peer that reads late gets the
    whole message); the bound sets the sockets' SO_SNDTIMEO, cleared with the channel."""
    t, raw = pair
    TCPBackend.bound_sends(_Group(t, CH), 0.3)  # type: ignore[arg-type]
    data = np.arange(8 << 20, dtype=np.uint8)
    got = bytearray()

    frames = -(-data.nbytes // t.cap)  # the message goes as frames of at most ``cap`` bytes

    def late_reader() -> None:
        time.sleep(1.5)  # several times the other channel's bound without reading
        need = frames * wire.HEADER.size + data.nbytes
        while len(got) < need:
            chunk = raw.recv(1 << 20)
            if not chunk:
                break
            got.extend(chunk)

    th = threading.Thread(target=late_reader, daemon=True)
    th.start()
    req = t.isend(data, 1, P2P, OTHER, 3, "send to rank 1 tag 3")
    assert req.wait(10.0)
    th.join(10)
    step = wire.HEADER.size + t.cap
    payload = b"".join(bytes(got[i + wire.HEADER.size:i + step]) for i in range(0, len(got), step))
    assert payload == data.tobytes()
    assert 1 not in t.dead
    t.close_channel(CH)
    assert t.peers[1].sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, 16) == bytes(16)


def test_unexpected_message_past_its_tags_cap_is_drained_without_its_memory(pair) -> None:
    t, raw = pair
    g = _Group(t, CH)
    TCPBackend.cap_unposted(g, 1 << 20)  # type: ignore[arg-type]
    TCPBackend.cap_unposted(g, 4096, tag=1)  # type: ignore[arg-type]
    payload = bytes(512 << 10)
    frame = wire.pack_header(P2P, 0, CH, 1, len(payload)) + payload
    tracemalloc.start()
    try:
        raw.sendall(frame)
        raw.sendall(wire.pack_header(P2P, 0, CH, 1, 100) + b"h" * 100)
        deadline = time.monotonic() + 10
        while t.probe([1], CH, 1) is None and time.monotonic() < deadline:
            time.sleep(1e-3)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert t.probe([1], CH, 1) == (1, 1, 100)  # the oversized one was never reported
    assert peak < 256 << 10, f"a dropped 512 KiB message took {peak} bytes"
    raw.sendall(wire.pack_header(P2P, 0, CH, 2, len(payload)) + payload)
    deadline = time.monotonic() + 10
    while t.probe([1], CH, 2) is None and time.monotonic() < deadline:
        time.sleep(1e-3)
    assert t.probe([1], CH, 2) == (1, 2, len(payload))  # other tags: the channel's cap
    t.close_channel(CH)
    assert not t.unposted_tag_caps

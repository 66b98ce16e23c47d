"""TCP point-to-point as ``hpcdp.rpc`` uses it on a ``dup()``: ``probe`` reads no further than the
message it reports, so data that follows stays on the socket until a receive is posted for it
(it then lands in that buffer, not in the unexpected queue); ``take`` hands over a message that
did arrive first as the buffer the reader filled, without a copy; what the channel's cap
dropped is neither reported nor handed over.

The transport is driven over a real socket whose other end writes frames by hand, with the
peer's background receiver kept aside (``linger_until``, as after a direct read), so what
each call reads is deterministic.
"""
from __future__ import annotations

import select
import socket
import time
from typing import Iterator

import numpy as np
import pytest

from hpcdp.backends.base import ANY_TAG
from hpcdp.backends.tcp import _wire as wire
from hpcdp.backends.tcp._frames import P2P
from hpcdp.backends.tcp._transport import Transport
from tcp_helpers import raw_peer_transport

CH = 5


@pytest.fixture
def pair() -> Iterator[tuple[Transport, socket.socket]]:
    """A transport of rank 0 whose peer 1 is ``raw``, the background receiver parked."""
    with raw_peer_transport(park_receiver=True, flush_timeout=1.0) as got:
        yield got


def _send(raw: socket.socket, tag: int, payload: bytes) -> None:
    raw.sendall(wire.pack_header(P2P, 0, CH, tag, len(payload)) + payload)


def _wait_readable(t: Transport) -> None:
    p = select.poll()
    p.register(t.peers[1].sock, select.POLLIN)
    assert p.poll(10_000), "nothing arrived"


def _probe(t: Transport, tag: int, deadline: float = 10.0) -> tuple[int, int, int]:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        found = t.probe([1], CH, tag)
        if found is not None:
            return found
        time.sleep(1e-3)
    raise AssertionError(f"probe found no message with tag {tag}")


def test_probe_leaves_the_data_after_its_match_on_the_socket(pair) -> None:
    """A head, then its data, both arrived: probing for the head reads the head only, so the
    receive posted next gets the data straight into its buffer."""
    t, raw = pair
    data = np.arange(48 << 10, dtype=np.uint8).tobytes()  # fits the socket buffers
    _send(raw, 1, b"h" * 32)
    _send(raw, 2, data)
    _wait_readable(t)
    time.sleep(0.05)  # both frames are in this rank's socket buffer
    assert _probe(t, 1) == (1, 1, 32)
    assert (1, P2P, CH, 2) not in t.unexpected  # still on the socket (or its read-ahead)
    buf = np.zeros(len(data), np.uint8)
    rq = t.irecv(buf, 1, P2P, CH, 2, "data")
    assert rq.wait(10.0)
    assert buf.tobytes() == data
    assert (1, P2P, CH, 2) not in t.unexpected
    head = np.zeros(32, np.uint8)
    assert t.irecv(head, 1, P2P, CH, 1, "head").wait(10.0)
    assert head.tobytes() == b"h" * 32
    assert not t.unexpected


def test_take_hands_over_the_received_buffer(pair) -> None:
    t, raw = pair
    data = np.random.default_rng(0).integers(0, 256, 256 << 10, dtype=np.uint8)
    _send(raw, 7, data.tobytes())
    assert _probe(t, ANY_TAG) == (1, 7, data.nbytes)
    stored = t.unexpected[(1, P2P, CH, 7)][0][0]
    got = t.take(1, CH, 7)
    assert got is not None and got.dtype == np.uint8 and got.nbytes == data.nbytes
    assert got.flags.writeable
    np.testing.assert_array_equal(got, data)
    stored[0] ^= 0xFF  # the reader's own buffer: no second copy
    assert got[0] == data[0] ^ 0xFF
    assert t.probe([1], CH, ANY_TAG) is None
    assert t.take(1, CH, 7) is None  # taken once


def test_take_and_probe_never_see_what_the_cap_dropped(pair) -> None:
    """A message larger than the channel's ``cap_unposted`` that arrives before its receive is
    drained, not stored: it is never reported nor handed over; the next one is."""
    t, raw = pair
    t.unposted_caps[CH] = 64 << 10
    _send(raw, 7, bytes(128 << 10))
    _send(raw, 8, b"x" * 1000)
    assert _probe(t, ANY_TAG) == (1, 8, 1000)
    assert t.take(1, CH, 7) is None
    got = t.take(1, CH, 8)
    assert got is not None and got.tobytes() == b"x" * 1000


def test_a_ping_pong_keeps_the_socket_through_its_sends() -> None:
    """A thread that read its peer's socket itself and then sends the peer a large message (a
    ping-pong) keeps the background receiver parked through the send, so the reply is read
    on this thread too rather than handed over (B1's large ping-pong). A send from a thread
    that was not reading extends nothing."""
    import threading

    from hpcdp.backends.tcp._transport import LINGER

    with raw_peer_transport(park_receiver=False) as (t, raw):
        peer = t.peers[1]
        big = np.ones(8 << 20, np.uint8)

        def slow_reader() -> None:
            time.sleep(0.05)  # the send blocks well past LINGER on full socket buffers
            got, view = 0, memoryview(bytearray(wire.HEADER.size + big.nbytes))
            while got < len(view):
                got += raw.recv_into(view[got:])

        assert peer.linger_until == 0.0
        reader = threading.Thread(target=slow_reader)
        reader.start()
        assert t.isend(big, 1, P2P, CH, 9, "big send").wait(10.0)
        reader.join(10.0)
        assert peer.linger_until == 0.0  # nobody was reading directly: nothing to extend

        # The ping-pong: a direct read, then the send. The send extends the linger only if it
        # starts within LINGER (2 ms) of the read, which a loaded machine can miss (this thread
        # off the CPU between two lines): ``_write`` notes whether the read's linger was still
        # on when the send began, and an attempt where it was not is tried again; where it was,
        # the extension is checked.
        whole, on_at_send = t._write, []

        def noting_write(p, hdr, view) -> None:
            on_at_send.append(p.linger_until > time.monotonic())
            whole(p, hdr, view)

        t._write = noting_write
        go = threading.Event()

        def reader_after_go() -> None:
            go.wait(30)
            slow_reader()

        for _attempt in range(10):
            # The background receiver must not take the next message before the receive is
            # posted (under load it did, and nothing was read on this thread): keep it parked,
            # as a recent direct read would, until a moment after; the direct read then sets
            # its own. (The moment is long: the receive must be posted within it, and on a
            # loaded machine this thread can be off the CPU for a second between two lines.)
            go.clear()
            del on_at_send[:]
            reader = threading.Thread(target=reader_after_go)
            reader.start()  # before the read: starting a thread waits for it to be scheduled
            parked = peer.linger_until = time.monotonic() + 30.0
            _send(raw, 1, b"x" * 16)
            head = np.zeros(16, np.uint8)
            assert t.irecv(head, 1, P2P, CH, 1, "head").wait(10.0)  # read on this thread
            read_until = peer.linger_until
            go.set()
            t0 = time.monotonic()
            assert t.isend(big, 1, P2P, CH, 9, "big send").wait(10.0)
            took = time.monotonic() - t0
            reader.join(10.0)
            assert 0.0 < read_until < parked  # (set by the direct read: now + LINGER)
            assert on_at_send, "the send wrote nothing"
            if on_at_send[0]:
                break
        else:
            pytest.fail("no send began within LINGER of its direct read in 10 attempts")
        assert took > LINGER, took  # (else this test would show nothing)
        # extended from the send's end, not left at the direct read's end + LINGER
        assert peer.linger_until > t0 + LINGER, (peer.linger_until - t0, took)

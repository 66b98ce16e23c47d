"""The rendezvous store: survives floods and fd exhaustion, never hangs a client, never lets
an odd timeout kill a store thread."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from hpcdp.backends.tcp import _accept as accept
from hpcdp.backends.tcp import _store as store
from hpcdp.backends.tcp import _wire as wire
from hpcdp.backends.tcp._store import StoreClient, StoreServer
from hpcdp.errors import CommTimeoutError, PeerFailureError
from tcp_helpers import closed_by_server

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SECRET = b"k" * 32


@pytest.fixture
def server():
    srv = StoreServer("127.0.0.1", 0, SECRET)
    try:
        yield srv
    finally:
        srv.close()


def _client(srv: StoreServer, timeout: float = 5.0) -> StoreClient:
    return StoreClient("127.0.0.1", srv.address[1], SECRET, 1, timeout=timeout)


def test_set_get_and_missing_key(server) -> None:
    c = _client(server)
    try:
        c.set("a", b"1")
        assert c.get("a", 1.0) == b"1"
        with pytest.raises(CommTimeoutError, match="'b' was not published"):
            c.get("b", 0.1)
        assert c.get("a", 0.0) == b"1"  # the connection is still usable
    finally:
        c.close()


@pytest.mark.parametrize("timeout", [float("inf"), 1e300, float("nan"), -1.0])
def test_odd_get_timeouts_are_clamped(server, timeout: float, log) -> None:
    """``inf`` used to raise OverflowError in the store thread; now it waits (in bounded
    requests), and NaN or negative timeouts just look."""
    c, other = _client(server), _client(server)
    try:
        if timeout > 0:
            timer = threading.Timer(0.2, other.set, args=("late", b"v"))
            timer.start()
            assert c.get("late", timeout) == b"v"
            timer.join()
        else:
            with pytest.raises(CommTimeoutError):
                c.get("never", timeout)
        c.set("x", b"1")  # the store thread of this connection is alive
        assert c.get("x", 1.0) == b"1"
    finally:
        c.close()
        other.close()
    assert not [m for m in log if "dropped" in m], log


def test_server_clamps_a_raw_infinite_wait(server, monkeypatch) -> None:
    """A client asking the server itself for an endless wait gets MISSING after ``MAX_WAIT``."""
    monkeypatch.setattr(store, "MAX_WAIT", 0.2)
    c = _client(server)
    try:
        kind, _ = c._request(store.GET, "nope", store._TIMEOUT.pack(float("inf")), 5.0)
        assert kind == store.MISSING
    finally:
        c.close()


def test_request_to_a_silent_store_times_out() -> None:
    """Rank 0's node vanished without a reset: the request raises, naming store and key."""
    lsock = socket.create_server(("127.0.0.1", 0))
    held = []

    def fake_store() -> None:  # authenticates, then never answers
        conn, _ = lsock.accept()
        wire.server_handshake(conn, SECRET, wire.ROLE_STORE, wire.STORE_ID, 5.0)
        held.append(conn)

    threading.Thread(target=fake_store, daemon=True).start()
    port = lsock.getsockname()[1]
    c = StoreClient("127.0.0.1", port, SECRET, 3, timeout=1.0)
    t0 = time.monotonic()
    with pytest.raises(CommTimeoutError, match=rf"store at 127.0.0.1:{port}.*'addr/1'"):
        c.get("addr/1", 0.5)
    assert time.monotonic() - t0 < 20
    with pytest.raises(PeerFailureError, match="unusable"):
        c.set("x", b"1")
    c.close()
    for s in held + [lsock]:
        s.close()


def test_store_that_dies_mid_request_is_a_peer_failure(server) -> None:
    c = _client(server)
    try:
        threading.Timer(0.2, server.close).start()
        with pytest.raises(PeerFailureError, match="store at 127.0.0.1.*lost the connection"):
            c.get("never", 30.0)
    finally:
        c.close()


def test_silent_connections_cannot_keep_a_client_out(server, monkeypatch) -> None:
    """Past the per-address cap each newcomer evicts the oldest silent connection, so a real
    client gets in while silent ones fill every slot (long before any of them times out)."""
    monkeypatch.setenv("HPCDP_HANDSHAKE_TIMEOUT", "60")
    monkeypatch.setattr(wire, "HELLO_TIMEOUT", 60.0)  # nothing leaves by its deadline here
    n = accept.PER_SOURCE + 20
    socks = [socket.create_connection(server.address) for _ in range(n)]
    try:
        evicted = sum(closed_by_server(s, 0.5) for s in socks[:20])
        assert evicted >= 20 - 2  # the oldest, give or take one the loop has not reached yet
        assert not any(closed_by_server(s, 0.01) for s in socks[-5:])  # the newest are held
        c = _client(server, timeout=10.0)
        c.set("a", b"1")
        assert c.get("a", 1.0) == b"1"
        c.close()
    finally:
        for s in socks:
            s.close()


def test_a_slow_hello_is_dropped_at_its_deadline(server, monkeypatch) -> None:
    """A client sending its HELLO a byte at a time is cut off at the HELLO deadline, even with a
    long handshake timeout; a real client's HELLO arrives at once."""
    monkeypatch.setenv("HPCDP_HANDSHAKE_TIMEOUT", "60")
    monkeypatch.setattr(wire, "HELLO_TIMEOUT", 0.5)
    s = socket.create_connection(server.address)
    try:
        dropped = False
        for _ in range(40):  # 1 byte per 0.1 s: the HELLO (48 bytes) would take 4.8 s
            try:
                s.sendall(b"H")
            except OSError:
                dropped = True
                break
            if closed_by_server(s, 0.1):
                dropped = True
                break
        assert dropped
    finally:
        s.close()


def test_rejections_are_rate_limited(server, log) -> None:
    for _ in range(50):
        s = socket.create_connection(server.address)
        s.sendall(os.urandom(wire.HELLO_SIZE))
        closed_by_server(s, 5.0)
        s.close()
    deadline = time.monotonic() + 5
    while len(server._conns) and time.monotonic() < deadline:
        time.sleep(0.01)
    dropped = [m for m in log if "dropped connection" in m]
    assert 1 <= len(dropped) <= 2, log
    server.close()
    summarized = [int(re.search(r"(\d+) more connection", m).group(1)) for m in log
                  if "more connection(s) rejected" in m]
    assert summarized and len(dropped) + sum(summarized) == 50, log  # every rejection counted


EMFILE = """
    import logging, os, resource, socket, time
    from hpcdp.backends.tcp._store import StoreClient, StoreServer
    srv = StoreServer("127.0.0.1", 0, b"k" * 32)
    port = srv.address[1]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 40, hard))
    socks = []
    for _ in range(30):  # silent clients: both ends use fds here, so accept() hits EMFILE
        try:
            socks.append(socket.create_connection(("127.0.0.1", port)))
        except OSError:
            break
    time.sleep(0.5)
    for s in socks:
        s.close()
    time.sleep(0.3)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    c = StoreClient("127.0.0.1", port, b"k" * 32, 1, timeout=10)
    c.set("a", b"1")
    print("store alive", c.get("a", 1.0))
"""


def test_store_survives_fd_exhaustion() -> None:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               HPCDP_HANDSHAKE_TIMEOUT="1")
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(EMFILE)], env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "store alive b'1'" in res.stdout

"""A rank's peer listener faces the network like the store: a flood of silent connections costs
no thread, is closed in bounded time with a rate-limited log, neither a running job nor the
rendezvous stops, and an authenticated peer that announces an oversized frame is dropped."""
from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

import hpcdp
from hpcdp.backends.tcp import _accept as accept
from hpcdp.backends.tcp import _wire as wire
from hpcdp.launch._processes import free_port
from hpcdp.backends.tcp._store import StoreClient
from hpcdp.backends.tcp._transport import COLL
from hpcdp.backends.tcp import TCPBackend, _World
from tcp_helpers import (checked_allreduce_job, closed_by_server, published_port, raw_peer_transport,
                         start_job)

SECRET = "listener-test-secret"
#: more than one address may hold: the oldest are evicted as the newest come in
FLOOD = accept.PER_SOURCE + 100


@pytest.mark.timeout(120)
def test_flood_of_silent_connections_does_not_stop_the_job(tmp_path) -> None:
    port = free_port()
    # a long handshake timeout: silent connections must go at the short HELLO deadline
    env = {"MASTER_PORT": str(port), "HPCDP_SECRET": SECRET, "HPCDP_HANDSHAKE_TIMEOUT": "60"}
    t, out = start_job(checked_allreduce_job, 2, (str(tmp_path), 20_000, 0.002), env)
    socks: list[socket.socket] = []
    try:
        peer_port = published_port(str(tmp_path), 1, t, out)
        socks = [socket.create_connection(("127.0.0.1", peer_port)) for _ in range(FLOOD)]
        # past the per-address cap each newcomer evicts the oldest: the first ones go at once
        evicted = sum(closed_by_server(s, 0.5) for s in socks[:FLOOD - accept.PER_SOURCE])
        assert evicted >= FLOOD - accept.PER_SOURCE - 2
        # the rest at the HELLO deadline (2 s), long before the 60 s handshake timeout
        assert all(closed_by_server(s, 10.0) for s in socks[FLOOD - accept.PER_SOURCE:])
        time.sleep(0.2)  # the job goes on after the flood
    finally:
        for s in socks:
            s.close()
        (tmp_path / "stop").write_text("")
        t.join(60)
    assert not t.is_alive(), "job hung"
    assert "err" not in out, out.get("err")
    r0, r1 = out["res"]
    assert r0["bad"] == 0 and r1["bad"] == 0 and r0["n"] > 0 and r1["n"] > 0
    # no thread per flooding connection (FLOOD of them): one thread serves every handshake
    assert r1["peak"] <= r1["base"] + 4, r1
    dropped = [m for m in r1["log"] if "dropped connection" in m]
    assert 1 <= len(dropped) <= 3, r1["log"]  # rate-limited: FLOOD rejections, a few lines


@pytest.mark.timeout(120)
def test_rendezvous_survives_a_flood_on_a_listener(monkeypatch, log) -> None:
    """Rank 1's listener is saturated by silent connections the moment it publishes its address:
    rank 0's connection evicts the oldest of them and the mesh forms."""
    monkeypatch.setenv("HPCDP_HANDSHAKE_TIMEOUT", "3")
    monkeypatch.delenv("HPCDP_BIND_ADDR", raising=False)
    port = free_port()
    flood: list[socket.socket] = []
    real_set = StoreClient.set

    def set_after_flood(self: StoreClient, key: str, value: bytes) -> None:
        if key.endswith("addr/1"):
            host, p = value.decode().rsplit(":", 1)
            flood.extend(socket.create_connection((host, int(p))) for _ in range(FLOOD))
            for s in flood[:FLOOD - accept.PER_SOURCE]:
                closed_by_server(s, 2.0)  # the per-address cap is reached now
        real_set(self, key, value)

    monkeypatch.setattr(StoreClient, "set", set_after_flood)
    worlds: dict = {}

    def start(rank: int) -> None:
        try:
            worlds[rank] = _World(rank, 2, "127.0.0.1", port, SECRET.encode(), 20.0)
        except BaseException as exc:  # noqa: BLE001
            worlds[rank] = exc

    threads = [threading.Thread(target=start, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    try:
        assert not any(t.is_alive() for t in threads), "rendezvous hung"
        assert all(isinstance(w, _World) for w in worlds.values()), worlds
        assert any("unauthenticated connections from this address" in m for m in log), log
        b0 = TCPBackend(worlds[0], (0, 1), 0)
        b1 = TCPBackend(worlds[1], (0, 1), 0)
        got = np.zeros(4)
        rq = b1.recv(got, 0, 5)
        b0.send(np.arange(4.0), 1, 5).wait(5.0)
        assert rq.wait(5.0) and np.array_equal(got, np.arange(4.0))
    finally:
        for s in flood:
            s.close()
        for w in worlds.values():
            if isinstance(w, _World):
                w.close()


def test_authenticated_peer_announcing_a_huge_frame_is_dropped(log) -> None:
    """Past the handshake, a frame header claiming 2**40 bytes fails that peer (nothing is
    allocated) and is logged once; the receive waiting on it raises ``PeerFailureError``."""
    with raw_peer_transport() as (t, evil):
        buf = np.zeros(16)
        rq = t.irecv(buf, 1, COLL, 0, 3, "no collective message from rank 1")
        evil.sendall(wire.pack_header(COLL, 0, 0, 3, 2**40))
        t0 = time.monotonic()
        with pytest.raises(hpcdp.PeerFailureError, match="rank 1 sent a malformed frame"):
            rq.wait(10.0)
        assert time.monotonic() - t0 < 5
        assert 1 in t.crashed
        frames = [m for m in log if "exceeds the cap" in m]
        assert len(frames) == 1, log

"""Hostile clients against a running TCP job: each is dropped, logged once, and the job finishes.

The job (2 ranks doing checked allreduces in a loop) runs in a thread of the test; the attacker
connects to the rendezvous store on rank 0 and to rank 1's peer listener.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import struct

import numpy as np
import pytest

import hpcdp
from hpcdp.backends.tcp import _wire as wire
from hpcdp.launch._processes import free_port
from tcp_helpers import checked_allreduce_job, closed_by_server, published_port, start_job

SECRET = secrets.token_hex(32)


def _hello(target: int, nonce: bytes | None = None) -> bytes:
    # version, role, init generation 0 (the job's first init), claimed rank 5, target
    return struct.pack("<4sBBHii32s", b"HPCD", wire.VERSION,
                       wire.ROLE_STORE if target < 0 else wire.ROLE_PEER, 0, 5, target,
                       nonce or secrets.token_bytes(32))


def attack_random(port: int, target: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(os.urandom(300))
    return s


def attack_wrong_hmac(port: int, target: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(_hello(target))
    wire.recv_exact(s, 64)
    s.sendall(os.urandom(32))
    return s


def attack_replay(port: int, target: int) -> socket.socket:
    # a legitimate client's bytes, captured ...
    legit = socket.create_connection(("127.0.0.1", port))
    hello = _hello(target)
    legit.sendall(hello)
    chal = bytes(wire.recv_exact(legit, 64))
    resp = hmac.new(SECRET.encode(), b"cli" + hello + chal[:32], hashlib.sha256).digest()
    legit.sendall(resp)
    assert bytes(wire.recv_exact(legit, 4)) == b"OK\0\0"
    legit.close()
    # ... replayed by someone without the secret: the server's fresh nonce makes it fail
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(hello)
    wire.recv_exact(s, 64)
    s.sendall(resp)
    return s


def attack_huge_frame(port: int, target: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    if target < 0:  # authenticated (knows the secret), then announces 1 TiB
        wire.client_handshake(s, SECRET.encode(), wire.ROLE_STORE, 5, -1, 5.0)
    s.sendall(wire.pack_header(10, 0, 0, 0, 2**40))
    return s


def attack_silent(port: int, target: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port))


ATTACKS = {"random": attack_random, "wrong_hmac": attack_wrong_hmac, "replay": attack_replay,
           "huge_frame": attack_huge_frame, "silent": attack_silent}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_attacker_is_dropped_and_job_finishes(attack: str, tmp_path) -> None:
    port = free_port()
    env = {"MASTER_PORT": str(port), "HPCDP_SECRET": SECRET, "HPCDP_HANDSHAKE_TIMEOUT": "1"}
    t, out = start_job(checked_allreduce_job, 2, (str(tmp_path),), env)
    try:
        peer_port = published_port(str(tmp_path), 1, t, out)
        targets = {"store": (port, -1), "peer": (peer_port, 1)}
        names = {}
        for where, (p, tgt) in targets.items():
            s = ATTACKS[attack](p, tgt)
            names[where] = str(s.getsockname())
            assert closed_by_server(s), f"{attack} on {where} was not dropped"
            s.close()
    finally:
        (tmp_path / "stop").write_text("")
        t.join(60)
    assert "err" not in out, out.get("err")
    res = out["res"]
    assert all(r["bad"] == 0 and r["n"] > 0 for r in res)
    store_log = [m for m in res[0]["log"] if names["store"] in m]
    peer_log = [m for m in res[1]["log"] if names["peer"] in m]
    assert len(store_log) == 1, res[0]["log"]
    assert len(peer_log) == 1, res[1]["log"]


def test_init_without_secret_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.delenv("HPCDP_SECRET", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(hpcdp.BackendUnavailableError, match="HPCDP_SECRET"):
        hpcdp.init(backend="tcp")


@pytest.mark.parametrize("raw", [
    "a" * 64, "ab" * 32, "abcdefgh" * 8, "password", "Secret-1",
    pytest.param(secrets.token_hex(8), id="token_hex(8)"), "my-super-secret-123",
    "0123456789abcdef" * 2,
])  # a fresh secret's id names how it was made: every pytest process collects the same ids
def test_weak_secrets_are_refused(raw: str) -> None:
    assert wire.check_secret(raw) is not None


@pytest.mark.parametrize("raw", [
    pytest.param(secrets.token_hex(16), id="token_hex(16)"),
    pytest.param(secrets.token_hex(32), id="token_hex(32)"),
    pytest.param(secrets.token_urlsafe(24), id="token_urlsafe(24)"),
    "correct horse battery staple of the cluster",  # a long passphrase
])
def test_strong_secrets_are_accepted(raw: str) -> None:
    assert wire.check_secret(raw) is None, raw


def _tcp_env(monkeypatch, secret: str, bind: str | None) -> None:
    monkeypatch.setenv("HPCDP_SECRET", secret)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    if bind is None:
        monkeypatch.delenv("HPCDP_BIND_ADDR", raising=False)
    else:
        monkeypatch.setenv("HPCDP_BIND_ADDR", bind)


def test_weak_secret_is_refused_when_the_job_listens_on_the_network(monkeypatch) -> None:
    """Ranks listening beyond loopback (here: all interfaces) need a strong secret."""
    _tcp_env(monkeypatch, "weak-secret", "0.0.0.0")
    with pytest.raises(hpcdp.BackendUnavailableError, match="too weak.*listens on the network"):
        hpcdp.init(backend="tcp")
    assert not hpcdp.is_initialized()


def test_any_secret_is_accepted_on_loopback(monkeypatch) -> None:
    _tcp_env(monkeypatch, "weak-secret", None)
    hpcdp.init(backend="tcp", timeout=10)
    try:
        assert float(hpcdp.allreduce(np.ones(1))[0]) == 1.0
    finally:
        hpcdp.finalize()


def test_launcher_refuses_a_weak_secret_for_a_multi_node_job(monkeypatch) -> None:
    """Checked by the launcher too: a restart's derived secret would look strong."""
    from hpcdp import run

    monkeypatch.setenv("HPCDP_SECRET", "weak-secret")
    with pytest.raises(SystemExit, match="too weak for a multi-node job"):
        run.launch(["true"], 1, nnodes=2, node_rank=0, master_addr="10.255.255.1")


# An impostor server: the client must refuse it by itself, with its own AuthError, before it
# sends a response MAC. The fake server accepts whatever response comes, so a client that did not
# check the server's MAC would complete the handshake (these tests fail if that check is removed).
class _FakeServer:
    """A raw listening socket speaking the server side of the handshake from ``_wire``.

    ``challenge(hello)`` gives the 64 CHALLENGE bytes to send for the client's HELLO; afterwards the
    server reads the client's response (``response``: b"" if the client hung up instead) and sends
    ACCEPT whatever it was.
    """

    def __init__(self, challenge) -> None:
        import threading

        self.challenge = challenge
        self.response: bytes | None = None
        self.error: BaseException | None = None
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.thread = threading.Thread(target=self._serve_one, daemon=True)
        self.thread.start()

    def _serve_one(self) -> None:
        try:
            conn, _ = self.listener.accept()
            with conn:
                conn.settimeout(10)
                hello = bytes(wire.recv_exact(conn, wire.HELLO_SIZE))
                conn.sendall(self.challenge(hello))
                got = b""
                while len(got) < wire.MAC:
                    chunk = conn.recv(wire.MAC - len(got))
                    if not chunk:
                        break
                    got += chunk
                self.response = got
                if len(got) == wire.MAC:
                    conn.sendall(wire.ACCEPT)
        except BaseException as exc:  # noqa: BLE001 - reported by finish()
            self.error = exc
        finally:
            self.listener.close()

    def finish(self) -> bytes:
        self.thread.join(15)
        assert not self.thread.is_alive(), "fake server did not finish"
        assert self.error is None, self.error
        assert self.response is not None
        return self.response


def _client(port: int, secret: str = SECRET) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        wire.client_handshake(s, secret.encode(), wire.ROLE_PEER, 0, 1, 5.0)


def test_client_refuses_a_server_with_the_wrong_secret() -> None:
    wrong = secrets.token_hex(32).encode()
    fake = _FakeServer(lambda hello: wire.challenge(wrong, hello)[1])
    with pytest.raises(hpcdp.AuthError, match="the server does not know the secret"):
        _client(fake.port)
    assert fake.finish() == b"", "the client sent its response MAC to an impostor"


def test_client_refuses_a_replayed_server_challenge() -> None:
    """A genuine session is recorded by a relay; a server without the secret replays its CHALLENGE
    (a valid MAC, but over the earlier session's HELLO and client nonce) to a new client."""
    import threading

    genuine = socket.create_server(("127.0.0.1", 0))
    served: list[object] = []

    def serve() -> None:
        conn, _ = genuine.accept()
        with conn:
            served.append(wire.server_handshake(conn, SECRET.encode(), wire.ROLE_PEER, 1, 10.0))

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    captured: list[bytes] = []

    def relay(hello: bytes) -> bytes:  # passes the HELLO on and records the genuine CHALLENGE
        upstream = socket.create_connection(genuine.getsockname(), timeout=10)
        upstream.sendall(hello)
        chal = bytes(wire.recv_exact(upstream, wire.CHALLENGE_SIZE))
        captured.append(chal)
        threading.Thread(target=_finish_relay, args=(upstream, recorder), daemon=True).start()
        return chal

    recorder = _FakeServer(relay)
    _client(recorder.port)  # the genuine session, relayed: it succeeds
    assert len(recorder.finish()) == wire.MAC
    t.join(15)
    genuine.close()
    assert served == [0] and len(captured) == 1

    replayer = _FakeServer(lambda hello: captured[0])
    with pytest.raises(hpcdp.AuthError, match="the server does not know the secret"):
        _client(replayer.port)
    assert replayer.finish() == b"", "the client sent its response MAC to a replaying server"


def _finish_relay(upstream: socket.socket, recorder: _FakeServer) -> None:
    """Forward the client's response (once the recorder has it) to the genuine server."""
    with upstream:
        recorder.thread.join(15)
        if recorder.response:
            upstream.sendall(recorder.response)
            wire.recv_exact(upstream, len(wire.ACCEPT))

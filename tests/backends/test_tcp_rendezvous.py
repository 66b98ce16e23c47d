"""Rendezvous under pressure and again: a slow flood on the store port does not keep the ranks
out, and init -> finalize -> init forms a new world (a generation of its own) every time."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import hpcdp
from hpcdp.testing import run_ranks
from hpcdp.backends.tcp import _wire as wire
from hpcdp.launch._processes import free_port
from hpcdp.backends.tcp._store import StoreClient, StoreServer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_LAUNCHER_PREFIXES = ("OMPI_", "PMI", "MPI_", "SLURM", "HPCDP_", "MASTER_")


class SlowFlood:
    """``n`` connections to ``port`` that send one byte a second each and reconnect as soon as
    they are dropped (or refused: the store is not up yet). Stops at ``stop()`` or ``limit``."""

    def __init__(self, port: int, n: int = 70, limit: float = 120.0) -> None:
        self.port, self.limit = port, limit
        self.socks: list[socket.socket | None] = [None] * n
        self.due = [0.0] * n
        self.connects = self.dropped = self.most_open = 0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "SlowFlood":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.thread.join(10)
        for s in self.socks:
            if s is not None:
                s.close()

    def _drop(self, i: int) -> None:
        self.socks[i].close()  # type: ignore[union-attr]
        self.socks[i] = None
        self.dropped += 1

    def _run(self) -> None:
        deadline = time.monotonic() + self.limit
        while not self._stop.is_set() and time.monotonic() < deadline:
            now = time.monotonic()
            for i, s in enumerate(self.socks):
                if s is None:
                    try:
                        s = socket.create_connection(("127.0.0.1", self.port), timeout=0.2)
                    except OSError:
                        continue
                    s.setblocking(False)
                    self.socks[i], self.due[i] = s, now
                    self.connects += 1
                try:
                    if s.recv(64) == b"":
                        self._drop(i)
                        continue
                except BlockingIOError:
                    pass
                except OSError:
                    self._drop(i)
                    continue
                if now >= self.due[i]:
                    try:
                        s.send(b"H")
                    except OSError:
                        self._drop(i)
                        continue
                    self.due[i] = now + 1.0
            self.most_open = max(self.most_open, sum(s is not None for s in self.socks))
            time.sleep(0.01)


JOB = """
    import os, time
    import numpy as np
    import hpcdp
    if os.environ["RANK"] != "0":
        time.sleep(float(os.environ["JOIN_DELAY"]))  # join once the flood holds the store
    hpcdp.init()
    x = hpcdp.allreduce(np.full(3, hpcdp.rank() + 1.0))
    print("ok", hpcdp.rank(), x[0])
    hpcdp.finalize()
"""


@pytest.mark.timeout(180)
def test_job_starts_while_slow_connections_flood_the_store(tmp_path) -> None:
    """70 connections at 1 byte a second on the rendezvous port (issue 9, item 9): the store
    drops them at the HELLO deadline or evicts them, and the three ranks get in."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB))
    port = free_port()
    procs = []
    with SlowFlood(port) as flood:
        for rank in range(3):
            env = {k: v for k, v in os.environ.items()
                   if not k.startswith(_LAUNCHER_PREFIXES) and k not in ("RANK", "WORLD_SIZE")}
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                       WORLD_SIZE="3", HPCDP_SECRET="flood-test-secret", PYTHONPATH=ROOT,
                       HPCDP_CONNECT_TIMEOUT="30", JOIN_DELAY="3")
            procs.append(subprocess.Popen([sys.executable, str(script)], env=env, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        outs = []
        try:
            for p in procs:
                out, err = p.communicate(timeout=90)
                outs.append((p.returncode, out.strip(), err))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.communicate()
        most_open, connects, dropped = flood.most_open, flood.connects, flood.dropped
    assert [o[:2] for o in outs] == [(0, f"ok {r} 6.0") for r in range(3)], outs
    assert most_open >= 60, most_open  # the flood really held the store's slots
    assert connects > 70 and dropped > 0, (connects, dropped)  # and was dropped, and came back


def reinit_body(rank: int) -> list[float]:
    """Three worlds in a row in the same processes (the first is spawn's)."""
    got = []
    for i in range(3):
        if i:
            hpcdp.init("tcp", timeout=20)
        got.append(float(hpcdp.allreduce(np.full(2, rank + 10.0 * i))[0]))
        if i == 1 and rank == 2:
            time.sleep(0.5)  # a late finalize: the others already re-publish
        hpcdp.finalize()
    hpcdp.init("tcp", timeout=20)  # spawn's finalize needs a world to close
    return got


@pytest.mark.timeout(120)
def test_init_finalize_init_forms_a_new_world_each_time() -> None:
    res = run_ranks("tcp", 3, reinit_body, timeout=20, join_timeout=90)
    assert res == [[3.0, 33.0, 63.0]] * 3


def test_a_store_refuses_another_generation(monkeypatch) -> None:
    """A rank of the next init cannot talk to the previous store (same port and secret):
    refused in the handshake, retried until its deadline; the right generation gets in."""
    monkeypatch.setenv("HPCDP_HANDSHAKE_TIMEOUT", "1")
    secret = b"generation-test-secret"
    srv = StoreServer("127.0.0.1", 0, secret, generation=4)
    try:
        port = srv.address[1]
        with pytest.raises(hpcdp.CommTimeoutError, match="no store"):
            StoreClient("127.0.0.1", port, secret, 1, timeout=1.0, generation=5)
        ok = StoreClient("127.0.0.1", port, secret, 1, timeout=5.0, generation=4)
        ok.set("k", b"v")
        assert ok.get("k", 1.0) == b"v"
        ok.close()
    finally:
        srv.close()


def _handshake_with_rewritten_generation(mac_over_sent: bool) -> dict:
    """A HELLO for generation 6 rewritten to 7 in flight; the client answers with a MAC over
    what it sent (generation 6) or, as a control, over what the server got."""
    a, b = socket.socketpair()
    secret = b"mac-test-secret"
    out: dict = {}

    def server() -> None:
        try:
            out["claimed"] = wire.server_handshake(b, secret, wire.ROLE_PEER, 0, 5.0, generation=7)
        except hpcdp.HpcdpError as exc:
            out["err"] = exc

    t = threading.Thread(target=server)
    t.start()
    orig = wire.hello(wire.ROLE_PEER, 1, 0, 6)
    sent = bytearray(orig)
    sent[6:8] = (7).to_bytes(2, "little")
    a.sendall(sent)
    nonce_s = bytes(wire.recv_exact(a, wire.CHALLENGE_SIZE)[:wire.NONCE])
    a.sendall(wire._mac(secret, b"cli", bytes(sent) if mac_over_sent else orig, nonce_s))
    t.join(10)
    a.close()
    b.close()
    return out


def test_generation_is_inside_the_mac() -> None:
    assert _handshake_with_rewritten_generation(True) == {"claimed": 1}  # the control
    out = _handshake_with_rewritten_generation(False)
    assert isinstance(out.get("err"), hpcdp.AuthError), out

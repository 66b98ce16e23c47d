"""Pieces the TCP tests share: a log collector, a "closed by the server" probe, a job in a thread,
a transport whose one peer is a raw socket."""
from __future__ import annotations

import logging
import socket
import threading
import time
from pathlib import Path
import contextlib
from typing import Any, Callable, Iterator

import numpy as np

import hpcdp
from hpcdp.backends.tcp._transport import Transport
from hpcdp.launch._processes import spawn_processes


class LogCollector(logging.Handler):
    """Keeps the messages of the ``hpcdp.tcp`` logger (used in spawned ranks too)."""

    def __init__(self, level: int = logging.WARNING) -> None:
        super().__init__(level)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def attach(self) -> "LogCollector":
        logging.getLogger("hpcdp.tcp").addHandler(self)
        return self

    def detach(self) -> None:
        logging.getLogger("hpcdp.tcp").removeHandler(self)


def closed_by_server(sock: socket.socket, within: float = 5.0) -> bool:
    """Whether the other end closes ``sock`` within ``within`` seconds (reading what it sends)."""
    sock.settimeout(within)
    try:
        while sock.recv(4096):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP: state T in /proc/<pid>/stat): a test waits
    for this rather than assuming a peer stopped itself within a fixed sleep."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "T"
    except (OSError, IndexError):
        return False


def start_job(fn: Callable[..., Any], n: int, args: tuple, env: dict[str, str]
              ) -> tuple[threading.Thread, dict[str, Any]]:
    """Run ``fn`` on ``n`` TCP ranks in a background thread; ``out`` gets "res" or "err"."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["res"] = spawn_processes(fn, n, args=args, timeout=30, join_timeout=60, env=env)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            out["err"] = exc

    t = threading.Thread(target=run)
    t.start()
    return t, out


def checked_allreduce_job(rank: int, info: str, count: int = 50_000,
                          pause: float = 0.0) -> dict[str, Any]:
    """A 2-rank job under attack: checked allreduces until the test writes ``info/stop``.

    Publishes this rank's listener port as ``info/port<rank>``; returns the number of rounds,
    how many gave a wrong answer, the base and peak thread counts and the ``hpcdp.tcp`` log.
    """
    handler = LogCollector().attach()
    be = hpcdp.get_default_group().backend
    Path(info, f"port{rank}").write_text(str(be.world.listener.getsockname()[1]))
    stop = Path(info, "stop")
    n, bad, t0 = 0, 0, time.monotonic()
    base = peak = threading.active_count()
    while True:
        done = hpcdp.broadcast(np.array([stop.exists() or time.monotonic() - t0 > 30]), root=0)
        if done[0]:
            break
        x = np.arange(count, dtype=np.float64) * (rank + 1)
        bad += int(not np.array_equal(hpcdp.allreduce(x), np.arange(count) * 3.0))
        n += 1
        peak = max(peak, threading.active_count())
        if pause:
            time.sleep(pause)
    hpcdp.barrier()
    return {"n": n, "bad": bad, "base": base, "peak": peak, "log": handler.messages}


def published_port(info: str, rank: int, job: threading.Thread, out: dict[str, Any]) -> int:
    """The listener port ``checked_allreduce_job`` publishes for ``rank`` (waits up to 20 s)."""
    path = Path(info, f"port{rank}")
    deadline = time.monotonic() + 20
    while not path.exists():
        assert time.monotonic() < deadline and job.is_alive(), out
        time.sleep(0.02)
    time.sleep(0.05)  # written, not just created
    return int(path.read_text())


@contextlib.contextmanager
def raw_peer_transport(*, park_receiver: bool = False,
                       flush_timeout: float = 1.0) -> Iterator[tuple[Transport, socket.socket]]:
    """A transport of rank 0 whose peer 1 is the raw socket yielded beside it (the test writes
    frames to it and reads what rank 0 sends). ``park_receiver``: the background receiver leaves
    the peer alone, so only the calls under test read it."""
    lsock = socket.create_server(("127.0.0.1", 0))
    raw = socket.create_connection(lsock.getsockname())
    conn, _ = lsock.accept()
    lsock.close()
    t = Transport(0, 2, 1 << 20)
    try:
        t.add_peer(1, conn)
        if park_receiver:
            t.peers[1].linger_until = time.monotonic() + 600
        yield t, raw
    finally:
        if park_receiver:
            t.peers[1].linger_until = 0.0
        raw.close()
        t.close(flush_timeout=flush_timeout)

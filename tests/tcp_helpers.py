"""Pieces the TCP tests share: a log collector, a "closed by the server" probe, a job in a thread."""
from __future__ import annotations

import logging
import socket
import threading
from typing import Any, Callable

from hpcdp.backends._tcp_spawn import spawn_processes


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

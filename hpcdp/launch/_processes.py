"""``spawn_processes``: run a function on N local TCP ranks and collect what each returns.

Children come from a forkserver that has numpy and hpcdp imported already, so a rank starts in
tens of milliseconds. Results and exceptions come back over a multiprocessing pipe (local IPC,
not the network). Every child watches its pipe: if the parent dies, the child exits, so nothing
is orphaned; on failure or ``join_timeout`` the parent kills every child it started.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import secrets
import signal
import socket
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection, wait as mp_wait
from typing import Any, Callable

from .. import trace
from ..comm.world import finalize, init
from ..errors import HpcdpError, PeerFailureError

__all__ = ["spawn_processes", "free_port"]

_CTX: Any = None
_GRACE = 3.0  # seconds peers get to report after the first failure


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now (``""``: on every interface), for a server that another
    process binds a moment later (the launcher's and tests' rendezvous port).

    Drawn at random below the kernel's ephemeral range: the kernel's own pick (``bind(0)``) comes
    from that range, where any outgoing connection of the machine may take it before the server
    binds it (seen in CI: ``Address already in use`` at a rank's store, while parallel tests
    opened connections). The kernel's pick only where the range leaves no room below it.
    """
    low = _ephemeral_low()
    if low > 2048:
        draw = secrets.SystemRandom()
        for _ in range(64):
            port = draw.randrange(max(1024, low // 3), low)
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue  # in use: another draw
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _context() -> Any:
    global _CTX
    if _CTX is None:
        try:
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(["numpy", "hpcdp", "hpcdp.backends.tcp",
                                        "hpcdp.launch._processes"])
        except ValueError:  # pragma: no cover - platforms without fork
            ctx = mp.get_context("spawn")
        _CTX = ctx
    return _CTX


def _watch_parent(conn: Connection) -> None:
    try:
        conn.recv_bytes()
    except (EOFError, OSError):
        pass
    os._exit(70)  # the parent is gone or told us to stop


def _child(rank: int, env: dict[str, str], path: list[str], payload: bytes, conn: Connection,
           timeout: float | None, backend: str) -> None:
    os.environ.clear()
    os.environ.update(env)
    sys.path[:] = path
    threading.Thread(target=_watch_parent, args=(conn,), daemon=True).start()
    status: tuple[Any, ...]
    try:
        fn, args, kwargs = pickle.loads(payload)
        init(backend, timeout=timeout)
        status = ("ok", fn(rank, *args, **kwargs))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        status = ("err", exc, traceback.format_exc())
        trace.dump(f"uncaught {type(exc).__name__} on {backend} rank {rank}: {exc}")
    try:
        data = pickle.dumps(status)
    except Exception as exc:  # noqa: BLE001 - unpicklable result or exception
        data = pickle.dumps(("err", HpcdpError(f"rank {rank}: cannot send result back: {exc}; "
                                               f"{status[1]!r}"), status[-1]))
    conn.send_bytes(data)
    try:
        finalize()
    except Exception:  # noqa: BLE001 - the result is already delivered
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if status[0] == "ok" else 1)


def spawn_processes(fn: Callable[..., Any], world_size: int, *, args: tuple[Any, ...] = (),
                    kwargs: dict[str, Any] | None = None, timeout: float | None = None,
                    join_timeout: float | None = None, env: dict[str, str] | None = None,
                    backend: str = "tcp") -> list[Any]:
    """``fn(rank, *args, **kwargs)`` on ``world_size`` local ranks of ``backend`` (one that
    meets through the launcher's environment: TCP); each rank's return value.

    Raises the first root-cause exception (a ``PeerFailureError`` only if nothing else failed),
    with the rank in a note; kills every child on failure or after ``join_timeout`` seconds.
    """
    payload = pickle.dumps((fn, args, kwargs or {}))
    ctx = _context()
    base = dict(os.environ)
    base.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size), "HPCDP_SECRET": secrets.token_hex(32),
        "HPCDP_BACKEND": backend,
    })
    base.pop("HPCDP_MASTER_ADDR", None)
    base.pop("HPCDP_MASTER_PORT", None)
    base.update(env or {})  # tests pin the port, the secret or the handshake timeout
    procs, conns = [], []
    try:
        for r in range(world_size):
            e = dict(base, RANK=str(r), LOCAL_RANK=str(r))
            parent_end, child_end = ctx.Pipe(duplex=True)
            p = ctx.Process(target=_child, args=(r, e, list(sys.path), payload, child_end, timeout,
                                                 backend),
                            name=f"hpcdp-{backend}-rank{r}", daemon=True)
            p.start()
            child_end.close()
            procs.append(p)
            conns.append(parent_end)
        return _collect(procs, conns, join_timeout)
    finally:
        _reap(procs, conns)


def _collect(procs: list[Any], conns: list[Connection], join_timeout: float | None) -> list[Any]:
    n = len(procs)
    results: list[Any] = [None] * n
    reports: dict[int, tuple[Any, ...]] = {}
    deadline = None if join_timeout is None else time.monotonic() + join_timeout
    first_failure: float | None = None
    open_ = {conns[r]: r for r in range(n)}
    sentinels = {procs[r].sentinel: r for r in range(n)}

    def died(r: int) -> None:
        nonlocal first_failure
        procs[r].join(0.5)
        reports[r] = ("err", HpcdpError(
            f"tcp rank {r} exited with code {procs[r].exitcode} without reporting a result"), "")
        if first_failure is None:
            first_failure = time.monotonic()

    while len(reports) < n:
        if not open_ and not sentinels:  # nothing left to wait on (cannot happen; never hang)
            for r in range(n):
                if r not in reports:
                    died(r)
            break
        now = time.monotonic()
        limit = deadline
        if first_failure is not None:
            limit = min(limit or float("inf"), first_failure + _GRACE)
        if limit is not None and now >= limit:
            break
        ready = mp_wait(list(open_) + list(sentinels), None if limit is None else limit - now)
        for obj in ready:
            if obj in open_:
                r = open_.pop(obj)
                try:
                    reports[r] = pickle.loads(obj.recv_bytes())
                except (EOFError, OSError):
                    if procs[r].sentinel not in sentinels:
                        died(r)  # its sentinel fired already (and found the pipe readable)
                    continue  # otherwise its sentinel says so
                if reports[r][0] != "ok" and first_failure is None:
                    first_failure = time.monotonic()
            elif obj in sentinels:
                r = sentinels.pop(obj)
                if r in reports:
                    continue
                c = conns[r]
                if c in open_ and c.poll(0.2):
                    continue  # a report written just before exit: read on the next round
                open_.pop(c, None)
                died(r)
    failed = {r: rep for r, rep in reports.items() if rep[0] != "ok"}
    if failed:
        root = next(((r, rep) for r, rep in sorted(failed.items())
                     if not isinstance(rep[1], PeerFailureError)), min(failed.items()))
        r, rep = root
        exc = rep[1]
        exc.add_note(f"(raised on tcp rank {r} of {n})" + (f"\n{rep[2]}" if rep[2] else ""))
        raise exc
    missing = [r for r in range(n) if r not in reports]
    if missing:
        raise HpcdpError(f"spawn: tcp rank(s) {missing} did not finish within {join_timeout} s")
    for r, rep in reports.items():
        results[r] = rep[1]
    return results


def _reap(procs: list[Any], conns: list[Connection]) -> None:
    """Stop every child: polite first, then SIGKILL; join all so none is left behind."""
    for c in conns:
        try:
            c.close()  # children exit when their pipe closes
        except OSError:
            pass
    deadline = time.monotonic() + 1.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            try:
                os.kill(p.pid, signal.SIGKILL)
            except (ProcessLookupError, TypeError):
                pass
            p.join(2.0)

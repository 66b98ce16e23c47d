"""Local rank processes for ``hpcdp-run``: start, prefix their output, stop and restart them.

A ``_Supervisor`` owns one node's ranks across restart attempts and the signals the launcher gets;
``launch`` builds each attempt's environment (port, secret, ``HPCDP_RESTART_COUNT``).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Any, Sequence

from ._processes import free_port

__all__ = ["launch", "attempt_secret", "GRACE"]

GRACE = 3.0


def _pump(stream: IO[bytes], prefix: bytes, out: IO[bytes], lock: threading.Lock) -> None:
    for line in iter(stream.readline, b""):
        if not line.endswith(b"\n"):
            line += b"\n"
        with lock:
            out.write(prefix + line)
            out.flush()
    stream.close()


def _die_with_parent() -> None:
    """Linux: the rank gets SIGKILL if the launcher dies, so no rank outlives its job."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class _Supervisor:
    """The ranks of one node across restart attempts, and the signals sent to the launcher.

    SIGINT/SIGTERM (Ctrl-C, Slurm preemption or time limit) are forwarded to the ranks and end the
    job: no restart after them. SIGUSR1/SIGUSR2 (``#SBATCH --signal=USR1@60``) are forwarded
    only, so ranks using ``hpcdp.checkpoint.on_preempt`` can save and exit on their own.
    """

    STOP = (signal.SIGINT, signal.SIGTERM)
    FORWARD = (signal.SIGUSR1, signal.SIGUSR2)

    def __init__(self, grace: float) -> None:
        self.grace = grace
        self.lock = threading.Lock()
        self.procs: list[subprocess.Popen] = []
        self.pumps: list[threading.Thread] = []
        self.received: list[int] = []  # stop signals sent to the launcher, in order
        self.forwarded: set[int] = set()  # pids the first of them was forwarded to
        self._old: dict[int, Any] = {}

    def __enter__(self) -> _Supervisor:
        for s in self.STOP + self.FORWARD:
            self._old[s] = signal.signal(s, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        self.reap()
        for s, h in self._old.items():
            signal.signal(s, h)

    def _signal_all(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
            if self.received and sig == self.received[0]:
                self.forwarded.add(p.pid)

    def _on_signal(self, signum: int, _frame: object) -> None:
        if signum in self.FORWARD:
            self._signal_all(signum)
            return
        # Forward it and let the main loop wait out the grace period: under SLURM a SIGTERM
        # means preemption, and ranks need that time to write a checkpoint. A second Ctrl-C
        # means "now".
        self.received.append(signum)
        if signum == signal.SIGINT and self.received.count(signal.SIGINT) > 1:
            self._signal_all(signal.SIGKILL)
        else:
            self._signal_all(signum)

    def run(self, cmd: Sequence[str], envs: list[tuple[int, dict[str, str]]]) -> tuple[int, int | None]:
        """Start one rank per ``(rank, env)``, supervise them; ``(exit code, first failed rank)``."""
        self.procs, self.forwarded = [], set()
        ranks: dict[int, int] = {}  # pid -> rank
        for rank, env in envs:
            if self.received:
                break  # told to stop while starting: start no more
            p = subprocess.Popen(list(cmd), env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, start_new_session=True,
                                 preexec_fn=_die_with_parent)
            self.procs.append(p)
            ranks[p.pid] = rank
            if self.received and p.pid not in self.forwarded:  # the signal came during Popen
                try:
                    os.killpg(p.pid, self.received[0])
                except ProcessLookupError:
                    pass
            prefix = f"[rank {rank}] ".encode()
            for stream, out in ((p.stdout, sys.stdout.buffer), (p.stderr, sys.stderr.buffer)):
                t = threading.Thread(target=_pump, args=(stream, prefix, out, self.lock), daemon=True)
                t.start()
                self.pumps.append(t)
        code, failed_rank = 0, None
        while not self.received:
            alive = [p for p in self.procs if p.poll() is None]
            failed = [p for p in self.procs if p.returncode not in (None, 0)]
            if failed:
                code = failed[0].returncode
                code = code if code > 0 else 128 - code  # killed by a signal: 128 + signum
                failed_rank = ranks[failed[0].pid]
                self._signal_all(signal.SIGTERM)
                break
            if not alive:
                break
            time.sleep(0.02)
        if self.received and not code:
            code = 128 + self.received[0]  # like a shell: 143 for SIGTERM, 130 for SIGINT
        # grace period: ranks may clean up (save a checkpoint), then whatever is left is killed
        deadline = time.monotonic() + self.grace
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.02)
        self.reap()
        return code, failed_rank

    def reap(self) -> None:
        """SIGKILL every rank's process group and wait for them, so no rank outlives its attempt."""
        self._signal_all(signal.SIGKILL)
        for p in self.procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass
        for t in self.pumps:
            t.join(1.0)
        self.pumps = []


def attempt_secret(base: str, attempt: int) -> str:
    """The secret of restart ``attempt``: each node derives the same one from ``HPCDP_SECRET``,
    and a rank left over from an earlier attempt cannot authenticate to the new one."""
    if attempt == 0:
        return base
    return hmac.new(base.encode(), f"hpcdp-run attempt {attempt}".encode(), hashlib.sha256).hexdigest()


def _weak_secret(secret: str, master_addr: str) -> str | None:
    """Why ``secret`` is too guessable for a job whose store listens beyond loopback, or None."""
    from ..backends.tcp._wire import check_secret, is_loopback  # late: no backend imported here

    return None if is_loopback(master_addr) else check_secret(secret)


def _say(message: str) -> None:
    sys.stderr.write(f"hpcdp-run: {message}\n")
    sys.stderr.flush()


def launch(cmd: Sequence[str], nproc: int, *, nnodes: int = 1, node_rank: int = 0,
           master_addr: str = "127.0.0.1", master_port: int | None = None,
           grace: float = GRACE, max_restarts: int = 0) -> int:
    """Start ``nproc`` ranks of ``cmd`` on this node; return the job's exit code.

    When a rank fails, every rank here is stopped (SIGTERM, SIGKILL after ``grace``) and, while
    restarts are left, all of them start again with ``HPCDP_RESTART_COUNT`` one higher, on a new
    port and with a new secret. Across nodes, each launcher restarts its own ranks (a failure
    anywhere fails every rank), attempt ``k`` using port ``master_port + k``.
    """
    if max_restarts < 0:
        raise SystemExit(f"hpcdp-run: --max-restarts must be >= 0, got {max_restarts}")
    world = nproc * nnodes
    base = os.environ.get("HPCDP_SECRET") if nnodes > 1 else None
    if nnodes > 1 and not base:
        raise SystemExit("hpcdp-run: multi-node jobs need the same HPCDP_SECRET exported on "
                         "every node (e.g. python -c 'import secrets; print(secrets.token_hex(32))')")
    if nnodes > 1 and (weak := _weak_secret(base or "", master_addr)):
        # checked here too: a restart's derived secret would look strong whatever the base
        raise SystemExit(f"hpcdp-run: HPCDP_SECRET is too weak for a multi-node job ({weak}); "
                         "use e.g. python -c 'import secrets; print(secrets.token_hex(32))'")
    with _Supervisor(grace) as sup:
        for attempt in range(max_restarts + 1):
            if nnodes > 1:
                port, secret = (master_port or 29500) + attempt, attempt_secret(base or "", attempt)
            else:
                port, secret = master_port or free_port(""), secrets.token_hex(32)
            envs = []
            for local in range(nproc):
                rank = node_rank * nproc + local
                env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world),
                           LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(nproc),
                           MASTER_ADDR=master_addr, MASTER_PORT=str(port), HPCDP_SECRET=secret,
                           HPCDP_BACKEND="tcp", HPCDP_RESTART_COUNT=str(attempt),
                           HPCDP_MAX_RESTARTS=str(max_restarts), PYTHONUNBUFFERED="1")
                for k in ("HPCDP_MASTER_ADDR", "HPCDP_MASTER_PORT"):
                    env.pop(k, None)
                envs.append((rank, env))
            code, failed = sup.run(cmd, envs)
            if code == 0 or sup.received or failed is None:
                return code
            if attempt == max_restarts:
                if max_restarts:
                    _say(f"rank {failed} exited with code {code}; no restarts left "
                         f"(--max-restarts {max_restarts}), giving up")
                return code
            _say(f"rank {failed} exited with code {code}; restarting all {nproc} rank(s) "
                 f"(restart {attempt + 1} of {max_restarts})")
    return code

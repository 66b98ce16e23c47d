"""Local rank processes for ``hpcdp-run``: start, prefix their output, stop and restart them.

A ``_Supervisor`` owns one node's ranks across restart attempts and the signals the launcher gets;
``launch`` builds each attempt's environment (port, secret, ``HPCDP_RESTART_COUNT``).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Any, Sequence

from .._config import setting
from ._boot import SIGNALS as BOOT_SIGNALS
from ._processes import free_port

__all__ = ["launch", "attempt_secret", "rank_command", "GRACE", "BOOT"]

GRACE = 3.0
#: the rank bootstrap, run by path (``rank_command``)
BOOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_boot.py")


def _pump(stream: IO[bytes], prefix: bytes, out: IO[bytes], lock: threading.Lock) -> None:
    """Copy a rank's lines to ours with ``prefix`` in front; a line that starts with it already
    (``hpcdp.get_logger``'s, whatever the launcher) keeps one, so every launcher shows one."""
    for line in iter(stream.readline, b""):
        if not line.endswith(b"\n"):
            line += b"\n"
        with lock:
            out.write(line if line.startswith(prefix) else prefix + line)
            out.flush()
    stream.close()


def _die_with_parent() -> None:
    """Linux: the rank gets SIGKILL if the launcher dies, so no rank outlives its job."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _start_boot_rank() -> None:
    """In the forked child of a rank run through the bootstrap: die with the launcher, and block
    the preemption notices until the bootstrap has a handler that remembers them."""
    _die_with_parent()
    signal.pthread_sigmask(signal.SIG_BLOCK, BOOT_SIGNALS)


def rank_command(script: str, args: Sequence[str], module: bool = False) -> list[str]:
    """The command of one rank: ``script`` (a module with ``module``) run through the bootstrap,
    which remembers a preemption notice that comes before the script has a handler."""
    return [sys.executable, "-u", BOOT, "--module" if module else "--path", script, *args]


class _Supervisor:
    """The ranks of one node across restart attempts, and the signals sent to the launcher.

    SIGINT/SIGTERM (Ctrl-C, Slurm preemption or time limit) are forwarded to the ranks and end the
    job: no restart after them. SIGUSR1/SIGUSR2 (``#SBATCH --signal=USR1@60``) are forwarded
    only, so ranks using ``hpcdp.checkpoint.on_preempt`` can save and exit on their own; ranks
    started through the bootstrap remember one that comes before they have a handler. A rank
    killed by a signal forwarded to it was stopped or preempted, not broken: that is never
    restarted either (``killed_by``), since a restart would have forgotten the signal.
    """

    STOP = (signal.SIGINT, signal.SIGTERM)
    FORWARD = (signal.SIGUSR1, signal.SIGUSR2)

    def __init__(self, grace: float) -> None:
        self.grace = grace
        self.lock = threading.Lock()
        self.procs: list[subprocess.Popen] = []
        self.pumps: list[threading.Thread] = []
        self.received: list[int] = []  # stop signals sent to the launcher, in order
        self.notices: list[int] = []  # SIGUSR1/SIGUSR2 sent to the launcher in this attempt
        self.sent: dict[int, set[int]] = {}  # pid -> signals forwarded to it in this attempt
        self.killed_by: int | None = None  # the forwarded signal the failed rank died of
        self.summary = ""  # one line on the last failed attempt: who failed first, the others
        self._old: dict[int, Any] = {}

    def __enter__(self) -> _Supervisor:
        for s in self.STOP + self.FORWARD:
            self._old[s] = signal.signal(s, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        self.reap()
        for s, h in self._old.items():
            signal.signal(s, h)

    def _signal_all(self, sig: int, forward: bool = False) -> None:
        """``sig`` to every live rank's process group; ``forward``: the launcher received it."""
        for p in self.procs:
            if p.poll() is None:  # a rank dead already did not die of this signal
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
                if forward:
                    self.sent.setdefault(p.pid, set()).add(sig)

    def _on_signal(self, signum: int, _frame: object) -> None:
        if signum in self.FORWARD:
            self.notices.append(signum)
            self._signal_all(signum, forward=True)
            return
        # Forward it and let the main loop wait out the grace period: under SLURM a SIGTERM
        # means preemption, and ranks need that time to write a checkpoint. A second Ctrl-C
        # means "now".
        self.received.append(signum)
        if signum == signal.SIGINT and self.received.count(signal.SIGINT) > 1:
            self._signal_all(signal.SIGKILL)
        else:
            self._signal_all(signum, forward=True)

    def run(self, cmd: Sequence[str], envs: list[tuple[int, dict[str, str]]]) -> tuple[int, int | None]:
        """Start one rank per ``(rank, env)``, supervise them; ``(exit code, first failed rank)``."""
        self.procs, self.sent, self.notices, self.killed_by = [], {}, [], None
        self.summary = ""
        # Through the bootstrap a rank starts with the notices blocked: one that comes before the
        # script has a handler is remembered, not fatal. Other commands keep the default action.
        # It names the exception that ended a rank in ``reports/RANK`` (for the summary).
        boot = BOOT in list(cmd)[:3]
        preexec = _start_boot_rank if boot else _die_with_parent
        reports = tempfile.mkdtemp(prefix="hpcdp-run-")
        if boot:
            at = list(cmd).index(BOOT) + 1
            cmd = [*cmd[:at], "--report", reports, *cmd[at:]]
        try:
            return self._run(cmd, envs, preexec, reports)
        finally:
            shutil.rmtree(reports, ignore_errors=True)

    def _run(self, cmd: Sequence[str], envs: list[tuple[int, dict[str, str]]], preexec: Any,
             reports: str) -> tuple[int, int | None]:
        ranks: dict[int, int] = {}  # pid -> rank
        for rank, env in envs:
            if self.received:
                break  # told to stop while starting: start no more
            p = subprocess.Popen(list(cmd), env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, start_new_session=True,
                                 preexec_fn=preexec)
            self.procs.append(p)
            ranks[p.pid] = rank
            for sig in self.received[:1] + self.notices:  # signals that came during Popen
                if sig not in self.sent.get(p.pid, ()):
                    self.sent.setdefault(p.pid, set()).add(sig)
                    try:
                        os.killpg(p.pid, sig)
                    except ProcessLookupError:
                        pass
            prefix = f"[rank {rank}] ".encode()
            for stream, out in ((p.stdout, sys.stdout.buffer), (p.stderr, sys.stderr.buffer)):
                t = threading.Thread(target=_pump, args=(stream, prefix, out, self.lock), daemon=True)
                t.start()
                self.pumps.append(t)
        code, failed_rank, first = 0, None, None
        stopped: set[int] = set()  # pids still running when the launcher sent SIGTERM
        while not self.received:
            alive = [p for p in self.procs if p.poll() is None]
            failed = [p for p in self.procs if p.returncode not in (None, 0)]
            if failed:
                # a rank that died of a signal forwarded to it explains its peers' failures, and
                # one that raised PeerFailureError is a consequence of another's failure
                by_signal = [p for p in failed if -p.returncode in self.sent.get(p.pid, ())]
                cause = [p for p in failed
                         if not _reason(reports, ranks[p.pid]).startswith("PeerFailureError")]
                first = (by_signal or cause or failed)[0]
                code = first.returncode
                code = code if code > 0 else 128 - code  # killed by a signal: 128 + signum
                failed_rank = ranks[first.pid]
                self.killed_by = -first.returncode if by_signal else None
                stopped = {p.pid for p in alive}
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
        late = {p.pid for p in self.procs if p.poll() is None}
        self.reap()
        if first is not None:
            self.summary = _summary(first, self.procs, ranks, stopped, late, reports, self.grace)
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


def _reason(reports: str, rank: int) -> str:
    """The one line the bootstrap wrote about what ended ``rank`` ("" if none)."""
    try:
        with open(os.path.join(reports, str(rank))) as f:
            return f.read().strip()
    except OSError:
        return ""


def _outcome(code: int | None, why: str) -> str:
    """``killed by SIGKILL`` / ``exit code 1, ValueError: bad value``."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            text = f"killed by {signal.Signals(-code).name}"
        except ValueError:
            text = f"killed by signal {-code}"
    else:
        text = f"exit code {code}"
    return f"{text}, {why}" if why else text


def _summary(first: subprocess.Popen, procs: list[subprocess.Popen], ranks: dict[int, int],
             stopped: set[int], late: set[int], reports: str, grace: float) -> str:
    """The failed attempt in one line: the rank that failed first and how, then what happened
    to every other rank of this node, ranks with the same fate together."""
    fates: dict[str, list[int]] = {}
    for p in procs:
        if p is first:
            continue
        rc, why = p.returncode, _reason(reports, ranks[p.pid])
        if p.pid in late:
            fate = f"{{was}} killed (SIGKILL: still running {grace:g} s after SIGTERM)"
        elif p.pid in stopped and rc == -signal.SIGTERM:
            fate = "{was} stopped (SIGTERM)"
        elif p.pid in stopped:
            fate = f"ended after SIGTERM ({_outcome(rc, why)})"
        elif rc == 0:
            fate = "had finished (exit code 0)"
        else:
            fate = f"also failed ({_outcome(rc, why)})"
        fates.setdefault(fate, []).append(ranks[p.pid])
    parts = [f"rank {ranks[first.pid]} failed first "
             f"({_outcome(first.returncode, _reason(reports, ranks[first.pid]))})"]
    for fate, rs in sorted(fates.items(), key=lambda kv: min(kv[1])):
        who = f"rank {rs[0]}" if len(rs) == 1 else f"ranks {', '.join(map(str, sorted(rs)))}"
        parts.append(f"{who} {fate.format(was='was' if len(rs) == 1 else 'were')}")
    return "; ".join(parts)


def attempt_secret(base: str, attempt: int) -> str:
    """The secret of restart ``attempt``: each node derives the same one from ``HPCDP_SECRET``,
    and a rank left over from an earlier attempt cannot authenticate to the new one."""
    if attempt == 0:
        return base
    return hmac.new(base.encode(), f"hpcdp-run attempt {attempt}".encode(), hashlib.sha256).hexdigest()


def _weak_secret(secret: str, master_addr: str) -> str | None:
    """Why ``secret`` is too guessable for a job whose store listens beyond loopback, or None."""
    from ..backends.tcp import check_secret, is_loopback  # late: the launcher needs no transport

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
    base = setting("HPCDP_SECRET") if nnodes > 1 else None
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
            if sup.summary:  # every failed attempt, restarted or not
                _say(sup.summary)
            if code == 0 or sup.received or failed is None:
                return code
            if sup.killed_by is not None:  # preempted or stopped, not broken: a restart would
                name = signal.Signals(sup.killed_by).name  # not get the signal again
                _say(f"rank {failed} was killed by {name}, which hpcdp-run forwarded to it; "
                     f"not restarting (a signal sent to the launcher ends the job)")
                return code
            if attempt == max_restarts:
                if max_restarts:
                    _say(f"rank {failed} exited with code {code}; no restarts left "
                         f"(--max-restarts {max_restarts}), giving up")
                return code
            _say(f"rank {failed} exited with code {code}; restarting all {nproc} rank(s) "
                 f"(restart {attempt + 1} of {max_restarts})")
    return code

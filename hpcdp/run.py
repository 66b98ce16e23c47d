"""``hpcdp-run``: start local TCP ranks like torchrun, or run one rank in-process under mpirun.

::

    hpcdp-run -n 4 train.py --lr 0.1            # 4 local ranks, output lines prefixed "[rank N] "
    hpcdp-run -n 4 --max-restarts 3 train.py    # restart all ranks when one fails (up to 3 times)
    hpcdp-run -n 4 --nnodes 2 --node-rank 0 --master-addr node01 train.py
    srun --ntasks-per-node=1 hpcdp-run -n 4 train.py   # nodes, node rank, master from SLURM
    mpirun -n 4 python -m hpcdp.run train.py    # in-process; an unhandled error aborts the job

When one rank exits non-zero the launcher stops the others (SIGTERM, then SIGKILL after a grace
period) and exits with that rank's code, so a failed job never hangs. A SIGTERM or SIGINT sent
to the launcher (SLURM preemption, Ctrl-C) is forwarded to the ranks, which get the same grace
period (``--grace``) to save a checkpoint; the launcher then exits with 128 + the signal number.
SIGUSR1 and SIGUSR2 (``#SBATCH --signal=USR1@60``) are only forwarded: ranks that use
``hpcdp.checkpoint.on_preempt`` save and exit by themselves.

With ``--max-restarts N`` a failed rank makes the launcher stop the others and start all of them
again, up to N times, each attempt with a fresh port and secret and ``HPCDP_RESTART_COUNT`` set
(0 on the first run); a script that resumes from ``hpcdp.checkpoint.latest()`` continues where it
stopped. A signal to the launcher never leads to a restart.
"""
from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import re
import runpy
import secrets
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import IO, Any, Mapping, Sequence

__all__ = ["main", "parse_nodelist", "node_layout", "launch", "attempt_secret"]

_MPI_ENV = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")
GRACE = 3.0


def parse_nodelist(spec: str) -> list[str]:
    """Expand a SLURM nodelist such as ``node[01-03,7],gpu7`` or ``r[1-2]-n[1-2]`` into host names."""
    hosts: list[str] = []
    for item in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", spec):  # commas outside brackets split
        hosts += _expand_hosts(item)
    return hosts


def _expand_hosts(pattern: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", pattern)
    if m is None:
        return [pattern]
    head, tail = pattern[:m.start()], pattern[m.end():]
    out: list[str] = []
    for part in m.group(1).split(","):
        if "-" in part:
            a, b = part.split("-", 1)
            values = [f"{i:0{len(a)}d}" for i in range(int(a), int(b) + 1)]
        else:
            values = [part]
        for v in values:
            out += _expand_hosts(head + v + tail)  # later brackets vary fastest, as in SLURM
    return out


def _slurm_int(environ: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        raw = environ.get(name)
        if raw:
            if not raw.isdigit():
                raise SystemExit(f"hpcdp-run: {name}={raw!r} is not a number")
            return int(raw)
    return None


def node_layout(nnodes: int | None, node_rank: int | None, master_addr: str | None,
                environ: Mapping[str, str]) -> tuple[int, int, str]:
    """``(nnodes, node_rank, master_addr)``: the flags given, the rest from SLURM or defaults.

    Under SLURM (``SLURM_JOB_ID`` set) the node count and master (first host) come from the
    srun step (``SLURM_STEP_NUM_NODES``, ``SLURM_STEP_NODELIST``) or, in the batch script
    itself, from the job (``SLURM_JOB_NUM_NODES``/``SLURM_NNODES``, ``SLURM_JOB_NODELIST``);
    this node's rank from ``SLURM_NODEID``. Without SLURM: one node, master 127.0.0.1.

    Args:
        nnodes, node_rank, master_addr: the command-line values (None where not given).
        environ: the environment to read, normally ``os.environ``.
    """
    if environ.get("SLURM_JOB_ID"):
        step = bool(environ.get("SLURM_STEP_NODELIST"))
        nodelist = (environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
                    or environ.get("SLURM_NODELIST") or "")
        hosts = parse_nodelist(nodelist)
        if step:
            count = _slurm_int(environ, "SLURM_STEP_NUM_NODES")
            tasks = _slurm_int(environ, "SLURM_STEP_NUM_TASKS")
            if nnodes is None and node_rank is None and tasks is not None and count is not None \
                    and tasks > count:
                raise SystemExit(
                    f"hpcdp-run: this srun step runs {tasks} tasks on {count} node(s); start one "
                    f"launcher per node (srun --ntasks-per-node=1 hpcdp-run -n RANKS_PER_NODE ...)")
        else:
            count = _slurm_int(environ, "SLURM_JOB_NUM_NODES", "SLURM_NNODES")
        if nnodes is None:
            nnodes = count if count is not None else (len(hosts) or None)
        if node_rank is None:
            node_rank = _slurm_int(environ, "SLURM_NODEID")
        if master_addr is None and hosts:
            master_addr = hosts[0]
    nnodes = 1 if nnodes is None else nnodes
    node_rank = 0 if node_rank is None else node_rank
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise SystemExit(f"hpcdp-run: --node-rank {node_rank} is outside --nnodes {nnodes}")
    return nnodes, node_rank, master_addr or "127.0.0.1"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hpcdp-run", description=__doc__.split("\n")[0])
    p.add_argument("-n", "--nproc-per-node", "--nproc", type=int, default=None,
                   help="ranks to start on this node (omit under mpirun/srun: run in-process)")
    p.add_argument("--nnodes", type=int, default=None)
    p.add_argument("--node-rank", type=int, default=None)
    p.add_argument("--master-addr", default=None)
    p.add_argument("--master-port", type=int, default=None)
    p.add_argument("--grace", type=float, default=GRACE,
                   help="seconds between SIGTERM and SIGKILL when stopping ranks")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="when a rank fails, restart all ranks up to this many times "
                        "(ranks see HPCDP_RESTART_COUNT)")
    p.add_argument("-m", dest="module", action="store_true", help="run the target as a module")
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER)
    return p


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


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
    from .backends._tcp_wire import check_secret, is_loopback  # late: no backend imported here

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
                port, secret = master_port or _free_port(), secrets.token_hex(32)
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


def run_inprocess(script: str, args: Sequence[str], module: bool = False) -> int:
    """Run ``script`` as ``__main__`` here; under MPI, abort the whole job on an unhandled error."""
    under_mpi = any(k in os.environ for k in _MPI_ENV)
    sys.argv = [script, *args]
    try:
        if module:
            runpy.run_module(script, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):  # sys.exit("message")
            sys.stderr.write(f"{_rank_label()}{exc.code}\n")
            sys.stderr.flush()
        if code and under_mpi:
            _abort(code)
        return code
    except BaseException:  # noqa: BLE001 - the point is to catch everything
        rank = _rank_label()
        text = traceback.format_exc()
        sys.stderr.write("".join(f"{rank}{line}\n" for line in text.rstrip("\n").split("\n")))
        sys.stderr.flush()
        if under_mpi:
            _abort(1)
        return 1
    return 0


def _rank_label() -> str:
    for k in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "RANK"):
        if os.environ.get(k, "").isdigit():
            return f"[rank {os.environ[k]}] "
    return ""


def _abort(code: int) -> None:
    """``MPI_Abort`` so ranks blocked in a collective or in MPI_Finalize cannot hang the job."""
    try:
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(code)
    except ImportError:
        pass
    os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point of ``hpcdp-run`` and ``python -m hpcdp.run``."""
    ns = _parser().parse_args(argv)
    args = list(ns.args)
    if args and args[0] == "--":
        args = args[1:]
    if ns.nproc_per_node is None:
        return run_inprocess(ns.script, args, ns.module)
    nnodes, node_rank, master = node_layout(ns.nnodes, ns.node_rank, ns.master_addr, os.environ)
    cmd = [sys.executable, "-u"] + (["-m", ns.script] if ns.module else [ns.script]) + args
    return launch(cmd, ns.nproc_per_node, nnodes=nnodes, node_rank=node_rank, master_addr=master,
                  master_port=ns.master_port, grace=ns.grace, max_restarts=ns.max_restarts)


if __name__ == "__main__":
    sys.exit(main())

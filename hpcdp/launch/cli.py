"""``hpcdp-run``: start local TCP ranks like torchrun, or run one rank in-process under mpirun.

::

    hpcdp-run -n 4 train.py --lr 0.1            # 4 local ranks, output lines prefixed "[rank N] "
    hpcdp-run -n 4 --max-restarts 3 train.py    # restart all ranks when one fails (up to 3 times)
    hpcdp-run -n 4 --nnodes 2 --node-rank 0 --master-addr node01 train.py
    srun -n $SLURM_JOB_NUM_NODES --ntasks-per-node=1 hpcdp-run -n 4 train.py   # layout from SLURM
    mpirun -n 4 python -m hpcdp.run train.py    # in-process; an unhandled error aborts the job

When one rank exits non-zero the launcher stops the others (SIGTERM, then SIGKILL after a grace
period) and exits with that rank's code, so a failed job never hangs. A SIGTERM or SIGINT sent
to the launcher (SLURM preemption, Ctrl-C) is forwarded to the ranks, which get the same grace
period (``--grace``) to save a checkpoint; the launcher then exits with 128 + the signal number.
SIGUSR1 and SIGUSR2 (``#SBATCH --signal=USR1@60``) are only forwarded: ranks that use
``hpcdp.checkpoint.on_preempt`` save and exit by themselves. Ranks run through a bootstrap
(``_boot``) that starts with those two blocked and remembers one that comes before the script
has a handler, so an early notice is neither fatal nor lost.

With ``--max-restarts N`` a failed rank makes the launcher stop the others and start all of them
again, up to N times, each attempt with a fresh port and secret and ``HPCDP_RESTART_COUNT`` set
(0 on the first run); a script that resumes from ``hpcdp.checkpoint.latest()`` continues where it
stopped. A signal to the launcher never leads to a restart: a rank killed by a signal the
launcher forwarded to it ends the job with 128 + that signal.
"""
from __future__ import annotations

import argparse
import os
import runpy
import sys
import threading
import time
import traceback
from typing import Sequence

from .. import trace
from ..comm.world import report_death
from ..progress import launcher_rank
from ._boot import remember as remember_early_signals
from ._local import GRACE, attempt_secret, launch, rank_command
from ._slurm import node_layout, parse_nodelist

__all__ = ["main", "parse_nodelist", "node_layout", "launch", "attempt_secret", "run_inprocess",
           "GRACE"]

_MPI_ENV = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hpcdp-run", description=__doc__.split("\n")[0].replace("``", ""),
        epilog="examples:\n" + __doc__.split("::\n", 1)[1].strip("\n").split("\n\n", 1)[0]
               + "\n\nWhen a rank fails, the others are stopped and one line on stderr names "
                 "the rank that\nfailed first (exit code or signal, and its exception) and "
                 "what happened to the others.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--nproc-per-node", "--nproc", type=int, default=None, metavar="N",
                   help="ranks to start on this node, as local TCP processes (omit under "
                        "mpirun/srun: the script then runs in-process as this MPI rank)")
    p.add_argument("--nnodes", type=int, default=None, metavar="N",
                   help="nodes in the job, one hpcdp-run on each (default: from SLURM, "
                        "SLURM_STEP_NUM_NODES or SLURM_JOB_NUM_NODES; else 1)")
    p.add_argument("--node-rank", type=int, default=None, metavar="I",
                   help="this node's index, 0 to NNODES-1; its ranks are I*N to I*N+N-1 "
                        "(default: SLURM_NODEID; else 0)")
    p.add_argument("--master-addr", default=None, metavar="HOST",
                   help="host of node 0, where the rendezvous store listens (default: the first "
                        "host of the SLURM node list; else 127.0.0.1)")
    p.add_argument("--master-port", type=int, default=None, metavar="PORT",
                   help="port of the rendezvous store (default: a free port on one node; 29500 "
                        "across nodes; restart K uses PORT+K)")
    p.add_argument("--grace", type=float, default=GRACE, metavar="SECONDS",
                   help="seconds between SIGTERM and SIGKILL when stopping ranks "
                        f"(default {GRACE:g})")
    p.add_argument("--max-restarts", type=int, default=0, metavar="K",
                   help="when a rank fails, restart all ranks up to this many times "
                        "(ranks see HPCDP_RESTART_COUNT; default 0)")
    p.add_argument("-m", dest="module", action="store_true",
                   help="run the target as a module, like python -m")
    p.add_argument("script", help="the training script (a module name with -m)")
    p.add_argument("args", nargs=argparse.REMAINDER,
                   help="arguments passed to the script (after an optional --)")
    return p


def run_inprocess(script: str, args: Sequence[str], module: bool = False) -> int:
    """Run ``script`` as ``__main__`` here; under MPI, abort the whole job on an unhandled error.

    From here on a SIGUSR1/SIGUSR2 without a handler is remembered for ``on_preempt`` instead of
    killing the rank (``_boot.remember``); before this process got here, it still kills it.
    """
    under_mpi = any(k in os.environ for k in _MPI_ENV)
    if threading.current_thread() is threading.main_thread():
        remember_early_signals(unblock=False)  # nobody blocked them for us here
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
    except BaseException as exc:  # noqa: BLE001 - the point is to catch everything
        rank = _rank_label()
        text = traceback.format_exc()
        sys.stderr.write("".join(f"{rank}{line}\n" for line in text.rstrip("\n").split("\n")))
        sys.stderr.flush()
        _dump_flight_record(exc)  # the abort below skips the excepthook's dump
        if under_mpi:
            _abort_after_peers_dumped(exc)
        return 1
    return 0


#: seconds an MPI rank that failed waits before aborting the job: peers blocked in a call with
#: it are told (its timeout's notice, or ``report_death``) and write their own flight records
ABORT_GRACE = 1.0


def _abort_after_peers_dumped(exc: BaseException) -> None:
    """``MPI_Abort`` the job, once the peers had a moment to write their flight records: the
    abort kills every rank at once, and a rank that would have failed a few milliseconds later
    (timed out in the same collective) would leave no record of where it was."""
    report_death(type(exc), exc)
    time.sleep(ABORT_GRACE)
    _abort(1)


def _dump_flight_record(exc: BaseException) -> None:
    """Write this rank's flight record (and flush its timeline)."""
    trace.dump(f"uncaught {type(exc).__name__}: {exc}")
    trace.flush_timelines()


def _rank_label() -> str:
    r = launcher_rank()  # the same rank the logger's prefix names
    return "" if r is None else f"[rank {r}] "


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
    cmd = rank_command(ns.script, args, ns.module)
    return launch(cmd, ns.nproc_per_node, nnodes=nnodes, node_rank=node_rank, master_addr=master,
                  master_port=ns.master_port, grace=ns.grace, max_restarts=ns.max_restarts)

"""Save at the next step boundary when the scheduler says the job must go, then requeue it.

::

    preempt = hpcdp.checkpoint.on_preempt(lambda: hpcdp.checkpoint.save(f"ckpt/step-{step}", state()))
    for step in range(start, steps):
        train_step()
        preempt.check()     # collective: every rank stops at the same step, saves, exits 0

With ``#SBATCH --signal=USR1@60`` Slurm sends SIGUSR1 to every task 60 s before the time limit
(``scancel --signal=USR1 JOBID`` does the same by hand). The handler only raises a flag: saving
inside a signal handler could interrupt a collective half-way. ``check()`` then agrees across the
group (one tiny allreduce) so that ranks signalled a few steps apart, or only some of them, all
stop at the same boundary and write one consistent checkpoint. Under Slurm, group rank 0 then runs
``scontrol requeue $SLURM_JOB_ID``: the job goes back to the queue under the same id, and its next
run resumes from ``hpcdp.checkpoint.latest()`` (``SLURM_RESTART_COUNT`` counts the requeues).

A notice may come before ``on_preempt`` is called. Ranks started by ``hpcdp-run`` begin with
SIGUSR1/SIGUSR2 blocked and remember one that arrives before any handler is in place
(``hpcdp.launch._boot``, also used by ``python -m hpcdp.run SCRIPT``); ``on_preempt`` takes it
over as a pending preemption, so the first ``check()`` saves. A process started some other way
(``mpirun python train.py``, ``srun python train.py``) has the default action until
``on_preempt`` runs: a SIGUSR1 before then kills it. Signal such jobs well after start
(``--signal=USR1@60`` fires 60 s before the time limit) or start them through ``hpcdp.run``.
"""
from __future__ import annotations

import os
import signal as _signal
import subprocess
import sys
import threading
from types import FrameType
from typing import Any, Callable

from .._config import setting
from ..comm.world import get_default_group, is_initialized
from ..errors import HpcdpError

__all__ = ["on_preempt", "Preemption", "restart_count", "slurm_job_id"]

#: seconds ``scontrol requeue`` may take before the requeue counts as failed
REQUEUE_TIMEOUT = 60.0

_lock = threading.Lock()
_requested: dict[int, bool] = {}  # signal number -> received since the last handled preemption
_previous: dict[int, Any] = {}  # signal number -> the handler ours replaced
_users: dict[int, int] = {}  # signal number -> open Preemption handles using our handler


def _handler(signum: int, frame: FrameType | None) -> None:
    # Only a flag: the step boundary (check) does the work, outside any collective.
    _requested[signum] = True
    prev = _previous.get(signum)
    if callable(prev):
        prev(signum, frame)


def _take_early(signum: int) -> bool:
    """Whether ``signum`` reached this process before any handler (remembered by the rank
    bootstrap, ``hpcdp.launch._boot``); after this call it is ours to handle."""
    boot = sys.modules.get("hpcdp.launch._boot")  # not loaded: nothing was remembered
    return bool(boot is not None and boot.take(signum))


def _signum(sig: int | str | _signal.Signals) -> int:
    if isinstance(sig, str):
        name = sig.upper()
        name = name if name.startswith("SIG") else "SIG" + name
        try:
            return int(getattr(_signal, name))
        except AttributeError:
            raise ValueError(f"on_preempt: unknown signal {sig!r}") from None
    return int(sig)


def _rank_of(group: Any) -> int:
    return group.rank if group is not None else 0


def restart_count() -> int:
    """How many times this job was restarted: ``hpcdp-run --max-restarts`` or Slurm requeues."""
    slurm = os.environ.get("SLURM_RESTART_COUNT", "")
    return max(setting("HPCDP_RESTART_COUNT"), int(slurm) if slurm.isdigit() else 0)


def slurm_job_id(environ: dict[str, str] | None = None) -> str | None:
    """The id ``scontrol requeue`` needs (``ARRAYJOB_TASK`` for array jobs), or None outside Slurm."""
    env = os.environ if environ is None else environ
    array, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"
    return env.get("SLURM_JOB_ID") or None


class Preemption:
    """A registered preemption handler; call ``check()`` at every step boundary.

    ``check()`` is collective over ``group`` (the default group when hpcdp is initialised): every
    rank must call it at the same boundaries.
    """

    def __init__(self, save_fn: Callable[[], Any], signum: int, *, requeue: bool, exit: bool,
                 group: Any, timeout: float) -> None:
        self._save_fn = save_fn
        self.signum = signum
        self.requeue = requeue
        self.exit = exit
        self._group = group
        self.timeout = timeout
        self._closed = False

    @property
    def requested(self) -> bool:
        """Whether this rank has received the signal (other ranks may not have yet)."""
        return bool(_requested.get(self.signum))

    def _resolve_group(self) -> Any:
        if self._group is not None:
            return self._group
        return get_default_group() if is_initialized() else None

    def check(self) -> bool:
        """At a step boundary: if any rank was signalled, save, requeue and exit 0 (collective).

        Returns False when nobody was signalled; with ``exit=False`` it returns True after
        saving (and requeueing) instead of raising ``SystemExit(0)``, so the caller can stop.
        """
        group = self._resolve_group()
        mine = self.requested
        agreed = mine
        if group is not None and group.size > 1:
            import numpy as np

            flag = np.array([1 if mine else 0], dtype=np.int32)
            agreed = bool(group.allreduce(flag, "max", timeout=self.timeout)[0])
        if not agreed:
            return False
        _requested[self.signum] = False  # a second signal later means a second preemption
        _take_early(self.signum)  # the same notice, if it also reached the bootstrap's handler
        rank = _rank_of(group)
        name = _signal.Signals(self.signum).name
        if rank == 0:
            print(f"hpcdp: preempted ({name}): saving at this step boundary", file=sys.stderr,
                  flush=True)
        self._save_fn()
        job = slurm_job_id() if self.requeue else None
        if job is not None:
            self._requeue(job, group, rank)
        if self.exit:
            raise SystemExit(0)
        return True

    def _requeue(self, job: str, group: Any, rank: int) -> None:
        # Every rank must be done with the checkpoint before the requeue ends this run.
        if group is not None and group.size > 1:
            group.barrier(timeout=self.timeout)
        error: str | None = None
        if rank == 0:
            # said before asking: Slurm may end this step while scontrol is still returning
            print(f"hpcdp: job {job} requeued; its next run resumes from the checkpoint",
                  file=sys.stderr, flush=True)
            error = _run_requeue(job, rank)
            if error is not None:
                print(f"hpcdp: the requeue of job {job} failed: {error}", file=sys.stderr, flush=True)
        if group is not None and group.size > 1:
            error = group.broadcast_object(error, 0, timeout=self.timeout)
        if error is not None:
            raise HpcdpError(error if rank == 0 else f"{error} (reported to rank {rank})")

    def close(self) -> None:
        """Stop listening: the last open handle puts the previous signal handler back."""
        if self._closed:
            return
        self._closed = True
        with _lock:
            _users[self.signum] -= 1
            if _users[self.signum] == 0 and threading.current_thread() is threading.main_thread():
                _signal.signal(self.signum, _previous.pop(self.signum, _signal.SIG_DFL))
                del _users[self.signum]
                _requested.pop(self.signum, None)

    def __enter__(self) -> Preemption:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _run_requeue(job: str, rank: int) -> str | None:
    """Run ``scontrol requeue JOB``; None on success, else a message naming the op and rank."""
    cmd = ["scontrol", "requeue", job]
    where = f"on_preempt: rank {rank}: 'scontrol requeue {job}'"
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=REQUEUE_TIMEOUT,
                             stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return f"{where} failed: scontrol is not on PATH (the checkpoint was saved)"
    except subprocess.TimeoutExpired:
        return f"{where} did not finish within {REQUEUE_TIMEOUT:.0f} s (the checkpoint was saved)"
    if res.returncode != 0:
        detail = (res.stderr or res.stdout).strip()[-500:]
        return (f"{where} exited with {res.returncode}: {detail or 'no output'} (the checkpoint was "
                f"saved; is the job requeueable? sbatch --requeue, JobRequeue=1)")
    return None


def on_preempt(save_fn: Callable[[], Any], *, signal: int | str = _signal.SIGUSR1,
               requeue: bool = True, exit: bool = True, group: Any = None,
               timeout: float = 300.0) -> Preemption:
    """Save with ``save_fn()`` at the next step boundary after ``signal``, requeue, exit 0.

    Call from the main thread (Python runs signal handlers there); simulated ranks, which are
    threads, may call it once the main thread has.

    Args:
        save_fn: saves the state (collective, like ``hpcdp.checkpoint.save``); no arguments.
        signal: the signal that announces preemption (SIGUSR1, as ``--signal=USR1@60`` sends).
        requeue: under Slurm, rank 0 runs ``scontrol requeue`` after saving.
        exit: raise ``SystemExit(0)`` after saving; False makes ``check()`` return True instead.
        group: the group that agrees on the boundary and saves (default: the default group).
        timeout: seconds the agreement, barrier and broadcast in ``check()`` may block.
    """
    signum = _signum(signal)
    if signum in (_signal.SIGKILL, _signal.SIGSTOP):
        raise ValueError(f"on_preempt: {_signal.Signals(signum).name} cannot be caught")
    with _lock:
        if signum not in _users:
            if threading.current_thread() is not threading.main_thread():
                raise HpcdpError(
                    f"on_preempt: rank {_rank_of(group)}: signal handlers can only be installed "
                    f"from the main thread; call on_preempt there first")
            _requested[signum] = False
            _previous[signum] = _signal.signal(signum, _handler)
            _users[signum] = 0
            if _take_early(signum):  # a notice that came before us counts
                _requested[signum] = True
        _users[signum] += 1
    return Preemption(save_fn, signum, requeue=requeue, exit=exit, group=group, timeout=timeout)

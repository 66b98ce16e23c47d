"""Rank bootstrap of ``hpcdp-run``: remember an early preemption notice, then run the script.

``hpcdp-run`` starts every rank with SIGUSR1 and SIGUSR2 blocked (a preemption notice, e.g.
``#SBATCH --signal=USR1@60``, may arrive while the interpreter is still starting) and runs it as
``python -u <this file> --path SCRIPT ARGS...`` (``--module NAME`` for ``-m``). Here a handler that
only remembers the signal is installed, the signals are unblocked (one that arrived meanwhile is
delivered now), and the script runs as ``__main__`` like ``python SCRIPT``. Without this, the
default action of SIGUSR1 kills a rank that has not installed a handler yet (exit 138), and a
restart would forget the preemption. ``hpcdp.checkpoint.on_preempt`` takes over a remembered
signal as a pending preemption (``take``); a script's own handler installed later does not see it.

This file is run by path, so that nothing of hpcdp is imported before the script does; it then
registers itself as ``hpcdp.launch._boot`` so that ``hpcdp.checkpoint.preempt`` finds the same
state. ``python -m hpcdp.run SCRIPT`` (in-process, e.g. under mpirun) calls ``remember`` too.
"""
from __future__ import annotations

import os
import runpy
import signal
import sys
from types import FrameType

__all__ = ["SIGNALS", "remember", "pending", "take", "main", "reason"]

#: the signals ``hpcdp-run`` forwards without stopping the job: preemption notices
SIGNALS: tuple[int, ...] = tuple(getattr(signal, n) for n in ("SIGUSR1", "SIGUSR2")
                                 if hasattr(signal, n))

_pending: set[int] = set()  # signals received with no handler of hpcdp's or the script's yet


def _remember(signum: int, _frame: FrameType | None) -> None:
    _pending.add(signum)


def remember(signals: tuple[int, ...] = SIGNALS, *, unblock: bool = True) -> None:
    """Install the remembering handler where the action is still the default, then unblock.

    A signal that is ignored (``SIG_IGN``) or already handled keeps its handler. Main thread only
    (Python's rule for signal handlers). ``unblock``: the signals were blocked for us (by
    ``hpcdp-run``); unblocking delivers one that was pending, which is remembered now.
    """
    for s in signals:
        if signal.getsignal(s) == signal.SIG_DFL:
            signal.signal(s, _remember)
    if unblock and hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)


def pending(signum: int) -> bool:
    """Whether ``signum`` arrived and nothing has taken it over yet."""
    return signum in _pending


def take(signum: int) -> bool:
    """Whether ``signum`` was pending; it is not any more (the caller handles it now)."""
    if signum in _pending:
        _pending.discard(signum)
        return True
    return False


def reason(exc: BaseException) -> str:
    """One line saying what ended a rank: ``ValueError: bad value`` (the message's first line,
    at most 200 characters); for ``sys.exit("text")`` the text, for ``sys.exit(N)`` nothing."""
    if isinstance(exc, SystemExit):
        return "" if exc.code is None or isinstance(exc.code, int) else str(exc.code)[:200]
    text = str(exc).strip().split("\n", 1)[0]
    line = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return line[:200]


def _write_reason(folder: str, exc: BaseException) -> None:
    """For ``hpcdp-run``'s summary: ``folder/RANK`` holds what ended this rank."""
    why = reason(exc)
    if not why:
        return
    try:
        with open(os.path.join(folder, os.environ.get("RANK", str(os.getpid()))), "w") as f:
            f.write(why)
    except OSError:
        pass  # the summary then gives the exit code alone


def main(argv: list[str]) -> None:
    """``[--report DIR] [--path SCRIPT | --module NAME] ARGS...``: remember early signals, run
    the target; with ``--report``, an exception that ends the script is named in ``DIR/RANK``
    (one line, for the launcher's summary) before it propagates as usual."""
    remember()
    report = None
    if argv[:1] == ["--report"] and len(argv) > 1:
        report, argv = argv[1], argv[2:]
    if len(argv) < 2 or argv[0] not in ("--path", "--module"):
        sys.exit(f"hpcdp-run: rank bootstrap: expected --path SCRIPT or --module NAME, got {argv!r}")
    try:
        _run(*argv[:2], argv[2:])
    except BaseException as exc:
        if report is not None:
            _write_reason(report, exc)
        raise


def _run(mode: str, target: str, args: list[str]) -> None:
    sys.argv = [target, *args]
    if mode == "--module":
        sys.path[0] = os.getcwd()  # as ``python -m``
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    elif os.path.isfile(target):
        sys.path[0] = os.path.dirname(os.path.realpath(target))  # as ``python SCRIPT``
        runpy.run_path(target, run_name="__main__")
    else:  # a directory or zip file with a __main__.py: run_path puts it first on sys.path
        del sys.path[0]
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    sys.modules.setdefault("hpcdp.launch._boot", sys.modules[__name__])
    main(sys.argv[1:])

"""Training-step marks, and the observers that act on them.

``step()`` is what a training loop (or DDP, once per synchronised backward) calls at the end of
a step: it puts a "step" mark on this rank's timeline, which ``plot`` splits the time at, and
tells every observer registered with ``on_step``. Observers are how a layer above ``trace``
acts on steps without ``trace`` importing it: ``hpcdp.comm.stragglers`` registers its straggler
report, which communicates, so ``trace`` itself never does.
"""
from __future__ import annotations

from typing import Any, Callable

from ._chrome import instant, state

__all__ = ["step", "on_step"]

_observers: list[Callable[[], Any]] = []


def on_step(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Call ``fn()`` at every ``step()`` on the calling rank (once per registration); returns
    ``fn`` (a decorator). What ``fn`` returns, when not None, is what ``step()`` returns."""
    if fn not in _observers:
        _observers.append(fn)
    return fn


def step() -> Any:
    """Mark the end of a training step on this rank: a "step" mark on its timeline
    (``HPCDP_TRACE=1``) and every ``on_step`` observer (e.g. the straggler report, collective
    every N steps: call ``step`` on every rank at the same points). Returns the last non-None
    value an observer returned (the straggler report, on the steps it reports), else None."""
    if state.on:
        instant("step", "step")
    return observe()


def observe() -> Any:
    """Call every ``on_step`` observer (``step`` without its mark); what ``step`` returns."""
    out = None
    for fn in _observers:
        got = fn()
        if got is not None:
            out = got
    return out

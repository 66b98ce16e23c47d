"""Seeing what happened: flight recorder, Chrome-trace timelines, divergence analysis, stragglers.

On by default: a ring of each rank's last operations (``recorder``), written to
``HPCDP_TRACE_DIR`` (``./hpcdp-trace/``) on a timeout, on SIGUSR1 and after an uncaught
exception (``install``, ``dump``). With ``HPCDP_TRACE=1``: a Chrome-trace timeline per rank
(``span``, ``instant``, ``counter``). Afterwards: ``python -m hpcdp.trace {analyze,merge,plot}``.
"""
from __future__ import annotations

from ._chrome import counter, disable, enable, enabled, instant, span, state, timeline
from ._chrome import close_all as close_timelines
from ._chrome import flush as flush_timelines
from ._clock import ClockSync, clock_offset_ns, estimate_clock_offset, set_clock_offset
from ._dump import dump, install, mark_finished, on_error, trace_dir
from ._recorder import (
    COMPLETED, FAILED, STARTED, TIMED_OUT, Recorder, active_recorder, bind_rank, configure,
    hide_frames, pinned_line, recorder, reset,
)
from ..comm.stragglers import StragglerReport, StragglerReporter, gather_arrivals, report_stragglers, step

__all__ = [
    "recorder", "active_recorder", "Recorder", "configure", "reset", "bind_rank", "hide_frames",
    "pinned_line",
    "install", "dump", "on_error", "mark_finished",
    "trace_dir", "STARTED", "COMPLETED", "TIMED_OUT", "FAILED", "span", "instant", "counter",
    "enable", "disable", "enabled", "state", "timeline", "flush_timelines", "close_timelines",
    "estimate_clock_offset", "ClockSync", "clock_offset_ns", "set_clock_offset", "report_stragglers",
    "StragglerReporter", "StragglerReport", "gather_arrivals", "step", "analyze", "merge", "plot",
]


def analyze(directory: str) -> str:
    """The lines ``python -m hpcdp.trace analyze DIR`` prints (one fact per line)."""
    from ._analyze import analyze as _analyze

    return _analyze(directory)


def merge(directory: str, out: str | None = None) -> str:
    """Merge ``directory``'s timelines into one Chrome trace; returns its path."""
    from ._merge import merge as _merge

    return _merge(directory, out)


def plot(source: str, out: str | None = None) -> str:
    """Draw time per phase per rank to a PNG; returns its path."""
    from ._plot import plot as _plot

    return _plot(source, out)

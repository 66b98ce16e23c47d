"""Seeing what happened: flight recorder, Chrome-trace timelines, divergence analysis.

On by default: a ring of each rank's last operations (``recorder``), written to
``HPCDP_TRACE_DIR`` (``./hpcdp-trace/``) on a timeout, on SIGUSR1 and after an uncaught
exception (``dump``). With ``HPCDP_TRACE=1``: a Chrome-trace timeline per rank (``span``,
``instant``, ``counter``; ``step`` marks where a training step ends). Afterwards:
``python -m hpcdp.trace {analyze,merge,plot}``.

This namespace holds what users call: read and size the recorder (``recorder``,
``configure``, ``reset``, ``bind_rank`` for a thread that acts as a rank, the entry states),
dump it, emit and control timeline events, line the clocks up, mark steps, and the offline
tools. The hooks the other layers call while recording (``install``, ``on_error``,
``active_recorder``, ``state``, ...) live in ``hpcdp.trace.hooks``. ``trace`` never
communicates on its own: the straggler report, which gathers over a group, is
``hpcdp.report_stragglers`` (``hpcdp.comm.stragglers``), driven by ``step``.
"""
from __future__ import annotations

from ._analyze import analyze
from ._chrome import counter, disable, enable, enabled, instant, span, timeline
from ._chrome import flush as flush_timelines
from ._clock import estimate_clock_offset
from ._dump import dump, trace_dir
from ._merge import merge
from ._plot import plot
from ._recorder import (
    COMPLETED, FAILED, STARTED, TIMED_OUT, Recorder, bind_rank, configure, recorder, reset,
)
from ._steps import step

__all__ = [
    "recorder", "Recorder", "configure", "reset", "bind_rank",
    "STARTED", "COMPLETED", "TIMED_OUT", "FAILED", "dump", "trace_dir",
    "span", "instant", "counter", "enable", "disable", "enabled", "timeline", "flush_timelines",
    "estimate_clock_offset", "step", "analyze", "merge", "plot",
]



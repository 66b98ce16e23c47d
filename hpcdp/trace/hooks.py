"""The hooks the layers that record into ``trace`` call; not for users (``hpcdp.trace`` is).

``hpcdp.comm`` records every operation (``active_recorder``, ``on_error``), arms the dumps
when a rank starts (``install``) and says when it finished (``record_finalize``); ``ddp``,
``fsdp``, ``pipeline`` and ``checkpoint`` test ``state.on`` before building timeline events
(DDP's backward, which every step repeats, is a ``Phase``: one entry for its spans and marks);
``comm.stragglers`` reads the clock offsets and registers for ``step`` marks (``on_step``);
``comm``'s watchdog names the user's line a blocked call was made from (``user_frame``).
They import this module, a public name, rather than ``trace``'s private modules.
"""
from __future__ import annotations

from ._chrome import close_all as close_timelines
from ._chrome import state
from ._clock import ClockSync, clock_offset_ns, set_clock_offset, wall_ns
from ._dump import count_p2p, install, mark_finished, on_error, record_finalize
from ._phase import Phase
from ._recorder import active_recorder, current_rank, hide_frames, hide_package, pinned_line, user_frame
from ._steps import on_step

__all__ = [
    "state", "Phase", "close_timelines", "ClockSync", "clock_offset_ns", "set_clock_offset", "wall_ns",
    "install", "mark_finished", "on_error", "record_finalize", "count_p2p", "active_recorder",
    "current_rank",
    "hide_frames", "hide_package", "pinned_line", "on_step", "user_frame",
]

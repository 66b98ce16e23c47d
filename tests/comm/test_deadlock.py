"""Deadlocks named (issue 25, item 5): a rank blocked past ``HPCDP_WARN_AFTER`` warns once, through
the ``hpcdp`` logger, what it waits for, on whom and from which line, and what that rank is blocked
in; ranks that wait on each other get a ``CommTimeoutError`` naming the cycle, each rank's call and
source line. Before, both waited the whole timeout and the error said only that "the peer has not
made the matching call". Ranks 0 and 1 play the parts; the others of a larger world look on.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import pytest

import hpcdp
from hpcdp.errors import CommTimeoutError
from hpcdp.testing import check
from hpcdp.testing.fixtures import World

pytestmark = pytest.mark.timeout(120)

FILE = "test_deadlock.py"


def _line(marker: str) -> int:
    with open(__file__) as fh:
        return next(i for i, t in enumerate(fh, 1) if marker in t and "_line(" not in t)


class _Warnings(logging.Handler):
    """The watchdog's warnings about one rank (simulated ranks share the logger)."""

    def __init__(self, world_rank: int) -> None:
        super().__init__(logging.WARNING)
        self.world_rank = world_rank
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "rank", None) == self.world_rank and "blocked" in record.getMessage():
            self.lines.append(record.getMessage())


def _watching(body, rank: int, *args) -> list[str]:  # noqa: ANN001
    """``body(rank, group, warnings, *args)`` with this rank's warnings collected."""
    g = hpcdp.get_default_group()
    h = _Warnings(g.ranks[g.rank])
    log = logging.getLogger("hpcdp")
    log.addHandler(h)
    try:
        return body(rank, g, h, *args)
    finally:
        log.removeHandler(h)


def _deadlock(rank: int, g, warned: _Warnings, how: str) -> list[str]:  # noqa: ANN001
    fails: list[str] = []
    if rank < 2:
        peer = 1 - rank
        buf = np.zeros(3)
        try:
            if how == "recv":
                g.recv(buf, peer, timeout=2.0)  # LINE-RECV
            else:
                g.irecv(buf, peer).wait(timeout=2.0)  # LINE-IRECV
            fails.append("the receive completed")
        except CommTimeoutError as exc:
            msg = str(exc)
            line = _line("LINE-RECV" if how == "recv" else "LINE-IRECV")
            mine = (f"rank {rank} waits for rank {peer} in recv(src={peer}, tag=0) #1 at "
                    f"{FILE}:{line}")
            theirs = (f"rank {peer} waits for rank {rank} in recv(src={rank}, tag=0) #1 at "
                      f"{FILE}:{line}")
            if mine not in msg or theirs not in msg or f"cycle {rank} -> {peer} -> {rank}" not in msg:
                fails.append(f"the timeout error does not name the cycle: {msg}")
        if len(warned.lines) != 1:
            fails.append(f"warned {len(warned.lines)} times: {warned.lines}")
        elif not all(w in warned.lines[0] for w in (
                f"in recv(src={peer}, tag=0) #1 at {FILE}:", f"waiting for rank {peer} to send",
                f"rank {peer} is itself blocked in recv(src={rank}, tag=0) #1 at {FILE}:",
                f"(a deadlock cycle: {rank} -> {peer} -> {rank})")):
            fails.append(f"the warning does not say who waits for whom: {warned.lines[0]}")
    g.barrier()  # nobody leaves while a peer still waits (a rank that left fails it sooner)
    return fails


def body_deadlock(rank: int, how: str) -> list[str]:
    return _watching(_deadlock, rank, how)


@pytest.mark.parametrize("how", ["recv", "irecv"])
def test_ranks_receiving_from_each_other_are_named_a_deadlock(world: World, how: str,
                                                              monkeypatch) -> None:
    monkeypatch.setenv("HPCDP_WARN_AFTER", "0.5")
    t0 = time.monotonic()
    check(world.run(body_deadlock, how, timeout=20))
    assert time.monotonic() - t0 < 60


def _slow_peer(rank: int, g, warned: _Warnings, delay: float,  # noqa: ANN001
               expect_warning: bool) -> list[str]:
    fails: list[str] = []
    if rank == 1:
        time.sleep(delay)  # busy outside hpcdp: it says nothing, and then sends
        g.send(np.arange(3.0), 0)
    elif rank == 0:
        got = g.irecv(np.zeros(3), 1).wait(timeout=20.0)  # LINE-SLOW
        if not np.array_equal(got, np.arange(3.0)):
            fails.append(f"received {got}")
    if rank == 0 and expect_warning:
        if len(warned.lines) != 1:
            fails.append(f"warned {len(warned.lines)} times: {warned.lines}")
        elif (f"recv(src=1, tag=0) #1 at {FILE}:{_line('LINE-SLOW')} on group" not in warned.lines[0]
              or "waiting for rank 1 to send; rank 1 has not said it is blocked" not in warned.lines[0]
              or "cycle" in warned.lines[0]):
            fails.append(f"the warning about a slow peer: {warned.lines[0]}")
    elif warned.lines:
        fails.append(f"warned: {warned.lines}")
    g.barrier()
    return fails


def body_slow_peer(rank: int, delay: float, expect_warning: bool) -> list[str]:
    return _watching(_slow_peer, rank, delay, expect_warning)


def test_a_slow_peer_is_warned_about_and_the_call_completes(world: World, monkeypatch) -> None:
    monkeypatch.setenv("HPCDP_WARN_AFTER", "0.3")
    check(world.run(body_slow_peer, 1.0, True, timeout=30))


def test_no_warning_when_the_interval_is_zero(world: World, monkeypatch) -> None:
    monkeypatch.setenv("HPCDP_WARN_AFTER", "0")
    check(world.run(body_slow_peer, 0.6, False, timeout=30))


def body_init_sets_the_interval(rank: int) -> list[str]:
    hpcdp.init(warn_after=0.3)  # (the rank's world already: init returns it, and sets this)
    return body_slow_peer(rank, 1.0, True)


def test_init_takes_the_warning_interval(monkeypatch) -> None:
    from hpcdp.comm import _watchdog
    monkeypatch.setenv("HPCDP_WARN_AFTER", "0")  # init's value wins over the environment's
    try:
        check(hpcdp.spawn(body_init_sets_the_interval, 2, backend="sim", timeout=30,
                          join_timeout=60))
    finally:
        _watchdog.set_warn_after(None)
    for bad, exc in ((-1, ValueError), (float("nan"), ValueError), (float("inf"), ValueError),
                     (True, TypeError), ("5", TypeError)):
        with pytest.raises(exc, match="warn_after"):
            hpcdp.init(warn_after=bad)

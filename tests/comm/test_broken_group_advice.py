"""Advice that works (issue 25, item 6): once a group refuses collectives for good, its error says
what works on that backend, and following the advice works. It used to say "create a new group to
continue", but ``new_group`` is a collective on the broken group itself.

What works where (found by trying it):

- simulated ranks: a collective given up on fails only that call on the ranks that come late;
  the group goes on working, so no advice is needed;
- TCP: the group stays failed (its channel is aborted); a group made from one that still works
  (``hpcdp.new_group`` on the default group) works, and ``hpcdp.finalize()`` then
  ``hpcdp.init()`` on every rank starts a new world in the same processes;
- MPI: a collective cannot be cancelled, so the group stays failed; a group made from another
  group works, but MPI cannot be initialised again in a process: the advice there is to restart
  the job (checked on the wording; a real collective timeout would leave an uncancellable call
  behind in the test job).
"""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

import hpcdp
from hpcdp.errors import CommTimeoutError, HpcdpError
from hpcdp.testing import check
from hpcdp.testing.fixtures import World, worlds

pytestmark = pytest.mark.timeout(120)

TCP_ADVICE = "hpcdp.finalize() then hpcdp.init() on every rank to start a new world"
NEW_GROUP_ADVICE = "make new groups from a group that still works (hpcdp.new_group on the default group"
MPI_RESTART = "restart the job (MPI cannot be initialised again within a process)"


def _give_up_on_one_collective(rank: int, g, gave_up: str) -> list[str]:  # noqa: ANN001
    """Rank 0 gives up on an allreduce of ``g``; the others make the call after it did.

    "After" is ordered by a file rank 0 writes once its call gave up, not by a fixed sleep: on
    a loaded machine rank 0 reached the call more than a sleep's 1.5 s after the others, and
    the allreduce it was to give up on completed. (Not ``tell_late_rank``'s message: on TCP the
    timeout leaves the default group failed, so no message could go over it.)"""
    fails: list[str] = []
    try:
        if rank == 0:
            try:
                g.allreduce(np.ones(2), timeout=0.5)
            finally:
                open(gave_up, "w").close()  # whatever happened: the others must not wait in vain
        else:
            deadline = time.monotonic() + 15  # (under the run's timeout: a crash shows as itself)
            while not os.path.exists(gave_up) and time.monotonic() < deadline:
                time.sleep(0.01)
            g.allreduce(np.ones(2), timeout=10)
        fails.append(f"rank {rank}: the allreduce rank 0 gave up on completed")
    except CommTimeoutError:
        if rank != 0:
            fails.append("a late rank timed out instead of failing at once")
    except HpcdpError:
        if rank == 0:
            raise
    return fails


def _again(g, fails: list[str]) -> str | None:  # noqa: ANN001
    """The next allreduce on ``g``: None if it worked, else its error's text."""
    try:
        got = g.allreduce(np.ones(2), timeout=10)
    except HpcdpError as exc:
        return str(exc)
    if not np.array_equal(got, np.full(2, g.size)):
        fails.append(f"allreduce gave {got}")
    return None


def body_default_group_given_up_on(rank: int, breaks: bool, gave_up: str) -> list[str]:
    g = hpcdp.get_default_group()
    fails = _give_up_on_one_collective(rank, g, gave_up)
    err = _again(g, fails)
    if not breaks:
        if err is not None:
            fails.append(f"the group did not recover: {err}")
        return fails
    if err is None:
        return fails + ["the group worked after a collective was given up on"]
    if TCP_ADVICE not in err or "create a new group" in err:
        fails.append(f"the error gives no advice that works: {err}")
    # follow it: a new world in the same processes
    hpcdp.finalize()
    g2 = hpcdp.init()
    if _again(g2, fails) is not None:
        fails.append("the new world's allreduce failed")
    return fails


@pytest.mark.parametrize("world", worlds("sim-2", "sim-4", "tcp-3"), indirect=True)
def test_after_a_collective_was_given_up_on_the_advice_works(world: World, tmp_path) -> None:
    check(world.run(body_default_group_given_up_on, world.backend == "tcp",
                    str(tmp_path / "gave-up"), timeout=20))


def body_sub_group_given_up_on(rank: int, breaks: bool, gave_up: str) -> list[str]:
    sub = hpcdp.new_group(list(range(hpcdp.world_size())))
    fails = _give_up_on_one_collective(rank, sub, gave_up)
    err = _again(sub, fails)
    if breaks and (err is None or NEW_GROUP_ADVICE not in err):
        fails.append(f"no advice, or not the one that works: {err}")
    if not breaks and err is not None:
        fails.append(f"the group did not recover: {err}")
    # the advice: a new group, made from the default group, which still works
    if _again(hpcdp.new_group(list(range(hpcdp.world_size()))), fails) is not None:
        fails.append("a group made from the default group failed")
    return fails


@pytest.mark.parametrize("world", worlds("sim-2", "tcp-3"), indirect=True)
def test_after_a_sub_group_failed_a_group_from_the_default_group_works(world: World,
                                                                   tmp_path) -> None:
    check(world.run(body_sub_group_given_up_on, world.backend == "tcp",
                    str(tmp_path / "gave-up"), timeout=20))


def body_mpi_wording(rank: int) -> list[str]:
    """The MPI messages, made the way the failures make them (``_note_failure`` after a
    collective failed or timed out; a peer's "left" notice), then the advice followed."""
    fails: list[str] = []
    g = hpcdp.get_default_group()  # (the harness's fresh group: broken here, dropped after)
    sub = g.new_group(list(range(g.size)))
    sub._note_failure("allreduce", 1, "timed out")
    try:
        sub.allreduce(np.ones(2))
        fails.append("a group whose collective timed out still ran one")
    except HpcdpError as exc:
        msg = str(exc)
        if (NEW_GROUP_ADVICE not in msg or MPI_RESTART not in msg or "create a new group" in msg
                or "hpcdp.init()" in msg):
            fails.append(f"the MPI advice: {msg}")
    sub.backend.notices.left = (1, (g.rank + 1) % g.size, "timed out in allreduce")
    try:
        sub.backend.notices.check(1)
        fails.append("a peer's departure did not fail the group")
    except HpcdpError as exc:
        if NEW_GROUP_ADVICE not in str(exc) or MPI_RESTART not in str(exc):
            fails.append(f"the MPI advice after a peer left: {exc}")
    # following it: a group made from one that still works
    if _again(g.new_group(list(range(g.size))), fails) is not None:
        fails.append("a group made from a working group failed")
    return fails


@pytest.mark.parametrize("world", worlds("mpi"), indirect=True)
def test_mpi_says_restart_the_job(world: World) -> None:
    """MPI only: the wording names what MPI allows (no re-initialisation in a process)."""
    check(world.run(body_mpi_wording))

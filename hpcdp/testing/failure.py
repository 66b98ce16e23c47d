"""Timeout and failure conformance bodies: a late rank, a rank that skips a collective, a rank
that left.

The contract (``Backend`` docstring): nothing blocks past its timeout, errors name the operation
and the rank, and a peer known to be gone fails the others fast instead of at the deadline.
"""
from __future__ import annotations

import re
import time
from typing import Sequence

import numpy as np

import hpcdp

from ._cases import call

__all__ = ["body_timeout", "body_collective_timeout", "body_finished_peer", "TIMEOUT_COLLECTIVES",
           "wait_until_others_gave_up", "tell_late_rank"]

#: every collective a ``body_collective_timeout`` case exists for
TIMEOUT_COLLECTIVES = ["allreduce", "broadcast", "reduce", "all_gather", "gather", "scatter",
                       "reduce_scatter", "all_to_all", "barrier"]


_GAVE_UP = 7301  # the tag of "I gave up on the allreduce" messages to the late rank


def wait_until_others_gave_up(late: int, wait: float = 60.0,
                              from_ranks: Sequence[int] | None = None) -> None:
    """On rank ``late``: return once every other rank of the default group (or each of
    ``from_ranks``) has called ``tell_late_rank`` (after its own call gave up): the
    message-ordered way to be late.

    A fixed sleep is not late enough on a loaded machine (on-time ranks can reach the call more
    than the sleep apart), and makes every run as slow as the worst case.
    """
    for r in range(hpcdp.world_size()) if from_ranks is None else from_ranks:
        if r != late:
            hpcdp.recv(np.empty(1), r, tag=_GAVE_UP, timeout=wait)


def tell_late_rank(late: int, wait: float = 60.0) -> None:
    """On an on-time rank, whatever its call did: let rank ``late`` go on (see above)."""
    hpcdp.send(np.zeros(1), late, tag=_GAVE_UP, timeout=wait)


def body_timeout(rank: int, late: int = 1, timeout: float = 0.5, wait: float = 60.0) -> list[str]:
    """Rank ``late`` joins an allreduce only after the others gave up on it (``timeout``): they
    raise ``CommTimeoutError`` naming the call and their rank, the late rank is not left
    hanging, and the world group still works.

    The late rank waits for a message from each on-time rank, not a fixed time: on a loaded
    machine on-time ranks reached the call more than the 1.5 s of a fixed sleep apart, the "late"
    rank was on time, and the allreduce succeeded. For the same reason an on-time rank may hear
    first that another on-time rank timed out (``PeerFailureError``): also a correct answer.
    The timed-out call runs on a group of its own, as a backend whose timeouts poison the group
    (``Backend.timeout_poisons_group``) would leave that group unusable.
    """
    n = hpcdp.world_size()
    fails: list[str] = []
    if n < 2:
        return fails
    sub = hpcdp.new_group(list(range(n)))
    if rank == late:
        wait_until_others_gave_up(late, wait)
    try:
        hpcdp.allreduce(np.ones(4), group=sub, timeout=timeout if rank != late else wait)
        if rank != late:
            fails.append("allreduce returned although a rank never joined in time")
    except hpcdp.CommTimeoutError as exc:
        text = str(exc)
        if rank == late:
            pass  # joined after the others gave up: a timeout is an allowed answer
        elif "allreduce" not in text or f"rank {rank}" not in text:
            fails.append(f"timeout message does not name the call and rank: {text}")
    except hpcdp.PeerFailureError as exc:
        # (the late rank has joined nothing yet: only an on-time rank can have left)
        if rank != late and late in tuple(getattr(exc, "peers", None) or ()):
            fails.append(f"on-time rank was told the late rank left, which had not: {exc}")
    except Exception as exc:  # noqa: BLE001 - collected and reported
        fails.append(f"raised {type(exc).__name__}: {exc}")
    if rank != late:  # whatever happened above: the late rank must not wait for us in vain
        tell_late_rank(late, wait)
    if hpcdp.allreduce(np.ones(1), timeout=wait)[0] != n:  # the world group is still healthy
        fails.append("world allreduce after the timeout wrong")
    return fails


def _timeout_roots(name: str, skip: int, n: int) -> tuple[int, bool]:
    """(root, whether a non-root rank may finish without the skipping rank) for ``name``.

    Broadcast and scatter are rooted at the skipping rank, so every other rank waits for data
    that never comes; reduce and gather are rooted at another rank, which waits for the skipping
    rank's part, while the other non-roots may return once they sent theirs.
    """
    if name in ("broadcast", "scatter"):
        return skip, False
    if name in ("reduce", "gather"):
        return (skip + 1) % n, True
    return 0, False


def body_collective_timeout(rank: int, name: str, skip: int = 1, timeout: float = 0.3,
                            wait: float = 60.0) -> list[str]:
    """Rank ``skip`` does not call collective ``name`` while the others do: each rank that needs
    the skipping rank raises ``CommTimeoutError`` naming the call and its own rank, not before
    its ``timeout``; the skipping rank is then not left hanging, and the world group still works.

    Ordered by messages, not sleeps: the skipping rank waits for a "gave up" message from each
    other rank before it makes its (late) call, so on a loaded machine it can never be on time,
    and the late call lets an MPI backend's abandoned requests drain. Only a lower bound is put
    on the time a rank took to give up (a slow machine may notice late; the harness caps hangs).
    As in ``body_timeout``, a rank may first hear that another on-time rank timed out
    (``PeerFailureError`` naming that rank): a correct answer too. The call runs on a group of
    its own, as a timeout may leave that group unusable (``Backend.timeout_poisons_group``).
    """
    n = hpcdp.world_size()
    fails: list[str] = []
    if n < 2:
        return fails
    skip %= n
    root, others_free = _timeout_roots(name, skip, n)
    x = np.arange(2 * n, dtype=np.float64) + rank
    sub = hpcdp.new_group(list(range(n)))
    label = f"{name}(root={root}) with rank {skip} skipping it, n={n}"

    def run(t: float) -> None:
        if name == "barrier":
            hpcdp.barrier(group=sub, timeout=t)
        else:
            call(name, x, "sum", root, sub, timeout=t)

    if rank == skip:
        wait_until_others_gave_up(skip, wait)
        try:  # every other rank gave up: any prompt answer is fine, only a hang is not
            run(timeout)
        except (hpcdp.CommTimeoutError, hpcdp.PeerFailureError):
            pass
        except Exception as exc:  # noqa: BLE001 - collected and reported
            fails.append(f"{label}: the late call raised {type(exc).__name__}: {exc}")
    else:
        free = others_free and rank != root
        t0 = time.monotonic()
        try:
            run(timeout)
            if not free:
                fails.append(f"{label}: returned although rank {skip} never called it")
        except hpcdp.CommTimeoutError as exc:
            took = time.monotonic() - t0
            text = str(exc)
            if not re.search(rf"(?<!\w){name} #\d+ ", text) or f"(rank {rank} of" not in text:
                fails.append(f"{label}: timeout message does not name the call and rank "
                             f"{rank}: {text}")
            if took < timeout * 0.95:
                fails.append(f"{label}: timed out after {took:.3f} s, before its {timeout} s")
        except hpcdp.PeerFailureError as exc:
            peers = tuple(getattr(exc, "peers", None) or ())
            text = str(exc)
            if skip in peers or ("timed out" not in text and "timeout" not in text) \
                    or name not in text or f"(rank {rank} of" not in text:
                fails.append(f"{label}: a peer failure other than an on-time rank's timeout: "
                             f"{exc}")
        except Exception as exc:  # noqa: BLE001 - collected and reported
            fails.append(f"{label}: raised {type(exc).__name__}: {exc}")
        tell_late_rank(skip, wait)  # whatever happened above: it must not wait for us in vain
    if hpcdp.allreduce(np.ones(1), timeout=wait)[0] != n:  # the world group is still healthy
        fails.append(f"{label}: world allreduce after the timeout wrong")
    return fails


def body_finished_peer(rank: int) -> str:
    """A rank that returned cannot join: a peer waiting on it fails fast, not at the timeout.

    Spawned backends only (under mpirun the process of a returned rank lives on).
    """
    if rank == 0:
        return "done"
    time.sleep(0.2)
    try:
        hpcdp.allreduce(np.ones(2))
    except hpcdp.PeerFailureError as exc:
        # with more ranks the news may come from a peer that failed because of rank 0
        named = (hpcdp.world_size() > 2 or 0 in (getattr(exc, "peers", None) or ())
                 or "rank 0" in str(exc) or "[0]" in str(exc))
        return "peer failure" if named else f"peer failure not naming rank 0: {exc}"
    except hpcdp.CommTimeoutError:
        return "timeout"
    return "no error"

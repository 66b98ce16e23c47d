"""Run a body on N ranks of any registered backend, or on the MPI world, and check the result."""
from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import traceback
from typing import Any, Callable, Sequence

import hpcdp
from ..backends import spawnable_backends
from ..comm import world as _world
from ..errors import HpcdpError

__all__ = ["run_ranks", "run_mpi", "check", "spawn_backends", "shared_dir", "remove_shared_dir"]


def run_ranks(backend: str, world_size: int, fn: Callable[..., Any], *args: Any,
              timeout: float = 30.0, join_timeout: float = 180.0) -> list[Any]:
    """``fn(rank, *args)`` on ``world_size`` ranks of ``backend``; each rank's return value.

    Args:
        timeout: the group timeout of collectives inside ``fn``.
        join_timeout: the hard cap on the whole run; stuck ranks raise instead of hanging.
    """
    return hpcdp.spawn(fn, world_size, backend=backend, args=args, timeout=timeout,
                       join_timeout=join_timeout)


#: seconds a collective inside a ``run_mpi`` body waits by default: well inside pytest's own
#: cap (300 s), so ranks left waiting by a peer that went astray give up and report in time
MPI_BODY_TIMEOUT = 120.0
_runs = itertools.count(1)


def run_mpi(fn: Callable[..., Any], *args: Any, timeout: float = MPI_BODY_TIMEOUT) -> list[Any]:
    """``fn(rank, *args)`` on every rank of the default group; every rank gets every rank's
    result. Collective.

    The body runs on a fresh group of the same ranks (its default group for the call), so what
    it leaves behind cannot reach the next call: an MPI collective that timed out leaves its
    group out of step for good. A body that raises on some ranks still takes part in the
    exchange of results on the default group, so the ranks stay in step, and then every rank
    raises ``AssertionError`` naming each rank's exception.

    Args:
        timeout: the fresh group's timeout (a call's own ``timeout=`` still wins).
    """
    parent = hpcdp.get_default_group()
    if parent.size == 1:  # nothing to keep in step
        return [fn(parent.rank, *args)]
    if parent._broken:
        raise HpcdpError(f"run_mpi (rank {parent.rank}): group {parent.name} is out of step "
                         f"since an earlier test ({parent._broken}); later multi-rank tests "
                         "cannot run in this job")
    group = parent.new_group(list(range(parent.size)), name=f"{parent.name}.run{next(_runs)}",
                             timeout=timeout)
    outer = getattr(_world._tls, "group", None)
    # started as the parent was, so that a body's own hpcdp.init() returns the fresh group
    _world.set_thread_default(group, _world.started_as(parent))
    try:
        mine: tuple[str, Any] = ("ok", fn(group.rank, *args))
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - reported on every rank below (pytest's
        # own timeout raises a BaseException, which must not skip the exchange either)
        raised = exc
        mine = ("raised", f"{type(exc).__name__}: {exc}\n"
                          + "".join(traceback.format_exception(exc)[-6:]))
    else:
        raised = None
    finally:
        _world.set_thread_default(outer)
    try:
        everyone = parent.all_gather_object(mine)
    finally:
        # its communicators (and those of groups the body made) would otherwise stay polled by
        # every later wait of the job
        group.shutdown()
    failed = [f"rank {r} raised {text}" for r, (kind, text) in enumerate(everyone)
              if kind == "raised"]
    if failed:
        raise AssertionError(f"run_mpi({getattr(fn, '__name__', fn)}): "
                             + "\n".join(failed)) from raised
    return [value for _, value in everyone]


def check(per_rank: Sequence[Any], limit: int = 20) -> None:
    """Assert that no rank reported a failure (bodies return lists of failure messages)."""
    fails = [f"rank {r}: {f}" for r, fs in enumerate(per_rank) for f in (fs or [])]
    more = f"\n... and {len(fails) - limit} more" if len(fails) > limit else ""
    assert not fails, f"{len(fails)} failure(s):\n" + "\n".join(fails[:limit]) + more


def spawn_backends() -> list[str]:
    """Registered backends that ``hpcdp.spawn`` can start in a test (the test matrix)."""
    return spawnable_backends()


def shared_dir(base: str | None = None, prefix: str = "hpcdp-test-") -> str:
    """A fresh directory every rank of the default group sees: rank 0 creates it, and its name
    is broadcast (one process under sim: the same string)."""
    d = tempfile.mkdtemp(prefix=prefix, dir=base) if hpcdp.rank() == 0 else None
    return hpcdp.broadcast_object(d, root=0)


def remove_shared_dir(path: str) -> None:
    """Collective: every rank is done with ``path`` before rank 0 removes it."""
    hpcdp.barrier()
    if hpcdp.rank() == 0 and os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)

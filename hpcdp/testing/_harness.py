"""Run a body on N ranks of any registered backend, or on the MPI world, and check the result."""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any, Callable, Sequence

import hpcdp

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


def run_mpi(fn: Callable[..., Any], *args: Any) -> list[Any]:
    """Run a body on every rank of the default group; every rank gets every rank's result."""
    mine = fn(hpcdp.rank(), *args)
    return hpcdp.all_gather_object(mine)


def check(per_rank: Sequence[Any], limit: int = 20) -> None:
    """Assert that no rank reported a failure (bodies return lists of failure messages)."""
    fails = [f"rank {r}: {f}" for r, fs in enumerate(per_rank) for f in (fs or [])]
    assert not fails, f"{len(fails)} failure(s):\n" + "\n".join(fails[:limit])


def spawn_backends() -> list[str]:
    """Registered backends that ``hpcdp.spawn`` can start in a test (the test matrix)."""
    from ..backends import spawnable_backends

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

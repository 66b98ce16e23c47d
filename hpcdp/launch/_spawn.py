"""``spawn``: run ``fn(rank)`` on N fresh ranks and collect what each returns.

How a backend's ranks start is the launcher's business; the backend only declares what it
supports in the registry (``register_backend``): ranks that are threads of this process
(``thread_world``: the backend ``shares_process``), local processes that meet through the
launcher's environment (``processes``, ``_processes``), or a ``spawn`` of its own.
"""
from __future__ import annotations

import functools
import threading
import time
from typing import Any, Callable

from .. import trace
from ..backends import backend_entry, spawnable_backends
from ..comm import stragglers
from ..comm.group import ProcessGroup
from ..comm.validation import check_timeout
from ..comm.world import set_thread_default, start_tracing
from ..errors import HpcdpError, PeerFailureError
from ._processes import spawn_processes

__all__ = ["spawn", "spawn_threads"]


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *,
    backend: str = "sim",
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float | None = None,
    join_timeout: float | None = None,
) -> list[Any]:
    """Run ``fn(rank, *args, **kwargs)`` on ``world_size`` ranks; return each rank's result.

    Inside ``fn`` the default group is that rank's, so ``hpcdp.allreduce`` etc. just work. If a rank
    raises, its peers get ``PeerFailureError`` instead of hanging, and ``spawn`` re-raises the
    first root-cause exception with the failing rank noted.

    Args:
        backend: any registered backend whose ranks can be started here
            (``hpcdp.backends.spawnable_backends()``: "sim" threads here, "tcp" local processes).
        timeout: the group timeout for collectives inside ``fn``.
        join_timeout: how long to wait for all ranks to finish (default: none).
    """
    if world_size < 1:
        raise ValueError(f"spawn: world_size must be >= 1, got {world_size}")
    if timeout is not None:
        check_timeout("spawn(timeout=...)", timeout)
    if join_timeout is not None:
        check_timeout("spawn(join_timeout=...)", join_timeout)
    run = _starter(backend)
    if run is None:
        raise ValueError(f"spawn: backend must be one of {spawnable_backends()}, got {backend!r}")
    return run(fn, world_size, args=args, kwargs=kwargs or {}, timeout=timeout,
               join_timeout=join_timeout)


def _starter(backend: str) -> Callable[..., list[Any]] | None:
    """How to start ``backend``'s ranks, from what its registry entry declares."""
    if backend not in spawnable_backends():
        return None
    entry = backend_entry(backend)
    assert entry is not None
    if entry.spawn is not None:
        return entry.spawn
    if entry.thread_world is not None:
        return functools.partial(spawn_threads, thread_world=entry.thread_world, backend=backend)
    return functools.partial(spawn_processes, backend=backend)


def spawn_threads(fn: Callable[..., Any], world_size: int, *, thread_world: Callable[[int], Any],
                  backend: str = "sim", args: tuple[Any, ...] = (),
                  kwargs: dict[str, Any] | None = None, timeout: float | None = None,
                  join_timeout: float | None = None) -> list[Any]:
    """``spawn`` for a backend whose ranks share this process: one thread per rank.

    ``thread_world(world_size)`` (the backend's registry entry) makes the ranks: an object with
    ``backend(rank)`` and ``mark_dead(rank, why)``.
    """
    kwargs = kwargs or {}
    world = thread_world(world_size)
    results: list[Any] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    def run(r: int) -> None:
        group = ProcessGroup(world.backend(r), name="world", timeout=timeout)
        set_thread_default(group, backend)
        try:
            start_tracing(group)  # this thread is rank r: its recorder, its dumps
            results[r] = fn(r, *args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - reported by spawn
            errors[r] = exc
            # before peers learn of it: their PeerFailureError dumps are rate-limited
            trace.dump(f"uncaught {type(exc).__name__} on simulated rank {r}: {exc}")
            world.mark_dead(r, f"{type(exc).__name__}: {exc}")
        finally:
            stragglers.stop()
            set_thread_default(None)
            # A rank that returned can no longer join anything: peers still waiting on it fail
            # fast, as on TCP. Messages it already sent stay readable.
            world.mark_dead(r, "it returned from its function")

    threads = [threading.Thread(target=run, args=(r,), name=f"hpcdp-{backend}-rank{r}", daemon=True)
               for r in range(world_size)]
    for t in threads:
        t.start()
    deadline = None if join_timeout is None else time.monotonic() + join_timeout
    for t in threads:
        t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    stuck = [r for r, t in enumerate(threads) if t.is_alive()]
    if stuck:
        for r in stuck:
            world.mark_dead(r, "did not finish in time")
        raise HpcdpError(f"spawn: rank(s) {stuck} did not finish within {join_timeout} s")
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        root = next(((r, e) for r, e in failed if not isinstance(e, PeerFailureError)), failed[0])
        r, exc = root
        exc.add_note(f"(raised on simulated rank {r} of {world_size})")
        raise exc
    return results

"""``spawn``: run ``fn(rank)`` on N ranks in this process (sim threads) or as local processes (tcp)."""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

from .. import trace
from ..comm.validation import check_timeout
from ..comm.world import _set_thread_default, _start_tracing
from ..errors import HpcdpError, PeerFailureError
from ..comm import stragglers
from ..backends import backend_spawner, spawnable_backends
from ..comm.group import ProcessGroup

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
        backend: any registered backend with a ``spawn`` (``hpcdp.backends.spawnable_backends()``:
            "sim" threads here, "tcp" local processes).
        timeout: the group timeout for collectives inside ``fn``.
        join_timeout: how long to wait for all ranks to finish (default: none).
    """
    if world_size < 1:
        raise ValueError(f"spawn: world_size must be >= 1, got {world_size}")
    if timeout is not None:
        check_timeout("spawn(timeout=...)", timeout)
    if join_timeout is not None:
        check_timeout("spawn(join_timeout=...)", join_timeout)
    run = backend_spawner(backend)
    if run is None:
        raise ValueError(f"spawn: backend must be one of {spawnable_backends()}, got {backend!r}")
    return run(fn, world_size, args=args, kwargs=kwargs or {}, timeout=timeout,
               join_timeout=join_timeout)


def spawn_threads(fn: Callable[..., Any], world_size: int, *, args: tuple[Any, ...] = (),
                  kwargs: dict[str, Any] | None = None, timeout: float | None = None,
                  join_timeout: float | None = None) -> list[Any]:
    """``spawn`` for the simulated backend: one thread per rank in this process."""
    kwargs = kwargs or {}
    from ..backends.sim import SimWorld, _sim_world_factory

    world = SimWorld(world_size)
    make = _sim_world_factory(world)
    results: list[Any] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    def run(r: int) -> None:
        group = ProcessGroup(make(r), name="world", timeout=timeout)
        _set_thread_default(group, "sim")
        try:
            _start_tracing(group)  # this thread is rank r: its recorder, its dumps
            results[r] = fn(r, *args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - reported by spawn
            errors[r] = exc
            # before peers learn of it: their PeerFailureError dumps are rate-limited
            trace.dump(f"uncaught {type(exc).__name__} on simulated rank {r}: {exc}")
            world.mark_dead(r, f"{type(exc).__name__}: {exc}")
        finally:
            stragglers.stop()
            _set_thread_default(None)
            # A rank that returned can no longer join anything: peers still waiting on it fail
            # fast, as on TCP. Messages it already sent stay readable.
            world.mark_dead(r, "it returned from its function")

    threads = [threading.Thread(target=run, args=(r,), name=f"hpcdp-sim-rank{r}", daemon=True)
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

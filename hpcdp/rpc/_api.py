"""Module-level RPC functions: they act on the calling thread's agent (see ``_context``)."""
from __future__ import annotations

import atexit
import threading
import weakref
from typing import Any

from ..comm import world as _world
from .._config import SETTINGS, setting
from ..comm.validation import check_timeout
from ..errors import HpcdpError
from . import _context
from ._agent import Agent, WorkerInfo
from ._codec import Limits
from ._future import Future
from ._rref import RRef

__all__ = ["init_rpc", "shutdown", "rpc_sync", "rpc_async", "remote", "get_worker_info",
           "is_initialized", "stats"]

DEFAULT_TIMEOUT = SETTINGS["HPCDP_RPC_TIMEOUT"].default
_agents: "weakref.WeakSet[Agent]" = weakref.WeakSet()
_atexit_lock = threading.Lock()
_atexit_done = False


def _default_timeout() -> float:
    return setting("HPCDP_RPC_TIMEOUT")


def _close_all() -> None:
    """At exit, before MPI finalises (atexit runs in reverse order): stop every agent still up."""
    for agent in list(_agents):
        try:
            agent.close(False, "interpreter exit without rpc.shutdown()")
        except Exception:  # noqa: BLE001 - exiting anyway
            pass


def init_rpc(name: str, *, group: Any = None, rpc_timeout: float | None = None,
             num_worker_threads: int = 16, limits: Limits | None = None,
             init_timeout: float | None = None) -> WorkerInfo:
    """Start this worker's RPC agent; collective over ``group`` (default: the default group).

    Args:
        name: this worker's unique name (other workers call it by this name).
        rpc_timeout: default per-call timeout in seconds (``HPCDP_RPC_TIMEOUT``, else 60).
        num_worker_threads: threads that run incoming calls (more calls wait in a queue).
        limits: caps on incoming messages (also announced to peers, which check them before
            sending); default ``Limits()``.
        init_timeout: seconds to wait for the other workers (default: the group's timeout).
    """
    global _atexit_done
    if not isinstance(name, str) or not 1 <= len(name) <= 128:
        raise ValueError(f"init_rpc: name must be a str of 1 to 128 characters, got {name!r}")
    existing = _context.peek()
    if existing is not None and existing.state != "closed":
        raise HpcdpError(f"init_rpc({name!r}): RPC is already running here as "
                         f"{existing.names[existing.rank]!r}; call rpc.shutdown() first")
    group = group if group is not None else _world.get_default_group()
    # every deadline must be able to pass: inf, nan, <= 0 and non-numbers are refused here,
    # not by the first call's ``OverflowError: timestamp out of range``
    timeout = _default_timeout() if rpc_timeout is None else check_timeout(
        f"init_rpc({name!r}): rpc_timeout={rpc_timeout!r}", rpc_timeout, named=True)
    if init_timeout is not None:
        init_timeout = check_timeout(f"init_rpc({name!r}): init_timeout={init_timeout!r}",
                                     init_timeout, named=True)
    agent = Agent(name, group, timeout=timeout, num_worker_threads=num_worker_threads,
                  limits=limits or Limits(),
                  init_timeout=group.timeout if init_timeout is None else init_timeout)
    # ranks that are threads of one process each have their own agent (per thread)
    threads = group.backend.shares_process
    _context.set_current(agent, process_wide=not threads or _world._default is group)
    with _atexit_lock:
        _agents.add(agent)
        if not _atexit_done:
            atexit.register(_close_all)
            _atexit_done = True
    return agent.worker_info(agent.rank)


def shutdown(graceful: bool = True, timeout: float | None = None) -> None:
    """Stop this worker's agent; by default wait until no RPC work is left on any worker.

    Graceful shutdown is collective: every worker calls it. ``graceful=False`` drops pending
    calls (their futures fail) and leaves at once; peers see this worker as gone.

    Args:
        timeout: seconds to wait for the other workers (default: the agent's RPC timeout).
    """
    agent = _context.current("shutdown")
    t = agent.timeout_of(timeout, "shutdown")  # a bad timeout leaves the agent running
    try:
        agent.coord.shutdown(graceful, t)
    finally:
        _context.clear(agent)


def rpc_sync(to: Any, func: Any, args: Any = None, kwargs: Any = None,
             timeout: float | None = None) -> Any:
    """Run registered ``func(*args, **kwargs)`` on worker ``to`` and return its result.

    Args:
        to: worker name, rank or ``WorkerInfo``.
        func: a function or class registered with ``@rpc.register``, or its registered name.
        timeout: seconds before ``CommTimeoutError`` (default: the agent's RPC timeout).
    """
    return _context.current("rpc_sync").calls.call("rpc_sync", to, func, args, kwargs, timeout)


def rpc_async(to: Any, func: Any, args: Any = None, kwargs: Any = None,
              timeout: float | None = None) -> Future:
    """Like ``rpc_sync`` but return a ``Future`` at once (``wait``, ``done``, ``then``)."""
    return _context.current("rpc_async").calls.call("rpc_async", to, func, args, kwargs, timeout)


def remote(to: Any, func: Any, args: Any = None, kwargs: Any = None,
           timeout: float | None = None) -> RRef:
    """Run ``func`` on worker ``to`` and return an ``RRef`` to the result, which stays there.

    The call returns at once; errors of ``func`` surface on ``to_here()`` or method calls.
    """
    return _context.current("remote").calls.remote(to, func, args, kwargs, timeout)


def get_worker_info(name: str | None = None) -> WorkerInfo:
    """``WorkerInfo(name, id)`` of the named worker, or of this one."""
    agent = _context.current("get_worker_info")
    return agent.worker_info(agent.rank if name is None else agent.resolve(name, "get_worker_info"))


def is_initialized() -> bool:
    agent = _context.peek()
    return agent is not None and agent.state != "closed"


def stats() -> dict[str, int]:
    """This worker's RRef counts (values owned, their forks and local handles, forks held,
    pending children) and outstanding requests: for tests and debugging."""
    agent = _context.current("stats")
    out = agent.rrefs.stats()
    out["pending_requests"] = agent.pending_count()
    return out

"""Which agent an RPC call uses: this thread's (simulated ranks, agent threads), else the process's."""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

from ..errors import HpcdpError

__all__ = ["current", "set_current", "using", "clear"]

_tls = threading.local()
_process: Any = None


def current(op: str) -> Any:
    agent = getattr(_tls, "agent", None) or _process
    if agent is None:
        raise HpcdpError(f"rpc.{op}: RPC is not initialised in this process or thread; call "
                         "hpcdp.rpc.init_rpc(name) first")
    return agent


def peek() -> Any:
    return getattr(_tls, "agent", None) or _process


def set_current(agent: Any, *, process_wide: bool) -> None:
    global _process
    _tls.agent = agent
    if process_wide:
        _process = agent


def clear(agent: Any) -> None:
    global _process
    if getattr(_tls, "agent", None) is agent:
        _tls.agent = None
    if _process is agent:
        _process = None


@contextlib.contextmanager
def using(agent: Any) -> Iterator[None]:
    """Make ``agent`` current in this thread for the block (None: leave as is)."""
    if agent is None:
        yield
        return
    old = getattr(_tls, "agent", None)
    _tls.agent = agent
    try:
        yield
    finally:
        _tls.agent = old

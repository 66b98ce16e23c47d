"""The caller's side: ``rpc_sync``/``rpc_async``, ``remote``, ``to_here`` and RRef method calls.

The agent holds one ``Calls`` (``agent.calls``); the module-level functions (``_api``) and
``RRef`` call it. It builds requests and leaves sending, deadlines and replies to the agent.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import HpcdpError, PeerFailureError
from . import _protocol as P
from . import _registry
from ._duty import before_blocking
from ._future import Future
from ._rref import RRef, show

if TYPE_CHECKING:
    from ._agent import Agent

__all__ = ["Calls"]

MAX_NAME = 256


class Calls:
    """What user code calls, on one ``Agent``.

    Of the agent it uses: ``rank``, ``state`` (read when used), ``resolve``, ``what``,
    ``timeout_of`` and ``request`` (naming, deadlines, sending), ``rrefs``, and its
    ``serving`` (a ``remote`` on this worker computes the value here, without a message)."""

    __slots__ = ("_agent", "_rank", "_rrefs")

    def __init__(self, agent: "Agent") -> None:
        self._agent = agent
        self._rank = agent.rank
        self._rrefs = agent.rrefs

    def func_name(self, func: Any, op: str) -> str:
        if isinstance(func, str):
            if not func or len(func) > MAX_NAME:
                raise ValueError(f"rpc.{op} on rank {self._rank}: bad function name {func[:60]!r}")
            return func
        name = _registry.name_of(func)
        if name is None:
            raise TypeError(f"rpc.{op} on rank {self._rank}: "
                            f"{getattr(func, '__qualname__', repr(func))} is not registered; "
                            "decorate it with @hpcdp.rpc.register (only registered functions and "
                            "classes can be called remotely)")
        return name

    def _args(self, args: Any, kwargs: Any, what: str) -> tuple[tuple, dict]:
        if args is None:
            args = ()
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"{what}: args must be a tuple or list, got {type(args).__name__}")
        kwargs = {} if kwargs is None else kwargs
        if not isinstance(kwargs, dict) or any(type(k) is not str for k in kwargs):
            raise TypeError(f"{what}: kwargs must be a dict with str keys")
        return tuple(args), dict(kwargs)

    def call(self, mode: str, to: Any, func: Any, args: Any, kwargs: Any,
             timeout: float | None) -> Any:
        """``rpc_sync`` (the result) or ``rpc_async`` (a ``Future``)."""
        dst = self._agent.resolve(to, mode)
        name = self.func_name(func, mode)
        what = self._agent.what(mode, repr(name), dst)
        body = self._args(args, kwargs, what)
        fut = self._agent.request(dst, P.CALL, [name], body, what,
                                  self._agent.timeout_of(timeout, mode))
        if mode != "rpc_sync":
            return fut
        try:
            return fut.wait()
        finally:
            fut = body = None  # not kept alive by the traceback of a failed call

    def remote(self, to: Any, func: Any, args: Any, kwargs: Any, timeout: float | None) -> RRef:
        dst = self._agent.resolve(to, "remote")
        name = self.func_name(func, "remote")
        what = self._agent.what("remote", repr(name), dst)
        return self._remote(dst, name, None, None, self._args(args, kwargs, what), what, timeout)

    def _remote(self, dst: int, name: str, target: RRef | None, method: str | None,
                body: tuple, what: str, timeout: float | None) -> RRef:
        t = self._agent.timeout_of(timeout, "remote")
        if dst == self._rank:  # owned here: no message, the value is computed on our pool
            if self._agent.state != "running":
                raise HpcdpError(f"{what}: RPC has shut down on this worker")
            rec = self._rrefs.new_local()
            handle = self._rrefs.owner_handle(rec)
            self._agent.serving.compute_into(
                rec, self._rank, name, None if target is None else list(target._rid), method,
                lambda: body)
            return handle
        rid, fid = self._rrefs.next_id(), self._rrefs.next_id()
        user = self._rrefs.new_user(rid, fid, dst)
        if target is not None:
            self._wait_fork_sent(target, what, t)
        tfield = None if target is None else list(target._rid)
        try:
            fut = self._agent.request(dst, P.REMOTE, [name, list(rid), list(fid), tfield, method],
                                      body, what, t)
        except BaseException:
            self._rrefs.remote_acked(fid, user._state, _Failed("not sent"))
            raise
        fut._on_done(lambda f: self._rrefs.remote_acked(fid, user._state, f))
        return user

    def _wait_fork_sent(self, rref: RRef, what: str, timeout: float) -> None:
        """A fork from a third worker is announced to the owner before we use it there."""
        st = rref._state
        if st is not None and not st.fork_sent.is_set():
            before_blocking()
        if st is not None and not st.fork_sent.wait(timeout):
            raise HpcdpError(f"{what}: this RRef's fork was not announced to its owner within "
                             f"{timeout:g} s")
        if st is not None and st.failed:
            raise PeerFailureError(f"{what}: the RRef is unusable: {st.failed}",
                                   peers=[rref._owner])

    def fetch(self, rref: RRef, timeout: float | None) -> Any:
        what = self._agent.what("RRef.to_here", f"of RRef {show(rref._rid)}", rref._owner)
        t = self._agent.timeout_of(timeout, "RRef.to_here")
        if rref._fid is None:
            return self._rrefs.local_value(rref._rid, t, "to_here")
        self._wait_fork_sent(rref, what, t)
        return self._agent.request(rref._owner, P.FETCH, [list(rref._rid)], None, what, t).wait()

    def _method_request(self, rref: RRef, method: str, body: tuple, what: str,
                        timeout: float) -> Future:
        self._wait_fork_sent(rref, what, timeout)
        return self._agent.request(rref._owner, P.RCALL, [list(rref._rid), method], body, what,
                                   timeout)

    def method_call(self, rref: RRef, method: str, args: tuple, kwargs: dict, mode: str,
                    timeout: float | None) -> Any:
        what = self._agent.what(f"RRef.{mode}().{method}", f"on RRef {show(rref._rid)}",
                                rref._owner)
        body = self._args(args, kwargs, what)
        if mode == "remote":
            return self._remote(rref._owner, method, rref, method, body, what, timeout)
        fut = self._method_request(rref, method, body, what, self._agent.timeout_of(timeout))
        if mode != "rpc_sync":
            return fut
        try:
            return fut.wait()
        finally:
            fut = body = None  # not kept alive by the traceback of a failed call


class _Failed:
    def __init__(self, why: str) -> None:
        self.why = why

    def exception(self) -> BaseException:
        return HpcdpError(self.why)


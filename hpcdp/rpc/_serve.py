"""Serving requests: registered functions, RRef creation, method calls on RRefs, fetches.

A handler runs on a transport thread and must not block or send: it checks the request, records
RRef state, and either returns the callee as a task for a serving thread to run inline
(``_duty``) or queues it on the pool; small replies go to the control thread. A malformed
request raises ``ProtocolError``; the agent answers it with an error and serves on. Arguments
are decoded before anything else can fail, so RRefs in them are always taken in (and let go).

The agent holds one ``Serving`` (``agent.serving``) and routes the request kinds to its
``on_*`` handlers; the caller's side (``_calls``) uses ``compute_into`` for RRefs it owns.
"""
from __future__ import annotations

import inspect
import traceback
from typing import TYPE_CHECKING, Any, Callable, Hashable

from ..errors import HpcdpError, ProtocolError
from . import _protocol as P
from . import _registry
from ._duty import Lent
from ._errors import remote_error
from ._wire import Frame

if TYPE_CHECKING:
    from ._agent import Agent

__all__ = ["Serving"]


class Serving:
    """The request handlers of one ``Agent``.

    Of the agent it uses: its name and rank (in messages), ``decode``, ``reply``,
    ``reply_error``, ``error_from``, ``control``, ``unqueue`` and ``discard`` (answers and the
    queue budget), ``rrefs``, ``pool`` (read when used), and ``house`` (which callees may run
    inline, and their timing on the pool)."""

    __slots__ = ("_agent", "_rank", "_name", "_rrefs", "_house")

    def __init__(self, agent: "Agent") -> None:
        self._agent = agent
        self._rank = agent.rank
        self._name = agent.names[agent.rank]
        self._rrefs = agent.rrefs
        self._house = agent.house

    def args_of(self, src: int, frame: Frame) -> tuple[tuple, dict]:
        value = self._agent.decode(src, frame)
        if type(value) is not tuple or len(value) != 2 or type(value[0]) is not tuple or \
                type(value[1]) is not dict or any(type(k) is not str for k in value[1]):
            raise ProtocolError("malformed arguments (expected (tuple, dict of str))")
        return value

    def submit(self, src: int, mid: int, task: Callable[[], None], *, force: bool = False,
               frame: Frame | None = None) -> None:
        if not self._agent.pool.submit(task, force=force):
            if frame is not None:
                self._agent.unqueue(frame)
                self._agent.discard(src, frame)
            self._agent.control(lambda: self._agent.reply_error(src, mid, HpcdpError(
                f"{self._name} (rank {self._rank}) is overloaded or shutting down: "
                f"its RPC queue is full"), ""))

    def inline_or_pool(self, src: int, mid: int, job: Callable[[], None], key: Hashable,
                       may_inline: bool, force: bool = False, frame: Any = None) -> Lent | None:
        """A ``Lent`` task for the serving thread when ``job`` may run there, else queue it."""
        if may_inline and self._house.policy.allows(key):
            return Lent(self._agent, job, key)
        self.submit(src, mid, self._house.timed(job, key), force=force, frame=frame)
        return None

    def on_call(self, src: int, mid: int, fields: list, frame: Frame, may_inline: bool) -> Any:
        if len(fields) != 3 or type(fields[2]) is not str:
            raise ProtocolError("malformed CALL")
        name = fields[2]
        return self.inline_or_pool(
            src, mid, lambda: self._serve(src, mid, frame, lambda: self.target(name)), name,
            may_inline, frame=frame)

    def target(self, name: str) -> Callable[..., Any]:
        entry = _registry.lookup(name)
        if entry is None:
            raise LookupError(f"{self._name} (rank {self._rank}) has no function or "
                              f"class registered as {name[:200]!r} (use @hpcdp.rpc.register)")
        return entry.obj

    def _serve(self, src: int, mid: int, frame: Frame, get: Callable[[], Callable]) -> None:
        try:
            try:
                args, kwargs = self.args_of(src, frame)  # first: RRefs in them are taken in
                fn = get()
                result = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - goes back to the caller
                self._agent.reply_error(src, mid, exc)
                return
            self._agent.reply(src, mid, result)
        finally:
            self._agent.unqueue(frame)

    def on_remote(self, src: int, mid: int, fields: list, frame: Frame, _inline: bool) -> None:
        if len(fields) != 7 or type(fields[2]) is not str or \
                (fields[5] is not None and type(fields[6]) is not str):
            raise ProtocolError("malformed REMOTE")
        if fields[5] is not None:
            self._rrefs.check_use(src, fields[5])  # before anything is recorded for it
        rec = self._rrefs.remote_created(src, fields[3], fields[4])
        self._agent.control(lambda: self._agent.reply(src, mid, None))
        self.compute_into(rec, src, fields[2], fields[5], fields[6],
                          lambda: self.args_of(src, frame), frame)

    def compute_into(self, rec: Any, src: int, name: str, target: Any, method: str | None,
                     args: Callable[[], tuple[tuple, dict]], frame: Frame | None = None) -> None:
        """Compute an RRef's value on the pool: ``name(*args)``, or ``method`` of ``target``'s.
        ``frame``: the REMOTE's message, held (and charged to the queue budget) until then."""

        def compute(get: Callable[[], Callable]) -> None:
            try:
                a, kw = args()  # first: RRefs in them are taken in
                fn = get()
                value, err = fn(*a, **kw), None
            except BaseException as exc:  # noqa: BLE001 - kept for to_here()
                value = None
                err = (getattr(exc, "remote_type", None) or type(exc).__name__,
                       str(exc)[:P.MAX_ERROR_TEXT],
                       "".join(traceback.format_exception(exc))[-P.MAX_ERROR_TEXT:])
            finally:
                self._agent.unqueue(frame)
            self._rrefs.set_value(rec, value, err)

        def start(get: Callable[[], Callable]) -> None:
            if not self._agent.pool.submit(lambda: compute(get), force=True):
                self._agent.unqueue(frame)
                self._rrefs.set_value(rec, None, ("HpcdpError", "the owner is shutting down", ""))

        if target is None:
            start(lambda: self.target(name))
            return

        def start_method(trec: Any) -> None:
            start(lambda: self.bound_method(trec, str(method)))

        try:
            trec = self._rrefs.when_ready(src, target, start_method)
        except ProtocolError as exc:  # the target went away since the REMOTE was checked
            self._agent.unqueue(frame)
            self._rrefs.set_value(rec, None, ("ProtocolError", str(exc), ""))
            return
        if trec is not None:
            start_method(trec)

    def bound_method(self, rec: Any, method: str) -> Callable[..., Any]:
        if rec.error is not None:
            raise self._agent.error_from(rec.error, "the RRef's value")
        value = rec.value
        cls = type(value)
        if method.startswith("_") or not _registry.is_registered_class(cls):
            raise PermissionError(f"{self._name}: method {method[:200]!r} of "
                                  f"{cls.__qualname__} cannot be called remotely (only public "
                                  "methods of @rpc.register-ed classes can)")
        # the class's own definition, never the instance's attributes or __getattr__: a peer
        # can call what the class declares, not a callable the object happens to hold
        if method in getattr(value, "__dict__", ()):
            raise PermissionError(f"{self._name}: an attribute of the "
                                  f"{cls.__qualname__} object shadows its method "
                                  f"{method[:200]!r}; refusing to call either")
        try:
            raw = inspect.getattr_static(cls, method)
        except AttributeError:
            raw = None
        if not (isinstance(raw, (staticmethod, classmethod)) or callable(raw)):
            raise AttributeError(f"{cls.__qualname__} has no method {method[:200]!r}")
        get = getattr(type(raw), "__get__", None)  # functions and other method descriptors
        return get(raw, value, cls) if get is not None else raw

    def on_rcall(self, src: int, mid: int, fields: list, frame: Frame, may_inline: bool) -> Any:
        if len(fields) != 4 or type(fields[3]) is not str:
            raise ProtocolError("malformed RCALL")
        method = fields[3]

        def job(rec: Any) -> Callable[[], None]:
            return lambda: self._serve(src, mid, frame, lambda: self.bound_method(rec, method))

        rec = self._rrefs.when_ready(src, fields[2], lambda rec: self.submit(
            src, mid, job(rec), force=True, frame=frame))
        if rec is None:
            return None  # runs once the value is computed
        return self.inline_or_pool(src, mid, job(rec), (type(rec.value), method), may_inline,
                                   force=True, frame=frame)

    def on_fetch(self, src: int, mid: int, fields: list, frame: Frame, may_inline: bool) -> Any:
        if len(fields) != 3:
            raise ProtocolError("malformed FETCH")

        def answer(rec: Any) -> None:
            try:
                if rec.error is not None:
                    name, msg, tb = rec.error
                    self._agent.reply_error(src, mid, remote_error(msg, name, ""), tb)
                else:
                    self._agent.reply(src, mid, rec.value)
            finally:
                self._agent.unqueue(frame)

        rec = self._rrefs.when_ready(src, fields[2], lambda rec: self.submit(
            src, mid, lambda: answer(rec), force=True, frame=frame))
        if rec is None:
            return None
        return self.inline_or_pool(src, mid, lambda: answer(rec), "RRef.to_here", may_inline,
                                   force=True, frame=frame)

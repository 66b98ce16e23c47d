"""``Work``: the handle an ``async_op=True`` collective returns."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

from ..trace.hooks import on_error
from . import _watchdog
from .validation import check_timeout
from ..backends.base import SPIN_SECONDS, CompletedRequest, Request, spin
from ..errors import CommTimeoutError, HpcdpError, PeerFailureError, public

if TYPE_CHECKING:
    from .group import ProcessGroup

__all__ = ["Work", "QuickWork", "then", "wait_for", "finish_wait", "timeout_error", "Polled",
           "WATCH_AFTER", "QUICK_SPIN_S", "p2p_name", "wait_quick", "QuickBatch", "wait_batch"]

#: seconds a blocking call waits before the watchdog (``_watchdog``) takes over its wait
WATCH_AFTER = _watchdog.WATCH_AFTER
#: seconds a point-to-point call on a backend's quick lane is ``Test``ed in a spin before it
#: becomes a registered request with the general wait (as the lanes' own spins)
QUICK_SPIN_S = SPIN_SECONDS
_monotonic = time.monotonic
_INF = float("inf")


def p2p_name(op: str, peer_name: str, peer: int, tag: int, k: int) -> str:
    """``send(dst=1, tag=3) #k``: how errors and traces name the k-th message of a pair."""
    return f"{op}({peer_name}={peer}, tag={tag}) #{k}"


class Work:
    """A collective in flight. ``wait()`` returns its result; buffers are the transport's until then."""

    __slots__ = ("_group", "_op", "_seq", "_req", "_finish", "_done", "_result", "_error",
                 "_timeout", "_tok")

    def __init__(
        self,
        group: "ProcessGroup",
        op: str,
        seq: int,
        req: Request,
        finish: Callable[[], Any],
        timeout: float | None = None,
        tok: int = 0,
    ) -> None:
        self._group, self._op, self._seq, self._req, self._finish = group, op, seq, req, finish
        self._tok = tok  # the flight recorder's token of this call (0: not recorded)
        self._timeout = timeout  # the call's timeout=, else the group's at wait()
        self._done = False
        self._result: Any = None
        self._error: BaseException | None = None

    def _where(self) -> str:
        return work_where(self._group, self._op, self._seq)

    def _complete(self) -> Any:
        self._result = self._finish()
        self._done = True
        self._finish = _nothing
        if self._tok:
            rec = self._group._rec
            if rec is not None:
                rec.end(self._tok)
        return self._result

    def _fail(self, exc: BaseException) -> BaseException:
        """Keep ``exc`` as this call's outcome and tell the flight recorder (dumps on a timeout)."""
        self._error = exc
        on_error(self._group._rec, self._tok, exc)
        return exc

    def _raise(self, exc: BaseException) -> None:
        raise self._fail(exc)

    @public
    def wait(self, timeout: float | None = None) -> Any:
        """Block until done or ``timeout`` (default: the call's, else the group's); the result."""
        return self._wait(timeout)

    def _wait(self, timeout: float | None = None) -> Any:
        """``wait`` for callers that are public calls themselves (a blocking collective): its
        error is trimmed once, at their boundary."""
        if self._done:
            return self._result
        if self._error is not None:
            raise self._error
        if timeout is not None:
            t = check_timeout(f"{self._where()}: wait()", timeout)
        else:
            t = self._group.timeout if self._timeout is None else self._timeout
        try:
            wait_for(self._group, self._op, self._seq, self._req, t)
        except HpcdpError as exc:
            self._raise(exc)
        return self._complete()

    def _progress(self, seconds: float) -> None:
        """Test (``seconds == 0``) or wait without abandoning; a transport error becomes this
        call's outcome, as ``wait()`` would make it."""
        try:
            done = self._req.test() if seconds == 0 else self._req.wait(seconds)
        except HpcdpError as exc:
            self._group._note_failure(self._op, self._seq, f"failed ({type(exc).__name__})")
            self._fail(annotate(exc, self._where()))
            return
        if done:
            self._complete()

    def is_completed(self) -> bool:
        """Make progress without blocking; True once ``wait()`` would return at once."""
        if not self._done and self._error is None:
            self._progress(0)
        return self._done or self._error is not None

    @public
    def wait_for(self, seconds: float) -> bool:
        """Wait up to ``seconds`` and say whether the call is done, without giving it up.

        Unlike ``wait()``, running out of time abandons nothing and raises nothing: the call
        stays in flight, to be waited for again (schedulers that interleave several calls).
        A transport error is raised as ``wait()`` would.
        """
        if not self._done and self._error is None:
            self._progress(0.0 if seconds == 0 else check_timeout(f"{self._where()}: wait_for()", seconds))
        if self._error is not None:
            raise self._error
        return self._done

    def result(self) -> Any:
        """The collective's result, waiting for it if needed."""
        return self.wait()

    def __repr__(self) -> str:
        state = "done" if self._done else ("failed" if self._error else "pending")
        return f"<Work {self._where()} {state}>"


def _nothing() -> None:
    return None


class QuickWork(Work):
    """An ``isend``/``irecv`` of a plain array on a backend's quick lane (``Backend.quick_p2p``):
    the bare transport request and its buffer, ``Test``ed in a short spin when waited on.

    A halo exchange posts a few of these per step and they complete within the spin, so the
    general machinery (a name, a registered request, a flight-recorder row, a deadline-checked
    wait) is built only when a call must wait longer, fails, is waited on with ``wait_for``,
    or is dropped while pending (``_adopt``): then it is a ``Work`` like any other, with its
    timeout, its name (``recv(src=1, tag=0) #k``), its watchdog and its peer-failure checks.
    A dropped one is adopted by ``__del__``: the transport's registry keeps its buffer until
    the transport is done with it. It belongs to one thread at a time: ``wait``,
    ``is_completed`` and ``wait_all`` on it from two threads at once would test one MPI request
    concurrently, which MPI forbids, and the bare request has no lock (a registered one does).
    """

    __slots__ = ("_lane", "_raw", "_buf", "_send", "_peer", "_tag", "_k")

    def __init__(self, group: "ProcessGroup", lane: Any, raw: Any, buf: Any, send: bool,
                 peer: int, tag: int, k: int, tok: int = 0) -> None:
        # (only what a lean call reads: ``_adopt`` sets the rest of ``Work``'s state)
        self._group, self._lane, self._raw, self._buf = group, lane, raw, buf
        self._send, self._peer, self._tag, self._k, self._tok = send, peer, tag, k, tok
        self._done = False
        self._error = None
        self._req: Request | None = None

    def _name(self) -> str:
        return p2p_name("send" if self._send else "recv", "dst" if self._send else "src",
                        self._peer, self._tag, self._k)

    def _where(self) -> str:
        return work_where(self._group, self._name(), 0)

    def _adopt(self, record: bool = True) -> None:
        """Become a general ``Work``: the request registered with the transport, named, in
        the flight recorder (as started) unless it is there already or not ``record``."""
        if self._req is not None or self._done or self._raw is None:
            return
        g, buf, send = self._group, self._buf, self._send
        self._op, self._seq, self._timeout, self._result = self._name(), 0, None, None
        self._finish = _nothing if send else (lambda: buf)
        self._req = self._lane.adopt(self._raw, buf, send, self._peer, self._tag)
        self._raw = None
        rec = g._rec
        if rec is not None and not self._tok and record:
            self._tok = rec.begin("send" if send else "recv", g, 0, buf.shape, buf.dtype, self._peer)

    def _quick_done(self) -> Any:
        self._done = True
        self._lane.live.pop(id(self._raw), None)
        self._raw = None
        res = self._result = None if self._send else self._buf
        if self._tok:
            rec = self._group._rec
            if rec is not None:
                rec.end(self._tok)
        if self._lane.alert[0]:  # a notice landed: take it (a finished p2p call never fails)
            self._lane.take_notices()
        return res

    def _wait(self, timeout: float | None = None) -> Any:
        if self._done:
            return self._result
        if self._error is not None:
            raise self._error
        if timeout is not None and not (type(timeout) is float and 0.0 < timeout < _INF):
            check_timeout(f"{self._where()}: wait()", timeout)  # (refused before the spin)
        if self._req is None:
            try:
                if _spun(self._raw.Test, self._lane.alert):
                    return self._quick_done()
            except Exception as exc:  # noqa: BLE001 - a transport error: this call's outcome
                self._raise(self._failed(exc))
            except BaseException:  # KeyboardInterrupt: the transport may still use the buffer
                self._adopt()
                raise
            self._adopt()
        return Work._wait(self, timeout)

    def _failed(self, exc: Exception) -> BaseException:
        """The error of a bare request whose ``Test`` raised, naming this call. MPI may have
        freed the request (MPICH does), so it is never tested again: a later test would say it
        completed and the error would be lost."""
        self._lane.live.pop(id(self._raw), None)
        self._raw = None
        err = self._lane.failure(exc, self._send)
        return annotate(err, self._where()) if isinstance(err, HpcdpError) else err

    def _progress(self, seconds: float) -> None:
        if self._req is None:
            if self._raw is None:  # failed already (``_failed``): nothing to test
                return
            if seconds == 0:
                try:
                    if self._raw.Test():
                        self._quick_done()
                    return
                except Exception as exc:  # noqa: BLE001 - this call's outcome
                    self._fail(self._failed(exc))
                    return
            self._adopt()
        Work._progress(self, seconds)

    def __del__(self) -> None:
        if not self._done and self._req is None and getattr(self, "_raw", None) is not None:
            try:  # dropped while pending: the transport's registry keeps the buffer (no
                self._adopt(record=False)  # recorder row: nobody waits for it)
            except Exception:  # noqa: BLE001 - (interpreter shutdown)
                pass

    def __repr__(self) -> str:
        state = "done" if self._done else ("failed" if self._error else "pending")
        return f"<Work {self._where()} {state}>"


def _spun(test: Callable[[], Any], alert: Any) -> bool:
    """Whether ``test()`` turned true within ``QUICK_SPIN_S`` (or before a notice landed)."""
    return spin(test, alert, QUICK_SPIN_S)


def wait_quick(works: list[Work]) -> bool:
    """``wait_all``'s first step: the lean ``QuickWork``s among ``works``, if they share one
    lane, tested together (``_settle``). True when every one of ``works`` is done
    (successfully: ``_result`` is its result)."""
    lane = None
    pending: list[QuickWork] = []
    raws = []
    rest = False  # a work that is neither lean nor done
    for w in works:
        if type(w) is QuickWork and w._req is None:
            if w._done:
                continue
            if lane is None:
                lane = w._lane
            elif w._lane is not lane:
                return False  # several groups: each waits on its own
            pending.append(w)
            raws.append(w._raw)
        elif not w._done:
            rest = True
    if lane is None:
        return not rest
    return _settle(pending, lane, raws) and not rest


def _settle(ws: list[QuickWork], lane: Any, raws: list[Any]) -> bool:
    """Test ``raws``, the bare requests of the pending lean works ``ws`` (one lane), together
    (one ``Testall``) in a short spin. True: all done, each marked so. False: each adopted
    for the general wait that follows (it then costs nothing for them, and does not spin
    again), or failed if the test raised."""
    testall = lane.testall
    try:
        ok = testall(raws) or _spun(lambda: testall(raws), lane.alert)
    except Exception as exc:  # noqa: BLE001 - which one failed is not known: all carry it
        for w in ws:
            if w._raw is not None:
                w._fail(w._failed(exc))
        return False
    except BaseException:  # KeyboardInterrupt: the transport may still use the buffers
        for w in ws:
            w._adopt()
        raise
    if not ok:
        for w in ws:
            w._adopt()
        return False
    live = lane.live
    for w in ws:
        if w._tok:
            w._quick_done()
        else:  # (``_quick_done`` inlined; its notice check once below)
            w._done = True
            live.pop(id(w._raw), None)
            w._raw = None
            w._result = None if w._send else w._buf
    if lane.alert[0]:
        lane.take_notices()
    return True


class QuickBatch(list):  # type: ignore[type-arg]
    """The ``Work``s of a ``batch_isend_irecv`` whose every op started on one quick lane: the
    list of them (in the order of the ops) that also keeps their bare requests as posted, so
    that ``wait_all`` (``wait_batch``) tests them together without gathering them again. A
    list in every other way; changed, or with a work waited on by itself, it is waited on as
    any list is."""

    # made by ``QuickBatch(works)`` (list's own constructor: no ``__init__`` frame), then
    # ``_snap`` (the list it was made from: compared, identity first, before use), ``_lane``
    # and ``_raws`` set by its maker (``_p2p_batch.post_batch``)
    __slots__ = ("_lane", "_raws", "_snap")


def wait_batch(b: QuickBatch) -> list[Any] | None:
    """``wait_quick`` for a ``QuickBatch`` as it was made, with none of its works waited on,
    adopted or recorded by themselves (else None at once: ``wait_quick`` then): its requests
    as posted, tested together (``_settle``); the results once every work is done, else None
    (the works adopted, for the general wait)."""
    if b != b._snap:
        return None
    for w in b:
        if w._raw is None or w._tok:
            return None
    if not _settle(b, b._lane, b._raws):
        return None
    return [w._result for w in b]


def then(work: Work, after: Callable[[Any], Any]) -> Work:
    """``work``, whose completion also runs ``after(result)`` and yields what it returns (the
    torch spellings copy a result into the caller's arrays this way, and return None)."""
    if type(work) is QuickWork:
        work._adopt()  # (a general Work: ``_finish`` to wrap)
    if work._done:
        work._result = after(work._result)
        return work
    inner = work._finish
    work._finish = lambda: after(inner())
    return work


def work_where(group: "ProcessGroup", op: str, seq: int) -> str:
    """"allreduce #7 on group world (rank 1 of 4)": how errors name a call (p2p has no #)."""
    num = f" #{seq}" if seq else ""
    return f"{op}{num} on group {group.name} (rank {group.rank} of {group.size})"


def wait_for(group: "ProcessGroup", op: str, seq: int, req: Request, timeout: float) -> None:
    """Wait for ``req``; the transport's error or a ``CommTimeoutError``, naming the call.

    A call still blocked after ``WATCH_AFTER`` s waits on under the watchdog, which warns
    after ``HPCDP_WARN_AFTER`` s and names a deadlock in the timeout error; before that the
    only cost is the shorter first wait."""
    first = timeout if timeout < WATCH_AFTER else WATCH_AFTER
    try:
        if req.wait(first):
            return
    except HpcdpError as exc:
        group._note_failure(op, seq, f"failed ({type(exc).__name__})")
        raise annotate(exc, work_where(group, op, seq)) from exc
    if err := finish_wait(group, op, seq, req, timeout, first):
        raise err


def finish_wait(group: "ProcessGroup", op: str, seq: int, req: Request, timeout: float,
                waited: float) -> HpcdpError | None:
    """The rest of a blocking call's wait, after a first ``waited`` s (``WATCH_AFTER``, or
    the whole ``timeout`` when shorter) in which ``req`` did not complete: under the
    watchdog, up to ``timeout`` s in all. None once complete, else the error to raise: the
    transport's, naming the call, or a ``CommTimeoutError`` (the request abandoned).

    For waits that do not go through ``wait_for`` (a backend's quick lane that blocks with a
    deadline of its own): give it ``WATCH_AFTER`` first, then call this."""
    note = ""
    if waited < timeout:
        try:
            done, note = _watchdog.watch(group, op, seq, req, timeout, waited)
        except HpcdpError as exc:
            group._note_failure(op, seq, f"failed ({type(exc).__name__})")
            err = annotate(exc, work_where(group, op, seq))
            err.__cause__ = exc
            return err
        if done:
            return None
    return timeout_error(group, op, seq, req, timeout, note)


def annotate(exc: HpcdpError, where: str) -> HpcdpError:
    """The transport's error, of the same type, prefixed with the collective it broke."""
    if isinstance(exc, PeerFailureError):
        return PeerFailureError(f"{where}: {exc}", peers=exc.peers)
    return type(exc)(f"{where}: {exc}")


def timeout_error(group: "ProcessGroup", op: str, seq: int, req: Request,
                  t: float, note: str = "") -> CommTimeoutError | None:
    """Abandon ``req`` and describe what did not arrive: op, sequence number, group and rank,
    and ``note`` (the watchdog's: the deadlock cycle, or what the awaited ranks are blocked in).

    None when the request turned out to have completed as it was given up (no error then).
    """
    pending = req.pending()
    if req.abandon():
        return None
    group._note_failure(op, seq, "timed out")  # collectives only: p2p calls have no seq
    return CommTimeoutError(f"{work_where(group, op, seq)} timed out after {t:g} s: {pending}"
                            f"{note}")


class Polled(Request):
    """A wait on a condition (``test()``) rather than a transport request, so a blocking probe
    waits through ``wait_for``/``finish_wait`` and its watchdog like any other call;
    ``what``: what did not arrive, for its timeout error."""

    def __init__(self, test: Callable[[], bool], what: str) -> None:
        self._test, self._what = test, what

    def test(self) -> bool:
        return self._test()

    def pending(self) -> str:
        return self._what


class CompletedWork(Work):
    """A Work that is already complete (world size 1, empty groups)."""

    def __init__(self, group: "ProcessGroup", op: str, seq: int, result: Any) -> None:
        super().__init__(group, op, seq, CompletedRequest(), _nothing)
        self._done = True
        self._result = result

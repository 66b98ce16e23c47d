"""A layer's phase that every training step repeats (DDP's backward), as one timeline entry.

``Phase`` writes what ``span``/``instant`` would: a span (``name``, with its args), an optional
inner span (``inner``) and marks (``mark``, one per call of ``Phase.mark``), the same JSON text
event for event. It records them differently: the times go into the phase object and one
entry is buffered when the phase ends, instead of a span object, a kwargs dict and a timeline
lookup per event; and the entry's text is made from what repeats from step to step (names,
args, tid), kept by value, and its times. On a small model's step, latency-bound, the
per-event layers of ``span``/``instant`` were a visible share of the step.

It also pins the source line, as ``pinned_line`` does (the user's call around the phase names
the operations started inside it), whenever source lines are recorded, tracing or not.
"""
from __future__ import annotations

import marshal
import threading
import weakref
from itertools import chain
from typing import Any

from . import _chrome
from ._chrome import _MS, _PLAIN, _refresh_here, instant, now_ns, state
from ._dump import on_dump
from ._recorder import _process_rank, _tls, pin_line
from ._steps import observe

__all__ = ["Phase"]

_ident = threading.get_ident
_NO_MARKS: tuple[Any, ...] = ()
_flat = chain.from_iterable
_dumps = marshal.dumps


class _Inner:
    """``with phase.inner:`` times the phase's inner span (a no-op unless the phase is traced)."""

    __slots__ = ("_p",)

    def __init__(self, phase: "Phase") -> None:
        self._p = phase

    def __enter__(self) -> "_Inner":
        p = self._p
        if p._h is not None:
            p._ti0 = now_ns()
        return self

    def __exit__(self, tp: Any, value: Any, tb: Any) -> bool:
        p = self._p
        if p._h is not None and p._ti0:
            p._ti1 = now_ns()
            if tp is not None:
                p._ierr = tp.__name__
        return False


class Phase:
    """``with phase(*values):`` a span named ``name`` (args ``dict(zip(args, values))``), with
    ``with phase.inner:`` inside it (a span named ``inner``) and ``phase.mark(*values)``
    (an instant named ``mark``, args named ``mark_args``), on the calling thread's timeline.

    One instance times one block at a time (a layer keeps one per object that runs the phase,
    e.g. per DDP model). A mark from another thread, or made while the phase is not being
    timed, is an ordinary ``instant``. An exception leaving the block (or the inner span) adds
    ``error`` (its class name) to that span's args, as ``span`` does.

    Args:
        name, cat: the span's name and category (``span``'s).
        args: the names of the span's args, matched to the values ``phase(...)`` is called with.
        inner: name of the inner span (None: none).
        mark, mark_args: name of the marks and of their args.
    """

    __slots__ = ("name", "cat", "args", "inner_name", "mark_name", "mark_args", "inner",
                 "_vals", "_h", "_t0", "_ti0", "_ti1", "_ierr", "_marks", "_dumped", "_pinned", "_prev",
                 "_texts", "__weakref__")

    def __init__(self, name: str, cat: str = "user", *, args: tuple[str, ...] = (),
                 inner: str | None = None, mark: str | None = None,
                 mark_args: tuple[str, ...] = ()) -> None:
        self.name, self.cat, self.args = name, cat, tuple(args)
        self.inner_name, self.mark_name, self.mark_args = inner, mark, tuple(mark_args)
        self.inner = _Inner(self)
        self._vals: tuple[Any, ...] = ()
        self._h: tuple[Any, ...] | None = None  # ``_tls.here`` while timed
        self._t0 = self._ti0 = self._ti1 = 0
        self._ierr: str | None = None
        #: the marks so far, flat: ``[time, values, time, values, ...]`` (values None: a step
        #: mark), so that the values alone are one slice (``_text``'s key)
        self._marks: list[Any] = []
        self._dumped = 0  # items of ``_marks`` a flight-record dump already wrote (``_drain``)
        self._pinned = False
        self._prev: Any = None
        #: texts of the span, the inner span and the marks by what they depend on (``_text``)
        self._texts: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        _phases.add(self)

    def __call__(self, *values: Any) -> "Phase":
        self._vals = values
        return self

    def __enter__(self) -> "Phase":
        # ``pinned_line``: the user's call around the phase names what starts inside
        self._pinned, self._prev = pin_line()
        if state.on:  # the thread's timeline and tid (``_chrome._here_entry`` inlined)
            h = _tls.here
            if h is None or h[3] is not _chrome._epoch or (h[4] is not None
                                                          and h[4] != _process_rank[0]):
                h = _refresh_here()
                if h is None:
                    return self
            self._ti0 = self._ti1 = 0
            self._ierr = None
            self._h = h  # (a phase being timed: what ``_drain`` looks for)
            self._t0 = now_ns()
        return self

    def __exit__(self, tp: Any, value: Any, tb: Any) -> bool:
        if self._pinned:
            self._pinned = False
            _tls.line = self._prev
        h = self._h
        if h is not None:
            t1 = now_ns()
            self._h = None
            err = None if tp is None else tp.__name__
            ti0, ti1, ierr = self._ti0, self._ti1, self._ierr
            if ti0 and not ti1:  # the inner span cut short by the exception leaving both
                ti1, ierr = t1, err
            marks = self._marks
            if marks:
                self._marks = []
                if self._dumped:  # those a dump wrote meanwhile are in the file already
                    marks, self._dumped = marks[self._dumped:], 0
            if not marks:
                marks = _NO_MARKS  # type: ignore[assignment]
            buf = h[5]
            buf.append((self, self._t0, t1, self._vals, ti0, ti1, marks, h[1], err, ierr))
            if len(buf) >= h[6]:
                h[0].flush()
        return False

    def mark(self, *values: Any) -> None:
        """A mark (args: ``mark_args`` matched to ``values``) at this moment."""
        h = self._h
        if h is not None and h[2] == _ident():
            m = self._marks
            m.append(now_ns())
            m.append(values)
        elif state.on and self.mark_name is not None:
            instant(self.mark_name, self.cat, **dict(zip(self.mark_args, values)))

    def step(self) -> Any:
        """``trace.step()`` (its "step" mark and the ``on_step`` observers), the mark recorded
        with the phase's entry: for a layer whose phase ends a training step (DDP's backward)."""
        h = self._h
        if h is not None and h[2] == _ident():
            m = self._marks
            m.append(now_ns())
            m.append(None)
        elif state.on:
            instant("step", "step")
        return observe()

    # -- writing (``Timeline._render``: an entry of 10 fields) -------------------------------
    def _events(self, ev: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        """The entry as the ``span``/``instant`` events it stands for, in the order those append."""
        _, t0, t1, vals, ti0, ti1, marks, tid, err, ierr = ev
        out = self._mark_events(marks, tid)
        cat = self.cat
        if ti0:
            out.append(("X", self.inner_name, cat, ti0, ti1 - ti0, tid,
                        None if ierr is None else {"error": ierr}))
        args = dict(zip(self.args, vals))
        if err is not None:
            args["error"] = err
        out.append(("X", self.name, cat, t0, t1 - t0, tid, args or None))
        return out

    def _mark_events(self, marks: Any, tid: int) -> list[tuple[Any, ...]]:
        """``marks`` (flat: time, values, ...) as the ``instant`` events they stand for."""
        names, cat = self.mark_args, self.cat
        return [("i", "step", "step", t, 0, tid, None) if values is None else
                ("i", self.mark_name, cat, t, 0, tid, dict(zip(names, values)) or None)
                for t, values in zip(marks[0::2], marks[1::2])]

    def _text(self, tl: Any, ev: tuple[Any, ...]) -> str:
        """The entry's events as ``tl`` writes them (``Timeline._render``'s text for ``_events``):
        the repeating part of the whole entry (every event's text but its times) kept by value,
        under one key, and the times formatted around it."""
        _, t0, t1, vals, ti0, ti1, marks, tid, err, ierr = ev
        epoch = tl.epoch_ns
        t, dur = t0 - epoch, t1 - t0
        # (marks are taken after the phase began, in order, on the same monotonic clock)
        if t < 0 or dur < 0 or ti1 < ti0 or (marks and marks[0] < t0):
            return tl._render(self._events(ev))  # the general path's signed floats
        mv = marks[1::2]
        try:  # by value and type (True == 1, and their texts differ), in one call: marshal's
            # bytes tell every type it takes apart and refuse any other (a step mark: None)
            key = _dumps((tl.rank, tid, err, ierr, ti0 > 0, vals, mv), 2)
        except ValueError:  # a value marshal does not take
            return tl._render(self._events(ev))
        hit = self._texts.get(key)
        if hit is None:
            if not (_PLAIN.issuperset(map(type, vals))
                    and _PLAIN.issuperset(map(type, _flat(filter(None, mv))))):
                return tl._render(self._events(ev))
            hit = self._plan(tl, tid, vals, mv, err, ierr, ti0 > 0)
            if len(self._texts) >= 10_000:
                self._texts.clear()
            self._texts[key] = hit
        ms = _MS
        text = f'{hit[0]}{t // 1000}.{ms[t % 1000]},"dur":{dur // 1000}.{ms[dur % 1000]}{hit[1]}'
        if ti0:
            t = ti0 - epoch
            dur = ti1 - ti0
            text = f'{hit[2]}{t // 1000}.{ms[t % 1000]},"dur":{dur // 1000}.{ms[dur % 1000]}{hit[3]}{text}'
        if not marks:
            return text
        out = []
        for (head, tail), t in zip(hit[4], marks[0::2]):
            t -= epoch
            out.append(f'{head}{t // 1000}.{ms[t % 1000]}{tail}')
        out.append(text)
        return "".join(out)

    def _plan(self, tl: Any, tid: int, vals: tuple[Any, ...], mv: tuple[Any, ...], err: str | None,
              ierr: str | None, inner: bool) -> tuple[Any, ...]:
        """(span head, its tail, inner span head, its tail up to the span's head, the marks'
        (head, tail) in order) for ``_text``: each event's text but its times."""
        args = dict(zip(self.args, vals))
        if err is not None:
            args["error"] = err
        head, tail = tl._span_plan("X", self.name, self.cat, tid, args or None)
        ihead, itail = tl._span_plan("X", self.inner_name, self.cat, tid,
                                     None if ierr is None else {"error": ierr}) if inner else ("", "")
        marks = tuple((h, t + "},\n") for h, t in (
            tl._span_plan("i", "step", "step", tid, None) if values is None else
            tl._span_plan("i", self.mark_name, self.cat, tid, dict(zip(self.mark_args, values)) or None)
            for values in mv))
        return head, tail + "}", ihead, itail + "},\n" if inner else "", marks


#: every phase: those being timed (``_h`` set) are the ones whose marks a flight-record dump
#: writes (``_drain``); registered once, not at every entry
_phases: "weakref.WeakSet[Phase]" = weakref.WeakSet()


def _drain() -> None:
    """At a flight-record dump (``on_dump``): the marks each open phase holds so far, written as
    the instants they stand for, as ``instant`` wrote them at once. A rank stuck inside a phase
    (DDP's backward, a bucket allreduce that never completes) shows which buckets it launched;
    the phase's entry leaves those marks out when it ends. (A dump from another thread at the
    very moment the phase ends may write a mark twice or leave it out.)"""
    for p in list(_phases):
        h = p._h
        if h is None:
            continue
        marks = p._marks
        n = len(marks) & ~1  # whole marks (a dump at a signal may fall between time and values)
        if n > p._dumped:
            new, p._dumped = marks[p._dumped:n], n
            h[5].extend(p._mark_events(new, h[1]))
            h[0].flush()


on_dump.append(_drain)

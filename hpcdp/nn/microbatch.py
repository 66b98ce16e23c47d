"""Microbatches in flight: ``with nn.microbatch(i):`` and the per-microbatch store of saved tensors.

A pipeline schedule runs the forward of several microbatches before their backward, and may run a
layer's weight-gradient part later still (zero-bubble schedules). So what a layer keeps between
forward and backward cannot live in ``self._x``: it is keyed by the microbatch that is current when
the forward runs, and consumed by the backward that runs under the same microbatch.

Two stores per module, both keyed by microbatch id:

* activations, written by ``save_for_backward`` in ``forward`` and taken (freed) by
  ``saved_tensors`` in ``backward_input``;
* what the weight gradient needs, written by ``save_for_weight`` in ``backward_input`` and taken
  (freed) by ``saved_for_weight`` in ``backward_weight``.

A module called several times within one forward pass (``Sequential(lin, act, lin)``, one
activation used twice in a block) keeps one entry per call, and its backwards take them back last
call first: the order in which a ``Sequential``, or any backward written in the reverse order of
its forward, runs them. A forward pass is one outermost ``module(...)`` call on this thread; the
next one, under a microbatch whose backward has not run, replaces that microbatch's entries (as the
single-slot layers did), so evaluation loops and finite-difference checks do not grow memory.
Calling ``forward`` directly, outside any ``module(...)`` call, always replaces.
"""
from __future__ import annotations

import itertools
import threading
from contextlib import contextmanager
from typing import Any, Iterator

from ..errors import HpcdpError

__all__ = ["microbatch", "current_microbatch", "SavedTensorsMixin"]


class _State(threading.local):
    """This thread's forward-pass and microbatch state, with class defaults (read per module
    call: no ``getattr`` default, whose miss raises and catches an AttributeError)."""

    depth: int = 0
    pass_id: int | None = None
    stack: list[int] | None = None


_local = _State()
_pass_ids = itertools.count(1)


def enter_call() -> None:
    """``Module.__call__`` starts: an outermost call begins a new forward pass on this thread."""
    depth = _local.depth
    if depth == 0:
        _local.pass_id = next(_pass_ids)
    _local.depth = depth + 1


def exit_call() -> None:
    """``Module.__call__`` ends (normally or not)."""
    _local.depth -= 1


def _forward_pass() -> int | None:
    """Id of the forward pass in progress on this thread; None outside any ``module(...)`` call."""
    return _local.pass_id if _local.depth else None


def current_microbatch() -> int:
    """Return the id of the innermost active ``microbatch`` on this thread (0 when none is)."""
    stack = _local.stack
    return stack[-1] if stack else 0


@contextmanager
def microbatch(index: int) -> Iterator[int]:
    """Make forward/backward inside the block save into and consume microbatch ``index``.

    Thread-local (each simulated rank is a thread) and nestable; the previous id is restored on exit.

    Args:
        index: a non-negative integer naming the microbatch.
    """
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"nn.microbatch needs a non-negative int, got {index!r}")
    stack = _local.stack
    if stack is None:
        stack = _local.stack = []
    stack.append(index)
    try:
        yield index
    finally:
        stack.pop()


class SavedTensorsMixin:
    """Per-microbatch saved tensors for :class:`~hpcdp.nn.Module` (no layer keeps ``self._x``).

    Each store maps a microbatch id to a stack of ``(pass id, tensors)``: one entry per call of the
    module in that forward pass (see the module docstring).
    """

    def _store(self, key: str) -> dict[int, list[tuple[int | None, tuple[Any, ...]]]]:
        d = self.__dict__.get(key)
        if d is None:
            d = {}
            object.__setattr__(self, key, d)
        return d

    def save_for_backward(self, *tensors: Any) -> None:
        """Keep ``tensors`` for this module's backward under the current microbatch."""
        store, mb, pid = self._store("_saved_fwd"), current_microbatch(), _forward_pass()
        entries = store.get(mb)
        if entries and pid is not None and entries[-1][0] == pid:
            entries.append((pid, tensors))   # called again in the same forward pass
        else:
            store[mb] = [(pid, tensors)]

    def _take(self, key: str, missing: str) -> tuple[int | None, tuple[Any, ...]]:
        """Pop the newest ``(pass id, tensors)`` of the current microbatch from store ``key``."""
        mb = current_microbatch()
        store = self._store(key)
        entries = store.get(mb)
        if not entries:
            raise HpcdpError(f"{type(self).__name__}.{missing} under microbatch {mb}")
        entry = entries.pop()
        if not entries:
            del store[mb]
        return entry

    def saved_tensors(self) -> tuple[Any, ...]:
        """Take (and free) what the latest forward under the current microbatch saved."""
        pid, tensors = self._take("_saved_fwd", "backward called without a preceding forward")
        self.__dict__["_consumed_pass"] = pid   # what a following save_for_weight belongs to
        return tensors

    def save_for_weight(self, *tensors: Any) -> None:
        """Keep what ``backward_weight`` needs for the current microbatch (called by ``backward_input``)."""
        mb = current_microbatch()
        store = self._store("_saved_wgt")
        pid = self.__dict__.get("_consumed_pass")
        entries = store.get(mb)
        if not entries:
            store[mb] = [(pid, tensors)]
        elif pid is not None and entries[-1][0] == pid:
            entries.append((pid, tensors))   # another call of the module in the same forward pass
        else:
            raise HpcdpError(f"{type(self).__name__}.backward_input under microbatch {mb}: the weight "
                             f"gradient of the previous backward_input has not run; call backward_weight first")

    def saved_for_weight(self) -> tuple[Any, ...]:
        """Take (and free) what ``backward_input`` kept for the current microbatch's weight gradient."""
        return self._take("_saved_wgt", "backward_weight called without a preceding backward_input")[1]

    def pending_microbatches(self) -> tuple[list[int], list[int]]:
        """Return (microbatches with saved activations, microbatches awaiting backward_weight) of this module."""
        return sorted(self._store("_saved_fwd")), sorted(self._store("_saved_wgt"))

    def saved_count(self, recurse: bool = True) -> int:
        """Count saved entries (activations plus pending weight parts) here and, by default, below.

        Zero after every forward has had its full backward: nothing is left holding memory.
        """
        mods = self.modules() if recurse else iter([self])  # type: ignore[attr-defined]
        return sum(len(e) for m in mods for key in ("_saved_fwd", "_saved_wgt") for e in m._store(key).values())

    def free_saved(self, microbatch: int | None = None, recurse: bool = True) -> None:
        """Drop saved entries of ``microbatch`` (all when None), e.g. after an aborted step or in eval."""
        mods = self.modules() if recurse else iter([self])  # type: ignore[attr-defined]
        for m in mods:
            for key in ("_saved_fwd", "_saved_wgt"):
                store = m._store(key)
                if microbatch is None:
                    store.clear()
                else:
                    store.pop(microbatch, None)

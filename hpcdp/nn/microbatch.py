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

A second forward under the same microbatch before its backward replaces the first's activations
(as the single-slot layers did), so evaluation loops and finite-difference checks do not grow memory.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterator

from ..errors import HpcdpError

__all__ = ["microbatch", "current_microbatch", "SavedTensorsMixin"]

_local = threading.local()


def current_microbatch() -> int:
    """Return the id of the innermost active ``microbatch`` on this thread (0 when none is)."""
    stack = getattr(_local, "stack", None)
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
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(index)
    try:
        yield index
    finally:
        stack.pop()


class SavedTensorsMixin:
    """Per-microbatch saved tensors for :class:`~hpcdp.nn.Module` (no layer keeps ``self._x``)."""

    def _store(self, key: str) -> dict[int, tuple[Any, ...]]:
        d = self.__dict__.get(key)
        if d is None:
            d = {}
            object.__setattr__(self, key, d)
        return d

    def save_for_backward(self, *tensors: Any) -> None:
        """Keep ``tensors`` for this module's backward under the current microbatch."""
        self._store("_saved_fwd")[current_microbatch()] = tensors

    def saved_tensors(self) -> tuple[Any, ...]:
        """Take (and free) what ``forward`` saved under the current microbatch."""
        mb = current_microbatch()
        try:
            return self._store("_saved_fwd").pop(mb)
        except KeyError:
            raise HpcdpError(f"{type(self).__name__}.backward called without a preceding forward "
                             f"under microbatch {mb}") from None

    def save_for_weight(self, *tensors: Any) -> None:
        """Keep what ``backward_weight`` needs for the current microbatch (called by ``backward_input``)."""
        mb = current_microbatch()
        store = self._store("_saved_wgt")
        if mb in store:
            raise HpcdpError(f"{type(self).__name__}.backward_input under microbatch {mb}: the weight "
                             f"gradient of the previous backward_input has not run; call backward_weight first")
        store[mb] = tensors

    def saved_for_weight(self) -> tuple[Any, ...]:
        """Take (and free) what ``backward_input`` kept for the current microbatch's weight gradient."""
        mb = current_microbatch()
        try:
            return self._store("_saved_wgt").pop(mb)
        except KeyError:
            raise HpcdpError(f"{type(self).__name__}.backward_weight called without a preceding "
                             f"backward_input under microbatch {mb}") from None

    def pending_microbatches(self) -> tuple[list[int], list[int]]:
        """Return (microbatches with saved activations, microbatches awaiting backward_weight) of this module."""
        return sorted(self._store("_saved_fwd")), sorted(self._store("_saved_wgt"))

    def saved_count(self, recurse: bool = True) -> int:
        """Count saved entries (activations plus pending weight parts) here and, by default, below.

        Zero after every forward has had its full backward: nothing is left holding memory.
        """
        mods = self.modules() if recurse else iter([self])  # type: ignore[attr-defined]
        return sum(len(m._store("_saved_fwd")) + len(m._store("_saved_wgt")) for m in mods)

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

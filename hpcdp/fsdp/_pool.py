"""``BufferPool``: the flat work buffers of a training step, reused from one step to the next.

Every step a unit needs the same buffers: the all-gather's receive buffer, the gathered
parameters, the unsharded gradient, the reduction's send and receive buffers and the shard
gradients. numpy has no caching allocator (torch's FSDP relies on CUDA's), so allocating them
afresh is left to the C allocator, which hands large blocks back to the kernel when they are
freed (``munmap``, or trimming the top of the heap) and gets them back zero-filled, page by page,
through page faults on the next step. Under shard_grad_op every unit stays gathered from its
forward to the end of backward, so the heap grows by the whole model every step and shrinks
again after it: the kernel's zeroing and faults cost about as much as the step's communication.

The pool keeps the buffers instead. A buffer is free when nothing but the pool refers to it
(CPython's reference count): a view installed on a parameter, a torch tensor over it, a posted
collective's request, or a user's reference to a ``.grad`` keeps it busy, so a buffer is never
handed out twice while anything can still read it, and nobody has to give buffers back. A buffer
not handed out during a whole step is forgotten at the start of the next one, so the pool holds
only buffers the last step used (one taken while the user held the old one does not stay as a
second copy for ever).

Only shard_grad_op keeps buffers (``keep=True``). full_shard promises that a unit's gathered
parameters are released after its forward, and holds so few buffers at a time that the C
allocator reuses the freed blocks without returning them to the kernel; its pool allocates
afresh and keeps nothing. Device arrays are not kept either: CuPy's own memory pool caches them.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .._arrays import free_refs, refs_at

__all__ = ["BufferPool"]

#: ``refs_at`` of a buffer only its pool entry refers to; None: this interpreter's counts cannot
#: tell (then nothing is kept)
_FREE = free_refs()


class BufferPool:
    """Buffers by (array module, shape, dtype); each entry is ``[array, step last handed out]``.

    Args:
        keep: keep buffers for reuse; False: every ``take`` allocates and nothing is kept.
    """

    def __init__(self, keep: bool = True) -> None:
        self.keep = bool(keep) and _FREE is not None
        self._entries: dict[tuple[str, tuple[int, ...], str], list[list[Any]]] = {}
        self._step = 0
        #: buffers handed out again (``reused``) and allocated (``allocated``), for tests and reports
        self.reused = 0
        self.allocated = 0

    def take(self, xp: Any, shape: Any, dtype: Any) -> Any:
        """A free buffer of ``shape`` and ``dtype`` (its contents are stale), or a new one."""
        if not self.keep or xp is not np:
            self.allocated += 1
            return xp.empty(shape, dtype)
        shape = tuple(int(d) for d in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        key = (xp.__name__, shape, np.dtype(dtype).str)
        entries = self._entries.setdefault(key, [])
        for e in entries:
            if refs_at(e, 0) == _FREE:
                e[1] = self._step
                self.reused += 1
                return e[0]
        buf = xp.empty(shape, dtype)
        entries.append([buf, self._step])
        self.allocated += 1
        return buf

    def zeros(self, xp: Any, shape: Any, dtype: Any) -> Any:
        """``take``, zero-filled."""
        if not self.keep or xp is not np:
            self.allocated += 1
            return xp.zeros(shape, dtype)
        buf = self.take(xp, shape, dtype)
        buf.fill(0)
        return buf

    def new_step(self) -> None:
        """Forget the buffers not handed out during the step that ended (their memory goes once
        nothing else refers to them)."""
        last = self._step
        for key in list(self._entries):
            kept = [e for e in self._entries[key] if e[1] >= last]
            if kept:
                self._entries[key] = kept
            else:
                del self._entries[key]
        self._step += 1

    def idle_bytes(self) -> int:
        """Bytes of the buffers held for reuse and not in use now."""
        return sum(int(e[0].nbytes) for es in self._entries.values() for e in es
                   if refs_at(e, 0) == _FREE)

    def held_bytes(self) -> int:
        """Bytes of every buffer the pool holds, in use or not."""
        return sum(int(e[0].nbytes) for es in self._entries.values() for e in es)

    def clear(self) -> None:
        """Forget every buffer."""
        self._entries.clear()

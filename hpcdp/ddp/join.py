"""``Join``: uneven inputs without hangs, as torch's ``Join`` context does for DDP.

Protocol (all ranks of the DDP group, in the same order):

1. Inside ``with ddp.join():`` every synced training forward ``ddp(x)`` first allreduces a 1
   ("I am still training"); the sum is the number of active ranks this iteration.
2. A rank that leaves the ``with`` block (its data ran out) keeps answering that allreduce with 0,
   and whenever the sum is still positive it shadows the iteration: the buffer broadcast (if any),
   every bucket's reduction with zero gradients, and the used-map allreduce (if
   ``find_unused_parameters``), in bucket order.
3. When the sum is 0 every rank has left; the ranks agree on the one that trained longest (most
   iterations, lowest rank on ties) and broadcast its parameters and buffers, because ranks that
   joined early skipped optimizer steps. Optimizer state is not synchronised (as in torch).

Divisor: with ``divide_by_initial_world_size=True`` (torch's default) the summed gradient is divided
by the group size, so a joined rank counts as a zero gradient; with False it is divided by the
number of ranks still training in that iteration, i.e. the mean over the actual contributors.

Every synced training forward inside the block must be followed by ``ddp.backward`` and by no
other collective on the DDP group (joined ranks could not match it).
"""
from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["Join"]


class Join:
    """Context manager returned by ``DDP.join()``."""

    def __init__(self, ddp: Any, *, divide_by_initial_world_size: bool = True, enable: bool = True) -> None:
        self.ddp = ddp
        self.divide_by_initial_world_size = bool(divide_by_initial_world_size)
        self.enable = bool(enable)
        self.iterations = 0
        self.shadowed = 0

    def __enter__(self) -> Join:
        if self.enable:
            if self.ddp._join is not None:
                raise RuntimeError("DDP.join: already inside a join context")
            self.ddp._join = self
            self.iterations = 0
        return self

    def _handshake(self, active: int) -> int:
        flag = np.array([active], dtype=np.int64)
        return int(self.ddp.group.allreduce(flag, "sum", out=flag)[0])

    def _set_divisor(self, active: int) -> None:
        n = self.ddp.group.size
        self.ddp._divisor = n if self.divide_by_initial_world_size else max(1, active)

    def notify_active(self) -> None:
        """Called by ``DDP.forward`` on a rank that still has data."""
        active = self._handshake(1)
        self._set_divisor(active)
        self.iterations += 1

    def after_sync_pass(self) -> None:
        self.ddp._divisor = self.ddp.group.size

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if not self.enable:
            return
        ddp = self.ddp
        try:
            if exc_type is not None:
                return  # the failing rank's peers learn of it from the transport, not by hanging here
            while True:
                active = self._handshake(0)
                if active == 0:
                    break
                self._set_divisor(active)
                if ddp.broadcast_buffers and ddp.group.size > 1:
                    bufs = [b for _, b in ddp._buffers()]
                    if bufs:
                        ddp._broadcast_coalesced(bufs, root=0)
                ddp._shadow_sync_pass()
                self.shadowed += 1
            self._sync_final_model()
        finally:
            ddp._join = None
            ddp._divisor = ddp.group.size

    def _sync_final_model(self) -> None:
        ddp = self.ddp
        if ddp.group.size == 1:
            return
        counts = ddp.group.all_gather(np.array([self.iterations], dtype=np.int64)).reshape(-1)
        src = int(np.argmax(counts))  # first rank with the most iterations
        ddp._broadcast_coalesced([p.data for _, p in ddp._named] + [b for _, b in ddp._buffers()], root=src)

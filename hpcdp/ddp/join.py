"""``Join``: uneven inputs without hangs, as torch's ``Join`` context does for DDP.

Protocol (all ranks of the DDP group, in the same order):

1. Inside ``with ddp.join():`` every training forward ``ddp(x)`` first allreduces the pair
   (1, syncs) where syncs is 0 under ``no_sync()`` and 1 otherwise (torch's DDP does the same with
   two allreduces); the sums are the number of active ranks and of ranks whose backward will
   reduce gradients this iteration.
2. A rank that leaves the ``with`` block (its data ran out) keeps answering that allreduce with
   (0, 0), and whenever the active count is still positive it shadows the iteration: the buffer
   broadcast (if any) and, only when the others sync, every bucket's reduction with zero
   gradients and the used-map allreduce (if ``find_unused_parameters``), in bucket order.
   Active ranks that disagree about ``no_sync`` make every rank raise instead of hanging.
3. When the active count is 0 every rank has left; the ranks agree on the one that ran the most
   synced iterations (lowest rank on ties) and broadcast its parameters (frozen ones too) and
   buffers, because ranks that joined early skipped optimizer steps. Optimizer state is not
   synchronised (as in torch).

Divisor: with ``divide_by_initial_world_size=True`` (torch's default) the summed gradient is divided
by the group size, so a joined rank counts as a zero gradient; with False it is divided by the
number of ranks still training in that iteration, i.e. the mean over the actual contributors.

Every training forward inside the block must be followed by ``ddp.backward`` and by no other
collective on the DDP group (joined ranks could not match it).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import HpcdpError

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
            if self.ddp._reducer.join is not None:
                raise RuntimeError("DDP.join: already inside a join context")
            self.ddp._reducer.join = self
            self.iterations = 0
        return self

    def _handshake(self, active: int, sync: int) -> tuple[int, int]:
        """Allreduce (active, sync); return (ranks still training, ranks syncing this iteration)."""
        flag = np.array([active, sync], dtype=np.int64)
        with self.ddp._comm_lock():
            self.ddp.group.allreduce(flag, "sum", out=flag)
        n_active, n_sync = int(flag[0]), int(flag[1])
        if 0 < n_sync < n_active:
            raise HpcdpError(
                f"DDP.join (rank {self.ddp.group.rank} of group {self.ddp.group.name}): {n_sync} of "
                f"{n_active} training ranks sync gradients in this iteration and the others are "
                "inside no_sync(); every rank must use no_sync() for the same iterations")
        return n_active, n_sync

    def _set_divisor(self, active: int) -> None:
        n = self.ddp.group.size
        self.ddp._reducer.divisor = n if self.divide_by_initial_world_size else max(1, active)

    def notify_active(self, sync: bool) -> None:
        """Called by every training ``DDP.forward`` on a rank that still has data."""
        active, _ = self._handshake(1, int(sync))
        if sync:
            self._set_divisor(active)
            self.iterations += 1

    def after_sync_pass(self) -> None:
        self.ddp._reducer.divisor = self.ddp.group.size

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if not self.enable:
            return
        ddp = self.ddp
        try:
            if exc_type is not None:
                return  # the failing rank's peers learn of it from the transport, not by hanging here
            while True:
                active, syncing = self._handshake(0, 0)
                if active == 0:
                    break
                ddp._sync_buffers()
                if syncing:
                    self._set_divisor(active)
                    ddp._reducer.shadow_sync_pass()
                    self.shadowed += 1
            self._sync_final_model()
        finally:
            ddp._reducer.join = None
            ddp._reducer.divisor = ddp.group.size

    def _sync_final_model(self) -> None:
        ddp = self.ddp
        if ddp.group.size == 1:
            return
        mine = np.array([self.iterations], dtype=np.int64)
        with ddp._comm_lock():
            counts = ddp.group.all_gather(mine).reshape(-1)
        src = int(np.argmax(counts))  # first rank with the most synced iterations
        ddp._sync_module_state(root=src)

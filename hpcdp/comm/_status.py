"""``Status``: what a probe or an any-source receive matched (mpi4py's ``MPI.Status``, as a
value): the point-to-point calls return it (``comm/_group_p2p``), ``hpcdp.probe`` and
``hpcdp.iprobe`` hand it to users (``comm/p2p``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["Status"]


@dataclass(frozen=True)
class Status:
    """What a probe or an any-source receive matched: group rank, tag and size in bytes, and the
    dtype and shape the sender sent (None where they are not known: a transport that does not
    carry them, or a probe under ``HPCDP_DEBUG=detail``, whose header is read only on receipt).
    Equality compares source, tag and size only."""

    source: int
    tag: int
    nbytes: int
    dtype: np.dtype | None = field(default=None, compare=False)
    shape: tuple[int, ...] | None = field(default=None, compare=False)

    def count(self, dtype: Any = None) -> int:
        """How many elements of ``dtype`` the message holds; by default of the dtype it was
        sent with (bytes where that is not known). mpi4py's ``Get_count`` counts bytes by
        default: ``count(np.uint8)`` does."""
        if dtype is None:
            dtype = self.dtype if self.dtype is not None else np.uint8
        return self.nbytes // np.dtype(dtype).itemsize

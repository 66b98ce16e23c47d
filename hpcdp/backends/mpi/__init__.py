"""The MPI backend (mpi4py buffer calls, nonblocking underneath so every wait has a deadline).

Modules by concern: ``_backend`` (the ``MPIBackend`` class: collectives, point to point, groups,
lifetime), ``_requests`` (requests, and memory MPI may still write), ``_notices`` (the side channel:
"left" notices and roll calls), ``_fastpath`` (the small-message path, behind one switch),
``_tuning`` (libnbc's allreduce algorithm by size), ``_staging`` (cupy arrays).
"""
from __future__ import annotations

from ._backend import MPIBackend, create_world, get_mpi, set_max_message_elements
from ._staging import cuda_aware, describe

__all__ = ["MPIBackend", "create_world", "cuda_aware", "describe", "get_mpi",
           "set_max_message_elements"]

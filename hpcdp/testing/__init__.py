"""The conformance suite and test helpers every backend and every hpcdp test uses.

- ``suite``: the cases a new backend must pass (collectives against numpy for every op, dtype and
  shape; p2p; timeouts; failures), runnable on any registered backend or inside ``mpirun``;
- ``run_ranks`` / ``run_mpi`` / ``check``: run a body on N ranks and assert on what they report;
- ``fixtures`` (needs pytest): ``world`` (one test body on simulated, TCP and MPI worlds),
  ``mpi_world`` and the MPI-safe ``shared_tmp_path``.
"""
from __future__ import annotations

from ._harness import check, remove_shared_dir, run_mpi, run_ranks, shared_dir, spawn_backends
from .suite import CASES, Case, check_failures, matrix, run_case, run_case_here

__all__ = ["run_ranks", "run_mpi", "check", "spawn_backends", "shared_dir", "remove_shared_dir",
           "CASES", "Case", "matrix", "run_case", "run_case_here", "check_failures"]

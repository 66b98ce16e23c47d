"""Shared fixtures: run a test body on N ranks of a backend, or on the MPI world under mpirun."""
from __future__ import annotations

import os
import sys
import tempfile
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # test bodies are imported by reference in spawned processes
    sys.path.insert(0, HERE)

# Flight records that tests' timeouts and failures dump go to a scratch directory, not ./hpcdp-trace
os.environ.setdefault("HPCDP_TRACE_DIR", os.path.join(tempfile.gettempdir(), f"hpcdp-test-trace-{os.getpid()}"))

import hpcdp  # noqa: E402


from hpcdp.testing import run_mpi, run_ranks, spawn_backends  # noqa: E402,F401 - used by tests
from hpcdp.testing.fixtures import mpi_world, shared_tmp_path  # noqa: E402,F401 - fixtures

SPAWN_BACKENDS = spawn_backends()


@pytest.fixture
def log():
    """Messages the ``hpcdp.tcp`` logger emits during the test (DEBUG and up)."""
    import logging

    from tcp_helpers import LogCollector

    handler = LogCollector(logging.DEBUG).attach()
    try:
        yield handler.messages
    finally:
        handler.detach()

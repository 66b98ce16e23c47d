"""Shared fixtures: run a test body on N ranks of a backend, or on the MPI world under mpirun."""
from __future__ import annotations

import os
import sys
import tempfile
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:  # test bodies are imported by reference in spawned processes
    sys.path.insert(0, HERE)

# Flight records that tests' timeouts and failures dump go to a scratch directory, not ./hpcdp-trace
os.environ.setdefault("HPCDP_TRACE_DIR", os.path.join(tempfile.gettempdir(), f"hpcdp-test-trace-{os.getpid()}"))

import hpcdp  # noqa: E402


from hpcdp.testing import run_mpi, run_ranks, spawn_backends  # noqa: E402,F401 - used by tests
from hpcdp.testing.fixtures import (  # noqa: E402,F401 - fixtures, and their world lists
    World, grid, mpi_world, shared_tmp_path, world, worlds,
)

SPAWN_BACKENDS = spawn_backends()

#: what would make a job a test launches join this process's job (or pick its backend)
LAUNCH_VARS = ("HPCDP_BACKEND", "HPCDP_MASTER_ADDR", "MASTER_ADDR", "RANK", "WORLD_SIZE")


def parse_source(text: str, filename: str = "<unknown>"):
    """``ast.parse(text, filename)``, again if CPython 3.11 says "AST constructor recursion depth
    mismatch": its AST builder keeps one depth counter for all threads, and 3.11's ``traceback``
    parses source to place its carets, so a background thread logging an exception while a test
    parses trips it (fixed in 3.12). A real syntax error is raised as before."""
    import ast

    for attempt in range(5):
        try:
            return ast.parse(text, filename)
        except SystemError as exc:
            if "recursion depth mismatch" not in str(exc) or attempt == 4:
                raise


def job_env(*drop: str, **settings: str) -> dict[str, str]:
    """The environment of a job or command a test launches: this checkout importable, mpirun
    allowed as root, ``settings`` added, none of ``LAUNCH_VARS`` nor of ``drop``."""
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **settings)
    for k in LAUNCH_VARS + drop:
        env.pop(k, None)
    return env


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

"""The job every ``cluster/`` check runs in: its default group, and what the launcher promised.

``ci/multinode/test.sh`` tells every rank (through the launcher, as a user would: ``mpirun -x``,
the environment ``sbatch`` exports, that of ``hpcdp-run``) how many nodes and ranks per node it
asked for, so the checks compare what hpcdp sees with what was launched, not with itself.

Not a ``conftest.py``: the suite's own modules import ``conftest`` by name (``tests/conftest.py``),
and a second one on the path would shadow it.  Check modules import the fixture from here.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import pytest

import hpcdp


@dataclass(frozen=True)
class Layout:
    """What the launch asked for, and where this rank is."""

    launcher: str       # mpirun | hpcdp-run | srun
    nodes: int          # nodes the job was started on
    per_node: int       # ranks started on each node
    backend: str        # the default group's backend as hpcdp.init() chose it
    hosts: tuple[str, ...]  # every rank's host name, by rank


def _need(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise pytest.UsageError(f"{name} is not set: run tests/multinode/cluster through "
                                "ci/multinode/test.sh (make test-multinode)")
    return value


@pytest.fixture(scope="session", autouse=True)
def layout() -> Layout:
    """Joins the job (``hpcdp.init()``: MPI under mpirun/srun, TCP under hpcdp-run) once."""
    if not hpcdp.is_initialized():
        hpcdp.init()
    g = hpcdp.get_default_group()
    hosts = tuple(g.all_gather_object(socket.gethostname()))
    return Layout(launcher=_need("HPCDP_MN_LAUNCHER"), nodes=int(_need("HPCDP_MN_NODES")),
                  per_node=int(_need("HPCDP_MN_PER_NODE")), backend=g.backend.name, hosts=hosts)

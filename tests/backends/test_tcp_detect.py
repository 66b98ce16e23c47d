"""``hpcdp.init()`` picks TCP from the torchrun-style environment, and only from a complete one."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from hpcdp.comm.world import detect_backend
from hpcdp.launch._processes import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_LAUNCHER_PREFIXES = ("OMPI_", "PMI", "MPI_", "SLURM", "HPCDP_", "MASTER_")
_RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if not k.startswith(_LAUNCHER_PREFIXES) and k not in _RANK_VARS}


@pytest.mark.parametrize("env, expected", [
    ({}, "sim"),
    ({"HPCDP_MASTER_ADDR": "127.0.0.1"}, "tcp"),
    ({"MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "2"}, "tcp"),
    # incomplete torchrun environments are not a TCP job
    ({"MASTER_ADDR": "127.0.0.1"}, "sim"),
    ({"MASTER_ADDR": "127.0.0.1", "RANK": "0"}, "sim"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "sim"),
    # an explicit choice wins
    ({"HPCDP_BACKEND": "sim", "MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "2"}, "sim"),
    ({"HPCDP_BACKEND": "tcp"}, "tcp"),
])
def test_detect_backend_reads_the_tcp_environment(monkeypatch, env, expected) -> None:
    for k in list(os.environ):
        if k.startswith(_LAUNCHER_PREFIXES) or k in _RANK_VARS:
            monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert detect_backend() == expected


INIT_JOB = """
    import numpy as np
    import hpcdp
    g = hpcdp.init()
    x = hpcdp.allreduce(np.full(3, hpcdp.rank() + 1.0))
    print(g.backend.name, hpcdp.rank(), hpcdp.world_size(), x[0])
    hpcdp.finalize()
"""


@pytest.mark.parametrize("prefix", ["", "HPCDP_"])
def test_init_without_arguments_joins_a_tcp_job(tmp_path, prefix: str) -> None:
    """Two processes with only the environment set (``MASTER_*`` or ``HPCDP_MASTER_*``) form
    a TCP world through ``hpcdp.init()``."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(INIT_JOB))
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = _clean_env()
        env.update({f"{prefix}MASTER_ADDR": "127.0.0.1", f"{prefix}MASTER_PORT": port,
                    f"{prefix}RANK": str(rank), f"{prefix}WORLD_SIZE": "2",
                    "HPCDP_SECRET": "detect-test-secret", "PYTHONPATH": ROOT})
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + 60
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            assert p.returncode == 0, err
            outs.append(out.strip())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert outs == ["tcp 0 2 3.0", "tcp 1 2 3.0"]

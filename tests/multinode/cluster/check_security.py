"""The TCP backend beyond loopback: a weak ``HPCDP_SECRET`` is refused before anything listens
on the network, and a strong one forms a world across nodes.

Each test starts fresh TCP ranks (one per node, a subprocess of that node's first rank) on the
nodes' real interfaces, whatever the backend of the job that coordinates them.
"""
from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys

import pytest

import hpcdp
from hpcdp.launch import free_port
from hpcdp.testing import check, run_mpi

from mn_cluster import Layout, layout  # noqa: F401 - the fixture

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

#: one TCP rank: join the world, allreduce its rank + 1, print the sum
RANK_SCRIPT = """
import numpy as np, hpcdp
hpcdp.init("tcp", timeout=30)
total = hpcdp.allreduce(np.array([hpcdp.rank() + 1.0]))
print("SUM", int(total[0]), flush=True)
hpcdp.finalize()
"""


def _env(rank: int, size: int, master: str, port: int, secret: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PMI_", "SLURM_", "HPCDP_MASTER"))}
    env.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK="0", MASTER_ADDR=master,
               MASTER_PORT=str(port), HPCDP_SECRET=secret, HPCDP_BACKEND="tcp",
               HPCDP_CONNECT_TIMEOUT="30", PYTHONPATH=REPO)
    return env


def _body_world(rank: int, hosts: tuple[str, ...], secret: str, port: int) -> list[str] | dict:
    """The first rank of every node starts TCP rank k (k = its node), master on node 0."""
    firsts = [r for r, h in enumerate(hosts) if hosts.index(h) == r]
    if rank not in firsts:
        return []
    k = firsts.index(rank)
    proc = subprocess.run([sys.executable, "-c", RANK_SCRIPT], capture_output=True, text=True,
                          timeout=90, stdin=subprocess.DEVNULL,
                          env=_env(k, len(firsts), hosts[0], port, secret))
    return {"rc": proc.returncode, "out": proc.stdout, "err": proc.stderr[-2000:], "n": len(firsts)}


def _port() -> int:
    """A port free on node 0's interface (rank 0 picks it; every rank gets it)."""
    g = hpcdp.get_default_group()
    return g.broadcast_object(free_port(socket.gethostbyname(socket.gethostname()))
                              if g.rank == 0 else None, root=0)


def test_weak_secret_is_refused_beyond_loopback(layout: Layout) -> None:
    res = run_mpi(_body_world, layout.hosts, "password1234", _port())
    for r in res:
        if r == []:
            continue
        assert r["rc"] != 0, f"a TCP rank across nodes started with a weak secret: {r}"
        assert "HPCDP_SECRET is too weak for a job that listens on the network" in r["err"], r
        assert "SUM" not in r["out"], r


def test_strong_secret_forms_a_world_across_nodes(layout: Layout) -> None:
    secret = hpcdp.get_default_group().broadcast_object(secrets.token_hex(32), root=0)
    res = [r for r in run_mpi(_body_world, layout.hosts, secret, _port()) if r != []]
    assert len(res) == layout.nodes
    want = sum(range(1, layout.nodes + 1))
    for r in res:
        assert r["rc"] == 0 and f"SUM {want}" in r["out"], r


def _body_launcher_refuses(rank: int, hosts: tuple[str, ...]) -> list[str]:
    """``hpcdp-run --nnodes 2`` with a weak secret stops before starting any rank."""
    if rank != 0:
        return []
    env = _env(0, 1, hosts[0], 29999, "password1234")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HPCDP_BACKEND"):
        env.pop(k)
    proc = subprocess.run([sys.executable, "-m", "hpcdp.run", "-n", "1", "--nnodes", "2",
                           "--node-rank", "0", "--master-addr", hosts[0], os.devnull],
                          capture_output=True, text=True, timeout=60, env=env,
                          stdin=subprocess.DEVNULL)
    if proc.returncode == 0 or "HPCDP_SECRET is too weak for a multi-node job" not in proc.stderr:
        return [f"hpcdp-run with a weak secret across nodes: rc {proc.returncode}, "
                f"{proc.stderr[-500:]!r}"]
    return []


def test_launcher_refuses_a_weak_secret_across_nodes(layout: Layout) -> None:
    check(run_mpi(_body_launcher_refuses, layout.hosts))

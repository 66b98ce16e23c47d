"""Every layer across nodes, on the backend the launcher gave (MPI under mpirun and srun, TCP
under hpcdp-run): the conformance suite, DDP, FSDP (each strategy), pipelines, RPC, checkpoints.

The bodies are the single-node suite's own (``tests/*_bodies.py``, ``hpcdp.testing``); here
they run with half the ranks on another host, over the simulated network.
"""
from __future__ import annotations

import os
import socket
import tempfile

import pytest

import hpcdp
from hpcdp.testing import CASES, check, run_case_here, run_mpi
from hpcdp.testing.suite import check_failures

import ckpt_bodies
import ddp_bodies
import fsdp_bodies
import pipeline_bodies
import rpc_bodies

from mn_cluster import Layout, layout  # noqa: F401 - the fixture

#: conformance cases that an already running job can take (not those that need a rank to leave)
CASES_HERE = [c for c in CASES if not c.spawn_only]


@pytest.mark.parametrize("case", CASES_HERE, ids=[c.name for c in CASES_HERE])
def test_conformance(case) -> None:  # noqa: ANN001 - a hpcdp.testing.Case
    check_failures(run_case_here(case))


@pytest.mark.parametrize("model", ["mlp", "tied"])
def test_ddp_matches_one_process(model: str) -> None:
    check(run_mpi(ddp_bodies.body_parity, model))


def test_ddp_overlaps_backward_across_nodes() -> None:
    check(run_mpi(ddp_bodies.body_overlap))


@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op", "no_shard", "hybrid_shard"])
def test_fsdp_matches_one_process(strategy: str) -> None:
    # hybrid_shard with shard_size=None: ranks per node, from the launcher's environment
    check(run_mpi(fsdp_bodies.body_parity, strategy))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_stages_on_both_nodes(schedule: str) -> None:
    # as many stages as ranks: consecutive stages cross from one node to the next
    n = hpcdp.world_size()
    check(run_mpi(pipeline_bodies.body_parity, schedule, n, 4, 1))


def test_pipeline_with_data_parallel_replicas() -> None:
    check(run_mpi(pipeline_bodies.body_pp_dp, "1f1b", 2))


@pytest.mark.parametrize("body", ["body_call_forms", "body_values", "body_rrefs"])
def test_rpc(body: str) -> None:
    check(run_mpi(getattr(rpc_bodies, body)))


def test_checkpoint_roundtrip_on_the_shared_directory(shared_tmp_path: str) -> None:
    path = os.path.join(shared_tmp_path, "step-1")
    check(run_mpi(ckpt_bodies.body_roundtrip, path))


def _body_tmp_is_node_local(rank: int, name: str, hosts: tuple[str, ...]) -> list[str]:
    """The control for the test above: a file rank 0 wrote in its /tmp is seen by the ranks of
    its node only, so a checkpoint that passes there went through the shared directory."""
    seen = os.path.exists(name)
    same_node = hosts[rank] == hosts[0]
    return [] if seen == same_node else [
        f"{name} (rank 0's /tmp on {hosts[0]}) is {'visible' if seen else 'missing'} on "
        f"{hosts[rank]}"]


def test_tmp_is_node_local_as_on_a_real_cluster(layout: Layout) -> None:
    g = hpcdp.get_default_group()
    name = None
    if g.rank == 0:
        fd, name = tempfile.mkstemp(prefix="hpcdp-mn-local-", dir="/tmp")
        os.close(fd)
    name = g.broadcast_object(name, root=0)
    try:
        check(run_mpi(_body_tmp_is_node_local, name, layout.hosts))
    finally:
        g.barrier()
        if g.rank == 0:
            os.unlink(name)


def _body_addresses(rank: int) -> list[str]:
    """TCP ranks listen on the node's own interface, never on loopback, once the job spans
    nodes (``tcp.bind_address``)."""
    from hpcdp.backends.tcp import bind_address

    master = os.environ.get("MASTER_ADDR", "")
    addr = bind_address(master)
    mine = socket.gethostbyname(socket.gethostname())
    return [] if addr == mine and not addr.startswith("127.") else [
        f"bind_address({master!r}) is {addr}, want this node's {mine}"]


def _body_node_address(rank: int) -> list[str]:
    """Under MPI: each rank's host name resolves to its node's own address on the virtual
    network (what Open MPI's TCP transport between the nodes runs over), never loopback, and
    ranks of different nodes have different addresses."""
    mine = socket.gethostbyname(socket.gethostname())
    every = hpcdp.get_default_group().all_gather_object((socket.gethostname(), mine))
    fails = [] if not mine.startswith("127.") else [f"{socket.gethostname()} resolves to {mine}"]
    by_host = {h: a for h, a in every}
    if len(set(by_host.values())) != len(by_host):
        fails.append(f"nodes share an address: {by_host}")
    return fails


def test_ranks_address_their_node_interface(layout: Layout) -> None:
    """TCP: ranks listen on the interface that routes to the master; MPI: every node has its
    own address on the virtual network."""
    check(run_mpi(_body_addresses if layout.backend == "tcp" else _body_node_address))

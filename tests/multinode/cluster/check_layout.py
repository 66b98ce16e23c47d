"""Placement across nodes: the node count, ``local_rank()`` and node-local groups are what the
launcher made, under each launcher (mpirun --host, hpcdp-run --nnodes, srun --nodes)."""
from __future__ import annotations

import socket
from collections import Counter

import numpy as np

import hpcdp
from hpcdp import nn
from hpcdp.testing import check, run_mpi

from mn_cluster import Layout, layout  # noqa: F401 - the fixture


def test_ranks_sit_on_the_nodes_the_launcher_asked_for(layout: Layout) -> None:
    per_host = Counter(layout.hosts)
    assert len(per_host) == layout.nodes, f"{layout.launcher}: ranks on hosts {dict(per_host)}"
    assert set(per_host.values()) == {layout.per_node}, dict(per_host)
    # the simulated nodes, not the machine they run on
    assert all(h.startswith("hpcdp-n") for h in per_host), dict(per_host)
    # block placement, as every launcher here was asked for: node k holds ranks k*P..k*P+P-1
    for r, h in enumerate(layout.hosts):
        assert h == layout.hosts[(r // layout.per_node) * layout.per_node], layout.hosts


def _body_local_rank(rank: int, hosts: tuple[str, ...]) -> list[str]:
    mine = [r for r, h in enumerate(hosts) if h == hosts[rank]]
    want = mine.index(rank)
    got = hpcdp.local_rank()
    return [] if got == want else [f"local_rank() is {got}, want {want} (ranks on "
                                   f"{hosts[rank]}: {mine})"]


def test_local_rank_counts_within_the_node(layout: Layout) -> None:
    check(run_mpi(_body_local_rank, layout.hosts))


def _body_node_groups(rank: int, nodes: int) -> list[str]:
    """Node-local groups built the way a user would, from ``local_rank()`` and the node count:
    each holds exactly the ranks of one host, and the "same local rank" groups span the nodes."""
    g = hpcdp.get_default_group()
    per_node = g.size // nodes
    node = rank // per_node
    local = [g.new_group(list(range(k * per_node, (k + 1) * per_node))) for k in range(nodes)]
    across = [g.new_group([j + k * per_node for k in range(nodes)]) for j in range(per_node)]
    fails: list[str] = []
    mine_local, mine_across = local[node], across[hpcdp.local_rank()]
    hosts = mine_local.all_gather_object(socket.gethostname())
    if len(set(hosts)) != 1:
        fails.append(f"node-local group of node {node} spans hosts {hosts}")
    hosts = mine_across.all_gather_object(socket.gethostname())
    if len(set(hosts)) != nodes:
        fails.append(f"cross-node group of local rank {hpcdp.local_rank()} is on hosts {hosts}")
    total = mine_local.allreduce(np.array([rank], dtype=np.int64))
    want = sum(range(node * per_node, (node + 1) * per_node))
    if int(total[0]) != want:
        fails.append(f"node-local allreduce gave {int(total[0])}, want {want}")
    return fails


def test_node_local_groups_hold_one_node_each(layout: Layout) -> None:
    check(run_mpi(_body_node_groups, layout.nodes))


def _body_hybrid_groups(rank: int, nodes: int, per_node: int) -> list[str]:
    """``hybrid_shard`` with the default ``shard_size`` (ranks per node, from the launcher):
    its shard group is one node's ranks, its replica group one rank of every node."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    fsdp = hpcdp.FSDP(model, strategy="hybrid_shard")
    shard, rep = fsdp.comm.shard, fsdp.comm.replicate
    fails: list[str] = []
    if shard is None or shard.size != per_node:
        fails.append(f"shard group of size {None if shard is None else shard.size}, want "
                     f"{per_node} (ranks per node)")
    else:
        hosts = shard.all_gather_object(socket.gethostname())
        if len(set(hosts)) != 1:
            fails.append(f"shard group spans hosts {hosts}: it must stay within a node")
    if rep is None or rep.size != nodes:
        fails.append(f"replica group of size {None if rep is None else rep.size}, want {nodes}")
    else:
        hosts = rep.all_gather_object(socket.gethostname())
        if len(set(hosts)) != nodes:
            fails.append(f"replica group on hosts {hosts}: want one rank per node")
    return fails


def test_hybrid_shard_shards_within_a_node_and_replicates_across(layout: Layout) -> None:
    check(run_mpi(_body_hybrid_groups, layout.nodes, layout.per_node))

"""``python -m hpcdp.bench multinode``: M1, M2 of PERF.md on a job that spans nodes.

Run on every rank of a job over two or more nodes, under any launcher (the backend is the one
``hpcdp.init()`` picks: MPI under mpirun/srun, TCP under hpcdp-run)::

    ci/multinode/bench.sh          # the simulated cluster, link shaped to 2 Gbit/s with tc tbf

* M1: allreduce bus bandwidth across nodes (nccl-tests' busbw = algbw * 2(n-1)/n) against the
  link rate given with ``--link-gbit``; with a ring over nodes of k ranks each, every node's link
  carries one ring edge each way, so busbw cannot pass the link rate.
* HIER: a hierarchical allreduce (reduce to the node's first rank, allreduce among those, broadcast
  within the node), built here from public calls on the same buffers, timed interleaved with the
  flat one; the figure is t_hier / t_flat (below 1: hierarchical wins). A measurement for deciding
  whether the library should have one, not a feature.
* M2: DDP weak scaling, 2 nodes vs 1: the same per-rank batch on the first node's ranks alone
  (the other nodes wait) and on every rank, interleaved; efficiency = t_one_node / t_all_nodes.

Nodes are told apart by host name (every rank's ``socket.gethostname()``); ranks are expected in
blocks per node, as every launcher places them by default.
"""
from __future__ import annotations

import argparse
import socket
import statistics
import time
from typing import Any, Callable

import numpy as np

import hpcdp
from hpcdp import nn, optim

from ._common import JsonSink, busbw_factor, fmt_size, interleaved, pretouch, summarize, time_loop

__all__ = ["main", "hierarchical_allreduce"]


class _Nodes:
    """The job's nodes: this rank's node group, the group of every node's first rank."""

    def __init__(self, g: Any) -> None:
        hosts = g.all_gather_object(socket.gethostname())
        self.hosts: list[str] = list(dict.fromkeys(hosts))
        self.members = [[r for r, h in enumerate(hosts) if h == host] for host in self.hosts]
        self.index = self.hosts.index(hosts[g.rank])
        # every rank creates every group, in the same order (new_group is collective)
        groups = [g.new_group(m) for m in self.members]
        self.local = groups[self.index]
        self.leaders = g.new_group([m[0] for m in self.members])
        self.is_leader = g.rank == self.members[self.index][0]

    @property
    def count(self) -> int:
        return len(self.hosts)


def hierarchical_allreduce(x: np.ndarray, nodes: _Nodes, out: np.ndarray) -> np.ndarray:
    """Sum ``x`` over every rank: reduce within the node, allreduce across the nodes' first ranks,
    broadcast within the node. ``out`` receives the sum on every rank."""
    nodes.local.reduce(x, "sum", root=0, out=out)
    if nodes.is_leader:
        nodes.leaders.allreduce(out, "sum", out=out)
    nodes.local.broadcast(out, root=0)
    return out


def _slowest(g: Any, t: float) -> float:
    return float(g.allreduce(np.array([t]), "max")[0])


def bench_allreduce(g: Any, nodes: _Nodes, sizes: list[int], trials: int, link_gbit: float | None,
                    hier: bool, sink: JsonSink) -> list[dict[str, Any]]:
    """M1 (and HIER): flat and hierarchical allreduce at each size, interleaved."""
    rows = []
    factor = busbw_factor("allreduce", g.size)
    if g.rank == 0:
        print(f"# M1 allreduce across {nodes.count} nodes x {g.size // nodes.count} ranks "
              f"({g.backend.name}); link {link_gbit or '?'} Gbit/s"
              + ("; HIER: reduce in node, allreduce across, broadcast in node" if hier else ""))
        print(f"# {'size':>10} {'flat(ms)':>9} {'busbw(GB/s)':>11} {'of link':>7}"
              + (f" {'hier(ms)':>9} {'hier/flat':>9}" if hier else ""))
    for size in sizes:
        x = np.ones(size // 4, dtype=np.float32)
        out = np.empty_like(x)
        pretouch(x, out)
        flat = lambda: g.allreduce(x, "sum", out=out)  # noqa: E731
        hier_fn = lambda: hierarchical_allreduce(x, nodes, out)  # noqa: E731
        flat()
        probe = time.perf_counter()
        flat()
        one = _slowest(g, time.perf_counter() - probe)
        iters = int(g.broadcast_object(max(3, min(200, 0.3 / max(one, 1e-6))), root=0))

        def timed(fn: Callable[[], Any]) -> Callable[[], float]:
            return lambda: _slowest(g, time_loop(fn, iters, g.barrier))

        if hier:
            hier_fn()
            tr = interleaved(timed(flat), timed(hier_fn), trials)
            t_flat, t_hier = tr.base_median, tr.cand_median
            ratio = tr.median_ratio
        else:
            t_flat = statistics.median(timed(flat)() for _ in range(trials))
            t_hier, ratio = float("nan"), float("nan")
        busbw = size / t_flat * factor / 1e9
        share = busbw / (link_gbit / 8) if link_gbit else float("nan")
        row = {"bench": "multinode", "op": "M1", "backend": g.backend.name, "ranks": g.size,
               "nodes": nodes.count, "size": size, "iters": iters, "flat_ms": t_flat * 1e3,
               "busbw_gbs": busbw, "link_gbit": link_gbit, "busbw_of_link": share,
               "hier_ms": t_hier * 1e3, "hier_over_flat": ratio}
        rows.append(row)
        sink.write(row)
        if g.rank == 0:
            print(f"  {fmt_size(size):>10} {t_flat * 1e3:>9.2f} {busbw:>11.3f} {share:>7.2f}"
                  + (f" {t_hier * 1e3:>9.2f} {ratio:>9.3f}" if hier else ""), flush=True)
    return rows


def _mlp(seed: int, hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(784, hidden, seed=seed), nn.ReLU(),
                         nn.Linear(hidden, hidden, seed=seed + 1), nn.ReLU(),
                         nn.Linear(hidden, 10, seed=seed + 2))


def bench_ddp(g: Any, nodes: _Nodes, trials: int, batch: int, hidden: int, iters: int,
              sink: JsonSink) -> dict[str, Any]:
    """M2: DDP steps on the first node's ranks alone vs on every rank (same batch per rank)."""
    rng = np.random.default_rng(g.rank)
    x = rng.normal(size=(batch, 784)).astype(np.float32)
    y = rng.integers(0, 10, batch)
    loss = nn.CrossEntropyLoss()
    on_first = nodes.index == 0
    first = g.new_group(nodes.members[0])  # collective: every rank takes part
    small = hpcdp.DDP(_mlp(0, hidden), group=first) if on_first else None
    whole = hpcdp.DDP(_mlp(0, hidden), group=g)
    opts = {id(m): optim.SGD(m.parameters(), lr=1e-3) for m in (small, whole) if m is not None}

    def step(ddp: Any) -> None:
        loss(ddp(x), y)
        ddp.backward(loss.backward())
        opts[id(ddp)].step()
        opts[id(ddp)].zero_grad()

    def t_one_node() -> float:
        # the other nodes sleep (not spin) meanwhile: they share this machine's cores
        g.barrier()
        box = np.zeros(1)
        if on_first:
            t = time_loop(lambda: step(small), iters, first.barrier)
            box[0] = float(first.allreduce(np.array([t]), "max")[0])
            if g.rank == 0:
                for w in [g.isend(box, r, tag=91) for r in range(g.size) if r not in nodes.members[0]]:
                    w.wait()
        else:
            req = g.irecv(box, 0, tag=91)
            while not req.is_completed():
                time.sleep(1e-3)
        return float(g.broadcast_object(float(box[0]) if g.rank == 0 else None, root=0))

    def t_all_nodes() -> float:
        return _slowest(g, time_loop(lambda: step(whole), iters, g.barrier))

    if on_first:
        step(small)
    step(whole)
    tr = interleaved(t_one_node, t_all_nodes, trials)
    eff = statistics.median(b / c for b, c in zip(tr.base, tr.cand))
    res = {"bench": "multinode", "op": "M2", "backend": g.backend.name, "ranks": g.size,
           "nodes": nodes.count, "per_node": len(nodes.members[0]), "batch": batch,
           "hidden": hidden, "t_one_node_ms": tr.base_median * 1e3,
           "t_all_nodes_ms": tr.cand_median * 1e3, "efficiency": eff}
    sink.write(res)
    if g.rank == 0:
        print(f"# M2 DDP weak scaling ({g.backend.name}, MLP 784-{hidden}-{hidden}-10, batch "
              f"{batch}/rank): 1 node x {len(nodes.members[0])} {res['t_one_node_ms']:.2f} ms, "
              f"{nodes.count} nodes x {len(nodes.members[0])} {res['t_all_nodes_ms']:.2f} ms per "
              f"step -> efficiency {eff:.3f}", flush=True)
    return res


def parser() -> argparse.ArgumentParser:
    """Options of M1, HIER, M2."""
    p = argparse.ArgumentParser(
        prog="python -m hpcdp.bench multinode",
        description="M1, M2 across nodes: allreduce busbw against the link rate, a hierarchical "
                    "allreduce against the flat one, DDP weak scaling over nodes. Run on every "
                    "rank of a job spanning nodes (ci/multinode/bench.sh on the simulated cluster).")
    p.add_argument("--sizes", default="1,4,16,64", help="allreduce sizes in MiB, comma-separated")
    p.add_argument("--link-gbit", type=float, default=None,
                   help="the link rate between nodes (Gbit/s), for busbw as a share of it")
    p.add_argument("--trials", type=int, default=5, help="interleaved trials per figure")
    p.add_argument("--only", default="M1,HIER,M2", help="comma-separated subset of M1,HIER,M2")
    p.add_argument("--ddp-hidden", type=int, default=1024, help="M2: hidden width of the MLP")
    p.add_argument("--ddp-batch", type=int, default=64, help="M2: batch per rank")
    p.add_argument("--ddp-iters", type=int, default=10, help="M2: steps per trial")
    p.add_argument("--json", default=None, help="append JSON lines to this file")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run M1 (with HIER) and M2 on the job this rank belongs to; print rows and summaries."""
    p = parser()
    args = p.parse_args(argv)
    try:
        sizes = [int(float(s) * (1 << 20)) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        p.error(f"--sizes: MiB values separated by commas, got {args.sizes!r}")
    if not sizes or min(sizes) < 4 or args.trials < 1 or args.ddp_iters < 1:
        p.error("--sizes must be positive, --trials and --ddp-iters >= 1")
    only = {s.strip().upper() for s in args.only.split(",") if s.strip()}
    g = hpcdp.init()
    sink = JsonSink(args.json if g.rank == 0 else None)
    nodes = _Nodes(g)
    if g.rank == 0:
        print(f"# hpcdp multinode benchmark: {g.size} {g.backend.name} ranks on {nodes.count} "
              f"node(s) {nodes.hosts}, {args.trials} interleaved trials")
    if nodes.count < 2 and g.rank == 0:
        print("# (one node only: these figures say nothing about a network between nodes)")
    if only & {"M1", "HIER"}:
        rows = bench_allreduce(g, nodes, sizes, args.trials, args.link_gbit, "HIER" in only, sink)
        shares = [r["busbw_of_link"] for r in rows if r["busbw_of_link"] == r["busbw_of_link"]]
        if nodes.count > 1 and shares:   # one node, or no link rate: no M1 figure
            summarize(sink, "M1", max(shares), ranks=g.size, variant=g.backend.name, nodes=nodes.count,
                      link_gbit=args.link_gbit)
    if "M2" in only and nodes.count > 1:
        res = bench_ddp(g, nodes, args.trials, args.ddp_batch, args.ddp_hidden, args.ddp_iters, sink)
        summarize(sink, "M2", res["efficiency"], ranks=g.size, variant=g.backend.name, nodes=nodes.count)
    sink.close()
    return 0

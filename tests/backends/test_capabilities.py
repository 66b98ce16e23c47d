"""Callers above ``hpcdp/backends`` ask a backend what it can do, never what it is called: RPC
runs over a third-party backend (registered with ``register_backend``) on threads, on TCP
processes and under ``mpirun``, choosing its channel from the capabilities alone, and no module
outside ``hpcdp/backends`` compares a backend's name or class."""
from __future__ import annotations

import ast
import os
from typing import Any, Sequence

import numpy as np
import pytest

import hpcdp
from hpcdp import rpc
from hpcdp.backends import base
from hpcdp.comm.group import ProcessGroup
from hpcdp.rpc import _context
from hpcdp.testing import check, run_ranks
from conftest import parse_source  # noqa: E402

PKG = os.path.dirname(os.path.abspath(hpcdp.__file__))
BACKEND_CLASSES = {"MPIBackend", "SimBackend", "TCPBackend", "SimP2PBackend", "P2PBackend"}


class Wrapped(base.Backend):
    """A backend hpcdp has never heard of: another transport's calls under a new name, with
    the capabilities it is given."""

    name = "toy"

    def __init__(self, inner: base.Backend, shares_process: bool) -> None:
        self.inner, self.shares_process = inner, shares_process
        self.rank, self.size, self.ranks = inner.rank, inner.size, inner.ranks

    def native_comm(self) -> Any:
        return self.inner.native_comm()

    def peers_gone(self) -> dict[int, str]:
        return self.inner.peers_gone()

    def allreduce(self, s, r, op):
        return self.inner.allreduce(s, r, op)

    def broadcast(self, buf, root):
        return self.inner.broadcast(buf, root)

    def reduce(self, s, r, op, root):
        return self.inner.reduce(s, r, op, root)

    def all_gather(self, s, r):
        return self.inner.all_gather(s, r)

    def gather(self, s, r, root):
        return self.inner.gather(s, r, root)

    def scatter(self, s, r, root):
        return self.inner.scatter(s, r, root)

    def reduce_scatter(self, s, r, op):
        return self.inner.reduce_scatter(s, r, op)

    def all_to_all(self, s, r):
        return self.inner.all_to_all(s, r)

    def barrier(self):
        return self.inner.barrier()

    def send(self, buf, dst, tag):
        return self.inner.send(buf, dst, tag)

    def recv(self, buf, src, tag):
        return self.inner.recv(buf, src, tag)

    def probe(self, src, tag):
        return self.inner.probe(src, tag)

    def new_group(self, ranks: Sequence[int]):
        sub = self.inner.new_group(ranks)
        return None if sub is None else Wrapped(sub, self.shares_process)

    def dup(self):
        return Wrapped(self.inner.dup(), self.shares_process)

    def shutdown(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.shutdown(*args, **kwargs)


@rpc.register
def plus(a: Any, b: Any) -> Any:
    return a + b


def _rpc_round(group: ProcessGroup) -> tuple[str, list[str]]:
    """init_rpc over ``group``, a call to the next worker, shutdown: (transport class, fails)."""
    fails: list[str] = []
    n, me = group.size, group.rank
    rpc.init_rpc(f"toy{me}", group=group, rpc_timeout=20)
    try:
        # RPC's channel runs over the toy's own duplicate: what it can do, not what it is called
        kind = type(_context.current("test").transport.be).__name__
        got = rpc.rpc_sync(f"toy{(me + 1) % n}", plus, args=(np.arange(3) + me, 1))
        if not np.array_equal(got, np.arange(3) + me + 1):
            fails.append(f"rpc result wrong: {got}")
    finally:
        rpc.shutdown()
    return kind, fails


def body_rpc_wrapped(rank: int, shares_process: bool) -> tuple[str, list[str]]:
    world = hpcdp.get_default_group()
    return _rpc_round(ProcessGroup(Wrapped(world.backend, shares_process), name="toy",
                                   timeout=30))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend,shares,transport", [("sim", True, "Wrapped"),
                                                      ("tcp", False, "Wrapped")])
def test_rpc_channel_follows_capabilities(backend: str, shares: bool, transport: str) -> None:
    res = run_ranks(backend, 2, body_rpc_wrapped, shares, timeout=30)
    assert [kind for kind, _ in res] == [transport] * 2
    check([fails for _, fails in res])


@pytest.mark.timeout(120)
def test_registered_third_party_backend_runs_rpc() -> None:
    from hpcdp.backends.sim import _sim_factory

    base.register_backend("toy", lambda **o: Wrapped(_sim_factory(), True))
    try:
        g = hpcdp.init("toy", timeout=20)
        try:
            assert g.backend.name == "toy" and "toy" in hpcdp.available_backends()
            kind, fails = _rpc_round(g)
        finally:
            hpcdp.finalize()
    finally:
        base._REGISTRY.pop("toy", None)
    assert kind == "Wrapped" and not fails


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
def test_rpc_channel_follows_capabilities_mpi(mpi_world) -> None:
    g = ProcessGroup(Wrapped(mpi_world.backend, False), name="toy", timeout=30)
    kind, fails = _rpc_round(g)
    assert kind == "Wrapped"
    check(mpi_world.all_gather_object(fails))


def _name_checks(tree: ast.AST) -> list[str]:
    """``<...>.backend.name ==`` / ``be.name in ...`` comparisons, getattr(..., "name") on a
    backend, and isinstance checks against the built-in backend classes."""
    found = []

    def is_backend(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "backend"
                or isinstance(node, ast.Name) and node.id in ("be", "backend"))

    def is_name_of_backend(node: ast.AST) -> bool:
        if isinstance(node, ast.Attribute) and node.attr == "name" and is_backend(node.value):
            return True
        return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "getattr" and len(node.args) >= 2 and is_backend(node.args[0])
                and isinstance(node.args[1], ast.Constant) and node.args[1].value == "name")

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(
                is_name_of_backend(x) for x in [node.left, *node.comparators]):
            found.append(f"line {node.lineno}: compares a backend's name")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id == "isinstance" and len(node.args) == 2:
            names = {n.id if isinstance(n, ast.Name) else getattr(n, "attr", "")
                     for n in ast.walk(node.args[1])}
            if names & BACKEND_CLASSES:
                found.append(f"line {node.lineno}: isinstance against {names & BACKEND_CLASSES}")
    return found


def test_no_backend_name_checks_outside_backends() -> None:
    bad = []
    for root, _, files in os.walk(PKG):
        if os.path.relpath(root, PKG).split(os.sep)[0] == "backends":
            continue
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                with open(path, encoding="utf-8") as fh:
                    tree = parse_source(fh.read(), path)
                bad += [f"{os.path.relpath(path, PKG)} {m}" for m in _name_checks(tree)]
    assert not bad, "\n".join(bad)


def test_the_name_check_finds_what_it_looks_for() -> None:
    code = ("if group.backend.name == 'mpi': pass\n"
            "sim = getattr(g.backend, 'name', None) == 'sim'\n"
            "ok = isinstance(be, MPIBackend)\n"
            "print(group.backend.name)\n")
    assert len(_name_checks(parse_source(code))) == 3

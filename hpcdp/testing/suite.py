"""The conformance suite: what a backend must pass before hpcdp's layers can stand on it.

Each ``Case`` is a body (run on every rank) plus how to judge the ranks' results. Run one on
simulated or TCP ranks with ``run_case(backend, world_size, case)``, or inside an ``mpirun``
job with ``run_case_here(case)``; both return failure messages (empty: passed). A test module
binds the cases to the backends as mpi4py's suite binds its bodies to communicators::

    @pytest.mark.parametrize("backend", spawn_backends())
    @pytest.mark.parametrize("case,world_size", matrix([1, 2, 3, 4]))
    def test_conformance(backend, case, world_size):
        check_failures(run_case(backend, world_size, case))
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from . import collective, failure, p2p
from ._harness import run_mpi, run_ranks

__all__ = ["Case", "CASES", "matrix", "run_case", "run_case_here", "check_failures"]


def _lists(per_rank: Sequence[Any]) -> list[str]:
    return [f"rank {r}: {f}" for r, fs in enumerate(per_rank) for f in (fs or [])]


def _peers_told(per_rank: Sequence[Any]) -> list[str]:
    return [f"rank {r}: {res}" for r, res in enumerate(per_rank)
            if r and res != "peer failure"]


@dataclass(frozen=True)
class Case:
    """One conformance check.

    Args:
        name: the test id.
        body: ``body(rank, *args)``, run on every rank.
        judge: per-rank results -> failure messages (default: bodies return failure lists).
        min_size: smallest world it means something on.
        spawn_only: needs ranks that can leave early (``hpcdp.spawn``), not an ``mpirun`` job.
    """

    name: str
    body: Callable[..., Any]
    args: tuple[Any, ...] = ()
    judge: Callable[[Sequence[Any]], list[str]] = field(default=_lists)
    min_size: int = 1
    spawn_only: bool = False
    timeout: float = 30.0


CASES: list[Case] = [
    *[Case(f"collective-{n}", collective.body_collective, (n,)) for n in collective.COLLECTIVES],
    Case("out-and-inplace", collective.body_out_and_inplace),
    Case("async", collective.body_async),
    Case("all-async-and-out", collective.body_all_collectives_async_and_out),
    Case("subgroups", collective.body_subgroups),
    Case("p2p", p2p.body_p2p),
    Case("p2p-timeout", p2p.body_p2p_timeout),
    Case("p2p-any-source", p2p.body_any_source),
    Case("p2p-batch", p2p.body_batch),
    Case("p2p-probe", p2p.body_probe),
    Case("timeout", failure.body_timeout, min_size=2),
    *[Case(f"timeout-{n}", failure.body_collective_timeout, (n,), min_size=2)
      for n in failure.TIMEOUT_COLLECTIVES],
    Case("finished-peer", failure.body_finished_peer, judge=_peers_told, min_size=2,
         spawn_only=True, timeout=60.0),
]


def matrix(world_sizes: Sequence[int], *, spawned: bool = True) -> list[tuple[Case, int]]:
    """(case, world size) pairs worth running: no case below its ``min_size``."""
    return [(c, n) for c in CASES for n in world_sizes
            if n >= c.min_size and (spawned or not c.spawn_only)]


def run_case(backend: str, world_size: int, case: Case) -> list[str]:
    """``case`` on ``world_size`` fresh ranks of ``backend``; its failure messages."""
    return case.judge(run_ranks(backend, world_size, case.body, *case.args,
                                timeout=case.timeout))


def run_case_here(case: Case) -> list[str]:
    """``case`` on the default group of an already running job (``mpirun``); collective."""
    if case.spawn_only:
        raise ValueError(f"conformance case {case.name!r} needs spawned ranks")
    return case.judge(run_mpi(case.body, *case.args))


def check_failures(fails: Sequence[str], limit: int = 20) -> None:
    """Assert that a case reported no failure."""
    assert not fails, f"{len(fails)} failure(s):\n" + "\n".join(fails[:limit])

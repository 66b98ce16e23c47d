"""hpcdp.rpc: every call form, bit-exact values of every dtype, RRefs shared with a third worker
and freed by their owner, errors, timeouts and shutdown with calls in flight; on simulated and
TCP ranks here, and on the MPI world under mpirun (``-m mpi``): one body per test, bound to
each world by the ``world`` fixture."""
from __future__ import annotations

import pytest

import hpcdp
import rpc_bodies as B
from conftest import run_ranks
from hpcdp.testing.fixtures import worlds

pytestmark = pytest.mark.timeout(240)


def _ok(results: list) -> None:
    bad = {r: f for r, f in enumerate(results) if f}
    assert not bad, bad


@pytest.mark.parametrize("world", worlds(*B.spawned(3), "mpi"), indirect=True)
def test_call_forms(world) -> None:
    _ok(world.run(B.body_call_forms, timeout=60, join_timeout=120))


@pytest.mark.parametrize("world", worlds(*B.spawned(2), "mpi"), indirect=True)
def test_values_round_trip_bit_exact(world) -> None:
    _ok(world.run(B.body_values, timeout=60, join_timeout=120))


@pytest.mark.parametrize("world", worlds(*B.spawned(3), "mpi"), indirect=True)
def test_rrefs_third_worker_and_refcounts(world) -> None:
    _ok(world.run(B.body_rrefs, timeout=60, join_timeout=120))


@pytest.mark.parametrize("world", worlds(*B.spawned(2), "mpi"), indirect=True)
def test_errors_timeouts_and_graceful_shutdown(world) -> None:
    _ok(world.run(B.body_errors, timeout=60, join_timeout=120))


@pytest.mark.parametrize("world", worlds(*B.spawned(3), "mpi"), indirect=True)
def test_worker_leaves_with_calls_in_flight(world) -> None:
    _ok(world.run(B.body_leave_abruptly, timeout=60, join_timeout=120))


def test_killed_callee_tcp(tmp_path) -> None:
    """A callee that exits mid-call fails the caller's pending calls with PeerFailureError."""
    with pytest.raises(hpcdp.HpcdpError, match="rank 1 exited with code 3"):
        run_ranks("tcp", 3, B.body_killed_callee, str(tmp_path), timeout=60, join_timeout=120)
    assert (tmp_path / "rank0").read_text() == "[]"


def test_sim_rank_dies_mid_call() -> None:
    report: dict = {}
    with pytest.raises(RuntimeError, match="rank 1 crashes"):
        run_ranks("sim", 2, B.body_sim_rank_dies, report, timeout=60, join_timeout=120)
    assert report == {0: []}

"""hpcdp.rpc.Executor, the task farm: map/starmap/submit, load balancing, timeouts, cancelling,
errors and a worker that dies; on simulated and TCP ranks here and the MPI world under mpirun
(``-m mpi``): one body per test (``executor_bodies``), bound to each world by ``world``."""
from __future__ import annotations

import uuid

import pytest

import executor_bodies as B
import hpcdp
from conftest import run_ranks
from hpcdp.testing.fixtures import worlds

pytestmark = pytest.mark.timeout(240)


def _ok(results: list) -> None:
    bad = {r: f for r, f in enumerate(results) if f}
    assert not bad, bad


@pytest.mark.parametrize("world", worlds("sim-1", "sim-2", "sim-4", "tcp-3", "mpi"),
                         indirect=True)
def test_map_starmap_submit_errors(world) -> None:
    _ok(world.run(B.body_farm, timeout=60, join_timeout=120))


@pytest.mark.parametrize("world", worlds("sim-2", "sim-3", "tcp-3", "mpi"), indirect=True)
def test_a_held_task_does_not_hold_up_the_others(world) -> None:
    _ok(world.run(B.body_balance, timeout=60, join_timeout=120))


@pytest.mark.parametrize("world", worlds("sim-2", "tcp-2", "mpi"), indirect=True)
def test_map_timeout_and_shutdown_cancel_futures(world) -> None:
    _ok(world.run(B.body_timeout_and_cancel, timeout=60, join_timeout=120))


def test_a_worker_that_exits_fails_only_its_tasks_tcp(tmp_path) -> None:
    """TCP notices a worker process that exits; MPI does not (its tasks time out there)."""
    with pytest.raises(hpcdp.HpcdpError, match="rank 2 exited with code 3"):
        run_ranks("tcp", 3, B.body_worker_exits, str(tmp_path), timeout=60, join_timeout=120)
    assert (tmp_path / "rank0").read_text() == "[]"


def test_bad_arguments_are_refused_at_once() -> None:
    run_ranks("sim", 1, _bad_arguments, timeout=30, join_timeout=60)


def _bad_arguments(rank: int) -> None:
    import hpcdp.rpc as rpc

    with pytest.raises(ValueError, match="max_in_flight"):
        rpc.Executor(max_in_flight=0)
    with pytest.raises(ValueError, match="task_timeout"):
        rpc.Executor(task_timeout=float("inf"))
    with pytest.raises(ValueError, match="no worker named"):
        rpc.Executor(root="nobody")
    assert not rpc.is_initialized()
    with rpc.Executor() as ex:
        with pytest.raises(ValueError, match="chunksize"):
            ex.map(B.square, [1], chunksize=0)
        with pytest.raises(ValueError, match="bad function name"):
            ex.submit("hpcdp.rpc.Executor.run", "x", (), {}, 1.0)
        assert ex.submit("no_such_function").exception(30) is not None


def test_a_worker_that_dies_fails_only_its_tasks_sim() -> None:
    report: dict = {}
    with pytest.raises(RuntimeError, match="rank 2 crashes"):
        run_ranks("sim", 3, B.body_sim_worker_dies, report, f"die-{uuid.uuid4().hex}",
                  timeout=60, join_timeout=120)
    assert report == {0: []}


def test_heartbeats_and_a_worker_that_gives_up(monkeypatch) -> None:
    from hpcdp.rpc import _executor

    monkeypatch.setattr(_executor, "HEARTBEAT", 0.05)  # simulated ranks share this process
    _ok(run_ranks("sim", 3, B.body_worker_gives_up, timeout=60, join_timeout=120))

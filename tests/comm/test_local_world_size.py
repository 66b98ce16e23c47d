"""``hpcdp.local_world_size()``: processes on this node, from each launcher's environment (FSDP's
hybrid_shard takes its shard size from it)."""
from __future__ import annotations

import pytest

import hpcdp

_KEYS = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "LOCAL_WORLD_SIZE", "SLURM_STEP_TASKS_PER_NODE",
         "SLURM_TASKS_PER_NODE", "SLURM_NODEID")


@pytest.mark.parametrize("env, want", [
    ({}, None),
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, 4),
    ({"MPI_LOCALNRANKS": "3"}, 3),
    ({"LOCAL_WORLD_SIZE": "2"}, 2),
    ({"SLURM_STEP_TASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "2"}, 2),   # srun --mpi=pmix
    ({"SLURM_STEP_TASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "3"}, 1),
    ({"SLURM_TASKS_PER_NODE": "4", "SLURM_NODEID": "0"}, 4),
    ({"SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_NODEID": "5"}, None),  # no such node
    ({"SLURM_STEP_TASKS_PER_NODE": "garbage", "SLURM_NODEID": "0"}, None),
    ({"LOCAL_WORLD_SIZE": "2", "SLURM_STEP_TASKS_PER_NODE": "4", "SLURM_NODEID": "0"}, 2),
])
def test_local_world_size(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], want: int | None) -> None:
    for k in _KEYS:
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert hpcdp.local_world_size() == want

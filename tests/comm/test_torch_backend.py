"""torch.distributed over hpcdp (issue 23, item 5): ``init_process_group("hpcdp")`` runs torch's
own DistributedDataParallel and FSDP2 over hpcdp's TCP and MPI transports.

The worlds are TCP processes and MPI ranks only: torch keeps one default group per process, so
simulated ranks (threads of one process) cannot each hold one.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

import torch  # noqa: E402,F401 - make test installs torch: a missing torch fails here, never skips

from conftest import job_env  # noqa: E402
from hpcdp.testing import check  # noqa: E402
from hpcdp.testing.fixtures import World, worlds  # noqa: E402
from torch_backend_bodies import (  # noqa: E402
    body_collectives, body_ddp_parity, body_fsdp2_parity, body_powersgd, body_refusals,
    body_skipped_allreduce,
)

#: the bodies module, run as a job of its own by ``test_job_started_by_torch``
BODIES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "torch_backend_bodies.py")


@pytest.mark.parametrize("world", worlds("tcp-3", "mpi"), indirect=True)
def test_collectives_match_numpy(world: World, shared_tmp_path) -> None:
    check(world.run(body_collectives, os.path.join(str(shared_tmp_path), "gave-up"), timeout=60))


@pytest.mark.parametrize("world", worlds("tcp-2", "tcp-3", "mpi"), indirect=True)
def test_torch_ddp_parity(world: World) -> None:
    check(world.run(body_ddp_parity, timeout=60))


@pytest.mark.parametrize("world", worlds("tcp-2", "mpi"), indirect=True)
def test_comm_hook_waiting_in_callbacks(world: World) -> None:
    check(world.run(body_powersgd, timeout=60, join_timeout=90))


@pytest.mark.parametrize("world", worlds("tcp-2", "mpi"), indirect=True)
def test_torch_fsdp2_parity(world: World) -> None:
    check(world.run(body_fsdp2_parity, timeout=60))


# TCP: test_job_started_by_torch runs the same body under hpcdp-run (a world of its own)
@pytest.mark.parametrize("world", worlds("mpi"), indirect=True)
def test_skipped_allreduce_times_out(world: World) -> None:
    check(world.run(body_skipped_allreduce, 1.5, timeout=60))


@pytest.mark.parametrize("world", worlds("tcp-2", "mpi"), indirect=True)
def test_refusals(world: World) -> None:
    check(world.run(body_refusals, timeout=60))


LAUNCH = {
    "tcp": [sys.executable, "-m", "hpcdp.run", "-n", "2"],
    "mpirun": ["mpirun", "-n", "2", "--oversubscribe", sys.executable, "-m", "hpcdp.run"],
}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("launcher", list(LAUNCH))  # not "mpi": pytest-mpi would skip it
def test_job_started_by_torch(tmp_path, launcher: str) -> None:
    """hpcdp not started by anyone: ``init_process_group("hpcdp", init_method="hpcdp://")``
    starts it from what the launcher set (TCP under hpcdp-run, MPI under mpirun); DDP parity;
    the skipped allreduce's timeout is in rank 0's flight-recorder dump."""
    trace_dir = tmp_path / "trace"
    job = subprocess.run([*LAUNCH[launcher], BODIES], capture_output=True, text=True,
                         timeout=150, env=job_env(HPCDP_TRACE_DIR=str(trace_dir)),
                         stdin=subprocess.DEVNULL, cwd=tmp_path)
    out = job.stdout + job.stderr
    assert job.returncode == 0, out
    # (hpcdp-run prefixes each line with "[rank N] "; mpirun may forward one rank's line in two
    # pieces around another's, so the reports are found in the text, not line by line)
    assert sorted(re.findall(r"torch_backend job rank (\d+): (ok)?", job.stdout)) == [
        ("0", "ok"), ("1", "ok")], out
    doc = json.loads((trace_dir / "flight-rank0.json").read_text())
    assert doc["reason"].startswith("CommTimeoutError: allreduce"), doc["reason"]
    assert [e["state"] for e in doc["entries"] if e["op"] == "allreduce"][-1] == "timed out", doc


#: a single-rank program whose future callback is still running when it destroys the group
_CALLBACK_AT_EXIT = """
import time, torch, torch.distributed as dist
import hpcdp.torch_backend
dist.init_process_group("hpcdp", init_method="hpcdp://")
def slow(fut):
    time.sleep(0.5)
    print("callback finished", flush=True)
    return fut.value()
dist.all_reduce(torch.ones(4), async_op=True).get_future().then(slow)
time.sleep(0.1)
dist.destroy_process_group()
"""


@pytest.mark.timeout(60)
def test_callback_running_at_exit_finishes() -> None:
    """A future's callback runs on the group's completer thread, inside torch's C++: the
    program must not end under it (a daemon thread killed there aborts the process after the
    program's last line: the CI failure "terminate called without an active exception").
    ``destroy_process_group`` waits for it."""
    job = subprocess.run([sys.executable, "-c", _CALLBACK_AT_EXIT], capture_output=True,
                         text=True, timeout=50, env=job_env(), stdin=subprocess.DEVNULL)
    out = job.stdout + job.stderr
    assert job.returncode == 0, out
    assert "callback finished" in job.stdout, out

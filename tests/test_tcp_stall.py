"""A peer that stops in the middle of a message (SIGSTOP: swapped out, a hung node) never holds
a waiting rank past its timeout, and a receive given up on is not written into afterwards."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import numpy as np
import pytest

import hpcdp
from conftest import run_mpi
from hpcdp.errors import HpcdpError

BIG = 64 << 20  # far more than the socket buffers hold: the sender is mid-message when stopped


def stalled_sender(rank: int, out: str, what: str) -> str:
    if rank == 1:
        threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGSTOP)).start()
        if what == "recv":
            hpcdp.send(np.ones(BIG, np.uint8), 0)
        else:
            hpcdp.allreduce(np.ones(BIG // 8), timeout=60)
        return "not stopped"
    t0 = time.monotonic()
    try:
        if what == "recv":
            hpcdp.recv(np.empty(BIG, np.uint8), 1, timeout=2)
        else:
            hpcdp.allreduce(np.ones(BIG // 8), timeout=2)
        result = {"error": None}
    except hpcdp.CommTimeoutError as exc:
        result = {"error": "timeout", "message": str(exc)}
    except Exception as exc:  # noqa: BLE001 - reported to the test
        result = {"error": type(exc).__name__, "message": str(exc)}
    result["elapsed"] = time.monotonic() - t0
    with open(out, "w") as f:
        json.dump(result, f)
    return "done"


@pytest.mark.parametrize("what", ["recv", "allreduce"])
def test_peer_stopped_mid_message_times_out_on_time(what: str, tmp_path) -> None:
    out = str(tmp_path / "rank0.json")
    t0 = time.monotonic()
    with pytest.raises(HpcdpError, match=r"rank\(s\) \[1\] did not finish"):
        hpcdp.spawn(stalled_sender, 2, backend="tcp", args=(out, what), timeout=30,
                    join_timeout=8)  # rank 1 stays stopped: spawn kills it
    assert time.monotonic() - t0 < 30
    with open(out) as f:
        res = json.load(f)
    assert res["error"] == "timeout", res
    assert 1.9 <= res["elapsed"] <= 3.5, res
    assert ("recv(src=1" if what == "recv" else "allreduce #") in res["message"], res


def late_message(rank: int) -> list[str]:
    """rank 0 gives up on a receive; the message that comes later must not land in its buffer."""
    fails: list[str] = []
    if rank == 0:
        buf = np.zeros(1000)
        try:
            hpcdp.recv(buf, 1, tag=7, timeout=0.5)
            fails.append("recv returned without a sender")
        except hpcdp.CommTimeoutError:
            pass
        hpcdp.barrier()  # now rank 1 sends the late message
        hpcdp.barrier()
        fresh = hpcdp.recv(np.zeros(1000), 1, tag=7, timeout=10)  # a new receive gets it
        if buf.any():
            fails.append("the late message was written into the abandoned buffer")
        if not np.all(fresh == 1):
            fails.append("a new receive did not get the late message")
    else:
        hpcdp.barrier()
        # isend: under MPI a blocking send of 8 KB may wait for the matching receive
        w = hpcdp.isend(np.ones(1000), 0, tag=7) if rank == 1 else None
        hpcdp.barrier()
        if w is not None:
            w.wait(10)
    return fails


@pytest.mark.parametrize("backend", ["tcp", "sim"])
def test_abandoned_receive_is_not_written_into(backend: str) -> None:
    res = hpcdp.spawn(late_message, 2, backend=backend, timeout=30, join_timeout=60)
    assert res == [[], []], res


@pytest.mark.mpi(min_size=2)
def test_abandoned_receive_is_not_written_into_mpi(mpi_world) -> None:
    assert run_mpi(late_message) == [[]] * mpi_world.size

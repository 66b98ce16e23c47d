"""``HPCDP_MAX_FRAME`` bounds every frame a rank sends, small messages included (they used to go
out as one frame whatever the cap, and a receiver with the same cap dropped the sender)."""
from __future__ import annotations

import numpy as np
import pytest

import hpcdp
from hpcdp.backends.tcp import _wire as wire
from hpcdp.launch._processes import spawn_processes

CAP = 1000
SIZES = [0, 1, CAP - 1, CAP, CAP + 1, 5000, 70_000, 300_000]


def cap_body(rank: int) -> list[str]:
    tr = hpcdp.get_default_group().backend.transport
    bad = [] if tr.cap == CAP else [f"cap {tr.cap}"]
    for n in SIZES:
        data = (np.arange(n) % 251).astype(np.uint8)
        if rank == 0:
            hpcdp.send(data, 1, tag=n % 1000)
            back = hpcdp.recv(np.empty(n, np.uint8), 1, tag=n % 1000)
        else:
            back = hpcdp.recv(np.empty(n, np.uint8), 0, tag=n % 1000)
            hpcdp.send(back, 0, tag=n % 1000)
        if not np.array_equal(back, data):
            bad.append(f"p2p {n} bytes")
    for count in (10, 600, 9000):  # collective pieces below and above the cap
        x = np.arange(count, dtype=np.float64) * (rank + 1)
        if not np.array_equal(hpcdp.allreduce(x), np.arange(count) * 3.0):
            bad.append(f"allreduce {count}")
    hpcdp.barrier()
    return bad


@pytest.mark.timeout(120)
def test_every_frame_respects_a_small_cap() -> None:
    res = spawn_processes(cap_body, 2, timeout=20, join_timeout=90,
                          env={"HPCDP_MAX_FRAME": str(CAP)})
    assert res == [[], []]


@pytest.mark.parametrize("raw", ["0", "-5", "abc", "1.5"])
def test_a_bad_cap_is_refused_before_anything_listens(monkeypatch, raw: str) -> None:
    monkeypatch.setenv("HPCDP_MAX_FRAME", raw)
    with pytest.raises(hpcdp.BackendUnavailableError, match="HPCDP_MAX_FRAME"):
        wire.max_frame()
    monkeypatch.setenv("HPCDP_SECRET", "cap-test-secret")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(hpcdp.BackendUnavailableError, match="HPCDP_MAX_FRAME"):
        hpcdp.init(backend="tcp")
    assert not hpcdp.is_initialized()

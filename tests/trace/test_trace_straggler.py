"""Clock offsets between ranks and the straggler report, on real groups of every backend."""
from __future__ import annotations

import io
import time

import numpy as np
import pytest

import hpcdp
from hpcdp import trace
from hpcdp.trace import hooks
from hpcdp.comm import stragglers
from hpcdp.comm.stragglers import StragglerReport
from hpcdp.trace._clock import WALL_MINUS_MONO_NS

from conftest import SPAWN_BACKENDS, run_ranks

SLACK_NS = 200_000  # anchors of different processes differ by their own sampling error


@pytest.fixture(autouse=True)
def fresh():
    trace.reset()
    yield
    trace.reset()


def test_report_arithmetic() -> None:
    arr = np.array([[100, 130, 100], [200, 260, 205], [300, 300, 390]], np.int64) * 1_000_000
    rep = StragglerReport("world", (0, 1, 2), np.array([4, 5, 6]), ["allreduce"] * 3, arr)
    assert rep.skew_ns.tolist() == [30e6, 60e6, 90e6]
    assert rep.last_counts().tolist() == [0, 2, 1]
    assert np.allclose(rep.mean_late_ns(), [0, 30e6, (0 + 5 + 90) / 3 * 1e6])
    text = rep.format(label="steps 1-10")
    assert text.startswith("hpcdp stragglers steps 1-10, group world (3 ranks), 3 collectives: rank 2 "
                           "arrives 31.67 ms late on average (last at 1 of 3, worst 90.00 ms at allreduce #6)"), text
    assert "rank 1 arrives 30.00 ms late" in text and "rank 0" not in text.split("\n")[0]
    assert "median 60.00 ms, max 90.00 ms" in text and "allreduce #6 90.00 ms (last: rank 2)" in text
    empty = StragglerReport("world", (0, 1), np.zeros(0, np.int64), [], np.zeros((0, 2), np.int64))
    assert "no collective recorded by every member" in empty.format()


def _straggler_body(rank: int, late: int, nops: int) -> dict:
    g = hpcdp.get_default_group()
    hooks.install(rank, g.size)
    sync = trace.estimate_clock_offset(g)
    x = np.ones(3)
    for s in range(1, nops + 1):
        if rank == late:
            time.sleep(0.2)
        g.allreduce(x)  # recorded by the collective layer itself
    rep = stragglers.gather_arrivals(g)
    return {"seqs": rep.seqs.tolist(), "last": rep.last_counts().tolist(), "ranks": list(rep.ranks),
            "text": rep.format(), "sync": (sync.offset_ns, sync.rtt_ns)}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", SPAWN_BACKENDS)
def test_gather_arrivals_names_the_late_rank(backend: str) -> None:
    out = run_ranks(backend, 3, _straggler_body, 2, 3)
    for o in out:  # every rank gets the same report
        assert o["seqs"] == [1, 2, 3] and o["ranks"] == [0, 1, 2]
        assert o["last"][2] >= 2, o["text"]
        assert o["text"].split(": ", 1)[1].startswith("rank 2 arrives"), o["text"]
    assert out[0]["sync"] == (0, 0)
    for o in out[1:]:
        off, rtt = o["sync"]
        assert rtt > 0 and abs(off) <= rtt // 2 + SLACK_NS, o["sync"]  # one machine: true offset ~0


def _skewed_clock_body(rank: int, skew_ns: int) -> tuple[int, int]:
    g = hpcdp.get_default_group()
    clock = (lambda: time.monotonic_ns() + WALL_MINUS_MONO_NS + (skew_ns if rank == 1 else 0))
    s = trace.estimate_clock_offset(g, rounds=5, clock=clock)
    assert hooks.clock_offset_ns(g.ranks[g.rank]) == s.offset_ns
    return s.offset_ns, s.rtt_ns


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", SPAWN_BACKENDS)
def test_clock_offset_recovers_an_injected_skew(backend: str) -> None:
    skew = 5_000_000_000  # rank 1's clock is 5 s ahead: its offset to rank 0 is -5 s
    res = run_ranks(backend, 3, _skewed_clock_body, skew)
    off1, rtt1 = res[1]
    assert abs(off1 + skew) <= rtt1 // 2 + SLACK_NS, res
    off2, rtt2 = res[2]
    assert abs(off2) <= rtt2 // 2 + SLACK_NS, res
    assert res[0] == (0, 0)


def _reporter_body(rank: int, every: int, steps: int) -> tuple[str, int]:
    g = hpcdp.get_default_group()
    trace.bind_rank(rank)
    buf = io.StringIO()
    rep = hpcdp.report_stragglers(every, file=buf)
    reports = 0
    for _ in range(steps):
        for _ in range(2):
            g.barrier()  # recorded by the collective layer itself
        if trace.step() is not None:
            reports += 1
    assert rep.steps == steps
    return buf.getvalue(), reports


@pytest.mark.timeout(120)
def test_reporter_prints_on_rank_zero_every_n_steps() -> None:
    res = run_ranks("sim", 3, _reporter_body, 2, 5)
    text0, n0 = res[0]
    assert n0 == 2 and text0.count("hpcdp stragglers steps") == 2, text0
    assert "steps 1-2" in text0 and "steps 3-4" in text0 and "4 collectives" in text0, text0
    for text, n in res[1:]:
        assert n == 2 and text == ""


def test_env_and_argument_checks(monkeypatch) -> None:
    monkeypatch.setenv("HPCDP_STRAGGLER", "often")
    with pytest.raises(ValueError, match="HPCDP_STRAGGLER='often'"):
        stragglers.from_env()
    monkeypatch.setenv("HPCDP_STRAGGLER", "0")
    assert stragglers.from_env() is None
    monkeypatch.setenv("HPCDP_STRAGGLER", "25")
    rep = stragglers.from_env()
    assert rep is not None and rep.every == 25
    stragglers.stop()
    assert trace.step() is None
    with pytest.raises(ValueError, match="every must be >= 1"):
        hpcdp.report_stragglers(0)
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        trace.estimate_clock_offset(object(), rounds=0)


# -- under mpirun ------------------------------------------------------------------------------

@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
def test_mpi_clock_offsets_and_arrivals(mpi_world) -> None:
    g = mpi_world.new_group(list(range(mpi_world.size)))
    n, rank = g.size, g.rank
    sync = trace.estimate_clock_offset(g)
    if rank:
        assert sync.rtt_ns > 0 and abs(sync.offset_ns) <= sync.rtt_ns // 2 + SLACK_NS, sync
    late = n - 1
    x = np.ones(4)
    for s in range(1, 4):
        if rank == late:
            time.sleep(0.2)
        g.allreduce(x)
    rep = stragglers.gather_arrivals(g)
    assert rep.seqs.tolist() == [1, 2, 3] and rep.ranks == tuple(range(n))
    assert int(rep.last_counts()[late]) >= 2, rep.format()

"""``HPCDP_DEBUG`` for point-to-point: a send and a receive that disagree on dtype, shape or size
raise ``CollectiveMismatchError`` naming both ranks and both calls on the receiving rank, on sim
and TCP ranks and under ``mpirun``; correct programs run unchanged with the check on."""
from __future__ import annotations

import os

import numpy as np
import pytest

import hpcdp
from hpcdp.comm import debug as _debug
from hpcdp.testing import check, p2p, run_ranks, spawn_backends
from hpcdp.testing.fixtures import World, grid, worlds

HERE = os.path.basename(__file__)
#: (tag, what rank 0 sends, what rank 1 receives into): each a mismatch the check must name
BAD = [
    (2, lambda: np.arange(4, dtype=np.float32), lambda: np.empty(4)),          # dtype
    (3, lambda: np.arange(6.0).reshape(2, 3), lambda: np.empty(6)),             # shape
    (4, lambda: np.arange(5.0), lambda: np.empty(3)),                           # larger
    (5, lambda: np.arange(3.0), lambda: np.empty(8)),                           # smaller
]


def _pairs(g: hpcdp.ProcessGroup) -> list[str]:
    """Rank 0 sends, rank 1 receives: good, then every mismatch, then good again (the channel
    is still in step after each error). Other ranks of the group only wait."""
    fails: list[str] = []
    if g.rank == 0:
        g.send(np.arange(3.0), 1, tag=1)
        for tag, make_send, _ in BAD:
            g.send(make_send(), 1, tag=tag)
        g.send(np.arange(7, dtype=np.int16), 1, tag=1)
    elif g.rank == 1:
        if not np.array_equal(g.recv(np.empty(3), 0, tag=1), np.arange(3.0)):
            fails.append("matching message wrong under HPCDP_DEBUG")
        for tag, make_send, make_recv in BAD:
            sent, buf = make_send(), make_recv()
            try:
                g.recv(buf, 0, tag=tag)
                fails.append(f"tag {tag}: {sent.dtype}{sent.shape} received into "
                             f"{buf.dtype}{buf.shape} without an error")
                continue
            except hpcdp.CollectiveMismatchError as exc:
                msg = str(exc)
            for part in (f"rank 0: send(dst=1, tag={tag}) #1 of {sent.dtype} {sent.shape}",
                         f"rank 1: recv(src=0, tag={tag}) #1 into {buf.dtype} {buf.shape}",
                         HERE):
                if part not in msg:
                    fails.append(f"tag {tag}: {part!r} not in the error: {msg}")
        got = g.recv(np.empty(7, np.int16), 0, tag=1)
        if not np.array_equal(got, np.arange(7)):
            fails.append(f"the message after the mismatches is wrong: {got}")
    g.barrier()
    # a receive posted before a collective takes a large (rendezvous on MPI) message while its
    # rank waits in the collective, as a posted receive does without the check
    big = np.arange(1 << 20, dtype=np.float64)
    if g.rank == 0:
        w = g.irecv(np.empty_like(big), 1, tag=20)
        g.barrier()
        if not np.array_equal(w.wait(), big):
            fails.append("large message received during a barrier is wrong")
    elif g.rank == 1:
        g.send(big, 0, tag=20)
        g.barrier()
    else:
        g.barrier()
    return fails


def body_mismatches(rank: int) -> list[str]:
    g = hpcdp.get_default_group()
    g.debug = "detail"
    return _pairs(g)


def body_missing_header(rank: int) -> list[str]:
    """Rank 0 runs without the check, rank 1 with it: the receive says so instead of
    mistaking the payload for a header."""
    g = hpcdp.get_default_group()
    fails: list[str] = []
    if rank == 0:
        g.send(np.arange(600, dtype=np.float64), 1, tag=8)
    else:
        level = g.debug  # restored below: the barrier's collective check must match rank 0's
        g.debug = "detail"
        try:
            g.recv(np.empty(600), 0, tag=8)
            fails.append("a message without a header was accepted")
        except hpcdp.CollectiveMismatchError as exc:
            if "no HPCDP_DEBUG header" not in str(exc) or "rank 0" not in str(exc):
                fails.append(f"unclear error: {exc}")
        g.debug = level
    g.barrier()
    return fails


def body_conformance_with_debug(rank: int) -> list[str]:
    """The p2p conformance bodies, unchanged, with the check on: it never refuses a correct
    program (probe sizes, any-source receives, batches, out-of-order tags)."""
    hpcdp.get_default_group().debug = "detail"
    fails = []
    for body in (p2p.body_p2p, p2p.body_any_source, p2p.body_batch, p2p.body_probe):
        fails += [f"{body.__name__}: {f}" for f in body(rank)]
    return fails


def test_debug_env_levels(monkeypatch: pytest.MonkeyPatch) -> None:
    for raw, level in (("1", "detail"), ("true", "detail"), ("ON", "detail"), ("detail", "detail"),
                       ("0", "off"), ("off", "off"), ("no", "off"), ("sample", "sample"),
                       ("", "sample")):  # empty is unset: the default, the sampled check
        monkeypatch.setenv("HPCDP_DEBUG", raw)
        assert _debug.debug_level() == level, raw
    monkeypatch.setenv("HPCDP_DEBUG", "2")
    with pytest.raises(ValueError, match="HPCDP_DEBUG"):
        _debug.debug_level()


def test_env_one_turns_the_p2p_check_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPCDP_DEBUG", "1")

    def body(rank: int) -> str:
        g = hpcdp.get_default_group()
        if rank == 0:
            g.send(np.ones(2, np.int32), 1)
            return g.debug
        try:
            g.recv(np.empty(2, np.int64), 0)
        except hpcdp.CollectiveMismatchError:
            return g.debug
        return "not raised"

    assert run_ranks("sim", 2, body, timeout=20) == ["detail", "detail"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", worlds(*grid([2]), "mpi"), indirect=True)
def test_p2p_mismatch_named(world: World) -> None:
    """A mismatched send and receive are named (the body turns the check on for its own group,
    which under MPI is ``run_mpi``'s fresh group of every rank: the world's stays as it was)."""
    check(world.run(body_mismatches, timeout=20, mpi_timeout=30))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", spawn_backends())
def test_p2p_missing_header_named(backend: str) -> None:
    """A receiver whose sender sent no header says so (2 ranks exactly: every rank but 0
    receives, so it is not run on the MPI world of 4)."""
    check(run_ranks(backend, 2, body_missing_header, timeout=20))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", worlds(*grid([1, 3]), "mpi"), indirect=True)
def test_correct_p2p_unchanged_under_debug(world: World) -> None:
    check(world.run(body_conformance_with_debug, timeout=30))

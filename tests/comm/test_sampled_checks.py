"""The sampled call checks (``HPCDP_DEBUG=sample``, the default; ``comm.debug``): mismatched
collectives raise ``CollectiveMismatchError`` on every rank before they run, on sim, TCP and MPI.

On MPI only mismatches that MPI itself sees as identical calls (the same dtype and element count,
another shape) are made in the asynchronous case, where the collective is posted beside its check:
a real size mismatch posted to MPI is undefined behaviour, which is what the checks prevent for
blocking calls.
"""
from __future__ import annotations

import numpy as np
import pytest

import hpcdp
from hpcdp.comm import debug as _debug
from hpcdp.testing.fixtures import World, worlds


def _raises(fn, fails: list[str], what: str, *words: str) -> None:
    try:
        fn()
        fails.append(f"{what}: no error")
    except hpcdp.CollectiveMismatchError as exc:
        text = str(exc)
        missing = [w for w in words if w not in text]
        if missing:
            fails.append(f"{what}: {missing} not in {text}")


def body_sampled(rank: int) -> list[str]:
    g = hpcdp.get_default_group()
    fails: list[str] = []
    if g.debug != "sample":
        return [f"default level is {g.debug!r}"]
    odd = rank == g.size - 1  # one rank differs from the others
    # 1. dtype and size (blocking: checked before anything is posted, so safe on MPI too)
    x = np.ones(8, np.float32) if odd else np.ones(4)
    _raises(lambda: g.allreduce(x), fails, "dtype/size", "allreduce #1", "float32, shape (8,)",
            "float64, shape (4,)", "every rank checked", f"rank {g.size - 1}:")
    if not np.array_equal(g.allreduce(np.ones(3)), np.full(3, g.size)):  # #2: still usable
        fails.append("the group is not usable after a caught mismatch")
    # 2. same bytes, another shape: (3, 2) against (2, 3)
    y = np.ones((3, 2)) if odd else np.ones((2, 3))
    _raises(lambda: g.broadcast(y, root=0), fails, "shape", "broadcast #3", "shape (3, 2)",
            "shape (2, 3)")
    # 3. root and op
    _raises(lambda: g.reduce(np.ones(2), root=1 if odd else 0), fails, "root", "root=0", "root=1")
    _raises(lambda: g.allreduce(np.ones(2), op="max" if odd else "sum"), fails, "op",
            "op=max", "op=sum")
    # 4. an asynchronous call: posted beside its check, judged at wait() on every rank
    z = np.ones((3, 2)) if odd else np.ones((2, 3))
    w = g.allreduce(z, async_op=True)
    _raises(lambda: w.wait(), fails, "async", "allreduce #6", "shape (3, 2)", "shape (2, 3)")
    return fails


def body_every_128th(rank: int) -> list[str]:
    """Calls #33 to #127 are not checked, #128 is: a mismatch there raises on every rank."""
    g = hpcdp.new_group(list(range(hpcdp.world_size())))  # its own sequence, from #1
    fails: list[str] = []
    x = np.ones(2)
    for _ in range(127):
        g.allreduce(x)
    y = np.ones((1, 2)) if rank == 0 else np.ones((2, 1))
    _raises(lambda: g.allreduce(y), fails, "#128", "allreduce #128", "shape (1, 2)", "shape (2, 1)")
    return fails


@pytest.mark.parametrize("world", worlds("sim-2", "sim-3", "tcp-3", "mpi"), indirect=True)
def test_mismatches_raise_on_every_rank_by_default(world: World) -> None:
    out = world.run(body_sampled, timeout=60)
    assert out == [[]] * world.size, out


@pytest.mark.parametrize("world", worlds("sim-2", "tcp-3", "mpi"), indirect=True)
def test_the_128th_call_is_checked(world: World) -> None:
    out = world.run(body_every_128th, timeout=60)
    assert out == [[]] * world.size, out


def test_the_sample_is_chosen_by_sequence_number_alone() -> None:
    picked = [s for s in range(1, 1025) if _debug.sampled(s)]
    assert picked == list(range(1, 33)) + [128 * k for k in range(1, 9)]


def test_signatures_are_built_once_per_call_and_carry_their_sequence_number() -> None:
    f8 = np.dtype("f8")
    a = _debug._signature("allreduce", 7, "sum", None, (2, 3), f8)
    b = _debug._signature("allreduce", 9, "sum", None, (2, 3), f8)
    assert (a[1], b[1]) == (7, 9)
    assert np.array_equal(a, _debug._build_signature("allreduce", 7, "sum", None, (2, 3), f8))
    a[:] = 0  # a caller's copy: the next signature of the call is whole
    assert np.array_equal(_debug._signature("allreduce", 7, "sum", None, (2, 3), f8),
                          _debug._build_signature("allreduce", 7, "sum", None, (2, 3), f8))
    # an unhashable shape is built each time, and equals the tuple's
    assert np.array_equal(_debug._signature("allreduce", 3, "sum", None, [2, 3], f8),
                          _debug._signature("allreduce", 3, "sum", None, (2, 3), f8))
    # each of (op, root, shape, dtype, operation) changes the signature
    calls = [("allreduce", "sum", None, (2, 3), f8), ("allreduce", "max", None, (2, 3), f8),
             ("reduce", "sum", 1, (2, 3), f8), ("reduce", "sum", 0, (2, 3), f8),
             ("allreduce", "sum", None, (3, 2), f8), ("allreduce", "sum", None, (2, 3), np.dtype("f4")),
             ("broadcast", None, 0, (2, 3), f8)]
    sigs = {_debug._signature(c[0], 5, *c[1:]).tobytes() for c in calls}
    assert len(sigs) == len(calls)
    # past the cache's bound it is cleared and rebuilt, never wrong
    for n in range(_debug._SIGNATURES_MAX + 10):
        s = _debug._signature("all_gather", n, None, None, (n,), f8)
        assert s[1] == n and s[7] == n, n


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_judge_sees_a_differing_rank_wherever_it_is(size: int) -> None:
    g = hpcdp.ProcessGroup(None, name="judge", members=range(size))
    same = _debug._signature("allreduce", 4, "sum", None, (2,), np.dtype("f8"))
    got = np.tile(same, (size, 1))
    _debug.judge_sampled(g, "allreduce", 4, got)  # all alike: no error
    for r in range(size if size > 1 else 0):
        odd = got.copy()
        odd[r] = _debug._signature("allreduce", 4, "sum", None, (3,), np.dtype("f8"))
        with pytest.raises(hpcdp.CollectiveMismatchError, match=f"rank {r}: allreduce.*shape \\(3,\\)"):
            _debug.judge_sampled(g, "allreduce", 4, odd)

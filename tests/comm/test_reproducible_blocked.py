"""Deterministic mode's blocked path (``comm.reproducible._blocked``, ``comm.exact.block_*``):
one grid per block of elements, ranges of the array exchanged one after the other, a range
that does not fit handed to the per-element method. Every sum is still the exact sum correctly
rounded, whatever the range and block sizes: checked against the ``fractions.Fraction``
reference with tiny ranges and blocks (so that a few hundred elements cross many range and
block boundaries and tails), on every world, for every layout, signed zeros, rows that differ
per rank (none included), and the three modes."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import hpcdp
from hpcdp.comm import exact, reproducible
from hpcdp.testing import check
from hpcdp.testing.fixtures import World, grid, worlds

from test_deterministic import exact_ref, same_bits

N = 203   # elements: with ranges of 24-48 elements and 5 blocks, every boundary and tail


def _data(case: str, rank: int, m: int, dtype: str) -> np.ndarray:
    """Rank ``rank``'s ``(m, N)`` rows of ``case``, the same in every process."""
    rng = np.random.default_rng([sum(map(ord, case)), rank, m, len(dtype)])
    dt = np.dtype(dtype)
    a = rng.standard_normal((m, N))
    if case == "wide":           # 40 binades per block: float64 in two float64 halves,
        a *= 2.0 ** rng.integers(-20, 20, (m, N))    # float32 in a float32 and a float64
    elif case == "wider":        # 70: float32 in two float64 halves (round-to-odd), float64
        a *= 2.0 ** rng.integers(-35, 35, (m, N))    # to the per-element method
    elif case == "onewide":      # one block of five 40 binades wide: halves there, values elsewhere
        a[:, ::5] *= 2.0 ** rng.integers(-20, 20, a[:, ::5].shape)
    elif case == "onedeep":      # normal values, one of them 30 binades down on each rank: its
        a[:, (7 + 40 * rank) % N] *= 2.0 ** -30   # block as two halves in a tail (float64: beside
    elif case == "zeros":        # a float32 hi and a float64 lo; float32: beside values)
        a[:, ::3] = -0.0
        a[:, 1::7] = 0.0
        a[:, 60:90] = -0.0       # whole blocks and ranges of -0
    elif case == "mixed":        # one range per element method (deep, inf, NaN), the others fast
        a[:, 40] = 1e300 if dt == np.float64 else 1e30
        a[:, 41] = 1e-300 if dt == np.float64 else 1e-30
        a[:, 120] = np.inf if rank % 2 else np.nan
        a[:, 150] = 2.0 ** -1074 if dt == np.float64 else 2.0 ** -149
    elif case == "subnormal":
        tiny = 2.0 ** -1074 if dt == np.float64 else 2.0 ** -149
        a = rng.integers(-1000, 1000, (m, N)) * tiny
    with np.errstate(over="ignore"):
        return a.astype(dt)


CASES = ["normal", "wide", "wider", "onewide", "onedeep", "zeros", "mixed", "subnormal"]


def _rows(rank: int) -> int:
    """Rows per rank: different on every rank, none on rank 2. (The other patterns: one row
    each; one on even ranks, none on odd; two, one, none: at most two summands on one or two
    ranks, which the plain sum adds exactly.)"""
    return [1, 3, 0, 2][rank % 4]


def body_blocked(rank: int, range_bytes: int, blocks: int, was: tuple[int, int]) -> list[str]:
    """``was``: the sizes to restore, read by the test before any rank changed them (simulated
    ranks share the module: one that starts late must not take another's test sizes for them)."""
    g = hpcdp.get_default_group()
    n = g.size
    fails: list[str] = []
    reproducible._RANGE_BYTES, exact.BLOCKS = range_bytes, blocks
    try:
        for dtype in ("float64", "float32"):
            for case in CASES:
                for rows_of in (lambda r: 1, _rows, lambda r: 1 - r % 2, lambda r: 2 - r % 3):
                    arrs = [_data(case, r, rows_of(r), dtype) for r in range(n)]
                    every = [row for a in arrs for row in a]
                    x = arrs[rank]
                    want = exact_ref(every)
                    got = reproducible.sum_rows(g, x, dtype=dtype)
                    if not same_bits(got, want):
                        bad = np.nonzero(got.view(f"u{got.itemsize}") != want.view(f"u{got.itemsize}"))[0][:4]
                        fails.append(f"all {dtype} {case}: elements {bad.tolist()} got {got[bad].tolist()} "
                                     f"want {want[bad].tolist()}")
                    mean = reproducible.sum_rows(g, x, dtype=dtype, divisor=3)
                    if not same_bits(mean, exact_ref(every, 3)):
                        fails.append(f"mean {dtype} {case}")
                    out = np.empty(N, dtype)
                    if reproducible.sum_rows(g, x, dtype=dtype, out=out) is not out or not same_bits(out, want):
                        fails.append(f"out= {dtype} {case}")
                    red = reproducible.sum_rows(g, x, mode="root", root=n - 1, dtype=dtype)
                    if (red is None) != (rank != n - 1) or (red is not None and not same_bits(red, want)):
                        fails.append(f"root {dtype} {case}")
                    cut = (N // n) * n
                    part = reproducible.sum_rows(g, x[:, :cut], mode="scatter", dtype=dtype)
                    per = cut // n
                    if not same_bits(part, want[rank * per:(rank + 1) * per]):
                        fails.append(f"scatter {dtype} {case}")
    finally:
        reproducible._RANGE_BYTES, exact.BLOCKS = was
    return fails


def _sizes() -> tuple[int, int]:
    return reproducible._RANGE_BYTES, exact.BLOCKS


@pytest.mark.parametrize("world", worlds(*grid([1, 2, 3, 4]), "mpi"), indirect=True)
def test_blocked_sums_are_exact_across_ranges(world: World) -> None:
    """Ranges of 24 float64 / 48 float32 elements, 5 blocks each (tails of 4 and 3)."""
    check(world.run(body_blocked, 192, 5, _sizes()))


@pytest.mark.parametrize("world", worlds("sim-2", "sim-3"), indirect=True)
def test_range_and_block_sizes_change_no_bit(world: World) -> None:
    """One range, one element per block; and the default sizes (one range for N elements)."""
    check(world.run(body_blocked, 1 << 20, 1, _sizes()))
    check(world.run(body_blocked, 1 << 20, exact.BLOCKS, _sizes()))


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("summands", [1, 2, 3, 5, 9])
def test_block_halves_are_exact_in_any_order(dtype: str, summands: int) -> None:
    """The kernel alone: block codes over every contribution, reduced by max, give a layout
    whose float64 sums (values, or halves) are exact in a shuffled and the reverse order;
    the layouts' limits sit where the docstrings put them (one float64 for float32 within 27
    binades, two halves for float64 within 50, the per-element method beyond)."""
    rng = np.random.default_rng(summands)
    dt = np.dtype(dtype)
    seen = set()
    nb = 7
    for span in (1, 10, 20, 40, 60, 200):
        rows = rng.standard_normal((summands, 300)) * 2.0 ** rng.integers(0, span, (summands, 300))
        rows[:, :5] = -0.0
        rows[0, 2] = 0.0
        if span == 200:
            rows[-1, 8] = 2.0 ** -1074 if dt == np.float64 else 2.0 ** -149
        with np.errstate(over="ignore"):
            rows = rows.astype(dt)
        per_row = np.empty((summands, 2, nb + 1), np.int16)
        zeros = [exact.block_codes(r[None], np, nb, per_row[i]) for i, r in enumerate(rows)]
        assert all(zeros)   # every row has a zero
        code = per_row.max(axis=0)   # the exchange's MAX
        halves, sigma = exact.block_layout(code, summands, dt, np)
        seen.add(halves)
        if not halves:
            continue
        want = exact_ref(list(rows))
        for order in (rng.permutation(summands), np.arange(summands)[::-1]):
            assert same_bits(_add_in_order(rows, order, halves, sigma, nb, dt), want), (dtype, summands, span, halves)
    if dtype == "float32":
        assert {1, 3} <= seen
    else:
        assert {2, 3, 0} <= seen



@pytest.mark.parametrize("dtype, depth, layout, deeper", [
    ("float32", 52, 1, 3), ("float64", 76, 3, 2), ("float64", 104, 2, 0)])
def test_layouts_end_where_their_sums_stop_being_exact(dtype: str, depth: int, layout: int,
                                                        deeper: int) -> None:
    """Two summands in [1, 2) and just under 2**(2 - depth) with every bit set: at ``depth``
    the layout still takes them (and adds them exactly, in both orders); one bit deeper it
    hands them on to the next (0: the per-element method)."""
    dt = np.dtype(dtype)
    prec = exact.FORMATS[dt][0]
    for d, want_layout in ((depth, layout), (depth + 1, deeper)):
        rows = np.array([[1.5 - 2.0 ** (1 - prec)], [(2.0 ** prec - 1) * 2.0 ** (1 - d)]]).astype(dt)
        per_row = np.empty((2, 2, 2), np.int16)
        for i in range(2):
            exact.block_codes(rows[i:i + 1], np, 1, per_row[i])
        got_layout, sigma = exact.block_layout(per_row.max(axis=0), 2, dt, np)
        assert got_layout == want_layout, (dtype, d)
        if d > depth:
            continue
        want = exact_ref([rows[0], rows[1]])
        for order in ((0, 1), (1, 0)):
            assert same_bits(_add_in_order(rows, order, layout, sigma, 1, dt), want), (dtype, d, order)


@pytest.mark.parametrize("dtype, layout", [("float64", 3), ("float32", 1)])
def test_plan_sends_only_the_deep_blocks_as_halves(dtype: str, layout: int) -> None:
    """Normal data with one value 30 binades under its block's largest: that block alone
    travels as two float64 halves in a tail, the others in the range's layout (float64: a
    float32 hi and a float64 lo, not two halves everywhere); the plan's sums are exact."""
    dt = np.dtype(dtype)
    nb, n = 8, 64
    rng = np.random.default_rng(5)
    rows = rng.standard_normal((4, n))
    rows[2, 13] *= 2.0 ** -30                     # block 13 % 8 = 5
    rows = rows.astype(dt)
    per_row = np.empty((4, 2, nb + 1), np.int16)
    for i in range(4):
        exact.block_codes(rows[i:i + 1], np, nb, per_row[i])
    got, sigma, tail, sigma2 = exact.block_plan(per_row.max(axis=0), 4, dt, np, n)
    assert got == layout and tail is not None and np.flatnonzero(tail).tolist() == [5]
    pos, block = exact.tail_positions(tail, nb, n, np)
    assert pos.tolist() == list(range(5, n, nb)) and set(block.tolist()) == {5}
    want = exact_ref(list(rows))
    for order in ((0, 1, 2, 3), (3, 1, 0, 2)):
        acc = None
        for r in order:   # each row as the range's layout, the tail block's elements as halves
            x = rows[r].astype(np.float64)
            if layout == 1:
                part = [x.copy(), np.zeros(n)]
            else:
                part = [np.empty(n, np.float32), np.empty(n)]
                exact.split_blocks(rows[r], sigma, nb, np, part[0], part[1], np.empty(n))
                part = [part[0].astype(np.float64), part[1]]
            h, l_ = np.empty(pos.shape[0]), np.empty(pos.shape[0])
            exact.split_blocks(rows[r][pos], np.append(sigma2[block], 0.0), pos.shape[0], np, h, l_)
            part[0][pos], part[1][pos] = h, l_
            acc = part if acc is None else [a + p for a, p in zip(acc, part)]
        assert same_bits(exact.combine2(acc[0], acc[1], dt, np), want), (dtype, order)


def _add_in_order(rows: np.ndarray, order: Any, layout: int, sigma: Any, nb: int, dt: np.dtype) -> np.ndarray:
    """The rows in ``order`` in ``layout`` (as the exchanges would add them), rounded to ``dt``."""
    n = rows.shape[1]
    acc = None
    for r in order:
        if layout == 1:
            part = [rows[r].astype(np.float64)]
        else:
            part = [np.empty(n, np.float32 if layout == 3 else np.float64), np.empty(n)]
            exact.split_blocks(rows[r], sigma, nb, np, part[0], part[1], np.empty(n))
        acc = [p.copy() for p in part] if acc is None else [a + p for a, p in zip(acc, part)]
    assert all(a.dtype == p.dtype for a, p in zip(acc, part))   # float32 his add as float32
    if layout == 1:
        return acc[0].astype(dt)
    got = exact.combine2(acc[0].astype(np.float64), acc[1], dt, np)
    zero = acc[0] == 0
    got[zero] = acc[1][zero]
    return got


def body_large(rank: int) -> list[str]:
    """Arrays over several default ranges: ranks 0 and 1 contribute values, the others -0
    (the sum's identity), so the exact sum correctly rounded is one IEEE addition."""
    g = hpcdp.get_default_group()
    fails = []
    for dtype in ("float64", "float32"):
        n = (3 << 20) // np.dtype(dtype).itemsize + 12345
        pair = [np.random.default_rng([7, r]).standard_normal(n).astype(dtype) for r in (0, 1)]
        pair[0][::1000] = -0.0
        pair[1][::1000] = -0.0                    # all -0: -0
        pair[1][1::1000] = -pair[0][1::1000]      # cancellation: +0
        pair[0][n // 2:n // 2 + 50] = 1e-30       # one range deeper than two halves hold
        x = pair[rank] if rank < 2 else np.full(n, -0.0, dtype)
        want = pair[0] + pair[1]
        got = reproducible.sum_rows(g, x[None])
        if not same_bits(got, want):
            bad = np.nonzero(got.view(f"u{got.itemsize}") != want.view(f"u{got.itemsize}"))[0][:4]
            fails.append(f"{dtype}: elements {bad.tolist()} got {got[bad].tolist()} want {want[bad].tolist()}")
    return fails


@pytest.mark.parametrize("world", worlds("sim-2", "sim-3", "tcp-2", "mpi"), indirect=True)
def test_large_arrays_over_default_ranges(world: World) -> None:
    check(world.run(body_large))


def body_replicated_pair(rank: int) -> list[str]:
    """Each rank alone in its group, the world as ``replicate`` (FSDP's hybrid layout turned
    inside out): on two ranks the sum has two summands, the one-addition case, which must still
    add over ``replicate``."""
    g = hpcdp.get_default_group()
    alone = g.split(rank)
    fails = []
    for dtype in ("float64", "float32"):
        every = [_data("normal", r, 1, dtype) for r in range(g.size)]
        want = exact_ref([row for a in every for row in a])
        got = reproducible.sum_rows(alone, every[rank], mode="all", dtype=dtype, replicate=g)
        if not same_bits(got, want):
            fails.append(f"rank {rank} {dtype}: the sum over replicate= was left out")
    return fails


@pytest.mark.parametrize("world", worlds("sim-2", "sim-3", "mpi"), indirect=True)
def test_replicate_is_summed_in_every_layout(world: World) -> None:
    check(world.run(body_replicated_pair))


def body_phases(rank: int) -> list[str]:
    """One process per rank (TCP, MPI) or one rank (simulated): the record is process-wide."""
    g = hpcdp.get_default_group()
    n = 3000
    # 3 rows (not one addition) in [1, 2): every block 54 bits deep, a float32 hi and a float64
    # lo on any number of ranks, no tail
    rows = 1.0 + np.random.default_rng([9, rank]).random((3, n))
    reproducible.record_phases(True)
    try:
        reproducible.sum_rows(g, rows)
    finally:
        rec = reproducible.record_phases(False)
    fails = []
    steps = {"codes", "codes exchange", "layout", "split", "values exchange", "rounding"}
    if not steps <= set(rec) or any(rec[k] < 0 for k in steps):
        fails.append(f"steps recorded: {sorted(rec)}")
    head = (2 * (min(exact.BLOCKS, n) + 1) + 2) * 2      # the block codes, int16
    if rec.get("bytes") != head + 12 * n:                # a float32 hi and a float64 lo
        fails.append(f"bytes {rec.get('bytes')}, want {head + 12 * n}")
    reproducible.sum_rows(g, rows)
    if rec.get("bytes") != head + 12 * n or reproducible.record_phases(False):
        fails.append("recorded after it was stopped")
    return fails


@pytest.mark.parametrize("world", worlds("sim-1", "tcp-2", "mpi"), indirect=True)
def test_record_phases_counts_steps_and_bytes(world: World) -> None:
    """The benchmark's breakdown: every step of the blocked path timed, and the bytes each rank
    hands its exchanges counted (float64 data: 12 per element plus the codes)."""
    check(world.run(body_phases))


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_quick_plan_makes_block_plans_choice(dtype: str) -> None:
    """``exact.quick_plan`` (a few reductions of the codes) picks the layout ``block_plan``
    picks wherever it answers, and answers for the common ranges: normal data of either
    dtype, with and without a tail block, on 1-9 summands; its one grid rounds every block
    within the layout's bounds but the few it names (``fix``, as ``uniform_grid`` finds them),
    whose constants are ``block_plan``'s."""
    dt = np.dtype(dtype)
    rng = np.random.default_rng(11)
    answered = set()
    for n, nb in ((96, 8), (101, 8), (40, 1)):
        for summands in (1, 2, 4, 9):
            for span in (0, 3, 12, 30, 80):
                rows = rng.standard_normal((summands, n)) * 2.0 ** rng.integers(0, span + 1, (summands, n))
                if span == 80:
                    rows[0, 3] = 0.0
                with np.errstate(over="ignore"):
                    rows = rows.astype(dt)
                per_row = np.empty((summands, 2, nb + 1), np.int16)
                for i in range(summands):
                    exact.block_codes(rows[i:i + 1], np, nb, per_row[i])
                code = per_row.max(axis=0)
                quick = exact.quick_plan(code, summands, dt, np, n)
                layout = exact.block_plan(code, summands, dt, np, n)
                if quick is None:
                    continue
                answered.add(quick[0])
                assert quick[0] == layout[0], (n, nb, summands, span)
                assert (quick[4] is None) == (layout[2] is None), (n, nb, summands, span)
                if layout[2] is not None:
                    assert np.array_equal(quick[4], layout[2])
                    assert np.array_equal(quick[5][layout[2]], layout[3][layout[2]])
                if quick[0] == 3:
                    s, fix = exact.uniform_grid(code, summands, dt, np, 3, quick[4])
                    assert s == quick[1]
                    if quick[2] is None:
                        assert not fix.any()
                    else:                 # the blocks off the one grid, with block_plan's sigma
                        assert np.array_equal(quick[2], fix) and fix.any()
                        assert np.array_equal(quick[3][fix], layout[1][fix])
    # (float64 codes bound a value's last bit by its exponent: one float64 never takes them)
    assert answered == ({3} if dtype == "float64" else {1, 3})
    # block 3 large, blocks 5 and the tail holding a small value: off the range's grid, fixed
    nb, n, summands = 16, 16 * 8 + 5, 4
    rows = rng.standard_normal((summands, n))
    rows[:, 3:128:16] *= 2.0 ** 9
    if dtype == "float32":               # every block 30 binades wide: two parts everywhere
        rows[0, :16] *= 2.0 ** -30
        rows[0, 130] *= 2.0 ** -30
    small = 2.0 ** (-20 if dtype == "float64" else -45)
    rows[1, 16 + 5] = rows[2, 131] = small * 1.2345
    rows = rows.astype(dt)
    code = np.empty((2, nb + 1), np.int16)
    exact.block_codes(rows, np, nb, code)
    quick = exact.quick_plan(code, summands, dt, np, n)
    layout = exact.block_plan(code, summands, dt, np, n)
    assert quick is not None and quick[0] == layout[0] == 3 and layout[2] is None
    assert np.flatnonzero(quick[2]).tolist() == [5, nb]
    assert np.array_equal(quick[3][quick[2]], layout[1][quick[2]])
    # a value 2**-40 small in block 7: too deep for its own grid too, two halves in a tail
    rows[3, 7] = (2.0 ** -40 if dtype == "float64" else 2.0 ** -70) * 1.2345
    code = np.empty((2, nb + 1), np.int16)
    exact.block_codes(rows, np, nb, code)
    quick = exact.quick_plan(code, summands, dt, np, n)
    layout = exact.block_plan(code, summands, dt, np, n)
    assert quick is not None and quick[0] == layout[0] == 3
    assert np.flatnonzero(quick[4]).tolist() == np.flatnonzero(layout[2]).tolist() == [7]
    assert np.flatnonzero(quick[2]).tolist() == [5, nb]
    assert quick[5][7] == layout[3][7]


def body_uniform_fix(rank: int, was: tuple[int, int]) -> list[str]:
    """Blocks that the range's one grid (``exact.uniform_grid``) cannot take, rounded with
    their own sigma (``exact.round_uniform``): block 3 is 2**9 larger than the others (the
    grid is its), block 5 and the tail block hold a small value with every bit set on some
    rank (fine on their own grid; on the coarse one their lo sums would round); a float32 hi
    and a float64 lo for both dtypes (float32: every block 30 binades wide), every mode, exact."""
    g = hpcdp.get_default_group()
    n = g.size
    fails: list[str] = []
    reproducible._RANGE_BYTES, exact.BLOCKS = 1 << 20, 16
    try:
        for dtype, small in (("float64", 2.0 ** -20), ("float32", 2.0 ** -45)):
            arrs = []
            for r in range(n):
                a = 1.0 + np.random.default_rng([13, r]).random((2, 16 * 8 + 5))
                a[:, 3:128:16] *= 2.0 ** 9
                if dtype == "float32":   # every block wide (30 binades): a float32 hi, a float64 lo
                    a[0, 16:32] *= 2.0 ** -30
                    a[0, 130] *= 2.0 ** -30
                arrs.append(a)
            for e, sign in ((5, 1.0), (16 * 3 + 5, -1.0), (130, -1.0)):   # blocks 5, 5, tail
                # small + a - a (+ c - c on more ranks): the lo sums see the small value beside
                # a's lo, and the exact total is the small value alone, every bit of which counts
                arrs[0][0, e] = sign * small * 1.9876543210987654321
                if n > 1:
                    arrs[1][0, e] = -arrs[0][1, e]
                    arrs[1][1, e] = 0.0
                for a in arrs[2:]:
                    a[1, e] = -a[0, e]
            arrs = [a.astype(dtype) for a in arrs]
            every = [row for a in arrs for row in a]
            want = exact_ref(every)
            got = reproducible.sum_rows(g, arrs[rank], dtype=dtype)
            if not same_bits(got, want):
                bad = np.nonzero(got != want)[0][:4]
                fails.append(f"all {dtype}: elements {bad.tolist()} got {got[bad].tolist()} "
                             f"want {want[bad].tolist()}")
            red = reproducible.sum_rows(g, arrs[rank], mode="root", root=0, dtype=dtype)
            if rank == 0 and not same_bits(red, want):
                fails.append(f"root {dtype}")
            cut = (arrs[rank].shape[1] // n) * n
            part = reproducible.sum_rows(g, arrs[rank][:, :cut], mode="scatter", dtype=dtype)
            per = cut // n
            if not same_bits(part, exact_ref([row[:cut] for row in every])[rank * per:(rank + 1) * per]):
                fails.append(f"scatter {dtype}")
    finally:
        reproducible._RANGE_BYTES, exact.BLOCKS = was
    return fails


def test_uniform_grid_fixes_only_the_deep_blocks() -> None:
    """The kernel: with block 3 large, the blocks holding a small value are the ``fix``, and
    ``round_uniform`` rounds exactly as one sigma per block would where that grid holds."""
    nb, n = 16, 16 * 8 + 5
    rows = 1.0 + np.random.default_rng(3).random((2, n))
    rows[:, 3:128:16] *= 2.0 ** 9
    rows[0, 5 + 32] = 2.0 ** -13
    rows[1, 130] = -(2.0 ** -13)
    code = np.empty((2, nb + 1), np.int16)
    exact.block_codes(rows, np, nb, code)
    layout, sigma, tail, _ = exact.block_plan(code, 4, rows.dtype, np, n)
    assert layout == 3 and tail is None
    s, fix = exact.uniform_grid(code, 4, rows.dtype, np, 3)
    assert np.flatnonzero(fix).tolist() == [5, nb] and s == sigma.max()
    got, own = np.empty((2, n)), np.empty((2, n))
    exact.round_uniform(rows, s, sigma, fix, nb, np, got)
    exact.round_blocks(rows, sigma, nb, np, own)
    blocks = np.arange(n) % nb
    blocks[(n // nb) * nb:] = nb
    mine = fix[blocks]
    assert same_bits(got[:, mine], own[:, mine])
    assert not np.array_equal(got, own)   # the coarse grid elsewhere (block 3's)
    assert np.all(np.abs(rows - got)[:, ~mine] <= s * 2.0 ** -53)   # lo within half its grid


@pytest.mark.parametrize("world", worlds(*grid([1, 2, 3, 4]), "mpi"), indirect=True)
def test_blocks_off_the_ranges_grid_keep_their_own(world: World) -> None:
    check(world.run(body_uniform_fix, _sizes()))


def body_float32_on_one_grid(rank: int) -> list[str]:
    """float32 rows on the range's one grid (``exact.round_uniform``): the rounding constant
    must act in float64. A Python float takes float32 rows' dtype under numpy's promotion
    rules: every hi came out 0 (the sum then rounded in float64, inexact), and a constant
    beyond float32's range made NaN of finite values. Three summands (no one-addition
    shortcut), split over the ranks, exact against the Fraction reference."""
    g = hpcdp.get_default_group()
    n = 2048
    fails: list[str] = []
    for name, a, b, c in (
            ("cancel", 1 + 2.0 ** -23, 2.0 ** -30 * (1 + 2.0 ** -23), -(1 + 2.0 ** -23)),
            ("huge", 2.0 ** 100 * (1 + 2.0 ** -23), 1.5 * 2.0 ** 70, 2.0 ** 100 * (1 + 2.0 ** -23))):
        every = [np.full(n, v, np.float32) for v in (a, b, c)]
        mine = np.array([row for i, row in enumerate(every) if i % g.size == rank],
                        np.float32).reshape(-1, n)
        got = reproducible.sum_rows(g, mine, dtype="float32")
        want = exact_ref(every)
        if not same_bits(got, want):
            fails.append(f"{name}: got {got[:2].tolist()} want {want[:2].tolist()}")
    return fails


@pytest.mark.parametrize("world", worlds("sim-1", "sim-2", "sim-3", "tcp-2", "mpi"), indirect=True)
def test_float32_rows_on_one_grid_are_exact(world: World) -> None:
    check(world.run(body_float32_on_one_grid))

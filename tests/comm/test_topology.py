"""Process topology: ``split`` (mpi4py's ``Comm.Split``), cartesian grids (``CartGroup``:
coordinates, ``shift``, ``rank_of``, ``sub``) and ``dims_create`` (``MPI.Compute_dims``), each
against a pure-Python or numpy reference, on every world."""
from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from typing import Any, Callable

import numpy as np
import pytest

import hpcdp
from hpcdp.backends.base import Backend
from hpcdp.testing import check
from hpcdp.testing.fixtures import World


# -- references -----------------------------------------------------------------------------------
def ref_layout(colors: list[Any], keys: list[int]) -> dict[int, list[int]]:
    """MPI_Comm_split's rule: per color, the ranks ordered by key, then by rank."""
    out: dict[int, list[int]] = {}
    for r in range(len(colors)):
        if colors[r] is not None and colors[r] != hpcdp.UNDEFINED:
            out.setdefault(colors[r], []).append(r)
    return {c: sorted(rs, key=lambda r: (keys[r], r)) for c, rs in out.items()}


def ref_coords(dims: list[int]) -> list[tuple[int, ...]]:
    """Every rank's coordinates, row-major (itertools.product varies the last dim fastest)."""
    return list(itertools.product(*(range(d) for d in dims)))


def ref_rank_of(dims: list[int], periods: list[bool], coords: tuple[int, ...]) -> int:
    fixed = []
    for c, d, p in zip(coords, dims, periods):
        if p:
            c %= d
        elif not 0 <= c < d:
            return hpcdp.PROC_NULL
        fixed.append(c)
    return ref_coords(dims).index(tuple(fixed))


def grids(n: int) -> list[tuple[list[int], list[bool]]]:
    """The grids a world of ``n`` ranks tests: 2x2 where n is 4, 1-D, and dims_create's 2-D and
    3-D shapes, each periodic and not (every mix of periods for 2x2)."""
    shapes = [[n], hpcdp.dims_create(n, 2), hpcdp.dims_create(n, 3)]
    if n == 4:
        shapes.insert(0, [2, 2])
    out = []
    for dims in shapes:
        mixes = (itertools.product([False, True], repeat=len(dims)) if dims == [2, 2]
                 else [(False,) * len(dims), (True,) * len(dims)])
        out += [(list(dims), list(p)) for p in mixes]
    return out


def raises_everywhere(fails: list[str], what: str, fn: Callable[[], Any],
                      exc: type[BaseException] | tuple[type[BaseException], ...],
                      *words: str) -> None:
    """``fn()`` must raise ``exc`` whose message holds ``words`` (called on every rank)."""
    try:
        got = fn()
    except exc as e:
        for w in words:
            if w not in str(e):
                fails.append(f"{what}: {w!r} not in {e}")
        return
    except Exception as e:  # noqa: BLE001 - reported as a failure
        fails.append(f"{what}: raised {type(e).__name__}: {e}, expected {exc}")
        return
    fails.append(f"{what}: returned {got!r}, expected {exc}")


# -- bodies ---------------------------------------------------------------------------------------
def check_split(fails: list[str], g: Any, rank: int, colors: list[Any], keys: list[Any],
                what: str, **kw: Any) -> Any:
    """``g.split(colors[rank], keys[rank])`` against the reference, with a collective on it."""
    n = g.size
    eff_keys = [r if k is None else k for r, k in enumerate(keys)]
    layout = ref_layout(colors, eff_keys)
    sub = g.split(colors[rank], keys[rank], **kw)
    mine = colors[rank]
    if mine is None or mine == hpcdp.UNDEFINED:
        if sub is not None:
            fails.append(f"{what}: rank {rank} without a color got {sub!r}, expected None")
        return None
    members = layout[mine]
    if list(sub.ranks) != [g.ranks[r] for r in members] or sub.rank != members.index(rank):
        fails.append(f"{what}: rank {rank} got {sub!r}, expected ranks "
                     f"{[g.ranks[r] for r in members]}, rank {members.index(rank)}")
        return sub
    # a collective on each new group, against numpy over the same members
    vals = np.array([[r + 1.0, r * r - 3.0, 2.0 ** -r] for r in range(n)])
    got = sub.allreduce(vals[rank])
    if not np.array_equal(got, vals[members].sum(axis=0)):
        fails.append(f"{what}: rank {rank} allreduce {got}, expected {vals[members].sum(axis=0)}")
    gathered = sub.all_gather(np.array([rank]))
    if gathered.ravel().tolist() != members:
        fails.append(f"{what}: rank {rank} all_gather {gathered.ravel().tolist()} != {members}")
    root_val = sub.broadcast(np.array([rank * 10.0]), root=0)
    if root_val[0] != members[0] * 10.0:
        fails.append(f"{what}: rank {rank} broadcast from new rank 0 gave {root_val}")
    return sub


def body_split(rank: int) -> list[str]:
    g = hpcdp.get_default_group()
    n = g.size
    fails: list[str] = []
    check_split(fails, g, rank, [r % 2 for r in range(n)], [None] * n, "two colors")
    check_split(fails, g, rank, [0] * n, [n - r for r in range(n)], "keys reverse the order")
    check_split(fails, g, rank, [r % 3 for r in range(n)], [-r for r in range(n)],
                "three colors, descending keys")
    # equal keys fall back to the parent rank; colors need not be dense or small
    check_split(fails, g, rank, [1000 * (r // 2) for r in range(n)], [7] * n, "equal keys")
    # no group: None, and MPI's spelling (hpcdp.UNDEFINED) as numpy ints too
    none_colors = [None, np.int64(hpcdp.UNDEFINED)] + [5] * (n - 2)
    check_split(fails, g, rank, none_colors, [None] * n, "None/UNDEFINED colors")
    check_split(fails, g, rank, [None] * n, [None] * n, "nobody gets a group")
    # names: one color keeps the name, several append the color
    sub = g.split(0, name="all")
    if sub.name != "all":
        fails.append(f"one color: name {sub.name!r}, expected 'all'")
    sub = g.split(rank % 2, name="parity")
    if sub.name != f"parity.{rank % 2}":
        fails.append(f"two colors: name {sub.name!r}, expected 'parity.{rank % 2}'")
    # a split of a split: the second level's ranks are the first's, in the first's order
    rev = g.split(0, key=-rank)
    check_split(fails, rev, rev.rank, [r % 2 for r in range(n)], [None] * n, "nested split")
    # the parent is unharmed
    total = g.allreduce(np.array([1.0]))
    if total[0] != n:
        fails.append(f"parent allreduce after splits: {total}")
    return fails


def body_split_bad(rank: int) -> list[str]:
    """Bad input on the last rank only makes every rank raise, naming that rank; the group then
    goes on (the exchange completed on every rank, and no backend state moved)."""
    g = hpcdp.get_default_group()
    bad = g.size - 1
    fails: list[str] = []
    cases: list[tuple[str, dict[str, Any], type[BaseException]]] = [
        ("str color", {"color": "a"}, TypeError),
        ("float color", {"color": 1.5}, TypeError),
        ("bool color", {"color": True}, TypeError),
        ("negative color", {"color": -1}, ValueError),
        ("huge color", {"color": 2**31}, ValueError),
        ("str key", {"color": 0, "key": "x"}, TypeError),
        ("huge key", {"color": 0, "key": -2**40}, ValueError),
    ]
    for what, kw, exc in cases:
        args = kw if rank == bad else {"color": 0}
        raises_everywhere(fails, what, lambda: g.split(**args), exc, f"rank {bad} passed")
        # a good split right after works, with the same layout everywhere
        check_split(fails, g, rank, [r % 2 for r in range(g.size)], [None] * g.size,
                    f"split after {what}")
    # one rank calls split while the others call new_group: every rank raises
    if rank == 0:
        raises_everywhere(fails, "split vs new_group", lambda: g.split(0),
                          hpcdp.CollectiveMismatchError, "not split")
    else:
        raises_everywhere(fails, "new_group vs split", lambda: g.new_group(range(g.size)),
                          TypeError, "rank 0")
    check_split(fails, g, rank, [0] * g.size, [None] * g.size, "split after the mismatch")
    return fails


def body_split_fallback(rank: int) -> list[str]:
    """``Backend.split``'s default, one ``new_group`` per color, which a registered backend
    without a ``split`` of its own gets: the same groups as the transports' own ``split``."""
    g = hpcdp.get_default_group()
    n = g.size
    fails: list[str] = []
    colors, keys = [r % 2 for r in range(n)], [-r for r in range(n)]
    layout = ref_layout(colors, keys)
    sub = Backend.split(g.backend, colors[rank], keys[rank], layout)
    members = layout[colors[rank]]
    if sub is None or list(sub.ranks) != [g.ranks[r] for r in members]:
        return [f"rank {rank}: the default split gave {sub and sub.ranks}, expected {members}"]
    pg = hpcdp.ProcessGroup(sub, name=f"fallback.{colors[rank]}", timeout=g.timeout)
    got = pg.allreduce(np.array([rank + 1]))
    if pg.rank != members.index(rank) or got[0] != sum(r + 1 for r in members):
        fails.append(f"rank {rank}: rank {pg.rank} of {members}, allreduce {got}")
    pg.shutdown()
    return fails


def body_cart(rank: int) -> list[str]:
    g = hpcdp.get_default_group()
    n = g.size
    fails: list[str] = []
    for dims, periods in grids(n):
        what = f"dims {dims} periods {periods}"
        cart = g.cart(dims, periods)
        coords = ref_coords(dims)
        if (cart.dims, cart.periods, cart.ndim) != (tuple(dims), tuple(periods), len(dims)):
            fails.append(f"{what}: got {cart!r}")
        if cart.coords != coords[rank] or cart.group.rank != rank or cart.size != n:
            fails.append(f"{what}: rank {rank} coords {cart.coords} (rank {cart.group.rank}), "
                         f"expected {coords[rank]}")
        if [cart.coords_of(r) for r in range(n)] != coords:
            fails.append(f"{what}: coords_of {[cart.coords_of(r) for r in range(n)]}")
        for c in itertools.product(*(range(-2, d + 2) for d in dims)):
            if cart.rank_of(c) != ref_rank_of(dims, periods, c):
                fails.append(f"{what}: rank_of({c}) = {cart.rank_of(c)}, expected "
                             f"{ref_rank_of(dims, periods, c)}")
        for dim in range(len(dims)):
            for disp in (-2, -1, 0, 1, 2, 3):
                lo = list(coords[rank])
                hi = list(coords[rank])
                lo[dim] -= disp
                hi[dim] += disp
                want = (ref_rank_of(dims, periods, tuple(lo)),
                        ref_rank_of(dims, periods, tuple(hi)))
                if cart.shift(dim, disp) != want:
                    fails.append(f"{what}: rank {rank} shift({dim}, {disp}) = "
                                 f"{cart.shift(dim, disp)}, expected {want}")
            # the neighbours agree: what comes from source is source's; PROC_NULL ends skipped
            src, dst = cart.shift(dim, 1)
            works = []
            got = np.full(1, -1)
            if src != hpcdp.PROC_NULL:
                works.append(cart.irecv(got, src, tag=dim))
            if dst != hpcdp.PROC_NULL:
                works.append(cart.isend(np.array([rank]), dst, tag=dim))
            hpcdp.wait_all(works)
            if src != hpcdp.PROC_NULL and got[0] != src:
                fails.append(f"{what}: rank {rank} got {got[0]} from shift source {src}")
        # sub-grids: each keeps some dims; its sum is numpy's over those axes
        vals = (np.arange(n, dtype=np.float64) ** 2 + 1).reshape(dims)
        for keep in itertools.product([False, True], repeat=len(dims)):
            sub = cart.sub(list(keep))
            kept = [i for i, k in enumerate(keep) if k]
            dropped = [i for i, k in enumerate(keep) if not k]
            want_sum = vals.sum(axis=tuple(kept))[tuple(coords[rank][i] for i in dropped)]
            got_sum = sub.allreduce(np.array([vals[coords[rank]]]))[0]
            members = [r for r in range(n)
                       if all(coords[r][i] == coords[rank][i] for i in dropped)]
            if got_sum != want_sum:
                fails.append(f"{what}: sub {keep} rank {rank} sum {got_sum}, expected {want_sum}")
            if (list(sub.group.ranks) != [g.ranks[r] for r in members]
                    or sub.dims != tuple(dims[i] for i in kept)
                    or sub.periods != tuple(periods[i] for i in kept)
                    or sub.coords != tuple(coords[rank][i] for i in kept)):
                fails.append(f"{what}: sub {keep} rank {rank} got {sub!r}, expected ranks "
                             f"{[g.ranks[r] for r in members]}")
    # the row and column groups of a 2-D grid: sums equal numpy's row and column sums
    dims = hpcdp.dims_create(n, 2)
    cart = g.cart(dims)
    field = np.arange(n * 3, dtype=np.float64).reshape(*dims, 3) * 0.5 - 1
    i, j = cart.coords
    row = cart.sub([False, True]).allreduce(field[i, j])
    col = cart.sub([True, False]).allreduce(field[i, j])
    if not np.array_equal(row, field.sum(axis=1)[i]) or not np.array_equal(
            col, field.sum(axis=0)[j]):
        fails.append(f"rank {rank}: row {row} / column {col} sums differ from numpy's")
    # a grid smaller than the group: the rest get None, as MPI's COMM_NULL
    if n > 1:
        small = g.cart([n - 1], True)
        if (small is None) != (rank == n - 1):
            fails.append(f"rank {rank}: cart([{n - 1}]) gave {small!r}")
        elif small is not None and (small.size != n - 1 or small.coords != (rank,)):
            fails.append(f"rank {rank}: cart([{n - 1}]) gave {small!r}")
    return fails


def body_cart_bad(rank: int) -> list[str]:
    """Bad or differing grid arguments on one rank raise on every rank; the group goes on."""
    g = hpcdp.get_default_group()
    n, last = g.size, g.size - 1
    fails: list[str] = []
    raises_everywhere(fails, "too many ranks", lambda: g.cart([n + 1]), ValueError,
                      f"need {n + 1} ranks")
    raises_everywhere(fails, "zero extent", lambda: g.cart([0] if rank == last else [n]),
                      ValueError, f"rank {last} passed dims")
    raises_everywhere(fails, "dims differ", lambda: g.cart([n, 1] if rank == last else [1, n]),
                      hpcdp.CollectiveMismatchError, "different dims")
    raises_everywhere(fails, "periods length",
                      lambda: g.cart([n], [True, False] if rank == last else [True]),
                      ValueError, f"rank {last} passed periods")
    cart = g.cart([n], [True])
    raises_everywhere(fails, "remain_dims length",
                      lambda: cart.sub([True, True] if rank == last else [True]),
                      ValueError, f"rank {last} passed remain_dims")
    raises_everywhere(fails, "remain_dims differ",
                      lambda: cart.sub([False] if rank == last else [True]),
                      hpcdp.CollectiveMismatchError, "different remain_dims")
    for what, fn, exc in [("shift dim", lambda: cart.shift(1, 1), ValueError),
                          ("rank_of length", lambda: cart.rank_of((0, 0)), ValueError),
                          ("coords_of range", lambda: cart.coords_of(n), ValueError),
                          ("coords_of PROC_NULL", lambda: cart.coords_of(hpcdp.PROC_NULL),
                           ValueError)]:
        raises_everywhere(fails, what, fn, exc)
    whole = cart.sub([True]).allreduce(np.array([1]))
    if whole[0] != n:
        fails.append(f"rank {rank}: the grid after the errors summed {whole}")
    return fails


# -- tests ----------------------------------------------------------------------------------------
def test_split(world: World) -> None:
    check(world.run(body_split))


def test_split_bad_input_raises_on_every_rank(world: World) -> None:
    check(world.run(body_split_bad))


def test_split_default_for_other_backends(world: World) -> None:
    check(world.run(body_split_fallback))


def test_cart(world: World) -> None:
    check(world.run(body_cart))


def test_cart_bad_input_raises_on_every_rank(world: World) -> None:
    check(world.run(body_cart_bad))


def test_cart_group_reads_like_its_group() -> None:
    def body(rank: int) -> list[str]:
        cart = hpcdp.get_default_group().cart([2])
        fails = []
        if cart.allreduce.__self__ is not cart.group or cart.rank != rank:
            fails.append(f"rank {rank}: {cart.allreduce} is not the grid group's")
        if "allreduce" not in dir(cart):
            fails.append("dir(cart) lacks the group's methods")
        cart.timeout = 7.0  # a group setting, set through the grid, is the group's
        if cart.group.timeout != 7.0 or "timeout" in vars(cart):
            fails.append(f"cart.timeout = 7 left the group's at {cart.group.timeout}")
        try:
            cart._broken
        except AttributeError:
            pass
        else:
            fails.append("a private attribute of the group was reachable on the grid")
        return fails

    check(hpcdp.spawn(body, 2, backend="sim"))


@pytest.mark.parametrize("nnodes,dims,want", [
    (12, 2, [4, 3]), (12, [0, 3, 0], [2, 3, 2]), (6, [2, 0, 0], [2, 3, 1]), (1, 0, []),
    (72, 2, [9, 8]), (7, [7], [7]), (16, [0, 0, 0, 0], [2, 2, 2, 2]),
])
def test_dims_create_examples(nnodes: int, dims: Any, want: list[int]) -> None:
    arg = list(dims) if isinstance(dims, list) else dims
    assert hpcdp.dims_create(nnodes, arg) == want
    assert arg == dims  # a list argument is not filled in place


@pytest.mark.parametrize("nnodes,dims", [(0, 2), (2, 0), (6, [4, 0]), (6, [2, 2]), (4, -1),
                                         (4, [-1, 0]), (2.0, 1), (4, ["a"])])
def test_dims_create_refuses(nnodes: Any, dims: Any) -> None:
    with pytest.raises(ValueError, match="dims_create"):
        hpcdp.dims_create(nnodes, dims)


def test_dims_create_matches_mpi_compute_dims() -> None:
    # MPI.Compute_dims in a child, so that this pytest process never initialises MPI (mpi4py and
    # an MPI that starts a singleton are installed by ``make install``: no skip)
    code = ("import json; from mpi4py import MPI; print(json.dumps({f'{n} {k}': "
            "MPI.Compute_dims(n, k) for n in range(1, 65) for k in range(1, 4)} | {f'{n} {d}': "
            "MPI.Compute_dims(n, json.loads(d)) for n in (12, 24, 36, 60) "
            "for d in ('[0, 2, 0]', '[3, 0]', '[0, 0, 1]')}))")
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, f"mpi4py's Compute_dims did not run: {out.stderr[-300:]}"
    ref = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(ref) == 64 * 3 + 12
    for case, want in ref.items():
        n, _, d = case.partition(" ")
        got = hpcdp.dims_create(int(n), json.loads(d))
        assert got == want, (case, got, want)
        assert math.prod(got) == int(n)

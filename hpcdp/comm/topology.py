"""Process topology: ``split`` into disjoint groups, cartesian grids and balanced grid shapes.

mpi4py's ``Comm.Split``, ``Create_cart``, ``Cartcomm`` (``coords``, ``Get_cart_rank``,
``Shift``, ``Sub``) and ``Compute_dims`` for hpcdp groups, so a decomposition takes a few lines
instead of every rank building every row and column group by hand, in the same order.

A 2-D halo exchange, walls at the top and bottom, periodic left to right::

    g = hpcdp.get_default_group()
    cart = g.cart(hpcdp.dims_create(g.size, 2), periods=[False, True])
    u = np.zeros((ny + 2, nx + 2))            # this rank's block and one ghost layer
    up, down = cart.shift(0, 1)               # PROC_NULL beyond a wall: that half is skipped
    cart.sendrecv(u[-2], down, u[0], up)      # last row down, top ghost row from above
    cart.sendrecv(u[1], up, u[-1], down)
    left, right = cart.shift(1, 1)
    u[:, 0] = cart.sendrecv(u[:, -2].copy(), right, np.empty(ny + 2), left)
    u[:, -1] = cart.sendrecv(u[:, 1].copy(), left, np.empty(ny + 2), right)
    row_total = cart.sub([False, True]).allreduce(u[1:-1, 1:-1].sum(axis=1))

Here ``cart`` is a ``CartGroup``: the grid's geometry, holding the ``ProcessGroup`` of its
ranks as ``cart.group``; collectives and point-to-point are that group's, reachable on the
grid itself (``cart.allreduce`` is ``cart.group.allreduce``) as on mpi4py's ``Cartcomm``.

The ``ProcessGroup`` methods ``split`` and ``cart`` (``group.py``) are the entry points; this
module holds what they need that is not a group's own: the ``split`` exchange's checks and
layout, the grid arithmetic, and ``dims_create``. It calls groups only through their public
methods.
"""
from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from ..backends.base import PROC_NULL
from ..errors import CollectiveMismatchError
from .validation import check_rank

if TYPE_CHECKING:
    from .group import ProcessGroup

__all__ = ["CartGroup", "PROC_NULL", "UNDEFINED", "cart_create", "dims_create"]

#: a ``split`` color meaning "no group for this rank" (MPI's value of ``MPI.UNDEFINED``, so code
#: ported from mpi4py keeps working); ``None`` means the same
UNDEFINED = -32766

_C_INT = 2**31  # colors and keys travel as C ints to MPI


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


# -- split --------------------------------------------------------------------------------------
def group_payload(ranks: Any) -> Any:
    """What one rank contributes to ``new_group``'s exchange: its list of ranks, or their repr
    where they are not ints, so that every rank judges every rank's list (``group_ranks``)."""
    try:
        return [int(r) if isinstance(r, (int, np.integer)) and not isinstance(r, bool) else repr(r)
                for r in ranks]
    except TypeError:
        return repr(ranks)


def group_ranks(seen: Sequence[Any], where: str, size: int) -> list[int]:
    """The ranks of ``new_group``'s exchange, every rank's list judged in rank order (so each
    rank raises the same error): ints, at least one, no duplicates, in range, and the same list
    from every rank."""
    for i, s in enumerate(seen):
        if not isinstance(s, list) or any(not isinstance(r, int) for r in s):
            raise TypeError(f"{where}: rank {i} passed ranks that are not ints: {s}")
        if not s:
            raise ValueError(f"{where}: a group needs at least one rank (rank {i} passed [])")
        if len(set(s)) != len(s):
            raise ValueError(f"{where}: duplicate ranks in {s} (passed by rank {i})")
        for r in s:
            check_rank(where + f" (list of rank {i})", "rank", r, size)
    if any(s != seen[0] for s in seen):
        detail = "; ".join(f"rank {i}: {s}" for i, s in enumerate(seen))
        raise CollectiveMismatchError(f"{where}: ranks passed different lists ({detail})")
    return list(seen[0])


def split_payload(color: Any, key: Any, rank: int) -> tuple[str, Any, Any]:
    """What one rank contributes to ``split``'s exchange: its color and key, or their repr
    where they are not ints, so that every rank judges every rank's input (``split_layout``)."""
    if color is None or (_is_int(color) and int(color) == UNDEFINED):
        c: Any = None
    else:
        c = int(color) if _is_int(color) else repr(color)[:80]
    if key is None:
        k: Any = rank
    else:
        k = int(key) if _is_int(key) else repr(key)[:80]
    return ("split", c, k)


def split_layout(seen: Sequence[Any], where: str
                 ) -> tuple[list[int | None], list[int], dict[int, list[int]]]:
    """Every rank's color and key from ``split``'s exchange, judged in rank order (so each rank
    raises the same error), and the layout: color -> group ranks ordered by key, then rank."""
    colors: list[int | None] = []
    keys: list[int] = []
    for i, s in enumerate(seen):
        if not (isinstance(s, tuple) and len(s) == 3 and s[0] == "split"):
            raise CollectiveMismatchError(
                f"{where}: rank {i} made another collective call, not split "
                f"(it contributed {s!r:.80})")
        _, c, k = s
        if c is not None and not _is_int(c):
            raise TypeError(f"{where}: rank {i} passed color={c}; a color is an int >= 0, "
                            "or None (hpcdp.UNDEFINED) for no group")
        if c is not None and not 0 <= c < _C_INT:
            raise ValueError(f"{where}: rank {i} passed color={c}; a color is an int in "
                             f"[0, 2**31), or None (hpcdp.UNDEFINED) for no group")
        if not _is_int(k):
            raise TypeError(f"{where}: rank {i} passed key={k}; a key is an int")
        if not -_C_INT <= k < _C_INT:
            raise ValueError(f"{where}: rank {i} passed key={k}, outside the C int range")
        colors.append(c)
        keys.append(k)
    layout: dict[int, list[int]] = {}
    for r in sorted(range(len(seen)), key=lambda r: (keys[r], r)):
        c = colors[r]
        if c is not None:
            layout.setdefault(c, []).append(r)
    return colors, keys, dict(sorted(layout.items()))


# -- cartesian grids ----------------------------------------------------------------------------
_OWN = frozenset({"group", "dims", "periods", "coords"})  # a CartGroup's own attributes


class CartGroup:
    """A group whose ranks form a cartesian grid, row-major as MPI's (the last dim varies
    fastest): mpi4py's ``Cartcomm``.

    Made by ``ProcessGroup.cart`` (or ``cart_create``). It holds the grid's ``ProcessGroup`` as
    ``group`` (composition); any public attribute that the grid itself lacks is the group's, so
    ``cart.allreduce(x)``, ``cart.isend(x, dst)``, ``cart.rank`` read as on the group.
    """

    def __init__(self, group: "ProcessGroup", dims: Sequence[int],
                 periods: Sequence[bool]) -> None:
        self.group = group
        self.dims: tuple[int, ...] = tuple(int(d) for d in dims)
        self.periods: tuple[bool, ...] = tuple(bool(p) for p in periods)
        if len(self.periods) != len(self.dims) or math.prod(self.dims) != group.size:
            raise ValueError(f"CartGroup: dims {list(self.dims)} and periods "
                             f"{list(self.periods)} do not lay out a group of {group.size}")
        #: this rank's coordinates
        self.coords: tuple[int, ...] = self.coords_of(group.rank)

    def __getattr__(self, attr: str) -> Any:
        group = self.__dict__.get("group")
        if group is None or attr.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {attr!r}")
        return getattr(group, attr)

    def __setattr__(self, attr: str, value: Any) -> None:
        # the group's settings (``cart.timeout = 60``, ``cart.debug``) are set on the group
        if attr in _OWN or "group" not in self.__dict__:
            object.__setattr__(self, attr, value)
        else:
            setattr(self.group, attr, value)

    def __dir__(self) -> list[str]:
        public = {a for a in dir(self.group) if not a.startswith("_")}
        return sorted(set(super().__dir__()) | public)

    def __repr__(self) -> str:
        return (f"<CartGroup dims {list(self.dims)} periods {list(self.periods)} coords "
                f"{list(self.coords)} of {self.group!r}>")

    @property
    def ndim(self) -> int:
        """Number of grid dimensions."""
        return len(self.dims)

    def coords_of(self, rank: int) -> tuple[int, ...]:
        """Grid coordinates of group rank ``rank`` (``Cartcomm.Get_coords``)."""
        size = math.prod(self.dims)
        if not _is_int(rank):
            raise TypeError(f"coords_of: rank must be an int, got {type(rank).__name__}")
        if not 0 <= rank < size:
            raise ValueError(f"coords_of: rank {rank} is not in a grid of {size} ranks "
                             f"(dims {list(self.dims)})")
        out = []
        r = int(rank)
        for d in reversed(self.dims):
            r, c = divmod(r, d)
            out.append(c)
        return tuple(reversed(out))

    def rank_of(self, coords: Sequence[int]) -> int:
        """Group rank at ``coords`` (``Cartcomm.Get_cart_rank``): periodic dims wrap; a
        coordinate outside a non-periodic dim gives ``PROC_NULL``."""
        coords = tuple(coords)
        if len(coords) != self.ndim:
            raise ValueError(f"rank_of: {len(coords)} coordinates for a {self.ndim}-D grid "
                             f"(dims {list(self.dims)})")
        r = 0
        for c, d, p in zip(coords, self.dims, self.periods):
            if not _is_int(c):
                raise TypeError(f"rank_of: coordinates must be ints, got {coords!r}")
            c = int(c)
            if p:
                c %= d
            elif not 0 <= c < d:
                return PROC_NULL
            r = r * d + c
        return r

    def shift(self, dim: int, disp: int = 1) -> tuple[int, int]:
        """``(source, dest)``: the ranks ``disp`` steps back and forward along ``dim``
        (``Cartcomm.Shift``); past the edge of a non-periodic dim, ``PROC_NULL``.

        Receive from ``source`` and send to ``dest`` to move data by ``+disp`` along ``dim``.
        """
        if not _is_int(dim) or not 0 <= dim < self.ndim:
            raise ValueError(f"shift: dim={dim!r} is not a dimension of a {self.ndim}-D grid")
        if not _is_int(disp):
            raise TypeError(f"shift: disp must be an int, got {type(disp).__name__}")
        lo, hi = list(self.coords), list(self.coords)
        lo[dim] -= int(disp)
        hi[dim] += int(disp)
        return self.rank_of(lo), self.rank_of(hi)

    def sub(self, remain_dims: Sequence[bool], *, name: str | None = None,
            timeout: float | None = None) -> "CartGroup":
        """Collective over the grid: the sub-grid through this rank that keeps the dims marked
        True (``Cartcomm.Sub``): in a 2-D grid ``[False, True]`` is this rank's row (its ranks
        differ in the last coordinate only), ``[True, False]`` its column.

        Every rank gets the sub-grid it lies in; all sub-grids come from one ``split``. The
        arguments are exchanged first, so a bad or differing ``remain_dims`` on any rank raises
        on every rank.
        """
        where = f"sub (rank {self.group.rank} of grid {self.group.name})"
        mine = _flags_or_repr(remain_dims, self.ndim)
        seen = self.group.all_gather_object(("sub", mine), timeout=timeout)
        for i, s in enumerate(seen):
            if not (isinstance(s, tuple) and len(s) == 2 and s[0] == "sub"):
                raise CollectiveMismatchError(
                    f"{where}: rank {i} made another collective call, not sub "
                    f"(it contributed {s!r:.80})")
            if not isinstance(s[1], tuple):
                raise ValueError(f"{where}: rank {i} passed remain_dims={s[1]}; it takes "
                                 f"{self.ndim} bools, one per dim of {list(self.dims)}")
        _agree(where, "remain_dims", [s[1] for s in seen])
        keep = seen[0][1]
        color = 0
        for c, d, k in zip(self.coords, self.dims, keep):
            if not k:
                color = color * d + c
        sub = self.group.split(color, name=name, timeout=timeout)
        assert sub is not None  # every rank has a color
        return CartGroup(sub, [d for d, k in zip(self.dims, keep) if k],
                         [p for p, k in zip(self.periods, keep) if k])


def _flags_or_repr(flags: Any, n: int) -> tuple[bool, ...] | str:
    """``flags`` as a tuple of ``n`` bools (one bool: the same for every dim), or its repr when
    it is not that, for the exchange before judging."""
    if _is_flag(flags):
        return (bool(flags),) * n
    try:
        out = tuple(flags)
    except TypeError:
        return repr(flags)[:80]
    if len(out) != n or not all(_is_flag(f) for f in out):
        return repr(flags)[:80]
    return tuple(bool(f) for f in out)


def _is_flag(f: Any) -> bool:
    return isinstance(f, (bool, np.bool_)) or (_is_int(f) and int(f) in (0, 1))


def _agree(where: str, what: str, values: Sequence[Any]) -> None:
    if any(v != values[0] for v in values):
        detail = "; ".join(f"rank {i}: {v}" for i, v in enumerate(values))
        raise CollectiveMismatchError(f"{where}: ranks passed different {what} ({detail})")


def cart_create(group: "ProcessGroup", dims: Sequence[int],
                periods: bool | Sequence[bool] = False, *, reorder: bool = False,
                name: str | None = None, timeout: float | None = None) -> CartGroup | None:
    """Collective over ``group``: its first ``prod(dims)`` ranks as a cartesian grid
    (mpi4py's ``Comm.Create_cart``); ``ProcessGroup.cart`` calls it.

    Args:
        dims: ranks along each dim (ints > 0); ``dims_create`` makes a balanced one.
        periods: per dim, or one bool for all: whether the dim wraps around (a ring).
        reorder: accepted for mpi4py's signature; ranks keep their order (grid rank ``r`` is
            group rank ``r``), which is what MPI implementations commonly do too.
        name: the grid group's name (default: made from the parent's).
        timeout: for the exchange and the grid group (default: the group's).

    Returns:
        The grid on its ranks; None on group ranks ``>= prod(dims)`` (MPI's ``COMM_NULL``),
        as MPI lets a grid use fewer ranks than the group. More ranks than the group raises
        ``ValueError``, on every rank: the arguments are exchanged first, so a bad or differing
        ``dims``/``periods`` on any rank raises everywhere.
    """
    where = f"cart (rank {group.rank} of group {group.name})"
    try:
        d: Any = tuple(int(x) if _is_int(x) else repr(x)[:40] for x in dims)
    except TypeError:
        d = repr(dims)[:80]
    n = len(d) if isinstance(d, tuple) else 0
    seen = group.all_gather_object(("cart", d, _flags_or_repr(periods, n)), timeout=timeout)
    for i, s in enumerate(seen):
        if not (isinstance(s, tuple) and len(s) == 3 and s[0] == "cart"):
            raise CollectiveMismatchError(f"{where}: rank {i} made another collective call, "
                                          f"not cart (it contributed {s!r:.80})")
        if not isinstance(s[1], tuple) or any(not _is_int(x) or x < 1 for x in s[1]):
            raise ValueError(f"{where}: rank {i} passed dims={s[1]}; dims are ints > 0")
        if not isinstance(s[2], tuple):
            raise ValueError(f"{where}: rank {i} passed periods={s[2]}; periods are a bool, "
                             f"or one bool per dim of {list(s[1])}")
    _agree(where, "dims", [s[1] for s in seen])
    _agree(where, "periods", [s[2] for s in seen])
    dims_t, periods_t = seen[0][1], seen[0][2]
    need = math.prod(dims_t)
    if need > group.size:
        raise ValueError(f"{where}: dims {list(dims_t)} need {need} ranks, the group has "
                         f"{group.size} (hpcdp.dims_create({group.size}, {len(dims_t)}) fits)")
    sub = group.split(0 if group.rank < need else None, name=name, timeout=timeout)
    return None if sub is None else CartGroup(sub, dims_t, periods_t)


# -- grid shapes --------------------------------------------------------------------------------
def dims_create(nnodes: int, dims: int | Sequence[int]) -> list[int]:
    """A balanced grid shape for ``nnodes`` ranks (mpi4py's ``MPI.Compute_dims``).

    Args:
        nnodes: ranks in the grid (>= 1).
        dims: the number of dims, or a list with the extents to keep and zeros to fill.

    Returns:
        The extents; the filled ones multiply to what the kept ones leave, are as close to each
        other as possible (smallest spread between largest and smallest) and in non-increasing
        order, e.g. ``dims_create(12, 2) == [4, 3]``, ``dims_create(12, [0, 3, 0]) == [2, 3, 2]``.
        Up to 64 ranks this agrees with every MPI; for some larger counts (72 into 2 dims: 9x8)
        it is more balanced than Open MPI 4's greedy choice (12x6).
    """
    if not _is_int(nnodes) or nnodes < 1:
        raise ValueError(f"dims_create: nnodes must be an int >= 1, got {nnodes!r}")
    if _is_int(dims):
        if dims < 0:
            raise ValueError(f"dims_create: ndims must be >= 0, got {dims}")
        out = [0] * int(dims)
    else:
        out = list(dims)
        if any(not _is_int(x) or x < 0 for x in out):
            raise ValueError(f"dims_create: dims must be ints >= 0 (0: to fill), got {dims!r}")
        out = [int(x) for x in out]
    fixed = math.prod(x for x in out if x)
    free = [i for i, x in enumerate(out) if x == 0]
    if nnodes % fixed or (not free and fixed != nnodes):
        raise ValueError(f"dims_create: the extents {out} cannot make a grid of {nnodes} ranks")
    rest = nnodes // fixed
    if not free:
        return out
    for i, x in zip(free, _balanced(rest, len(free))):
        out[i] = x
    return out


def _balanced(n: int, k: int) -> tuple[int, ...]:
    """``k`` factors of ``n``, non-increasing, with the smallest spread (then the smallest
    leading factors): a search over the divisors of ``n``, which are few."""
    divs = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    divs = sorted(set(divs + [n // d for d in divs]), reverse=True)
    best: tuple[int, ...] | None = None

    def walk(rem: int, left: int, cap: int, acc: tuple[int, ...]) -> None:
        nonlocal best
        if left == 1:
            if rem <= cap:
                t = acc + (rem,)
                if best is None or (t[0] - t[-1], t) < (best[0] - best[-1], best):
                    best = t
            return
        for f in divs:
            if f > cap or rem % f:
                continue
            if f ** left < rem:  # the remaining factors, none above f, cannot reach rem
                break
            walk(rem // f, left - 1, f, acc + (f,))

    walk(n, k, n, ())
    assert best is not None
    return best

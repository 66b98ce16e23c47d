"""One parameter's place in its unit: dim-0 sharding with padding, and the copies in and out.

Every parameter is sharded along its first dimension, as in PyTorch's FSDP2: with ``n`` ranks
in the shard group each rank owns ``chunk = ceil(rows / n)`` rows (the last owners get fewer or
none; a bias of 3 on 4 ranks leaves rank 3 with nothing), so a rank's piece of every parameter is
a rectangular block that ``checkpoint.Shard`` describes as it is. A unit packs its parameters'
padded chunks into one flat buffer per rank (``chunk * row_size`` elements each), so one
all-gather and one reduce-scatter serve the unit. The all-gather result is rank-major (rank 0's
pieces of every parameter, then rank 1's, ...), while a parameter needs its rows contiguous:
``copy_out`` moves each parameter's rows into a parameter-major buffer whose views become
``Parameter.data``, and ``copy_in`` does the reverse for gradients (FSDP2's "copy-out" and
"copy-in"; one pass over the unit's bytes, no more).
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Any

from ..errors import HpcdpError

__all__ = ["ParamSlot", "FreedGrad"]


@dataclass
class ParamSlot:
    """Layout of one parameter inside its unit's flat buffers (for one rank of the shard group)."""

    name: str            # global name (the bare model's ``named_parameters`` name)
    param: Any           # the model's Parameter: its ``.data`` is a view only while gathered
    shape: tuple[int, ...]
    n: int               # ranks in the shard group
    rank: int            # this rank in the shard group
    shard_offset: int = 0  # in the flat shard (padded chunks)
    full_offset: int = 0   # in the parameter-major gathered buffer (unpadded)

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def row_size(self) -> int:
        return prod(self.shape[1:])

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def chunk(self) -> int:
        """Rows per rank (the last owners may hold fewer)."""
        return -(-self.rows // self.n)

    @property
    def padded(self) -> int:
        """Elements this parameter takes in every rank's flat shard."""
        return self.chunk * self.row_size

    def bounds(self, rank: int | None = None) -> tuple[int, int]:
        """[lo, hi) rows owned by ``rank`` (default: this rank), clamped to the real rows."""
        r = self.rank if rank is None else rank
        return min(r * self.chunk, self.rows), min((r + 1) * self.chunk, self.rows)

    @property
    def local_shape(self) -> tuple[int, ...]:
        lo, hi = self.bounds()
        return (hi - lo, *self.shape[1:])

    @property
    def offsets(self) -> tuple[int, ...]:
        """Index of this rank's block in the whole parameter (``Shard.offsets``)."""
        return (self.bounds()[0],) + (0,) * (len(self.shape) - 1)

    def shard_view(self, flat: Any) -> Any:
        """This rank's real rows (no padding) as a view of the unit's flat shard."""
        lo, hi = self.bounds()
        n = (hi - lo) * self.row_size
        return flat[self.shard_offset:self.shard_offset + n].reshape(self.local_shape)

    def full_view(self, full: Any) -> Any:
        """The whole parameter as a view of a parameter-major buffer."""
        return full[self.full_offset:self.full_offset + self.numel].reshape(self.shape)

    def _split(self) -> tuple[int, int]:
        """(ranks whose chunk is complete, rows in the next rank's partial chunk)."""
        if self.chunk == 0:
            return 0, 0
        k = self.rows // self.chunk
        return k, self.rows - k * self.chunk

    def copy_out(self, gathered: Any, full: Any) -> None:
        """Rows of this parameter from the rank-major ``gathered`` (n, S) into ``full`` (1-D)."""
        if self.numel == 0:
            return
        c, rs = self.chunk, self.row_size
        src = gathered[:, self.shard_offset:self.shard_offset + self.padded].reshape(self.n, c, rs)
        dst = full[self.full_offset:self.full_offset + self.numel].reshape(self.rows, rs)
        k, rem = self._split()
        if k:
            dst[:k * c].reshape(k, c, rs)[...] = src[:k]
        if rem:
            dst[k * c:] = src[k, :rem]

    def copy_in_stack(self, stack: Any, send: Any) -> None:
        """``copy_in`` for ``m`` gradients at once: ``stack`` (m, *shape) into the rank-major
        ``send`` (m, n, S'), whose padding is already zero."""
        c, rs = self.chunk, self.row_size
        if c == 0 or rs == 0:
            return
        m = stack.shape[0]
        dst = send[:, :, self.shard_offset:self.shard_offset + self.padded].reshape(m, self.n, c, rs)
        src = stack.reshape(m, self.rows, rs)
        k, rem = self._split()
        if k:
            dst[:, :k] = src[:, :k * c].reshape(m, k, c, rs)
        if rem:
            dst[:, k, :rem] = src[:, k * c:]

    def copy_in(self, full: Any, send: Any) -> None:
        """This parameter's rows of ``full`` (1-D, parameter-major) into the rank-major ``send``
        (n, S), zeroing its padding."""
        c, rs = self.chunk, self.row_size
        if c == 0 or rs == 0:
            return
        dst = send[:, self.shard_offset:self.shard_offset + self.padded].reshape(self.n, c, rs)
        src = full[self.full_offset:self.full_offset + self.numel].reshape(self.rows, rs)
        k, rem = self._split()
        if k:
            dst[:k] = src[:k * c].reshape(k, c, rs)
        if rem:
            dst[k, :rem] = src[k * c:]
            dst[k, rem:] = 0
            k += 1
        dst[k:] = 0


def _refuse(self: FreedGrad, *args: Any, **kwargs: Any) -> Any:
    raise HpcdpError(
        f"FSDP: the gradient of {self._name!r} was moved into its shard after backward; an "
        "optimizer (or clipping) over the model's full parameters would update nothing. Build the "
        "optimizer on fsdp.parameters() and clip with fsdp.clip_grad_norm_()")


class FreedGrad:
    """What a model parameter's ``.grad`` holds after FSDP reduced it into the shards.

    Any use (arithmetic, numpy functions, indexing, attributes) raises ``HpcdpError``, so an
    optimizer built on the full parameters fails loudly at its first step instead of silently
    skipping parameters whose gradient is None.
    """

    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "_name", name)

    def __getattr__(self, attr: str) -> Any:
        _refuse(self)

    def __repr__(self) -> str:
        return f"<FreedGrad of {self._name!r}: the gradient lives in the FSDP shard>"

    __array_ufunc__ = __array_function__ = __array__ = _refuse
    __add__ = __radd__ = __iadd__ = __sub__ = __rsub__ = __isub__ = _refuse
    __mul__ = __rmul__ = __imul__ = __truediv__ = __rtruediv__ = __itruediv__ = _refuse
    __pow__ = __neg__ = __abs__ = __getitem__ = __setitem__ = __len__ = __iter__ = _refuse
    __float__ = __bool__ = _refuse

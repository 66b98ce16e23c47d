"""``Unit``: one FSDP unit's flat shard, its gathered parameters and its gradient reduction.

Life of a unit in one training step (the schedule in ``_state`` decides when)::

    start_gather()      post the all-gather of the flat shard (cast to the compute dtype)
    finish_gather()     wait, copy out, install views on the model's ``Parameter.data``
    (forward)           full_shard: reshard() after; shard_grad_op keeps the views for backward
    begin_grads()       point the model's ``.grad`` at views of a zeroed parameter-major buffer
    (backward)          the layers accumulate into those views
    reshard()           drop the gathered parameters (placeholders on ``.data``)
    launch_reduction()  copy the gradient in (rank-major, padded), post the reduction, free the buffer
    finish_reduction()  wait; this rank's piece becomes (or is added to) the shard parameters' ``.grad``

Outside those windows a model parameter's ``.data`` is an empty placeholder and its ``.grad`` is a
:class:`FreedGrad`, so nothing full-size stays behind and misuse raises. The flat buffers (receive,
gathered, unsharded gradient, send, the reduced piece) come from the FSDP's ``BufferPool``: under
shard_grad_op the next step reuses them once nothing refers to them any more (``_pool``).
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .. import trace
from ..trace.hooks import state as trace_state
from .._arrays import to_host, xp_of
from ..errors import HpcdpError
from ..nn.parameter import Parameter
from ._api import BF16, is_low_precision
from ._chunked import exact_reduction
from ..nn.chunking import ChunkCount
from ._collectives import Reduction, ShardComm, comm_dtype, decode, encode
from ._param import FreedGrad, ParamSlot
from ._pool import BufferPool
from ._wrap import UnitSpec

__all__ = ["Unit", "FREE", "PENDING", "GATHERED"]

FREE, PENDING, GATHERED = "free", "pending", "gathered"


class Unit:
    """The flat shard of one unit's parameters plus the machinery to gather and reduce it.

    Args:
        spec: module, enclosing unit and owned parameters (global names).
        index: position in pre-order (root is 0).
        comm: the shard and replicate groups.
        master_dtype: dtype of the flat shard and the shard parameters (optimizer state).
        param_dtype: dtype gathered and computed in (``"bfloat16"`` emulated), None: master's.
        reduce_dtype: dtype gradients are reduced in, None: the compute dtype.
        track: ``track(delta_bytes)`` told of every gathered buffer allocated or dropped.
        pool: where the step's flat buffers come from (shared by the units of one FSDP).
    """

    def __init__(self, spec: UnitSpec, index: int, comm: ShardComm, master_dtype: Any,
                 param_dtype: Any, reduce_dtype: Any, track: Callable[[int], None],
                 pool: BufferPool | None = None) -> None:
        self.spec, self.index, self.comm = spec, index, comm
        self.name = spec.label
        self.module = spec.module
        self.master_dtype = np.dtype(master_dtype)
        self.param_dtype = param_dtype if param_dtype is not None else self.master_dtype
        self.compute_dtype = np.dtype(np.float32) if self.param_dtype == BF16 else np.dtype(self.param_dtype)
        self.reduce_dtype = reduce_dtype if reduce_dtype is not None else self.param_dtype
        self._track = track
        self.pool = pool if pool is not None else BufferPool(keep=False)
        n, r = comm.n, comm.shard_rank
        self.slots: list[ParamSlot] = []
        s_off = f_off = 0
        for gname, p in spec.params:
            shape = tuple(int(d) for d in p.data.shape)
            if not shape:
                raise ValueError(f"FSDP: parameter {gname!r} is 0-d; dim-0 sharding needs at least one "
                                 "axis (make it shape (1,))")
            slot = ParamSlot(gname, p, shape, n, r, s_off, f_off)
            s_off += slot.padded
            f_off += slot.numel
            self.slots.append(slot)
        self.S, self.F = s_off, f_off
        self.xp = xp_of(spec.params[0][1].data) if spec.params else np
        self.flat: Any = self.xp.zeros(self.S, self.master_dtype)
        self.shard_params: list[Parameter] = []
        self.state = FREE
        self.full: Any = None          # parameter-major gathered parameters
        self._ag_work: Any = None
        self._ag_buf: Any = None
        self._ag_bytes = 0
        self._full_bytes = 0
        self._gather_dtype: Any = self.param_dtype
        self._gather_direct = False
        self.grad_full: Any = None     # parameter-major unsharded gradient (this rank's)
        self.chunks: ChunkCount | None = None   # set by FSDP(deterministic_chunk=)
        self.reduction: Reduction | None = None
        self._placeholder = self.xp.empty((0,), self.compute_dtype)
        # per-step bookkeeping, owned by the schedule
        self.fwd_count = 0
        self.bwd_count = 0
        self.bwd_done = False
        self.arrived: set[int] = set()   # slots whose gradient hook fired in this pass
        # slots given a gradient since the last reduction (all passes of a no_sync accumulation);
        # parameters without gradient hooks (foreign frameworks) count as always given one
        self.used: set[int] = {i for i, s in enumerate(self.slots) if not hasattr(s.param, "register_hook")}
        self._always_used = frozenset(self.used)

    # -- construction -------------------------------------------------------------------------
    def shard_from_model(self) -> None:
        """Copy this rank's rows of every (full, already synced) model parameter into the flat shard,
        make the shard parameters, and release the model's full arrays."""
        for slot in self.slots:
            p = slot.param
            lo, hi = slot.bounds()
            slot.shard_view(self.flat)[...] = p.data[lo:hi]
            trainable = bool(getattr(p, "requires_grad", True))
            derived = getattr(p, "derived", None)   # a torch model's: a torch tensor over the shard
            sp = (derived(slot.shard_view(self.flat), slot.name, requires_grad=trainable) if derived
                  else Parameter(slot.shard_view(self.flat), requires_grad=trainable, name=slot.name))
            self.shard_params.append(sp)
            p._hpcdp_fsdp = True   # a second FSDP over the same model would shard placeholders
            p.data = self._placeholder
            p.grad = None

    @property
    def trainable(self) -> list[int]:
        return [i for i, s in enumerate(self.slots) if getattr(s.param, "requires_grad", True)]

    # -- gathering ------------------------------------------------------------------------------
    def _direct(self, dtype: Any) -> bool:
        """Whether the gathered parameters can be views of the flat shard itself (no copy)."""
        return self.comm.n == 1 and dtype == self.master_dtype

    def start_gather(self, full_precision: bool = False, private: bool = False) -> bool:
        """Post the all-gather (True), or do nothing if the unit is gathered or gathering (False).

        Args:
            full_precision: gather in the master dtype (summon_full_params), not the compute dtype.
            private: into a buffer of its own even where views of the flat shard would do, so
                changes to the gathered parameters do not reach the shard (summon without writeback).
        """
        if self.state != FREE or not self.slots:
            return False
        travel = self.master_dtype if full_precision else self.param_dtype
        self._gather_dtype = travel
        self._gather_direct = self._direct(travel) and not private
        self.state = PENDING
        if self._gather_direct:
            return True
        send = encode(self.flat, travel)
        n = self.comm.n
        self._ag_buf = self.pool.take(self.xp, (n, self.S), comm_dtype(travel))
        self._ag_bytes = int(self._ag_buf.nbytes)
        self._track(self._ag_bytes)
        self._ag_work = self.comm.all_gather(send, self._ag_buf)
        if trace_state.on:
            trace.instant("gather posted", "fsdp", unit=self.name, bytes=self._ag_bytes)
        return True

    def poll(self) -> None:
        if self._ag_work is not None:
            self._ag_work.is_completed()

    def finish_gather(self) -> None:
        """Wait for the all-gather, copy each parameter out and install the views."""
        if self.state == GATHERED or not self.slots:
            return
        if self.state == FREE:
            self.start_gather()
        travel = self._gather_dtype
        if self._gather_direct:
            self.full = self.flat
        else:
            if self._ag_work is not None:
                with trace.span("fsdp.gather", "fsdp", unit=self.name):
                    self._ag_work.wait()
                self._ag_work = None
            gathered = decode(self._ag_buf, travel)
            dtype = np.dtype(np.float32) if travel == BF16 else np.dtype(travel)
            self.full = self.pool.take(self.xp, self.F, dtype)
            self._full_bytes = int(self.full.nbytes)
            self._track(self._full_bytes)
            if self.comm.n == 1:  # no_shard with mixed precision: a cast copy, same layout
                self.full[...] = gathered.reshape(-1)
            else:
                for slot in self.slots:
                    slot.copy_out(gathered, self.full)
            self._ag_buf = None
            self._track(-self._ag_bytes)
            self._ag_bytes = 0
        for slot in self.slots:
            slot.param.data = slot.full_view(self.full)
        self.state = GATHERED

    def reshard(self) -> None:
        """Drop the gathered parameters (``summon`` writes changes back first)."""
        if self.state == PENDING:
            self.finish_gather()  # a posted collective must complete before its buffer goes
        if self.state != GATHERED:
            return
        for slot in self.slots:
            slot.param.data = self._placeholder
        self.full = None
        self._track(-self._full_bytes)
        self._full_bytes = 0
        self.state = FREE

    def write_back(self) -> None:
        """Copy this rank's rows of the gathered (full precision) parameters into the flat shard."""
        if self.state != GATHERED or self.full is self.flat:
            return
        for slot in self.slots:
            lo, hi = slot.bounds()
            slot.shard_view(self.flat)[...] = slot.full_view(self.full)[lo:hi]

    @property
    def gathered_bytes(self) -> int:
        return self._ag_bytes + self._full_bytes

    # -- gradients ---------------------------------------------------------------------------------
    def begin_grads(self) -> None:
        """Point the model's gradients at a zeroed parameter-major buffer (kept under no_sync)."""
        if self.grad_full is None:
            self.grad_full = self.pool.zeros(self.xp, self.F, self.compute_dtype)
            fresh = True
        else:
            fresh = False
        for i in self.trainable:
            slot = self.slots[i]
            view = slot.full_view(self.grad_full)
            g = slot.param.grad
            if fresh and g is not None and not isinstance(g, FreedGrad) and g is not view:
                view += g  # a gradient accumulated outside FSDP's backward is kept
                self.used.add(i)
            slot.param.grad = view

    def drop_local_grads(self) -> None:
        """Forget the unreduced gradient (no_sync passes, an aborted backward) and its views."""
        self.grad_full = None
        self.used = set(self._always_used)
        for slot in self.slots:
            slot.param.grad = None

    def launch_reduction(self) -> None:
        """Copy the unit's gradient in, post its reduction, free the unsharded gradient.

        One "used" flag per parameter rides at the end of every rank's chunk, so the reduction
        also tells each rank which parameters got a gradient on some rank: one that none used
        keeps ``grad=None`` as in single-process training (a zero gradient would still let
        momentum and weight decay move it).
        """
        if self.reduction is not None:
            raise HpcdpError(f"FSDP unit {self.name!r} (rank {self.comm.group.rank}): a gradient reduction "
                             "was launched twice in one backward")
        if self.chunks is not None:   # deterministic_chunk: the chunks, added exactly
            staging = np.dtype(self.master_dtype)
            self.reduction = exact_reduction(self, self.chunks.total, staging)
            self.grad_full = None
            self.used = set(self._always_used)
            for i in self.trainable:
                slot = self.slots[i]
                slot.param.grad = FreedGrad(slot.name)
            return
        if self.grad_full is None:  # backward never reached the unit's hooks: keep what layers left
            self.begin_grads()
        full = self.grad_full
        predivide = is_low_precision(self.reduce_dtype) and self.comm.world > 1
        if predivide:
            full *= 1.0 / self.comm.world
        n, k = self.comm.n, len(self.slots)
        staging = np.dtype(np.float32) if self.reduce_dtype == BF16 else np.dtype(self.reduce_dtype)
        send = self.pool.take(self.xp, (n, self.S + k), staging)   # every element is written below
        if n == 1:   # no_shard: the flat shard is the whole unit, same layout
            send[0, :self.F] = full
        else:
            for slot in self.slots:
                slot.copy_in(full, send)
        flags = np.zeros(k, staging)
        flags[sorted(self.used)] = 1
        send[:, self.S:] = self.xp.asarray(flags)
        self.used = set(self._always_used)
        if self.reduce_dtype == BF16:
            send = encode(send, BF16).reshape(send.shape)
        self.grad_full = None
        for i in self.trainable:
            slot = self.slots[i]
            slot.param.grad = FreedGrad(slot.name)
        self.reduction = Reduction(self.comm, send, self.reduce_dtype, predivide, self.name, self.pool)
        if trace_state.on:
            trace.instant("reduction posted", "fsdp", unit=self.name, bytes=int(send.nbytes))

    def finish_reduction(self) -> None:
        """Wait for the reduction; add this rank's piece to (or make it) the shard gradients."""
        red, self.reduction = self.reduction, None
        if red is None:
            return
        with trace.span("fsdp.reduce_scatter", "fsdp", unit=self.name):
            res = red.wait()
        used = to_host(res[self.S:]) > 0
        # a copy (the flags and the reduction's buffer do not stay behind), divided on the way
        piece_all = self.pool.take(self.xp, self.S, self.master_dtype)
        if red.scale == 1.0:
            piece_all[...] = res[:self.S]
        elif res.dtype == piece_all.dtype:
            self.xp.multiply(res[:self.S], red.scale, out=piece_all)
        else:   # divide in the reduction's dtype, as the sum was made, then widen
            res = res[:self.S]
            res *= red.scale
            piece_all[...] = res
        res = piece_all
        for i in self.trainable:
            sp, slot = self.shard_params[i], self.slots[i]
            if not used[i]:
                continue   # no rank gave it a gradient: it keeps None (or what it had)
            piece = slot.shard_view(res)
            if sp.grad is None:
                sp.grad = piece
            else:
                sp.grad += piece

    # -- accounting ----------------------------------------------------------------------------------
    def shard_param_bytes(self) -> int:
        return int(self.flat.nbytes)

    def shard_grad_bytes(self) -> int:
        """Bytes of the gradients this rank holds for the unit (shard pieces plus any unsharded buffer)."""
        seen: set[int] = set()
        total = 0
        for sp in self.shard_params:
            g = sp.grad
            if g is None:
                continue
            base = g.base if getattr(g, "base", None) is not None else g
            if id(base) not in seen:
                seen.add(id(base))
                total += int(base.nbytes)
        if self.grad_full is not None:
            total += int(self.grad_full.nbytes)
        return total

    def padding_elements(self) -> int:
        """Elements of padding in this rank's flat shard of the unit (the rows it does not own)."""
        real = sum((hi - lo) * s.row_size for s in self.slots for lo, hi in [s.bounds()])
        return self.S - real

"""The per-step schedule: module hooks that gather, prefetch, reshard and reduce, and the event log.

Who calls what, in one training step (every rank, same order):

1. ``root(x)`` fires the root's forward pre-hook: ``begin_step`` reshards anything left gathered,
   clears the event log and the per-unit counters.
2. Each unit's forward pre-hook gathers it (waiting for a prefetched all-gather if one is in
   flight), then prefetches the next unit in the forward order recorded on the first step; its
   forward hook reshards it (full_shard; shard_grad_op keeps it for backward).
3. ``FSDP.backward`` runs ``root.run_backward``: each unit's backward pre-hook gathers it (full_shard),
   points the model's gradients at a zeroed buffer and prefetches the next unit in the backward
   order recorded on the first backward; its backward hook (after the unit's last backward of the
   step) reshards it and posts its gradient reduction, asynchronously.
4. ``finish_backward`` reduces the units whose hooks could not (gradients still missing: a weight
   gradient deferred by ``run_backward_input``, or hooks bypassed), in a fixed order, and waits
   for the reductions still in flight, first-in first-out. Each reduction also sums one "used"
   flag per parameter, so a parameter no rank gave a gradient keeps ``grad=None``.

An exception in forward (``abort_forward``) or backward (``abort_backward``) reshards every unit
and drops unreduced gradients before it propagates, so nothing full-size stays behind; a peer
still waiting in a collective gets the group's timeout.

Prefetch is bounded: with ``limit_all_gathers`` at most one unit is gathered ahead of its use
(two without), so besides the units whose forward or backward is running (the root, an
enclosing block, the one computing) at most one more holds full parameters. Reductions are
bounded too: at most ``MAX_REDUCTIONS_IN_FLIGHT`` (each holds its unit's unsharded gradient until
it completes), the oldest finished before another starts.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np

from ..errors import HpcdpError
from ._api import BF16, Event
from ..nn.torch_module import is_tensor
from ._collectives import decode, encode
from ._torch import cast_tensor
from ._unit import FREE, GATHERED, Unit

__all__ = ["Schedule", "MAX_REDUCTIONS_IN_FLIGHT"]

#: gradient reductions posted and not yet waited for; the oldest is finished before a third starts
MAX_REDUCTIONS_IN_FLIGHT = 2


class Schedule:
    """Step state shared by the hooks of every unit of one FSDP instance."""

    def __init__(self, units: list[Unit], *, reshard_after_forward: bool, prefetch: bool,
                 limit_all_gathers: bool, mixed: Any, rank: int, record_events: bool = True,
                 pool: Any = None) -> None:
        self.units = units
        self.pool = pool   # the units' BufferPool: told when a step begins
        self.reshard_after_forward = reshard_after_forward
        self.prefetch = prefetch
        self.ahead_cap = 1 if limit_all_gathers else 2
        self.mixed = mixed
        self.rank = rank
        self.record_events = record_events
        #: a torch model's unit hooks say its backward ended once its trainable parameters have
        #: their gradients: frozen ones may still be needed (the gradient flowing through them to
        #: earlier units), so a unit holding any stays gathered until the end of backward
        self.keep_frozen_gathered = False
        self.events: list[Event] = []
        self.fwd_order: list[Unit] | None = None
        self.bwd_order: list[Unit] | None = None
        self._rec_fwd: list[Unit] = []
        self._rec_bwd: list[Unit] = []
        self.stack: list[Unit] = []
        self.ahead: list[Unit] = []
        self.reductions: list[Unit] = []   # units whose reduction is in flight, FIFO
        self.deferred: list[Unit] = []     # backward ended with gradients still missing
        self.launched: set[int] = set()    # units whose reduction this backward already posted
        self.forward_pending = False
        self.in_backward = False
        self.sync = True
        self.summoned = False
        self.phase = "fwd"
        #: seconds this step spent blocked on all-gathers and on gradient reductions
        self.waits = {"all_gather": 0.0, "reduce": 0.0}
        self.where: dict[int, tuple[Unit, int]] = {}
        for u in units:
            for i, slot in enumerate(u.slots):
                self.where[id(slot.param)] = (u, i)

    # -- events -----------------------------------------------------------------------------------
    def log(self, kind: str, unit: Unit, prefetch: bool = False) -> None:
        if not self.record_events:
            return
        gathered = tuple(u.name for u in self.units if u.state != FREE and u.slots)
        self.events.append(Event(kind, unit.name, self.phase, prefetch, gathered,
                                 tuple(u.name for u in self.stack)))

    # -- progress -----------------------------------------------------------------------------------
    def poll(self) -> None:
        """Let in-flight collectives progress (MPI moves nonblocking collectives only inside calls)."""
        for u in self.ahead:
            u.poll()
        for u in self.reductions:
            if u.reduction is None or not u.reduction.poll():
                break

    # -- gathering ----------------------------------------------------------------------------------
    def _gather_now(self, unit: Unit) -> None:
        if unit in self.ahead:
            self.ahead.remove(unit)
        if unit.state == FREE and unit.slots:
            unit.start_gather()
            self.log("ag_post", unit)
        if unit.state != GATHERED and unit.slots:
            t0 = time.perf_counter()
            unit.finish_gather()
            self.waits["all_gather"] += time.perf_counter() - t0
            self.log("ag_done", unit)

    def _prefetch_after(self, unit: Unit, order: list[Unit] | None) -> None:
        if not self.prefetch or order is None or unit not in order:
            return
        pos = order.index(unit)
        for cand in order[pos + 1:]:
            if len(self.ahead) >= self.ahead_cap:
                return
            if cand.state != FREE or not cand.slots or cand in self.stack:
                continue
            cand.start_gather()
            self.ahead.append(cand)
            self.log("ag_post", cand, prefetch=True)

    def _reshard(self, unit: Unit) -> None:
        if unit.state != FREE:
            unit.reshard()
            self.log("reshard", unit)
        if unit in self.ahead:
            self.ahead.remove(unit)

    # -- forward ------------------------------------------------------------------------------------
    def begin_step(self) -> None:
        if self.in_backward:
            raise HpcdpError(f"FSDP forward (rank {self.rank}): called during backward")
        for u in self.units:
            if u.state != FREE:
                u.reshard()
            u.fwd_count = u.bwd_count = 0
            u.bwd_done = False
            u.arrived.clear()
        self.ahead.clear()
        self.stack.clear()
        self.events.clear()
        if self.pool is not None:
            self.pool.new_step()
        self.waits = {"all_gather": 0.0, "reduce": 0.0}
        self.phase = "fwd"
        self.forward_pending = False

    def pre_forward(self, unit: Unit, args: tuple) -> tuple | None:
        if self.summoned:
            return None
        if unit.index == 0:
            self.begin_step()
        self.phase = "fwd"
        self.stack.append(unit)
        unit.fwd_count += 1
        self.log("fwd_begin", unit)
        if self.fwd_order is None and unit not in self._rec_fwd:
            self._rec_fwd.append(unit)
        self._gather_now(unit)
        self._prefetch_after(unit, self.fwd_order)
        self.poll()
        if unit.index == 0 and self.mixed is not None and self.mixed.cast_forward_inputs:
            return tuple(_cast_input(a, self.mixed.param_dtype) for a in args)
        return None

    def post_forward(self, unit: Unit, training: bool) -> None:
        if self.summoned:
            return
        self.log("fwd_end", unit)
        if self.stack and self.stack[-1] is unit:
            self.stack.pop()
        if self.reshard_after_forward or not training:
            self._reshard(unit)
        if unit.index == 0:
            for u in list(self.ahead):   # prefetched for a unit that did not run after all
                self._reshard(u)
            if self.fwd_order is None:
                self.fwd_order = list(self._rec_fwd)
            self.forward_pending = True
        self.poll()

    # -- backward -----------------------------------------------------------------------------------
    def begin_backward(self, sync: bool) -> None:
        if self.summoned:
            raise HpcdpError(f"FSDP.backward (rank {self.rank}): not allowed inside summon_full_params()")
        if self.in_backward:
            raise HpcdpError(f"FSDP.backward (rank {self.rank}): called again before the previous "
                             "backward finished")
        if not self.forward_pending:
            raise HpcdpError(f"FSDP.backward (rank {self.rank}): no forward since the last backward; "
                             "run out = fsdp(x) first (a second backward would reduce stale gradients)")
        self.in_backward, self.sync, self.phase = True, sync, "bwd"
        self.deferred.clear()
        self.launched.clear()

    def pre_backward(self, unit: Unit, grad_output: tuple) -> tuple | None:
        if not self.in_backward:
            raise HpcdpError(f"FSDP (rank {self.rank}): backward of unit {unit.name!r} started outside "
                             "FSDP.backward; call fsdp.backward(grad) so gradients get reduced")
        if unit.fwd_count == 0:
            raise HpcdpError(f"FSDP (rank {self.rank}): backward reached unit {unit.name!r}, whose "
                             "forward did not run in this step")
        self.stack.append(unit)
        unit.bwd_count += 1
        self.log("bwd_begin", unit)
        if self.bwd_order is None and unit not in self._rec_bwd:
            self._rec_bwd.append(unit)
        self._gather_now(unit)
        if unit.bwd_count == 1 and unit.slots:
            unit.begin_grads()
        self._prefetch_after(unit, self.bwd_order)
        self.poll()
        if unit.index == 0 and self.mixed is not None:
            g = grad_output[0]
            if is_tensor(g):
                return (cast_tensor(g, unit.compute_dtype),)
            if hasattr(g, "dtype") and np.issubdtype(g.dtype, np.floating) and g.dtype != unit.compute_dtype:
                return (g.astype(unit.compute_dtype),)
        return None

    def on_grad(self, param: Any) -> None:
        hit = self.where.get(id(param))
        if hit is not None:
            hit[0].arrived.add(hit[1])
            hit[0].used.add(hit[1])

    def post_backward(self, unit: Unit) -> None:
        self.log("bwd_end", unit)
        for k in range(len(self.stack) - 1, -1, -1):   # the innermost entry: a torch model's unit and
            if self.stack[k] is unit:                  # its parent sharing an output start in either order
                del self.stack[k]
                break
        if unit.bwd_count < unit.fwd_count:
            return  # the module ran several times: its last backward is still to come
        unit.bwd_done = True
        if not (self.keep_frozen_gathered and len(unit.trainable) < len(unit.slots)):
            self._reshard(unit)
        if not self.sync or not unit.slots:
            return
        if all(i in unit.arrived for i in unit.trainable):
            self._launch(unit)
        else:
            self.deferred.append(unit)
        self.poll()

    def _finish_oldest(self) -> None:
        u = self.reductions.pop(0)
        t0 = time.perf_counter()
        u.finish_reduction()
        self.waits["reduce"] += time.perf_counter() - t0
        self.log("rs_done", u)

    def _launch(self, unit: Unit) -> None:
        # A reduction in flight holds its unit's whole gradient (the send buffer): with every unit's
        # in flight at once that is a full copy of the model's gradients. At most two are.
        while len(self.reductions) >= MAX_REDUCTIONS_IN_FLIGHT:
            self._finish_oldest()
        for u in self.reductions:   # hybrid: earlier reductions go on to the allreduce across replicas
            if u.reduction is not None and u.reduction.awaiting_second:
                u.reduction.advance()
        unit.launch_reduction()
        self.launched.add(unit.index)
        self.reductions.append(unit)
        self.log("rs_post", unit)

    def _drop_gathered(self) -> None:
        """Reshard every unit after an exception, keeping the caller's exception the one raised.

        A prefetched all-gather was posted by every rank at the same program point, so waiting for
        it completes (or times out with the group's timeout, which is then swallowed here: the
        original error says what went wrong).
        """
        self.stack.clear()
        self.ahead.clear()
        for u in self.units:
            if u.state != FREE:
                try:
                    u.reshard()
                except HpcdpError:
                    pass

    def abort_forward(self) -> None:
        """After an exception inside the model's forward: drop the gathered and prefetched units."""
        if self.summoned or self.in_backward:
            return   # not this schedule's forward (summon) or a misuse raised before touching state
        self.forward_pending = False
        self._drop_gathered()

    def abort_backward(self) -> None:
        """After an exception inside the model's backward: forget the step without posting anything.

        Reductions already posted are dropped unwaited (the transport reaps them), gathered
        parameters and unsharded gradients are released (the model's ``.grad`` views of them
        too, or they would keep the whole buffer alive); the next forward starts clean.
        """
        self.in_backward = self.forward_pending = False
        self.deferred.clear()
        self.reductions.clear()
        self._drop_gathered()
        for u in self.units:
            u.reduction = None
            u.drop_local_grads()
        self.phase = "fwd"

    def finish_backward(self) -> None:
        """Reduce what the hooks left, wait for every reduction, reshard everything."""
        try:
            if self.stack:
                names = [u.name for u in self.stack]
                self.stack.clear()
                raise HpcdpError(f"FSDP.backward (rank {self.rank}): units {names} started their "
                                 "backward but never finished it")
            for u in self.units:
                if u.state != FREE:
                    self._reshard(u)
            if self.sync:
                late = list(self.deferred)
                late += [u for u in self.units if u.slots and u not in late and u.index not in self.launched
                         and (u.fwd_count > 0 or u.grad_full is not None)]
                for u in late:
                    self._launch(u)
                while self.reductions:
                    self._finish_oldest()
            if self.bwd_order is None:
                self.bwd_order = list(self._rec_bwd)
        finally:
            self.in_backward = False
            self.forward_pending = False
            self.deferred.clear()
            self.phase = "fwd"


def _cast_input(a: Any, dtype: Any) -> Any:
    """A floating array (or torch tensor) input in the compute dtype (bfloat16: rounded, kept as float32)."""
    if is_tensor(a):
        return cast_tensor(a, dtype)
    if not hasattr(a, "dtype") or not hasattr(a, "astype") or not np.issubdtype(a.dtype, np.floating):
        return a
    if dtype == BF16:
        return decode(encode(a, BF16), BF16).reshape(a.shape)
    return a if a.dtype == dtype else a.astype(dtype)

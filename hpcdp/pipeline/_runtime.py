"""``Pipeline``: run a schedule's actions on this rank's stages, exchanging activations and
gradients with tagged non-blocking point-to-point, and return the step's loss on every rank.

Per step, on every rank: post the control receives, check the inputs, then execute this rank's
actions in order (receives are posted one compute action before they are needed, sends are
``isend``s waited for at the end), then the end-of-step handshake (``_channel``). The first step
also sends each stage's output shape once; later steps check against it before any compute.

Loss scaling: the last stage seeds microbatch ``k``'s backward with ``w_k * dloss_k/dout`` where
``w_k`` is its share of the full batch's loss (``1/m`` for a mean, the fraction of non-ignored
targets for a cross-entropy with ``ignore_index``, 1 for a sum), so the accumulated gradients
equal the full batch's and the returned loss is the full batch's. With data-parallel replicas the
full batch is all replicas' batches: the non-ignored targets are counted over the last stages'
``dp_group`` (whose replicas' gradients and losses are then averaged), so replicas holding
different numbers of ignored targets still give the global mean.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import nn
from .._arrays import xp_of
from ..comm.validation import check_timeout
from ..errors import CollectiveMismatchError, HpcdpError
from ..nn.torch_module import is_tensor, to_array
from ..trace import span
from ..trace.hooks import state as trace_state
from ._actions import Action, Op
from ._builtin import schedule as builtin_schedule
from ._channel import (
    ABORTED, FAILED, Channel, ControlMessage, PeerAborted, decode_meta, encode_meta, peer_failure,
)
from ._dp import DataParallelGrads
from ._schedule import Schedule
from ._stage import PipelineStage
from ._torch import as_pipeline_loss
from ._verify import Report, ScheduleError, verify

__all__ = ["Pipeline", "loss_weights"]


def loss_weights(loss_fn: Any, targets: list[Any], dp_group: Any = None) -> list[float]:
    """Each microbatch's share of the full batch's loss (see the module docstring).

    With ``dp_group`` (the last stages of every replica; collective over it when the loss ignores
    targets) the share is of all replicas' batches, times the replica count that averaging divides by.
    """
    m = len(targets)
    reduction = getattr(loss_fn, "reduction", "mean")
    if reduction == "sum":
        return [1.0] * m
    ignore = getattr(loss_fn, "ignore_index", None)
    if ignore is not None and all(np.issubdtype(np.dtype(t.dtype), np.integer) for t in targets):
        counts = [int((t != ignore).sum()) for t in targets]
        total, replicas = sum(counts), 1
        if dp_group is not None and dp_group.size > 1:
            replicas = dp_group.size
            total = int(dp_group.allreduce(np.array([total], np.int64), "sum")[0])
        if total:
            return [c * replicas / total for c in counts]
    return [1.0 / m] * m


@dataclass
class _Step:
    """What one step holds between actions; everything is gone when the step ends."""

    x: list[Any] = field(default_factory=list)
    y: list[Any] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    recvs: dict[tuple[bool, int, int], Any] = field(default_factory=dict)   # None: deferred
    outbox: dict[tuple[bool, int, int], Any] = field(default_factory=dict)
    local: dict[tuple[bool, int, int], Any] = field(default_factory=dict)   # one rank: handoffs
    seeds: dict[int, Any] = field(default_factory=dict)
    loss: float = 0.0
    peak: int = 0


class Pipeline:
    """Train a ``PipelineStage`` with a pipeline schedule.

    Args:
        stage: this rank's ``PipelineStage``.
        schedule: a built-in name ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble") or a
            ``Schedule`` (checked with ``verify`` first: an invalid one raises ``ScheduleError``).
        n_microbatches: microbatches per step; the batch size must be a multiple of it.
        loss_fn: an ``nn`` loss (``loss_fn(out, y)``, then ``loss_fn.backward(scale)``), reduction
            "mean" or "sum"; for a torch model also a torch loss (``loss_fn(output, target) -> 0-d
            tensor``, e.g. ``torch.nn.CrossEntropyLoss()``), which is wrapped in ``TorchLoss``.
        dp_group: data-parallel replicas of this stage (see ``hpcdp.pipeline.grid``): parameters
            are broadcast from its rank 0 now, gradients and the loss averaged over it every step.
        timeout: seconds any wait may take (default: the stage group's timeout).

    Collective over ``stage.group`` (it makes the pipeline's own communicator).
    """

    def __init__(self, stage: PipelineStage, *, schedule: str | Schedule = "1f1b",
                 n_microbatches: int, loss_fn: Any, dp_group: Any = None,
                 timeout: float | None = None) -> None:
        if not isinstance(stage, PipelineStage):
            raise TypeError(f"Pipeline: expected a PipelineStage, got {type(stage).__name__}")
        m = n_microbatches
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"Pipeline: n_microbatches must be a positive int, got {m!r}")
        loss_fn = as_pipeline_loss(loss_fn, stage.is_torch)
        if getattr(loss_fn, "reduction", "mean") not in ("mean", "sum"):
            raise ValueError(f"Pipeline: loss_fn reduction must be 'mean' or 'sum', got "
                             f"{loss_fn.reduction!r}")
        g = stage.group
        p = g.size
        if isinstance(schedule, str):
            sched = builtin_schedule(schedule, p, m, stage.virtual)
        elif isinstance(schedule, Schedule):
            sched = schedule
            if (sched.stages, sched.virtual, sched.microbatches) != (p, stage.virtual, m):
                raise ValueError(f"Pipeline: the schedule is for {sched.stages} ranks x {sched.virtual} "
                                 f"virtual, {sched.microbatches} microbatches; the stage has {p} x "
                                 f"{stage.virtual} and n_microbatches={m}")
        else:
            raise TypeError(f"Pipeline: schedule must be a name or a Schedule, got {type(schedule).__name__}")
        report = verify(sched)
        if not report.ok:
            raise ScheduleError(f"Pipeline: the schedule is not valid:\n{report}")
        self.stage = stage
        self.schedule = sched.with_comms()
        self.report: Report = report
        self.n_microbatches = m
        self.loss_fn = loss_fn
        self.timeout = g.timeout if timeout is None else check_timeout("Pipeline(timeout=...)", timeout)
        self._where = f"Pipeline.step (rank {g.rank} of {p}, stages {list(stage.stage_ids)})"
        comm = g.new_group(list(range(p)), name=f"{g.name}.pipeline") if p > 1 else g
        if p > 1:
            mine = hashlib.sha256(f"{self.schedule}|{stage.bounds}".encode()).hexdigest()
            seen = comm.all_gather_object(mine)
            if any(s != mine for s in seen):
                bad = [r for r, s in enumerate(seen) if s != seen[0]]
                raise CollectiveMismatchError(f"Pipeline (rank {g.rank}): ranks {bad} run a different "
                                              f"schedule or model split than rank 0")
        self._ranks = g.ranks
        self._channel = Channel(comm, stage.n_stages, m, self.timeout)
        self._actions: tuple[Action, ...] = self.schedule.actions[g.rank]
        self._last = stage.n_stages - 1
        self._broken: str | None = None
        self._in_meta: dict[int, tuple[tuple[int, ...], np.dtype]] = {}
        self._out_meta: dict[int, tuple[tuple[int, ...], np.dtype]] = {}
        self._y_meta: tuple[tuple[int, ...], np.dtype] | None = None
        self._meta_sent: set[int] = set()
        self._meta_recv: dict[int, tuple[Any, np.ndarray]] = {}
        self._doing: Action | None = None
        self._mods = {s: list(mod.modules()) for s, mod in stage.modules.items()}
        xp_param = next(iter(stage._named_params()), None)
        self._xp = xp_of(xp_param[1].data) if xp_param is not None else np
        self._dp = DataParallelGrads(stage, self._actions, dp_group) if dp_group is not None else None
        if dp_group is not None:
            stage.dp_group = dp_group   # stage.state_dict() and opt.state_dict(): replica 0 writes
        #: most microbatches whose saved activations this rank held at once in the last step
        self.peak_activations = 0

    # -- public ---------------------------------------------------------------------------------
    @property
    def predicted_peak_activations(self) -> int:
        """What ``verify`` predicts for this rank (equal to ``peak_activations`` after a step)."""
        return self.report.peak_activations[self.stage.group.rank]

    def parameters(self) -> Any:
        return self.stage.parameters()

    def state_dict(self) -> dict[str, Any]:
        """``stage.state_dict()``, with only data-parallel rank 0 writing (see ``PipelineStage``)."""
        owner = self._dp is None or self._dp.group.rank == 0
        return self.stage.state_dict(owner=owner)

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        self.stage.load_state_dict(state, strict)

    def optim_state_dict(self, optimizer: Any) -> dict[str, Any]:
        """``stage.optim_state_dict(optimizer)`` with only data-parallel rank 0 writing; collective
        over the pipeline's ranks."""
        owner = self._dp is None or self._dp.group.rank == 0
        return self.stage.optim_state_dict(optimizer, owner=owner)

    def load_optim_state_dict(self, optimizer: Any, state: dict[str, Any]) -> None:
        """``stage.load_optim_state_dict(optimizer, state)``."""
        self.stage.load_optim_state_dict(optimizer, state)

    def step(self, x: Any = None, y: Any = None) -> float:
        """Forward and backward of one batch; gradients accumulate into the stages' parameters.

        Args:
            x: the batch (read by the rank of stage 0; others may pass it or None): an array, or
                a CPU torch tensor (read through a numpy view, not copied).
            y: the targets (read by the rank of the last stage; others may pass them or None).

        Returns:
            The batch's loss (as ``loss_fn`` on the whole batch would give), on every rank.
        """
        if self._broken:
            raise HpcdpError(f"{self._where}: {self._broken}")
        x = to_array(x) if is_tensor(x) else x
        y = to_array(y) if is_tensor(y) else y
        ch = self._channel
        ch.begin_step()
        st = _Step()
        current: Action | str = "the input check"
        try:
            self._prepare(x, y, st)
            for i, current in enumerate(self._actions):
                if trace_state.on and current.is_compute:   # HPCDP_TRACE: one span per compute
                    with span(current.op.description, "pipeline", stage=current.stage, mb=current.mb):
                        self._execute(current, st)
                else:
                    self._execute(current, st)
                if self._dp is not None:
                    self._dp.after(i)
            current = "the end of the step"
            self._check_drained(st)
            ch.wait_sends()
            local_loss = st.loss if self.stage.is_last else math.nan
            loss = ch.finish(local_loss)
        except PeerAborted as exc:
            error = peer_failure(self._where, exc, self._ranks)
            self._give_up(st, ControlMessage(ABORTED, exc.root.stage, exc.root.mb, exc.root.rank,
                                             math.nan, exc.root.action, exc.root.message), error)
            raise error from None
        except BaseException as exc:
            info = self._failure_info(current, exc)
            self._give_up(st, info, exc)
            exc.add_note(f"pipeline: rank {self.stage.group.rank} {info.describe().split(': ', 1)[0]}")
            raise
        self.peak_activations = st.peak
        if self._dp is not None:
            loss = self._dp.finish(loss)
        return loss

    # -- failure ----------------------------------------------------------------------------------
    def _failure_info(self, a: Action | str, exc: BaseException) -> ControlMessage:
        rank = self.stage.group.rank
        text = f"{type(exc).__name__}: {exc}"
        if isinstance(a, str):   # outside any action: name this rank's first (or last) stage
            stage = self.stage.stage_ids[-1 if a.endswith("step") else 0]
            if a == "the input check" and self.stage.is_last and not self.stage.is_first:
                stage = self._last
            return ControlMessage(FAILED, stage, -1, rank, math.nan, a, text)
        return ControlMessage(FAILED, a.stage, a.mb, rank, math.nan, str(a), text)

    def _give_up(self, st: _Step, info: ControlMessage, error: BaseException) -> None:
        """``_fail``, keeping ``error`` the one the user gets: a failure while giving up the
        step becomes a note on it, never a replacement (its class is what callers catch)."""
        try:
            self._fail(st, info)
        except Exception as exc:  # noqa: BLE001 - reported on the error being raised
            error.add_note(f"pipeline: while giving up the step: {type(exc).__name__}: {exc}")

    def _fail(self, st: _Step, info: ControlMessage) -> None:
        """Tell every peer (once), give up this step's transfers, free its activations.

        Best effort: a peer that cannot be told (gone too) must not replace the error being raised.
        """
        ch = self._channel
        try:
            if not ch.told:
                try:
                    ch.tell_all(info)
                except HpcdpError:
                    pass
            ch.abandon([w for w in st.recvs.values() if w is not None]
                       + [w for w, _ in self._meta_recv.values()])
            ch.drain()
        finally:
            self._meta_recv.clear()
            for mod in self.stage.modules.values():
                mod.free_saved()
            free = getattr(self.loss_fn, "free_saved", None)
            if free is not None:
                free()
            self._broken = (f"an earlier step failed ({info.describe()}); messages of that step may "
                            f"still be in flight, so build a new Pipeline to continue")

    # -- inputs ---------------------------------------------------------------------------------
    def _split(self, what: str, a: Any, meta: tuple | None) -> tuple[list[Any], tuple]:
        m = self.n_microbatches
        if a is None:
            raise ValueError(f"{self._where}: this rank runs the {'first' if what == 'x' else 'last'} "
                             f"stage and needs {what}")
        if not hasattr(a, "shape") or not hasattr(a, "dtype") or a.ndim < 1:
            raise TypeError(f"{self._where}: {what} must be an array with a batch axis, got "
                            f"{type(a).__name__}")
        if a.shape[0] == 0 or a.shape[0] % m:
            raise ValueError(f"{self._where}: the batch of {what} ({a.shape[0]}) is not a positive "
                             f"multiple of n_microbatches={m}")
        b = a.shape[0] // m
        mine = ((b,) + tuple(a.shape[1:]), np.dtype(a.dtype))
        if meta is not None and mine != meta:
            raise ValueError(f"{self._where}: mismatched microbatch shape: {what} gives microbatches "
                             f"of {mine[0]} {mine[1]}, the first step had {meta[0]} {meta[1]}")
        return [a[i * b:(i + 1) * b] for i in range(m)], mine

    def _prepare(self, x: Any, y: Any, st: _Step) -> None:
        if self.stage.is_first:
            st.x, self._in_meta[0] = self._split("x", x, self._in_meta.get(0))
        if self.stage.is_last:
            st.y, self._y_meta = self._split("y", y, self._y_meta)
            if x is not None and hasattr(x, "shape") and x.shape[:1] != y.shape[:1]:
                raise ValueError(f"{self._where}: x has {x.shape[0]} samples, y {y.shape[0]}")
            st.weights = loss_weights(self.loss_fn, st.y, None if self._dp is None else self._dp.group)

    # -- actions --------------------------------------------------------------------------------
    def _execute(self, a: Action, st: _Step) -> None:
        op, s, mb = a.op, a.stage, a.mb
        self._doing = a   # what a wait inside names when its peer does not answer
        if op is Op.FORWARD:
            self._forward(st, s, mb)
        elif op is Op.BACKWARD or op is Op.BACKWARD_INPUT:
            self._backward(st, s, mb, split=op is Op.BACKWARD_INPUT)
        elif op is Op.BACKWARD_WEIGHT:
            with nn.microbatch(mb):
                self.stage.modules[s].backward_weight()
        elif op is Op.RECV_F:
            self._post(st, False, s - 1, mb)
        elif op is Op.RECV_B:
            self._post(st, True, s + 1, mb)
        elif op is Op.SEND_F:
            self._send(st, False, s, mb, s + 1)
        else:
            self._send(st, True, s, mb, s - 1)
        if a.is_compute:
            st.peak = max(st.peak, self._stashed())

    def _stashed(self) -> int:
        """Microbatches (per stage) that hold saved activations on this rank: measured in nn."""
        n = 0
        for mods in self._mods.values():
            mbs: set[int] = set()
            for mod in mods:
                fwd, wgt = mod.pending_microbatches()
                mbs.update(fwd)
                mbs.update(wgt)
            n += len(mbs)
        return n

    def _forward(self, st: _Step, s: int, mb: int) -> None:
        x = st.x[mb] if s == 0 else self._take(st, False, s - 1, mb)
        if s > 0 and s not in self._in_meta:  # one rank: the input came from this rank
            self._in_meta[s] = (tuple(x.shape), np.dtype(x.dtype))
        with nn.microbatch(mb):
            out = self.stage.modules[s](x)
        if not hasattr(out, "shape") or not hasattr(out, "dtype"):
            raise TypeError(f"stage {s} returned {type(out).__name__}; a stage must return one array")
        meta = (tuple(out.shape), np.dtype(out.dtype))
        known = self._out_meta.setdefault(s, meta)
        if meta != known:
            raise ValueError(f"stage {s} returned {meta[0]} {meta[1]} for microbatch {mb} but "
                             f"{known[0]} {known[1]} before: microbatches must keep their shape")
        if s == self._last:
            w = st.weights[mb]
            with nn.microbatch(mb):
                loss = self.loss_fn(out, st.y[mb])
                st.seeds[mb] = self.loss_fn.backward(w)
            if w:
                st.loss += float(loss) * w
        elif self.schedule.stages == 1:
            st.local[(False, s, mb)] = out
        else:
            st.outbox[(False, s, mb)] = out

    def _backward(self, st: _Step, s: int, mb: int, split: bool) -> None:
        g = st.seeds.pop(mb) if s == self._last else self._take(st, True, s + 1, mb)
        mod = self.stage.modules[s]
        with nn.microbatch(mb):
            gx = mod.run_backward_input(g) if split else mod.run_backward(g)
        if s == 0:
            return
        meta = self._in_meta[s]
        if not hasattr(gx, "shape") or (tuple(gx.shape), np.dtype(gx.dtype)) != meta:
            got = (f"{tuple(gx.shape)} {gx.dtype}" if hasattr(gx, "shape") else type(gx).__name__)
            raise ValueError(f"stage {s}'s backward returned an input gradient of {got} for "
                             f"microbatch {mb}; its input was {meta[0]} {meta[1]}")
        key = (True, s, mb)
        if self.schedule.stages == 1:
            st.local[key] = gx
        else:
            st.outbox[key] = gx

    # -- transfers ------------------------------------------------------------------------------
    def _post(self, st: _Step, grad: bool, producer: int, mb: int) -> None:
        consumer = producer - 1 if grad else producer + 1
        meta = self._out_meta.get(consumer) if grad else self._in_meta.get(consumer)
        src = self.schedule.rank_of(producer)
        ch = self._channel
        if meta is not None:
            buf = self._xp.empty(*meta)
            st.recvs[(grad, producer, mb)] = ch.comm.irecv(buf, src, ch.data_tag(grad, producer, mb))
            return
        st.recvs[(grad, producer, mb)] = None   # shape not known yet (first step): at use
        if not grad and consumer not in self._meta_recv:
            buf = np.zeros(12, np.int64)
            self._meta_recv[consumer] = (ch.comm.irecv(buf, src, ch.meta_tag(producer)), buf)

    def _take(self, st: _Step, grad: bool, producer: int, mb: int) -> Any:
        key = (grad, producer, mb)
        if self.schedule.stages == 1:
            return st.local.pop(key)
        ch = self._channel
        src = self.schedule.rank_of(producer)
        consumer = producer - 1 if grad else producer + 1
        noun = "gradient" if grad else "activation"
        a = self._doing
        doing = (f"stage {consumer}" if a is None else
                 f"stage {consumer} in action {a} ({a.op.description} of microbatch {a.mb})")
        work = st.recvs.pop(key)
        if work is None:
            if grad:
                meta = self._out_meta[consumer]
            else:
                meta = self._in_meta.get(consumer)
                if meta is None:
                    mwork, mbuf = self._meta_recv.pop(consumer)
                    ch.wait(mwork, f"{doing} waiting for the shape of its input from stage "
                                   f"{producer} (rank {src})", src)
                    meta = decode_meta(mbuf, f"stage {consumer} (shape from rank {src})")
                    self._in_meta[consumer] = meta
            buf = self._xp.empty(*meta)
            work = ch.comm.irecv(buf, src, ch.data_tag(grad, producer, mb))
        return ch.wait(work, f"{doing} waiting for the {noun} of microbatch {mb} from "
                             f"stage {producer} (rank {src})", src)

    def _send(self, st: _Step, grad: bool, producer: int, mb: int, consumer: int) -> None:
        x = st.outbox.pop((grad, producer, mb))
        dst = self.schedule.rank_of(consumer)
        ch = self._channel
        if not grad and producer not in self._meta_sent:
            ch.isend(encode_meta(x), dst, ch.meta_tag(producer))
            self._meta_sent.add(producer)
        ch.isend(x, dst, ch.data_tag(grad, producer, mb))

    def _check_drained(self, st: _Step) -> None:
        left = {k: v for k, v in (("receives", st.recvs), ("unsent outputs", st.outbox),
                                  ("local handoffs", st.local), ("loss gradients", st.seeds)) if v}
        if left:
            raise HpcdpError(f"{self._where}: the schedule left {', '.join(left)} unused: "
                             f"{ {k: sorted(v) for k, v in left.items()} }")

    def __repr__(self) -> str:
        return (f"<Pipeline {self.schedule.name} stages={self.schedule.stages} "
                f"microbatches={self.n_microbatches} virtual={self.schedule.virtual} {self.stage!r}>")

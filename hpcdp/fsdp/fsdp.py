"""``FSDP``: fully sharded data parallelism (ZeRO-3/2, DDP and hybrid) over ``hpcdp.nn`` hooks.

The training loop is DDP's: ``out = fsdp(x)``, ``fsdp.backward(loss_fn.backward())``, an optimizer
built on ``fsdp.parameters()`` (the shards), ``opt.step()``, ``opt.zero_grad()``. Construction
(collective over ``group``) checks that every rank wraps the same model, broadcasts rank 0's
parameters and buffers, picks the units, shards every parameter along its first dimension and
registers the hooks that gather, prefetch, reshard and reduce (see ``_state``). Afterwards the
model's own parameters hold an empty placeholder outside forward and backward; the shard
parameters hold this rank's rows.

A ``torch.nn.Module`` is wrapped through ``hpcdp.nn.from_torch`` (units are torch submodules,
their hooks fire from torch's) and keeps torch's loop: ``loss = loss_fn(fsdp(x), y)``,
``loss.backward()`` (the shards' gradients are reduced when it returns), ``opt.step()`` with a
``torch.optim`` optimizer over ``fsdp.parameters()`` (torch tensors over the shards). What differs
for torch lives in ``_torch``. Under full_shard, what autograd saves of a gathered parameter is
held as a marker and re-made from the parameter gathered again for backward, so the gathered
memory is freed after each unit's forward for torch layers too; shard_grad_op keeps it.
"""
from __future__ import annotations

import contextlib
import math
import os
import weakref
from typing import Any, Iterator

import numpy as np

from .._arrays import xp_of
from ..errors import CollectiveMismatchError, HpcdpError, public
from ..nn.module import Module
from ..optim.optimizer import live_optimizers
from . import _checkpoint
from ._api import STRATEGIES, Event, MixedPrecision
from ._collectives import ShardComm
from ._memory import MemoryStats, Tracker, optimizer_state_bytes
from ._pool import BufferPool
from ._state import Schedule, _cast_input
from ._torch import SavedParams, TorchPass
from ..nn.torch_module import TorchModule, from_torch, is_torch_module
from ..comm.reproducible import exact_total
from ..nn import chunking
from ..nn.chunking import ChunkCount
from ._unit import Unit
from ._wrap import plan_units
from ..comm.world import group_or_default, local_world_size

__all__ = ["FSDP"]

_BCAST_CHUNK = 64 << 20


def _local_size() -> int | None:
    """Ranks per node as the launcher tells it (``comm.world.local_world_size``), if it does."""
    return local_world_size()


def _spec(module: Any, config: tuple) -> dict[str, Any]:
    params = [(n, tuple(int(d) for d in p.data.shape), np.dtype(p.data.dtype).str,
               bool(getattr(p, "requires_grad", True))) for n, p in module.named_parameters()]
    nb = getattr(module, "named_buffers", None)
    bufs = [(n, tuple(b.shape), np.dtype(b.dtype).str) for n, b in (nb() if nb else [])]
    return {"config": config, "params": params, "buffers": bufs}


def _difference(a: dict[str, Any], b: dict[str, Any]) -> str:
    if a["config"] != b["config"]:
        keys = ("strategy", "shard_size", "mixed_precision", "prefetch", "limit_all_gathers",
                "sync_module_states", "units")
        for k, x, y in zip(keys, a["config"], b["config"]):
            if x != y:
                return f"FSDP option {k}={y!r} where rank 0 has {x!r}"
    for key in ("params", "buffers"):
        la, lb = a[key], b[key]
        for x, y in zip(la, lb):
            if x != y:
                return f"{key[:-1]} {y} where rank 0 has {x}"
        if len(la) != len(lb):
            extra = la[len(lb):] or lb[len(la):]
            return f"{len(lb)} {key} where rank 0 has {len(la)} (first unmatched: {extra[0]})"
    return "?"


def _broadcast_arrays(group: Any, arrays: list[Any]) -> None:
    """Broadcast rank 0's ``arrays`` in place, packed per dtype in chunks of at most 64 MiB."""
    by_key: dict[tuple[str, str], list[Any]] = {}
    for a in arrays:
        by_key.setdefault((xp_of(a).__name__, np.dtype(a.dtype).str), []).append(a)
    for _, group_arrays in sorted(by_key.items()):
        xp = xp_of(group_arrays[0])
        batch: list[Any] = []
        size = 0
        for a in group_arrays + [None]:
            if a is not None and (not batch or size + a.nbytes <= _BCAST_CHUNK):
                batch.append(a)
                size += a.nbytes
                continue
            flat = xp.concatenate([x.reshape(-1) for x in batch]) if batch else None
            if flat is not None and flat.size:
                group.broadcast(flat, 0)
                off = 0
                for x in batch:
                    x[...] = flat[off:off + x.size].reshape(x.shape)
                    off += x.size
            batch, size = ([a], a.nbytes) if a is not None else ([], 0)


class FSDP:
    """Shard ``module``'s parameters, gradients and optimizer state over the ranks of ``group``.

    Args:
        module: an ``hpcdp.nn.Module``, a ``torch.nn.Module`` (tensors in: ``loss.backward()``
            reduces; numpy in: ``fsdp.backward(grad)``), or any object with
            ``named_parameters()``, ``forward`` and ``backward`` (one unit gathered around its
            forward and backward).
        strategy: ``"full_shard"`` (ZeRO-3), ``"shard_grad_op"`` (ZeRO-2), ``"no_shard"`` (DDP) or
            ``"hybrid_shard"`` (full_shard inside groups of ``shard_size`` consecutive ranks).
        group: process group (default: the default group); every member wraps the same model.
        shard_size: ranks per shard group for hybrid_shard (default: ranks per node, from the launcher).
        auto_wrap: module classes, ``hpcdp.fsdp.size_based(min_params)`` or a callable
            ``module -> bool`` picking the submodules that become units of their own (for a
            torch model: torch classes such as ``{torch.nn.Linear}``, and the callable is given
            the torch submodules).
        mixed_precision: a :class:`MixedPrecision` (compute and reduction dtypes).
        prefetch: post the next unit's all-gather before the current unit computes (forward and
            backward; the order is recorded on the first step).
        limit_all_gathers: at most one unit gathered ahead of its use (two when False).
        sync_module_states: broadcast rank 0's parameters and buffers at construction.
        deterministic_chunk: ``c``: world-size-independent training (``fsdp._chunked``): one
            gradient per chunk of ``c`` samples (axis 0 of the forward's first array), all
            chunks of all ranks added exactly and divided by their number, so a global batch of
            ``B`` samples gives bit-identical shards' gradients (and, with ``clip_grad_norm_``
            and an elementwise optimizer, parameters) on any world size dividing ``B / c``.
            Gradients are reduced in the master dtype (``reduce_dtype`` does not apply).
    """

    def __init__(self, module: Any, *, strategy: str = "full_shard", group: Any = None,
                 shard_size: int | None = None, auto_wrap: Any = None,
                 mixed_precision: MixedPrecision | None = None, prefetch: bool = True,
                 limit_all_gathers: bool = True, sync_module_states: bool = True,
                 deterministic_chunk: int | None = None) -> None:
        if is_torch_module(module):
            module = from_torch(module)
        if strategy not in STRATEGIES:
            raise ValueError(f"FSDP: strategy must be one of {sorted(STRATEGIES)}, got {strategy!r}")
        if not hasattr(module, "named_parameters"):
            raise TypeError(f"FSDP needs an object with named_parameters(), got {type(module).__name__}")
        if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
            raise TypeError("FSDP: mixed_precision must be an hpcdp.fsdp.MixedPrecision, got "
                            f"{type(mixed_precision).__name__}")
        if shard_size is not None and strategy != "hybrid_shard":
            raise ValueError(f"FSDP: shard_size is for strategy='hybrid_shard', not {strategy!r}")
        if deterministic_chunk is not None and isinstance(module, TorchModule):
            raise TypeError("FSDP: deterministic_chunk needs an hpcdp.nn model (its layers compute one "
                            "gradient per chunk); torch modules are not supported")
        self.module = module
        self.strategy = strategy
        self.mixed_precision = mixed_precision
        self.group = group_or_default(group)
        if not self.group.is_member:
            raise ValueError(f"FSDP: this rank is not a member of group {self.group.name}")
        self._hooked = isinstance(module, Module)
        if not self._hooked and auto_wrap is not None:
            raise TypeError("FSDP: auto_wrap needs an hpcdp.nn.Module (units are found through "
                            f"its children), got {type(module).__name__}")
        rank = self.group.rank
        if strategy == "hybrid_shard" and shard_size is None:
            shard_size = _local_size()
            if shard_size is None or self.group.size % shard_size:
                raise ValueError(f"FSDP (rank {rank}): hybrid_shard needs shard_size (the launcher "
                                 f"does not say how many of the {self.group.size} ranks share a node)")
        taken = [n for n, p in module.named_parameters() if getattr(p, "_hpcdp_fsdp", False)]
        if taken:
            raise ValueError(f"FSDP (rank {rank}): parameters {taken[:3]} are already sharded by another "
                             "FSDP; wrap each model once")
        named = list(module.named_parameters())
        specs = plan_units(module, auto_wrap, named)
        plan = [(sp.name, [n for n, _ in sp.params]) for sp in specs]
        config = (strategy, shard_size, repr(mixed_precision), bool(prefetch), bool(limit_all_gathers),
                  bool(sync_module_states), plan)
        self._check_same_model(_spec(module, config))
        self.comm = self._make_groups(strategy, shard_size)
        bufs = list(module.named_buffers()) if hasattr(module, "named_buffers") else []
        if sync_module_states and self.group.size > 1:
            _broadcast_arrays(self.group, [p.data for _, p in named] + [b for _, b in bufs])
        self._tracker = Tracker()
        self._pool = BufferPool(keep=strategy == "shard_grad_op")   # see _pool
        self.units: list[Unit] = []
        for i, sp in enumerate(specs):
            dtypes = {np.dtype(p.data.dtype) for _, p in sp.params}
            if len(dtypes) > 1:
                raise TypeError(f"FSDP: unit {sp.label!r} mixes parameter dtypes {sorted(map(str, dtypes))}; "
                                "one flat buffer needs one dtype (wrap the parts as separate units)")
            dt = dtypes.pop() if dtypes else np.dtype(np.float32)
            master = np.dtype(np.float32) if mixed_precision is not None and dt.itemsize < 4 else dt
            unit = Unit(sp, i, self.comm, master,
                        mixed_precision.param_dtype if mixed_precision else None,
                        mixed_precision.reduce_dtype if mixed_precision else None, self._tracker,
                        self._pool)
            unit.shard_from_model()
            self.units.append(unit)
        order = {id(p): k for k, (_, p) in enumerate(named)}
        pairs = [(order[id(s.param)], s.name, sp) for u in self.units for s, sp in zip(u.slots, u.shard_params)]
        self._named_shards = [(name, sp) for _, name, sp in sorted(pairs, key=lambda t: t[0])]
        for _, sp in self._named_shards:   # opt.state_dict() on shards defers to optim_state_dict
            sp._state_owner = weakref.ref(self)
        self._sched = Schedule(self.units, reshard_after_forward=strategy in ("full_shard", "hybrid_shard"),
                               prefetch=prefetch, limit_all_gathers=limit_all_gathers,
                               mixed=mixed_precision, rank=rank, pool=self._pool)
        self._require_sync = True
        self._chunks = None if deterministic_chunk is None else ChunkCount(deterministic_chunk, "FSDP")
        for u in self.units:
            u.chunks = self._chunks
        self._handles: list[Any] = []
        self._register_hooks(named)
        self._torch_pass = TorchPass(module, self._sched, rank) if isinstance(module, TorchModule) else None
        self._sched.keep_frozen_gathered = self._torch_pass is not None
        self._saved = (SavedParams(self.units) if self._torch_pass is not None
                       and strategy in ("full_shard", "hybrid_shard") else None)

    # -- construction helpers -----------------------------------------------------------------
    def _check_same_model(self, mine: dict[str, Any]) -> None:
        specs = self.group.all_gather_object(mine)
        bad = [(r, _difference(specs[0], s)) for r, s in enumerate(specs) if s != specs[0]]
        if bad:
            detail = "; ".join(f"rank {r}: {d}" for r, d in bad)
            raise CollectiveMismatchError(
                f"FSDP construction (rank {self.group.rank} of group {self.group.name}): ranks wrap "
                f"different models or options ({detail}); every rank must build the same model")

    def _make_groups(self, strategy: str, shard_size: int | None) -> ShardComm:
        g, n = self.group, self.group.size
        if strategy in ("full_shard", "shard_grad_op"):
            return ShardComm(g, g if n > 1 else None, None)
        if strategy == "no_shard":
            return ShardComm(g, None, g if n > 1 else None)
        ss = int(shard_size)  # type: ignore[arg-type]
        if ss < 1 or n % ss:
            raise ValueError(f"FSDP (rank {g.rank}): shard_size {shard_size} must divide the group "
                             f"size {n}")
        reps = n // ss
        shard = replicate = None
        if ss > 1:
            for s in range(reps):   # every rank creates every sub-group, in the same order
                sub = g.new_group(list(range(s * ss, (s + 1) * ss)))
                if g.rank // ss == s:
                    shard = sub
        if reps > 1:
            for j in range(ss):
                sub = g.new_group([j + s * ss for s in range(reps)])
                if g.rank % ss == j:
                    replicate = sub
        return ShardComm(g, shard, replicate)

    def _register_hooks(self, named: list[tuple[str, Any]]) -> None:
        sched = self._sched
        for p in (p for _, p in named):
            if hasattr(p, "register_hook") and getattr(p, "requires_grad", True):
                self._handles.append(p.register_hook(sched.on_grad))
        if not self._hooked:
            return
        unit_of = {id(u.module): u for u in self.units}
        for m in self.module.modules():
            u = unit_of.get(id(m))
            if u is None:
                self._handles.append(m.register_forward_pre_hook(lambda mod, args: sched.poll()))
                self._handles.append(m.register_full_backward_pre_hook(lambda mod, g: sched.poll()))
                continue
            self._handles += [
                m.register_forward_pre_hook(lambda mod, args, u=u: sched.pre_forward(u, args), prepend=True),
                m.register_forward_hook(lambda mod, args, out, u=u: sched.post_forward(u, mod.training)),
                m.register_full_backward_pre_hook(lambda mod, g, u=u: sched.pre_backward(u, g), prepend=True),
                m.register_full_backward_hook(lambda mod, gi, go, u=u: sched.post_backward(u)),
            ]

    # -- the module's interface ---------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module's forward; the hooks gather each unit for it and reshard after.

        If the forward raises, every gathered or prefetched unit is resharded before the
        exception propagates, so no full parameters stay behind.
        """
        root, sched = self.units[0], self._sched
        training = bool(getattr(self.module, "training", True))
        if self._chunks is not None and training:
            self._chunks.begin_forward(args, kwargs, self.group.rank)
        if self._torch_pass is not None:
            self._torch_pass.check()
        try:
            if self._hooked:
                if self._saved is not None and training:
                    with self._saved.hooks():
                        out = self.module(*args, **kwargs)
                else:
                    out = self.module(*args, **kwargs)
                if self._torch_pass is not None and training and sched.forward_pending:
                    self._torch_pass.open(out, self._require_sync)   # tensors out: loss.backward()
                return out
            new = sched.pre_forward(root, args)
            out = self.module.forward(*(args if new is None else new), **kwargs)
            sched.post_forward(root, bool(getattr(self.module, "training", True)))
            return out
        except BaseException:
            sched.abort_forward()
            raise

    @public
    def backward(self, grad_output: Any) -> Any:
        """Run the module's backward; return its input gradient once the shard gradients are reduced.

        Raises:
            HpcdpError: no forward ran since the last backward, or a backward is already running.
        """
        sched = self._sched
        if self._torch_pass is not None:
            self._torch_pass.refuse_numpy_backward()
            if self.mixed_precision is not None:   # torch's backward needs the outputs' dtype
                grad_output = _cast_input(grad_output, self.units[0].compute_dtype)
        if self._chunks is not None and self._require_sync:
            self._chunks.agree(self.group)
        sched.begin_backward(self._require_sync)
        try:
            if self._hooked:
                out = self.module.run_backward(grad_output)
            else:
                new = sched.pre_backward(self.units[0], (grad_output,))
                out = self.module.backward(grad_output if new is None else new[0])
                sched.post_backward(self.units[0])
        except BaseException:
            sched.abort_backward()
            raise
        finally:
            if self._chunks is not None:
                chunking.set_chunk_size(None)
        sched.finish_backward()
        return out

    def parameters(self) -> Iterator[Any]:
        """Yield the shard parameters (this rank's rows), in the model's parameter order: for a
        torch model, torch tensors over the shards (what ``torch.optim`` optimizers take)."""
        return iter([p for _, p in self.named_parameters()])

    def named_parameters(self) -> Iterator[tuple[str, Any]]:
        """Yield ``(global name, shard parameter)`` pairs, in the model's parameter order."""
        if self._torch_pass is not None:
            return iter([(n, p.tensor) for n, p in self._named_shards])
        return iter(list(self._named_shards))

    def train(self, mode: bool = True) -> FSDP:
        """Set the module's training mode; return self."""
        fn = getattr(self.module, "train", None)
        if fn is not None:
            fn(mode)
        else:
            self.module.training = bool(mode)
        return self

    def eval(self) -> FSDP:
        """Set the module to evaluation mode; return self."""
        return self.train(False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the shard gradients, and any unsharded gradient kept by ``no_sync``."""
        for _, p in self._named_shards:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad[...] = 0
        for u in self.units:
            u.drop_local_grads()
        if self._chunks is not None:   # chunks kept by no_sync passes go too
            self._chunks.local = 0
            for u in self.units:
                for slot in u.slots:
                    slot.param.chunk_grads = None

    @property
    def events(self) -> list[Event]:
        """What the last step did, in order (see :class:`hpcdp.fsdp.Event`)."""
        return list(self._sched.events)

    @property
    def comm_wait(self) -> dict[str, float]:
        """Seconds the last step spent blocked on all-gathers and on gradient reductions."""
        return dict(self._sched.waits)

    @property
    def unit_names(self) -> list[str]:
        """Units in pre-order (``"<root>"`` first)."""
        return [u.name for u in self.units]

    # -- features -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside, backward keeps unsharded gradients locally; the next synced backward reduces the sum."""
        old, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = old

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Scale the shard gradients so the global norm over all ranks is at most ``max_norm``.

        Collective over the shard group. Returns the total norm before clipping (the same on
        every rank), exactly what clipping the unsharded gradients would compute.
        """
        grads = [p.grad for _, p in self._named_shards if p.grad is not None]
        inf = norm_type == math.inf
        if not inf and (self._chunks is not None or self.group.deterministic):
            # the same bits for any partition: a shard holds whole rows, so each row's sum is
            # the same whatever rank computes it; the rows' sums are then added exactly
            rows = [(np.abs(g.astype(np.float64)) ** norm_type).reshape(max(g.shape[:1] or (1,)), -1).sum(axis=1)
                    for g in grads if g.size]
            flat = np.concatenate(rows) if rows else np.zeros(0)
            total = exact_total(self.comm.shard, flat) ** (1.0 / norm_type)
            coef = float(max_norm) / (total + 1e-6)
            if coef < 1.0:
                for g in grads:
                    g *= coef
            return total
        if inf:
            local = max((float(np.abs(g).max()) if g.size else 0.0) for g in grads) if grads else 0.0
        else:
            local = sum(float((np.abs(g.astype(np.float64)) ** norm_type).sum()) for g in grads)
        if self.comm.shard is not None:
            arr = np.array([local], dtype=np.float64)
            local = float(self.comm.shard.allreduce(arr, "max" if inf else "sum")[0])
        total = local if inf else local ** (1.0 / norm_type)
        coef = float(max_norm) / (total + 1e-6)
        if coef < 1.0:
            for g in grads:
                g *= coef
        return total

    @contextlib.contextmanager
    def summon_full_params(self, writeback: bool = True) -> Iterator[None]:
        """Inside, the model's parameters hold the full values (master precision) on every rank.

        Collective over the group. The model can be called directly (evaluation, export); with
        ``writeback`` changes made to the full parameters are copied into the shards on exit.
        """
        sched = self._sched
        if sched.in_backward or sched.summoned:
            raise HpcdpError(f"FSDP.summon_full_params (rank {self.group.rank}): not inside backward "
                             "or another summon")
        for u in self.units:
            u.reshard()
        for u in self.units:
            if u.start_gather(full_precision=True, private=not writeback):
                u.finish_gather()
        sched.summoned = True
        try:
            yield
        finally:
            sched.summoned = False
            for u in self.units:
                if writeback:
                    u.write_back()
                u.reshard()

    def memory_stats(self, optimizer: Any = None, *, reset_peak: bool = False) -> MemoryStats:
        """Bytes this rank holds: shard parameters, gradients, optimizer state, peaks, and the step
        buffers shard_grad_op keeps for the next step (``buffer_cache``, idle now).

        Args:
            optimizer: the optimizer whose state to count; by default every live ``hpcdp.optim``
                optimizer built on these shards (``print(fsdp.memory_stats())`` shows them all).
            reset_peak: start a new peak window after reading this one.
        """
        shard_params = [p for _, p in self._named_shards]
        if optimizer is None:
            mine = {id(p) for p in shard_params}
            optimizers = [o for o in live_optimizers()
                          if any(id(p) in mine for g in o.param_groups for p in g["params"])]
            optimizer = _Combined(optimizers)  # none built yet: no state, 0 bytes
        stats = MemoryStats(
            rank=self.group.rank, world=self.group.size, strategy=self.strategy,
            params=sum(u.shard_param_bytes() for u in self.units),
            grads=sum(u.shard_grad_bytes() for u in self.units),
            optim_state=None if optimizer is None else optimizer_state_bytes(
                optimizer, [p for _, p in self.named_parameters()]),   # torch.optim: keyed by tensor
            gathered_peak=self._tracker.peak, gathered_now=self._tracker.now,
            padding=sum(u.padding_elements() * u.master_dtype.itemsize for u in self.units),
            full_params=sum(u.F * u.master_dtype.itemsize for u in self.units),
            buffer_cache=self._pool.idle_bytes())
        if reset_peak:
            self._tracker.reset_peak()
        return stats

    # -- checkpoints (see _checkpoint) ------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Parameters as ``checkpoint.Shard`` blocks at their global names and shapes, plus buffers."""
        return _checkpoint.state_dict(self)

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Copy this rank's rows out of ``state`` (Shards or full arrays) into the shards."""
        _checkpoint.load_state_dict(self, state, strict)

    def full_state_dict(self) -> dict[str, Any]:
        """Every parameter and buffer, whole, on rank 0 (an empty dict elsewhere). Collective."""
        return _checkpoint.full_state_dict(self)

    def optim_state_dict(self, optimizer: Any) -> dict[str, Any]:
        """``optimizer``'s state keyed by parameter name, each array a ``Shard`` of the parameter."""
        return _checkpoint.optim_state_dict(self, optimizer)

    def load_optim_state_dict(self, optimizer: Any, state: dict[str, Any]) -> None:
        """Load name-keyed optimizer state (Shards or full arrays, from any strategy or world size)."""
        _checkpoint.load_optim_state_dict(self, optimizer, state)

    # -- lifecycle ----------------------------------------------------------------------------------
    def close(self) -> None:
        """Remove every hook from the model (its parameters stay sharded placeholders) and drop the
        cached step buffers. Idempotent."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._pool.clear()

    def __repr__(self) -> str:
        units = ", ".join(f"{u.name}({len(u.slots)})" for u in self.units)
        return (f"FSDP(strategy={self.strategy}, group={self.group.name}, shard={self.comm.n}, "
                f"replicas={self.comm.m}, units=[{units}])")


class _Combined:
    """Several optimizers seen as one ``state`` mapping, for memory accounting."""

    def __init__(self, optimizers: list[Any]) -> None:
        self.state: dict[Any, Any] = {}
        for o in optimizers:
            self.state.update(o.state)


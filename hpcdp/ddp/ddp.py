"""``DDP``: data-parallel training that averages gradients in buckets while backward still runs.

Life of one synced iteration (every rank, same order)::

    ddp(x)                 training mode: points each parameter's empty ``.grad`` at its slice of a
                           bucket, [join: allreduce of ("still active", "syncs")], [broadcast buffers]
    ddp.backward(g)        module.backward fires one hook per parameter gradient; a bucket whose
                           gradients are all in is *ready*; ready buckets are launched (async
                           allreduce, or the comm hook) strictly in bucket order (over MPI
                           without a progress thread the last one, default hook, is reduced at
                           once, blocking: every gradient is in by then)
    (end of backward)      buckets not yet launched get their missing gradients treated as zero and
                           are launched; [find_unused_parameters: allreduce of the used-map];
                           wait for every bucket in order, each divided by the number of ranks as
                           its sum arrives; gradients are averaged when it returns

Design choices (see also ``hpcdp/ddp/__init__.py``):

* Buckets hold parameters in reverse registration order, by (array module, dtype); the first
  bucket is capped at 1 MiB (torch's choice) so that communication starts early, later ones at
  ``bucket_cap_mb``. Over MPI with the whole job on one node and no rank holding a progress
  thread, every bucket is capped at ``bucket_cap_mb``: there the reduction is copies by the core
  that runs backward, so starting early hides nothing and a split bucket only adds a collective
  (``_reducer._early_pays``, agreed by the ranks at construction).
* Expected hook counts are learnt on the first synced backward (a tied parameter used k times fires
  k hooks), during which buckets are launched only at the end; later iterations overlap.
* A parameter that got no gradient contributes zeros, so every rank always runs the same
  collectives and nothing can hang. With ``find_unused_parameters=False`` this also emits a
  one-time warning naming the parameters; with True a small used-map allreduce tells which
  parameters no rank used, and those get ``.grad = None`` (as torch leaves them untouched).
* Averaging divides each bucket's *sum* when its reduction completes (as a product by ``1/n``
  where that gives the quotient's very bits: ``n`` a power of two; with separate ``.grad``
  arrays that product is the copy back into them, one pass instead of two). Scaling the loss
  gradient by 1/n before backward would spare that pass, but it is right only for a backward
  that is linear in its input (not for, e.g., a penalty added inside backward), and user hooks
  would see scaled gradients. The pass is small next to a step (measured as fast either way:
  README, D4).
* Frozen parameters (``requires_grad=False``) are broadcast with the others but get no bucket.
* The gradient hooks are the reducer's (the model's parameters keep it, never the DDP, alive)
  and ``close()`` removes them, so a DDP that is dropped or closed stops touching the model's
  gradients.
* A torch model's ``loss.backward()`` ends, once its graph is known to be static (every
  parameter used, hook counts learnt), in the hook that launches the last bucket: the buckets
  count every gradient, so no per-parameter tracking of the adapter's runs alongside them.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator

import numpy as np

from .. import trace
from ..trace.hooks import pinned_line
from .._arrays import xp_of
from ..errors import HpcdpError, public
from ..nn.module import Module
from ..nn.torch_module import (TorchModule, from_torch, is_torch_module, output_tensors,
                               unfinished_backward)
from ..optim.names import by_name, load_by_name, optimizer_names, state_by_name, tag_names
from ._buckets import Bucket
from ._reducer import CommHook, Reducer
from .join import Join
from ._chunked import ChunkedGradients
from ..comm.world import group_or_default

__all__ = ["DDP"]


class DDP:
    """Wrap ``module`` so that ``backward`` averages gradients over the ranks of ``group``.

    Args:
        module: any object with ``named_parameters()`` yielding parameters that have ``.data``,
            ``.grad`` and ``register_hook(fn)`` (``hpcdp.nn.Module`` does), plus ``forward`` and
            ``backward``.
        bucket_cap_mb: size cap of each gradient bucket in MiB (the first one is capped at 1 MiB).
        group: process group (default: the default group); every member must wrap the same model.
        find_unused_parameters: allreduce a per-parameter "used" map each synced iteration so that
            parameters no rank used keep ``.grad = None``; without it they get zero gradients and
            a warning.
        broadcast_buffers: broadcast rank 0's buffers (``module.named_buffers()``) at every
            training forward (a module without buffers when wrapped has none to broadcast).
        gradient_as_bucket_view: make each ``.grad`` a view into its bucket (no copies); False
            keeps separate ``.grad`` arrays and copies in and out of the buckets.
        deterministic_chunk: ``c``: world-size-independent gradients (``ddp._chunked``): the
            layers compute one gradient per chunk of ``c`` samples (axis 0 of the forward's
            first array) and the chunks of all ranks are added exactly, so a global batch of
            ``B`` samples gives bit-identical gradients on any world size dividing ``B / c``.
            The reduction then runs after backward, not overlapped with it; comm hooks do not
            apply.

    Rank 0's parameters (frozen ones included) and buffers are broadcast at construction.
    ``close()`` detaches a DDP from its model; wrapping the model again without closing or
    dropping the old DDP leaves both reducing its gradients.
    """

    def __init__(self, module: Any, *, bucket_cap_mb: float = 25, group: Any = None,
                 find_unused_parameters: bool = False, broadcast_buffers: bool = True,
                 gradient_as_bucket_view: bool = True, deterministic_chunk: int | None = None) -> None:
        if is_torch_module(module):
            module = from_torch(module)
        if not hasattr(module, "named_parameters"):
            raise TypeError(f"DDP needs an object with named_parameters(), got {type(module).__name__}")
        if deterministic_chunk is not None and isinstance(module, TorchModule):
            raise TypeError("DDP: deterministic_chunk needs an hpcdp.nn model (its layers compute one "
                            "gradient per chunk); torch modules are not supported")
        if bucket_cap_mb <= 0:
            raise ValueError(f"DDP: bucket_cap_mb must be positive, got {bucket_cap_mb}")
        self.module = module
        self.group = group_or_default(group)
        if not self.group.is_member:
            raise ValueError(f"DDP: this rank is not a member of group {self.group.name}")
        self.find_unused_parameters = bool(find_unused_parameters)
        self.broadcast_buffers = bool(broadcast_buffers)
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        self.bucket_cap_bytes = max(1, int(bucket_cap_mb * (1 << 20)))
        every = list(module.named_parameters())
        for n, p in every:
            if not hasattr(p, "data"):
                raise TypeError(f"DDP: parameter {n!r} lacks .data")
        named = [(n, p) for n, p in every if getattr(p, "requires_grad", True)]
        for n, p in named:
            if not hasattr(p, "register_hook"):
                raise TypeError(f"DDP: parameter {n!r} lacks register_hook")
        self._named = named  # trainable: these get buckets and hooks
        self._all_named = every  # frozen ones too: broadcast with the others
        self._handles: list[Any] = []
        self._reducer: Reducer | None = None
        self._closed = False
        self._sync_module_state()
        # Buffers are those the module has when wrapped (as torch's DDP takes them): asking a
        # torch model for them walks its module tree, at every training forward otherwise.
        self._has_buffers = bool(self._buffers())
        self._reducer = Reducer(named, self.group, bucket_cap_bytes=self.bucket_cap_bytes,
                                find_unused_parameters=self.find_unused_parameters,
                                gradient_as_bucket_view=self.gradient_as_bucket_view)
        self._require_sync = True
        self._size = self.group.size
        self._is_torch = isinstance(module, TorchModule)
        # An hpcdp.nn module's __call__ fires its forward hooks; a foreign object may offer only forward.
        self._call_module = isinstance(module, Module) or getattr(module, "forward", None) is None
        self._torch_pass: bool | None = None   # a torch backward is awaited (loss.backward())
        #: that backward's end is told by the buckets (``_expect_torch_backward``), not by
        #: ``TorchModule.expect_backward``
        self._torch_fast = False
        self._solo_pass = False   # the last forward was a torch one on a group of one
        #: every trainable parameter, once a step's graph walk found them all used (see
        #: _expect_torch_backward); None: walk every step
        self._torch_every: dict[int, Any] | None = None
        self._chunks = (None if deterministic_chunk is None else
                        ChunkedGradients(deterministic_chunk, self.group, self._reducer.buckets))
        # The gradient hooks are the reducer's own (one call per gradient, nothing between): the
        # model's parameters keep the reducer, never this DDP, alive, and close() (run when the
        # DDP is dropped) removes them, so ``DDP(model)`` twice leaves only the new one attached.
        # Its end-of-pass callback reaches the DDP through a weak reference for the same reason.
        # Chunked gradients are reduced after backward: no hooks.
        ref = weakref.ref(self)

        def pass_done() -> None:
            ddp = ref()
            if ddp is not None:
                ddp._torch_backward_done(True, end=True)

        self._reducer.pass_done = pass_done
        if self._chunks is None:
            self._handles = [p.register_hook(self._reducer.on_grad) for _, p in named]
        # An optimizer built on ddp.parameters() keys its state_dict by these names (held weakly
        # through the module, which outlives this wrapper), so it loads under FSDP or a pipeline.
        try:
            tag_names(module, [p for _, p in every])
        except TypeError:   # a module that cannot be referenced weakly
            tag_names(self, [p for _, p in every])

    def close(self) -> None:
        """Detach from the model: remove the gradient hooks and stop the progress thread.

        Idempotent; also run when the DDP is garbage-collected. The module keeps its parameters
        and gradients; a closed DDP refuses ``forward`` and ``backward``.
        """
        for h in getattr(self, "_handles", ()):
            h.remove()
        self._handles = []
        reducer = getattr(self, "_reducer", None)
        if reducer is not None:
            reducer.close()
        self._closed = True

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finalizer (e.g. at interpreter exit)
            pass

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise HpcdpError(f"DDP.{what}: this DDP was closed; wrap the model again")

    def _comm_lock(self) -> Any:
        """The lock to hold while calling into the transport when a progress thread tests requests."""
        r = self._reducer
        return r.comm_lock() if r is not None else contextlib.nullcontext()

    @property
    def buckets(self) -> list[Bucket]:
        """The gradient buckets, in launch order. Without ``gradient_as_bucket_view`` a bucket's
        buffer is staging: after a synced backward it may hold the sum, whose mean (times 1/n)
        went into each ``.grad`` in the copy back; the gradients are the result."""
        return self._reducer.buckets if self._reducer is not None else []

    # -- construction-time state sync ----------------------------------------------------------
    def _buffers(self) -> list[tuple[str, Any]]:
        nb = getattr(self.module, "named_buffers", None)
        return list(nb()) if nb is not None else []

    def _sync_module_state(self, root: int = 0) -> None:
        """Broadcast root's parameters (frozen ones too) and buffers, one message per dtype."""
        arrays = [p.data for _, p in self._all_named] + [b for _, b in self._buffers()]
        self._broadcast_coalesced(arrays, root)

    def _sync_buffers(self) -> None:
        if self.broadcast_buffers and self._has_buffers and self.group.size > 1:
            bufs = [b for _, b in self._buffers()]
            if bufs:
                self._broadcast_coalesced(bufs, root=0)

    def _broadcast_coalesced(self, arrays: list[Any], root: int) -> None:
        if self.group.size == 1 or not arrays:
            return
        by_key: dict[tuple[str, str], list[Any]] = {}
        for a in arrays:
            by_key.setdefault((xp_of(a).__name__, np.dtype(a.dtype).str), []).append(a)
        for _, group_arrays in sorted(by_key.items()):
            xp = xp_of(group_arrays[0])
            flat = xp.concatenate([a.reshape(-1) for a in group_arrays])
            with self._comm_lock():
                self.group.broadcast(flat, root)
            off = 0
            for a in group_arrays:
                a[...] = flat[off:off + a.size].reshape(a.shape)
                off += a.size

    # -- the module's interface ------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module's forward (in training mode: prepare buckets, join handshake, buffers)."""
        if self._closed:
            self._check_open("forward")
        if self._torch_pass is not None:
            self._check_torch_pass()
        training = bool(getattr(self.module, "training", True))
        if training and self._size == 1 and self._solo_torch():
            out = self.module(*args, **kwargs)
            if output_tensors(out):
                # A group of one has nothing to reduce: torch's own gradients are the average, so
                # loss.backward() runs with no DDP work at all (not even the gradient hooks').
                self._solo_pass = self._reducer.muted = True
                return out
            self._solo_pass = self._reducer.muted = False   # arrays out: ddp.backward below
            if self.gradient_as_bucket_view:
                self._reducer.point_grads_at_buckets()
            return out
        if self._solo_pass:
            self._solo_pass = self._reducer.muted = False
        if training and self._chunks is not None:
            self._chunks.begin_forward(args, kwargs)
            self._sync_buffers()
        elif training:
            if self.gradient_as_bucket_view:
                self._reducer.point_grads_at_buckets()
            join = self._reducer.join
            if join is not None:  # every training forward, so joined ranks stay in step
                join.notify_active(self._require_sync)
            if self._has_buffers:
                self._sync_buffers()
        out = self.module(*args, **kwargs) if self._call_module else self.module.forward(*args, **kwargs)
        if training and self._is_torch and self._torch_pass is None:
            self._expect_torch_backward(out)
        return out

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # ``forward`` looked up on the instance: a subclass's override (or one set on the
        # object) runs, as torch's ``Module.__call__`` runs it
        return self.forward(*args, **kwargs)

    # -- the torch user's loss.backward() ---------------------------------------------------------
    def _solo_torch(self) -> bool:
        """A torch model on a group of one, nothing asked of the buckets (comm hook, join)."""
        r = self._reducer
        return (self.group.size == 1 and isinstance(self.module, TorchModule) and r.comm_hook is None
                and r.join is None and self._chunks is None)

    def _expect_torch_backward(self, out: Any) -> None:
        """Tensors out of a torch model: the user runs ``loss.backward()``; when its last parameter
        gradient has accumulated, the buckets still pending are reduced and every gradient is
        averaged before ``loss.backward()`` returns.

        The graph walk that tells which parameters this backward reaches costs tens of
        microseconds a step; once a walk found every trainable parameter used, later steps
        expect them all without walking (torch's DDP assumes as much unless told
        find_unused_parameters=True, which walks every step here too). A synced pass of such a
        static graph, hook counts learnt, needs no tracking of its own: the buckets count every
        gradient, and the hook that launches the last bucket finishes the pass
        (``Reducer.pass_done``). Otherwise ``TorchModule.expect_backward`` tells the end."""
        reducer, sync = self._reducer, self._require_sync
        reducer.begin_pass(sync)
        self._torch_pass = True
        every = self._torch_every
        static = every is not None and not self.find_unused_parameters
        if static and sync and reducer.learned and reducer.buckets:
            self._torch_fast = reducer.notify_done = True
            return
        self._torch_fast = False

        def done() -> None:
            self._torch_backward_done(sync)

        reached = self.module.expect_backward(out, done, every if static else None)
        if not reached:
            self._torch_pass = None
            reducer.in_backward = False   # nothing to differentiate (torch.no_grad, frozen model)
        elif every is None and not self.find_unused_parameters:
            trainable = {id(p): p for _, p in self._named}
            if len(reached) == len(trainable) and all(id(p) in trainable for p in reached):
                self._torch_every = trainable

    def _torch_backward_done(self, sync: bool, end: bool = False) -> None:
        """The awaited torch backward has given every parameter its gradient: the buckets are
        reduced and waited (averaged gradients), the pass closes. ``end``: the adapter's
        mirrors still waiting end first (``expect_backward`` does that itself)."""
        self._torch_pass = None
        reducer = self._reducer
        try:
            if end:
                self.module.end_backward()
            if sync:
                reducer.finish_sync_pass()
        finally:
            reducer.in_backward = False

    def _check_torch_pass(self) -> None:
        """A new forward while the previous forward's backward is awaited: a forward without
        backward is forgotten; a backward that reached only some parameters is an error (as
        torch's DDP: "Expected to have finished reduction in the prior iteration")."""
        if self._torch_pass is None:
            return
        self._torch_pass = None
        arrived, missing = self.module.cancel_expected()
        if self._torch_fast:   # the buckets were counting (never the adapter)
            self._torch_fast = False
            arrived, missing = self._reducer.abandon_pass()
        self._reducer.in_backward = False
        if arrived:
            raise unfinished_backward(f"DDP forward (rank {self.group.rank})", missing,
                                      "buckets were", static=True)

    @public
    def backward(self, grad_output: Any) -> Any:
        """Run the module's backward; return its result once all gradients are averaged."""
        self._check_open("backward")
        sync = self._require_sync
        if self._chunks is not None:
            return self._chunked_backward(grad_output, sync)
        reducer = self._reducer
        reducer.begin_pass(sync)
        phase = reducer.trace_phase  # span "backward", its "wait gradients", the buckets' marks
        with phase(sync):  # (and the pinned line: the bucket allreduces name this call's caller)
            try:
                # run_backward fires the root's backward hooks (hpcdp.nn); foreign modules offer only backward.
                run = getattr(self.module, "run_backward", None)
                out = run(grad_output) if run is not None else self.module.backward(grad_output)
            except BaseException:
                reducer.in_backward = False
                raise
            if sync:
                with phase.inner:
                    reducer.finish_sync_pass()
        reducer.in_backward = False
        return out

    def _chunked_backward(self, grad_output: Any, sync: bool) -> Any:
        """``backward`` with ``deterministic_chunk``: per-chunk gradients, added exactly after."""
        with trace.span("backward", "ddp", sync=sync, chunked=True), pinned_line():
            try:
                run = getattr(self.module, "run_backward", None)
                out = run(grad_output) if run is not None else self.module.backward(grad_output)
            finally:
                self._chunks.end_backward()
            if sync:
                with trace.span("exact gradient sum", "ddp"):
                    self._chunks.reduce()
        return out

    def parameters(self) -> Iterator[Any]:
        """Yield the module's parameters (a torch model's: its torch parameters, for ``torch.optim``)."""
        return iter([p for _, p in self.named_parameters()])

    def named_parameters(self) -> Iterator[tuple[str, Any]]:
        """Yield the module's ``(name, parameter)`` pairs."""
        if isinstance(self.module, TorchModule):
            return iter([(n, p.tensor) for n, p in self.module.named_parameters()])
        return iter(list(self.module.named_parameters()))

    def state_dict(self) -> dict[str, Any]:
        """Return the module's state dict (no ``module.`` prefix: it loads into the bare model)."""
        return self.module.state_dict()

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> Any:
        """Load into the module (same keys as the bare model's)."""
        return self.module.load_state_dict(state, strict=strict)

    def optim_state_dict(self, optimizer: Any) -> dict[str, Any]:
        """``optimizer``'s state keyed by parameter name (plain arrays), as ``FSDP.optim_state_dict``.

        Returns ``{"state": {name: {key: array | scalar}}, "param_groups": [{..., "params": [names]}]}``
        (what ``optimizer.state_dict()`` returns too), so optimizer state moves between DDP, FSDP,
        pipelines and world sizes through a checkpoint.
        """
        return state_by_name(optimizer, self._optim_names(optimizer, "DDP.optim_state_dict"))

    def load_optim_state_dict(self, optimizer: Any, state: dict[str, Any]) -> None:
        """Load optimizer state keyed by name (whole arrays, or ``checkpoint.Shard`` blocks covering
        the whole parameter, e.g. from ``FSDP.optim_state_dict`` via a checkpoint) or by index (in
        the optimizer's parameter order, as older checkpoints hold it) into ``optimizer``."""
        names = self._optim_names(optimizer, "DDP.load_optim_state_dict")
        where = f"DDP.load_optim_state_dict (rank {self.group.rank})"
        order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
        load_by_name(where, optimizer, names, by_name(where, state, order))

    def _optim_names(self, optimizer: Any, where: str) -> dict[int, str]:
        return optimizer_names(f"{where} (rank {self.group.rank})", self.module.named_parameters(),
                               optimizer, "ddp.parameters()")

    def train(self, mode: bool = True) -> DDP:
        """Set the module's training mode; return self."""
        self.module.train(mode)
        return self

    def eval(self) -> DDP:
        """Set the module to evaluation mode; return self."""
        return self.train(False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients (None by default; zeros in place keeps bucket views), and with
        ``deterministic_chunk`` the chunk gradients that ``no_sync`` passes kept."""
        for _, p in self._named:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad[...] = 0
            if self._chunks is not None:
                p.chunk_grads = None
        if self._chunks is not None:
            self._chunks.count.local = 0

    # -- features ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside, backward accumulates gradients locally; the next synced backward averages the sum."""
        old, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = old

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Use ``hook(state, bucket) -> future`` to reduce each bucket (see ``hpcdp.ddp.comm_hooks``)."""
        if not callable(hook):
            raise TypeError(f"register_comm_hook: hook must be callable, got {type(hook).__name__}")
        r = self._reducer
        if r.comm_hook is not None:
            raise HpcdpError(f"register_comm_hook (rank {self.group.rank}): a communication hook "
                             "is already registered")
        r.comm_state, r.comm_hook = state, hook

    def join(self, *, divide_by_initial_world_size: bool = True, enable: bool = True) -> Any:
        """Context manager for uneven inputs: ranks that finish early shadow the others' allreduces.

        Args:
            divide_by_initial_world_size: divide summed gradients by the group size (torch's
                default: joined ranks count as zero contributions); False divides by the number
                of ranks still training in that iteration.
            enable: False makes it a no-op context.
        """
        return Join(self, divide_by_initial_world_size=divide_by_initial_world_size, enable=enable)

    def __repr__(self) -> str:
        sizes = ", ".join(f"{b.nbytes / (1 << 20):.2f}" for b in self.buckets)
        return (f"DDP(group={self.group.name}, ranks={self.group.size}, buckets=[{sizes}] MiB, "
                f"find_unused_parameters={self.find_unused_parameters})\n  {self.module!r}")

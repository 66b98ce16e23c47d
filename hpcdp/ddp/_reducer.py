"""The gradient reducer behind ``DDP``: buckets, the per-gradient hook, launches and waits.

``DDP`` (``ddp.py``) is the user-facing facade: module interface, options, state sync at
construction, ``no_sync``/``join``/``register_comm_hook``. This module owns one synced backward
(see the iteration protocol in ``ddp.py``): ``point_grads_at_buckets`` before forward,
``begin_pass``, ``on_grad`` per gradient hook, ``finish_sync_pass``; ``shadow_sync_pass`` is a
joined rank's zero-gradient stand-in for it.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings
from typing import Any, Callable

import numpy as np

from .. import trace
from ..trace.hooks import Phase
from ..trace.hooks import state as trace_state
from .._config import setting
from ..errors import HpcdpError
from ..comm.world import get_default_group, is_initialized, local_world_size
from ..nn.torch_module import TorchParameter
from ._buckets import Bucket, build_buckets
from .comm_hooks import GradBucket, HookFuture, _average

__all__ = ["Reducer", "CommHook", "use_progress_thread"]

CommHook = Callable[[Any, GradBucket], Any]


class _Progress:
    """A daemon thread that tests in-flight bucket reductions while backward computes.

    MPI advances nonblocking collectives only inside MPI calls, and numpy's matmuls (which release
    the GIL) give no such calls, so without this a bucket launched early would mostly move only
    when backward ends. The thread tests the oldest in-flight bucket at a short interval; ``lock``
    keeps it and the training thread from touching the same request at once.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cond = threading.Condition()
        self.queue: list[Any] = []
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name="hpcdp-ddp-progress", daemon=True)
        self.thread.start()

    def add(self, work: Any) -> None:
        with self.cond:
            self.queue.append(work)
            self.cond.notify()

    def clear(self) -> None:
        with self.cond:
            self.queue.clear()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.queue.clear()
            self.cond.notify()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=5.0)

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.queue and not self.stopped:
                    self.cond.wait()
                if self.stopped:
                    return
                work = self.queue[0]
            with self.lock:
                done = work.is_completed()
            with self.cond:
                if done and self.queue and self.queue[0] is work:
                    self.queue.pop(0)
            if not done:
                time.sleep(5e-5)


def use_progress_thread(group: Any) -> bool:
    """A progress thread for ``group``: a transport that needs one to overlap
    (``Backend.needs_progress_thread``: MPI), more than one rank, a spare core (or the override),
    and a transport that several threads may call at once (``thread_level == "multiple"``)."""
    backend = group.backend
    if not backend.needs_progress_thread or group.size <= 1 or not _want_progress_thread():
        return False
    return backend.thread_level == "multiple"


def _want_progress_thread() -> bool:
    """A progress thread pays only with a spare core: on a rank bound to one core it competes
    with backward for that core and the GIL (measured: D4 efficiency 0.76 with it, 0.80 without,
    2 ranks bound to cores). ``HPCDP_DDP_PROGRESS_THREAD=0/1`` overrides (1 still needs
    MPI_THREAD_MULTIPLE)."""
    forced = setting("HPCDP_DDP_PROGRESS_THREAD")
    if forced is not None:
        return forced
    try:
        return len(os.sched_getaffinity(0)) > 1
    except (AttributeError, OSError):
        return (os.cpu_count() or 1) > 1


def _one_node() -> bool:
    """Whether the launcher says every process of the job (the default group) runs on this node."""
    local = local_world_size()
    return local is not None and is_initialized() and local == get_default_group().size


def _early_pays(group: Any, progress: bool, device: bool) -> bool:
    """Whether a small first bucket (torch's 1 MiB, so that communication starts early) can
    overlap anything. Not over a transport that moves data only inside its calls (MPI) when the
    whole job shares one node, no rank has a progress thread and the gradients are in host
    memory: the reduction is then copies by the very core that runs backward, so starting early
    hides nothing, and the extra collective of a split bucket costs (D5 in the README's
    benchmark table). Device gradients (``device``) move by DMA, which does overlap.
    Collective (the ranks must build the same buckets): a max over the group of what each rank
    sees."""
    if group.size <= 1 or not getattr(group.backend, "needs_progress_thread", False):
        return True
    flags = np.array([int(progress), int(not _one_node()), int(device)], dtype=np.int32)
    return bool(group.allreduce(flags, "max").any())


class Reducer:
    """Averages the gradients of ``named`` (trainable parameters) over ``group`` in buckets.

    Args:
        named: ``(name, parameter)`` pairs in registration order; buckets take them reversed.
        bucket_cap_bytes: cap of every bucket after the first (1 MiB, unless ``_early_pays``
            says a small first bucket cannot overlap anything).
        find_unused_parameters, gradient_as_bucket_view: as ``DDP``'s options.
    """

    def __init__(self, named: list[tuple[str, Any]], group: Any, *, bucket_cap_bytes: int,
                 find_unused_parameters: bool, gradient_as_bucket_view: bool) -> None:
        self.named = named
        self.group = group
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.progress: _Progress | None = _Progress() if use_progress_thread(group) else None
        #: every bucket capped alike, no small first one (see ``_early_pays``)
        self.one_cap = not _early_pays(group, self.progress is not None,
                                       any(not isinstance(p.data, np.ndarray) for _, p in named))
        self.buckets: list[Bucket] = (build_buckets(named, bucket_cap_bytes,
                                                    bucket_cap_bytes if self.one_cap else None)
                                      if named else [])
        index = {id(p): k for k, (_, p) in enumerate(named)}
        #: per parameter (by id): its bucket, its slot there, its registration index
        self._where: dict[int, tuple[Bucket, int, int]] = {}
        for b in self.buckets:
            for i, p in enumerate(b.params):
                self._where[id(p)] = (b, i, index[id(p)])
            if all(isinstance(p, TorchParameter) for p in b.params):
                b.tensors = [p.tensor for p in b.params]
        self._expected: list[list[int]] | None = None  # per bucket, per slot: hooks per pass
        self._pending: list[int] | None = None  # per bucket: slots that expect hooks
        #: per parameter (registration order): a gradient arrived since the last synced pass
        #: (a bytearray: set once per gradient hook, cheaper than a numpy element)
        self._used = bytearray(len(named))
        self._unused = bytes(len(named))
        #: gradient hooks do nothing (DDP's torch pass on a group of one, which has nothing to reduce)
        self.muted = False
        #: called once the last bucket of a synced pass has been launched from a gradient hook,
        #: where ``notify_done`` is set for that pass (DDP's torch backward with a static graph:
        #: every gradient is in, so the backward's reductions can be finished there)
        self.pass_done: Callable[[], None] | None = None
        self.notify_done = False
        self.in_backward = False
        self._pass_sync = False
        self._next_launch = 0
        self._inflight: list[Bucket] = []
        self.divisor = group.size
        self.comm_hook: CommHook | None = None
        self.comm_state: Any = None
        self.warned_unused = False
        self.join: Any = None  # the active join context, if any
        #: DDP's backward on the timeline (``HPCDP_TRACE``): a "backward" span, its "wait
        #: gradients" and a "bucket ready" mark per launched bucket, recorded as one entry
        self.trace_phase = Phase("backward", "ddp", args=("sync",), inner="wait gradients",
                                 mark="bucket ready", mark_args=("bucket", "bytes", "in_flight"))
        #: the default reduction leaves the mean's 1/n to the copy back into the gradients (one
        #: pass over the bucket, not two) where the gradients are not the bucket's own views
        self._scale_on_copy = not gradient_as_bucket_view
        #: the last bucket (default reduction) is reduced at once, blocking, where an async one
        #: would not advance anyway until waited on: a transport that moves data only inside its
        #: calls (MPI) and no progress thread. By then every gradient is in, so nothing is left
        #: to overlap with but a backward's input gradients, which run on this core either way;
        #: the blocking call skips the async request's bookkeeping. (Blocking or not, the call
        #: matches its peers' alike: ranks may choose differently.)
        self.block_last = (self.progress is None and group.size > 1
                           and bool(getattr(group.backend, "needs_progress_thread", False)))

    def comm_lock(self) -> Any:
        """The lock to hold while calling into the transport when a progress thread tests requests."""
        return self.progress.lock if self.progress is not None else contextlib.nullcontext()

    def close(self) -> None:
        """Stop the progress thread (idempotent)."""
        progress, self.progress = self.progress, None
        if progress is not None:
            progress.stop()

    @property
    def learned(self) -> bool:
        """Whether the hook counts of a synced pass are known (after the first one)."""
        return self._expected is not None

    def point_grads_at_buckets(self) -> None:
        """Make every ``.grad`` its bucket view (a gradient already there is copied in, a
        missing one is zeros), so backward accumulates straight into the buckets."""
        for b in self.buckets:
            _own_views(b, zero_all_missing=True)

    def begin_pass(self, sync: bool) -> None:
        self.notify_done = False
        if self.in_backward:
            raise HpcdpError(f"DDP.backward (rank {self.group.rank}): called again before the "
                             "previous backward finished")
        self.in_backward = True
        self._pass_sync = sync
        if not sync:
            return
        self._next_launch = 0
        self._inflight = []
        pending = self._pending
        for bi, b in enumerate(self.buckets):
            b.seen = [0] * len(b.params)
            b.launched = False
            b.work = None
            b.pending = len(b.params) if pending is None else pending[bi]

    def on_grad(self, p: Any) -> None:
        """A gradient hook: ``p``'s gradient has accumulated (its bucket may be ready)."""
        # (Per-gradient work is kept to counting: that the gradients are still the bucket's
        # views is checked once per bucket, when it is launched.)
        if self.muted:
            return
        b, i, k = self._where[id(p)]
        self._used[k] = 1
        if not (self.in_backward and self._pass_sync):
            return
        if b.launched:
            raise HpcdpError(
                f"DDP (rank {self.group.rank}): parameter {b.names[i]!r} produced a gradient after its "
                f"bucket {b.index} was already being reduced: it fired more gradient hooks in this "
                f"backward than in the first one (a shared parameter used a varying number of times?)"
            )
        seen = b.seen
        seen[i] += 1
        expected = b.expected
        if expected is None:
            return  # first synced pass: counting hooks, buckets launch at the end
        if seen[i] == expected[i]:
            b.pending -= 1
            if b.pending == 0:
                self._launch_ready()
                if self.notify_done and self._next_launch == len(self.buckets):
                    self.notify_done = False
                    self.pass_done()   # every bucket launched: the pass's end, at once
                    return
        if self._inflight and self.progress is None:
            self._poll()

    def abandon_pass(self) -> tuple[int, list[str]]:
        """Forget a synced pass whose end never came (``notify_done`` still set): how many
        parameters got their gradients in it, and the names of those that did not."""
        self.notify_done = False
        self.in_backward = False
        arrived, missing = 0, []
        for b in self.buckets:
            for name, s in zip(b.names, b.seen):
                if s:
                    arrived += 1
                else:
                    missing.append(name)
        return arrived, missing

    def _poll(self) -> None:
        # MPI progresses nonblocking collectives only inside MPI calls: test the oldest one.
        head = self._inflight[0]
        if head.work is not None and head.work.is_completed():
            self._inflight.pop(0)

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets):
            b = self.buckets[self._next_launch]
            if b.pending > 0:
                return
            self._launch(b)

    def _launch(self, b: Bucket, own: bool = True) -> None:
        """Start ``b``'s reduction. ``own``: its gradients are this pass's (not a joined rank's
        shadow zeros); with ``gradient_as_bucket_view`` one replaced since forward (say, by a
        ``zero_grad`` between forward and backward) is copied into the bucket first."""
        if self.gradient_as_bucket_view:
            if own:
                _own_views(b)
        else:
            for p, v in zip(b.params, b.views):
                if p.grad is None:
                    v.fill(0)
                else:
                    v[...] = p.grad
        b.launched = True
        self._next_launch = b.index + 1
        if trace_state.on:  # (buckets in flight as an arg: a counter track costs 2 events a step)
            self.trace_phase.mark(b.index, b.nbytes, len(self._inflight) + 1)
        last = b.index == len(self.buckets) - 1
        hook = self.comm_hook
        if hook is None:   # allreduce_hook's reduction, without a GradBucket to build
            if self.progress is not None:
                with self.progress.lock:
                    b.work = _average(self.group, b.flat, self.divisor)
                self.progress.add(b.work)
            else:
                b.work = _average(self.group, b.flat, self.divisor, not (last and self.block_last),
                                  self._scale_on_copy and type(b.flat) is np.ndarray)
        else:
            gb = GradBucket(b.index, b.flat, b.params, b.views, self.group, self.divisor, last)
            if self.progress is not None:
                with self.progress.lock:
                    b.work = hook(self.comm_state, gb)
                self.progress.add(b.work)
            else:
                b.work = hook(self.comm_state, gb)
        self._inflight.append(b)

    def finish_sync_pass(self) -> None:
        if self._expected is None:
            self._expected = [[max(1, s) for s in b.seen] for b in self.buckets]
            self._pending = [sum(1 for e in exp if e > 0) for exp in self._expected]
            for b, exp in zip(self.buckets, self._expected):
                b.expected = exp
        missing: list[str] = []
        for b in self.buckets[self._next_launch:]:
            for i, p in enumerate(b.params):
                if b.seen[i] == 0 and p.grad is None:
                    missing.append(b.names[i])
                    b.views[i].fill(0)
                    if self.gradient_as_bucket_view:
                        p.grad = b.views[i]
                elif b.seen[i] == 0 and not self._used[self._where[id(p)][2]]:
                    missing.append(b.names[i])  # e.g. zeros set up by forward, never written
            self._launch(b)
        used = None
        if self.find_unused_parameters:
            with self.comm_lock():
                used = self.group.allreduce(np.frombuffer(self._used, np.uint8).astype(np.int32),
                                            "sum", async_op=True)
        self._wait_all()
        if used is not None:
            with self.comm_lock():
                counts = used.wait()
            for k, (_, p) in enumerate(self.named):
                if counts[k] == 0:
                    p.grad = None
        elif missing and not self.warned_unused:
            self.warned_unused = True
            warnings.warn(
                f"DDP (rank {self.group.rank}): parameters {missing} got no gradient in this backward; "
                "they were averaged as zeros so every rank stays in step. Pass "
                "find_unused_parameters=True to detect unused parameters across ranks and leave "
                "their .grad as None.", stacklevel=4)
        self._used[:] = self._unused
        if self.join is not None:
            self.join.after_sync_pass()
        # one synced backward: the straggler report's step (collective every N); its mark is
        # recorded with the backward's phase (``trace.step()`` otherwise)
        self.trace_phase.step()

    def _wait_all(self) -> None:
        for b in self.buckets:
            if self.progress is not None:
                with self.progress.lock:
                    res = b.work.wait()
            else:
                res = b.work.wait()
            if res is not None and res is not b.flat:
                b.flat[...] = res.reshape(-1)
            # (only the default reduction's own future: a user hook's may have a ``scale`` of its own)
            s = b.work.scale if type(b.work) is HookFuture else None
            b.work = None
            if s is not None:  # the mean's 1/n, in the copy back (``_average``'s scale_later)
                for p, v in zip(b.params, b.views):
                    if p.grad is None:
                        p.grad = v * s
                    else:
                        np.multiply(v, s, out=p.grad)
            elif not self.gradient_as_bucket_view:
                for p, v in zip(b.params, b.views):
                    if p.grad is None:
                        p.grad = v.copy()
                    else:
                        p.grad[...] = v
        self._inflight = []
        if self.progress is not None:
            self.progress.clear()

    def shadow_sync_pass(self) -> None:
        for b in self.buckets:
            b.flat.fill(0)
            b.launched = False
        self._next_launch = 0
        self._inflight = []
        if not self.gradient_as_bucket_view:
            saved = [p.grad for _, p in self.named]
            for _, p in self.named:
                p.grad = None
        for b in self.buckets:
            self._launch(b, own=False)
        used = None
        if self.find_unused_parameters:
            with self.comm_lock():
                used = self.group.allreduce(np.zeros(len(self._used), np.int32), "sum", async_op=True)
        self._wait_all()
        if used is not None:
            with self.comm_lock():
                used.wait()
        if not self.gradient_as_bucket_view:
            for (_, p), g in zip(self.named, saved):
                p.grad = g
        trace.step()  # mirrors the active ranks' steps, so a straggler report stays collective


def _own_views(b: Bucket, zero_all_missing: bool = False) -> None:
    """Make each ``.grad`` of bucket ``b`` its view: a gradient that is another array is copied
    in, a missing one is zeros (the whole buffer at once when every one is missing and
    ``zero_all_missing``). Torch parameters whose gradient tensors are those last pointed here
    are the views still: one identity test each, no property read."""
    tensors, pointed = b.tensors, b.pointed
    if pointed is not None:
        for t, g in zip(tensors, pointed):
            if t.grad is not g:
                break
        else:
            return
    ps, vs = b.params, b.views
    grads = [p.grad for p in ps]
    if zero_all_missing and all(g is None for g in grads):
        b.flat.fill(0)
        for p, v in zip(ps, vs):
            p.grad = v
    else:
        for p, v, g in zip(ps, vs, grads):
            if g is v:
                continue
            if g is None:
                v.fill(0)
            else:
                v[...] = g
            p.grad = v
    if tensors is not None:
        b.pointed = [t.grad for t in tensors]

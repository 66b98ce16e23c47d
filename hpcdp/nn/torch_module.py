"""``from_torch``: a ``torch.nn.Module`` presented through hpcdp.nn's module protocol.

DDP, FSDP and pipeline stages talk to a model through a small protocol (``named_parameters``
whose items have ``.data``, ``.grad`` and gradient hooks, ``forward``/``backward`` per
microbatch, module hooks). :class:`TorchModule` speaks that protocol for a torch model, with torch
autograd doing the differentiation, so every layer above serves torch models without a second
implementation:

* **Parameters** are :class:`TorchParameter` objects whose ``.data`` and ``.grad`` are numpy views
  of the torch tensors (no copies: a write through either side is seen by the other), and whose
  setters install numpy arrays as the tensors' storage (``torch.from_numpy``). That is how FSDP's
  gathered views and DDP's bucket views become what torch computes with and accumulates into.
  Gradient-ready hooks come from torch's ``register_post_accumulate_grad_hook``.
* **Two ways to call it.** Given numpy (or cupy) arrays, ``forward`` runs the torch module on
  tensors sharing their memory and returns numpy; ``backward(grad)`` runs torch autograd for the
  current microbatch (``nn.microbatch``) and returns the input gradient: the protocol pipelines and
  ``ddp.backward(g)`` use. Given torch tensors, it returns torch tensors and the user calls
  ``loss.backward()``: the torch user's loop. Either way the same torch graph and hooks run.
* **Module hooks** registered on a mirror module (the adapter mirrors the torch module tree, so
  FSDP can make any torch submodule a unit) fire from torch's own hooks: forward pre/post from
  ``register_forward_pre_hook``/``register_forward_hook``; backward pre when the first gradient of
  the module's outputs is computed (``torch.autograd.graph.register_multi_grad_hook``); backward
  post once every trainable parameter below the module has accumulated its gradient (its weight
  work is done), or when the backward pass ends for a module whose parameters got none. Torch's
  full backward hooks are not used: they wrap outputs in a function that makes in-place
  activations (``ReLU(inplace=True)``) fail.
* **The end of a torch backward** is what DDP and FSDP wait for to finish their reductions before
  ``loss.backward()`` returns. Torch's public API has no "backward finished" callback, so
  :meth:`TorchModule.expect_backward` walks the autograd graph of a forward's outputs once
  (``grad_fn.next_functions``) to learn which parameters this backward will reach, and calls back
  when the last of them has accumulated: nothing of the parameters' gradients is left to compute.

Only torch's public API is used. Tested with torch 2.13 (CPU build).
"""
from __future__ import annotations

import os
import sys
import weakref
from typing import Any, Callable, Iterator

import numpy as np

from .._arrays import is_cupy
from ..errors import HpcdpError
from ..trace.hooks import hide_package
from .hooks import _as_args
from .microbatch import enter_call, exit_call
from .module import Module
from .parameter import Parameter

__all__ = ["from_torch", "TorchModule", "TorchParameter", "is_torch_module", "is_tensor", "to_tensor",
           "to_array", "output_tensors", "reachable_parameters", "unfinished_backward"]


def _torch() -> Any:
    import torch  # only reached with a torch object in hand: torch is imported already

    return torch


def is_torch_module(obj: Any) -> bool:
    """Tell whether ``obj`` is a ``torch.nn.Module`` (without importing torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.nn.Module)


def is_tensor(obj: Any) -> bool:
    """Tell whether ``obj`` is a ``torch.Tensor`` (without importing torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def to_array(t: Any) -> Any:
    """The numpy (CPU) or cupy (CUDA) view of tensor ``t``'s memory; never a copy."""
    if t.device.type == "cpu":
        return t.detach().numpy()
    import cupy

    return cupy.from_dlpack(t.detach())


def to_tensor(a: Any) -> Any:
    """A torch tensor sharing ``a``'s memory (numpy or cupy); a read-only numpy array is copied."""
    torch = _torch()
    if is_cupy(a):
        return torch.from_dlpack(a)
    if isinstance(a, np.ndarray) and not a.flags.writeable:
        a = a.copy()
    return torch.from_numpy(np.asarray(a))


_NUMPY_LACKS = ("bfloat16", "float8", "complex32", "qint", "quint", "uint1", "int1", "bits")


def _check_dtype(what: str, t: Any) -> None:
    name = str(t.dtype).replace("torch.", "")
    if any(name.startswith(p) for p in _NUMPY_LACKS):
        raise TypeError(
            f"from_torch: {what} has dtype torch.{name}, which numpy lacks, so hpcdp cannot view it "
            "without a copy; keep the module in float32/float64 (for bfloat16 compute use FSDP's "
            "MixedPrecision(param_dtype='bfloat16'), which keeps float32 masters)")


class TorchParameter(Parameter):
    """An hpcdp :class:`~hpcdp.nn.Parameter` presenting a ``torch.nn.Parameter``.

    ``.data``/``.grad`` read as numpy views of the tensor and its gradient; assigning an array
    makes torch use that array's memory (``tensor.data = torch.from_numpy(a)``, ``tensor.grad =
    ...``). An object that is not an array (FSDP's freed-gradient marker) is kept beside the
    tensor, whose ``.grad`` is then None. ``.tensor`` is the torch parameter, what a torch
    optimizer is given.
    """

    def __init__(self, tensor: Any, name: str | None = None) -> None:
        _check_dtype(f"parameter {name!r}", tensor)
        object.__setattr__(self, "tensor", tensor)
        self._view_key: tuple | None = None
        self._view: Any = None
        self._grad_key: Any = None
        self._grad_view: Any = None
        self._grad_other: Any = None
        self._arrival: Callable[[TorchParameter], None] | None = None
        #: the adapter's list of mirrors awaiting gradients (``_arrival`` is called only while
        #: it is not empty: most backward passes have nothing waiting on single parameters)
        self._watchers: list[Any] = []
        super().__init__(self.data, name, requires_grad=bool(tensor.requires_grad))
        self._ready = True
        self._torch_hook = tensor.register_post_accumulate_grad_hook(self._on_accumulated) \
            if tensor.requires_grad else None

    # .data ---------------------------------------------------------------------------------
    @property  # type: ignore[override]
    def data(self) -> Any:
        t = self.tensor
        key = (t.data_ptr(), t.shape, t.dtype)
        if key != self._view_key:
            self._view, self._view_key = to_array(t), key
        return self._view

    @data.setter
    def data(self, value: Any) -> None:
        if isinstance(value, Parameter):
            value = value.data
        t = self.tensor
        if self.__dict__.get("_view") is value:
            return
        if is_tensor(value):
            t.data = value
        else:
            t.data = to_tensor(value)
            self._view, self._view_key = value, (t.data_ptr(), t.shape, t.dtype)

    # .grad ---------------------------------------------------------------------------------
    @property  # type: ignore[override]
    def grad(self) -> Any:
        g = self.tensor.grad
        if g is None:
            return self._grad_other
        if g is not self._grad_key:
            self._grad_view, self._grad_key = to_array(g), g
        return self._grad_view

    @grad.setter
    def grad(self, value: Any) -> None:
        if "_ready" not in self.__dict__:
            return   # Parameter.__init__ clearing .grad: a torch gradient already there stays
        t = self.tensor
        self._grad_other = None
        if value is None:
            t.grad = None
        elif is_tensor(value):
            t.grad = value
        elif isinstance(value, np.ndarray) or is_cupy(value):   # no hasattr: FSDP's FreedGrad raises
            if value is self._grad_view and self._grad_key is not None:
                # the array this parameter's gradient was before (DDP re-pointing a cleared
                # .grad at its bucket view every step): its tensor again, none made anew
                if t.grad is not self._grad_key:
                    t.grad = self._grad_key
                return
            g = to_tensor(value)
            t.grad = g
            self._grad_view, self._grad_key = value, g
        else:
            t.grad = None
            self._grad_other = value

    @property  # type: ignore[override]
    def requires_grad(self) -> bool:
        return bool(self.tensor.requires_grad)

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        if "tensor" in self.__dict__ and bool(value) != bool(self.tensor.requires_grad):
            self.tensor.requires_grad_(bool(value))
            if value and self.__dict__.get("_torch_hook") is None:
                self._torch_hook = self.tensor.register_post_accumulate_grad_hook(self._on_accumulated)

    # gradients -----------------------------------------------------------------------------
    def _on_accumulated(self, _tensor: Any) -> None:
        """torch's gradient-ready hook: fire hpcdp's hooks, then tell the adapter it arrived."""
        hooks = self._hooks
        if hooks:
            for hook in list(hooks.values()):
                hook(self)
        if self._watchers:
            self._arrival(self)

    def accumulate_grad(self, g: Any) -> None:
        """Add ``g`` into the torch gradient and fire the hooks (torch autograd does this itself)."""
        if not self.requires_grad:
            return
        if tuple(g.shape) != self.shape:
            raise ValueError(f"Parameter {self.name!r}: gradient shape {tuple(g.shape)} does not "
                             f"match parameter shape {self.shape}")
        if self.grad is None or not hasattr(self.grad, "shape"):
            self.grad = g.astype(self.data.dtype, copy=True)
        else:
            self.grad += g
        self._on_accumulated(self.tensor)

    def derived(self, array: Any, name: str | None = None, *, requires_grad: bool = True) -> TorchParameter:
        """A new torch-backed parameter over ``array``'s memory (FSDP's shards: what a torch
        optimizer is given in place of the model's parameters)."""
        torch = _torch()
        return TorchParameter(torch.nn.Parameter(to_tensor(array), requires_grad=requires_grad), name)

    def __repr__(self) -> str:
        frozen = "" if self.requires_grad else ", requires_grad=False"
        name = f"{self.name!r}, " if self.name else ""
        return f"TorchParameter({name}shape={self.shape}, dtype={self.dtype}{frozen})"


def output_tensors(value: Any) -> list[Any]:
    """The tensors inside a forward's output (a tensor, or tuples/lists/dicts of them)."""
    if is_tensor(value):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in output_tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in output_tensors(v)]
    return []


def _map(value: Any, fn: Callable[[Any], Any], kind: Callable[[Any], bool]) -> Any:
    if kind(value):
        return fn(value)
    if isinstance(value, tuple):
        return tuple(_map(v, fn, kind) for v in value)
    if isinstance(value, list):
        return [_map(v, fn, kind) for v in value]
    if isinstance(value, dict):
        return {k: _map(v, fn, kind) for k, v in value.items()}
    return value


def _is_array(x: Any) -> bool:
    return isinstance(x, np.ndarray) or is_cupy(x)


def _any_array(values: Any) -> bool:
    """Whether any of ``values`` is a numpy or cupy array (asked at every forward: one pass, cupy
    looked up once)."""
    cp = sys.modules.get("cupy")   # (cupy_or_none, inlined)
    for a in values:
        if isinstance(a, np.ndarray) or (cp is not None and isinstance(a, cp.ndarray)):
            return True
    return False


def reachable_parameters(outputs: list[Any]) -> list[Any]:
    """The leaf tensors requiring grad that a backward from ``outputs`` reaches (graph walk).

    Runs at every training forward of a torch model under DDP/FSDP, so it is written for speed:
    a node's kind is told by its type's name (asking a non-leaf node for ``.variable`` raises and
    catches an AttributeError inside torch, the dearest step of a naive walk), and nodes are
    marked seen when pushed, so each is visited once."""
    found = [t for t in outputs if t.grad_fn is None and t.requires_grad]
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    seen = {id(f) for f in stack}
    push, mark = stack.append, seen.add
    while stack:
        fn = stack.pop()
        if type(fn).__name__ == "AccumulateGrad":
            found.append(fn.variable)   # the leaf it accumulates into
            continue
        for f, _ in fn.next_functions:
            if f is not None and id(f) not in seen:
                mark(id(f))
                push(f)
    return found


def unfinished_backward(where: str, missing: list[str], reduced: str, static: bool = False) -> HpcdpError:
    """The error of a forward that finds the previous torch backward half done: some parameters
    got their gradients, ``missing`` did not, so what ``reduced`` them never ran (DDP's
    buckets, FSDP's units). ``static``: the caller assumed the graph of an earlier step."""
    more = (", or a model that uses other parameters on other steps (pass "
            "find_unused_parameters=True)") if static else ""
    return HpcdpError(
        f"{where}: the previous backward gave gradients to some parameters but not to "
        f"{missing[:8]}{' ...' if len(missing) > 8 else ''}, so their {reduced} never reduced: "
        f"a loss that used only part of the outputs (make it use every output), an exception "
        f"inside backward{more}. That step is forgotten; the next one starts clean.")


class _Backward:
    """One torch backward pass being waited for: parameters still to arrive, then callbacks."""

    def __init__(self, waiting: dict[int, Any], done: Callable[[], None]) -> None:
        self.waiting = waiting
        self.arrived = 0
        self.done = done


class TorchModule(Module):
    """A torch module (and, as children, each of its submodules) in hpcdp.nn's protocol.

    Args:
        module: the ``torch.nn.Module``; its parameters and buffers stay torch's (views, not copies).
        split_backward: ``backward_input`` computes only the input gradient
            (``torch.autograd.grad``, keeping the graph) and ``backward_weight`` the parameters'
            (a second backward over the kept graph, restricted to them): zero-bubble pipeline
            schedules then defer weight work, at the price of a second graph traversal. Default:
            ``backward_input`` does both and ``backward_weight`` has nothing left.

    Use :func:`from_torch` to make one (it returns the same adapter for the same module).
    """

    def __init__(self, module: Any, *, split_backward: bool = False, _root: TorchModule | None = None,
                 _params: dict[int, TorchParameter] | None = None) -> None:
        super().__init__()
        object.__setattr__(self, "torch", module)
        object.__setattr__(self, "split_backward", bool(split_backward))
        object.__setattr__(self, "_root", self if _root is None else weakref.proxy(_root))
        object.__setattr__(self, "_torch_handles", {})
        object.__setattr__(self, "_pending_posts", [])
        object.__setattr__(self, "_passes", [])
        object.__setattr__(self, "_watching", [])   # root: mirrors with passes awaiting parameters
        object.__setattr__(self, "training", bool(module.training))
        params = {} if _params is None else _params
        object.__setattr__(self, "_wrappers", params)
        for name, t in module.named_parameters(recurse=False):
            w = params.get(id(t))
            if w is None:
                # one wrapper per tensor for its life (its torch hook keeps it alive), so that
                # adapters made again for the same model do not stack gradient hooks
                ref = getattr(t, "_hpcdp_param", None)
                w = ref() if ref is not None else None
                if w is None or w.tensor is not t:   # (a deepcopy carries the weak reference)
                    w = TorchParameter(t, name)
                    t._hpcdp_param = weakref.ref(w)
                params[id(t)] = w
                w._arrival = self._root_arrival
                w._watchers = self._root._watching
            self._parameters[name] = w
        for name, child in module.named_children():
            self._modules[name] = TorchModule(child, split_backward=split_backward,
                                              _root=self if _root is None else _root, _params=params)
        persistent = {k for k in module.state_dict(keep_vars=True) if "." not in k}
        for name, b in module.named_buffers(recurse=False):
            _check_dtype(f"buffer {name!r}", b)
            if name not in persistent:
                self.__dict__.setdefault("_non_persistent", set()).add(name)
            self._buffers[name] = None   # the live view is read from torch on every access

    # -- protocol: registration mirrors torch's -----------------------------------------------
    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"TorchModule: set attributes on the torch module (adapter.torch.{name} = ...)")

    def _root_arrival(self, p: TorchParameter) -> None:
        try:
            watching = self._root._watching
        except ReferenceError:   # a dropped adapter (say, from_torch(m).state_dict()): nothing waits
            return
        for m in list(watching):
            m._arrived(p)

    def _watch(self, bw: _Backward) -> None:
        self._passes.append(bw)
        watching = self._root._watching
        if self not in watching:
            watching.append(self)

    def named_buffers(self, prefix: str = "", recurse: bool = True) -> Iterator[tuple[str, Any]]:
        """Yield ``(dotted_name, array)``: numpy views of the torch buffers, read now."""
        for name, b in self.torch.named_buffers(prefix=prefix, recurse=recurse):
            yield name, to_array(b)

    def _persistent_buffers(self, prefix: str = "") -> Iterator[tuple[str, Any]]:
        for mod_name, mod in self.named_modules(prefix):
            skip = mod.__dict__.get("_non_persistent", ())
            for name, b in mod.torch.named_buffers(recurse=False):
                if name not in skip:
                    yield (f"{mod_name}.{name}" if mod_name else name), to_array(b)

    def train(self, mode: bool = True) -> TorchModule:
        """Set training mode here, on every mirror below and on the torch module."""
        self.torch.train(bool(mode))
        for m in self.modules():
            object.__setattr__(m, "training", bool(mode))
        return self

    # -- calls -----------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # The mirror's hooks fire from torch's hooks (installed as they are registered), so the
        # torch call below runs them at the same points for this module and every mirror below.
        enter_call()
        try:
            return self.forward(*args, **kwargs)
        finally:
            exit_call()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the torch module. Tensors in: tensors out (torch autograd for backward). Arrays in:
        arrays out, with the graph kept for :meth:`backward` under the current microbatch."""
        if not _any_array(args) and not (kwargs and _any_array(kwargs.values())):
            return self.torch(*args, **kwargs)
        torch = _torch()
        grad = self.training and torch.is_grad_enabled()

        def tensor_in(a: Any) -> Any:
            t = to_tensor(a)
            if grad and t.is_floating_point():
                t.requires_grad_(True)
            return t

        targs = tuple(_map(a, tensor_in, _is_array) for a in args)
        tkwargs = {k: _map(v, tensor_in, _is_array) for k, v in kwargs.items()}
        with torch.set_grad_enabled(grad):
            out = self.torch(*targs, **tkwargs)
        if grad:
            self.save_for_backward(targs, out)
        return _map(out, to_array, is_tensor)

    def _run(self, grad_output: Any, inputs: list[Any] | None) -> tuple[Any, Any]:
        torch = _torch()
        targs, out = self.saved_tensors()
        outs = [t for t in output_tensors(out) if t.requires_grad]
        grads = [to_tensor(g) if _is_array(g) else g for g in _as_args(grad_output)]
        if len(grads) != len(outs):
            raise ValueError(f"TorchModule.backward: {len(grads)} gradients for {len(outs)} outputs "
                             "that require grad")
        grads = [g.reshape(t.shape) if g.shape != t.shape and g.numel() == t.numel() else g
                 for g, t in zip(grads, outs)]
        xs = [t for a in targs for t in output_tensors(a) if t.requires_grad]
        if inputs is not None:   # split: input gradients now, weights later over the kept graph
            gx = torch.autograd.grad(outs, xs, grads, retain_graph=True, allow_unused=True) if xs else ()
            self.save_for_weight(outs, grads)
            got = {id(x): g for x, g in zip(xs, gx)}
        else:
            torch.autograd.backward(outs, grads)
            got = {id(x): x.grad for x in xs}
            self.end_backward()
        grad_in = tuple(_map(a, lambda t: None if got.get(id(t)) is None else to_array(got[id(t)]),
                             is_tensor) if output_tensors(a) else None for a in targs)
        return (grad_in[0] if len(grad_in) == 1 else grad_in), None

    def backward(self, grad_output: Any) -> Any:
        """Run torch autograd from this microbatch's outputs; return the input gradient (numpy)."""
        return self._run(grad_output, None)[0]

    def backward_input(self, grad_output: Any) -> Any:
        """The input gradient; the parameters' too unless ``split_backward``."""
        return self._run(grad_output, [] if self.split_backward else None)[0]

    def backward_weight(self) -> None:
        """With ``split_backward``: the parameters' gradients over the graph kept by
        ``backward_input`` (their hooks fire); otherwise nothing is left to do."""
        if not self.split_backward:
            return
        torch = _torch()
        outs, grads = self.saved_for_weight()
        params = [p.tensor for p in self.parameters() if p.requires_grad]
        if params:
            torch.autograd.backward(outs, grads, inputs=params)
        self.end_backward()

    def run_backward(self, grad_output: Any) -> Any:
        return self.backward(grad_output)   # module hooks fire from torch's hooks

    def run_backward_input(self, grad_output: Any) -> Any:
        return self.backward_input(grad_output)

    def _needs_weight_grad(self) -> bool:
        return any(p.requires_grad for p in self.parameters())

    # -- module hooks through torch's ------------------------------------------------------------
    def _register(self, kind: str, fn: Callable[..., Any], prepend: bool) -> Any:
        handle = super()._register(kind, fn, prepend)
        self._install(kind)
        return handle

    def _install(self, kind: str) -> None:
        h = self._torch_handles
        ref = weakref.ref(self)
        if kind == "_forward_pre_hooks" and kind not in h:
            def pre(_m: Any, args: tuple) -> Any:
                me = ref()
                if me is None:
                    return None
                for fn in list(me._hooks("_forward_pre_hooks").values()):
                    res = fn(me, args)
                    if res is not None:
                        args = _as_args(res)
                return args
            h[kind] = self.torch.register_forward_pre_hook(pre)
        if kind in ("_forward_hooks", "_backward_pre_hooks", "_backward_hooks") and "post" not in h:
            def post(_m: Any, args: tuple, out: Any) -> Any:
                me = ref()
                return None if me is None else me._after_forward(args, out)
            h["post"] = self.torch.register_forward_hook(post)

    def _after_forward(self, args: tuple, out: Any) -> Any:
        for fn in list(self._hooks("_forward_hooks").values()):
            res = fn(self, args, out)
            if res is not None:
                out = res
        if self._hooks("_backward_pre_hooks") or self._hooks("_backward_hooks"):
            torch = _torch()
            outs = [t for t in output_tensors(out) if t.requires_grad]
            if outs and torch.is_grad_enabled():
                ref = weakref.ref(self)

                def started(_grads: Any) -> None:
                    me = ref()
                    if me is not None:
                        me._backward_started()
                torch.autograd.graph.register_multi_grad_hook(outs, started, mode="any")
        return out

    def _subtree_trainable(self) -> dict[int, Any]:
        return {id(p): p for p in self.parameters() if p.requires_grad}

    def _backward_started(self) -> None:
        for fn in list(self._hooks("_backward_pre_hooks").values()):
            fn(self, (None,))
        if not self._hooks("_backward_hooks"):
            return
        waiting = self._subtree_trainable()
        self._root._pending_posts.append(self)
        if not waiting:
            self._backward_finished()
            return
        self._watch(_Backward(waiting, self._backward_finished))

    def _backward_finished(self) -> None:
        root = self._root
        if self in root._pending_posts:
            root._pending_posts.remove(self)
        for fn in list(self._hooks("_backward_hooks").values()):
            fn(self, (None,), (None,))

    def _arrived(self, p: Any) -> None:
        for bw in list(self._passes):
            if bw not in self._passes:
                continue   # ended by an earlier pass's callback (its end_backward) in this loop
            if bw.waiting.pop(id(p), None) is not None:
                bw.arrived += 1
                if not bw.waiting:
                    self._passes.remove(bw)
                    if not self._passes and self in self._root._watching:
                        self._root._watching.remove(self)
                    bw.done()

    def end_backward(self) -> None:
        """A backward over this adapter's graph returned (or a caller that tracks the gradients
        itself, DDP's buckets, knows it is over): mirrors whose parameters got no gradient run
        their backward hooks now, so none is left half way."""
        root = self._root
        for m in list(root._pending_posts):
            m._passes.clear()
            if m in root._watching:
                root._watching.remove(m)
            m._backward_finished()

    # -- the end of a torch backward (the torch user's loss.backward()) --------------------------
    def expect_backward(self, output: Any, done: Callable[[], None],
                        expected: dict[int, Any] | None = None) -> list[Any]:
        """Call ``done()`` when a backward from ``output`` has given every parameter it reaches its
        gradient (before ``loss.backward()`` returns). Returns those parameters (may be empty:
        then ``done`` is not called).

        ``expected`` (``{id(param): param}``) names them instead of a walk of the graph: the walk
        creates a Python object for every autograd node of the step (tens of microseconds on a
        small model), which a caller that knows the graph is static can spare."""
        if expected is not None:
            waiting = dict(expected)
        else:
            leaves = reachable_parameters(output_tensors(output))
            key = tuple(map(id, leaves))
            cached = self.__dict__.get("_reach_cache")
            if cached is not None and cached[0] == key:   # the same graph as last step: its template
                waiting = cached[1].copy()
            else:
                wrappers = self._wrappers
                waiting = {id(w): w for w in (wrappers.get(id(t)) for t in leaves) if w is not None}
                self.__dict__["_reach_cache"] = (key, dict(waiting))
        if not waiting:
            return []

        def finish() -> None:
            self.end_backward()
            done()
        self._watch(_Backward(waiting, finish))
        return list(waiting.values())

    def cancel_expected(self) -> tuple[int, list[str]]:
        """Forget backward passes still awaited; returns (parameters that had arrived, names of those
        that had not) summed over them."""
        arrived, missing = 0, []
        names = {id(p): n for n, p in self.named_parameters()}
        for bw in self._passes:
            arrived += bw.arrived
            missing += [names.get(k, "?") for k in bw.waiting]
        self._passes.clear()
        # a backward that raised half way leaves mirrors waiting for their parameters and their
        # backward hooks unfired: forget them too, so the next backward starts clean
        root = self._root
        for m in list(root._watching):
            m._passes.clear()
        root._watching.clear()
        root._pending_posts.clear()
        return arrived, missing

    def extra_repr(self) -> str:
        return type(self.torch).__name__

    def __repr__(self) -> str:
        return f"TorchModule({self.torch!r})"


def from_torch(module: Any, *, split_backward: bool = False) -> TorchModule:
    """Present ``module`` (a ``torch.nn.Module``) as an hpcdp.nn module (see :class:`TorchModule`).

    The same torch module gives the same adapter (DDP and FSDP wrap it through here too), so its
    parameters get one set of gradient hooks.
    """
    if isinstance(module, TorchModule):
        return module
    if not is_torch_module(module):
        raise TypeError(f"from_torch needs a torch.nn.Module, got {type(module).__name__}")
    # collectives started from torch's autograd engine record the user's loss.backward() line
    hide_package(os.path.dirname(sys.modules["torch"].__file__))
    cached = getattr(module, "_hpcdp_adapter", None)
    adapter = cached() if cached is not None else None
    if adapter is None or adapter.torch is not module or adapter.split_backward != bool(split_backward):
        adapter = TorchModule(module, split_backward=split_backward)
        object.__setattr__(module, "_hpcdp_adapter", weakref.ref(adapter))
    return adapter

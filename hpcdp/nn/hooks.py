"""Per-module forward and backward hooks with torch's names, arguments and call order.

Who calls what (the contract FSDP and pipeline stages rely on):

1. ``module(*args)`` (``Module.__call__``) runs the forward pre-hooks ``fn(module, args)`` (each may
   return replacement args, a tuple or a single value), then ``forward``, then the forward hooks
   ``fn(module, args, output)`` (each may return a replacement output).
2. ``module.run_backward(grad_output)`` runs the full backward pre-hooks ``fn(module, grad_output)``
   (``grad_output`` is a 1-tuple; each may return a replacement), then ``backward``, then the full
   backward hooks ``fn(module, grad_input, grad_output)`` (``grad_input`` a 1-tuple, ``(None,)`` when
   the input has no gradient, e.g. indices; each may return a replacement ``grad_input``).
   ``run_backward_input`` does the same around ``backward_input`` (the hooks fire when the input
   gradient is ready; ``backward_weight`` fires only the parameters' gradient hooks).
3. Containers call ``run_backward``/``run_backward_input`` for their children and ``module(...)``
   in forward; wrappers (DDP, FSDP, pipeline stages) call them for the root. So hooks nest like
   torch's: outer pre, inner pre, ..., inner post, outer post, in forward and in backward.

Hooks run in registration order (``prepend=True`` puts one first); each ``register_*`` returns a
:class:`RemovableHandle`.
"""
from __future__ import annotations

from typing import Any, Callable

from .microbatch import enter_call, exit_call
from .parameter import RemovableHandle

__all__ = ["HooksMixin"]

_HOOK_KINDS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def _as_args(value: Any) -> tuple[Any, ...]:
    return value if isinstance(value, tuple) else (value,)


def _single(value: Any, what: str, module: Any) -> Any:
    """Unwrap a hook's 1-tuple (or bare array) replacement gradient."""
    if isinstance(value, (tuple, list)):
        if len(value) != 1:
            raise ValueError(f"{type(module).__name__}: {what} hook returned {len(value)} gradients, expected 1")
        return value[0]
    return value


class HooksMixin:
    """Hook registration and the hook-firing entry points of :class:`~hpcdp.nn.Module`."""

    def _hooks(self, kind: str) -> dict[int, Callable[..., Any]]:
        d = self.__dict__.get(kind)
        if d is None:
            d = {}
            object.__setattr__(self, kind, d)
        return d

    def _register(self, kind: str, fn: Callable[..., Any], prepend: bool) -> RemovableHandle:
        if not callable(fn):
            raise TypeError(f"{type(self).__name__}: hook must be callable, got {type(fn).__name__}")
        hooks = self._hooks(kind)
        handle = RemovableHandle(hooks)
        if prepend:
            rest = list(hooks.items())
            hooks.clear()
            hooks[handle.id] = fn
            hooks.update(rest)
        else:
            hooks[handle.id] = fn
        return handle

    def register_forward_pre_hook(self, fn: Callable[..., Any], *, prepend: bool = False) -> RemovableHandle:
        """Call ``fn(module, args)`` before ``forward``; a non-None return replaces ``args``."""
        return self._register("_forward_pre_hooks", fn, prepend)

    def register_forward_hook(self, fn: Callable[..., Any], *, prepend: bool = False) -> RemovableHandle:
        """Call ``fn(module, args, output)`` after ``forward``; a non-None return replaces ``output``."""
        return self._register("_forward_hooks", fn, prepend)

    def register_full_backward_pre_hook(self, fn: Callable[..., Any], *,
                                        prepend: bool = False) -> RemovableHandle:
        """Call ``fn(module, grad_output)`` before backward; a non-None return replaces ``grad_output``."""
        return self._register("_backward_pre_hooks", fn, prepend)

    def register_full_backward_hook(self, fn: Callable[..., Any], *, prepend: bool = False) -> RemovableHandle:
        """Call ``fn(module, grad_input, grad_output)`` once the input gradient is ready.

        A non-None return replaces ``grad_input`` (what the module passes on to earlier layers).
        """
        return self._register("_backward_hooks", fn, prepend)

    def _has_hooks(self) -> bool:
        d = self.__dict__
        return any(d.get(k) for k in _HOOK_KINDS)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        enter_call()   # the outermost call is one forward pass (see hpcdp.nn.microbatch)
        try:
            pre = self.__dict__.get("_forward_pre_hooks")
            if pre:
                for fn in list(pre.values()):
                    res = fn(self, args)
                    if res is not None:
                        args = _as_args(res)
            out = self.forward(*args, **kwargs)  # type: ignore[attr-defined]
            post = self.__dict__.get("_forward_hooks")
            if post:
                for fn in list(post.values()):
                    res = fn(self, args, out)
                    if res is not None:
                        out = res
            return out
        finally:
            exit_call()

    def _with_backward_hooks(self, step: Callable[[Any], Any], grad_output: Any) -> Any:
        pre = self.__dict__.get("_backward_pre_hooks")
        if pre:
            for fn in list(pre.values()):
                res = fn(self, (grad_output,))
                if res is not None:
                    grad_output = _single(res, "full backward pre", self)
        grad_input = step(grad_output)
        post = self.__dict__.get("_backward_hooks")
        if post:
            for fn in list(post.values()):
                res = fn(self, (grad_input,), (grad_output,))
                if res is not None:
                    grad_input = _single(res, "full backward", self)
        return grad_input

    def run_backward(self, grad_output: Any) -> Any:
        """Run ``backward(grad_output)`` between this module's backward hooks; return the input gradient.

        This is how a backward is started on a module: containers call it for their children and
        wrappers (DDP, FSDP, pipeline stages) for the root, so every module's hooks fire.
        """
        return self._with_backward_hooks(self.backward, grad_output)  # type: ignore[attr-defined]

    def run_backward_input(self, grad_output: Any) -> Any:
        """Run ``backward_input(grad_output)`` between this module's backward hooks.

        The weight part follows with ``backward_weight()`` (under the same microbatch), which fires
        the parameters' gradient hooks but no module hooks.
        """
        return self._with_backward_hooks(self.backward_input, grad_output)  # type: ignore[attr-defined]

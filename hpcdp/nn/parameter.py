"""Parameter: an array with a gradient slot and hooks that fire when its gradient is ready."""
from __future__ import annotations

import itertools
from typing import Any, Callable

from .backend import is_float_dtype, xp_of
from .chunking import chunk_size

__all__ = ["Parameter", "RemovableHandle", "GradHook"]

GradHook = Callable[["Parameter"], None]
_handle_ids = itertools.count()


class RemovableHandle:
    """Handle returned by ``register_hook``; ``remove()`` unregisters the hook (idempotent)."""

    __slots__ = ("_hooks", "id")

    def __init__(self, hooks: dict[int, Any]) -> None:
        self._hooks = hooks
        self.id = next(_handle_ids)

    def remove(self) -> None:
        """Unregister the hook; calling it twice is harmless."""
        self._hooks.pop(self.id, None)

    def __enter__(self) -> RemovableHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


class Parameter:
    """A trainable array (numpy or cupy) plus its gradient and gradient-ready hooks.

    Hook contract (what DDP relies on to overlap communication with backward):

    * Layers call :meth:`accumulate_grad` exactly once per parameter per backward pass, at the moment
      their backward has computed that parameter's gradient and before they return. With a split
      backward that moment is ``backward_weight`` (once per microbatch), not ``backward_input``.
    * ``accumulate_grad`` first adds the gradient into ``.grad`` (allocating it on first use, in
      place afterwards, so a ``.grad`` that is a view into a larger buffer stays that view) and then
      calls every hook ``fn(param)`` in registration order. When a hook runs, ``param.grad`` holds the
      complete gradient of this pass (plus whatever was accumulated before, e.g. under ``no_sync``).
    * A parameter shared by k layers (tied weights) gets k ``accumulate_grad`` calls per backward,
      hence k hook calls; only the last one sees the complete gradient. Hook users that support
      tied weights must count calls per pass.
    * Frozen parameters (``requires_grad=False``) get no gradient and fire no hooks.

    Parameters hash by identity (no ``__eq__``), so they can key optimizer state.
    """

    def __init__(self, data: Any, name: str | None = None, *, requires_grad: bool = True) -> None:
        if isinstance(data, Parameter):
            data = data.data
        if not hasattr(data, "shape") or not hasattr(data, "dtype"):
            raise TypeError(f"Parameter data must be a numpy or cupy array, got {type(data).__name__}")
        if requires_grad and not is_float_dtype(data.dtype):
            raise TypeError(f"Parameter {name!r}: a trainable parameter needs a floating dtype, got {data.dtype}")
        self.data = data
        self.grad: Any = None
        self.name = name
        self.requires_grad = bool(requires_grad)
        self._hooks: dict[int, GradHook] = {}
        #: per-chunk gradient stacks ``(k, *shape)`` of chunked backward passes (``nn.chunking``),
        #: waiting for DDP or FSDP to add them exactly; None outside chunked training
        self.chunk_grads: list[Any] | None = None

    # -- array facts -------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def dtype(self) -> Any:
        return self.data.dtype

    @property
    def size(self) -> int:
        return int(self.data.size)

    @property
    def ndim(self) -> int:
        return int(self.data.ndim)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    # -- gradients ---------------------------------------------------------------------------------
    def register_hook(self, fn: GradHook) -> RemovableHandle:
        """Call ``fn(param)`` each time a backward pass has accumulated this parameter's gradient.

        Args:
            fn: callable taking the parameter; its return value is ignored.
        """
        if not callable(fn):
            raise TypeError(f"hook must be callable, got {type(fn).__name__}")
        handle = RemovableHandle(self._hooks)
        self._hooks[handle.id] = fn
        return handle

    # torch's name for the same semantics, so code written against torch reads naturally.
    register_post_accumulate_grad_hook = register_hook

    def accumulate_grad(self, g: Any) -> None:
        """Add ``g`` into ``.grad`` (allocating it on first use), then fire the gradient hooks.

        Args:
            g: gradient with the parameter's shape, same array module; cast to the parameter dtype.
                With chunked gradients on (``nn.chunking``): a stack ``(chunks, *shape)``, kept
                in ``chunk_grads`` (``.grad`` is left alone) until DDP or FSDP adds it exactly.
        """
        if not self.requires_grad:
            return
        if chunk_size() is not None:
            # a stack of per-chunk gradients: kept apart, to be added exactly by DDP or FSDP
            if tuple(g.shape[1:]) != tuple(self.data.shape) or g.ndim != self.data.ndim + 1:
                raise ValueError(
                    f"Parameter {self.name!r}: chunked gradient shape {tuple(g.shape)} is not "
                    f"(chunks, {', '.join(map(str, self.data.shape))})")
            if self.chunk_grads is None:
                self.chunk_grads = []
            self.chunk_grads.append(g)
            for hook in list(self._hooks.values()):
                hook(self)
            return
        if tuple(g.shape) != tuple(self.data.shape):
            raise ValueError(
                f"Parameter {self.name!r}: gradient shape {tuple(g.shape)} does not match "
                f"parameter shape {tuple(self.data.shape)}"
            )
        if self.grad is None:
            # Copy: g may be a view into a layer's temporary, and .grad must own its memory.
            self.grad = g.astype(self.data.dtype, copy=True)
        else:
            self.grad += g
        for hook in list(self._hooks.values()):
            hook(self)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradient (default) or fill it with zeros in place (keeps views valid)."""
        if set_to_none:
            self.grad = None
        elif self.grad is not None:
            self.grad[...] = 0

    def __repr__(self) -> str:
        xp = xp_of(self.data).__name__
        frozen = "" if self.requires_grad else ", requires_grad=False"
        name = f"{self.name!r}, " if self.name else ""
        return f"Parameter({name}shape={self.shape}, dtype={self.dtype}, {xp}{frozen})"

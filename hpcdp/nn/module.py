"""Module: the base class of every layer, with torch-like registration and explicit backward."""
from __future__ import annotations

from types import ModuleType
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np

from .backend import copy_into, is_float_dtype, resolve_xp, to_module, xp_of
from .hooks import HooksMixin
from .microbatch import SavedTensorsMixin
from .parameter import Parameter

__all__ = ["Module", "IncompatibleKeys"]


class IncompatibleKeys(NamedTuple):
    """What ``load_state_dict(strict=False)`` could not match."""

    missing_keys: list[str]
    unexpected_keys: list[str]


class Module(HooksMixin, SavedTensorsMixin):
    """Base class: ``forward`` saves what backward needs; backward returns the input gradient.

    Assigning a :class:`Parameter` or a :class:`Module` to an attribute registers it (as in torch);
    non-trainable arrays are registered with :meth:`register_buffer`. Iteration order is
    torch's (own members in registration order, then children depth first), identical on every rank.

    Backward comes in two parts so pipeline schedules can defer the weight gradient:
    ``backward_input(grad_output)`` returns the input gradient and keeps (``save_for_weight``) what
    the weight gradient needs; ``backward_weight()`` computes it, ``p.accumulate_grad(g)`` per own
    parameter in reverse registration order (firing the gradient hooks DDP overlaps with), and frees
    what was kept. ``backward(grad_output)`` is both, one after the other. Everything a layer keeps
    is stored per microbatch (``save_for_backward``/``saved_tensors``, see ``nn.microbatch``).

    A module may instead implement only ``forward`` and a fused ``backward`` (as before the split):
    then ``backward_input`` runs that ``backward`` and ``backward_weight`` has nothing left to do.
    Hooks (``register_forward_pre_hook`` ...) fire around any of them; see :mod:`hpcdp.nn.hooks`.
    """

    training: bool

    def __init__(self) -> None:
        object.__setattr__(self, "_parameters", {})
        object.__setattr__(self, "_buffers", {})
        object.__setattr__(self, "_modules", {})
        object.__setattr__(self, "training", True)
        for kind in ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks",
                     "_saved_fwd", "_saved_wgt"):
            object.__setattr__(self, kind, {})

    # -- registration --------------------------------------------------------------------------------
    def __setattr__(self, name: str, value: Any) -> None:
        if "_parameters" not in self.__dict__:
            raise AttributeError(f"call Module.__init__() in {type(self).__name__}.__init__ before assigning attributes")
        params, buffers, modules = self._parameters, self._buffers, self._modules
        if isinstance(value, Parameter):
            self._discard(name)
            if value.name is None:
                value.name = name
            params[name] = value
        elif isinstance(value, Module):
            self._discard(name)
            modules[name] = value
        elif name in params:
            if value is not None:
                raise TypeError(f"cannot assign {type(value).__name__} to parameter {name!r}; wrap it in Parameter")
            params[name] = None
        elif name in buffers:
            buffers[name] = value
        elif name in modules:
            if value is not None:
                raise TypeError(f"cannot assign {type(value).__name__} to child module {name!r}")
            modules[name] = None
        else:
            object.__setattr__(self, name, value)

    def _discard(self, name: str) -> None:
        for d in (self._parameters, self._buffers, self._modules):
            d.pop(name, None)
        self.__dict__.pop(name, None)

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails, i.e. for registered members.
        d = self.__dict__
        for key in ("_parameters", "_buffers", "_modules"):
            if key in d and name in d[key]:
                return d[key][name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __delattr__(self, name: str) -> None:
        for key in ("_parameters", "_buffers", "_modules"):
            if name in self.__dict__.get(key, {}):
                del self.__dict__[key][name]
                return
        object.__delattr__(self, name)

    def register_parameter(self, name: str, param: Parameter | None) -> None:
        """Register ``param`` under ``name`` (``None`` reserves the slot, e.g. a disabled bias)."""
        if param is None:
            self._discard(name)
            self._parameters[name] = None
        else:
            setattr(self, name, param)

    def register_buffer(self, name: str, array: Any, persistent: bool = True) -> None:
        """Register a non-trainable array (running statistics, masks) that state_dict saves."""
        self._discard(name)
        self._buffers[name] = array
        if not persistent:
            self.__dict__.setdefault("_non_persistent", set()).add(name)

    def add_module(self, name: str, module: Module | None) -> None:
        """Register ``module`` as a child under ``name``."""
        if module is None:
            self._discard(name)
            self._modules[name] = None
        else:
            setattr(self, name, module)

    # -- traversal -----------------------------------------------------------------------------------
    def named_children(self) -> Iterator[tuple[str, Module]]:
        """Yield ``(name, child)`` for direct children in registration order."""
        for name, m in self._modules.items():
            if m is not None:
                yield name, m

    def children(self) -> Iterator[Module]:
        """Yield direct children in registration order."""
        for _, m in self.named_children():
            yield m

    def named_modules(self, prefix: str = "", _seen: set[int] | None = None) -> Iterator[tuple[str, Module]]:
        """Yield ``(dotted_name, module)`` for this module and all descendants, each once."""
        seen = set() if _seen is None else _seen
        if id(self) in seen:
            return
        seen.add(id(self))
        yield prefix, self
        for name, child in self.named_children():
            yield from child.named_modules(f"{prefix}.{name}" if prefix else name, seen)

    def modules(self) -> Iterator[Module]:
        """Yield this module and all descendants, each once."""
        for _, m in self.named_modules():
            yield m

    def named_parameters(self, prefix: str = "", recurse: bool = True) -> Iterator[tuple[str, Parameter]]:
        """Yield ``("0.weight", p)``-style dotted names and parameters, each parameter once.

        Order is torch's: a module's own parameters (in registration order), then each child's,
        depth first. A parameter reachable under several names is yielded under the first.
        """
        seen: set[int] = set()
        mods = self.named_modules(prefix) if recurse else iter([(prefix, self)])
        for mod_name, mod in mods:
            for name, p in mod._parameters.items():
                if p is None or id(p) in seen:
                    continue
                seen.add(id(p))
                yield (f"{mod_name}.{name}" if mod_name else name), p

    def parameters(self, recurse: bool = True) -> Iterator[Parameter]:
        """Yield parameters in registration order, children recursively, without duplicates."""
        for _, p in self.named_parameters(recurse=recurse):
            yield p

    def named_buffers(self, prefix: str = "", recurse: bool = True) -> Iterator[tuple[str, Any]]:
        """Yield ``(dotted_name, array)`` for registered buffers."""
        seen: set[int] = set()
        mods = self.named_modules(prefix) if recurse else iter([(prefix, self)])
        for mod_name, mod in mods:
            for name, b in mod._buffers.items():
                if b is None or id(b) in seen:
                    continue
                seen.add(id(b))
                yield (f"{mod_name}.{name}" if mod_name else name), b

    def buffers(self, recurse: bool = True) -> Iterator[Any]:
        """Yield registered buffers (non-trainable arrays)."""
        for _, b in self.named_buffers(recurse=recurse):
            yield b

    def apply(self, fn: Callable[[Module], None]) -> Module:
        """Call ``fn`` on every descendant and then on this module; return self."""
        for child in self.children():
            child.apply(fn)
        fn(self)
        return self

    # -- modes and gradients -------------------------------------------------------------------------
    def train(self, mode: bool = True) -> Module:
        """Set training mode (dropout active) on this module and its descendants; return self."""
        for m in self.modules():
            object.__setattr__(m, "training", bool(mode))
        return self

    def eval(self) -> Module:
        """Set evaluation mode (dropout is the identity); return self."""
        return self.train(False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear every parameter's gradient (``None`` by default, zeros in place otherwise)."""
        for p in self.parameters():
            p.zero_grad(set_to_none)

    def requires_grad_(self, requires_grad: bool = True) -> Module:
        """Freeze (False) or unfreeze every parameter; return self."""
        for p in self.parameters():
            p.requires_grad = bool(requires_grad)
        return self

    # -- compute ---------------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Compute the output and save (``save_for_backward``) what backward needs."""
        raise NotImplementedError(f"{type(self).__name__} does not implement forward")

    def backward(self, grad_output: Any) -> Any:
        """Accumulate parameter gradients and return the gradient with respect to the input.

        The default runs ``backward_input`` then ``backward_weight``; containers override it to run
        each child's whole backward in turn, so gradient hooks fire as early as possible.
        """
        if type(self).backward_input is Module.backward_input:
            raise NotImplementedError(f"{type(self).__name__} implements neither backward nor backward_input")
        grad_input = self.backward_input(grad_output)
        self.backward_weight()
        return grad_input

    def backward_input(self, grad_output: Any) -> Any:
        """Return the input gradient and keep what ``backward_weight`` needs (current microbatch).

        For a module that only implements a fused ``backward``, this runs it (weight part included).
        """
        if type(self).backward is Module.backward:
            raise NotImplementedError(f"{type(self).__name__} implements neither backward nor backward_input")
        return self.backward(grad_output)

    def _needs_weight_grad(self) -> bool:
        """Tell whether any own parameter wants a gradient (else backward_input keeps nothing)."""
        return any(p is not None and p.requires_grad for p in self._parameters.values())

    def backward_weight(self) -> None:
        """Accumulate the parameter gradients of the current microbatch's ``backward_input``.

        Fires the parameters' gradient hooks. The default has nothing to do (no parameters of its
        own, or a fused ``backward`` already did it).
        """

    # -- state -----------------------------------------------------------------------------------------
    def _persistent_buffers(self, prefix: str = "") -> Iterator[tuple[str, Any]]:
        for mod_name, mod in self.named_modules(prefix):
            skip = mod.__dict__.get("_non_persistent", ())
            for name, b in mod._buffers.items():
                if b is not None and name not in skip:
                    yield (f"{mod_name}.{name}" if mod_name else name), b

    def state_dict(self, prefix: str = "") -> dict[str, Any]:
        """Return ``{dotted_name: array}`` for parameters and persistent buffers.

        The values are the live arrays (``p.data``), not copies, exactly as torch returns its
        tensors: copy them if you keep them across optimizer steps.
        """
        out: dict[str, Any] = {name: p.data for name, p in self.named_parameters(prefix)}
        out.update(self._persistent_buffers(prefix))
        return out

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> IncompatibleKeys:
        """Copy ``state`` into the existing arrays in place, checking keys, shapes and dtypes.

        Args:
            state: mapping of dotted names to arrays (numpy or cupy; moved to the model's module).
            strict: raise ``KeyError`` listing missing and unexpected keys instead of ignoring them.
        """
        targets: dict[str, Any] = {name: p.data for name, p in self.named_parameters()}
        targets.update(self._persistent_buffers())
        missing = [k for k in targets if k not in state]
        unexpected = [k for k in state if k not in targets]
        if strict and (missing or unexpected):
            raise KeyError(
                f"load_state_dict into {type(self).__name__}: missing keys {missing}, unexpected keys {unexpected}"
            )
        problems = []
        for name, dst in targets.items():
            if name not in state:
                continue
            src = state[name]
            src_shape = tuple(np.shape(src)) if not hasattr(src, "shape") else tuple(src.shape)
            src_dtype = np.asarray(src).dtype if not hasattr(src, "dtype") else src.dtype
            if src_shape != tuple(dst.shape) or np.dtype(src_dtype) != np.dtype(dst.dtype):
                problems.append(f"{name}: got {src_shape} {src_dtype}, expected {tuple(dst.shape)} {dst.dtype}")
        if problems:
            raise ValueError(f"load_state_dict into {type(self).__name__}: " + "; ".join(problems))
        for name, dst in targets.items():
            if name in state:
                copy_into(dst, state[name])
        return IncompatibleKeys(missing, unexpected)

    # -- conversion --------------------------------------------------------------------------------------
    def _convert(self, fn: Callable[[Any], Any]) -> None:
        for m in self.modules():
            for p in m._parameters.values():
                if p is not None:
                    p.data = fn(p.data)
                    if p.grad is not None:
                        p.grad = fn(p.grad)
            for name, b in list(m._buffers.items()):
                if b is not None:
                    m._buffers[name] = fn(b)

    def astype(self, dtype: Any) -> Module:
        """Convert floating parameters, gradients and buffers to ``dtype`` (e.g. float64); return self.

        The Parameter objects stay the same (only their arrays are replaced), but optimizers and
        wrappers created earlier that cached arrays must be rebuilt.
        """
        dt = np.dtype(dtype)
        if not is_float_dtype(dt):
            raise TypeError(f"astype needs a floating dtype, got {dt}")
        self._convert(lambda a: a.astype(dt, copy=False) if is_float_dtype(a.dtype) else a)
        return self

    def to(self, xp_or_device: ModuleType | str) -> Module:
        """Move every array to numpy ("cpu") or cupy ("cuda"); return self."""
        xp = resolve_xp(xp_or_device)
        self._convert(lambda a: a if xp_of(a) is xp else to_module(a, xp))
        return self

    # -- printing ----------------------------------------------------------------------------------------
    def extra_repr(self) -> str:
        """Return the layer-specific part of ``repr``."""
        return ""

    def __repr__(self) -> str:
        lines = [f"({name}): " + repr(m).replace("\n", "\n  ") for name, m in self.named_children()]
        head = f"{type(self).__name__}({self.extra_repr()}"
        if not lines:
            return head + ")"
        return head + "\n  " + "\n  ".join(lines) + "\n)"

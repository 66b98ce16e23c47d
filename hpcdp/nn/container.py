"""Containers: Sequential (a chain with forward and backward), ModuleList and ModuleDict (registries).

Containers start their children's backward through ``run_backward``/``run_backward_input``, so
every child's backward hooks fire, nested as torch nests them.
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator, Mapping

from .module import Module

__all__ = ["Sequential", "ModuleList", "ModuleDict"]


def _check_module(m: Any, where: str) -> Module:
    if not isinstance(m, Module):
        raise TypeError(f"{where} is a {type(m).__name__}, not a Module")
    return m


class Sequential(Module):
    """Run children in order; backward runs them in reverse, so the last layer's hooks fire first."""

    def __init__(self, *modules: Module) -> None:
        super().__init__()
        for i, m in enumerate(modules):
            self.add_module(str(i), _check_module(m, f"Sequential argument {i}"))

    def append(self, module: Module) -> Sequential:
        """Add ``module`` at the end; return self."""
        self.add_module(str(len(self._modules)), _check_module(module, "Sequential.append argument"))
        return self

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return iter(list(self.children()))

    def __getitem__(self, idx: int | slice) -> Any:
        mods = list(self.children())
        if isinstance(idx, slice):
            return Sequential(*mods[idx])
        return mods[idx]

    def forward(self, x: Any) -> Any:
        """Apply every child in registration order."""
        for m in self.children():
            x = m(x)
        return x

    def backward(self, grad_output: Any) -> Any:
        """Run each child's whole backward in reverse order; return the gradient wrt the input."""
        g = grad_output
        for m in reversed(list(self.children())):
            g = m.run_backward(g)
        return g

    def backward_input(self, grad_output: Any) -> Any:
        """Run each child's input part in reverse order (each keeps its weight part for later)."""
        g = grad_output
        for m in reversed(list(self.children())):
            g = m.run_backward_input(g)
        return g

    def backward_weight(self) -> None:
        """Run each child's weight part, last child first (gradient hooks in reverse parameter order)."""
        for m in reversed(list(self.children())):
            m.backward_weight()


class ModuleList(Module):
    """A list of modules registered as children ``"0"``, ``"1"``, ...; it has no forward of its own.

    A module that holds one writes its own ``forward`` and backward, calling ``m(x)`` and
    ``m.run_backward(g)`` (or ``run_backward_input`` / ``backward_weight``) on the items.
    """

    def __init__(self, modules: Iterable[Module] | None = None) -> None:
        super().__init__()
        if modules is not None:
            self.extend(modules)

    def _list(self) -> list[Module]:
        return list(self._modules.values())

    def _reset(self, mods: list[Module]) -> None:
        self._modules.clear()
        for i, m in enumerate(mods):
            self._modules[str(i)] = m

    def _index(self, idx: int) -> int:
        n = len(self._modules)
        if not -n <= idx < n:
            raise IndexError(f"ModuleList index {idx} out of range for length {n}")
        return idx % n

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return iter(self._list())

    def __getitem__(self, idx: int | slice) -> Any:
        if isinstance(idx, slice):
            return ModuleList(self._list()[idx])
        return self._list()[self._index(idx)]

    def __setitem__(self, idx: int, module: Module) -> None:
        mods = self._list()
        mods[self._index(idx)] = _check_module(module, "ModuleList item")
        self._reset(mods)

    def __delitem__(self, idx: int | slice) -> None:
        mods = self._list()
        if isinstance(idx, slice):
            del mods[idx]
        else:
            del mods[self._index(idx)]
        self._reset(mods)

    def append(self, module: Module) -> ModuleList:
        """Add ``module`` at the end; return self."""
        self.add_module(str(len(self._modules)), _check_module(module, "ModuleList.append argument"))
        return self

    def extend(self, modules: Iterable[Module]) -> ModuleList:
        """Append each of ``modules``; return self."""
        for m in modules:
            self.append(m)
        return self

    def insert(self, index: int, module: Module) -> None:
        """Insert ``module`` before ``index`` (names are renumbered)."""
        mods = self._list()
        mods.insert(index, _check_module(module, "ModuleList.insert argument"))
        self._reset(mods)


class ModuleDict(Module):
    """An ordered mapping of names to modules, registered as children; it has no forward of its own.

    Args:
        modules: a mapping or an iterable of ``(name, module)`` pairs, registered in order.
    """

    def __init__(self, modules: Mapping[str, Module] | Iterable[tuple[str, Module]] | None = None) -> None:
        super().__init__()
        if modules is not None:
            self.update(modules)

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._modules))

    def __contains__(self, key: object) -> bool:
        return key in self._modules

    def __getitem__(self, key: str) -> Module:
        try:
            return self._modules[key]
        except KeyError:
            raise KeyError(f"ModuleDict has no module {key!r}; keys are {list(self._modules)}") from None

    def __setitem__(self, key: str, module: Module) -> None:
        if not isinstance(key, str) or not key or "." in key:
            raise KeyError(f"ModuleDict keys must be non-empty strings without '.', got {key!r}")
        # Straight into the registry: a key such as "training" must not clobber an attribute.
        self._modules[key] = _check_module(module, f"ModuleDict[{key!r}]")

    def __delitem__(self, key: str) -> None:
        del self._modules[key]

    def keys(self) -> list[str]:
        """Return the names in registration order."""
        return list(self._modules)

    def values(self) -> list[Module]:
        """Return the modules in registration order."""
        return list(self._modules.values())

    def items(self) -> list[tuple[str, Module]]:
        """Return ``(name, module)`` pairs in registration order."""
        return list(self._modules.items())

    def pop(self, key: str) -> Module:
        """Remove ``key`` and return its module."""
        module = self[key]
        del self._modules[key]
        return module

    def update(self, modules: Mapping[str, Module] | Iterable[tuple[str, Module]]) -> None:
        """Add or replace modules from a mapping or ``(name, module)`` pairs."""
        pairs = modules.items() if isinstance(modules, Mapping) else modules
        for key, module in pairs:
            self[key] = module

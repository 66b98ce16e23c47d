"""Sequential: chains children in forward and runs their backward in reverse."""
from __future__ import annotations

from typing import Any, Iterator

from .module import Module

__all__ = ["Sequential"]


class Sequential(Module):
    """Run children in order; backward runs them in reverse, so the last layer's hooks fire first."""

    def __init__(self, *modules: Module) -> None:
        super().__init__()
        for i, m in enumerate(modules):
            if not isinstance(m, Module):
                raise TypeError(f"Sequential argument {i} is a {type(m).__name__}, not a Module")
            self.add_module(str(i), m)

    def append(self, module: Module) -> Sequential:
        """Add ``module`` at the end; return self."""
        self.add_module(str(len(self._modules)), module)
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
        """Run children's backward in reverse order; return the gradient wrt the input."""
        g = grad_output
        for m in reversed(list(self.children())):
            g = m.backward(g)
        return g

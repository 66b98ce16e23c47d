"""Which modules become units (``auto_wrap``) and which unit owns each parameter."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..nn.torch_module import TorchModule
from ._api import SizeBasedPolicy

__all__ = ["UnitSpec", "plan_units"]


@dataclass
class UnitSpec:
    """A unit before it is built: its module, its enclosing unit and its parameters."""

    name: str                 # dotted module path; "" for the root
    module: Any
    parent: int | None        # index of the enclosing unit (None for the root)
    params: list[tuple[str, Any]] = field(default_factory=list)

    @property
    def label(self) -> str:
        return self.name or "<root>"


def _children(m: Any) -> list[tuple[str, Any]]:
    nc = getattr(m, "named_children", None)
    return list(nc()) if nc is not None else []


def _own_params(m: Any) -> list[Any]:
    own = getattr(m, "_parameters", None)
    if isinstance(own, dict):
        return [p for p in own.values() if p is not None]
    return []


def _tree(root: Any, again: list[tuple[Any, str]] | None = None) -> list[tuple[str, Any, str | None]]:
    """(path, module, parent path) for every module once, pre-order (``named_modules``' order).

    A module reached a second time (shared by two parents) is appended to ``again`` with the
    second parent's path.
    """
    out: list[tuple[str, Any, str | None]] = []
    seen: set[int] = set()

    def visit(path: str, m: Any, parent: str | None) -> None:
        if id(m) in seen:
            if again is not None and parent is not None:
                again.append((m, parent))
            return
        seen.add(id(m))
        out.append((path, m, parent))
        for name, c in _children(m):
            visit(f"{path}.{name}" if path else name, c, path)

    visit("", root, None)
    return out


def _seen_as(m: Any) -> Any:
    """What a policy is asked about: the torch module behind a ``from_torch`` mirror, else ``m``."""
    return m.torch if isinstance(m, TorchModule) else m


def _wrapped_by(policy: Any) -> Callable[[str, Any, int], bool]:
    """``decide(path, module, unwrapped_numel)`` for the policy.

    For a torch model the classes are matched against, and a callable is given, the torch
    submodule (``{torch.nn.Linear}``, ``lambda m: isinstance(m, Block)``), as torch's own wrap
    policies see it; a class of the adapter (``TorchModule``) matches the mirror.
    """
    if isinstance(policy, SizeBasedPolicy):
        return lambda path, m, numel: numel >= policy.min_params
    if isinstance(policy, type):
        policy = {policy}
    if isinstance(policy, (set, frozenset, list, tuple)):
        classes = tuple(policy)
        bad = [c for c in classes if not isinstance(c, type)]
        if bad:
            raise TypeError(f"FSDP auto_wrap: expected module classes, got {bad!r}")
        return lambda path, m, numel: isinstance(m, classes) or isinstance(_seen_as(m), classes)
    if callable(policy):
        return lambda path, m, numel: bool(policy(_seen_as(m)))
    raise TypeError("FSDP auto_wrap must be a set of module classes, hpcdp.fsdp.size_based(n), a "
                    f"callable module -> bool, or None; got {type(policy).__name__}")


def plan_units(root: Any, policy: Any, named: list[tuple[str, Any]]) -> list[UnitSpec]:
    """Units in pre-order (root first), each with the parameters it owns.

    A parameter belongs to the innermost unit whose subtree (not entering nested units) holds it;
    one reachable from several units (tied weights) belongs to their closest common enclosing
    unit, which is gathered whenever either user runs.

    Args:
        root: the wrapped module.
        policy: ``auto_wrap`` (None: the root is the only unit).
        named: ``root.named_parameters()``, which fixes every parameter's global name and order.
    """
    again: list[tuple[Any, str]] = []
    tree = _tree(root, again)
    wrap: set[str] = {""}
    if policy is not None:
        decide = _wrapped_by(policy)
        left: dict[str, int] = {}
        for path, m, _ in reversed(tree):  # children before parents
            numel = sum(int(getattr(p, "size", 0)) for p in _own_params(m))
            for name, c in _children(m):
                cpath = f"{path}.{name}" if path else name
                if cpath in left and cpath not in wrap:
                    numel += left[cpath]
            left[path] = numel
            if path and decide(path, m, numel):
                wrap.add(path)
    units: list[UnitSpec] = []
    index: dict[str, int] = {}
    owner_of_module: dict[str, int] = {}
    for path, m, parent in tree:
        if path in wrap:
            up = None if parent is None else owner_of_module[parent]
            index[path] = len(units)
            units.append(UnitSpec(path, m, up))
            owner_of_module[path] = index[path]
        else:
            owner_of_module[path] = owner_of_module[parent]  # type: ignore[index]
    # Which units see each parameter (through their own modules).
    seen_by: dict[int, list[int]] = {}
    for path, m, _ in tree:
        u = owner_of_module[path]
        for p in _own_params(m):
            lst = seen_by.setdefault(id(p), [])
            if u not in lst:
                lst.append(u)
    # A module shared by two parents: its parameters are used under the second parent's unit too
    # (unless the module is a unit itself, which gathers its own whenever it runs).
    unit_ids = {id(u.module) for u in units}
    for m, parent in again:
        if id(m) in unit_ids:
            continue
        u = owner_of_module[parent]
        for p in m.parameters():
            lst = seen_by.setdefault(id(p), [])
            if u not in lst:
                lst.append(u)
    for gname, p in named:
        users = seen_by.get(id(p), [0])
        units[_common(units, users)].params.append((gname, p))
    return units


def _common(units: list[UnitSpec], users: list[int]) -> int:
    """Closest unit enclosing every unit in ``users``."""
    def chain(u: int) -> list[int]:
        out = [u]
        while units[out[-1]].parent is not None:
            out.append(units[out[-1]].parent)  # type: ignore[arg-type]
        return out[::-1]  # root first

    chains = [chain(u) for u in users]
    common = 0
    for level in zip(*chains):
        if all(x == level[0] for x in level):
            common = level[0]
        else:
            break
    return common

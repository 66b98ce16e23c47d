"""Optimizer base: torch-style param_groups and a state_dict made only of arrays and scalars."""
from __future__ import annotations

import copy
import weakref
from typing import Any, Callable, Iterable


from ..errors import HpcdpError
from ._state_check import check_groups, load_param_state, state_index

__all__ = ["Optimizer", "live_optimizers"]

#: every optimizer alive in this process, so wrappers can account for the state of the optimizers
#: built on their parameters (``FSDP.memory_stats()``) without being handed them
_LIVE: "weakref.WeakSet[Optimizer]" = weakref.WeakSet()


def _owner_of(p: Any) -> Any:
    ref = getattr(p, "_state_owner", None)
    return ref() if ref is not None else None


def live_optimizers() -> list["Optimizer"]:
    """The optimizers of this process that have not been garbage-collected."""
    return list(_LIVE)


class Optimizer:
    """Base class holding ``param_groups`` (list of dicts) and per-parameter ``state``.

    Parameters are any objects with ``.data`` and ``.grad`` arrays (``hpcdp.nn.Parameter`` or a
    wrapper's flat parameter); updates are in place on ``p.data`` because DDP/FSDP hold references
    to the same arrays. Parameters whose ``.grad is None`` are skipped by ``step``. ``state`` is keyed
    by the parameter objects, which must hash by identity (``nn.Parameter`` does).

    ``state_dict()`` returns ``{"state": {index: {name: array | scalar}}, "param_groups": [...]}``
    with integer indices counting parameters across groups in order, exactly like torch, and
    nothing that needs pickling, so it can be written to HDF5. Arrays in it are the live state
    arrays (not copies); ``load_state_dict`` copies what it is given.
    """

    #: what each parameter's state holds (see ``_state_check``); None: checked generically
    state_spec: dict[str, str] | None = None

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any]) -> None:
        self.defaults = dict(defaults)
        self.param_groups: list[dict[str, Any]] = []
        self.state: dict[Any, dict[str, Any]] = {}
        params = list(params)
        if not params:
            raise ValueError(f"{type(self).__name__} got an empty parameter list")
        groups = params if isinstance(params[0], dict) else [{"params": params}]
        for g in groups:
            self.add_param_group(g)
        _LIVE.add(self)

    def add_param_group(self, group: dict[str, Any]) -> None:
        """Add a group of parameters with its own hyper-parameters (missing ones take the defaults)."""
        if not isinstance(group, dict):
            raise TypeError(f"param group must be a dict, got {type(group).__name__}")
        ps = group["params"]
        ps = [ps] if hasattr(ps, "data") and hasattr(ps, "grad") else list(ps)
        seen = {id(p) for g in self.param_groups for p in g["params"]}
        for p in ps:
            if not (hasattr(p, "data") and hasattr(p, "grad")):
                raise TypeError(f"optimizer parameters need .data and .grad, got {type(p).__name__}")
            if id(p) in seen:
                raise ValueError("a parameter appears in more than one parameter group (or twice in one)")
            seen.add(id(p))
        new = {k: v for k, v in self.defaults.items()}
        new.update({k: v for k, v in group.items() if k != "params"})
        new["params"] = ps
        self.param_groups.append(new)

    # -- the loop --------------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients of every parameter (``None`` by default, zeros in place otherwise)."""
        for g in self.param_groups:
            for p in g["params"]:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad[...] = 0

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update every parameter that has a gradient; return ``closure()`` if given."""
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, p.grad, group, self.state.setdefault(p, {}))
        return loss

    def _update(self, p: Any, grad: Any, group: dict[str, Any], state: dict[str, Any]) -> None:
        raise NotImplementedError

    # -- state -------------------------------------------------------------------------------------
    def _index(self) -> dict[int, Any]:
        return {i: p for i, p in enumerate(p for g in self.param_groups for p in g["params"])}

    def _sharded_owner(self) -> Any:
        """The wrapper (FSDP) whose shards these parameters are, or None for plain parameters.

        Its shards are pieces of global arrays, so their state must be saved as ``Shard`` blocks at
        the parameters' global names; a plain index-keyed dict would write one rank's piece as if
        it were the whole array.
        """
        owners = {id(o): o for g in self.param_groups for p in g["params"]
                  if (o := _owner_of(p)) is not None}
        if not owners:
            return None
        plain = [p for g in self.param_groups for p in g["params"] if _owner_of(p) is None]
        if len(owners) > 1 or plain:
            raise HpcdpError(f"{type(self).__name__}.state_dict: the optimizer mixes the shards of "
                             f"{len(owners)} FSDP wrapper(s) with {len(plain)} other parameter(s); "
                             "save each wrapper's part with fsdp.optim_state_dict(opt)")
        return next(iter(owners.values()))

    def state_dict(self) -> dict[str, Any]:
        """Return ``{"state": {index: {...}}, "param_groups": [{..., "params": [indices]}]}``.

        On FSDP shards it returns ``fsdp.optim_state_dict(self)`` instead: state keyed by parameter
        name, each array a ``checkpoint.Shard``, so a checkpoint reshards across world sizes.
        """
        owner = self._sharded_owner()
        if owner is not None:
            return owner.optim_state_dict(self)
        index = self._index()
        state = {i: dict(self.state[p]) for i, p in index.items() if self.state.get(p)}
        groups, start = [], 0
        for g in self.param_groups:
            n = len(g["params"])
            gd = {k: copy.copy(v) for k, v in g.items() if k != "params"}
            gd["params"] = list(range(start, start + n))
            groups.append(gd)
            start += n
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore hyper-parameters and per-parameter state (arrays copied onto each param's
        module/dtype). Everything is checked first (``_state_check``): a wrong shape, dtype or
        hyper-parameter type, or state for a parameter no group lists, raises naming the entry
        and changes nothing."""
        owner = self._sharded_owner()
        if owner is not None:
            owner.load_optim_state_dict(self, state_dict)
            return
        where = f"{type(self).__name__}.load_state_dict"
        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
            raise TypeError(f"{where}: expected a dict with 'state' and 'param_groups', got "
                            f"{type(state_dict).__name__}")
        groups = state_dict["param_groups"]
        settings = check_groups(where, self.defaults, self.param_groups, groups)
        for i, (mine, theirs) in enumerate(zip(self.param_groups, groups)):
            if len(mine["params"]) != len(theirs.get("params", ())):
                raise ValueError(f"{where}: param group {i}: loaded state has "
                                 f"{len(theirs.get('params', ()))} parameters, optimizer has "
                                 f"{len(mine['params'])}")
        loaded = state_index(where, groups, state_dict["state"])
        index = self._index()
        saved_ids = [int(j) for g in groups for j in g["params"]]
        spec = getattr(type(self), "state_spec", None)
        new_state: dict[Any, dict[str, Any]] = {}
        for pos, saved_id in enumerate(saved_ids):
            if saved_id in loaded:
                p = index[pos]
                new_state[p] = load_param_state(where, f"parameter {saved_id}", spec,
                                                loaded[saved_id], p.data)
        for mine, typed in zip(self.param_groups, settings):
            mine.update(typed)
        self.state = new_state

    def __repr__(self) -> str:
        lines = [type(self).__name__ + " ("]
        for i, g in enumerate(self.param_groups):
            lines.append(f"Parameter Group {i}")
            lines.extend(f"    {k}: {v}" for k, v in sorted(g.items()) if k != "params")
        return "\n".join(lines) + "\n)"

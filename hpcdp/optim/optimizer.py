"""Optimizer base: torch-style param_groups and a state_dict made only of arrays and scalars."""
from __future__ import annotations

import copy
import weakref
from typing import Any, Callable, Iterable


from ..errors import HpcdpError
from .names import NAME_HINT, by_name, is_name_keyed, load_by_name, names_of, state_by_name
from .state_check import check_index_keyed, require_state_dict

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
    wrapper's flat parameter), or ``(name, parameter)`` pairs such as ``model.named_parameters()``;
    updates are in place on ``p.data`` because DDP/FSDP hold references to the same arrays.
    Parameters whose ``.grad is None`` are skipped by ``step``. ``state`` is keyed by the parameter
    objects, which must hash by identity (``nn.Parameter`` does).

    ``state_dict()`` is keyed by parameter *name* wherever names are known (see ``names``):
    ``{"state": {"0.weight": {...}}, "param_groups": [{..., "params": ["0.weight", ...]}]}``, so it
    loads under DDP, FSDP, a pipeline or one process alike. Names come from ``DDP`` (which tags its
    module's parameters), from ``(name, parameter)`` pairs given here, and on FSDP shards and
    pipeline stages from the wrapper itself (``fsdp.optim_state_dict(self)``: Shards;
    ``stage.optim_state_dict(self)``: collective over the pipeline). Unnamed parameters keep
    torch's integer indices. Nothing in it needs pickling, so it can be written to HDF5; arrays
    in it are the live state arrays (not copies); ``load_state_dict`` copies what it is given.
    """

    #: what each parameter's state holds (see ``state_check``); None: checked generically
    state_spec: dict[str, str] | None = None

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any]) -> None:
        self.defaults = dict(defaults)
        self.param_groups: list[dict[str, Any]] = []
        self.state: dict[Any, dict[str, Any]] = {}
        self._given_names: dict[int, str] = {}
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
        named = [x for x in ps if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str)]
        if named and len(named) != len(ps):
            raise TypeError("a param group mixes (name, parameter) pairs with bare parameters")
        if named:
            given = dict(getattr(self, "_given_names", {}))
            for n, p in named:
                given[id(p)] = n
            ps = [p for _, p in named]
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
        if named:
            self._given_names = given

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

    def _params(self) -> list[Any]:
        return [p for g in self.param_groups for p in g["params"]]

    def param_names(self) -> list[str] | None:
        """The names of the parameters in order (across groups), or None where any is unnamed."""
        return names_of(self._params(), getattr(self, "_given_names", None))

    def _sharded_owner(self) -> Any:
        """The wrapper (FSDP, PipelineStage) that produces these parameters' state, or None.

        FSDP shards are pieces of global arrays, so their state must be saved as ``Shard`` blocks
        at the parameters' global names; a pipeline stage holds some of the model's parameters,
        so its state is the whole model's, every other stage's blocks empty.
        """
        owners = {id(o): o for g in self.param_groups for p in g["params"]
                  if (o := _owner_of(p)) is not None}
        if not owners:
            return None
        plain = [p for g in self.param_groups for p in g["params"] if _owner_of(p) is None]
        if len(owners) > 1 or plain:
            raise HpcdpError(f"{type(self).__name__}.state_dict: the optimizer mixes the parameters "
                             f"of {len(owners)} FSDP wrapper(s) or pipeline stage(s) with "
                             f"{len(plain)} other parameter(s); build one optimizer per wrapper and "
                             "save each one's part with fsdp.optim_state_dict(opt) or "
                             "stage.optim_state_dict(opt)")
        return next(iter(owners.values()))

    def state_dict(self) -> dict[str, Any]:
        """Return ``{"state": {name: {...}}, "param_groups": [{..., "params": [names]}]}``.

        Keyed by index (torch's layout) where the parameters have no names. On FSDP shards it
        returns ``fsdp.optim_state_dict(self)`` (each array a ``checkpoint.Shard``, so a checkpoint
        reshards across world sizes), on a pipeline stage's parameters
        ``stage.optim_state_dict(self)``, which is collective over the pipeline's ranks.
        """
        owner = self._sharded_owner()
        if owner is not None:
            return owner.optim_state_dict(self)
        names = self.param_names()
        if names is not None:
            return state_by_name(self, dict(zip(map(id, self._params()), names)))
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
        module/dtype). Everything is checked first (``state_check``): a wrong shape, dtype or
        hyper-parameter type, or state for a parameter no group lists, raises naming the entry
        and changes nothing."""
        owner = self._sharded_owner()
        if owner is not None:
            owner.load_optim_state_dict(self, state_dict)
            return
        where = f"{type(self).__name__}.load_state_dict"
        require_state_dict(where, state_dict)
        if is_name_keyed(state_dict):
            names = self.param_names()
            if names is None:
                shown = [str(n) for g in state_dict["param_groups"] for n in g.get("params", [])][:4]
                raise ValueError(f"{where}: the state is keyed by parameter name ({shown}...), and "
                                 f"this optimizer's parameters have no names: {NAME_HINT}")
            load_by_name(where, self, dict(zip(map(id, self._params()), names)),
                         by_name(where, state_dict, names))
            return
        params = self._params()
        settings, checked = check_index_keyed(where, self.defaults, self.param_groups, state_dict,
                                              params, getattr(type(self), "state_spec", None))
        new_state: dict[Any, dict[str, Any]] = {params[pos]: st for pos, st in checked.items()}
        for mine, typed in zip(self.param_groups, settings):
            mine.update(typed)
        self.state = new_state

    def __repr__(self) -> str:
        lines = [type(self).__name__ + " ("]
        for i, g in enumerate(self.param_groups):
            lines.append(f"Parameter Group {i}")
            lines.extend(f"    {k}: {v}" for k, v in sorted(g.items()) if k != "params")
        return "\n".join(lines) + "\n)"

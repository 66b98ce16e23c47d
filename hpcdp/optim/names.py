"""Optimizer state keyed by parameter name, so it moves between DDP, FSDP, pipelines and one process.

An index (torch's key) means "the i-th parameter this optimizer was built on": nothing another
layout can use, since FSDP's flat shards, a pipeline stage's parameters and the plain model list
different parameters in different orders. A name (``"0.weight"``, the unsplit model's) means the
same array everywhere. So every optimizer ``state_dict`` that hpcdp's layers produce is keyed by
name::

    {"state": {"0.weight": {"step": 2, "exp_avg": ..., ...}, ...},
     "param_groups": [{"lr": ..., ..., "params": ["0.weight", "0.bias", ...]}, ...]}

Where the names come from: the wrapper that owns the parameters (``DDP`` tags them with itself,
``FSDP`` and ``PipelineStage`` produce the state themselves), or the optimizer's own
construction from ``model.named_parameters()``. An optimizer over plain, unnamed parameters keeps
torch's index keys. Every load accepts both: name-keyed state is matched by name; index-keyed
state (older checkpoints) by position in the saved param groups, as torch does, and where
positions cannot say which parameter is which the error names ``name_keyed``, the conversion.
"""
from __future__ import annotations

import weakref
from typing import Any, Mapping, Sequence

from .state_check import check_groups, load_param_state
from .torch_state import check_torch_state, group_out, install_torch_state, is_torch_optimizer, state_out

__all__ = ["name_keyed", "is_name_keyed", "names_of", "tag_names", "by_name", "optimizer_names",
           "state_by_name", "load_by_name", "index_keyed", "whole", "get_optimizer_state_dict",
           "set_optimizer_state_dict"]

#: what an error says to do with name-keyed state and an optimizer that has no names
NAME_HINT = ("build the optimizer on model.named_parameters() (or on ddp.parameters() of a DDP), so "
             "that it knows its parameters' names")


def _is_name(k: Any) -> bool:
    return isinstance(k, str) and not k.isdigit()


def is_name_keyed(state_dict: Any) -> bool:
    """Whether ``state_dict`` names its parameters (any key or group entry that is not an index)."""
    if not isinstance(state_dict, Mapping):
        return False
    keys = list(state_dict.get("state", {}) or {}) if isinstance(state_dict.get("state"), Mapping) else []
    for g in state_dict.get("param_groups", []) or []:
        if isinstance(g, Mapping):
            keys.extend(g.get("params", []) or [])
    return any(_is_name(k) for k in keys)


def name_keyed(state_dict: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """Convert index-keyed optimizer state to name-keyed state.

    Args:
        state_dict: ``{"state": {index: ...}, "param_groups": [{..., "params": [indices]}]}``, as an
            optimizer over unnamed parameters (or hpcdp before name keys) saved it.
        names: the names of the parameters that optimizer was built on, in its order, e.g.
            ``[n for n, _ in model.named_parameters()]`` for ``Adam(model.parameters())``.
    """
    return by_name("name_keyed", state_dict, list(names))


def by_name(where: str, state_dict: Any, order: Sequence[str]) -> dict[str, Any]:
    """``state_dict`` keyed by name: as it is if it already is, else its i-th parameter (counting
    across its param groups, in order) named ``order[i]``."""
    if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= set(state_dict):
        raise TypeError(f"{where}: expected a dict with 'state' and 'param_groups', got "
                        f"{type(state_dict).__name__}")
    if is_name_keyed(state_dict):
        return dict(state_dict)
    groups = state_dict["param_groups"]
    if not isinstance(groups, (list, tuple)) or not all(isinstance(g, Mapping) for g in groups):
        raise TypeError(f"{where}: 'param_groups' must be a list of dicts")
    saved = [int(str(j)) for g in groups for j in g.get("params", [])]
    if len(saved) != len(order):
        raise ValueError(f"{where}: the state is keyed by parameter index and lists {len(saved)} "
                         f"parameters, this optimizer holds {len(order)}: positions cannot say "
                         "which is which; convert it with hpcdp.optim.name_keyed(state, names), "
                         "names = the saving optimizer's parameter names in its order")
    name_of = {i: order[pos] for pos, i in enumerate(saved)}
    out_groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [name_of[int(str(j))] for j in g.get("params", [])]} for g in groups]
    state = state_dict["state"]
    if not isinstance(state, Mapping):
        raise TypeError(f"{where}: 'state' must be a dict")
    out_state = {}
    for k, v in state.items():
        if not (isinstance(k, int) or (isinstance(k, str) and k.isdigit())) or int(k) not in name_of:
            raise KeyError(f"{where}: state for parameter {k!r}, which no saved param group lists")
        out_state[name_of[int(k)]] = v
    return {"state": out_state, "param_groups": out_groups}


def index_keyed(where: str, state_dict: Any, order: Sequence[str]) -> dict[str, Any]:
    """Name-keyed ``state_dict`` as indices into ``order`` (this optimizer's names, in order)."""
    pos = {n: i for i, n in enumerate(order)}

    def at(n: Any) -> int:
        if str(n) not in pos:
            raise KeyError(f"{where}: the state names parameter {str(n)!r}, which this optimizer "
                           f"does not hold (it holds {list(order)[:6]}{'...' if len(order) > 6 else ''})")
        return pos[str(n)]

    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [at(n) for n in g.get("params", [])]}
              for g in state_dict.get("param_groups", [])]
    return {"state": {at(n): st for n, st in dict(state_dict.get("state", {})).items()},
            "param_groups": groups}


# -- where names come from ------------------------------------------------------------------------
def tag_names(owner: Any, params: Any) -> None:
    """Mark ``params`` as named by ``owner`` (its ``named_parameters()``), held weakly."""
    ref = weakref.ref(owner)
    for p in params:
        try:
            p._name_owner = ref
        except AttributeError:   # a parameter type that takes no attributes: stays unnamed
            pass


def names_of(params: Sequence[Any], given: Mapping[int, str] | None = None) -> list[str] | None:
    """The names of ``params`` (in order), or None if any has none or two share one."""
    given = given or {}
    owners: dict[int, dict[int, str]] = {}
    out = []
    for p in params:
        n = given.get(id(p))
        if n is None:
            ref = getattr(p, "_name_owner", None)
            owner = ref() if ref is not None else None
            if owner is None:
                return None
            table = owners.get(id(owner))
            if table is None:
                table = owners[id(owner)] = {id(q): m for m, q in owner.named_parameters()}
            n = table.get(id(p))
            if n is None:
                return None
        out.append(n)
    return out if len(set(out)) == len(out) else None


# -- state by name ---------------------------------------------------------------------------------
def optimizer_names(where: str, named: Any, optimizer: Any, build_on: str) -> dict[int, str]:
    """``id(param) -> name`` for every parameter ``optimizer`` holds, from the layer's
    ``named`` (name, parameter) pairs; a parameter the layer does not own is an error that says
    what the optimizer should have been built on (``build_on``, e.g. "ddp.parameters()")."""
    names = {}
    for n, p in named:
        names[id(p)] = n
        tensor = getattr(p, "tensor", None)   # a torch model's adapter parameter: what torch.optim holds
        if tensor is not None:
            names[id(tensor)] = n
    for g in optimizer.param_groups:
        for p in g["params"]:
            if id(p) not in names:
                raise ValueError(f"{where}: the optimizer holds a parameter of shape "
                                 f"{tuple(p.data.shape)} that is not one of this layer's; "
                                 f"build it on {build_on}")
    return names


def state_by_name(optimizer: Any, names: Mapping[int, str]) -> dict[str, Any]:
    """``optimizer``'s state keyed by ``names[id(param)]`` (live arrays, not copies; a torch
    optimizer's tensors as numpy views of them)."""
    torch_opt = is_torch_optimizer(optimizer)
    state, groups = {}, []
    for g in optimizer.param_groups:
        for p in g["params"]:
            if optimizer.state.get(p):
                st = optimizer.state[p]
                state[names[id(p)]] = state_out(st) if torch_opt else dict(st)
        settings = group_out(g) if torch_opt else {k: v for k, v in g.items() if k != "params"}
        groups.append({**settings, "params": [names[id(p)] for p in g["params"]]})
    return {"state": state, "param_groups": groups}


def whole(where: str, label: str, v: Any) -> Any:
    """A ``checkpoint.Shard`` covering its whole array as that array; other values unchanged."""
    if hasattr(v, "global_shape") and hasattr(v, "local"):
        if tuple(v.local.shape) != tuple(v.global_shape):
            raise ValueError(f"{where}: {label} is a block {tuple(v.local.shape)} of "
                             f"{tuple(v.global_shape)}; this optimizer needs the whole array")
        return v.local
    return v


def load_by_name(where: str, optimizer: Any, names: Mapping[int, str], state_dict: Any, *,
                 known: set[str] | None = None) -> None:
    """Load name-keyed ``state_dict`` (whole arrays, or Shards covering them) into ``optimizer``.

    ``known``: every name of the whole model, when this optimizer holds only some (a pipeline
    stage): saved groups may then list, and the state hold, the others' names, which are skipped.
    Everything is checked before anything changes.
    """
    if not isinstance(state_dict, Mapping) or not isinstance(state_dict.get("state"), Mapping):
        raise TypeError(f"{where}: expected a dict with 'state' (a dict) and 'param_groups', got "
                        f"{type(state_dict).__name__}")
    groups = list(state_dict.get("param_groups", []))
    settings = check_groups(where, optimizer.defaults, optimizer.param_groups, groups)
    by = {}
    for i, (mine, theirs) in enumerate(zip(optimizer.param_groups, groups)):
        want = [names[id(p)] for p in mine["params"]]
        got = [str(n) for n in theirs.get("params", [])]
        lacking = [n for n in want if n not in got]
        extra = [n for n in got if n not in want and (known is None or n not in known)]
        if lacking or extra:
            raise ValueError(f"{where}: param group {i} of the state lists {got}, the optimizer's "
                             f"holds {want} (the state lacks {lacking}, has no parameter for {extra})")
        by.update({n: p for n, p in zip(want, mine["params"])})
    listed = {str(n) for g in groups for n in g.get("params", [])}
    torch_opt = is_torch_optimizer(optimizer)
    spec = getattr(type(optimizer), "state_spec", None)
    new_state: dict[Any, dict[str, Any]] = {}
    for name, st in state_dict["state"].items():
        name = str(name)
        if name not in listed:
            raise KeyError(f"{where}: state for {name!r}, which no param group of the state lists")
        p = by.get(name)
        if p is None:
            if known is not None and name in known:
                continue   # another stage's parameter
            raise KeyError(f"{where}: state for {name!r}, which this optimizer does not hold")
        if not isinstance(st, Mapping):
            raise TypeError(f"{where}: state of {name!r} must be a dict, got {type(st).__name__}")
        entry = {k: whole(where, f"{name}[{k!r}]", v) for k, v in st.items()}
        new_state[p] = (check_torch_state(where, repr(name), optimizer, entry, p) if torch_opt
                        else load_param_state(where, repr(name), spec, entry, p.data))
    if torch_opt:
        install_torch_state(optimizer, settings, new_state)
        return
    for mine, typed in zip(optimizer.param_groups, settings):
        mine.update(typed)
    optimizer.state = new_state


# -- the user's calls --------------------------------------------------------------------------
def get_optimizer_state_dict(model: Any, optimizer: Any) -> dict[str, Any]:
    """Return ``optimizer``'s state keyed by ``model``'s parameter names (as torch's
    ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``).

    The result holds arrays and scalars only (a torch optimizer's tensors as numpy views, live:
    ``checkpoint.save`` copies them), so ``hpcdp.checkpoint.save`` writes it and it loads under
    any layer and world size.

    Args:
        model: what the optimizer was built on: a ``torch.nn.Module`` (the optimizer holds its
            ``parameters()``), an hpcdp.nn module, or a layer (``DDP``, ``FSDP``, a pipeline
            stage), whose own ``optim_state_dict`` is used.
        optimizer: a ``torch.optim`` or ``hpcdp.optim`` optimizer over those parameters.
    """
    own = getattr(model, "optim_state_dict", None)
    if callable(own):
        return own(optimizer)
    names = optimizer_names("get_optimizer_state_dict", _named(model), optimizer, "model.parameters()")
    return state_by_name(optimizer, names)


def set_optimizer_state_dict(model: Any, optimizer: Any, state_dict: Any) -> None:
    """Load name-keyed (or, in the optimizer's parameter order, index-keyed) ``state_dict`` into
    ``optimizer``, built on ``model``'s parameters; everything is checked before anything changes.

    Args:
        model: as for :func:`get_optimizer_state_dict`.
        optimizer: the optimizer to load into (its param groups must match the saved ones).
        state_dict: what :func:`get_optimizer_state_dict` or a layer's ``optim_state_dict``
            returned, e.g. from ``hpcdp.checkpoint.load``.
    """
    own = getattr(model, "load_optim_state_dict", None)
    if callable(own):
        own(optimizer, state_dict)
        return
    where = "set_optimizer_state_dict"
    names = optimizer_names(where, _named(model), optimizer, "model.parameters()")
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    load_by_name(where, optimizer, names, by_name(where, state_dict, order))


def _named(model: Any) -> Any:
    named = getattr(model, "named_parameters", None)
    if not callable(named):
        raise TypeError(f"expected a model with named_parameters(), got {type(model).__name__}")
    return named()

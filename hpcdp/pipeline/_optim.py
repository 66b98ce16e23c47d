"""A pipeline's optimizer state for checkpoints: the whole model's, keyed by unsplit names.

Each rank's optimizer holds the state of its stages' parameters only, but ``checkpoint.save`` needs
every rank to pass the same tree (keys, shapes, dtypes and the same scalars). So
``optim_state_dict`` is collective over the pipeline's ranks: they exchange a description of their
state (per parameter: array shapes and dtypes, scalar values such as Adam's ``step``) and their
param groups, and each returns the same name-keyed tree::

    {"state": {"0.weight": {"step": 2, "exp_avg": Shard(...), ...}, ...},
     "param_groups": [{"lr": ..., "params": [every rank's names of this group, in model order]}]}

where each array is a ``checkpoint.Shard`` of the parameter's shape: whole on the rank that holds
the parameter (on data-parallel replica 0 only), empty elsewhere, exactly as
``PipelineStage.state_dict`` does for the parameters. Saved, it is the state a DDP optimizer or a
plain one over ``model.named_parameters()`` has, so it loads there; loading back into any split
takes each rank's own names (``load_optim_state_dict``, not collective).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..optim.names import by_name, load_by_name, optimizer_names
from ..optim.torch_state import group_out, is_torch_optimizer, state_out

__all__ = ["optim_state_dict", "load_optim_state_dict"]


def _is_array(v: Any) -> bool:
    return hasattr(v, "shape") and hasattr(v, "dtype") and getattr(v, "ndim", 0) > 0


def _plain(v: Any) -> Any:
    """A scalar as a plain Python value (ranks compare and pickle it)."""
    if isinstance(v, np.generic) or (hasattr(v, "shape") and getattr(v, "ndim", 1) == 0):
        return v.item()
    return v


def _names(stage: Any, optimizer: Any, where: str) -> dict[int, str]:
    return optimizer_names(where, stage.named_parameters(), optimizer, "stage.parameters()")


def _settings(g: dict[str, Any]) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, tuple) else _plain(v)) for k, v in g.items() if k != "params"}


def optim_state_dict(stage: Any, optimizer: Any, owner: bool) -> dict[str, Any]:
    """See the module docstring. Collective over ``stage.group``; ``optimizer`` None on a rank
    whose stages have no parameters."""
    from ..checkpoint import Shard

    g = stage.group
    where = f"PipelineStage.optim_state_dict (rank {g.rank} of {g.size})"
    desc: dict[str, dict[str, tuple]] = {}
    groups: list[tuple[dict[str, Any], list[str]]] | None = None
    local: dict[str, dict[str, Any]] = {}
    if optimizer is not None:
        names = _names(stage, optimizer, where)
        groups = []
        torch_opt = is_torch_optimizer(optimizer)   # its tensors as numpy views, as DDP's are
        for grp in optimizer.param_groups:
            settings = _settings(group_out(grp) if torch_opt else grp)
            groups.append((settings, [names[id(p)] for p in grp["params"]]))
            for p in grp["params"]:
                st = optimizer.state.get(p)
                if not st:
                    continue
                n = names[id(p)]
                local[n] = state_out(st) if torch_opt else dict(st)
                desc[n] = {k: (("a", tuple(v.shape), np.dtype(v.dtype).str) if _is_array(v)
                               else ("s", _plain(v))) for k, v in local[n].items()}
    seen = g.all_gather_object((desc, groups)) if g.size > 1 else [(desc, groups)]
    order = {n: i for i, n in enumerate(stage.param_names)}
    merged: list[tuple[dict[str, Any], list[str]]] = []
    ref = next(((r, gs) for r, (_, gs) in enumerate(seen) if gs is not None), None)
    for r, (_, gs) in enumerate(seen):
        if gs is None:
            continue
        if len(gs) != len(ref[1]):
            raise ValueError(f"{where}: rank {r}'s optimizer has {len(gs)} param groups, rank "
                             f"{ref[0]}'s {len(ref[1])}: every stage's optimizer needs the same groups")
        for i, (settings, _) in enumerate(gs):
            if settings != ref[1][i][0]:
                diff = sorted(k for k in set(settings) | set(ref[1][i][0])
                              if settings.get(k) != ref[1][i][0].get(k))
                raise ValueError(f"{where}: param group {i} has settings {diff} different on rank {r} "
                                 f"and rank {ref[0]}: one checkpoint holds one value per group")
    if ref is not None:
        for i, (settings, _) in enumerate(ref[1]):
            params = sorted((n for _, gs in seen if gs is not None for n in gs[i][1]), key=order.__getitem__)
            merged.append((settings, params))
    state: dict[str, dict[str, Any]] = {}
    everything = {n: d for d, _ in seen for n, d in d.items()}
    for n in sorted(everything, key=order.__getitem__):
        entry: dict[str, Any] = {}
        for k, (kind, *rest) in everything[n].items():
            if kind == "s":
                entry[k] = rest[0]
                continue
            shape, dtype = tuple(rest[0]), np.dtype(rest[1])
            v = local.get(n, {}).get(k)
            if owner and v is not None:
                entry[k] = Shard(v, shape, (0,) * len(shape))
            else:
                entry[k] = Shard(np.empty((0,) + shape[1:], dtype), shape, (0,) * len(shape))
        state[n] = entry
    out_groups = []
    for settings, params in merged:
        gd = {k: (tuple(v) if isinstance(v, list) else v) for k, v in settings.items()}
        gd["params"] = params
        out_groups.append(gd)
    return {"state": state, "param_groups": out_groups}


def load_optim_state_dict(stage: Any, optimizer: Any, state: Any) -> None:
    """Load this rank's part of a whole model's optimizer state: name-keyed (a pipeline's of any
    split, DDP's, FSDP's, a plain optimizer's over ``model.named_parameters()``) or index-keyed in
    the whole model's parameter order (an older checkpoint of an optimizer over
    ``model.parameters()``)."""
    g = stage.group
    where = f"PipelineStage.load_optim_state_dict (rank {g.rank} of {g.size})"
    names = _names(stage, optimizer, where)
    load_by_name(where, optimizer, names, by_name(where, state, stage.param_names),
                 known=set(stage.param_names))

"""Checks of loaded optimizer state, shared by ``Optimizer.load_state_dict``, ``ZeroRedundancyOptimizer``
and ``FSDP.load_optim_state_dict``.

A checkpoint is data from outside: a row-shaped or 3-D ``exp_avg``, a string ``lr`` or state for
a parameter that does not exist would otherwise load and fail at the first ``step()`` with a numpy
error naming nothing, or be dropped silently so training resumes with fresh moments. Everything
is checked before anything is changed, and an error names the entry (``parameter 3 ['exp_avg']``,
``param group 0 'lr'``), what it holds and what was expected.

What each optimizer keeps is declared on its class as ``state_spec``: entry name -> ``"param"``
(an array of the parameter's shape and a number dtype), ``"param?"`` (the same, optional) or
``"count"`` (a non-negative integer, such as Adam's ``step``). An optimizer without a spec gets
the generic checks only: arrays of numbers, nothing else looked at.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Mapping

import numpy as np

from ..nn.backend import to_module, xp_of

__all__ = ["check_groups", "load_param_state", "state_index", "require_state_dict", "check_index_keyed"]

#: hyper-parameters that the built-in optimizers refuse below zero at construction
_NONNEGATIVE = frozenset({"lr", "eps", "weight_decay", "momentum"})


def _scalar(v: Any) -> Any:
    """A numpy scalar or 0-d array as the Python value; anything else unchanged."""
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray) and v.ndim == 0:
        return v.item()
    return v


def _real(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _hparam(where: str, label: str, key: str, default: Any, v: Any) -> Any:
    """``v`` as the type of ``default`` (HDF5 gives numpy scalars and arrays back), or raise."""
    got = _scalar(v)
    if isinstance(default, bool):
        if not isinstance(got, bool):
            raise TypeError(f"{where}: {label} must be a bool, got {_show(v)}")
        return got
    if _real(default):
        if not _real(got) or not math.isfinite(got):
            raise TypeError(f"{where}: {label} must be a finite number, got {_show(v)}")
        if key in _NONNEGATIVE and got < 0:
            raise ValueError(f"{where}: {label} must be >= 0, got {got!r}")
        return got
    if isinstance(default, tuple):
        seq = v.tolist() if isinstance(v, np.ndarray) else v
        if not isinstance(seq, (list, tuple)) or len(seq) != len(default) \
                or not all(_real(_scalar(x)) and math.isfinite(_scalar(x)) for x in seq):
            raise TypeError(f"{where}: {label} must be {len(default)} finite numbers like "
                            f"{default!r}, got {_show(v)}")
        out = tuple(float(_scalar(x)) if isinstance(d, float) else _scalar(x)
                    for x, d in zip(seq, default))
        if key == "betas" and not all(0.0 <= b < 1.0 for b in out):
            raise ValueError(f"{where}: {label} must lie in [0, 1), got {out!r}")
        return out
    return v   # a setting the optimizer has no typed default for: kept as given


def _show(v: Any) -> str:
    text = repr(v)
    return f"{type(v).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def check_groups(where: str, defaults: Mapping[str, Any], mine: list[dict[str, Any]],
                 theirs: Any) -> list[dict[str, Any]]:
    """The loaded groups' settings (without ``params``), typed like ``defaults``; raises before
    anything is changed. ``mine`` are the optimizer's groups (their count must match)."""
    if not isinstance(theirs, (list, tuple)) or not all(isinstance(g, Mapping) for g in theirs):
        raise TypeError(f"{where}: 'param_groups' must be a list of dicts, got {_show(theirs)}")
    if len(theirs) != len(mine):
        raise ValueError(f"{where}: loaded state has {len(theirs)} param groups, the optimizer "
                         f"has {len(mine)}")
    out = []
    for i, (cur, g) in enumerate(zip(mine, theirs)):
        typed = {}
        for k, v in g.items():
            if k == "params":
                continue
            like = cur.get(k, defaults.get(k))
            typed[k] = _scalar(v) if like is None else _hparam(where, f"param group {i} {k!r}", k, like, v)
        out.append(typed)
    return out


def state_index(where: str, groups: list[Mapping[str, Any]], state: Any) -> dict[int, Any]:
    """``state`` keyed by int index (HDF5 gives string keys back); every index must be one that
    a loaded group lists, or the state would be dropped without a word."""
    if not isinstance(state, Mapping):
        raise TypeError(f"{where}: 'state' must be a dict, got {_show(state)}")
    listed: set[int] = set()
    for g in groups:
        for j in g.get("params", []):
            listed.add(_index(where, j, "a param group lists"))
    out: dict[int, Any] = {}
    for k, v in state.items():
        i = _index(where, k, "state is keyed by")
        if i not in listed:
            raise KeyError(f"{where}: state for parameter {i}, which no loaded param group lists "
                           f"(they list {len(listed)} parameters: {_span(listed)})")
        out[i] = v
    return out


def _index(where: str, k: Any, what: str) -> int:
    k = _scalar(k)
    if isinstance(k, bool) or not isinstance(k, (int, str)) or (isinstance(k, str) and not k.isdigit()):
        raise TypeError(f"{where}: {what} {_show(k)}, not a parameter index")
    return int(k)


def _span(ids: set[int]) -> str:
    s = sorted(ids)
    return "none" if not s else (f"{s[0]}..{s[-1]}" if s == list(range(s[0], s[-1] + 1)) else str(s[:8]))


def check_state_keys(where: str, label: str, spec: Mapping[str, str] | None, state: Any) -> None:
    """``state`` (one parameter's) is a dict whose keys are ``spec``'s: none unknown, none missing
    but the optional ones (kinds ending in ``?``); a None ``spec`` checks only the dict."""
    if not isinstance(state, Mapping):
        raise TypeError(f"{where}: state of {label} must be a dict, got {_show(state)}")
    if spec is not None:
        unknown = [k for k in state if k not in spec]
        if unknown:
            raise KeyError(f"{where}: state of {label} has entries {unknown} this optimizer does "
                           f"not keep (it keeps {sorted(spec)})")
        missing = [k for k, kind in spec.items() if state and k not in state and not kind.endswith("?")]
        if missing:
            raise KeyError(f"{where}: state of {label} lacks {missing}")


def load_param_state(where: str, label: str, spec: Mapping[str, str] | None, state: Any,
                     like: Any) -> dict[str, Any]:
    """One parameter's loaded state, checked against ``spec`` and the parameter data ``like``,
    arrays copied onto its array module (floating ones in its dtype)."""
    check_state_keys(where, label, spec, state)
    out: dict[str, Any] = {}
    for k, v in state.items():
        kind = None if spec is None else spec[k].rstrip("?")
        entry = f"{label}[{k!r}]"
        if kind == "count":
            out[k] = _count(where, entry, v)
        elif kind == "param":
            out[k] = _array(where, entry, v, like, same_shape=True)
        elif hasattr(v, "shape") and hasattr(v, "dtype"):
            out[k] = int(v) if k == "step" and v.ndim == 0 else _array(where, entry, v, like, False)
        else:
            out[k] = v
    return out


def _count(where: str, entry: str, v: Any) -> int:
    got = _scalar(v)
    if isinstance(got, float) and math.isfinite(got) and got == int(got):
        got = int(got)   # torch keeps step as a float tensor
    if isinstance(got, bool) or not isinstance(got, int) or got < 0:
        raise TypeError(f"{where}: state {entry} must be a non-negative integer, got {_show(v)}")
    return got


def _array(where: str, entry: str, v: Any, like: Any, same_shape: bool) -> Any:
    if not (hasattr(v, "shape") and hasattr(v, "dtype")):
        raise TypeError(f"{where}: state {entry} must be an array of the parameter's shape "
                        f"{tuple(like.shape)}, got {_show(v)}")
    kind = np.dtype(v.dtype).kind
    ok = "fiu" + ("c" if np.dtype(like.dtype).kind == "c" else "")
    if kind not in ok:
        raise TypeError(f"{where}: state {entry} has dtype {np.dtype(v.dtype)}, not a number type "
                        f"the parameter ({np.dtype(like.dtype)}) can use")
    if same_shape and tuple(v.shape) != tuple(like.shape):
        raise ValueError(f"{where}: state {entry} has shape {tuple(v.shape)}, the parameter "
                         f"{tuple(like.shape)}")
    arr = to_module(v, xp_of(like))
    floating = np.issubdtype(np.dtype(arr.dtype), np.floating)
    dtype = like.dtype if same_shape or floating else arr.dtype   # moments: the parameter's dtype
    return arr.astype(dtype, copy=True)   # always a copy: the caller's arrays must not alias ours


def require_state_dict(where: str, state_dict: Any) -> None:
    """A dict with 'state' and 'param_groups', or a ``TypeError`` saying what came instead."""
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
        raise TypeError(f"{where}: expected a dict with 'state' and 'param_groups', got "
                        f"{type(state_dict).__name__}")


def check_index_keyed(where: str, defaults: Mapping[str, Any], mine: list[dict[str, Any]],
                      state_dict: Mapping[str, Any], params: list[Any],
                      spec: Mapping[str, str] | None) -> tuple[list[dict[str, Any]], dict[int, Any]]:
    """Check an index-keyed (torch-style) optimizer state against the optimizer's groups
    ``mine`` and its parameters in group order (``params``), changing nothing.

    Returns each group's typed hyper-parameters and ``{position in params: checked state}``.
    """
    groups = state_dict["param_groups"]
    settings = check_groups(where, defaults, mine, groups)
    for i, (g, theirs) in enumerate(zip(mine, groups)):
        if len(g["params"]) != len(theirs.get("params", ())):
            raise ValueError(f"{where}: param group {i}: loaded state has "
                             f"{len(theirs.get('params', ()))} parameters, the optimizer "
                             f"{len(g['params'])}")
    loaded = state_index(where, groups, state_dict["state"])
    saved = [int(j) for g in groups for j in g["params"]]
    checked = {pos: load_param_state(where, f"parameter {saved[pos]}", spec, loaded[saved[pos]], p.data)
               for pos, p in enumerate(params) if saved[pos] in loaded}
    return settings, checked

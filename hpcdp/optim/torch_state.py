"""A ``torch.optim`` optimizer's state in and out of hpcdp's name-keyed, pickle-free layout.

A torch optimizer keys its state by tensor and holds tensors in it: moments of the parameter's
shape, and 0-d tensors for counters (``step`` is a float32 tensor in torch 2.x; Adam refuses a
Python int there). A checkpoint holds numpy arrays and scalars only. So state goes out as numpy
views of the tensors (no copies: ``checkpoint.save`` copies what it writes) and comes back through
the same checks as an hpcdp optimizer's (``state_check``), then as fresh tensors through the
optimizer's own ``load_state_dict``, which runs its hooks and ``__setstate__`` defaults. A 0-d
entry goes back in the dtype the optimizer already uses for it, else in the saved floating dtype,
else in torch's scalar dtype, so an hpcdp Adam's integer ``step`` loads into torch's AdamW too.

torch is never imported here: everything is reached through the optimizer and tensors handed in.
"""
from __future__ import annotations

import math
import numbers
import sys
from typing import Any, Mapping

import numpy as np

from ..nn.torch_module import is_tensor, to_array, to_tensor
from .state_check import _array, _show, check_state_keys

__all__ = ["is_torch_optimizer", "torch_state_spec", "state_out", "group_out", "check_torch_state",
           "install_torch_state"]

_ADAM = {"step": "scalar", "exp_avg": "param", "exp_avg_sq": "param", "max_exp_avg_sq": "param?"}

#: what each of torch's own optimizers keeps per parameter (``state_check`` kinds, plus
#: ``"scalar"``: a finite real, a 0-d tensor in torch). A subclass or another optimizer is checked
#: against the state it already holds, or generically.
TORCH_STATE_SPECS: dict[str, dict[str, str]] = {
    "SGD": {"momentum_buffer": "param?"},
    "Adam": _ADAM, "AdamW": _ADAM,
    "NAdam": {"step": "scalar", "mu_product": "scalar", "exp_avg": "param", "exp_avg_sq": "param"},
    "RAdam": {"step": "scalar", "exp_avg": "param", "exp_avg_sq": "param"},
    "Adamax": {"step": "scalar", "exp_avg": "param", "exp_inf": "param"},
    "Adagrad": {"step": "scalar", "sum": "param"},
    "Adadelta": {"step": "scalar", "square_avg": "param", "acc_delta": "param"},
    "RMSprop": {"step": "scalar", "square_avg": "param", "momentum_buffer": "param?",
                "grad_avg": "param?"},
    "Rprop": {"step": "scalar", "prev": "param", "step_size": "param"},
    "ASGD": {"step": "scalar", "eta": "scalar", "mu": "scalar", "ax": "param"},
}

#: entries that count steps: a non-negative whole number
_COUNTERS = frozenset({"step"})


def is_torch_optimizer(optimizer: Any) -> bool:
    """Tell whether ``optimizer`` is a ``torch.optim.Optimizer`` (without importing torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(optimizer, torch.optim.Optimizer)


def torch_state_spec(optimizer: Any) -> dict[str, str] | None:
    """The per-parameter state spec of one of torch's own optimizer classes, else None."""
    cls = type(optimizer)
    if cls.__module__.startswith("torch.optim"):
        return TORCH_STATE_SPECS.get(cls.__name__)
    return None


def _out(v: Any) -> Any:
    return to_array(v) if is_tensor(v) else v


def state_out(state: Mapping[str, Any]) -> dict[str, Any]:
    """One parameter's torch state with every tensor as a numpy (or cupy) view of it."""
    return {k: _out(v) for k, v in state.items()}


def group_out(group: Mapping[str, Any]) -> dict[str, Any]:
    """A param group's settings (no ``params``) with tensors (a tensor ``lr``) as arrays and
    tuples of tensors (``betas``) as tuples of arrays."""
    out = {}
    for k, v in group.items():
        if k in ("params", "param_names"):
            continue
        out[k] = tuple(_out(x) for x in v) if isinstance(v, tuple) else _out(v)
    return out


def _real_value(where: str, entry: str, v: Any) -> float | int:
    """``v`` (a 0-d array or Python number) as a finite Python real, or raise."""
    if hasattr(v, "shape") and hasattr(v, "dtype"):
        if tuple(v.shape) != ():
            raise ValueError(f"{where}: state {entry} must be a single number, got an array of "
                             f"shape {tuple(v.shape)}")
        if np.dtype(v.dtype).kind not in "fiu":
            raise TypeError(f"{where}: state {entry} must be a real number, got dtype {np.dtype(v.dtype)}")
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
        raise TypeError(f"{where}: state {entry} must be a finite real number, got {_show(v)}")
    return v


def _scalar_tensor(where: str, entry: str, key: str, v: Any, current: Any, torch: Any) -> Any:
    value = _real_value(where, entry, v)
    if key in _COUNTERS and (value < 0 or value != int(value)):
        raise ValueError(f"{where}: state {entry} must be a non-negative whole number, got {value!r}")
    if is_tensor(current) and current.dim() == 0:
        dtype = current.dtype
    elif hasattr(v, "dtype") and np.dtype(v.dtype).kind == "f":
        dtype = torch.from_numpy(np.zeros((), np.dtype(v.dtype))).dtype
    else:   # torch's own choice for scalar state (``_get_scalar_dtype``)
        dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    return torch.tensor(value, dtype=dtype)


def check_torch_state(where: str, label: str, optimizer: Any, state: Any, param: Any) -> dict[str, Any]:
    """One parameter's loaded state as fresh tensors on ``param``'s device, checked first.

    Known keys come from the optimizer class (``TORCH_STATE_SPECS``) or, for another optimizer,
    from the state it already holds for ``param``; arrays must have the parameter's shape and a
    number dtype (copied in the parameter's dtype); 0-d entries must be finite reals (``step``
    whole and non-negative); ``None`` stays ``None`` where the entry is optional.
    """
    torch = sys.modules["torch"]
    spec = torch_state_spec(optimizer)
    current = optimizer.state.get(param) or {}
    keys = spec if spec is not None else ({k: "" for k in current} if current else None)
    check_state_keys(where, label, keys, state)
    like = to_array(param)
    out: dict[str, Any] = {}
    for k, v in state.items():
        entry = f"{label}[{k!r}]"
        kind = (spec or {}).get(k, "").rstrip("?")
        if v is None:
            if kind and not spec[k].endswith("?"):
                raise TypeError(f"{where}: state {entry} must be "
                                f"{'a number' if kind == 'scalar' else 'an array'}, got None")
            out[k] = None
            continue
        if not kind:   # an optimizer torch_state_spec does not know: judged by its shape
            kind = "param" if tuple(getattr(v, "shape", ())) != () else "scalar"
        if kind == "param":
            arr = _array(where, entry, v, like, same_shape=True)
            t = to_tensor(arr)
            out[k] = t if t.device == param.device else t.to(param.device)
        else:
            out[k] = _scalar_tensor(where, entry, str(k), v, current.get(k), torch)
    return out


def install_torch_state(optimizer: Any, settings: list[dict[str, Any]],
                        new_state: dict[Any, dict[str, Any]]) -> None:
    """Give ``optimizer`` checked ``settings`` (per group) and ``new_state`` (per parameter tensor)
    through its own ``load_state_dict``, keyed by position as torch expects."""
    positions: dict[int, int] = {}
    groups = []
    for mine, typed in zip(optimizer.param_groups, settings):
        ids = []
        for p in mine["params"]:
            positions[id(p)] = len(positions)
            ids.append(positions[id(p)])
        kept = {k: v for k, v in mine.items() if k not in ("params", "param_names")}
        groups.append({**kept, **{k: _like_current(v, mine.get(k)) for k, v in typed.items()},
                       "params": ids})
    state = {positions[id(p)]: st for p, st in new_state.items()}
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _like_current(v: Any, current: Any) -> Any:
    """A loaded setting as a tensor where the optimizer holds that setting as a tensor."""
    if is_tensor(current) and not is_tensor(v):
        torch = sys.modules["torch"]
        return torch.tensor(np.asarray(v).item(), dtype=current.dtype, device=current.device)
    return v

"""A model and its optimizer in and out of a checkpoint in one call each, torch models included.

``save`` and ``load`` move dicts of arrays; what goes into them for a training run is always the
same two things, the model's state and its optimizer's keyed by parameter name, so that the files
load under any layer, at any world size, and into a plain ``torch.nn.Module`` and ``torch.optim``
optimizer in one process::

    save(path, state_of(ddp, opt, step=step))          # every rank
    step = load_into(path, model, opt)["step"]         # any world size; or one process, plain torch

torch is never imported here; a torch module is recognised through ``sys.modules``.
"""
from __future__ import annotations

import os
from typing import Any

from ..nn.torch_module import is_torch_module, to_array, to_tensor
from ..optim.names import get_optimizer_state_dict, set_optimizer_state_dict
from ._reader import load

__all__ = ["state_of", "load_into"]


def _model_state(model: Any) -> dict[str, Any]:
    if is_torch_module(model):   # numpy views of torch's own state_dict (no adapter, no hooks)
        return {k: to_array(v) for k, v in model.state_dict().items()}
    return model.state_dict()


def state_of(model: Any, optimizer: Any = None, **extra: Any) -> dict[str, Any]:
    """Return ``{"model": ..., "optim": ..., **extra}`` for ``checkpoint.save``.

    Arrays in it are live views of the model's and optimizer's (``save`` copies what it writes).

    Args:
        model: a ``torch.nn.Module``, an hpcdp.nn module, or a layer (``DDP``, ``FSDP``, a
            pipeline stage: their own ``state_dict`` and ``optim_state_dict``).
        optimizer: a ``torch.optim`` or ``hpcdp.optim`` optimizer built on the model's (or
            layer's) parameters; None: no ``"optim"`` entry.
        extra: more entries (``step=...``): ints, floats, strings, arrays, dicts of them.
    """
    reserved = {"model", "optim"} & set(extra)
    if reserved:
        raise ValueError(f"state_of: {sorted(reserved)} are the model's and optimizer's entries")
    out = {"model": _model_state(model)}
    if optimizer is not None:
        out["optim"] = get_optimizer_state_dict(model, optimizer)
    out.update(extra)
    return out


def load_into(path: str | os.PathLike, model: Any, optimizer: Any = None, *,
              group: Any = None) -> dict[str, Any]:
    """Load the checkpoint ``path`` (saved from :func:`state_of`) into ``model`` and ``optimizer``.

    Collective over ``group`` like ``load``; arrays are read whole, so this serves models that
    every rank holds whole (one process, ``DDP``); for FSDP's shards use ``load(path, like=...)``.
    Every value is checked before it is used (``load``'s file checks, the model's shapes and
    dtypes, the optimizer state's keys, shapes, dtypes and settings). Returns the whole loaded
    state (its ``extra`` entries, such as ``"step"``).

    Args:
        path: the checkpoint directory.
        model: what to load ``state["model"]`` into (a ``torch.nn.Module``: tensors copied in
            place by its ``load_state_dict``, strict).
        optimizer: what to load ``state["optim"]`` into (None: skipped); built on ``model``'s
            parameters, with the saved param groups.
        group: the ranks that load together (default: the default group, or none at all).
    """
    state = load(path, group=group)
    if not isinstance(state, dict) or "model" not in state:
        raise KeyError(f"load_into {os.fspath(path)}: the checkpoint has no 'model' entry "
                       "(was it saved from state_of(model, optimizer)?)")
    where = f"load_into {os.fspath(path)}"
    saved = state["model"]
    _check_model_state(where, saved, _model_state(model))
    if optimizer is not None:   # checked whole before it changes anything, so it goes first
        if "optim" not in state:
            raise KeyError(f"{where}: the checkpoint has no 'optim' entry")
        set_optimizer_state_dict(model, optimizer, state["optim"])
    if is_torch_module(model):
        model.load_state_dict({k: to_tensor(v) for k, v in saved.items()})
    else:
        model.load_state_dict(saved)
    return state


def _check_model_state(where: str, saved: Any, mine: dict[str, Any]) -> None:
    """The saved model state has this model's keys, shapes and dtypes (before anything loads)."""
    if not isinstance(saved, dict):
        raise TypeError(f"{where}: 'model' is a {type(saved).__name__}, not a dict")
    missing = [k for k in mine if k not in saved]
    unexpected = [k for k in saved if k not in mine]
    if missing or unexpected:
        raise KeyError(f"{where}: the saved model state lacks {missing[:8]} and has {unexpected[:8]}, "
                       "which this model does not")
    bad = [f"{k}: saved {tuple(getattr(v, 'shape', ()))} {getattr(v, 'dtype', type(v).__name__)}, "
           f"model {tuple(mine[k].shape)} {mine[k].dtype}" for k, v in saved.items()
           if not hasattr(v, "shape") or tuple(v.shape) != tuple(mine[k].shape)
           or str(v.dtype) != str(mine[k].dtype)]
    if bad:
        raise ValueError(f"{where}: the saved model state does not fit this model: " + "; ".join(bad[:8]))

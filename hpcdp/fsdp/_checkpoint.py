"""FSDP state for checkpoints: Shards at global names, full gathers, name-keyed optimizer state.

What each rank returns from ``state_dict`` / ``optim_state_dict``:

* full_shard and shard_grad_op (n > 1): ``Shard(local rows, global shape, (lo, 0, ...))`` per
  parameter and per optimizer array of a parameter's shape; padding never leaves the unit.
* hybrid_shard: the replicas of shard group 0 give their blocks, the other replicas empty blocks
  (a checkpoint must not be written twice); loading broadcasts from replica 0 across replicas.
* no_shard or one rank: the plain arrays, as the bare model's ``state_dict`` would.

Loading takes, per name, a ``Shard`` (this rank's block, e.g. read back through ``like=``) or a
whole array (a checkpoint from DDP or a plain model, or optimizer state that ``like`` did not
describe, which ``checkpoint.load`` reads whole): this rank's rows are cut out of it.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .._arrays import to_host, xp_of
from ..errors import HpcdpError
from ..nn.backend import to_module
from ..nn.torch_module import is_tensor, to_array
from ..optim.names import by_name, optimizer_names
from ..optim.state_check import check_groups, load_param_state
from ._torch import is_torch_optimizer, load_torch_optim_state_dict, torch_optim_state_dict

__all__ = ["state_dict", "load_state_dict", "full_state_dict", "optim_state_dict", "load_optim_state_dict"]


def _shard_type() -> Any:
    # Imported on use: hpcdp.checkpoint brings h5py, which training alone does not need.
    from ..checkpoint import Shard

    return Shard


def _as_entry(fsdp: Any, slot: Any, local: Any) -> Any:
    Shard = _shard_type()
    comm = fsdp.comm
    if comm.n == 1:
        return local
    if comm.replica != 0:
        return Shard(local[:0], slot.shape, (0,) * len(slot.shape))
    return Shard(local, slot.shape, slot.offsets)


def _buffers(fsdp: Any) -> dict[str, Any]:
    names = {n for n, _ in fsdp._named_shards}
    sd = getattr(fsdp.module, "state_dict", None)
    if sd is None:
        return {}
    return {k: v for k, v in sd().items() if k not in names}


def _slots(fsdp: Any) -> dict[str, tuple[Any, Any, Any]]:
    """name -> (unit, slot, shard parameter)."""
    return {s.name: (u, s, sp) for u in fsdp.units for s, sp in zip(u.slots, u.shard_params)}


def state_dict(fsdp: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    slots = _slots(fsdp)
    for name, sp in fsdp._named_shards:
        out[name] = _as_entry(fsdp, slots[name][1], sp.data)
    out.update(_buffers(fsdp))
    return out


def _local_piece(where: str, name: str, value: Any, slot: Any, rank: int) -> Any | None:
    """This rank's rows from a Shard or a whole array; None for an empty block (hybrid replica)."""
    lo, hi = slot.bounds()
    if isinstance(value, _shard_type()):
        if tuple(value.global_shape) != slot.shape:
            raise ValueError(f"{where} (rank {rank}): {name!r} has global shape {value.global_shape}, "
                             f"the model has {slot.shape}")
        local = value.local
        if hi == lo:
            return local[:0]
        if local.size == 0 and slot.row_size != 0:
            return None
        start = value.offsets[0]
        if any(value.offsets[1:]) or tuple(local.shape[1:]) != slot.shape[1:] \
                or start > lo or start + local.shape[0] < hi:
            raise ValueError(f"{where} (rank {rank}): {name!r} is a block {tuple(local.shape)} at "
                             f"{value.offsets}, which does not hold this rank's rows [{lo}, {hi})")
        return local[lo - start:hi - start]
    shape = tuple(getattr(value, "shape", ()))
    if shape != slot.shape:
        raise ValueError(f"{where} (rank {rank}): {name!r} has shape {shape}, the model has {slot.shape}")
    return value[lo:hi]


def load_state_dict(fsdp: Any, state: dict[str, Any], strict: bool = True) -> None:
    where, rank = "FSDP.load_state_dict", fsdp.group.rank
    if fsdp._sched.summoned or fsdp._sched.in_backward:
        raise HpcdpError(f"{where} (rank {rank}): not inside summon_full_params() or backward")
    slots = _slots(fsdp)
    bufs = dict(fsdp.module.named_buffers()) if hasattr(fsdp.module, "named_buffers") else {}
    persistent = _buffers(fsdp)
    missing = [k for k in list(slots) + list(persistent) if k not in state]
    unexpected = [k for k in state if k not in slots and k not in bufs]
    if strict and (missing or unexpected):
        raise KeyError(f"{where} (rank {rank}): missing keys {missing}, unexpected keys {unexpected}")
    for name, (u, slot, sp) in slots.items():
        if name not in state:
            continue
        piece = _local_piece(where, name, state[name], slot, rank)
        if piece is not None:
            sp.data[...] = to_module(piece, xp_of(sp.data))
    for name, b in bufs.items():
        if name in state:
            shape = tuple(getattr(state[name], "shape", ()))
            if shape != tuple(b.shape):   # b[...] = v would broadcast a wrong shape silently
                raise ValueError(f"{where} (rank {rank}): buffer {name!r} has shape {shape}, the model "
                                 f"has {tuple(b.shape)}")
            b[...] = to_module(state[name], xp_of(b))
    rep = fsdp.comm.replicate
    if rep is not None and fsdp.comm.n > 1:  # hybrid: replicas other than 0 may have read nothing
        for u in fsdp.units:
            if u.S:
                rep.broadcast(u.flat, 0)


def full_state_dict(fsdp: Any) -> dict[str, Any]:
    comm = fsdp.comm
    out: dict[str, Any] = {}
    mine = fsdp.group.rank == 0
    if comm.replica != 0:
        return out
    for u in fsdp.units:
        if not u.slots:
            continue
        if comm.n == 1:
            full = to_host(u.flat).copy() if mine else None
        else:
            got = comm.shard.gather(u.flat, root=0)
            full = None
            if mine:
                full = np.empty(u.F, u.master_dtype)
                host = to_host(got)
                for slot in u.slots:
                    slot.copy_out(host, full)
        if mine:
            for slot in u.slots:
                out[slot.name] = slot.full_view(full)
    if not mine:
        return {}
    order = [n for n, _ in fsdp._named_shards]
    result = {n: out[n] for n in order}
    result.update({k: to_host(v).copy() for k, v in _buffers(fsdp).items()})
    return result


def _groups_out(optimizer: Any, names: dict[int, str]) -> list[dict[str, Any]]:
    groups = []
    for g in optimizer.param_groups:
        gd = {k: v for k, v in g.items() if k != "params"}
        gd["params"] = [names[id(p)] for p in g["params"]]
        groups.append(gd)
    return groups


def _name_map(fsdp: Any, optimizer: Any, where: str) -> dict[int, str]:
    return optimizer_names(f"{where} (rank {fsdp.group.rank})", fsdp._named_shards, optimizer,
                           "fsdp.parameters() (the shards)")


def optim_state_dict(fsdp: Any, optimizer: Any) -> dict[str, Any]:
    slots = _slots(fsdp)
    if is_torch_optimizer(optimizer):
        return torch_optim_state_dict(f"FSDP.optim_state_dict (rank {fsdp.group.rank})", fsdp._named_shards,
                                      optimizer, lambda name, v: _as_entry(fsdp, slots[name][1], v))
    names = _name_map(fsdp, optimizer, "FSDP.optim_state_dict")
    state: dict[str, Any] = {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            st = optimizer.state.get(p)
            if not st:
                continue
            name = names[id(p)]
            slot = slots[name][1]
            entry = {}
            for k, v in st.items():
                is_piece = hasattr(v, "shape") and tuple(v.shape) == tuple(p.data.shape) and v.ndim > 0
                entry[k] = _as_entry(fsdp, slot, v) if is_piece else v
            state[name] = entry
    return {"state": state, "param_groups": _groups_out(optimizer, names)}


def _check_groups(where: str, optimizer: Any, groups: Any, names: dict[int, str]) -> list[dict[str, Any]]:
    """The loaded groups' settings, checked (``optim._state_check``) before anything changes."""
    settings = check_groups(where, optimizer.defaults, optimizer.param_groups, groups)
    for i, (mine, theirs) in enumerate(zip(optimizer.param_groups, groups)):
        want = [names[id(p)] for p in mine["params"]]
        got = [str(n) for n in theirs.get("params", [])]
        if sorted(want) != sorted(got):
            raise ValueError(f"{where}: param group {i} holds {got}, the optimizer {want}")
    return settings


def load_optim_state_dict(fsdp: Any, optimizer: Any, osd: dict[str, Any]) -> None:
    """Load optimizer state keyed by name (any layer's, any world size) or by index (older
    checkpoints of DDP or a plain optimizer: the i-th parameter is the i-th of this optimizer's,
    in ``fsdp.parameters()`` order, which is the module's); shapes, dtypes and settings are
    checked (naming the parameter and the entry) before the optimizer changes."""
    where, rank = "FSDP.load_optim_state_dict", fsdp.group.rank
    slots = _slots(fsdp)
    at = f"{where} (rank {rank})"
    if is_torch_optimizer(optimizer):
        load_torch_optim_state_dict(at, fsdp._named_shards, optimizer, osd,
                                    lambda name, k, v: _local_piece(where, f"{name}.{k}", v, slots[name][1], rank))
        _replicate_state(fsdp, [optimizer.state.get(sp.tensor, {}) for _, sp in fsdp._named_shards])
        return
    names = _name_map(fsdp, optimizer, where)
    shard_of = {n: sp for n, sp in fsdp._named_shards}
    if not isinstance(osd, dict) or not isinstance(osd.get("state", {}), dict):
        raise TypeError(f"{at}: expected a dict with 'state' (a dict) and 'param_groups', got "
                        f"{type(osd).__name__}")
    if "param_groups" in osd:
        osd = by_name(at, osd, [names[id(p)] for g in optimizer.param_groups for p in g["params"]])
    settings = _check_groups(at, optimizer, list(osd.get("param_groups", [])), names)
    spec = getattr(type(optimizer), "state_spec", None)
    new_state: dict[Any, dict[str, Any]] = {}
    for name, st in osd.get("state", {}).items():
        name = str(name)
        if name not in shard_of:
            raise KeyError(f"{at}: state for {name!r}, which this model does not have")
        if not isinstance(st, dict):
            raise TypeError(f"{at}: state of {name!r} must be a dict, got {type(st).__name__}")
        sp, slot = shard_of[name], slots[name][1]
        entry: dict[str, Any] = {}
        for k, v in st.items():
            if isinstance(v, _shard_type()) or (hasattr(v, "shape") and tuple(v.shape) == slot.shape and v.ndim > 0):
                piece = _local_piece(where, f"{name}.{k}", v, slot, rank)
                entry[k] = xp_of(sp.data).zeros_like(sp.data) if piece is None else piece
            else:
                entry[k] = v   # a scalar, or an array of another shape: the check names it
        new_state[sp] = load_param_state(at, repr(name), spec, entry, sp.data)
    for mine, typed in zip(optimizer.param_groups, settings):
        mine.update(typed)
    _replicate_state(fsdp, [new_state.get(sp, {}) for _, sp in fsdp._named_shards])
    optimizer.state = new_state


def _replicate_state(fsdp: Any, entries: list[dict[str, Any]]) -> None:
    """hybrid_shard: replica 0's loaded optimizer arrays to the other replicas (which read nothing)."""
    rep = fsdp.comm.replicate
    if rep is None or fsdp.comm.n == 1:
        return
    for entry in entries:
        for k in sorted(entry):
            v = entry[k]
            if hasattr(v, "shape") and len(v.shape) > 0:
                rep.broadcast(to_array(v) if is_tensor(v) else v, 0)

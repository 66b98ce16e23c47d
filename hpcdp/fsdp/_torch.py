"""What FSDP does differently for a torch model: tensors at the edges, the torch user's loop, torch.optim.

FSDP wraps a ``torch.nn.Module`` through ``hpcdp.nn.from_torch``: the adapter mirrors the torch
module tree, so units are mirror submodules whose hooks fire from torch's own, and the model's
parameters are ``TorchParameter``s, whose ``.data``/``.grad`` assignments make torch compute with
FSDP's gathered buffers and accumulate into its gradient buffers. The rest of FSDP is unchanged;
this module holds the few places where a torch model differs:

* **Inputs and gradients as tensors.** Mixed precision casts floating tensor inputs as it casts
  arrays (bfloat16: rounded through ``torch.bfloat16``, computed in float32, as the emulation
  does for arrays).
* **The torch user's loop** (:class:`TorchPass`): tensors out of a training forward mean the user
  will call ``loss.backward()``. The schedule's backward is opened at the end of the forward
  (before torch's backward can start: the unit hooks need it) and
  ``TorchModule.expect_backward`` closes it (``finish_backward``: reductions launched and waited
  for) when the last parameter the backward reaches has its gradient, so the shards' ``.grad``
  are reduced when ``loss.backward()`` returns, as torch's FSDP does.
* **torch.optim over the shards**: state keyed by tensors (``step`` a 0-d tensor), saved as
  hpcdp's name-keyed layout (Shards of the parameters' global shapes; ``step`` a float) and
  loaded back through the optimizer's own ``load_state_dict``.
* **Saved parameters** (:class:`SavedParams`): what autograd saves of a gathered parameter is
  held as a marker, so resharding after forward frees the gathered memory for torch layers too.
"""
from __future__ import annotations

import sys
from typing import Any, Callable

import numpy as np

from ..errors import HpcdpError
from ..nn.torch_module import TorchModule, is_tensor, output_tensors, unfinished_backward
from ._api import BF16
from ._unit import GATHERED

__all__ = ["cast_tensor", "TorchPass", "SavedParams", "torch_optim_state_dict", "load_torch_optim_state_dict",
           "is_torch_optimizer"]


def _torch() -> Any:
    import torch  # only reached with a torch model in hand: torch is imported already

    return torch


def cast_tensor(t: Any, dtype: Any) -> Any:
    """A floating tensor in the compute dtype (bfloat16: rounded, kept as float32); others as they are."""
    if not t.is_floating_point():
        return t
    torch = _torch()
    if dtype == BF16:
        return t.to(torch.bfloat16).to(torch.float32)
    want = torch.from_numpy(np.empty(0, np.dtype(dtype))).dtype
    return t if t.dtype == want else t.to(want)


class TorchPass:
    """The backward of a torch forward's outputs, awaited for ``loss.backward()``.

    ``open(out, sync)`` after a training forward that returned tensors; the schedule's backward
    is then open until torch's backward reaches the last parameter, when ``finish`` runs (inside
    that backward, from the parameter's post-accumulate-grad hook). A new forward before that
    (``check``) forgets a forward whose outputs got no backward, and raises if a backward reached
    only part of the parameters (their reductions never ran: the ranks would disagree on the
    collectives posted).
    """

    def __init__(self, module: TorchModule, sched: Any, rank: int) -> None:
        self.module, self.sched, self.rank = module, sched, rank
        self.pending = False

    def open(self, out: Any, sync: bool) -> None:
        sched = self.sched
        if not any(t.requires_grad for t in output_tensors(out)):
            return
        sched.begin_backward(sync)

        def done() -> None:
            self.pending = False
            try:
                sched.finish_backward()
            except BaseException:
                sched.abort_backward()
                raise

        self.pending = True
        if not self.module.expect_backward(out, done):
            self.pending = False   # nothing to differentiate (frozen model)
            sched.in_backward = False

    def check(self) -> None:
        if not self.pending:
            return
        self.pending = False
        arrived, missing = self.module.cancel_expected()
        sched = self.sched
        started = bool(sched.stack) or any(u.bwd_count for u in sched.units)
        if not arrived and not started:
            # no backward ran: close the pass (no_sync's kept gradients stay kept)
            sched.in_backward = sched.forward_pending = False
            sched.phase = "fwd"
            return
        sched.abort_backward()   # reshard, drop this step's unreduced gradients
        if not arrived:
            return   # a backward that raised before any parameter's gradient: nothing was reduced
        raise unfinished_backward(f"FSDP forward (rank {self.rank})", missing, "units were")

    def refuse_numpy_backward(self) -> None:
        if self.pending:
            raise HpcdpError(
                f"FSDP.backward (rank {self.rank}): the forward returned torch tensors, so its backward "
                "is torch's: call loss.backward() (gradients are reduced into the shards when it "
                "returns), or pass numpy arrays to the forward to use fsdp.backward(grad)")


class SavedParams:
    """Autograd's saved parameters held as markers while a unit is resharded (full_shard).

    Torch saves what a layer's backward needs when the forward runs: a parameter itself
    (``Conv2d``) or a view of it (``Linear`` saves ``weight.t()``). A saved view would hold the
    unit's gathered buffer until backward, losing what resharding after forward saves. Inside
    the forward (``torch.autograd.graph.saved_tensors_hooks``) a saved tensor whose memory is a
    gathered parameter of a unit is replaced by a marker (unit, parameter, view geometry); when
    backward unpacks it, the unit's backward pre-hook has gathered it again, and the marker
    becomes the same view of the re-gathered parameter. Everything else is saved as torch does.
    """

    def __init__(self, units: list[Any]) -> None:
        self.units = units

    def hooks(self) -> Any:
        return _torch().autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: Any) -> Any:
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):   # a tensor without plain storage
            return t
        if not ptr:
            return t
        for u in self.units:
            if u.state != GATHERED:
                continue
            for i, slot in enumerate(u.slots):
                pt = slot.param.tensor
                if pt.numel() and pt.untyped_storage().data_ptr() == ptr and pt.dtype == t.dtype:
                    offset = (t.data_ptr() - ptr) // t.element_size()
                    return _Marker(u, i, tuple(t.shape), tuple(t.stride()), offset)
        return t

    def unpack(self, saved: Any) -> Any:
        if not isinstance(saved, _Marker):
            return saved
        u = saved.unit
        if u.state != GATHERED:
            raise HpcdpError(
                f"FSDP unit {u.name!r} (rank {u.comm.group.rank}): backward needs its parameter "
                f"{u.slots[saved.slot].name!r} after the unit's trainable parameters got their "
                "gradients and it was resharded (a use of it outside their gradients' path, e.g. "
                "through .detach()); use strategy='shard_grad_op'")
        base = u.slots[saved.slot].param.tensor.detach()
        return base.as_strided(saved.shape, saved.stride, saved.offset)


class _Marker:
    __slots__ = ("unit", "slot", "shape", "stride", "offset")

    def __init__(self, unit: Any, slot: int, shape: tuple, stride: tuple, offset: int) -> None:
        self.unit, self.slot, self.shape, self.stride, self.offset = unit, slot, shape, stride, offset


# -- torch.optim over the shards ---------------------------------------------------------------------
def is_torch_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a ``torch.optim.Optimizer`` (without importing torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(optimizer, torch.optim.Optimizer)


def _names(where: str, named_shards: list[tuple[str, Any]], optimizer: Any) -> dict[int, str]:
    names = {id(sp.tensor): n for n, sp in named_shards}
    for g in optimizer.param_groups:
        for p in g["params"]:
            if id(p) not in names:
                raise ValueError(f"{where}: the optimizer holds a tensor of shape {tuple(p.shape)} that "
                                 "is not one of this FSDP's shards; build it on fsdp.parameters()")
    return names


def torch_optim_state_dict(where: str, named_shards: list[tuple[str, Any]], optimizer: Any,
                           as_entry: Callable[[str, Any], Any]) -> dict[str, Any]:
    """A torch optimizer's state keyed by name: arrays of a shard's shape through ``as_entry(name,
    array)`` (a Shard of the global parameter), 0-d tensors (``step``) as Python numbers."""
    names = _names(where, named_shards, optimizer)
    state: dict[str, Any] = {}
    groups = []
    for g in optimizer.param_groups:
        for p in g["params"]:
            st = optimizer.state.get(p)
            if not st:
                continue
            entry: dict[str, Any] = {}
            for k, v in st.items():
                if is_tensor(v) and v.dim() == 0:
                    entry[k] = v.item()
                elif is_tensor(v) and tuple(v.shape) == tuple(p.shape):
                    entry[k] = as_entry(names[id(p)], v.detach().cpu().numpy())
                elif is_tensor(v):
                    entry[k] = v.detach().cpu().numpy()
                else:
                    entry[k] = v
            state[names[id(p)]] = entry
        groups.append({**{k: v for k, v in g.items() if k != "params"},
                       "params": [names[id(p)] for p in g["params"]]})
    return {"state": state, "param_groups": groups}


def load_torch_optim_state_dict(where: str, named_shards: list[tuple[str, Any]], optimizer: Any,
                                osd: Any, local_piece: Callable[[str, str, Any], Any]) -> None:
    """Load name-keyed state (from any layer or world size) into a torch optimizer over the shards.

    ``local_piece(name, key, value)`` cuts this rank's rows out of a Shard or whole array (None:
    an empty block, a hybrid replica that reads nothing). The state is handed to the optimizer's
    own ``load_state_dict`` (index-keyed, as torch expects), which checks the groups and casts.
    """
    torch = _torch()
    names = _names(where, named_shards, optimizer)
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    index = {n: i for i, n in enumerate(order)}
    shard_of = {n: sp for n, sp in named_shards}
    if not isinstance(osd, dict) or not isinstance(osd.get("state", {}), dict):
        raise TypeError(f"{where}: expected a dict with 'state' (a dict) and 'param_groups', got "
                        f"{type(osd).__name__}")
    groups = list(osd.get("param_groups", []))
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(f"{where}: the state has {len(groups)} param groups, the optimizer "
                         f"{len(optimizer.param_groups)}")
    out_groups = []
    for i, (mine, theirs) in enumerate(zip(optimizer.param_groups, groups)):
        want = [names[id(p)] for p in mine["params"]]
        got = [str(n) for n in theirs.get("params", [])]
        if sorted(want) != sorted(got):
            raise ValueError(f"{where}: param group {i} holds {got}, the optimizer {want}")
        settings = {k: (tuple(v) if isinstance(v, list) and isinstance(mine.get(k), tuple) else v)
                    for k, v in theirs.items() if k != "params"}
        out_groups.append({**settings, "params": [index[n] for n in want]})
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    state: dict[int, dict[str, Any]] = {}
    for name, st in osd.get("state", {}).items():
        name = str(name)
        if name not in index:
            raise KeyError(f"{where}: state for {name!r}, which this optimizer does not hold")
        if not isinstance(st, dict):
            raise TypeError(f"{where}: state of {name!r} must be a dict, got {type(st).__name__}")
        sp = shard_of[name]
        entry: dict[str, Any] = {}
        for k, v in st.items():
            if hasattr(v, "global_shape") or (hasattr(v, "shape") and getattr(v, "ndim", 0) > 0):
                piece = local_piece(name, k, v)
                arr = np.zeros_like(sp.data) if piece is None else np.array(piece, dtype=sp.data.dtype)
                if tuple(arr.shape) != tuple(sp.data.shape):
                    raise ValueError(f"{where}: {name}[{k!r}] has shape {tuple(arr.shape)}, this "
                                     f"rank's shard {tuple(sp.data.shape)}")
                entry[k] = torch.from_numpy(arr)
            elif isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool):
                entry[k] = torch.tensor(float(v), dtype=scalar)   # torch keeps ``step`` as a 0-d tensor
            else:
                entry[k] = v
        state[index[name]] = entry
    optimizer.load_state_dict({"state": state, "param_groups": out_groups})

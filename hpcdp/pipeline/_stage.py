"""``PipelineStage``: this rank's stages of a ``Sequential``, with the unsplit model's names.

The model is cut between children into ``group.size * virtual`` stages, balanced by parameter
count unless ``split_points`` says where; stage ``s`` runs on rank ``s % group.size``. Each stage is
an ``nn.Sequential`` whose children keep their names in the whole model (``"3"``, ``"4"``), so
``named_parameters()`` and ``state_dict()`` use the unsplit names and a checkpoint written by one
split loads into another, or into the plain model.

A ``torch.nn.Sequential`` is cut the same way (``_torch``): each stage is a torch Sequential of the
model's own child modules, and ``parameters()`` yields their torch tensors, for ``torch.optim``.
"""
from __future__ import annotations

import weakref
from typing import Any, Iterator, Sequence

import numpy as np

from .. import nn
from ..comm.world import get_default_group
from ..errors import CollectiveMismatchError
from ..nn.torch_module import TorchModule, is_torch_module
from . import _optim
from ._torch import torch_children, torch_entries, torch_stage

__all__ = ["PipelineStage", "balanced_split"]


def balanced_split(sizes: Sequence[int], parts: int) -> list[int]:
    """Split points (indices where stages 1.. start) cutting ``sizes`` into ``parts`` contiguous
    non-empty runs with the smallest possible largest run sum (ties: earliest cuts)."""
    n = len(sizes)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot cut {n} layers into {parts} non-empty stages")
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + int(s))
    inf = float("inf")
    # best[k][i]: smallest largest-run for the first i items in k runs; cut[k][i]: where run k starts
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    points, i = [], n
    for k in range(parts, 0, -1):
        i = cut[k][i]
        points.append(i)
    return sorted(points)[1:]


class PipelineStage:
    """This rank's part of ``model`` for a pipeline over ``group``.

    Args:
        model: an ``nn.Sequential`` or a ``torch.nn.Sequential`` (its children are the units that
            get split); every rank builds the same model (same seed) and keeps only its stages.
        split_points: child indices where stages ``1 .. n-1`` start (``n = group.size * virtual``);
            None balances parameter counts.
        virtual: stages per rank (for ``interleaved_1f1b``); stage ``s`` runs on rank ``s % size``.
        group: the pipeline's ranks (default: the default group); collective over it.
        split_backward: for a torch model: the zero-bubble schedule's input gradient (``I``) and
            weight gradient (``W``) are separate torch backward passes, so weight work really is
            deferred (a second traversal of the kept graph). False: ``I`` does both and ``W``
            nothing, one traversal, no deferral; either gives the same gradients.

    For a torch model, ``parameters()`` and ``named_parameters()`` yield the torch parameters (give
    them to a ``torch.optim`` optimizer), and the stages' modules are ``hpcdp.nn.from_torch``
    adapters of torch Sequentials holding the model's own child modules.
    """

    def __init__(self, model: Any, split_points: Sequence[int] | None = None, virtual: int = 1,
                 group: Any = None, *, split_backward: bool = True) -> None:
        if group is None:
            group = get_default_group()
        if isinstance(model, TorchModule):
            model = model.torch   # a from_torch adapter: its torch model is what gets split
        #: whether the model is a torch one (parameters() then yields torch tensors)
        self.is_torch = is_torch_module(model)
        if not self.is_torch and not isinstance(model, nn.Sequential):
            raise TypeError(f"PipelineStage: the model must be an nn.Sequential (its children are split "
                            f"into stages), got {type(model).__name__}")
        if isinstance(virtual, bool) or not isinstance(virtual, int) or virtual < 1:
            raise ValueError(f"PipelineStage: virtual must be a positive int, got {virtual!r}")
        if not getattr(group, "is_member", True) or group.rank < 0:
            raise ValueError(f"PipelineStage: this rank is not a member of group {group.name}; "
                             f"only the group's ranks build its stages")
        where = f"PipelineStage (rank {group.rank} of {group.size})"
        if self.is_torch:
            children = torch_children(model, where)
        else:
            own = [n for n, _ in model.named_parameters(recurse=False)] + list(model._buffers)
            if own:
                raise ValueError(f"PipelineStage: the Sequential holds parameters or buffers of its "
                                 f"own ({own}); move them into a child module")
            children = list(model.named_children())
        self.group = group
        self.virtual = virtual
        self.n_stages = group.size * virtual
        if len(children) < self.n_stages:
            raise ValueError(f"{where}: {len(children)} layers cannot fill {self.n_stages} stages "
                             f"({group.size} ranks x {virtual} virtual)")
        sizes = [sum(int(np.prod(p.shape)) for p in c.parameters()) for _, c in children]
        if split_points is None:
            points = balanced_split(sizes, self.n_stages)
        else:
            points = [int(i) for i in split_points]
            if len(points) != self.n_stages - 1 or points != sorted(set(points)) or (
                    points and (points[0] < 1 or points[-1] >= len(children))):
                raise ValueError(f"{where}: split_points must be {self.n_stages - 1} increasing "
                                 f"child indices in [1, {len(children) - 1}], got {list(split_points)}")
        bounds = list(zip([0] + points, points + [len(children)]))
        mine = (len(children), sizes, points, [n for n, _ in children])
        if group.size > 1:
            seen = group.all_gather_object(mine)
            bad = [r for r, s in enumerate(seen) if s != mine]
            if bad:
                raise CollectiveMismatchError(
                    f"{where}: ranks {bad} built a different model or split (layers, parameter counts "
                    f"or split points differ): every rank must build the same model")
        self.bounds: tuple[tuple[int, int], ...] = tuple(bounds)
        self.stage_ids: tuple[int, ...] = tuple(range(group.rank, self.n_stages, group.size))
        owner: dict[int, int] = {}  # id(parameter) -> stage, to refuse weights tied across stages
        self.modules: dict[int, Any] = {}   # stage -> nn.Sequential, or a from_torch adapter
        for s, (lo, hi) in enumerate(bounds):
            for cname, child in children[lo:hi]:
                for pname, p in child.named_parameters():
                    if owner.setdefault(id(p), s) != s:
                        raise ValueError(f"{where}: parameter {cname}.{pname} is shared by stages "
                                         f"{owner[id(p)]} and {s}; tied weights must stay in one stage")
            if s in self.stage_ids and self.is_torch:
                self.modules[s] = torch_stage(children[lo:hi], split_backward)
            elif s in self.stage_ids:
                chunk = nn.Sequential()
                for name, child in children[lo:hi]:
                    chunk.add_module(name, child)
                self.modules[s] = chunk
        # Every entry of the whole model's state: name -> (shape, dtype, stage), for checkpoints.
        stage_of = {name: s for s, (lo, hi) in enumerate(bounds) for name, _ in children[lo:hi]}
        described = torch_entries(model) if self.is_torch else {
            key: (tuple(val.shape), np.dtype(val.dtype)) for key, val in model.state_dict().items()}
        self._entries: dict[str, tuple[tuple[int, ...], np.dtype, int]] = {
            key: (shape, dtype, stage_of[key.split(".", 1)[0]]) for key, (shape, dtype) in described.items()}
        #: the unsplit model's parameter names, in its order (index-keyed optimizer state counts so)
        self.param_names: tuple[str, ...] = tuple(n for n, _ in model.named_parameters())
        #: the data-parallel replicas of these stages (set by ``Pipeline(dp_group=...)``): only
        #: replica 0 writes entries by default
        self.dp_group: Any = None
        # opt.state_dict() on these parameters defers to optim_state_dict (the whole model's state);
        # a torch optimizer's state_dict stays torch's own
        if not self.is_torch:
            for _, p in self.named_parameters():
                p._state_owner = weakref.ref(self)

    # -- who is where ---------------------------------------------------------------------------
    @property
    def is_first(self) -> bool:
        """Whether this rank runs stage 0 (reads the input)."""
        return 0 in self.modules

    @property
    def is_last(self) -> bool:
        """Whether this rank runs the last stage (computes the loss)."""
        return self.n_stages - 1 in self.modules

    def layer_range(self, stage: int) -> tuple[int, int]:
        """``[lo, hi)`` child indices of the model that ``stage`` runs."""
        return self.bounds[stage]

    # -- parameters and modes ---------------------------------------------------------------------
    def named_parameters(self) -> Iterator[tuple[str, Any]]:
        """This rank's parameters under their names in the unsplit model (a torch model's: its
        torch parameters)."""
        for name, p in self._named_params():
            yield name, (p.tensor if self.is_torch else p)

    def parameters(self) -> Iterator[Any]:
        """This rank's parameters (for the optimizer; a torch model's for ``torch.optim``)."""
        for _, p in self.named_parameters():
            yield p

    def _named_params(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The stages' hpcdp parameters (a torch model's adapters), what the runtime works on."""
        for s in self.stage_ids:
            yield from self.modules[s].named_parameters()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for m in self.modules.values():
            m.zero_grad(set_to_none)

    def train(self, mode: bool = True) -> PipelineStage:
        for m in self.modules.values():
            m.train(mode)
        return self

    def eval(self) -> PipelineStage:
        return self.train(False)

    def saved_count(self) -> int:
        """Saved activations still held by this rank's stages (0 after a complete step)."""
        return sum(m.saved_count() for m in self.modules.values())

    # -- state ----------------------------------------------------------------------------------------
    def local_state_dict(self) -> dict[str, Any]:
        """``{unsplit name: array}`` of the entries this rank holds (live arrays, not copies)."""
        out: dict[str, Any] = {}
        for s in self.stage_ids:
            out.update(self.modules[s].state_dict())
        return out

    def _owner(self, owner: bool | None) -> bool:
        if owner is not None:
            return bool(owner)
        return self.dp_group is None or self.dp_group.rank == 0

    def state_dict(self, *, owner: bool | None = None) -> dict[str, Any]:
        """Every entry of the unsplit model as a checkpoint ``Shard`` at its unsplit name.

        The entries of this rank's stages are whole blocks, the others empty blocks, so
        ``hpcdp.checkpoint.save(path, {"model": stage.state_dict()})`` (collective) writes the
        whole model, and ``load(path, like={"model": stage.state_dict()})`` reads just this
        rank's entries. ``owner=False`` contributes empty blocks only: pass it on every data
        parallel replica but one when saving, so no entry is written twice (None: replica 0 of
        ``dp_group`` writes, which ``Pipeline(dp_group=...)`` sets).
        """
        from ..checkpoint import Shard

        owner = self._owner(owner)
        local = self.local_state_dict()
        out: dict[str, Any] = {}
        for name, (shape, dtype, _) in self._entries.items():
            if not shape:
                raise ValueError(f"PipelineStage.state_dict: {name!r} is 0-d; a pipeline checkpoint "
                                 f"needs entries with at least one axis")
            if owner and name in local:
                out[name] = Shard(local[name], shape, (0,) * len(shape))
            else:
                out[name] = Shard(np.empty((0,) + shape[1:], dtype), shape, (0,) * len(shape))
        return out

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Copy this rank's entries out of ``state`` (a whole-model state dict, of arrays or of
        whole-block Shards as ``hpcdp.checkpoint.load`` returns them) into the stages.

        Entries of other stages are skipped; with ``strict``, a missing entry of this rank or a
        name the model does not have raises ``KeyError``.
        """
        unknown = [k for k in state if k not in self._entries]
        mine = self.local_state_dict()
        missing = [k for k in mine if k not in state]
        if strict and (unknown or missing):
            raise KeyError(f"PipelineStage.load_state_dict (rank {self.group.rank}): missing keys "
                           f"{missing}, unexpected keys {unknown}")
        for s in self.stage_ids:
            sub = {}
            for k in self.modules[s].state_dict():
                if k not in state:
                    continue
                v = state[k]
                if hasattr(v, "global_shape") and hasattr(v, "local"):
                    if tuple(v.local.shape) != tuple(v.global_shape):
                        raise ValueError(f"PipelineStage.load_state_dict: {k!r} holds block "
                                         f"{tuple(v.local.shape)} of {tuple(v.global_shape)}; "
                                         f"this rank needs the whole entry")
                    v = v.local
                sub[k] = v
            self.modules[s].load_state_dict(sub, strict=False)

    def optim_state_dict(self, optimizer: Any, *, owner: bool | None = None) -> dict[str, Any]:
        """The whole model's optimizer state, keyed by unsplit parameter name; collective over
        ``group`` (every rank calls it, like ``checkpoint.save`` right after).

        Each array is a ``checkpoint.Shard``: whole on the rank whose stage holds the parameter,
        empty on the others; scalars (Adam's ``step``) and param groups are the same on every
        rank. So ``save(path, {"optim": stage.optim_state_dict(opt)})`` writes the state a DDP or
        plain optimizer over the whole model has, and it loads there, or into any other split.
        ``opt.state_dict()`` on this stage's parameters returns the same.

        Args:
            optimizer: the optimizer over this rank's ``parameters()``; None on a rank whose
                stages have none.
            owner: as for ``state_dict``.
        """
        return _optim.optim_state_dict(self, optimizer, self._owner(owner))

    def load_optim_state_dict(self, optimizer: Any, state: dict[str, Any]) -> None:
        """Load this rank's parameters' part of a whole model's optimizer state (a pipeline's of
        any split, DDP's, FSDP's or a plain one's; see ``optim_state_dict``). Not collective."""
        _optim.load_optim_state_dict(self, optimizer, state)

    def __repr__(self) -> str:
        parts = ", ".join(f"stage {s}: layers {self.bounds[s][0]}..{self.bounds[s][1] - 1}"
                          for s in self.stage_ids)
        return f"<PipelineStage rank {self.group.rank} of {self.group.size}, {parts}>"

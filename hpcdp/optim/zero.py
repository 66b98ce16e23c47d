"""``ZeroRedundancyOptimizer``: ZeRO-1, the optimizer state partitioned across the ranks of DDP.

Each parameter is owned by one rank (greedy by size, largest first, so the partitions are about
equal); a rank builds the wrapped optimizer on its own parameters only, so it holds about 1/N
of the state. ``step()`` updates the owned parameters from their (DDP-averaged) gradients, then
one all-gather per dtype hands every rank the updated values of the others: each rank packs its
partition into a buffer padded to the largest partition. Gradients and parameters stay whole on
every rank (that is ZeRO-1; ``hpcdp.FSDP`` shards those too).

Collective calls (every rank of ``group``, same order): construction, ``step``,
``consolidate_state_dict``.
"""
from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from ..errors import CollectiveMismatchError, HpcdpError
from ..nn.backend import xp_of
from ..nn.parameter import Parameter
from .names import NAME_HINT, index_keyed, is_name_keyed
from .state_check import check_index_keyed, require_state_dict
from .optimizer import Optimizer
from ..comm.world import group_or_default

__all__ = ["ZeroRedundancyOptimizer"]


class ZeroRedundancyOptimizer(Optimizer):
    """Wrap ``optimizer_class`` so each rank keeps the state of its own share of the parameters.

    Args:
        params: parameters or param-group dicts, identical on every rank (e.g. ``ddp.parameters()``).
        optimizer_class: an ``hpcdp.optim`` optimizer class (SGD, Adam, AdamW, ...).
        group: process group (default: the default group).
        **defaults: the optimizer's arguments (``lr=...``), as for ``optimizer_class``.

    ``param_groups`` list every parameter with the hyper-parameters, so learning-rate schedulers
    work as usual; they are copied to the local optimizer at each ``step``.
    """

    def __init__(self, params: Iterable[Any], optimizer_class: type, group: Any = None,
                 **defaults: Any) -> None:
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
            raise TypeError("ZeroRedundancyOptimizer needs an hpcdp.optim.Optimizer class, "
                            f"got {optimizer_class!r}")
        super().__init__(params, defaults)
        self.group = group_or_default(group)
        self.optimizer_class = optimizer_class
        g, n = self.group, self.group.size
        everything = [p for grp in self.param_groups for p in grp["params"]]
        mine = [(tuple(p.data.shape), np.dtype(p.data.dtype).str) for p in everything]
        seen = g.all_gather_object(mine)
        bad = [r for r, s in enumerate(seen) if s != seen[0]]
        if bad:
            raise CollectiveMismatchError(
                f"ZeroRedundancyOptimizer (rank {g.rank} of group {g.name}): ranks {bad} pass parameters "
                "with shapes or dtypes different from rank 0's; every rank must pass the same list")
        # Greedy partition: largest first onto the least-loaded rank (deterministic on every rank).
        load = [0] * n
        self.owner: dict[int, int] = {}
        for k in sorted(range(len(everything)), key=lambda k: (-everything[k].data.size, k)):
            r = min(range(n), key=lambda j: (load[j], j))
            self.owner[id(everything[k])] = r
            load[r] += int(everything[k].data.size)
        self._all = everything
        # The local optimizer: this rank's parameters, group by group, with the groups' settings.
        self._local_groups: list[int] = []   # global group index of each local group
        local = []
        for i, grp in enumerate(self.param_groups):
            own = [p for p in grp["params"] if self.owner[id(p)] == g.rank]
            if own:
                local.append({**{k: v for k, v in grp.items() if k != "params"}, "params": own})
                self._local_groups.append(i)
        self.local: Optimizer | None = optimizer_class(local, **defaults) if local else None
        # The class's own defaults (betas, eps...) in every group, on every rank, including groups
        # this rank owns nothing of: schedulers and the consolidated state dict read them there.
        full = optimizer_class([Parameter(np.zeros(1))], **defaults).defaults
        self.defaults = dict(full)
        for grp in self.param_groups:
            for k, v in full.items():
                grp.setdefault(k, v)
        self.state = self.local.state if self.local is not None else {}
        # One all-gather per (array module, dtype): partitions packed, padded to the largest.
        self._plans: list[tuple[list[list[Any]], int, Any, Any]] = []
        keys: dict[tuple[str, str], list[Any]] = {}
        for p in everything:
            keys.setdefault((xp_of(p.data).__name__, np.dtype(p.data.dtype).str), []).append(p)
        for _, ps in sorted(keys.items()):
            parts: list[list[Any]] = [[] for _ in range(n)]
            for p in ps:
                parts[self.owner[id(p)]].append(p)
            width = max(sum(int(p.data.size) for p in part) for part in parts)
            self._plans.append((parts, width, xp_of(ps[0].data), ps[0].data.dtype))
        self._consolidated: dict[str, Any] | None = None

    def add_param_group(self, group: dict[str, Any]) -> None:
        """Add a group while constructing; afterwards raise (the partition is fixed at construction).

        A group added later would be in ``param_groups`` but owned by no rank, so its
        parameters would silently never be updated.
        """
        if "owner" not in self.__dict__:
            super().add_param_group(group)
            return
        raise HpcdpError(f"ZeroRedundancyOptimizer.add_param_group (rank {self.group.rank}): the "
                         "parameters are partitioned across ranks at construction; build a new "
                         "ZeroRedundancyOptimizer over all the groups instead")

    def step(self, closure: Any = None) -> Any:
        """Update this rank's parameters, then all-gather everyone's updated parameters."""
        loss = closure() if closure is not None else None
        if self.local is not None:
            for li, gi in enumerate(self._local_groups):
                for k, v in self.param_groups[gi].items():
                    if k != "params":
                        self.local.param_groups[li][k] = v
            self.local.step()
        g = self.group
        for parts, width, xp, dtype in self._plans:
            if width == 0 or g.size == 1:
                continue
            send = xp.zeros(width, dtype)
            off = 0
            for p in parts[g.rank]:
                send[off:off + p.data.size] = p.data.reshape(-1)
                off += p.data.size
            got = g.all_gather(send)
            for r, part in enumerate(parts):
                if r == g.rank:
                    continue
                off = 0
                for p in part:
                    p.data[...] = got[r, off:off + p.data.size].reshape(p.data.shape)
                    off += p.data.size
        return loss

    def local_optimizer_state(self) -> dict[Any, dict[str, Any]]:
        """The state this rank holds (its own parameters only)."""
        return self.state

    def consolidate_state_dict(self, to: int = 0) -> dict[str, Any] | None:
        """Collect the whole optimizer state on rank ``to`` (collective); return it there, None elsewhere.

        The result has the wrapped optimizer's ``state_dict`` format: keyed by parameter name
        where the parameters have names (``ddp.parameters()``), else by indices counting every
        parameter across ``param_groups``; it loads into a plain optimizer too.
        """
        index = {id(p): i for i, p in enumerate(self._all)}
        mine = {index[id(p)]: {k: (v.copy() if hasattr(v, "copy") else v) for k, v in st.items()}
                for p, st in self.state.items() if st}
        parts = self.group.gather_object(mine, root=to)
        self._consolidated = None
        if parts is None:
            return None
        state: dict[int, dict[str, Any]] = {}
        for part in parts:
            state.update(part)
        groups, start = [], 0
        for grp in self.param_groups:
            gd = {k: v for k, v in grp.items() if k != "params"}
            gd["params"] = list(range(start, start + len(grp["params"])))
            groups.append(gd)
            start += len(grp["params"])
        self._consolidated = {"state": dict(sorted(state.items())), "param_groups": groups}
        names = self.param_names()
        if names is not None:
            self._consolidated = {
                "state": {names[i]: st for i, st in self._consolidated["state"].items()},
                "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in groups]}
        return self._consolidated

    def state_dict(self) -> dict[str, Any]:
        """The state gathered by the last ``consolidate_state_dict(to=this rank)``."""
        if self._consolidated is None:
            raise HpcdpError(f"ZeroRedundancyOptimizer.state_dict (rank {self.group.rank}): call "
                             "consolidate_state_dict(to=r) on every rank first, then state_dict() on rank r")
        return self._consolidated

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a whole optimizer state (plain or consolidated format); each rank keeps its share.

        Every rank checks the whole state (``state_check``), its share and the others', before
        changing anything: a wrong entry fails on every rank alike, naming the parameter's global
        index, and state for an index no group lists is an error, not dropped.
        """
        where = f"ZeroRedundancyOptimizer.load_state_dict (rank {self.group.rank})"
        require_state_dict(where, state_dict)
        if is_name_keyed(state_dict):
            names = self.param_names()
            if names is None:
                raise ValueError(f"{where}: the state is keyed by parameter name and this "
                                 f"optimizer's parameters have no names: {NAME_HINT}")
            state_dict = index_keyed(where, state_dict, names)
        settings, checked = check_index_keyed(where, self.defaults, self.param_groups, state_dict,
                                              self._all, getattr(self.optimizer_class, "state_spec", None))
        for mine, typed in zip(self.param_groups, settings):
            mine.update(typed)
        if self.local is None:
            return
        local_params = [p for grp in self.local.param_groups for p in grp["params"]]
        local_index = {id(p): i for i, p in enumerate(local_params)}
        local_state = {local_index[id(p)]: checked[pos] for pos, p in enumerate(self._all)
                       if id(p) in local_index and pos in checked}
        local_groups = []
        for li, gi in enumerate(self._local_groups):
            gd = {k: v for k, v in self.param_groups[gi].items() if k != "params"}
            start = sum(len(grp["params"]) for grp in self.local.param_groups[:li])
            gd["params"] = list(range(start, start + len(self.local.param_groups[li]["params"])))
            local_groups.append(gd)
        self.local.load_state_dict({"state": local_state, "param_groups": local_groups})
        self.state = self.local.state

    def __repr__(self) -> str:
        n_own = sum(1 for p in self._all if self.owner[id(p)] == self.group.rank)
        return (f"ZeroRedundancyOptimizer({self.optimizer_class.__name__}, rank {self.group.rank} owns "
                f"{n_own} of {len(self._all)} parameters)")

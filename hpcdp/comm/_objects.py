"""Python-object collectives of ``ProcessGroup``: pickled, so only between the ranks of one job.

Each object travels as a uint8 array through the array collectives; a rank that cannot pickle its
object still takes part (with a size of -1), so every rank raises together instead of waiting.
"""
from __future__ import annotations

import pickle
from typing import TYPE_CHECKING, Any

import numpy as np

from .validation import check_rank
from ..errors import public

if TYPE_CHECKING:
    from .group import ProcessGroup

__all__ = ["ObjectCollectives"]


class ObjectCollectives:
    """The Python-object collectives of one ``ProcessGroup`` (``group._objects``; the group's
    methods of these names delegate here), built on the group's array collectives."""

    __slots__ = ("_g",)

    def __init__(self, group: "ProcessGroup") -> None:
        self._g = group

    @public
    def broadcast_object(self, obj: Any = None, root: int = 0, *, timeout: float | None = None) -> Any:
        """Every rank gets root's ``obj``."""
        where = self._g._where("broadcast_object")
        root = check_rank(where, "root", root, self._g.size)
        failure: BaseException | None = None
        if self._g.rank == root:
            try:
                data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
                n = np.array([data.size], np.int64)
            except Exception as exc:  # noqa: BLE001 - told to every rank below
                failure, data, n = exc, None, np.array([-1], np.int64)
        else:
            data, n = None, np.zeros(1, np.int64)
        self._g.broadcast(n, root, timeout=timeout)
        if n[0] < 0:
            raise TypeError(f"{where}: root {root} could not pickle its object"
                            + (f": {failure}" if failure else "")) from failure
        if self._g.rank != root:
            data = np.empty(int(n[0]), np.uint8)
        self._g.broadcast(data, root, timeout=timeout)
        return obj if self._g.rank == root else pickle.loads(data.tobytes())

    @public
    def all_gather_object(self, obj: Any, *args: Any, timeout: float | None = None) -> Any:
        """A list of every rank's ``obj``, in rank order.

        torch's form ``all_gather_object(object_list, obj)`` fills ``object_list`` and returns
        None.
        """
        if args:
            if len(args) > 1:
                raise TypeError(f"{self._g._where('all_gather_object')}: takes (obj) or torch's "
                                f"(object_list, obj), got {1 + len(args)} positional arguments")
            return self._g._torch.all_gather_object(obj, args[0], timeout)
        failure: BaseException | None = None
        try:
            data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
        except Exception as exc:  # noqa: BLE001 - told to every rank below
            failure, data = exc, np.zeros(0, np.uint8)
        mine = np.array([-1 if failure else data.size], np.int64)
        sizes = self._g.all_gather(mine, timeout=timeout).reshape(-1)
        if (sizes < 0).any():
            bad = [int(i) for i in np.flatnonzero(sizes < 0)]
            raise TypeError(f"{self._g._where('all_gather_object')}: rank(s) {bad} could not pickle "
                            "their object" + (f": {failure}" if failure else "")) from failure
        padded = np.zeros(int(sizes.max()), np.uint8)
        padded[: data.size] = data
        rows = self._g.all_gather(padded, timeout=timeout)
        return [pickle.loads(rows[i, : int(sizes[i])].tobytes()) for i in range(self._g.size)]

    @public
    def gather_object(self, obj: Any, root: Any = 0, *, timeout: float | None = None,
                      object_gather_list: list[Any] | None = None,
                      dst: int | None = None) -> list[Any] | None:
        """Like ``all_gather_object`` but only ``root`` gets the list.

        torch's form ``gather_object(obj, object_gather_list, dst=0)`` fills the list on ``dst``
        and returns None.
        """
        torch_form = (dst is not None or object_gather_list is not None
                      or not isinstance(root, (int, np.integer)))
        if torch_form:
            if object_gather_list is None and isinstance(root, list):
                object_gather_list = root  # positional: gather_object(obj, list, dst)
            if dst is None:
                dst = root if isinstance(root, (int, np.integer)) else 0
            root = dst
        root = check_rank(self._g._where("gather_object"), "dst" if torch_form else "root", root,
                          self._g.size)
        objs = self.all_gather_object(obj, timeout=timeout)
        if not torch_form:
            return objs if self._g.rank == root else None
        if self._g.rank == root:
            if not isinstance(object_gather_list, list) or len(object_gather_list) != self._g.size:
                raise ValueError(f"{self._g._where('gather_object')}: object_gather_list on dst "
                                 f"{root} must be a list of {self._g.size} entries")
            object_gather_list[:] = objs
        return None

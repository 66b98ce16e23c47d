"""torch.distributed's spellings on ``ProcessGroup``: they do what torch's do.

hpcdp's own collectives are numpy style: they return the result (or fill ``out=``). A name that
torch.distributed also uses must not quietly mean something else to a torch user, who reads the
tensor after ``all_reduce(t)``. So each torch spelling here works in place on the arrays passed,
takes torch's keywords (``src=``, ``dst=``, ``gather_list=``, ...) and returns what torch returns:
None, or a ``Work`` with ``async_op=True`` (whose ``wait()`` returns None). Where the name is
shared with hpcdp's own call (``all_gather``, ``gather``, ``broadcast``, ...), the torch form is
told apart by its arguments, which hpcdp's form never takes (``ProcessGroup`` dispatches here).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from .._arrays import is_cupy, xp_of
from .._tensors import tensor_call
from ._buffers import via_tensors
from .validation import check_array
from ..errors import public
from .work import Work, then

if TYPE_CHECKING:
    from ..ops import ReduceOp
    from .group import ProcessGroup

__all__ = ["TorchSpellings"]


def _writable(where: str, x: Any, what: str = "the tensor") -> Any:
    """``x``, an array torch's call may write in place; else a TypeError/ValueError that says so."""
    check_array(where, x)
    if isinstance(x, np.ndarray) and not x.flags.writeable:
        raise ValueError(f"{where}: {what} is read-only; this torch-style call writes it in place "
                         "(hpcdp's numpy-style call, without the underscore or the torch keywords, "
                         "returns a new array instead)")
    return x


def _copy_into(targets: Sequence[Any]) -> Callable[[Any], None]:
    """What a list-form call does with its stacked result: row i into ``targets[i]``."""
    def into(stacked: Any) -> None:
        for i, t in enumerate(targets):
            t[...] = stacked[i].reshape(t.shape)
        return None

    return into


def _into(target: Any) -> Callable[[Any], None]:
    def into(result: Any) -> None:
        if result is not target:
            target[...] = result.reshape(target.shape)
        return None

    return into


def _none(_: Any) -> None:
    return None


def _finish(res: Any, after: Callable[[Any], None], async_op: bool) -> Work | None:
    """torch's return: None once ``after`` ran, or the ``Work`` that runs it on completion."""
    if async_op:
        return then(res, after)
    after(res)
    return None


class TorchSpellings:
    """The calls torch.distributed spells, with torch's behaviour, for one ``ProcessGroup``.

    The group holds one (``group._torch``) and its methods of these names delegate here; each
    is built from the group's own numpy-style collectives, through the group it is given.
    """

    __slots__ = ("_g",)

    def __init__(self, group: "ProcessGroup") -> None:
        self._g = group

    @public
    def all_reduce(self, tensor: Any, op: "ReduceOp | str" = "sum", *, async_op: bool = False,
                   timeout: float | None = None) -> Work | None:
        """torch's ``all_reduce``: reduce ``tensor`` across ranks *in place*; None (or a Work).

        hpcdp's ``allreduce(x)`` returns the result instead and leaves ``x`` alone.
        """
        if tc := tensor_call(self._g._where("all_reduce"), tensor, reduce=True):
            return via_tensors(tc, self.all_reduce(tc.write(tensor), op, async_op=async_op, timeout=timeout))
        _writable(self._g._where("all_reduce"), tensor)
        res = self._g.allreduce(tensor, op, out=tensor, async_op=async_op, timeout=timeout)
        return then(res, _none) if async_op else None

    @public
    def all_gather_into_tensor(self, output_tensor: Any, input_tensor: Any, *,
                               async_op: bool = False, timeout: float | None = None) -> Work | None:
        """torch's ``all_gather_into_tensor``: rank i's input fills part i of ``output_tensor``
        (shaped ``(size * n, ...)`` or ``(size, n, ...)``); None (or a Work)."""
        where = self._g._where("all_gather_into_tensor")
        if tc := tensor_call(where, output_tensor, input_tensor):
            return via_tensors(tc, self.all_gather_into_tensor(
                tc.write(output_tensor, "output_tensor"), tc.read(input_tensor), async_op=async_op, timeout=timeout))
        _writable(where, output_tensor, "output_tensor")
        check_array(where, input_tensor)
        if output_tensor.size != self._g.size * input_tensor.size:
            raise ValueError(f"{where}: output_tensor has {output_tensor.size} elements, "
                             f"{self._g.size} ranks x input_tensor's {input_tensor.size} needed")
        res = self._g.all_gather(input_tensor, async_op=async_op, timeout=timeout)
        return _finish(res, _into(output_tensor), async_op)

    @public
    def reduce_scatter_tensor(self, output: Any, input: Any, op: "ReduceOp | str" = "sum", *,
                              async_op: bool = False, timeout: float | None = None) -> Work | None:
        """torch's ``reduce_scatter_tensor``: reduce ``input`` (``size`` parts along axis 0)
        across ranks; part i lands in rank i's ``output``; None (or a Work)."""
        where = self._g._where("reduce_scatter_tensor")
        if tc := tensor_call(where, output, input, reduce=True):
            return via_tensors(tc, self.reduce_scatter_tensor(
                tc.write(output, "output"), tc.read(input), op, async_op=async_op, timeout=timeout))
        _writable(where, output, "output")
        check_array(where, input)
        if input.size != self._g.size * output.size:
            raise ValueError(f"{where}: input has {input.size} elements, {self._g.size} ranks x "
                             f"output's {output.size} needed")
        flat = input.reshape(self._g.size, -1)
        res = self._g.reduce_scatter(flat, op, async_op=async_op, timeout=timeout)
        return _finish(res, _into(output), async_op)

    @public
    def all_to_all_single(self, output: Any, input: Any, output_split_sizes: Any = None,
                          input_split_sizes: Any = None, *, async_op: bool = False,
                          timeout: float | None = None) -> Work | None:
        """torch's ``all_to_all_single`` with even splits: part j of ``input`` goes to rank j,
        part i of ``output`` came from rank i; None (or a Work). Uneven splits are not offered."""
        where = self._g._where("all_to_all_single")
        if output_split_sizes is not None or input_split_sizes is not None:
            raise NotImplementedError(f"{where}: uneven splits (output_split_sizes/"
                                      "input_split_sizes) are not supported; pad to equal parts")
        if tc := tensor_call(where, output, input):
            return via_tensors(tc, self.all_to_all_single(
                tc.write(output, "output"), tc.read(input), async_op=async_op, timeout=timeout))
        _writable(where, output, "output")
        res = self._g.all_to_all(input, out=output, async_op=async_op, timeout=timeout)
        return _finish(res, _none, async_op)

    def broadcast_object_list(self, object_list: list[Any], src: int = 0, *,
                              timeout: float | None = None) -> None:
        """torch's ``broadcast_object_list``: every rank's ``object_list`` becomes ``src``'s."""
        got = self._g.broadcast_object(list(object_list) if self._g.rank == src else None, src,
                                    timeout=timeout)
        if len(got) != len(object_list):
            raise ValueError(f"{self._g._where('broadcast_object_list')}: rank {src} sent "
                             f"{len(got)} objects, this rank's list holds {len(object_list)}")
        object_list[:] = got

    # -- the torch forms of names hpcdp shares (ProcessGroup dispatches on the arguments) ------
    def broadcast(self, tensor: Any, src: int, async_op: bool, timeout: Any) -> Work | None:
        if tc := tensor_call(self._g._where("broadcast"), tensor):
            return via_tensors(tc, self.broadcast(tc.write(tensor), src, async_op, timeout))
        _writable(self._g._where("broadcast"), tensor)
        res = self._g.broadcast(tensor, src, async_op=async_op, timeout=timeout)
        return _finish(res, _none, async_op)

    def reduce(self, tensor: Any, dst: int, op: Any, async_op: bool,
                      timeout: Any) -> Work | None:
        if tc := tensor_call(self._g._where("reduce"), tensor, reduce=True):  # written on every rank: the same checks
            return via_tensors(tc, self.reduce(tc.write(tensor), dst, op, async_op, timeout))
        _writable(self._g._where("reduce"), tensor)
        out = tensor if self._g.rank == dst else None
        res = self._g.reduce(tensor, op, dst, out=out, async_op=async_op, timeout=timeout)
        return _finish(res, _none, async_op)

    def all_gather(self, tensor_list: Any, tensor: Any, async_op: bool,
                          timeout: Any) -> Work | None:
        where = self._g._where("all_gather")
        if tc := tensor_call(where, tensor_list, tensor):
            return via_tensors(tc, self.all_gather(tc.write_list(tensor_list, "tensor_list"), tc.read(tensor),
                                                   async_op, timeout))
        targets = self._check_list(where, "tensor_list", tensor_list, tensor)
        res = self._g.all_gather(tensor, async_op=async_op, timeout=timeout)
        return _finish(res, _copy_into(targets), async_op)

    def all_to_all(self, output_list: Any, input_list: Any, async_op: bool,
                          timeout: Any) -> Work | None:
        where = self._g._where("all_to_all")
        if tc := tensor_call(where, output_list, input_list):
            return via_tensors(tc, self.all_to_all(tc.write_list(output_list, "output_tensor_list"),
                                                   tc.read_list(input_list), async_op, timeout))
        if not isinstance(input_list, (list, tuple)) or not input_list:
            raise TypeError(f"{where}: torch's form all_to_all(output_tensor_list, "
                            "input_tensor_list) needs two lists")
        first = check_array(where, input_list[0])
        targets = self._check_list(where, "output_tensor_list", output_list, first)
        self._check_list(where, "input_tensor_list", input_list, first, write=False)
        xp = xp_of(first)
        stacked = xp.stack([xp.asarray(a).reshape(first.shape) for a in input_list])
        res = self._g.all_to_all(stacked, async_op=async_op, timeout=timeout)
        return _finish(res, _copy_into(targets), async_op)

    def gather(self, tensor: Any, gather_list: Any, dst: int, async_op: bool,
                      timeout: Any) -> Work | None:
        where = self._g._where("gather")
        if tc := tensor_call(where, tensor, gather_list if self._g.rank == dst else None):
            lst = tc.write_list(gather_list, "gather_list") if self._g.rank == dst else gather_list
            return via_tensors(tc, self.gather(tc.read(tensor), lst, dst, async_op, timeout))
        check_array(where, tensor)
        targets = None
        if self._g.rank == dst:
            targets = self._check_list(where, "gather_list", gather_list, tensor)
        res = self._g.gather(tensor, dst, async_op=async_op, timeout=timeout)
        return _finish(res, _copy_into(targets) if targets is not None else _none, async_op)

    def scatter(self, tensor: Any, scatter_list: Any, src: int, async_op: bool,
                       timeout: Any) -> Work | None:
        where = self._g._where("scatter")
        if tc := tensor_call(where, tensor, scatter_list if self._g.rank == src else None):
            lst = tc.read_list(scatter_list) if self._g.rank == src else scatter_list
            return via_tensors(tc, self.scatter(tc.write(tensor), lst, src, async_op, timeout))
        _writable(where, tensor)
        xp = xp_of(tensor)
        if self._g.rank == src:
            parts = self._check_list(where, "scatter_list", scatter_list, tensor, write=False)
            x = xp.stack([xp.asarray(p).reshape(tensor.shape) for p in parts])
        else:
            x = xp.empty((self._g.size, *tensor.shape), tensor.dtype)
        res = self._g.scatter(x, src, async_op=async_op, timeout=timeout)
        return _finish(res, _into(tensor), async_op)

    def all_gather_object(self, object_list: Any, obj: Any, timeout: Any) -> None:
        if not isinstance(object_list, list) or len(object_list) != self._g.size:
            raise ValueError(f"{self._g._where('all_gather_object')}: torch's form "
                             f"all_gather_object(object_list, obj) needs a list of {self._g.size} "
                             f"entries, got {type(object_list).__name__}")
        object_list[:] = self._g.all_gather_object(obj, timeout=timeout)

    def _check_list(self, where: str, name: str, lst: Any, like: Any, write: bool = True) -> list:
        """``lst``: ``size`` arrays shaped and typed like ``like`` (and writable when ``write``)."""
        if not isinstance(lst, (list, tuple)) or len(lst) != self._g.size:
            got = f"{len(lst)} entries" if isinstance(lst, (list, tuple)) else type(lst).__name__
            raise ValueError(f"{where}: {name} must be a list of {self._g.size} arrays (one per "
                             f"rank), got {got}")
        for i, t in enumerate(lst):
            if (not (isinstance(t, np.ndarray) or is_cupy(t)) or t.shape != like.shape
                    or t.dtype != like.dtype):
                got = (f"{t.dtype} {t.shape}" if hasattr(t, "shape") else type(t).__name__)
                raise ValueError(f"{where}: {name}[{i}] must be a {like.dtype} array of shape "
                                 f"{like.shape}, got {got}")
            if write:
                _writable(where, t, f"{name}[{i}]")
        return list(lst)

"""torch.distributed's spellings behave as torch's: in place, None or a Work, torch's keywords.

A torch user reads the tensor after ``all_reduce(t)``; if hpcdp returned the sum and left ``t``
alone, that user would train on unreduced gradients without an error (issue 21, item 1). The
numpy-style names (``allreduce``, ``all_gather(x)``, ...) keep returning their result.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest

import hpcdp
from hpcdp.testing import check
from hpcdp.testing.fixtures import World, worlds


def body_torch_names(rank: int) -> list[str]:
    """Every torch spelling on the default group (and on ``ProcessGroup``); failures as text."""
    n, g, fails = hpcdp.world_size(), hpcdp.get_default_group(), []

    def check(name: str, ok: Any, got: Any = "") -> None:
        if not ok:
            fails.append(f"{name}: {got}")

    def is_none_or_work(name: str, res: Any, async_op: bool) -> None:
        if async_op:
            check(f"{name} async returns a Work", isinstance(res, hpcdp.Work), res)
            res.wait()
        else:
            check(f"{name} returns None", res is None, res)

    total = sum(range(1, n + 1))
    for async_op in (False, True):
        # all_reduce: in place, like torch (module and ProcessGroup)
        x = np.full(3, rank + 1.0)
        is_none_or_work("all_reduce", hpcdp.all_reduce(x, async_op=async_op), async_op)
        check("all_reduce in place", np.array_equal(x, np.full(3, float(total))), x)
        x = np.full((2, 2), rank, np.int64)
        is_none_or_work("ProcessGroup.all_reduce",
                        g.all_reduce(x, op=hpcdp.ReduceOp.MAX, async_op=async_op), async_op)
        check("ProcessGroup.all_reduce max in place", (x == n - 1).all(), x)
        # broadcast(src=)
        x = np.full(4, rank, np.int32)
        is_none_or_work("broadcast(src=)", hpcdp.broadcast(x, src=n - 1, async_op=async_op),
                        async_op)
        check("broadcast(src=) in place", (x == n - 1).all(), x)
        # reduce(dst=) and torch's positional reduce(tensor, dst)
        for call in ("kw", "positional"):
            x = np.full(2, rank + 1, np.int64)
            res = (hpcdp.reduce(x, dst=0, async_op=async_op) if call == "kw"
                   else hpcdp.reduce(x, 0, async_op=async_op))
            is_none_or_work(f"reduce({call} dst)", res, async_op)
            want = total if rank == 0 else rank + 1
            check(f"reduce({call} dst) into the tensor on dst only", (x == want).all(), x)
        # all_gather(tensor_list, tensor)
        lst = [np.zeros(2, np.float32) for _ in range(n)]
        is_none_or_work("all_gather(list, t)",
                        hpcdp.all_gather(lst, np.full(2, rank, np.float32), async_op=async_op),
                        async_op)
        check("all_gather(list, t) fills the list", all((lst[i] == i).all() for i in range(n)), lst)
        # all_gather_into_tensor
        out = np.zeros(2 * n, np.int32)
        is_none_or_work("all_gather_into_tensor", hpcdp.all_gather_into_tensor(
            out, np.full(2, rank, np.int32), async_op=async_op), async_op)
        check("all_gather_into_tensor", np.array_equal(out, np.repeat(np.arange(n), 2)), out)
        # reduce_scatter_tensor
        out = np.zeros(2, np.float64)
        inp = np.arange(2 * n, dtype=np.float64) + rank
        is_none_or_work("reduce_scatter_tensor",
                        hpcdp.reduce_scatter_tensor(out, inp, async_op=async_op), async_op)
        want = (np.arange(2 * n) * n + sum(range(n)))[2 * rank: 2 * rank + 2]
        check("reduce_scatter_tensor", np.array_equal(out, want), out)
        # all_to_all(output_list, input_list) and all_to_all_single
        outs = [np.zeros(1, np.int64) for _ in range(n)]
        ins = [np.array([10 * rank + j]) for j in range(n)]
        is_none_or_work("all_to_all(lists)", hpcdp.all_to_all(outs, ins, async_op=async_op),
                        async_op)
        check("all_to_all(lists)", [int(o[0]) for o in outs] == [10 * i + rank for i in range(n)],
              outs)
        out = np.zeros(n, np.int64)
        is_none_or_work("all_to_all_single", hpcdp.all_to_all_single(
            out, np.arange(n, dtype=np.int64) + 10 * rank, async_op=async_op), async_op)
        check("all_to_all_single", np.array_equal(out, np.arange(n) * 10 + rank), out)
        # gather(gather_list=, dst=) and scatter(scatter_list=, src=)
        lst = [np.zeros(2, np.int32) for _ in range(n)] if rank == 0 else None
        is_none_or_work("gather(dst=)", hpcdp.gather(np.full(2, rank, np.int32), gather_list=lst,
                                                     dst=0, async_op=async_op), async_op)
        if rank == 0:
            check("gather(dst=) fills gather_list", all((lst[i] == i).all() for i in range(n)),
                  lst)
        t = np.zeros(3, np.float32)
        parts = [np.full(3, 7.0 * i, np.float32) for i in range(n)] if rank == n - 1 else None
        is_none_or_work("scatter(src=)", hpcdp.scatter(t, scatter_list=parts, src=n - 1,
                                                       async_op=async_op), async_op)
        check("scatter(src=) fills the tensor", (t == 7.0 * rank).all(), t)
        # barrier: None, or a Work
        is_none_or_work("barrier", hpcdp.barrier(async_op=async_op), async_op)

    # send/recv with torch's dst=/src= keywords, in place
    if n > 1 and rank in (0, 1):
        buf = np.zeros(3, np.int64)
        if rank == 0:
            check("send(dst=) returns None", hpcdp.send(np.arange(3, dtype=np.int64), dst=1) is None)
        else:
            hpcdp.recv(buf, src=0)
            check("recv(src=) fills the tensor in place", np.array_equal(buf, np.arange(3)), buf)
    check("get_rank", hpcdp.get_rank() == rank and hpcdp.get_rank(g) == rank, hpcdp.get_rank())
    check("get_world_size", hpcdp.get_world_size() == n, hpcdp.get_world_size())
    # object collectives in torch's forms
    objs: list[Any] = [None] * n
    check("all_gather_object(list, obj) returns None",
          hpcdp.all_gather_object(objs, {"r": rank}) is None)
    check("all_gather_object(list, obj) fills the list", objs == [{"r": i} for i in range(n)], objs)
    got = [None] * n if rank == 0 else None
    check("gather_object(dst=) returns None",
          hpcdp.gather_object(rank * 2, object_gather_list=got, dst=0) is None)
    if rank == 0:
        check("gather_object(dst=) fills the list", got == [2 * i for i in range(n)], got)
    blist = ["a", rank] if rank == 0 else [None, None]
    hpcdp.broadcast_object_list(blist, src=0)
    check("broadcast_object_list", blist == ["a", 0], blist)

    # the numpy-style names are unchanged: they return the result and leave x alone
    x = np.full(3, rank + 1.0)
    y = hpcdp.allreduce(x)
    check("allreduce returns the sum", np.array_equal(y, np.full(3, float(total))), y)
    check("allreduce leaves x", (x == rank + 1.0).all(), x)
    check("all_gather(x) returns the stack", hpcdp.all_gather(np.array([rank])).shape == (n, 1))
    check("reduce(x, root=0) returns", (hpcdp.reduce(np.ones(1), root=0) is not None) == (rank == 0))
    b = np.full(2, rank)
    check("broadcast(x, 0) returns x", hpcdp.broadcast(b, 0) is b)
    # a torch form hpcdp does not offer, and a read-only tensor, are refused loudly
    for name, fn, exc in (
        ("reduce_scatter(list form)",
         lambda: hpcdp.reduce_scatter(np.zeros(1), [np.zeros(1)] * n), TypeError),
        ("all_reduce(read-only)", _readonly, ValueError),
        ("all_reduce(list)", lambda: hpcdp.all_reduce([1.0, 2.0]), TypeError),
    ):
        try:
            fn()
            fails.append(f"{name}: no error")
        except exc as e:
            check(f"{name} names the call", "rank" in str(e), e)
    return fails


def _readonly() -> Any:
    x = np.ones(2)
    x.setflags(write=False)
    return hpcdp.all_reduce(x)


@pytest.mark.parametrize("world", worlds("sim-1", "sim-2", "sim-3", "tcp-2", "mpi"), indirect=True)
def test_torch_names(world: World) -> None:
    check(world.run(body_torch_names, timeout=60))


def test_module_and_group_offer_the_same_torch_names() -> None:
    """Each torch spelling exists on the module and on ProcessGroup, documented as torch's."""
    names = ["all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
             "all_to_all_single", "broadcast_object_list"]
    for name in names:
        fn: Callable[..., Any] = getattr(hpcdp, name)
        assert "torch" in (fn.__doc__ or ""), name
        assert callable(getattr(hpcdp.ProcessGroup, name)), name
    assert hpcdp.all_reduce is not hpcdp.allreduce
    assert hpcdp.ProcessGroup.all_reduce is not hpcdp.ProcessGroup.allreduce

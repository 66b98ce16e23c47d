"""torch tensors through every collective and point-to-point call (issue 23, item 1).

A CPU tensor is taken wherever a numpy array is, as a view of its own storage: ``out=`` and the
in-place torch spellings write the tensor itself, and new results come back as tensors. Each
call is checked bit for bit against a numpy reference (torch's own for bfloat16, which numpy
lacks); the rules for strides, grad, bfloat16 and the dtypes numpy lacks each have a body here.
"""
from __future__ import annotations

import subprocess
import sys
import warnings
from typing import Any, Callable

import numpy as np
import pytest

import hpcdp
from hpcdp.testing import check
from hpcdp.testing.fixtures import World, worlds

import torch  # noqa: E402 - make test installs torch: a missing torch fails here, never skips

DTYPES = ("float32", "float64", "int64", "bool", "bfloat16")
SHAPES = lambda n: ((), (0,), (5,), (2 * n, 3))  # noqa: E731 - 0-d, empty, odd, divisible


def _data(r: int, dt: str, shape: tuple[int, ...]) -> "torch.Tensor":
    """Rank ``r``'s tensor. bfloat16: values of 8 significant bits within a few octaves, so a
    float32 sum of a few ranks is exact in any order and only the final rounding is tested."""
    count = int(np.prod(shape))
    if dt == "bfloat16":
        g = torch.Generator().manual_seed(1000 + r)
        return (torch.randn(count, generator=g) * 3).to(torch.bfloat16).reshape(shape)
    base = (np.arange(count, dtype=np.float64) % 7 + r + 1).reshape(shape)
    arr = (base % 2 == 0) if dt == "bool" else base.astype(dt)
    return torch.from_numpy(np.array(arr))  # (a 0-d comparison gives a numpy scalar)


class _Check:
    """Failures as text, so that one rank's failure is reported by ``check`` on every world."""

    def __init__(self, rank: int) -> None:
        self.rank, self.fails = rank, []

    def ok(self, label: str, cond: Any, got: Any = "") -> None:
        if not cond:
            self.fails.append(f"rank {self.rank} {label}: {got}")

    def same(self, label: str, got: Any, want: "torch.Tensor") -> None:
        """``got`` is a tensor of ``want``'s dtype and shape with the same bits."""
        if not isinstance(got, torch.Tensor):
            self.fails.append(f"rank {self.rank} {label}: got {type(got).__name__}, not a tensor")
            return
        if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
            self.fails.append(f"rank {self.rank} {label}: {got.dtype}{tuple(got.shape)}, want "
                              f"{want.dtype}{tuple(want.shape)}")
            return
        bits = (lambda t: t.view(torch.int16)) if want.dtype == torch.bfloat16 else (lambda t: t)
        if not torch.equal(bits(got.contiguous()), bits(want.contiguous())):
            self.fails.append(f"rank {self.rank} {label}: {got.flatten()[:6].tolist()} != "
                              f"{want.flatten()[:6].tolist()}")

    def raises(self, label: str, exc: type, words: tuple[str, ...], fn: Callable[[], Any]) -> None:
        try:
            fn()
        except exc as e:
            missing = [w for w in words if w not in str(e)]
            self.ok(f"{label}: the message names {missing}", not missing, e)
        else:
            self.fails.append(f"rank {self.rank} {label}: no {exc.__name__}")


def _np(t: "torch.Tensor") -> np.ndarray:
    return t.numpy()


def _refs(every: list, dt: str, n: int) -> dict[str, "torch.Tensor"]:
    """Sum, max and mean of every rank's tensor: numpy's, or for bfloat16 torch's float32 sum
    rounded once (what a float32 reduction of bfloat16 data must give)."""
    if dt == "bfloat16":
        f32 = torch.stack([e.float() for e in every])
        return {"sum": f32.sum(0).to(torch.bfloat16), "max": f32.amax(0).to(torch.bfloat16)
                if f32.numel() else f32.sum(0).to(torch.bfloat16),
                "mean": (f32.sum(0) / n).to(torch.bfloat16)}
    stack = np.stack([_np(e) for e in every])
    npdt = np.dtype(dt)
    total = np.asarray(np.sum(stack, axis=0, dtype=npdt))
    out = {"sum": torch.from_numpy(total),
           "max": torch.from_numpy(np.asarray(np.max(stack, axis=0)) if stack.size else total)}
    if dt.startswith("float"):
        out["mean"] = torch.from_numpy(np.asarray(total / npdt.type(n)))
    return out


def body_every_collective(rank: int) -> list[str]:
    """Every collective, numpy-style and torch-named, on tensors of each dtype and shape."""
    n, c = hpcdp.world_size(), _Check(rank)
    for dt in DTYPES:
        tdt = getattr(torch, dt)
        for shape in SHAPES(n):
            tag = f"{dt}{shape}"
            every = [_data(r, dt, shape) for r in range(n)]
            x = _data(rank, dt, shape)
            ref = _refs(every, dt, n)
            stacked = torch.stack(every)
            # allreduce: a new tensor; out= writes that tensor (same memory, returned as itself)
            if dt != "bool":
                c.same(f"allreduce sum {tag}", hpcdp.allreduce(x), ref["sum"])
            c.same(f"allreduce max {tag}", hpcdp.allreduce(x, "max"), ref["max"])
            if "mean" in ref:
                c.same(f"allreduce mean {tag}", hpcdp.allreduce(x, "mean"), ref["mean"])
            o = torch.empty(shape, dtype=tdt)
            ptr = o.data_ptr()
            r = hpcdp.allreduce(x, "max", out=o)
            c.ok(f"allreduce out= returns out {tag}", r is o and o.data_ptr() == ptr)
            c.same(f"allreduce out= {tag}", o, ref["max"])
            c.same(f"allreduce input untouched {tag}", x, every[rank])
            w = hpcdp.allreduce(x, "max", async_op=True)
            c.same(f"allreduce async wait() {tag}", w.wait(), ref["max"])
            # torch's all_reduce: in place, the tensor's own memory
            t = x.clone()
            ptr = t.data_ptr()
            c.ok(f"all_reduce returns None {tag}", hpcdp.all_reduce(t, "max") is None)
            c.ok(f"all_reduce keeps the storage {tag}", t.data_ptr() == ptr)
            c.same(f"all_reduce in place {tag}", t, ref["max"])
            t = x.clone()
            hpcdp.all_reduce(t, "max", async_op=True).wait()
            c.same(f"all_reduce async in place {tag}", t, ref["max"])
            # broadcast: numpy-style fills x in place and returns it; torch's src= form likewise
            t = x.clone()
            c.ok(f"broadcast returns x {tag}", hpcdp.broadcast(t, root=n - 1) is t)
            c.same(f"broadcast {tag}", t, every[n - 1])
            t = x.clone()
            c.ok(f"broadcast(src=) None {tag}", hpcdp.broadcast(t, src=0) is None)
            c.same(f"broadcast(src=) {tag}", t, every[0])
            # reduce: the root gets a tensor, the others None; torch's dst= form in place
            if dt != "bool":
                red = hpcdp.reduce(x, root=0)
                if rank == 0:
                    c.same(f"reduce {tag}", red, ref["sum"])
                else:
                    c.ok(f"reduce non-root None {tag}", red is None, red)
                t = x.clone()
                hpcdp.reduce(t, dst=n - 1)
                c.same(f"reduce(dst=) {tag}", t, ref["sum"] if rank == n - 1 else every[rank])
            # all_gather / gather, numpy-style, with out=, and torch's list and into-tensor forms
            c.same(f"all_gather {tag}", hpcdp.all_gather(x), stacked)
            o = torch.zeros((n, *shape), dtype=tdt)
            c.ok(f"all_gather out= {tag}", hpcdp.all_gather(x, out=o) is o)
            c.same(f"all_gather out= {tag}", o, stacked)
            lst = [torch.zeros(shape, dtype=tdt) for _ in range(n)]
            hpcdp.all_gather(lst, x)
            c.same(f"all_gather(list, t) {tag}", torch.stack(lst), stacked)
            o = torch.zeros((n, *shape), dtype=tdt)
            ptr = o.data_ptr()
            hpcdp.all_gather_into_tensor(o, x)
            c.ok(f"all_gather_into_tensor keeps the storage {tag}", o.data_ptr() == ptr)
            c.same(f"all_gather_into_tensor {tag}", o, stacked)
            gat = hpcdp.gather(x, root=n - 1)
            if rank == n - 1:
                c.same(f"gather {tag}", gat, stacked)
            else:
                c.ok(f"gather non-root None {tag}", gat is None, gat)
            lst = [torch.zeros(shape, dtype=tdt) for _ in range(n)] if rank == 0 else None
            hpcdp.gather(x, gather_list=lst, dst=0)
            if rank == 0:
                c.same(f"gather(gather_list, dst=) {tag}", torch.stack(lst), stacked)
            if not shape or shape[0] % n:
                continue
            part = shape[0] // n
            mine = slice(rank * part, (rank + 1) * part)
            if dt != "bool":
                c.same(f"reduce_scatter {tag}", hpcdp.reduce_scatter(x), ref["sum"][mine])
                o = torch.zeros((part, *shape[1:]), dtype=tdt)
                hpcdp.reduce_scatter_tensor(o, x)
                c.same(f"reduce_scatter_tensor {tag}", o, ref["sum"][mine])
            c.same(f"scatter {tag}", hpcdp.scatter(x, root=0), every[0][mine])
            o = torch.zeros((part, *shape[1:]), dtype=tdt)
            c.ok(f"scatter out= {tag}", hpcdp.scatter(x if rank == 0 else None, root=0, out=o) is o)
            c.same(f"scatter out= {tag}", o, every[0][mine])
            t = torch.zeros((part, *shape[1:]), dtype=tdt)
            parts = [x[i * part:(i + 1) * part] for i in range(n)] if rank == n - 1 else None
            hpcdp.scatter(t, scatter_list=parts, src=n - 1)
            c.same(f"scatter(scatter_list, src=) {tag}", t, every[n - 1][mine])
            want = torch.cat([e[mine] for e in every])
            c.same(f"all_to_all {tag}", hpcdp.all_to_all(x), want)
            o = torch.zeros(shape, dtype=tdt)
            hpcdp.all_to_all_single(o, x)
            c.same(f"all_to_all_single {tag}", o, want)
            outs = [torch.zeros((part, *shape[1:]), dtype=tdt) for _ in range(n)]
            hpcdp.all_to_all(outs, [x[i * part:(i + 1) * part] for i in range(n)])
            c.same(f"all_to_all(lists) {tag}", torch.cat(outs), want)
    return c.fails


def body_point_to_point(rank: int) -> list[str]:
    """send/recv, isend/irecv and sendrecv around a ring, on tensors of each dtype; the receive
    buffer is the tensor returned, written in place, strided or not."""
    n, c = hpcdp.world_size(), _Check(rank)
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    for dt in DTYPES:
        tdt = getattr(torch, dt)
        mine, theirs = _data(rank, dt, (5,)), _data(prv, dt, (5,))
        buf = torch.zeros(5, dtype=tdt)
        ptr = buf.data_ptr()
        s = hpcdp.isend(mine, nxt, tag=1)
        w = hpcdp.irecv(buf, prv, tag=1)
        c.ok(f"irecv wait() returns the tensor {dt}", w.wait() is buf and buf.data_ptr() == ptr)
        s.wait()
        c.same(f"isend/irecv {dt}", buf, theirs)
        got = hpcdp.sendrecv(mine, nxt, torch.zeros(5, dtype=tdt), prv, sendtag=2, recvtag=2)
        c.same(f"sendrecv {dt}", got, theirs)
        buf = torch.zeros(5, dtype=tdt)
        works = hpcdp.batch_isend_irecv([hpcdp.P2POp("isend", mine, nxt, 5),
                                         hpcdp.P2POp("irecv", buf, prv, 5)])
        c.ok(f"batch_isend_irecv returns the receive tensor {dt}", hpcdp.wait_all(works)[1] is buf)
        c.same(f"batch_isend_irecv {dt}", buf, theirs)
        if n == 1:
            continue
        strided = torch.zeros((5, 2), dtype=tdt)[:, 1]  # a blocking receive, not contiguous
        if rank % 2 == 0:
            hpcdp.send(mine, nxt, tag=3)
            got = hpcdp.recv(strided, prv, tag=3)
        else:
            got = hpcdp.recv(strided, prv, tag=3)
            hpcdp.send(mine, nxt, tag=3)
        c.ok(f"recv returns its buffer {dt}", got is strided)
        c.same(f"send/recv strided {dt}", strided, theirs)
        if rank % 2 == 0:
            hpcdp.send(mine, nxt, tag=4)
            got, st = hpcdp.recv(torch.zeros(5, dtype=tdt), tag=4, return_status=True)
        else:
            got, st = hpcdp.recv(torch.zeros(5, dtype=tdt), tag=4, return_status=True)
            hpcdp.send(mine, nxt, tag=4)
        c.same(f"recv(return_status=True) {dt}", got, theirs)
        c.ok(f"recv status {dt}", st.source == prv and st.tag == 4, st)
    return c.fails


def body_rules(rank: int) -> list[str]:
    """Strides, grad and dtypes: each rule as the README states it. Every refusal happens on
    every rank before anything is sent, so no rank is left waiting."""
    n, c = hpcdp.world_size(), _Check(rank)
    total = float(sum(range(1, n + 1)))
    # non-contiguous inputs are read through their strides, targets written through them
    base = torch.arange(24, dtype=torch.float64).reshape(4, 6) * (rank + 1)
    want = torch.arange(24, dtype=torch.float64).reshape(4, 6) * total
    c.same("allreduce of a transposed input", hpcdp.allreduce(base.t()), want.t())
    c.same("allreduce of a strided slice", hpcdp.allreduce(base[:, ::2]), want[:, ::2])
    holder = torch.zeros(4, 12, dtype=torch.float64)
    target = holder[:, ::2]
    c.ok("allreduce into a strided out=", hpcdp.allreduce(base, out=target) is target)
    c.same("allreduce into a strided out=", holder[:, ::2], want)
    c.ok("the gaps of a strided out= untouched", bool((holder[:, 1::2] == 0).all()))
    t = base.clone().t()
    hpcdp.all_reduce(t)
    c.same("all_reduce in place on a transposed tensor", t, want.t())
    t = torch.full((3,), float(rank)).expand(2, 3)
    c.same("an expanded input is read", hpcdp.allreduce(t), torch.full((2, 3), float(sum(range(n)))))
    c.raises("an expanded target", ValueError, ("share memory", "contiguous()", "rank"),
             lambda: hpcdp.all_reduce(torch.zeros(3).expand(2, 3)))
    c.raises("an expanded out=", ValueError, ("out=", "share memory"),
             lambda: hpcdp.allreduce(torch.ones(2, 3), out=torch.zeros(3).expand(2, 3)))
    # requires_grad: inputs read through detach(); a target only under no_grad, as torch says
    p = torch.nn.Parameter(torch.full((3,), rank + 1.0))
    r = hpcdp.allreduce(p)
    c.same("allreduce of a parameter", r, torch.full((3,), total))
    c.ok("the result carries no grad", not r.requires_grad)
    c.raises("all_reduce of a parameter under grad mode", TypeError,
             ("requires grad", "torch.no_grad()", "detach()", "rank"), lambda: hpcdp.all_reduce(p))
    c.raises("out= requiring grad", TypeError, ("out= requires grad",),
             lambda: hpcdp.allreduce(torch.ones(3), out=torch.zeros(3, requires_grad=True)))
    c.raises("recv into a tensor requiring grad", TypeError, ("receive buffer requires grad",),
             lambda: hpcdp.irecv(torch.zeros(3, requires_grad=True), 0))
    c.same("a refused parameter is untouched", p.detach(), torch.full((3,), rank + 1.0))
    kept = p.detach()  # hpcdp's numpy-style broadcast copies what it may not write
    got = hpcdp.broadcast(p, root=0)
    c.ok("broadcast of a parameter returns a new tensor", got is not p and not got.requires_grad)
    c.same("broadcast of a parameter", got, torch.full((3,), 1.0))
    c.same("broadcast leaves the parameter", p.detach(), kept)
    v = p._version
    with torch.no_grad():
        hpcdp.all_reduce(p)
    c.same("all_reduce of a parameter under no_grad", p.detach(), torch.full((3,), total))
    c.ok("the version counter moved, as for torch's in-place ops", p._version > v, (v, p._version))
    # ... so autograd notices a saved tensor overwritten behind its back
    w = torch.ones(3, requires_grad=True)
    x = torch.full((3,), rank + 1.0)
    loss = (w * x).sum()  # saves x for backward
    hpcdp.all_reduce(x)
    c.raises("backward after x was reduced in place", RuntimeError, ("inplace",), loss.backward)
    # bfloat16: reduced in float32 and rounded once; 1 + k/256 lands on ties between bfloat16's
    # neighbours (round half to even), which a reduction in bfloat16 could round otherwise
    every = [torch.tensor([1.0, 2.0 ** -8, 3.0, -(2.0 ** -8)], dtype=torch.bfloat16) * (1 if r == 0 else 2 ** -8)
             for r in range(n)]
    f32 = torch.stack([e.float() for e in every])
    one = every[rank]
    r = hpcdp.allreduce(one)
    c.same("bfloat16 sum rounded once", r, f32.sum(0).to(torch.bfloat16))
    t = one.clone()
    hpcdp.all_reduce(t, "mean")
    c.same("bfloat16 mean in place", t, (f32.sum(0) / n).to(torch.bfloat16))
    t = one.clone()
    c.ok("bfloat16 allreduce(out=x) returns x", hpcdp.allreduce(t, out=t) is t)
    c.same("bfloat16 allreduce(out=x) in place", t, r)
    holder = torch.zeros(8, dtype=torch.bfloat16)
    hpcdp.allreduce(one, out=holder[::2])
    c.same("bfloat16 sum into a strided out=", holder[::2], r)
    c.raises("bfloat16 beside float32", TypeError, ("bfloat16",),
             lambda: hpcdp.allreduce(one, out=torch.zeros(4)))
    c.raises("bfloat16 beside numpy", TypeError, ("bfloat16",),
             lambda: hpcdp.all_gather(one, out=np.zeros((n, 4), np.int16)))
    # dtypes numpy lacks, and tensors hpcdp cannot view, are refused by name
    with warnings.catch_warnings():  # (torch: complex32 is experimental, quantized deprecated)
        warnings.simplefilter("ignore")
        odd = {"complex32": torch.zeros(2, dtype=torch.complex32),
               "quantized": torch.quantize_per_tensor(torch.zeros(2), 0.1, 0, torch.quint8)}
    for name, fn in (("float8_e4m3fn", lambda: hpcdp.allreduce(torch.zeros(2, dtype=torch.float8_e4m3fn))),
                     ("complex32", lambda: hpcdp.broadcast(odd["complex32"], 0)),
                     ("quantized", lambda: hpcdp.all_gather(odd["quantized"])),
                     ("meta", lambda: hpcdp.allreduce(torch.zeros(2, device="meta"))),
                     ("sparse", lambda: hpcdp.allreduce(torch.zeros(2).to_sparse()))):
        c.raises(f"{name} tensor", TypeError, (name, "rank"), fn)
    # numpy in, numpy out, with torch loaded too; a numpy input and a tensor out= meet
    a = hpcdp.allreduce(np.ones(2))
    c.ok("numpy stays numpy", type(a) is np.ndarray, type(a))
    o = torch.zeros(2, dtype=torch.float64)
    c.ok("numpy x, tensor out=", hpcdp.allreduce(np.ones(2), out=o) is o and bool((o == n).all()), o)
    return c.fails


def body_all(rank: int) -> list[str]:
    """The three bodies above in one world: TCP ranks are processes that each import torch, so
    one launch serves them all."""
    return body_every_collective(rank) + body_point_to_point(rank) + body_rules(rank)


@pytest.mark.parametrize("world", worlds("sim-1", "sim-2", "sim-3", "sim-4", "mpi"), indirect=True)
def test_every_collective_on_tensors(world: World) -> None:
    check(world.run(body_every_collective, timeout=30))


@pytest.mark.parametrize("world", worlds("sim-1", "sim-2", "sim-3", "sim-4", "mpi"), indirect=True)
def test_point_to_point_on_tensors(world: World) -> None:
    check(world.run(body_point_to_point, timeout=30))


@pytest.mark.parametrize("world", worlds("sim-1", "sim-3", "mpi"), indirect=True)
def test_tensor_rules(world: World) -> None:
    check(world.run(body_rules, timeout=30))


@pytest.mark.parametrize("world", worlds("tcp-3"), indirect=True)
def test_tensors_on_tcp(world: World) -> None:
    check(world.run(body_all, timeout=30))


def test_views_share_the_tensors_memory() -> None:
    """The arrays a call works on are the tensors' storage (``np.shares_memory``)."""
    from hpcdp._tensors import TensorCall

    t = torch.arange(12.0).reshape(3, 4)
    tc = TensorCall("test")
    a = tc.read(t)
    assert np.shares_memory(a, t.numpy()) and a.shape == (3, 4)
    assert tc.write(t) is a  # one array per tensor: ``out is x`` still means in place
    s = t[:, ::2]
    assert np.shares_memory(TensorCall("test").write(s), t.numpy())
    b = torch.ones(3, dtype=torch.bfloat16)
    moved = TensorCall("test").read(b)
    assert moved.dtype == np.int16 and np.shares_memory(moved, b.view(torch.int16).numpy())
    assert TensorCall("test", reduce=True).read(b).dtype == np.float32


def test_hpcdp_does_not_import_torch() -> None:
    """numpy users pay nothing: a numpy program never has torch imported by hpcdp."""
    code = ("import sys, numpy as np, hpcdp\n"
            "r = hpcdp.spawn(lambda rank: hpcdp.allreduce(np.ones(2), out=np.zeros(2)).tolist(), 2)\n"
            "assert r == [[2.0, 2.0]] * 2, r\n"
            "assert 'torch' not in sys.modules, 'hpcdp imported torch'\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]

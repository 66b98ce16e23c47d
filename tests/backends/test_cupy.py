"""cupy arrays through every collective, DDP, FSDP and checkpoints, on every backend.

Written once against ``hpcdp.testing.cupy_stand_in.array_module``: real cupy on a GPU machine
(``make test-gpu`` runs this file with ``HPCDP_TEST_CUPY=real``), the numpy-backed stand-in
everywhere else, so the same bodies run in every ``make test``. On the stand-in these prove the
routing (which backend sees which array, host staging, the results' array module, copies back)
and the numerics against numpy; only the GPU run proves that no transport reads device memory
directly.
"""
from __future__ import annotations

import importlib
import os
import shutil
import signal
import sys
import types

import numpy as np
import pytest

import hpcdp
from hpcdp.testing.cupy_stand_in import array_module, is_stand_in, real_cupy, stand_in_modules

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")


@pytest.fixture
def cp(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """Real cupy with a device, else the stand-in for this test only (taken out afterwards)."""
    real = real_cupy()
    if real is not None:
        return real
    if os.environ.get("HPCDP_TEST_CUPY", "").lower() == "real":
        pytest.fail("HPCDP_TEST_CUPY=real but no usable cupy/CUDA device")
    for name, mod in stand_in_modules().items():
        monkeypatch.setitem(sys.modules, name, mod)
    return sys.modules["cupy"]


# -- every collective, against numpy ----------------------------------------------------------
DTYPES = ("float32", "float64", "float16", "int64")


def _collectives(rank: int, n: int, group: "hpcdp.ProcessGroup | None" = None) -> list[str]:
    """Every collective and point-to-point call on cupy arrays; what differs from numpy."""
    cp = array_module("cupy")
    kw = {"group": group} if group is not None else {}
    fails: list[str] = []

    def same(label: str, got: object, want: np.ndarray) -> None:
        if not isinstance(got, cp.ndarray):
            fails.append(f"{label}: result is {type(got).__name__}, not cupy.ndarray")
            return
        host = got.get()
        tol = 1e-2 if want.dtype == np.float16 else 1e-6
        if host.shape != want.shape or host.dtype != want.dtype or not np.allclose(host, want, rtol=tol):
            fails.append(f"{label}: got {host.dtype}{host.shape} {host.ravel()[:4]}, "
                         f"want {want.dtype}{want.shape} {want.ravel()[:4]}")

    def local(r: int, dt: str, shape: tuple[int, ...]) -> np.ndarray:
        return (np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape) % 7 + r + 1).astype(dt)

    for dt in DTYPES:
        for shape in ((), (0,), (5,), (2 * n, 3)):
            mine = local(rank, dt, shape)
            every = [local(r, dt, shape) for r in range(n)]
            x = cp.asarray(mine)
            tag = f"{dt}{shape}"
            same(f"allreduce sum {tag}", hpcdp.allreduce(x, **kw), np.sum(every, axis=0, dtype=dt))
            same(f"allreduce max {tag}", hpcdp.allreduce(x, "max", **kw), np.max(every, axis=0))
            if dt.startswith("float"):
                same(f"allreduce mean {tag}", hpcdp.allreduce(x, "mean", **kw),
                     (np.sum(every, axis=0, dtype=np.float64) / n).astype(dt))
            y = cp.asarray(mine)
            hpcdp.allreduce(y, out=y, **kw)
            same(f"allreduce in place {tag}", y, np.sum(every, axis=0, dtype=dt))
            w = hpcdp.allreduce(cp.asarray(mine), async_op=True, **kw)
            same(f"allreduce async {tag}", w.wait(), np.sum(every, axis=0, dtype=dt))
            same(f"broadcast {tag}", hpcdp.broadcast(cp.asarray(mine), root=n - 1, **kw), every[n - 1])
            red = hpcdp.reduce(x, root=0, **kw)
            if rank == 0:
                same(f"reduce {tag}", red, np.sum(every, axis=0, dtype=dt))
            elif red is not None:
                fails.append(f"reduce {tag}: non-root got {type(red).__name__}")
            same(f"all_gather {tag}", hpcdp.all_gather(x, **kw), np.stack(every))
            gat = hpcdp.gather(x, root=n - 1, **kw)
            if rank == n - 1:
                same(f"gather {tag}", gat, np.stack(every))
            if shape and shape[0] % n == 0:
                part = shape[0] // n
                same(f"reduce_scatter {tag}", hpcdp.reduce_scatter(x, **kw),
                     np.sum(every, axis=0, dtype=dt)[rank * part:(rank + 1) * part])
                same(f"scatter {tag}", hpcdp.scatter(x, root=0, **kw),
                     every[0][rank * part:(rank + 1) * part])
                same(f"all_to_all {tag}", hpcdp.all_to_all(x, **kw),
                     np.concatenate([e[rank * part:(rank + 1) * part] for e in every]))
    # point to point: a ring, blocking and nonblocking, a non-contiguous receive buffer
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    if n > 1:
        buf = cp.zeros(6, dtype=cp.float32)
        s = hpcdp.isend(cp.full(6, rank, dtype=cp.float32), nxt, tag=3, **kw)
        hpcdp.irecv(buf, prv, tag=3, **kw).wait()
        s.wait()
        same("isend/irecv", buf, np.full(6, prv, np.float32))
        strided = cp.zeros((4, 2), dtype=cp.float64)[:, 0]  # a blocking receive, not contiguous
        s = hpcdp.isend(cp.arange(4.0) + rank, nxt, tag=4, **kw)
        hpcdp.recv(strided, prv, tag=4, **kw)
        s.wait()
        same("recv strided", strided, np.arange(4.0) + prv)
    hpcdp.barrier(**kw)
    return fails


def _spawned(rank: int) -> list[str]:
    return _collectives(rank, hpcdp.world_size())


@pytest.mark.parametrize("backend,n", [("sim", 2), ("sim", 3), ("tcp", 2)])
def test_every_collective_on_cupy_matches_numpy(cp, backend: str, n: int) -> None:
    fails = hpcdp.spawn(_spawned, n, backend=backend, timeout=60)
    assert fails == [[]] * n


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("aware", ["auto", "0"])
def test_every_collective_on_cupy_mpi(mpi_world, cp, aware: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if aware == "0":
        monkeypatch.setenv("HPCDP_CUDA_AWARE", "0")
    elif real_cupy() is None:  # the stand-in is host memory: MPI reading it directly is fine
        monkeypatch.setenv("HPCDP_CUDA_AWARE", "1")
    group = hpcdp.new_group(list(range(mpi_world.size)))
    assert _collectives(group.rank, group.size, group) == []
    if aware == "0":
        assert group.backend.cuda_aware is False
        assert group.backend._staging.allocations > 0  # staged through the pool


# -- host staging: what the transport sees ---------------------------------------------------
class _Spy:
    """A backend stand-in recording the types it is handed."""

    accepts_cupy = False

    def __init__(self) -> None:
        self.seen: list[type] = []
        self.sent: list[np.ndarray] = []

    def allreduce(self, sendbuf, recvbuf, op):  # noqa: ANN001 - mirrors Backend
        from hpcdp.backends.base import Request

        self.seen += [type(sendbuf), type(recvbuf)]
        self.sent += [sendbuf, recvbuf]
        np.copyto(recvbuf, sendbuf * 2)
        spy = self

        class Done(Request):
            def test(self) -> bool:
                return True

            def wait(self, timeout) -> bool:  # noqa: ANN001
                return True

            def pending(self) -> str:
                return ""

            def abandon(self):  # noqa: ANN202
                spy.abandoned = True
                return None

        return Done()


def test_host_staging_hands_the_transport_host_arrays_and_reuses_pinned_buffers(cp) -> None:
    from hpcdp.backends._staging import HostStaged

    spy = _Spy()
    staged = HostStaged(spy)
    for step in range(3):
        x = cp.asarray(np.arange(8.0) + step)
        out = cp.empty(8)
        assert staged.allreduce(x, out, None).wait(1.0)
        np.testing.assert_array_equal(out.get(), 2 * (np.arange(8.0) + step))
        y = cp.asarray(np.ones(8))
        assert staged.allreduce(y, y, None).wait(1.0)  # in place: one host copy, both roles
        np.testing.assert_array_equal(y.get(), 2.0)
    assert set(spy.seen) == {np.ndarray}, spy.seen  # never a device array
    assert staged.pool.allocations == 1  # one host buffer, reduced in place, reused every step
    assert all(a is b for a, b in zip(spy.sent[::2], spy.sent[1::2]))  # in place on the host
    assert staged.allreduce(np.ones(2), np.ones(2), None).wait(1.0)  # numpy: straight through


def test_staged_call_given_up_on_keeps_its_buffers_out_of_the_pool(cp) -> None:
    from hpcdp.backends._staging import HostPool, stage
    from hpcdp.backends.base import Request

    class Stuck(Request):
        def test(self) -> bool:
            return False

        def wait(self, timeout) -> bool:  # noqa: ANN001
            return False

        def pending(self) -> str:
            return "stuck"

        def abandon(self):  # noqa: ANN202
            return None

    pool = HostPool()
    dev = cp.asarray(np.ones(4))
    req = stage(pool, lambda s, r: Stuck(), "allreduce", ("sendbuf", "recvbuf"), (dev, dev))
    assert not req.wait(0.01)
    req.abandon()
    req.then()  # (a late completion must not copy back or give buffers back)
    assert pool.free == {} and dev.get().tolist() == [1.0] * 4


def test_mixing_numpy_and_cupy_in_one_call_is_rejected(cp) -> None:
    dev = cp.asarray(np.ones(3))

    def body(rank: int) -> str:
        try:
            hpcdp.allreduce(np.ones(3), out=dev if rank == 0 else cp.asarray(np.ones(3)))
        except TypeError as exc:
            return "cupy" in str(exc) and "numpy" in str(exc) and "ok" or str(exc)
        return "accepted"

    assert hpcdp.spawn(body, 2, timeout=30) == ["ok", "ok"]


# -- CUDA-awareness: a functional probe in a child process ------------------------------------
def test_probe_says_no_when_the_library_crashes_hangs_or_corrupts() -> None:
    from hpcdp.backends.mpi._staging import probe_cuda_aware

    crash = f"import os, signal; os.kill(os.getpid(), {int(signal.SIGSEGV)})"
    aware, why = probe_cuda_aware(script=crash, timeout=30)
    assert not aware and "signal 11" in why
    aware, why = probe_cuda_aware(script="import time; time.sleep(30)", timeout=1)
    assert not aware and "did not finish" in why
    aware, why = probe_cuda_aware(script="print('wrong-values')", timeout=30)
    assert not aware and "wrong values" in why
    assert probe_cuda_aware(script="print('aware')", timeout=30)[0]


def test_probe_retries_under_mpirun_when_no_singleton_can_start() -> None:
    """Where MPI cannot start a singleton (seen with Open MPI 4.1 on a lent GPU machine), the
    probe runs once more under ``mpirun -n 1``; a child that never started MPI proves nothing."""
    from hpcdp.backends.mpi._staging import probe_cuda_aware

    if shutil.which("mpirun") is None and shutil.which("mpiexec") is None:
        pytest.fail("mpirun is part of this project's set-up (make install)")
    only_under_a_launcher = ("import os, sys\n"
                             "if not any(k in os.environ for k in ('OMPI_COMM_WORLD_SIZE', 'PMI_SIZE', 'PMIX_RANK')):\n"
                             "    print('cupy'); sys.exit('Local abort before MPI_INIT completed')\n"
                             "print('sent'); print('aware')\n")
    aware, why = probe_cuda_aware(script=only_under_a_launcher, timeout=120)
    assert aware and "-n 1" in why and "Local abort" in why, why


def test_probe_child_leaves_the_launchers_job_variables_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    from hpcdp.backends.mpi._staging import probe_env

    env = {"OMPI_COMM_WORLD_RANK": "1", "PMIX_RANK": "1", "OMPI_MCA_ess_base_jobid": "9",
           "OMPI_MCA_ess": "^singleton", "OMPI_MCA_orte_hnp_uri": "x", "SLURM_PROCID": "1",
           "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_MCA_btl": "self,vader", "PATH": "/bin",
           "OMPI_MCA_plm_rsh_agent": "/bin/false", "HPCDP_CUDA_AWARE": "1"}
    kept = probe_env(env)  # settings stay (a machine without ssh needs its launch agent)
    assert kept == {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_MCA_btl": "self,vader", "PATH": "/bin",
                    "OMPI_MCA_plm_rsh_agent": "/bin/false", "HPCDP_CUDA_AWARE": "1"}


#: what the probe does, on host memory: proves a singleton MPI child starts from inside a rank
_HOST_PROBE = r"""
import numpy as np
from mpi4py import MPI
assert MPI.COMM_WORLD.Get_size() == 1, MPI.COMM_WORLD.Get_size()
a, b = np.arange(64.0), np.zeros(64)
MPI.COMM_SELF.Sendrecv(a, 0, 7, b, 0, 7)
print("aware" if (a == b).all() else "wrong-values")
"""


@pytest.mark.mpi(min_size=2)
def test_probe_child_is_a_singleton_job_from_inside_an_mpirun_rank(mpi_world) -> None:
    from hpcdp.backends.mpi._staging import probe_cuda_aware

    aware, why = probe_cuda_aware(script=_HOST_PROBE, timeout=120)
    assert aware, why
    hpcdp.barrier()


def test_cuda_aware_override_and_unprobed_default(monkeypatch: pytest.MonkeyPatch) -> None:
    from hpcdp.backends.mpi import _staging as _mpi_staging

    monkeypatch.setenv("HPCDP_CUDA_AWARE", "0")
    assert _mpi_staging.cuda_aware() is False
    monkeypatch.setenv("HPCDP_CUDA_AWARE", "1")
    assert _mpi_staging.cuda_aware() is True
    assert "HPCDP_CUDA_AWARE=1" in _mpi_staging.describe()


# -- training and checkpoints with cupy parameters ---------------------------------------------
def _train(rank: int, dev: str, strategy: str) -> tuple[float, list[list[float]]]:
    """The digits MLP for 2 epochs; test accuracy and the first parameter's first row."""
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    ex = importlib.import_module("02_ddp_train")
    from hpcdp import nn, optim
    from hpcdp.data import DistributedSampler

    xp = array_module(dev)
    x_train, y_train, x_test, y_test = ex.load_data(0)
    model = ex.build_model(32, 0).to("cuda" if dev == "cupy" else "cpu")
    wrapped = hpcdp.DDP(model) if strategy == "ddp" else hpcdp.FSDP(model, strategy=strategy)
    opt = optim.Adam(wrapped.parameters(), lr=2e-3)
    loss_fn = nn.CrossEntropyLoss()
    sampler = DistributedSampler(len(y_train), shuffle=True, seed=0)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for idx in sampler.batches(16):
            out = wrapped(xp.asarray(x_train[idx]))
            loss_fn(out, xp.asarray(y_train[idx]))
            wrapped.backward(loss_fn.backward())
            opt.step()
            opt.zero_grad()
    for p in wrapped.parameters():
        assert isinstance(p.data, xp.ndarray), type(p.data)
    out = wrapped(xp.asarray(x_test))
    pred = out.get() if dev == "cupy" else out
    first = next(iter(model.parameters())).data
    return float((pred.argmax(1) == y_test).mean()), (first.get() if dev == "cupy" else first)[:1].tolist()


@pytest.mark.parametrize("strategy", ["ddp", "full_shard", "shard_grad_op"])
def test_training_with_cupy_parameters_matches_numpy(cp, strategy: str) -> None:
    on_cpu = hpcdp.spawn(_train, 2, args=("numpy", strategy), timeout=120)
    on_gpu = hpcdp.spawn(_train, 2, args=("cupy", strategy), timeout=120)
    acc_cpu, acc_gpu = on_cpu[0][0], on_gpu[0][0]
    assert acc_cpu > 0.8 and abs(acc_gpu - acc_cpu) <= 0.02, (acc_cpu, acc_gpu)
    if is_stand_in(cp):  # the same arithmetic: the same bits
        assert on_cpu == on_gpu
    else:  # another BLAS, other reduction orders: 90 Adam steps apart, close, not equal
        np.testing.assert_allclose(on_gpu[0][1], on_cpu[0][1], rtol=0.05, atol=0.01)
    assert on_gpu[0] == on_gpu[1]  # DDP/FSDP: every rank holds the same model


def _checkpoint_round_trip(rank: int, path: str) -> list[str]:
    cp = array_module("cupy")
    import hpcdp.checkpoint as ckpt

    fails = []
    dev_state = {"w": cp.asarray(np.arange(12.0).reshape(3, 4)), "b": cp.asarray(np.ones(5, np.float32)),
                 "step": 7}
    ckpt.save(os.path.join(path, "gpu"), dev_state)
    host = ckpt.load(os.path.join(path, "gpu"), like={"w": np.zeros((3, 4)), "b": np.zeros(5, np.float32),
                                                      "step": 0})
    if type(host["w"]) is not np.ndarray or not np.array_equal(host["w"], np.arange(12.0).reshape(3, 4)):
        fails.append(f"cupy -> numpy: {type(host['w']).__name__} {host['w']}")
    ckpt.save(os.path.join(path, "cpu"), {"w": host["w"] * 2, "b": host["b"], "step": 8})
    back = ckpt.load(os.path.join(path, "cpu"), like=dev_state)
    if not isinstance(back["w"], cp.ndarray) or not np.array_equal(back["w"].get(), 2 * np.arange(12.0).reshape(3, 4)):
        fails.append(f"numpy -> cupy: {type(back['w']).__name__}")
    if back["step"] != 8 or back["b"].dtype != np.float32:
        fails.append(f"scalars/dtypes: {back['step']} {back['b'].dtype}")
    return fails


def test_checkpoint_saved_from_cupy_loads_into_numpy_and_back(cp, tmp_path) -> None:
    assert hpcdp.spawn(_checkpoint_round_trip, 2, args=(str(tmp_path),), timeout=120) == [[], []]


# -- torch CUDA tensors (DLPack: no copy) ---------------------------------------------------------
def _torch_cuda():
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not torch.cuda.is_available() or real_cupy() is None:
        if os.environ.get("HPCDP_TEST_CUPY", "").lower() == "real":
            pytest.fail("HPCDP_TEST_CUPY=real: torch with CUDA and cupy are required here")
        pytest.skip("torch with CUDA is not available (runs on the GPU machine: make test-gpu)")
    return torch


def _torch_body(rank: int) -> list[str]:
    import cupy
    import torch

    t = torch.arange(8, dtype=torch.float32, device="cuda") + rank
    view = cupy.from_dlpack(t)  # the tensor's memory, no copy
    hpcdp.allreduce(view, out=view)
    n = hpcdp.world_size()
    want = sum(np.arange(8, dtype=np.float32) + r for r in range(n))
    got = t.cpu().numpy()
    return [] if np.allclose(got, want) else [f"rank {rank}: {got} != {want}"]


def test_torch_cuda_tensors_through_collectives_without_a_copy() -> None:
    _torch_cuda()
    assert hpcdp.spawn(_torch_body, 2, timeout=60) == [[], []]


def _torch_direct_body(rank: int, group: "hpcdp.ProcessGroup | None" = None) -> list[str]:
    """CUDA tensors handed to hpcdp as they are: cupy views by DLPack, results CUDA tensors
    (``hpcdp._tensors``), in place where the call is in place."""
    import torch

    kw = {"group": group} if group is not None else {}
    n = hpcdp.world_size() if group is None else group.size
    fails: list[str] = []

    def same(label: str, got: object, want: "torch.Tensor") -> None:
        if not isinstance(got, torch.Tensor) or got.device.type != "cuda":
            fails.append(f"rank {rank} {label}: {type(got).__name__} {getattr(got, 'device', '')}, not a CUDA tensor")
            return
        host = got.cpu()
        bits = (lambda t: t.view(torch.int16)) if want.dtype == torch.bfloat16 else (lambda t: t)
        if host.dtype != want.dtype or host.shape != want.shape or not torch.equal(bits(host), bits(want)):
            fails.append(f"rank {rank} {label}: {host.dtype} {host.flatten()[:4].tolist()} != "
                         f"{want.dtype} {want.flatten()[:4].tolist()}")

    every = [torch.arange(2 * n * 3, dtype=torch.float32).reshape(2 * n, 3) % 7 + r for r in range(n)]
    total = torch.stack(every).sum(0)
    x = every[rank].cuda()
    same("allreduce", hpcdp.allreduce(x, **kw), total)
    same("allreduce async", hpcdp.allreduce(x, async_op=True, **kw).wait(), total)
    t = x.clone()
    ptr = t.data_ptr()
    hpcdp.all_reduce(t, **kw)
    same("all_reduce in place", t, total)
    if t.data_ptr() != ptr:
        fails.append(f"rank {rank} all_reduce moved the tensor")
    o = torch.empty_like(x)
    if hpcdp.allreduce(x, out=o, **kw) is not o:
        fails.append(f"rank {rank} allreduce(out=) did not return out")
    same("allreduce out=", o, total)
    same("all_gather", hpcdp.all_gather(x, **kw), torch.stack(every))
    t = x.clone()
    hpcdp.broadcast(t, src=n - 1, **kw)
    same("broadcast(src=)", t, every[n - 1])
    o = torch.empty((2, 3), device="cuda")
    hpcdp.reduce_scatter_tensor(o, x, **kw)
    same("reduce_scatter_tensor", o, total[2 * rank:2 * rank + 2])
    same("all_to_all", hpcdp.all_to_all(x, **kw), torch.cat([e[2 * rank:2 * rank + 2] for e in every]))
    same("all_reduce strided", hpcdp.allreduce(x[:, ::2], **kw), total[:, ::2])
    # bfloat16: moved as its bits, reduced in float32 and rounded once
    b = every[rank].to(torch.bfloat16).cuda() / 8
    same("bfloat16 all_gather", hpcdp.all_gather(b, **kw), torch.stack([(e.to(torch.bfloat16) / 8) for e in every]))
    same("bfloat16 allreduce", hpcdp.allreduce(b, **kw),
         torch.stack([(e.to(torch.bfloat16) / 8).float() for e in every]).sum(0).to(torch.bfloat16))
    flags = (every[rank] > 3).cuda()
    same("bool all_gather", hpcdp.all_gather(flags, **kw), torch.stack([e > 3 for e in every]))
    # point to point around a ring
    buf = torch.zeros(5, device="cuda")
    s = hpcdp.isend(torch.full((5,), float(rank), device="cuda"), (rank + 1) % n, tag=7, **kw)
    got = hpcdp.irecv(buf, (rank - 1) % n, tag=7, **kw).wait()
    s.wait()
    if got is not buf:
        fails.append(f"rank {rank} irecv did not return its tensor")
    same("isend/irecv", buf, torch.full((5,), float((rank - 1) % n)))
    hpcdp.barrier(**kw)
    return fails


@pytest.mark.parametrize("backend", ["sim", "tcp"])
def test_torch_cuda_tensors_passed_directly(backend: str) -> None:
    _torch_cuda()
    assert hpcdp.spawn(_torch_direct_body, 2, backend=backend, timeout=60) == [[], []]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("aware", ["auto", "0"])
def test_torch_cuda_tensors_passed_directly_mpi(mpi_world, aware: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    _torch_cuda()
    if aware == "0":
        monkeypatch.setenv("HPCDP_CUDA_AWARE", "0")
    group = hpcdp.new_group(list(range(mpi_world.size)))
    assert _torch_direct_body(group.rank, group) == []


def _debug_p2p_body(rank: int) -> list[str]:
    """Point to point under ``HPCDP_DEBUG=detail`` (framed messages): the transport still gets
    host arrays only, and the data arrives."""
    cp = array_module("cupy")
    g = hpcdp.get_default_group()
    g.debug = "detail"
    seen: list[str] = []
    be = g.backend
    real_send, real_recv = be.send, be.recv

    def send(buf, dst, tag):  # noqa: ANN001, ANN202 - the backend's own argument names
        seen.append(type(buf).__module__ + "." + type(buf).__name__)
        return real_send(buf, dst, tag)

    def recv(buf, src, tag):  # noqa: ANN001, ANN202
        seen.append(type(buf).__module__ + "." + type(buf).__name__)
        return real_recv(buf, src, tag)

    be.send, be.recv = send, recv
    if rank == 0:
        hpcdp.send(cp.arange(5.0), 1)
    else:
        b = cp.zeros(5)
        hpcdp.recv(b, 0)
        if b.get().tolist() != [0.0, 1.0, 2.0, 3.0, 4.0]:
            seen.append(f"wrong data {b.get()}")
    return seen


def test_debug_p2p_frames_cupy_through_host_staging(cp) -> None:
    seen = hpcdp.spawn(_debug_p2p_body, 2, timeout=30)
    assert seen[0] == ["numpy.ndarray"] and seen[1] == ["numpy.ndarray"], seen

"""hpcdp.checkpoint under failure: a rank raising mid-save, a bad plan, a rank killed mid-save."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import hpcdp
from ckpt_bodies import body_load_check, body_save, make_state
from hpcdp.testing import run_ranks
from hpcdp.checkpoint import Shard, latest, load, save

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: the bodies modules
REPO = os.path.dirname(HERE)


def _body_failing_save(rank: int, path: str, how: str) -> str:
    n = hpcdp.world_size()
    st = make_state(rank, n)
    if how == "unsupported" and rank == 1:
        st["scalars"]["bad"] = object()
    elif how == "shape" and rank == 1:
        st["big"] = st["big"][:10]
    elif how == "overlap":
        st["sharded"]["rows"] = Shard(np.zeros((2, 11), np.int32), (37, 11), (0, 0))
    elif how == "hole":
        st["sharded"]["rows"] = Shard(np.zeros((1, 11), np.int32), (37, 11), (rank, 0))
    elif how == "scalar" and rank == 1:
        st["opt"]["state"][0]["step"] = 4            # a rank that took one more optimizer step
    elif how == "string" and rank == 1:
        st["scalars"]["s"] = "another run"
    try:
        save(path, st)
    except hpcdp.CheckpointError as exc:
        return str(exc)
    return ""


class _FailingWrite:
    """VdsWriter.write that raises on rank 1 after the others have started writing."""

    def __init__(self, orig):
        self.orig = orig

    def __call__(self, writer, *a, **k):
        if writer.rank == 1:
            raise OSError(28, "No space left on device (simulated)")
        return self.orig(writer, *a, **k)


@pytest.mark.parametrize("how", ["unsupported", "shape", "overlap", "hole", "write", "scalar",
                                 "string"])
def test_failure_on_one_rank_raises_everywhere(how: str, tmp_path, monkeypatch) -> None:
    d = tmp_path / "ck"
    good = str(d / "step-1")
    run_ranks("sim", 3, body_save, good)
    if how == "write":
        from hpcdp.checkpoint import _writer_vds

        monkeypatch.setattr(_writer_vds.VdsWriter, "write",
                            lambda self, *a, _f=_FailingWrite(_writer_vds.VdsWriter.write): _f(self, *a))
    msgs = run_ranks("sim", 3, _body_failing_save, str(d / "step-2"), how)
    assert all(msgs), msgs
    assert len(set(msgs)) == 1, msgs                       # the same error on every rank
    if how in ("unsupported", "shape", "write", "scalar", "string"):
        assert "rank 1" in msgs[0] or "rank(s) [1]" in msgs[0], msgs[0]
    if how in ("scalar", "string"):
        assert "rank(s) [1]" in msgs[0] and "rank(s) [1, 2]" not in msgs[0], msgs[0]
        where = "['step']" if how == "scalar" else "['s']"
        assert where in msgs[0], msgs[0]
    if how in ("overlap", "hole"):
        assert how in msgs[0], msgs[0]
    assert latest(str(d)) == good
    assert not os.path.exists(d / "step-2")
    monkeypatch.undo()
    run_ranks("sim", 3, body_save, str(d / "step-3"))     # a later save cleans up leftovers
    assert not any(n.startswith(".tmp-") for n in os.listdir(d)), os.listdir(d)
    assert run_ranks("sim", 2, body_load_check, good, 3) == [[], []]


# -- a process killed in the middle of a save ---------------------------------------------------
_SIM_SCRIPT = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {here!r})
    import hpcdp
    from hpcdp.checkpoint import _writer_vds
    from ckpt_bodies import body_save
    d = sys.argv[1]
    hpcdp.spawn(body_save, 2, args=(d + "/step-1",))
    print("saved step-1", flush=True)
    orig = _writer_vds.VdsWriter.finish
    def finish(self, *a):
        if self.rank == 0:
            print("mid-save", flush=True)
            time.sleep(600)           # killed here: rank files written, main file not
        return orig(self, *a)
    _writer_vds.VdsWriter.finish = finish
    hpcdp.spawn(body_save, 2, args=(d + "/step-2",))
    print("should not get here", flush=True)
""")


def test_process_killed_mid_save_sim(tmp_path) -> None:
    d = str(tmp_path / "ck")
    script = _SIM_SCRIPT.format(here=HERE)
    p = subprocess.Popen([sys.executable, "-c", script, d], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        for line in p.stdout:
            if line.startswith("mid-save"):
                p.send_signal(signal.SIGKILL)
                break
        rc = p.wait(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert rc == -signal.SIGKILL, (rc, p.stderr.read())
    assert any(n.startswith(".tmp-step-2") for n in os.listdir(d)), os.listdir(d)
    assert latest(d) == os.path.join(d, "step-1")
    assert run_ranks("sim", 2, body_load_check, os.path.join(d, "step-1"), 2) == [[], []]


_MPI_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {here!r})
    import hpcdp
    from hpcdp.checkpoint import _writer_mpio
    from ckpt_bodies import body_save
    hpcdp.init("mpi")
    d = sys.argv[1]
    body_save(hpcdp.rank(), d + "/step-1")
    hpcdp.barrier()
    orig = _writer_mpio.write_slab
    def write_slab(*a, **k):
        if hpcdp.rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)   # dies inside the parallel write
        return orig(*a, **k)
    _writer_mpio.write_slab = write_slab
    body_save(hpcdp.rank(), d + "/step-2")
    print("should not get here", flush=True)
""")


def test_rank_killed_mid_save_mpirun(tmp_path) -> None:
    import shutil

    mpirun = shutil.which("mpirun")
    assert mpirun, "mpirun not found (install openmpi-bin: make sysdeps)"
    d = str(tmp_path / "ck")
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               HPCDP_TIMEOUT="60")
    env = {k: v for k, v in env.items() if not k.startswith(("PMIX_", "OMPI_COMM_", "PMI_"))}
    cmd = ["timeout", "--kill-after=10", "120", mpirun, "--oversubscribe", "-n", "2",
           sys.executable, "-c", _MPI_SCRIPT.format(here=HERE), d]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180, cwd=REPO)
    assert out.returncode != 0, out.stdout + out.stderr
    assert "should not get here" not in out.stdout
    assert latest(d) == os.path.join(d, "step-1"), (os.listdir(d), out.stderr[-2000:])
    assert not os.path.exists(os.path.join(d, "step-2"))
    assert run_ranks("sim", 3, body_load_check, os.path.join(d, "step-1"), 2) == [[], [], []]
    st = load(os.path.join(d, "step-1"))                   # and in this plain process
    assert np.array_equal(st["big"], make_state(0, 1)["big"])


# -- under mpirun: a Python-level failure on one rank inside the parallel (mpio) write ----------
#: a hang (a rank left alone in a collective write or close) ends the job after this long
MPI_WATCHDOG_S = 90


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("where", ["collective", "independent"])
def test_write_failure_on_one_rank_mpi(mpi_world, where: str, monkeypatch) -> None:
    """Rank 1's slab write raises: every rank keeps joining the collective writes, then all raise
    the same CheckpointError naming rank 1, and the previous checkpoint is still latest and loads."""
    import faulthandler
    import shutil

    import h5py

    from ckpt_bodies import shared_dir
    from hpcdp.testing import run_mpi
    from hpcdp.checkpoint import _writer_mpio

    if not h5py.get_config().mpi:
        pytest.fail("this h5py lacks MPI support: run `make install` (parallel HDF5 build)")
    d = shared_dir()
    good, bad = os.path.join(d, "step-1"), os.path.join(d, "step-2")
    # Never hang CI: past the watchdog, dump every thread's stack and exit (mpirun then ends the job).
    faulthandler.dump_traceback_later(MPI_WATCHDOG_S, exit=True)
    try:
        body_save(hpcdp.rank(), good, "mpio")
        orig = _writer_mpio.write_slab

        def write_slab(dset, data, offsets, dxpl=None):
            # rank 1 fails before HDF5's call, on its first slab of the chosen kind of transfer
            if hpcdp.rank() == 1 and data is not None and (dxpl is not None) == (where == "collective"):
                raise OSError(28, "No space left on device (simulated)")
            return orig(dset, data, offsets, dxpl=dxpl)

        monkeypatch.setattr(_writer_mpio, "write_slab", write_slab)
        try:
            body_save(hpcdp.rank(), bad, "mpio")
            msg = ""
        except hpcdp.CheckpointError as exc:
            msg = str(exc)
        monkeypatch.undo()
        msgs = hpcdp.all_gather_object(msg)
        assert all(msgs), msgs
        assert len(set(msgs)) == 1, msgs                     # the same error on every rank
        assert "rank(s) [1]" in msgs[0] and "No space left on device" in msgs[0], msgs[0]
        assert latest(d) == good
        assert not os.path.exists(bad)
        fails = run_mpi(body_load_check, good, hpcdp.world_size())
        assert fails == [[]] * hpcdp.world_size(), fails
        body_save(hpcdp.rank(), bad, "mpio")                 # and the next save works
        assert latest(d) == bad
    finally:
        faulthandler.cancel_dump_traceback_later()
        hpcdp.barrier()
        if hpcdp.rank() == 0:
            shutil.rmtree(d, ignore_errors=True)

"""hpcdp.checkpoint: round trips of every dtype, shards, resharding, both write modes, corruption."""
from __future__ import annotations

import os
import shutil

import h5py
import numpy as np
import pytest

import hpcdp
from ckpt_bodies import (
    body_async, body_load_check, body_load_error, body_load_out, body_reshard_subgroups,
    body_roundtrip, body_save, make_state, shared_dir,
)
from hpcdp.testing import check, run_mpi, run_ranks
from hpcdp.testing.fixtures import World, grid, worlds
from hpcdp.checkpoint import Shard, _commit, latest, list_checkpoints, load, save
from hpcdp.checkpoint._format import MANIFEST


@pytest.mark.parametrize("world", worlds(*grid([1, 2, 3, 4]), "mpi"), indirect=True)
def test_roundtrip(world: World, shared_tmp_path: str) -> None:
    """In the default mode (auto: mpio under MPI with a parallel h5py, vds otherwise)."""
    check(world.run(body_roundtrip, os.path.join(shared_tmp_path, "ck", "step-1")))


@pytest.mark.parametrize("world", worlds(*grid([1, 3]), "mpi"), indirect=True)
def test_load_into_out(world: World, shared_tmp_path: str) -> None:
    """``load(out=)`` fills the caller's arrays in place (resharded), after checking them all."""
    check(world.run(body_load_out, os.path.join(shared_tmp_path, "ck", "step-1")))


# MPI only: "vds" forced where "auto" would choose mpio (the spawned worlds use vds already).
@pytest.mark.parametrize("world", worlds("mpi"), indirect=True)
def test_roundtrip_vds(world: World, shared_tmp_path: str) -> None:
    check(world.run(body_roundtrip, os.path.join(shared_tmp_path, "ck", "step-1"), "vds"))


@pytest.mark.parametrize("n_load", [1, 2, 3, 4])
def test_save_on_4_load_on_k(n_load: int, tmp_path) -> None:
    path = str(tmp_path / "step-4")
    run_ranks("sim", 4, body_save, path)
    check(run_ranks("sim", n_load, body_load_check, path, 4))


def test_plain_session_reads_any_array(tmp_path) -> None:
    """No hpcdp.init, no MPI: plain h5py sees global arrays, load() returns the whole state."""
    import subprocess
    import sys

    path = str(tmp_path / "step-1")
    run_ranks("sim", 3, body_save, path)
    code = (
        "import sys, h5py, numpy as np\n"
        "sys.path.insert(0, sys.argv[2])\n"
        "from ckpt_bodies import global_arrays, expected_full, _eq\n"
        "f = h5py.File(sys.argv[1] + '/data.h5', 'r')\n"
        "assert np.array_equal(f['sharded/cols'][...], global_arrays()['cols'])\n"
        "assert f['big'].shape == (600, 512)\n"
        "import hpcdp.checkpoint as ck, hpcdp\n"
        "fails = []; _eq(expected_full(3), ck.load(sys.argv[1]), 'full', fails)\n"
        "assert not fails, fails\n"
        "assert not hpcdp.is_initialized()\n"
        "print('ok')\n")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI", "PMIX", "SLURM", "HPCDP_", "MASTER_"))}
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # tests/: ckpt_bodies
    out = subprocess.run([sys.executable, "-c", code, path, here], env=env, cwd=str(tmp_path),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


@pytest.mark.parametrize("world", worlds("sim-3", "mpi"), indirect=True)
def test_async_save(world: World, shared_tmp_path: str) -> None:
    check(world.run(body_async, os.path.join(shared_tmp_path, "a", "step-1")))


def test_keep_last_latest_and_cleanup(tmp_path) -> None:
    d = tmp_path / "ck"
    st = {"w": np.arange(10.0), "step": 0}
    assert latest(str(d)) is None
    dead = d / ".tmp-step-99-0badc0de"              # an uncommitted leftover, untouched for long
    os.makedirs(dead)
    (dead / "data.h5").write_bytes(b"torn")
    _age(dead, _commit.STALE_AFTER_S + 60)
    os.makedirs(d / "notes")                         # not a checkpoint
    for step in (1, 2, 10, 3):
        st["step"] = step
        save(str(d / f"step-{step}"), st, keep_last=3)
    names = [os.path.basename(p) for p in list_checkpoints(str(d))]
    assert names == ["step-2", "step-3", "step-10"], names
    assert latest(str(d)) == str(d / "step-10")
    assert not any(n.startswith(".tmp-") for n in os.listdir(d)), os.listdir(d)
    # re-saving under an existing name replaces it atomically
    st["step"] = 11
    save(str(d / "step-10"), st)
    assert load(str(d / "step-10"))["step"] == 11


def _age(path, seconds: float) -> None:
    """Make ``path`` and the entries in it look untouched for ``seconds``."""
    import time

    t = time.time() - seconds
    for name in os.listdir(path):
        os.utime(os.path.join(path, name), (t, t))
    os.utime(path, (t, t))


def test_cleanup_spares_concurrent_saves_and_restores_moved_aside(tmp_path) -> None:
    d = tmp_path / "ck"
    st = {"w": np.arange(10.0), "step": 1}
    save(str(d / "step-1"), st)
    tok = "0123abcd"
    live = d / f".tmp-step-7-{tok}"                  # another job's save, in progress
    stale = d / f".tmp-step-8-{tok}"                 # a save that died long ago
    mine = d / f".tmp-step-2-{tok}"                  # a dead earlier attempt at the same name
    tomb = d / f".tmp-step-0-{tok}.del"              # rotation interrupted mid-delete
    for p in (live, stale, mine, tomb):
        os.makedirs(p)
        (p / "data.h5").write_bytes(b"partial")
    _age(stale, _commit.STALE_AFTER_S + 60)
    # a re-save of step-5 that died between its two renames: the old copy is the only one
    shutil.copytree(d / "step-1", d / f".tmp-step-5-{tok}.old")
    save(str(d / "step-2"), st)
    left = sorted(os.listdir(d))
    assert left == [live.name, "step-1", "step-2", "step-5"], left
    assert load(str(d / "step-5"))["step"] == 1
    assert latest(str(d)) == str(d / "step-5")


def test_failed_resave_keeps_the_previous_checkpoint(tmp_path, monkeypatch) -> None:
    """commit() moves the old directory aside, then renames the new one in: if that fails, the
    old one is put back; if even that fails (a crash between), the next save puts it back."""
    d = tmp_path / "ck"
    final = str(d / "step-1")
    save(final, {"w": np.arange(4.0), "step": 1})
    real_rename = os.rename

    def failing(fail: set[int]):
        calls = []

        def rename(src, dst, *a, **k):
            calls.append((os.fspath(src), os.fspath(dst)))
            if len(calls) in fail:
                raise OSError(5, "Input/output error (simulated)")
            return real_rename(src, dst, *a, **k)
        return rename, calls

    rename, calls = failing({2})                    # the rename of the new directory into place
    monkeypatch.setattr(_commit.os, "rename", rename)
    with pytest.raises(hpcdp.CheckpointError, match="simulated"):
        save(final, {"w": np.arange(4.0) + 1, "step": 2})
    monkeypatch.undo()
    assert calls[0][0] == final and calls[1][1] == final, calls
    assert load(final)["step"] == 1
    assert not any(n.startswith(".tmp-") for n in os.listdir(d)), os.listdir(d)

    rename, calls = failing({2, 3})                 # ... and putting the old one back fails too
    monkeypatch.setattr(_commit.os, "rename", rename)
    with pytest.raises(hpcdp.CheckpointError, match="simulated"):
        save(final, {"w": np.arange(4.0) + 1, "step": 2})
    monkeypatch.undo()
    assert not os.path.exists(final)
    assert [n for n in os.listdir(d) if n.endswith(".old")], os.listdir(d)
    save(str(d / "step-2"), {"w": np.arange(4.0), "step": 3})  # its clean-up restores step-1
    assert load(final)["step"] == 1
    assert not any(n.startswith(".tmp-") for n in os.listdir(d)), os.listdir(d)
    assert list_checkpoints(str(d)) == [final, str(d / "step-2")]


def test_rotation_failure_is_a_warning(tmp_path, monkeypatch) -> None:
    d = tmp_path / "ck"
    save(str(d / "step-1"), {"step": 1})

    def broken(*a, **k):
        raise PermissionError(13, "Permission denied (simulated)")

    monkeypatch.setattr(_commit, "rotate", broken)
    with pytest.warns(RuntimeWarning, match="keep_last=1.*simulated"):
        assert save(str(d / "step-2"), {"step": 2}, keep_last=1) == str(d / "step-2")
    assert load(str(d / "step-2"))["step"] == 2
    assert latest(str(d)) == str(d / "step-2")


def test_bad_inputs_raise(tmp_path) -> None:
    with pytest.raises(ValueError):
        Shard(np.zeros((2, 2)), (3, 3), (2, 0))
    target = tmp_path / "never-written" / "x"
    with pytest.raises(hpcdp.CheckpointError, match="unsupported"):
        save(str(target), {"o": object()})
    assert not os.path.exists(target)
    assert not os.path.exists(tmp_path / "never-written")


def _body_keys_with_slash_and_percent(rank: int, path: str, mode: str) -> list[str]:
    """VirtualSource names are printf-like in HDF5: "%" (our escape for "/") must not break them."""
    st = {"pad": np.arange(3.0), "enc/w": np.arange(10.0), "a%b": {"c/d%2F": np.arange(4.0)}}
    save(path, st, mode=mode)
    fails: list[str] = []
    from ckpt_bodies import _eq

    _eq(st, load(path), "slash", fails)
    with h5py.File(os.path.join(path, "data.h5"), "r") as f:
        if mode == "vds" and hpcdp.world_size() > 1 and not f["enc%2Fw"].is_virtual:
            fails.append("enc/w was expected to be a virtual dataset")
    return fails


@pytest.mark.parametrize("world_size", [1, 2])
def test_keys_with_slash_and_percent_vds(world_size: int, tmp_path) -> None:
    check(run_ranks("sim", world_size, _body_keys_with_slash_and_percent,
                     str(tmp_path / "a%d" / "step-1"), "vds"))


def _body_finalize_waits(rank: int, path: str) -> tuple[bool, bool]:
    h = save(path, make_state(rank, hpcdp.world_size()), async_save=True)
    hpcdp.finalize()
    return h.done(), latest(os.path.dirname(path)) == path


def test_finalize_waits_for_async_save(tmp_path) -> None:
    path = str(tmp_path / "ck" / "step-1")
    assert run_ranks("sim", 2, _body_finalize_waits, path) == [(True, True)] * 2
    check(run_ranks("sim", 2, body_load_check, path, 2))


# -- corruption: every rank raises, naming file and dataset -------------------------------------
def _flip_byte(path: str, dataset: str) -> None:
    fn = os.path.join(path, "data.h5")
    with h5py.File(fn, "r") as f:
        d = f[dataset]
        if d.is_virtual:
            src = d.virtual_sources()[-1]
            fn, off = os.path.join(path, src.file_name), None
            with h5py.File(fn, "r") as g:
                off = g[src.dset_name].id.get_offset()
        else:
            off = d.id.get_offset()
    with open(fn, "r+b") as fh:
        fh.seek(off + 5)
        b = fh.read(1)
        fh.seek(off + 5)
        fh.write(bytes([b[0] ^ 0x10]))


def _truncate(path: str, _: str) -> None:
    fn = os.path.join(path, "data.h5")
    os.truncate(fn, os.path.getsize(fn) // 2)


def _drop_manifest(path: str, _: str) -> None:
    with h5py.File(os.path.join(path, "data.h5"), "r+") as f:
        del f[MANIFEST]


def _wrong_shape(path: str, dataset: str) -> None:
    with h5py.File(os.path.join(path, "data.h5"), "r+") as f:
        del f[dataset]
        f.create_dataset(dataset, data=np.zeros((2, 2), np.float32))


CORRUPTIONS = {"flipped-byte": (_flip_byte, "big"), "flipped-byte-shard": (_flip_byte, "sharded/rows"),
               "truncated": (_truncate, None), "missing-manifest": (_drop_manifest, "manifest"),
               "wrong-shape": (_wrong_shape, "big")}


@pytest.mark.parametrize("saved_on", [1, 3])
@pytest.mark.parametrize("like_state", [False, True])
@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_corruption_raises_on_every_rank(case: str, like_state: bool, saved_on: int, tmp_path) -> None:
    path = str(tmp_path / "step-1")
    run_ranks("sim", saved_on, body_save, path)
    damage, dataset = CORRUPTIONS[case]
    damage(path, dataset)
    msgs = run_ranks("sim", 2, body_load_error, path, like_state)
    for r, m in enumerate(msgs):
        assert m, f"rank {r} loaded a damaged checkpoint ({case})"
        assert "data.h5" in m or "rank-" in m, m
        if dataset:
            assert dataset in m, m


# -- under mpirun (-n 2 and -n 4) --------------------------------------------------------------
# MPI only: sub-groups standing in for other world sizes, the mpio writer, HPCDP_CKPT_MODE read
# in every rank's process, and a byte flipped once in a file every rank then reads.
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", ["auto", "vds"])
def test_reshard_subgroups_mpi(mpi_world, mode: str) -> None:
    d = shared_dir()
    try:
        check(run_mpi(body_reshard_subgroups, os.path.join(d, "step-1"), mode))
    finally:
        hpcdp.barrier()
        if hpcdp.rank() == 0:
            shutil.rmtree(d, ignore_errors=True)


@pytest.mark.mpi(min_size=2)
def test_env_forces_vds_mpi(mpi_world, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPCDP_CKPT_MODE", "vds")
    d = shared_dir()
    path = os.path.join(d, "step-1")
    run_mpi(body_save, path)
    files = sorted(os.listdir(path))
    assert any(f.startswith("rank-") for f in files), files
    with h5py.File(os.path.join(path, "data.h5"), "r") as f:
        assert f["big"].is_virtual
    hpcdp.barrier()
    if hpcdp.rank() == 0:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.mpi(min_size=2)
def test_mpio_is_one_file_mpi(mpi_world) -> None:
    import h5py as _h5

    if not _h5.get_config().mpi:
        pytest.fail("this h5py lacks MPI support: run `make install` (parallel HDF5 build)")
    d = shared_dir()
    path = os.path.join(d, "step-1")
    run_mpi(body_save, path, "mpio")
    assert os.listdir(path) == ["data.h5"]
    with h5py.File(os.path.join(path, "data.h5"), "r") as f:
        assert f["big"].id.get_create_plist().get_layout() == h5py.h5d.CONTIGUOUS
    hpcdp.barrier()
    if hpcdp.rank() == 0:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.mpi(min_size=2)
def test_corruption_mpi(mpi_world) -> None:
    d = shared_dir()
    path = os.path.join(d, "step-1")
    run_mpi(body_save, path)
    hpcdp.barrier()
    if hpcdp.rank() == 0:
        _flip_byte(path, "sharded/rows")
    hpcdp.barrier()
    for like_state in (False, True):
        msgs = run_mpi(body_load_error, path, like_state)
        for r, m in enumerate(msgs):
            assert "sharded/rows" in m and "checksum (corrupt data)" in m, (r, m)
            assert "truncated" not in m, (r, m)  # a checksum failure is not a read failure
    hpcdp.barrier()
    if hpcdp.rank() == 0:
        shutil.rmtree(d, ignore_errors=True)


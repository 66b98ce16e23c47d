"""Checkpoints never touch what hpcdp did not write (issue 9, items 1-3).

- 1: ``save`` replaces an existing path only when it is a committed hpcdp checkpoint (its format
  marker and a valid manifest, nothing else in it); anything else raises and is left as it was;
- 2: ``keep_last`` rotation and ``latest`` see only committed hpcdp checkpoints;
- 3: a re-save that died between its two renames is recovered by ``latest`` and ``load``.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap

import h5py
import numpy as np
import pytest

import hpcdp
from hpcdp.testing import run_mpi, run_ranks
from hpcdp.checkpoint import _commit, latest, list_checkpoints, load, save
from hpcdp.checkpoint._format import MANIFEST

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: the bodies modules
STATE = {"w": np.arange(8.0), "step": 1}


def snapshot(root: str) -> dict[str, tuple]:
    """Every entry under ``root`` and ``root`` itself: type, size, mtime and content hash."""
    st = os.lstat(root)
    out: dict[str, tuple] = {".": (stat.S_IFMT(st.st_mode), st.st_mtime_ns)}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            digest = None
            if stat.S_ISREG(st.st_mode):
                with open(p, "rb") as fh:
                    digest = hashlib.sha256(fh.read()).hexdigest()
            out[os.path.relpath(p, root)] = (stat.S_IFMT(st.st_mode), st.st_size, st.st_mtime_ns,
                                             digest)
    return out


def _plain_h5(path: str) -> None:
    with h5py.File(path, "w") as f:
        f["images"] = np.arange(100, dtype=np.uint8)


def _target(kind: str, root: str) -> str:
    """Build one kind of existing path that is not a replaceable checkpoint; return it."""
    if kind == "project":
        os.makedirs(os.path.join(root, "proj", "src"))
        with open(os.path.join(root, "proj", "src", "main.py"), "w") as fh:
            fh.write("print('my work')\n")
        return os.path.join(root, "proj")
    if kind == "parent-of-checkpoints":
        for step in (1, 2):
            save(os.path.join(root, "ck", f"step-{step}"), dict(STATE, step=step))
        return os.path.join(root, "ck")
    if kind == "cwd":
        os.makedirs(os.path.join(root, "work"))
        with open(os.path.join(root, "work", "notes.txt"), "w") as fh:
            fh.write("notes\n")
        os.chdir(os.path.join(root, "work"))
        return "."
    if kind == "foreign-data-h5":
        os.makedirs(os.path.join(root, "dataset"))
        _plain_h5(os.path.join(root, "dataset", "data.h5"))
        return os.path.join(root, "dataset")
    if kind in ("marker-no-manifest", "checkpoint-plus-user-file", "symlink-to-checkpoint"):
        ck = os.path.join(root, "ck", "step-1")
        save(ck, STATE)
        if kind == "marker-no-manifest":
            with h5py.File(os.path.join(ck, "data.h5"), "r+") as f:
                del f[MANIFEST]
            return ck
        if kind == "checkpoint-plus-user-file":
            with open(os.path.join(ck, "README.txt"), "w") as fh:
                fh.write("the run that converged\n")
            return ck
        os.symlink(ck, os.path.join(root, "best"))
        return os.path.join(root, "best")
    if kind == "empty-dir":
        os.makedirs(os.path.join(root, "empty"))
        return os.path.join(root, "empty")
    if kind == "file":
        with open(os.path.join(root, "model.bin"), "wb") as fh:
            fh.write(b"\0" * 64)
        return os.path.join(root, "model.bin")
    raise AssertionError(kind)


TARGETS = ["project", "parent-of-checkpoints", "cwd", "foreign-data-h5", "marker-no-manifest",
           "checkpoint-plus-user-file", "symlink-to-checkpoint", "empty-dir", "file"]


# -- 1: save over something that is not a committed checkpoint ----------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("async_save", [False, True])
@pytest.mark.parametrize("kind", TARGETS)
def test_save_never_replaces_what_it_did_not_write(kind: str, async_save: bool, tmp_path,
                                                   monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    root = str(tmp_path)
    target = _target(kind, root)
    before = snapshot(root)
    with pytest.raises(hpcdp.CheckpointError, match="not a committed hpcdp checkpoint") as info:
        h = save(target, {"w": np.zeros(3), "step": 9}, async_save=async_save)
        if async_save:
            h.wait(timeout=60)
    assert os.path.abspath(target).rstrip(os.sep) in str(info.value)
    assert snapshot(root) == before                 # not a byte, not an mtime, no .tmp- entry


@pytest.mark.timeout(60)
def test_resave_over_own_checkpoint_still_works(tmp_path) -> None:
    ck = str(tmp_path / "ck" / "last")
    save(ck, STATE)
    save(ck, dict(STATE, step=2))
    assert load(ck)["step"] == 2
    assert sorted(os.listdir(tmp_path / "ck")) == ["last"]


def _body_save_over(rank: int, target: str) -> str:
    try:
        save(target, {"w": np.full(3, rank), "step": 9})
    except hpcdp.CheckpointError as exc:
        return str(exc)
    return ""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["project", "parent-of-checkpoints"])
def test_save_over_foreign_dir_raises_on_every_rank(kind: str, tmp_path) -> None:
    root = str(tmp_path)
    target = _target(kind, root)
    before = snapshot(root)
    msgs = run_ranks("sim", 3, _body_save_over, target)
    assert all(msgs) and len(set(msgs)) == 1, msgs
    assert "not a committed hpcdp checkpoint" in msgs[0], msgs[0]
    assert snapshot(root) == before


# -- 2: rotation and latest() recognise only committed checkpoints --------------------------------
@pytest.mark.timeout(60)
def test_rotation_spares_foreign_directories(tmp_path) -> None:
    d = str(tmp_path / "ck")
    os.makedirs(os.path.join(d, "dataset"))
    _plain_h5(os.path.join(d, "dataset", "data.h5"))          # a user's data, not a checkpoint
    save(os.path.join(d, "step-0"), STATE)
    shutil.copytree(os.path.join(d, "step-0"), os.path.join(d, "old-run"))
    with h5py.File(os.path.join(d, "old-run", "data.h5"), "r+") as f:
        del f[MANIFEST]                                        # marker without a manifest
    keep = {n: snapshot(os.path.join(d, n)) for n in ("dataset", "old-run")}
    for step in (1, 2, 3):
        save(os.path.join(d, f"step-{step}"), dict(STATE, step=step), keep_last=1)
    assert sorted(os.listdir(d)) == ["dataset", "old-run", "step-3"]
    assert {n: snapshot(os.path.join(d, n)) for n in keep} == keep
    assert list_checkpoints(d) == [os.path.join(d, "step-3")]


@pytest.mark.timeout(60)
def test_rotation_keeps_a_checkpoint_holding_user_files(tmp_path) -> None:
    d = str(tmp_path / "ck")
    save(os.path.join(d, "step-1"), STATE)
    with open(os.path.join(d, "step-1", "notes.txt"), "w") as fh:
        fh.write("keep me\n")
    with pytest.warns(RuntimeWarning, match="notes.txt"):
        save(os.path.join(d, "step-2"), dict(STATE, step=2), keep_last=1)
    assert sorted(os.listdir(os.path.join(d, "step-1"))) == ["data.h5", "notes.txt"]
    assert latest(d) == os.path.join(d, "step-2")


@pytest.mark.timeout(60)
def test_latest_skips_foreign_directories(tmp_path) -> None:
    d = str(tmp_path / "ck")
    save(os.path.join(d, "step-5"), dict(STATE, step=5))
    os.makedirs(os.path.join(d, "step-9"))
    _plain_h5(os.path.join(d, "step-9", "data.h5"))            # sorts after step-5
    os.makedirs(os.path.join(d, "step-10"))
    with open(os.path.join(d, "step-10", "data.h5"), "wb") as fh:
        fh.write(b"not even HDF5")
    os.symlink(os.path.join(d, "step-5"), os.path.join(d, "step-11"))   # hpcdp never makes links
    assert latest(d) == os.path.join(d, "step-5")
    assert list_checkpoints(d) == [os.path.join(d, "step-5")]
    assert load(latest(d))["step"] == 5


# -- 3: a crash between the two renames of a re-save --------------------------------------------
_KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    from hpcdp.checkpoint import _commit, save
    d = sys.argv[1]
    save(d + "/last", {"w": np.arange(8.0), "step": 1})
    real, calls = os.rename, []
    def rename(src, dst, *a, **k):
        calls.append(dst)
        if len(calls) == 2:                         # the new directory's rename into place
            print("between the renames", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return real(src, dst, *a, **k)
    _commit.os.rename = rename
    save(d + "/last", {"w": np.arange(8.0) + 1, "step": 2})
    print("should not get here", flush=True)
""")


def _crash_between_renames(d: str) -> None:
    """Run a re-save of ``d/last`` in a process killed between its two renames."""
    out = subprocess.run([sys.executable, "-c", _KILL_SCRIPT, d], capture_output=True, text=True,
                         timeout=120, cwd=HERE)
    assert out.returncode == -signal.SIGKILL, (out.returncode, out.stdout, out.stderr[-2000:])
    assert "between the renames" in out.stdout
    left = os.listdir(d)
    assert "last" not in left and any(n.endswith(".old") for n in left), left


@pytest.mark.timeout(150)
def test_latest_recovers_a_resave_killed_between_renames(tmp_path) -> None:
    d = str(tmp_path / "ck")
    _crash_between_renames(d)
    assert latest(d) == os.path.join(d, "last")
    assert load(os.path.join(d, "last"))["step"] == 1
    assert "last" in os.listdir(d)
    save(os.path.join(d, "last"), dict(STATE, step=3))         # and the name works on
    assert load(os.path.join(d, "last"))["step"] == 3
    assert sorted(os.listdir(d)) == ["last"]


@pytest.mark.timeout(150)
def test_load_recovers_a_resave_killed_between_renames(tmp_path) -> None:
    d = str(tmp_path / "ck")
    _crash_between_renames(d)
    assert load(os.path.join(d, "last"))["step"] == 1          # no latest() first
    assert latest(d) == os.path.join(d, "last")


def _body_load_step(rank: int, path: str) -> int:
    return load(path)["step"]


def _moved_aside(d: str, *, saved: bool = False) -> str:
    """The state a crash between the renames leaves, made without a subprocess (``saved``: the
    checkpoint ``d/last`` was already saved, collectively)."""
    final = os.path.join(d, "last")
    if not saved:
        save(final, STATE)
    os.rename(final, os.path.join(d, ".tmp-last-0123abcd.old"))
    shutil.copytree(os.path.join(d, ".tmp-last-0123abcd.old"), os.path.join(d, ".tmp-last-4567cdef"))
    return final


@pytest.mark.timeout(120)
def test_ranks_loading_together_recover_once(tmp_path) -> None:
    final = _moved_aside(str(tmp_path / "ck"))
    assert run_ranks("sim", 4, _body_load_step, final) == [1] * 4
    assert latest(str(tmp_path / "ck")) == final


@pytest.mark.timeout(60)
def test_load_sees_a_directory_another_rank_restored_meanwhile(tmp_path, monkeypatch) -> None:
    """The race ``test_ranks_loading_together_recover_once`` hit now and then: this rank looks
    (no ``last`` yet: the path would be a file), another rank restores ``last`` (a directory),
    then this rank reads: it must read ``last/data.h5``, not try to open the directory."""
    from hpcdp.checkpoint import _commit as commit, _reader as reader

    final = _moved_aside(str(tmp_path / "ck"))
    real, raced = reader.data_file, []

    def looked_then_raced(path):
        fn = real(path)
        if not raced:
            raced.append(commit.recover(final))  # the other rank, right after this one looked
        return fn

    monkeypatch.setattr(reader, "data_file", looked_then_raced)
    assert load(final)["step"] == 1
    assert raced == [True]


@pytest.mark.timeout(60)
def test_recovery_restores_only_checkpoints_and_only_free_names(tmp_path) -> None:
    d = str(tmp_path / "ck")
    final = _moved_aside(d)
    save(final, dict(STATE, step=2))                           # the name is taken again
    assert latest(d) == final and load(final)["step"] == 2
    # a moved-aside directory that is not a committed checkpoint is never put under a real name
    os.makedirs(os.path.join(d, ".tmp-other-89abcdef.old"))
    _plain_h5(os.path.join(d, ".tmp-other-89abcdef.old", "data.h5"))
    assert latest(d) == final
    assert not os.path.exists(os.path.join(d, "other"))
    with pytest.raises(hpcdp.CheckpointError, match="no such checkpoint"):
        load(os.path.join(d, "other"))


@pytest.mark.timeout(60)
def test_cleanup_never_deletes_user_entries_named_like_ours(tmp_path) -> None:
    """Only hpcdp's own temporary names with only hpcdp's files in them are ever deleted."""
    d = tmp_path / "ck"
    save(str(d / "step-1"), STATE)
    mine = d / ".tmp-step-1-0badc0de"
    (mine / "sub").mkdir(parents=True)
    (mine / "sub" / "thesis.tex").write_text("years of work")
    users = d / ".tmp-build"
    users.mkdir()
    (users / "data.h5").write_bytes(b"user")
    old = _commit.time.time() - _commit.STALE_AFTER_S - 60
    for p in (mine, users):
        os.utime(p, (old, old))
    save(str(d / "step-1"), STATE)
    assert (mine / "sub" / "thesis.tex").read_text() == "years of work"
    assert (users / "data.h5").read_bytes() == b"user"


# -- under mpirun -------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_ownership_mpi(mpi_world) -> None:
    from ckpt_bodies import shared_dir

    d = shared_dir()
    try:
        target = _target("project", d) if hpcdp.rank() == 0 else None
        target = hpcdp.broadcast_object(target, root=0)
        before = snapshot(d) if hpcdp.rank() == 0 else None
        msgs = run_mpi(_body_save_over, target)
        assert all(msgs) and len(set(msgs)) == 1, msgs
        assert "not a committed hpcdp checkpoint" in msgs[0]
        hpcdp.barrier()
        if hpcdp.rank() == 0:
            assert snapshot(d) == before
        final = os.path.join(d, "ck", "last")
        save(final, STATE)                                     # collective
        if hpcdp.rank() == 0:
            _moved_aside(os.path.join(d, "ck"), saved=True)
        hpcdp.barrier()
        assert run_mpi(_body_load_step, final) == [1] * hpcdp.world_size()
        assert latest(os.path.join(d, "ck")) == final
    finally:
        hpcdp.barrier()
        if hpcdp.rank() == 0:
            shutil.rmtree(d, ignore_errors=True)

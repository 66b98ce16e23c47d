"""The bulk I/O paths: large slabs read with ``pread`` and checksummed as they arrive (load),
slabs flushed by an early fsync while their checksums run (save). The guarantees are the slow
path's: exact bytes, any corruption refused on every rank, a failed fsync fails the save."""
from __future__ import annotations

import errno
import json
import os
import threading
from typing import Any

import h5py
import numpy as np
import pytest

import hpcdp
from ckpt_bodies import BF16, uneven
from hpcdp.checkpoint import Shard, latest, load, save
from hpcdp.checkpoint import _commit, _flush, _reader
from hpcdp.checkpoint._layout import read_manifest, survey
from hpcdp.testing import check, run_ranks
from hpcdp.testing.fixtures import World, worlds

ROWS = 1030                    # split unevenly: slabs of ~1/n of the rows
ROW_BYTES = 4608               # each slab at least 1 MiB on 4 ranks (RAW_MIN_BYTES)
DTYPES = ["float32", ">f8", "complex64", "bool", "int16", "bf16"]
COLS_SHAPE = (256, 8192)       # int32, sharded by columns: not one run of bytes (HDF5 reads it)


def _global(dt: str) -> np.ndarray:
    rng = np.random.default_rng(DTYPES.index(dt))
    if dt == "bf16":
        return rng.integers(0, 1 << 16, (ROWS, ROW_BYTES // 2), dtype=np.uint16).view(BF16)
    d = np.dtype(dt)
    shape = (ROWS, ROW_BYTES // d.itemsize)
    if d.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    if d.kind == "i":
        return rng.integers(-30000, 30000, shape).astype(d)
    if d.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(d)
    return rng.standard_normal(shape).astype(d)


def _cols_global() -> np.ndarray:
    return np.arange(np.prod(COLS_SHAPE), dtype=np.int32).reshape(COLS_SHAPE)


def _state(rank: int, n: int, shift: int = 0) -> dict:
    """This rank's row blocks of every array (``shift``: another layout of the same arrays)."""
    out: dict[str, Any] = {}
    for dt in DTYPES:
        g = _global(dt)
        lo, hi = uneven(ROWS, n, (rank + shift) % n)
        if shift:
            lo, hi = max(0, lo - 7 * shift), max(0, lo - 7 * shift) + (hi - lo)
        out[dt.replace(">", "be_")] = Shard(g[lo:hi], g.shape, (lo, 0))
    g = _cols_global()
    clo, chi = uneven(COLS_SHAPE[1], n, rank)
    out["cols"] = Shard(g[:, clo:chi], COLS_SHAPE, (0, clo))
    return {"big": out, "step": 3}


def _compare(got: dict, want: dict, where: str) -> list[str]:
    fails = []
    for k, w in want["big"].items():
        g = got["big"][k]
        wl, gl = (w.local, g.local) if isinstance(w, Shard) else (w, g)
        if not isinstance(gl, np.ndarray) or gl.dtype != wl.dtype or gl.tobytes() != wl.tobytes():
            fails.append(f"{where}: {k} differs")
    return fails


def _body_round_trip(rank: int, path: str) -> list[str]:
    n = hpcdp.world_size()
    save(path, _state(rank, n))
    fails = _compare(load(path, like=_state(rank, n)), _state(rank, n), "same layout")
    # another layout: every rank keeps parts of slabs it did not write (read in blocks)
    like = _state(rank, n, shift=1)
    for k, v in like["big"].items():
        like["big"][k] = Shard(np.zeros_like(v.local), v.global_shape, v.offsets)
    fails += _compare(load(path, like=like), _state(rank, n, shift=1), "resharded")
    whole = load(path)  # every array at its global shape
    for dt in DTYPES:
        if whole["big"][dt.replace(">", "be_")].tobytes() != _global(dt).tobytes():
            fails.append(f"whole: {dt} differs")
    if whole["big"]["cols"].tobytes() != _cols_global().tobytes():
        fails.append("whole: cols differs")
    return fails


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", worlds("sim-1", "sim-4", "tcp-3", "mpi"), indirect=True)
def test_large_slabs_round_trip(world: World, shared_tmp_path: str) -> None:
    """Exact bytes of every dtype whether a rank reads whole slabs, parts of them or everything."""
    check(world.run(_body_round_trip, os.path.join(shared_tmp_path, "ck", "step-1")))


# -- corruption inside a large slab ---------------------------------------------------------------
def _flip(path: str, dataset: str, row: int) -> None:
    """Flip one byte of ``row`` of ``dataset``, in whichever file holds it."""
    fn = os.path.join(path, "data.h5")
    with h5py.File(fn, "r") as f:
        pieces = survey(f, fn, read_manifest(f, fn))[dataset]
        p = next(p for p in pieces
                 if p.slab["offsets"][0] <= row < p.slab["offsets"][0] + p.slab["shape"][0])
        at0 = p.at[0] + row - p.slab["offsets"][0]
    with h5py.File(p.file, "r") as g:
        d = g[p.name]
        off = d.id.get_offset() + at0 * d.shape[1] * d.dtype.itemsize + 5
    with open(p.file, "r+b") as fh:
        fh.seek(off)
        b = fh.read(1)
        fh.seek(off)
        fh.write(bytes([b[0] ^ 0x10]))


def _body_load_msg(rank: int, path: str, shift: int) -> str:
    n = hpcdp.world_size()
    try:
        load(path, like=_state(rank, n, shift))
    except hpcdp.CheckpointError as exc:
        return str(exc)
    return ""


def _body_save_big(rank: int, path: str) -> None:
    save(path, _state(rank, hpcdp.world_size()))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", worlds("sim-2", "tcp-3", "mpi"), indirect=True)
@pytest.mark.parametrize("shift", [0, 1], ids=["whole-slabs", "parts"])
def test_a_flipped_byte_in_a_large_slab_is_refused(world: World, shift: int,
                                                   shared_tmp_path: str) -> None:
    path = os.path.join(shared_tmp_path, f"ck{shift}", "step-1")
    world.run(_body_save_big, path)
    world.from_root(_flip, path, "big/float32", ROWS // 2)
    msgs = world.run(_body_load_msg, path, shift)
    assert all(msgs) and len(set(msgs)) == 1, msgs
    assert "checksum" in msgs[0] and "big/float32" in msgs[0], msgs[0]


# -- the pread path itself (one process, no launcher) ---------------------------------------------
def test_large_row_slabs_take_the_pread_path(tmp_path, monkeypatch) -> None:
    """The fast path reads every row-sharded array (so the tests above test it) and nothing of
    the column-sharded one, whose slabs are not one run of bytes each."""
    path = str(tmp_path / "step-1")
    run_ranks("sim", 2, _body_save_big, path)
    seen: list[int] = []
    orig = os.preadv  # (the reader's one read call; ``pread_into`` only finishes a short read)
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: (seen.append(sum(memoryview(b).nbytes
                                                                             for b in bufs)),
                                                             orig(fd, bufs, off))[1])
    got = load(path)
    assert got["big"]["float32"].tobytes() == _global("float32").tobytes()
    assert got["big"]["cols"].tobytes() == _cols_global().tobytes()
    assert max(seen) <= _reader.RAW_BLOCK_BYTES, max(seen)
    assert sum(seen) == sum(_global(dt).nbytes for dt in DTYPES), (sum(seen), len(seen))


def test_data_h5_slabs_take_the_pread_path(tmp_path, monkeypatch) -> None:
    """The large slabs of data.h5 itself (as MPI-IO checkpoints hold every array) are read with
    ``pread`` for every dtype, big-endian, bool, complex and bfloat16 included: the survey found
    where each lies and that HDF5 would convert nothing (``Piece.raw``). Exact bytes."""
    path = str(tmp_path / "step-1")
    run_ranks("sim", 1, _body_save_plain, path)
    assert sorted(os.listdir(path)) == ["data.h5"], os.listdir(path)
    seen: list[int] = []
    orig = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: (seen.append(sum(memoryview(b).nbytes
                                                                             for b in bufs)),
                                                             orig(fd, bufs, off))[1])
    got = load(path)
    for dt in DTYPES:
        assert got["big"][dt.replace(">", "be_")].tobytes() == _global(dt).tobytes(), dt
    assert sum(seen) == sum(_global(dt).nbytes for dt in DTYPES), (sum(seen), len(seen))


def test_a_file_cut_short_while_loading_is_refused(tmp_path, monkeypatch) -> None:
    """Cut after every check that it holds its bytes and after it is open, just before the
    data is read: an error naming the dataset, never zeros or a part of it."""
    path = str(tmp_path / "step-1")
    run_ranks("sim", 1, _body_save_big, path)
    orig = _reader._Reader._place

    def place_then_cut(self: Any, *args: Any) -> Any:
        out = orig(self, *args)
        if out is not None:
            fd, off = out
            os.truncate(os.readlink(f"/proc/self/fd/{fd}"), off + (1 << 20))
        return out

    monkeypatch.setattr(_reader._Reader, "_place", place_then_cut)
    with pytest.raises(hpcdp.CheckpointError, match=r"'big/float32' cannot be read \(truncated\?\)"):
        load(path, like=_state(0, 1))


def _open_under(path: str) -> list[str]:
    """The files under ``path`` this process holds open (Linux: /proc/self/fd)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # (the descriptor listdir itself used)
            continue
        if target.startswith(path):
            out.append(target)
    return sorted(out)


def _body_save_plain(rank: int, path: str) -> None:
    """Every array whole and replicated: rank 0 writes it into data.h5 itself (as MPI-IO
    checkpoints hold every array)."""
    save(path, {"big": {dt.replace(">", "be_"): _global(dt) for dt in DTYPES}, "step": 3})


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
@pytest.mark.parametrize("where", ["data.h5", "rank files"])
def test_a_load_leaves_no_file_open(tmp_path, where: str) -> None:
    """The large slabs of data.h5 are read after HDF5's file is closed, through a duplicate of
    its descriptor; those of rank files as they come. No file stays open after a load, whole or
    into ``out=``, nor after one that fails its checksum."""
    path = str(tmp_path / "step-1")
    run_ranks("sim", 1, _body_save_plain if where == "data.h5" else _body_save_big, path)
    assert (sorted(os.listdir(path)) == ["data.h5"]) == (where == "data.h5"), os.listdir(path)
    like = load(path)  # every array whole
    out = {"big": {k: np.zeros_like(v) for k, v in like["big"].items()}, "step": 0}
    load(path, out=out)
    for dt in DTYPES:
        assert out["big"][dt.replace(">", "be_")].tobytes() == _global(dt).tobytes(), dt
    assert _open_under(str(tmp_path)) == []
    _flip(path, "big/float32", ROWS // 2)
    for kw in ({"like": like}, {"out": out}, {}):
        with pytest.raises(hpcdp.CheckpointError, match="big/float32.*checksum"):
            load(path, **kw)
        assert _open_under(str(tmp_path)) == [], kw


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_bulk_reads_run_with_hdf5_closed_and_a_kept_error_holds_no_file(tmp_path, monkeypatch) -> None:
    """While the deferred slabs are read, HDF5 has no file or dataset open (only the duplicate
    descriptor is); and a failed check or load whose error the caller keeps (a log, a retry)
    holds no file open through the objects in its traceback."""
    from hpcdp.checkpoint import _reader

    path = str(tmp_path / "step-1")
    run_ranks("sim", 1, _body_save_plain, path)
    seen: list[tuple[int, int, int]] = []
    orig = _reader._Reader.read_deferred

    def spy(self: Any) -> None:
        seen.append((len(self._deferred), h5py.h5f.get_obj_count(h5py.h5f.OBJ_ALL, h5py.h5f.OBJ_FILE
                                                                 | h5py.h5f.OBJ_DATASET),
                     len(_open_under(str(tmp_path)))))
        orig(self)

    monkeypatch.setattr(_reader._Reader, "read_deferred", spy)
    got = load(path)
    assert got["big"]["float32"].tobytes() == _global("float32").tobytes()
    assert len(seen) == 1 and seen[0][0] > 0 and seen[0][1:] == (0, 1), seen
    with h5py.File(os.path.join(path, "data.h5"), "r+") as f:
        del f["big/float32"]
    kept = []
    for check in (lambda: _reader.verify_structure(path), lambda: load(path)):
        with pytest.raises(hpcdp.CheckpointError, match="float32") as info:
            check()
        kept.append(info)
        assert _open_under(str(tmp_path)) == [], kept


@pytest.mark.parametrize("algo", ["xxh3_64", "crc32c"])
def test_large_slabs_with_a_streamed_checksum(tmp_path, monkeypatch, algo: str) -> None:
    """Slab checksums fed piece by piece (format 3's plain XXH3-64, CRC32C) on the pread path:
    exact bytes, and a flipped byte refused."""
    from hpcdp.checkpoint import _save

    monkeypatch.setattr(_save, "usable_checksums", lambda: (algo,))
    path = str(tmp_path / "step-1")
    run_ranks("sim", 1, _body_save_plain, path)
    with h5py.File(os.path.join(path, "data.h5"), "r") as f:
        assert json.loads(f["_hpcdp_manifest"].asstr()[()])["checksum"] == algo
    got = load(path)
    for dt in DTYPES:
        assert got["big"][dt.replace(">", "be_")].tobytes() == _global(dt).tobytes(), dt
    _flip(path, "big/float32", ROWS // 2)
    with pytest.raises(hpcdp.CheckpointError, match=f"big/float32.*{algo.upper()} checksum"):
        load(path)


# -- a failed early fsync fails the save ----------------------------------------------------------
class _FailFirstHelperFsync:
    """``_commit.fsync_path`` whose first call from a save's fsync helper thread fails with EIO."""

    def __init__(self, orig: Any) -> None:
        self.orig, self.left, self.lock = orig, 1, threading.Lock()

    def __call__(self, p: str) -> None:
        if threading.current_thread().name == "hpcdp-ckpt-fsync":
            with self.lock:
                fail, self.left = self.left > 0, self.left - 1
            if fail:
                raise OSError(errno.EIO, "Input/output error (simulated)", p)
        self.orig(p)


def _body_fsync_fails(rank: int, d: str, patch: bool, every: int | None) -> list[Any]:
    n = hpcdp.world_size()
    good, bad = os.path.join(d, "step-1"), os.path.join(d, "step-2")
    orig, orig_every = _commit.fsync_path, _flush.FLUSH_EVERY_BYTES
    if patch:
        _commit.fsync_path = _FailFirstHelperFsync(orig)
        _flush.FLUSH_EVERY_BYTES = every or orig_every
    try:
        save(bad, _state(rank, n))
        msg = ""
    except hpcdp.CheckpointError as exc:
        msg = str(exc)
    finally:
        _commit.fsync_path, _flush.FLUSH_EVERY_BYTES = orig, orig_every
    hpcdp.barrier()
    out = [msg, latest(d), os.path.exists(bad)]
    hpcdp.barrier()
    save(bad, _state(rank, n))                      # the next save works
    return out + [_compare(load(good, like=_state(rank, n)), _state(rank, n), "good")]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", worlds("sim-2", "tcp-3", "mpi"), indirect=True)
@pytest.mark.parametrize("every", [None, 1 << 20], ids=["after-the-writes", "during-the-writes"])
def test_a_failed_background_fsync_fails_the_save(world: World, every: int | None,
                                                 shared_tmp_path: str, monkeypatch) -> None:
    """The kernel reports a write-back error to one fsync only: the helper thread's error is the
    save's, on every rank, and the previous checkpoint stays the latest. ``every``: the helper
    fsyncs only once the slabs are written (a small state), or already between them."""
    d = os.path.join(shared_tmp_path, "ck")
    world.run(_body_save_big, os.path.join(d, "step-1"))
    in_process = world.backend == "sim"        # ranks are threads here: patch once, for all
    if in_process:
        monkeypatch.setattr(_commit, "fsync_path", _FailFirstHelperFsync(_commit.fsync_path))
        if every:
            monkeypatch.setattr(_flush, "FLUSH_EVERY_BYTES", every)
    got = world.run(_body_fsync_fails, d, not in_process, every)
    monkeypatch.undo()
    msgs = [g[0] for g in got]
    assert all(msgs) and len(set(msgs)) == 1, msgs
    assert "Input/output error (simulated)" in msgs[0], msgs[0]
    assert all(g[1] == os.path.join(d, "step-1") and not g[2] for g in got), got
    assert all(g[3] == [] for g in got), got


def test_flusher(tmp_path, monkeypatch) -> None:
    """fsyncs a file once ``every`` new bytes were written to it, after the writes on ``flush``,
    each asked-for fsync before ``wait`` returns; keeps the first error and then stops."""
    synced: list[tuple[str, str]] = []

    def fsync(p: str) -> None:
        synced.append((threading.current_thread().name, p))
        if p.endswith("bad"):
            raise OSError(errno.EIO, "Input/output error (simulated)", p)

    monkeypatch.setattr(_commit, "fsync_path", fsync)
    f = _flush.Flusher(every=100)
    f.wrote("a", 60)
    f.wrote("b", 99)
    assert f.wait() is None and synced == []            # below ``every``: nothing yet
    f = _flush.Flusher(every=100)
    f.wrote("a", 60)
    f.wrote("a", 40)                                    # 100 bytes: fsync "a"
    f.flush(["b"])
    assert f.wait() is None and f.wait() is None
    assert sorted(synced) == [("hpcdp-ckpt-fsync", "a"), ("hpcdp-ckpt-fsync", "b")], synced
    with pytest.raises(RuntimeError):
        f.flush(["a"])
    synced.clear()
    f = _flush.Flusher(every=100)
    f.flush(["1-bad"])
    exc = f.wait()
    assert isinstance(exc, OSError) and exc.errno == errno.EIO
    f2 = _flush.Flusher()
    f2.flush(["0-bad", "1-ok"])                         # sorted: the bad one first, then none
    assert isinstance(f2.wait(), OSError)
    assert [p for _, p in synced] == ["1-bad", "0-bad"], synced

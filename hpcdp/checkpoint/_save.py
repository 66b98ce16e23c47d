"""``save``: the collective protocol, in order (every step on every rank of the group).

1. flatten the state locally (copying it first for ``async_save``);
2. gather every rank's dataset specs and shard blocks; check they agree and that shards tile;
3. rank 0 creates the temporary directory and broadcasts its name;
4. write the slabs (``_writer_mpio`` or ``_writer_vds``), CRC32 of each slab computed on the way;
5. gather the slab checksums (and any failure); build the manifest, identical on every rank;
6. finish the files (manifest, close), fsync each rank's files;
7. rank 0 verifies the directory, renames it into place, fsyncs the parent, rotates; broadcasts.
A failure on any rank at any step makes every rank raise the same ``CheckpointError`` listing the
failing ranks; the temporary directory is discarded and the previous checkpoint is untouched.
"""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ..errors import CheckpointError
from . import _commit
from ._format import FORMAT, FORMAT_VERSION, checksum_of, default_checksum, encode_manifest, flatten
from ._group import backend_name, ckpt_group, pending, resolve, set_pending
from ._plan import make_plan, slab_data

__all__ = ["save", "AsyncSave", "choose_mode"]

MODES = ("auto", "mpio", "vds")


def choose_mode(group: Any, mode: str | None) -> str:
    """``mode`` or ``HPCDP_CKPT_MODE`` (auto/mpio/vds); auto = mpio on MPI with parallel h5py."""
    want = (mode or os.environ.get("HPCDP_CKPT_MODE") or "auto").lower()
    if want not in MODES:
        raise ValueError(f"checkpoint mode must be one of {MODES}, got {want!r}")
    if want == "vds":
        return "vds"
    import h5py

    mpi_ok = backend_name(group) == "mpi" and bool(h5py.get_config().mpi)
    if want == "mpio" and not mpi_ok:
        raise CheckpointError(f"save: mode 'mpio' needs the MPI backend and MPI-enabled h5py "
                              f"(backend {backend_name(group)!r}, h5py mpi={h5py.get_config().mpi})")
    return "mpio" if mpi_ok else "vds"


def _describe(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"


def _agree(group: Any, what: str, path: str, err: str | None, payload: Any = None) -> list[Any]:
    """All-gather (err, payload); raise the same CheckpointError everywhere if any rank failed."""
    got = group.all_gather_object((err, payload))
    bad = [(r, e) for r, (e, _) in enumerate(got) if e is not None]
    if bad:
        detail = "; ".join(f"rank {r}: {e}" for r, e in bad)
        raise CheckpointError(f"save {path!r}: {what} failed on rank(s) {[r for r, _ in bad]}: {detail}")
    return [p for _, p in got]


def _first_difference(specs: list[list[tuple]]) -> str | None:
    ref = specs[0]
    for r, s in enumerate(specs[1:], 1):
        if s == ref:
            continue
        for i in range(max(len(s), len(ref))):
            a = ref[i] if i < len(ref) else None
            b = s[i] if i < len(s) else None
            if a != b:
                return f"entry {i}: rank 0 has {a}, rank {r} has {b}"
    return None


def _save_on(group: Any, final: str, tree: dict | None, leaves: list, mode: str,
             keep_last: int | None, local_err: str | None) -> str:
    rank, size = group.rank, group.size
    # 2. agree on the plan
    specs = None if local_err else [l.spec() for l in leaves]
    blocks = None if local_err else [(l.offsets, tuple(l.data.shape)) if l.kind == "shard" else None
                                     for l in leaves]
    got = _agree(group, "preparing the state", final, local_err,
                 (specs, blocks, mode, tree if rank == 0 else None, default_checksum()))
    all_specs = [g[0] for g in got]
    diff = _first_difference(all_specs)
    if diff is not None:
        raise CheckpointError(f"save {final!r}: ranks passed different states ({diff}); every rank "
                              "must save the same keys, shapes and dtypes (shards: the global ones)")
    modes = {g[2] for g in got}
    if len(modes) != 1:
        raise CheckpointError(f"save {final!r}: ranks chose different modes {[g[2] for g in got]}")
    tree0 = got[0][3]
    algo = got[0][4]  # rank 0's checksum, so a rank without the crc32c package still agrees
    plans = make_plan(all_specs[0], [g[1] for g in got], size)  # raises alike on every rank

    # 3. temporary directory
    tmp, err = None, None
    if rank == 0:
        try:
            tmp = _commit.begin(final)
        except Exception as exc:  # noqa: BLE001
            err = _describe(exc)
    tmp = _agree(group, "creating the temporary directory", final, err, tmp)[0]

    # 4. write
    if mode == "mpio":
        from ._writer_mpio import MpioWriter

        writer: Any = MpioWriter(tmp, group.backend.comm, rank)
    else:
        from ._writer_vds import VdsWriter

        writer = VdsWriter(tmp, rank)
    err, crcs = None, []
    try:
        # Checksums in a helper thread while this one writes (both release the GIL).
        mine = [(i, s) for i, p in enumerate(plans) if (s := p.slab_of(rank)) is not None]
        with ThreadPoolExecutor(1, thread_name_prefix="hpcdp-ckpt-crc") as pool:
            futs = [(i, s, pool.submit(checksum_of, slab_data(leaves[i], plans[i], rank), algo))
                    for i, s in mine]
            writer.write(plans, leaves, tree0)
            crcs = [(i, s.as_json(f.result())) for i, s, f in futs]
    except Exception as exc:  # noqa: BLE001
        err = _describe(exc)
        writer.abort()
    try:
        got = _agree(group, "writing", final, err, crcs)
    except CheckpointError:
        if rank == 0:
            _commit.discard(tmp)
        raise

    # 5. manifest (identical on every rank: built from gathered data only)
    import hpcdp

    datasets = {p.path: {"shape": list(p.shape), "dtype": p.dtype, "type": p.note or p.dtype,
                         "kind": p.kind, "mode": p.mode, "slabs": []} for p in plans}
    for per_rank in got:
        for i, slab in per_rank:
            datasets[plans[i].path]["slabs"].append(slab)
    for d in datasets.values():
        d["slabs"].sort(key=lambda s: s["offsets"])
    files = []
    if mode == "vds":
        from ._writer_vds import _in_main, rank_file

        files = sorted({rank_file(s.rank) for p in plans if not _in_main(p) for s in p.slabs})
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "hpcdp_version": hpcdp.__version__,
                "world_size": size, "mode": mode, "checksum": algo, "created_unix": None,
                "tree": tree0, "datasets": datasets, "files": files}
    raw, mcrc = encode_manifest(manifest)

    # 6. finish and fsync
    err = None
    try:
        written = writer.finish(raw, mcrc)
        for p in written:
            _commit.fsync_path(p)
    except Exception as exc:  # noqa: BLE001
        err = _describe(exc)
        writer.abort()
    try:
        _agree(group, "finishing the files", final, err)
    except CheckpointError:
        if rank == 0:
            _commit.discard(tmp)
        raise

    # 7. verify, commit, rotate (rank 0)
    err = None
    if rank == 0:
        try:
            from ._reader import verify_structure

            verify_structure(tmp)
            _commit.commit(tmp, final)
            if keep_last is not None:
                _commit.rotate(os.path.dirname(final), keep_last, final)
        except Exception as exc:  # noqa: BLE001
            err = _describe(exc)
            _commit.discard(tmp)
    _agree(group, "committing", final, err)
    return final


class AsyncSave:
    """Handle of a save running in a background thread; ``wait()`` returns the checkpoint path."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._done = threading.Event()
        self._exc: BaseException | None = None
        self._thread: threading.Thread | None = None

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> str:
        """Block until the save committed (or failed: raises its ``CheckpointError``)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"async save of {self.path!r} still running after {timeout} s")
        if self._thread is not None:
            self._thread.join()
        if self._exc is not None:
            raise self._exc
        return self.path

    def _run(self, fn: Any) -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to wait()
            self._exc = exc
        finally:
            self._done.set()


def wait_pending(group: Any) -> None:
    h = pending(group)
    if h is not None:
        try:
            h.wait()
        except CheckpointError:
            pass  # reported by the handle's own wait(); a later save or load goes on
        finally:
            set_pending(group, None)


def save(path: str | os.PathLike, state: dict, *, group: Any = None, keep_last: int | None = None,
         async_save: bool = False, mode: str | None = None) -> str | AsyncSave:
    """Write ``state`` as the checkpoint ``path`` (a directory); collective over ``group``.

    Args:
        path: e.g. ``"ckpt/step-100"``; the same on every rank.
        state: nested dict of arrays (numpy/cupy, replicated: rank 0's copy is written), ``Shard``s,
            scalars, strings, lists and tuples.
        group: process group (default: the default group; none needed in a plain session).
        keep_last: keep only the newest N checkpoints in ``path``'s directory.
        async_save: copy the arrays now, write in a background thread, return an ``AsyncSave``.
        mode: "mpio", "vds" or "auto" (default: ``HPCDP_CKPT_MODE`` or auto).

    Returns:
        The checkpoint path, or an ``AsyncSave`` handle whose ``wait()`` returns it.
    """
    if keep_last is not None and int(keep_last) < 1:
        raise ValueError(f"save: keep_last must be >= 1, got {keep_last}")
    group = resolve(group)
    final = os.path.abspath(os.fspath(path)).rstrip(os.sep)
    wait_pending(group)  # saves on one group run one at a time
    cg = ckpt_group(group)
    local_err, tree, leaves = None, None, []
    try:
        m = choose_mode(group, mode)
        tree, leaves = flatten(state, copy=async_save)
    except Exception as exc:  # noqa: BLE001 - reported on every rank by _agree
        local_err, m = _describe(exc), "?"
    if not async_save:
        return _save_on(cg, final, tree, leaves, m, keep_last, local_err)
    handle = AsyncSave(final)
    t = threading.Thread(target=handle._run, name="hpcdp-ckpt-save",
                         args=(lambda: _save_on(cg, final, tree, leaves, m, keep_last, local_err),))
    handle._thread = t
    set_pending(group, handle)
    t.start()
    return handle

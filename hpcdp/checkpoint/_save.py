"""``save``: the collective protocol, in order (every step on every rank of the group).

1. flatten the state locally (copying it first for ``async_save``);
2. gather every rank's dataset specs, shard blocks and a digest of its non-array values; check
   they agree (rank 0's scalars are the ones written) and that shards tile;
3. rank 0 checks that ``path`` is free or a committed checkpoint it may replace (anything else
   raises, untouched), creates the temporary directory and broadcasts its name;
4. write the slabs (``_writer_mpio`` or ``_writer_vds``); a rank that fails goes on taking part in
   the remaining collective writes with nothing to write; a helper thread fsyncs what is written
   as it goes (``_flush``), and the checksum of each slab runs while the last ones go out;
5. gather the slab checksums (and any failure); build the manifest, identical on every rank;
6. finish the files (manifest, close), fsync each rank's files; rank 0 meanwhile verifies the
   directory (what it reads is what the fsync makes durable; a failure of either fails the save);
7. rank 0 renames the directory into place, fsyncs the parent; broadcasts; then
   rotates (a rotation failure is a warning: the new checkpoint is already committed).
A failure on any rank at any step makes every rank raise the same ``CheckpointError`` listing the
failing ranks; the files are closed on every rank together, the temporary directory is discarded
and the previous checkpoint is untouched.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import warnings
from typing import Any


from .. import trace
from ..trace.hooks import state as trace_state
from ..comm import world as _world
from .._config import setting
from .._version import __version__
from ..comm.validation import check_timeout
from ..errors import (
    CheckpointError, CollectiveMismatchError, CommTimeoutError, HpcdpError, PeerFailureError,
    public, public_error,
)
from . import _commit
from ._flush import Flusher
from ._format import (
    FORMAT, FORMAT_VERSION, checksum_of, encode_manifest, flatten, rank_file, usable_checksums,
)
from ._group import backend_label, ckpt_group, native_comm, pending, resolve, set_pending
from ._plan import make_plan, slab_data

__all__ = ["save", "AsyncSave", "choose_mode", "raised_from"]

MODES = ("auto", "mpio", "vds")

#: what one rank sees when its peers never join a checkpoint's internal collectives
_COLLECTIVE_FAILURES = (CollectiveMismatchError, CommTimeoutError, PeerFailureError)


def raised_from(call: str, path: Any, group: Any, exc: HpcdpError) -> BaseException:
    """What ``checkpoint.save``/``load`` raise for ``exc``: the same class, raised from the public
    call (``errors.public_error``). A failed internal collective (mismatch, timeout, peer gone)
    first says that the call is collective: ``all_gather #19 ... timed out`` alone does not tell
    a torch user that ``if rank == 0: save(...)`` is the mistake."""
    if not isinstance(exc, _COLLECTIVE_FAILURES):
        return public_error(exc)
    try:
        rank: Any = resolve(group).rank
    except Exception:  # noqa: BLE001 - the message only
        rank = "?"
    return public_error(exc, f"checkpoint.{call}({os.fspath(path)!r}) on rank {rank}: "
                             f"checkpoint.{call} is collective: every rank of the group must call "
                             "it (a `if rank == 0:` guard around it is the usual cause). ")


def choose_mode(group: Any, mode: str | None) -> str:
    """``mode`` or ``HPCDP_CKPT_MODE`` (auto/mpio/vds); auto = mpio on MPI with parallel h5py."""
    want = (mode or setting("HPCDP_CKPT_MODE")).lower()
    if want not in MODES:
        raise ValueError(f"checkpoint mode must be one of {MODES}, got {want!r}")
    if want == "vds":
        return "vds"
    import h5py

    mpi_ok = native_comm(group) is not None and bool(h5py.get_config().mpi)
    if want == "mpio" and not mpi_ok:
        raise CheckpointError(f"save: mode 'mpio' needs the MPI backend and MPI-enabled h5py "
                              f"(backend {backend_label(group)!r}, h5py mpi={h5py.get_config().mpi})")
    return "mpio" if mpi_ok else "vds"


def _describe(exc: BaseException) -> str:
    from ._h5util import SlabWriteError

    if isinstance(exc, SlabWriteError) and exc.__cause__ is not None:
        exc = exc.__cause__  # name HDF5's own error
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


def tree_digest(tree: dict | None) -> str | None:
    """SHA-256 of the tree (containers, scalars and strings, array paths): ranks must agree on it."""
    if tree is None:
        return None
    raw = json.dumps(tree, sort_keys=True, separators=(",", ":"), default=repr)
    return hashlib.sha256(raw.encode()).hexdigest()


def checked_tree(tree: dict | None, leaves: list) -> dict | None:
    """``tree`` with every stored list's values (a SHA-256 of its bytes) in its node: a list of
    floats is a dataset, not a scalar of the tree, yet every rank must save the same one, as it
    must the same scalars (a replicated array, by contrast, is rank 0's copy by contract)."""
    if tree is None:
        return None
    data = {l.path: l.data for l in leaves}

    def walk(node: dict) -> dict:
        t = node["t"]
        if t == "seq":
            a = data[node["path"]]
            return {**node, "n": len(a), "sha": hashlib.sha256(a.tobytes()).hexdigest()}
        if t == "dict":
            return {**node, "items": [{**it, "v": walk(it["v"])} for it in node["items"]]}
        if t in ("list", "tuple"):
            return {**node, "items": [walk(c) for c in node["items"]]}
        return node

    return walk(tree)


def _tree_difference(a: Any, b: Any, where: str = "state") -> str:
    """Where two trees first differ, for the error message."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.get("t") != b.get("t"):
            return f"{where} is a {a.get('t')} on rank 0, a {b.get('t')}"
        if a.get("t") == "scalar":
            va, vb = (f"{n.get('value')!r} ({n.get('dtype') or n.get('type')})" for n in (a, b))
            return f"{where} is {va} on rank 0, {vb}"
        if a.get("t") == "seq":
            va, vb = (f"a {n.get('seq')} of {n.get('n')} {n.get('of')}s" for n in (a, b))
            return f"{where} is {va} on rank 0, {vb} of other values" if va == vb else \
                f"{where} is {va} on rank 0, {vb}"
        ia, ib = a.get("items", []), b.get("items", [])
        for i, (x, y) in enumerate(zip(ia, ib)):
            if x != y:
                if isinstance(x, dict) and "k" in x and isinstance(y, dict) and "k" in y:
                    if x["k"] != y["k"]:
                        return f"{where} has key {x['k']!r} on rank 0, {y['k']!r}"
                    return _tree_difference(x["v"], y["v"], f"{where}[{x['k']!r}]")
                return _tree_difference(x, y, f"{where}[{i}]")
        if len(ia) != len(ib):
            return f"{where} has {len(ia)} entries on rank 0, {len(ib)}"
    return f"{where} differs"


def _check_trees(group: Any, final: str, digests: list[str | None], tree: dict | None) -> None:
    """Raise on every rank if ranks passed different scalars, strings or structure."""
    bad = [r for r, d in enumerate(digests) if d != digests[0]]
    if not bad:
        return
    # Rare: exchange the whole trees only now, to say where the first rank that differs differs.
    trees = group.all_gather_object(tree)
    where = _tree_difference(trees[0], trees[bad[0]])
    raise CheckpointError(f"save {final!r}: rank(s) {bad} passed scalars, strings or containers "
                          f"different from rank 0's ({where} on rank {bad[0]}); every rank must "
                          "save the same non-array values")


def _manifest(plans: list, got: list, mode: str, size: int, algo: str, tree0: dict) -> dict:
    """The manifest, from the plan and every rank's (plan index, slab with checksum) only."""
    datasets = {p.path: {"shape": list(p.shape), "dtype": p.dtype, "type": p.note or p.dtype,
                         "kind": p.kind, "mode": p.mode, "slabs": []} for p in plans}
    for per_rank in got:
        for i, slab in per_rank:
            datasets[plans[i].path]["slabs"].append(slab)
    for d in datasets.values():
        d["slabs"].sort(key=lambda s: s["offsets"])
    files = []
    if mode == "vds":
        from ._writer_vds import _in_main  # (h5py: imported when a save writes)

        files = sorted({rank_file(s.rank) for p in plans if not _in_main(p) for s in p.slabs})
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "hpcdp_version": __version__,
            "world_size": size, "mode": mode, "checksum": algo, "created_unix": None,
            "tree": tree0, "datasets": datasets, "files": files}


class _Phases:
    """The save's consecutive steps as ``checkpoint.<phase>`` spans on the timeline (``HPCDP_TRACE``)."""

    def __init__(self) -> None:
        self._cur: Any = None

    def __call__(self, name: str) -> None:
        self.end()
        if trace_state.on:
            self._cur = trace.span(f"checkpoint.{name}", "checkpoint")
            self._cur.__enter__()

    def end(self) -> None:
        cur, self._cur = self._cur, None
        if cur is not None:
            cur.__exit__(None, None, None)


def _save_on(group: Any, final: str, tree: dict | None, leaves: list, mode: str,
             keep_last: int | None, local_err: str | None) -> str:
    phase = _Phases()
    try:
        return _save_steps(group, final, tree, leaves, mode, keep_last, local_err, phase)
    finally:
        phase.end()


def _save_steps(group: Any, final: str, tree: dict | None, leaves: list, mode: str,
                keep_last: int | None, local_err: str | None, phase: _Phases) -> str:
    rank, size = group.rank, group.size
    phase("plan")
    # 2. agree on the plan
    specs = None if local_err else [l.spec() for l in leaves]
    checked = None if local_err else checked_tree(tree, leaves)
    blocks = None if local_err else [(l.offsets, tuple(l.data.shape)) if l.kind == "shard" else None
                                     for l in leaves]
    got = _agree(group, "preparing the state", final, local_err,
                 (specs, blocks, mode, tree if rank == 0 else None, usable_checksums(),
                  tree_digest(checked)))
    # structure and values first: where they differ says more than a dataset spec (a list's length)
    _check_trees(group, final, [g[5] for g in got], checked)
    all_specs = [g[0] for g in got]
    diff = _first_difference(all_specs)
    if diff is not None:
        raise CheckpointError(f"save {final!r}: ranks passed different states ({diff}); every rank "
                              "must save the same keys, shapes and dtypes (shards: the global ones)")
    modes = {g[2] for g in got}
    if len(modes) != 1:
        raise CheckpointError(f"save {final!r}: ranks chose different modes {[g[2] for g in got]}")
    tree0 = got[0][3]
    # the best checksum every rank can compute (a rank without the xxhash package: CRC32C)
    algo = next(a for a in got[0][4] if all(a in g[4] for g in got))
    plans = make_plan(all_specs[0], [g[1] for g in got], size)  # raises alike on every rank

    # 3. temporary directory
    tmp, err = None, None
    if rank == 0:
        try:
            tmp = _commit.begin(final)
        except Exception as exc:  # noqa: BLE001
            err = _describe(exc)
    tmp = _agree(group, "preparing the directory", final, err, tmp)[0]

    # 4. write
    phase("write")
    if mode == "mpio":
        from ._writer_mpio import MpioWriter

        writer: Any = MpioWriter(tmp, native_comm(group), rank)
    else:
        from ._writer_vds import VdsWriter

        writer = VdsWriter(tmp, rank)
    err, crcs, mine = None, [], []
    # Whatever fails here, every rank still runs writer.write to its end: in mpio mode it joins
    # every collective write (with nothing to write after a local failure), so no rank is left
    # waiting in one.
    try:
        mine = [(i, s, slab_data(leaves[i], plans[i], rank))
                for i, p in enumerate(plans) if (s := p.slab_of(rank)) is not None]
    except Exception as exc:  # noqa: BLE001
        err = _describe(exc)
    # The device writes earlier slabs out while later ones are copied (``Flusher``), and the rest
    # as soon as the last is written; the checksums run meanwhile, in time this core would idle
    # in the final fsync (run beside the writes, they would only slow them: the same core copies
    # the bytes into the page cache, or aggregates them).
    early = Flusher()
    try:
        try:
            writer.write(plans, leaves, tree0, failed=err is not None, wrote=early.wrote)
        except Exception as exc:  # noqa: BLE001
            err = err or _describe(exc)
        if err is None:
            early.flush(writer.early_files())
            try:
                crcs = [(i, s.as_json(checksum_of(data, algo))) for i, s, data in mine]
            except Exception as exc:  # noqa: BLE001
                err = _describe(exc)
        try:
            got = _agree(group, "writing", final, err, crcs)
        except CheckpointError:
            early.wait()
            writer.abort()  # all ranks together: closing an mpio file is collective
            if rank == 0:
                _commit.discard(tmp)
            raise

        # 5. manifest (identical on every rank: built from gathered data only)
        raw, mcrc = encode_manifest(_manifest(plans, got, mode, size, algo, tree0))

        # 6. finish and fsync (finish closes the file on every rank even when it fails on one);
        # rank 0 checks what it wrote (from the page cache) while the helper fsyncs it
        phase("fsync")
        err = None
        try:
            early.flush(writer.finish(raw, mcrc))
            if rank == 0:
                from ._reader import verify_structure

                verify_structure(tmp)
        except Exception as exc:  # noqa: BLE001
            err = _describe(exc)
        exc_sync = early.wait()
        if exc_sync is not None:  # the kernel reports a write-back error to one fsync only
            err = _describe(exc_sync)
    finally:
        early.wait()
    try:
        _agree(group, "finishing the files", final, err)
    except CheckpointError:
        writer.abort()
        if rank == 0:
            _commit.discard(tmp)
        raise

    # 7. commit (rank 0), then rotate: the save succeeded once committed, so a
    # rotation failure is a warning, not a failed save.
    phase("commit")
    err, rotate_err = None, None
    if rank == 0:
        try:
            _commit.commit(tmp, final)  # verify_structure ran with the fsync
        except Exception as exc:  # noqa: BLE001
            err = _describe(exc)
            _commit.discard(tmp)
        if err is None and keep_last is not None:
            try:
                _commit.rotate(os.path.dirname(final), keep_last, final)
            except Exception as exc:  # noqa: BLE001
                rotate_err = _describe(exc)
    _agree(group, "committing", final, err)
    if rotate_err is not None:
        warnings.warn(f"save {final!r}: committed, but deleting older checkpoints "
                      f"(keep_last={keep_last}) failed: {rotate_err}", RuntimeWarning, stacklevel=2)
    return final


class AsyncSave:
    """Handle of a save running in a background thread; ``wait()`` returns the checkpoint path."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._done = threading.Event()
        self._exc: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._reported = False

    def done(self) -> bool:
        return self._done.is_set()

    @public
    def wait(self, timeout: float | None = None) -> str:
        """Block until the save committed (or failed: raises its ``CheckpointError``)."""
        timeout = None if timeout is None else check_timeout("AsyncSave.wait", timeout)
        if not self._done.wait(timeout):
            raise TimeoutError(f"async save of {self.path!r} still running after {timeout} s")
        if self._thread is not None:
            self._thread.join()
        if self._exc is not None:
            self._reported = True
            raise self._exc
        return self.path

    def _run(self, fn: Any) -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to wait()
            self._exc = exc
        finally:
            self._done.set()


@_world.on_finalize
def _finalize_hook(group: Any) -> None:
    """``hpcdp.finalize``: an async save still writing runs collectives on this group's transport;
    let it commit (every rank calls ``finalize``, so the save completes) before the transport goes."""
    wait_pending(group, warn=True)


def wait_pending(group: Any, *, warn: bool = False) -> None:
    """Wait for ``group``'s async save, if any. Its failure is the handle's to report (``wait()``);
    with ``warn`` (at ``finalize``, the last chance) a failure nobody collected becomes a warning."""
    h = pending(group)
    if h is not None:
        reported = h._reported
        try:
            h.wait()
        except Exception as exc:  # noqa: BLE001
            if not warn and not isinstance(exc, CheckpointError):
                raise
            if warn and not reported:
                warnings.warn(f"async checkpoint save of {h.path!r} failed and its handle was never "
                              f"waited on: {exc}", RuntimeWarning, stacklevel=3)
        finally:
            set_pending(group, None)


def save(path: str | os.PathLike, state: dict, *, group: Any = None, keep_last: int | None = None,
         async_save: bool = False, mode: str | None = None) -> str | AsyncSave:
    """Write ``state`` as the checkpoint ``path`` (a directory); collective over ``group``.

    Collective: every rank of ``group`` must call ``save`` with the same ``path`` (each passes
    its own state; shards are written by their owners, replicated arrays once). A save guarded
    by ``if rank == 0:`` waits for ranks that never come, and raises (a ``CommTimeoutError``,
    ``PeerFailureError`` or ``CollectiveMismatchError``) saying that ``save`` is collective.

    Args:
        path: e.g. ``"ckpt/step-100"``; the same on every rank. An existing ``path`` is replaced
            only if it is a committed hpcdp checkpoint with nothing else in it; anything else (a
            project directory, ``"."``, the parent of ``step-*/``) raises ``CheckpointError``
            and is left untouched.
        state: nested dict of arrays (numpy/cupy, replicated: rank 0's copy is written), ``Shard``s,
            scalars, strings, lists and tuples.
        group: process group (default: the default group; none needed in a plain session).
        keep_last: keep only the newest N checkpoints in ``path``'s directory (only committed
            hpcdp checkpoints count, and only they are ever deleted).
        async_save: copy the arrays now, write in a background thread, return an ``AsyncSave``.
        mode: "mpio", "vds" or "auto" (default: ``HPCDP_CKPT_MODE`` or auto).

    Returns:
        The checkpoint path, or an ``AsyncSave`` handle whose ``wait()`` returns it.
    """
    try:
        return _save(path, state, group, keep_last, async_save, mode)
    except HpcdpError as exc:
        raise raised_from("save", path, group, exc)  # noqa: B904 - exc is its __context__


def _save(path: str | os.PathLike, state: dict, group: Any, keep_last: int | None,
          async_save: bool, mode: str | None) -> str | AsyncSave:
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

    def write() -> str:
        try:
            return _save_on(cg, final, tree, leaves, m, keep_last, local_err)
        except HpcdpError as exc:
            raise raised_from("save", path, group, exc)  # noqa: B904 - exc is its __context__

    t = threading.Thread(target=handle._run, name="hpcdp-ckpt-save", args=(write,))
    handle._thread = t
    set_pending(group, handle)
    t.start()
    return handle

"""``load``: read a checkpoint on any number of ranks, verify it, and reshard.

Each rank opens ``data.h5`` read-only with HDF5's POSIX driver and, before it allocates anything,
validates the manifest (``_manifest``) and where every dataset's bytes are (``_layout``: nothing
from outside the checkpoint, stored bytes behind every declared shape). It then reads only what it
needs: whole datasets for replicated arrays, and for a ``Shard`` of ``like`` the slabs that meet
its block. Every slab is checked against its checksum before any byte of it is used; one that a
rank keeps only part of is read and checked in C-order blocks of ``READ_BLOCK_BYTES``, so a rank
holds its own part plus one block, never a whole foreign slab. A large slab stored as one run of
bytes that HDF5 would copy unconverted is read with ``pread`` straight into its place, a
``RAW_BLOCK_BYTES`` piece at a time, each checksummed at once while it is still in the CPU's
cache: one pass over memory instead of a read pass and then a checksum pass (format 4's
checksum is made of such blocks, each hashed in one call). The whole slabs of data.h5 itself are
read last, after HDF5's file is closed (through a duplicate of its descriptor): the metadata
work of the load, HDF5's included, then runs before the bulk reads flush the CPU's caches, not
between them. That work runs on cold caches all the same (whatever ran before the load flushed
them), so each fact is asked of HDF5 once: the survey finds where data.h5's large datasets lie
and that HDF5 would convert nothing, as it checks their type and storage. Errors are gathered so every rank raises the same ``CheckpointError`` naming the
file and dataset (one small reduction when there is none); nothing is loaded in part: ``load``
returns a new state and never modifies ``like``. ``load(out=)`` reads into the caller's arrays
instead (no second copy of the state; pages already touched), after checking every shape and
dtype; only a failure found mid-read (a checksum, a truncated file) can leave it filled in part.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import os
from collections import OrderedDict
from math import prod
from typing import Any, Iterator

import h5py
import numpy as np

from .. import trace
from .._arrays import is_cupy
from ..errors import CheckpointError, HpcdpError
from ._commit import DATA, recover
from ._format import (
    SUM_BLOCK_BYTES, BlockXxh3, Shard, feed, memory_dtype, new_checksum, scalar_value, seq_value,
    slab_sum_key, storage_dtype, type_note, unflatten,
)
from ._group import resolve as resolve_group
from ._h5util import (
    flat_index, posix_fd, pread_into, raw_offset, read_into, read_slab, run_offset,
)
from ._layout import Names, Piece, file_id, open_rank_file, read_manifest, survey

__all__ = ["load", "verify_structure", "data_file", "READ_BLOCK_BYTES", "RAW_BLOCK_BYTES"]

#: a slab a rank keeps only part of is read and verified in pieces of at most this many bytes
READ_BLOCK_BYTES = 16 << 20
#: a slab read with ``pread`` is read and checksummed this many bytes at a time (within a core's
#: L2; format 4's checksum block, so that each piece is hashed in one call)
RAW_BLOCK_BYTES = SUM_BLOCK_BYTES
#: slabs smaller than this go through HDF5's read (finding the raw place costs a few HDF5 calls)
RAW_MIN_BYTES = 1 << 20
#: rank files kept open at once while one load reads (a 1000-rank checkpoint has 1000 of them)
OPEN_RANK_FILES = 16


def data_file(path: str | os.PathLike) -> str:
    p = os.fspath(path)
    return os.path.join(p, DATA) if os.path.isdir(p) else p


def _open(fn: str) -> Any:
    """``fn`` opened read-only, as its low-level FileID: ``h5py.File``'s bookkeeping at open and
    at close is a share of a load from the page cache. HDF5 closes the file once the FileID and
    the last object opened in it are closed (``_Reader.close`` drops them; the file's close
    degree stays the default: another ``h5py.File`` of the same file may be open). The driver
    is named (``_sec2``): the file's descriptor then reads what HDF5 reads, without asking."""
    try:
        return h5py.h5f.open(os.fsencode(fn), h5py.h5f.ACC_RDONLY, _sec2())
    except OSError as exc:
        if not os.path.exists(fn):
            raise CheckpointError(f"load {fn}: no such checkpoint") from None
        raise CheckpointError(f"load {fn}: cannot open as HDF5 (truncated or not a checkpoint): {exc}") from None


@functools.lru_cache(maxsize=None)
def _sec2() -> Any:
    """File access properties naming HDF5's POSIX driver (sec2), made once."""
    p = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    p.set_fapl_sec2()
    return p


def _close_file(f: Any) -> None:
    """Close ``f`` and every object still open through it, as ``h5py.File.close`` does: after a
    failed load the error's traceback holds some (a survey's datasets, the groups walked), and
    they would keep the file open as long as the error lives."""
    if f.valid:
        close_objects = getattr(f, "_close_open_objects", None)  # (h5py's own, as File.close)
        if close_objects is not None:
            close_objects(h5py.h5f.OBJ_LOCAL | ~h5py.h5f.OBJ_FILE)
        f.close()


def verify_structure(directory: str) -> None:
    """Check before commit: manifest intact, every dataset present, stored and mapped as it must be."""
    fn = os.path.join(directory, DATA)
    f = _open(fn)
    try:
        names = Names(f, f"load {fn}")
        survey(f, fn, read_manifest(f, f"load {fn}", names), names)
    finally:
        _close_file(f)


def _blocks(shape: tuple[int, ...], itemsize: int, budget: int
            ) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Consecutive C-order blocks (offsets, shape) of an array of ``shape``, each at most
    ``budget`` bytes (or one element): a checksum run over them in order is the whole array's."""
    n = len(shape)
    if n == 0:
        yield (), ()
        return
    row = [0] * n                       # row[a]: bytes of one index step along axis a
    acc = itemsize
    for a in range(n - 1, -1, -1):
        row[a] = acc
        acc *= shape[a]
    axis = next((a for a in range(n) if row[a] <= budget), n - 1)
    step = max(1, budget // row[axis])
    for lead in itertools.product(*(range(s) for s in shape[:axis])):
        for lo in range(0, shape[axis], step):
            k = min(step, shape[axis] - lo)
            yield lead + (lo,) + (0,) * (n - axis - 1), (1,) * axis + (k,) + tuple(shape[axis + 1:])


def _box(offsets: Any, shape: Any) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offsets, shape))


class _Reader:
    """One load of one checkpoint file: its validated manifest, where each slab is, open files."""

    def __init__(self, f: Any, fn: str) -> None:
        self.f, self.fn, self.where = f, fn, f"load {fn}"
        #: by rank file: the descriptor ``pread`` may read (``posix_fd``), asked once per file
        self._fds: dict[str, int | None] = {}
        self._rank_files: OrderedDict[str, Any] = OrderedDict()
        #: whole data.h5 slabs whose ``pread`` waits for ``read_deferred``:
        #: (fd, offset, destination, hasher, slab, dataset path)
        self._deferred: list[tuple[int, int, np.ndarray, Any, dict, str]] = []
        #: data.h5's: a duplicate of HDF5's descriptor, so that it outlives HDF5's file
        fd = posix_fd(f, sec2=True)  # (``_open`` named the driver)
        self._own_fd: int | None = None if fd is None else os.dup(fd)
        try:
            # the size of the file HDF5 has open (not of whatever the path names by now)
            size = None if self._own_fd is None else os.fstat(self._own_fd).st_size
            with trace.span("checkpoint.manifest", "checkpoint"):
                names = Names(f, self.where)  # (one walk of data.h5's groups: manifest and survey)
                self.m = read_manifest(f, self.where, names, size)
            self.algo = self.m["checksum"]
            self.sum_key = slab_sum_key(self.m["format_version"])
            try:  # a package the checksum needs is missing: said before anything is read
                new_checksum(self.algo)
            except CheckpointError as exc:
                raise CheckpointError(f"{self.where}: {exc}") from None
            with trace.span("checkpoint.survey", "checkpoint"):
                self.pieces = survey(f, fn, self.m, names, size, RAW_MIN_BYTES)
        except BaseException:
            self.close_fd()
            raise

    def close(self) -> None:
        """Close every HDF5 object of this load (data.h5's ``pread`` descriptor stays open for
        ``read_deferred`` until ``close_fd``)."""
        for g, _ in self._rank_files.values():
            g.close()
        self._rank_files.clear()
        self.pieces = {}  # their DatasetIDs: the last objects that keep data.h5 open

    def close_fd(self) -> None:
        """Close data.h5's ``pread`` descriptor (whatever ``read_deferred`` did not read is
        dropped: the load has failed)."""
        self._deferred.clear()
        if self._own_fd is not None:
            os.close(self._own_fd)
            self._own_fd = None

    def _dataset(self, p: Piece) -> Any:
        if p.dset is not None:
            return p.dset
        entry = self._rank_files.pop(p.file, None)
        if entry is None:
            g = open_rank_file(os.path.dirname(p.file), os.path.basename(p.file), self.where)
            entry = (g, Names(g, f"{self.where}: slab file {os.path.basename(p.file)}"))
            while len(self._rank_files) >= OPEN_RANK_FILES:
                old, (g_old, _) = self._rank_files.popitem(last=False)
                g_old.close()
                self._fds.pop(old, None)  # opened again, it may have another descriptor
        self._rank_files[p.file] = entry
        return entry[1].get(p.name)

    def _place(self, d: Any, p: Piece, shape: tuple, item: int) -> tuple[int, int] | None:
        """(file descriptor, byte offset) of slab ``p`` (of ``shape``) in dataset ``d`` when
        ``pread`` there reads exactly what HDF5's read would (``raw_offset``; the slab is one run
        of bytes in C order), else None. data.h5's facts are ``survey``'s (``Piece.raw``)."""
        if p.dset is not None:  # data.h5's own: its shape is the manifest's (survey checked)
            base, dshape = p.raw, self.m["datasets"][p.name]["shape"]
            fd = self._own_fd
        else:  # a rank file's dataset (survey saw it; read as this open finds it)
            base, dshape = raw_offset(d), d.shape
            fd = self._fds.get(p.file, -1)
            if fd == -1:
                fd = self._fds[p.file] = posix_fd(file_id(self._rank_files[p.file][0]))
        if base is None or fd is None:
            return None
        rel = run_offset(p.at, shape, dshape, item)
        return None if rel is None else (fd, base + rel)

    # -- one region of one dataset, verified --------------------------------------------------
    def region(self, path: str, offsets: tuple, shape: tuple, dest: np.ndarray | None = None,
               defer: bool = False) -> np.ndarray:
        """The verified block ``shape`` at ``offsets`` of dataset ``path`` (storage dtype), read
        into ``dest`` when given (a writeable host array of that shape and dtype: ``load(out=)``).

        ``defer``: the caller uses the array's values only after ``read_deferred`` (it returns
        the array itself or a view of it): whole data.h5 slabs read by ``pread`` are then read
        and verified there, after every other part of the load (HDF5's metadata, small arrays)
        and after HDF5's file is closed, so that none of that work runs on caches the bulk
        reads have just flushed."""
        dtype = np.dtype(self.m["datasets"][path]["dtype"])
        # within the declared shape, which survey saw stored
        out = np.empty(shape, dtype) if dest is None else dest
        for p in self.pieces[path]:
            so, ss = tuple(p.slab["offsets"]), tuple(p.slab["shape"])
            lo = tuple(max(a, b) for a, b in zip(so, offsets))
            hi = tuple(min(a + n, b + k) for a, n, b, k in zip(so, ss, offsets, shape))
            if any(l >= h for l, h in zip(lo, hi)):
                continue  # this slab does not meet the region
            h = new_checksum(self.algo)
            with self._reading(path):
                if self._slab(self._dataset(p), p, out, offsets, lo, hi, h, defer):
                    continue  # read and verified by ``read_deferred``
            self._verify(h, p.slab, path)
        return out

    def read_deferred(self) -> None:
        """Read and verify the slabs ``region(defer=True)`` left for now, in their order."""
        jobs, self._deferred = self._deferred, []
        for fd, offset, view, h, slab, path in jobs:
            with self._reading(path):
                self._read_checked(fd, offset, view, h)
            self._verify(h, slab, path)

    @contextlib.contextmanager
    def _reading(self, path: str) -> Iterator[None]:
        """A failed read of dataset ``path`` as the CheckpointError that names it."""
        try:
            yield
        except CheckpointError:
            raise
        except (OSError, ValueError, TypeError, RuntimeError, KeyError) as exc:
            raise CheckpointError(f"{self.where}: dataset {path!r} cannot be read (truncated?): "
                                  f"{exc}") from None

    def _verify(self, h: Any, slab: dict, path: str) -> None:
        if h.intdigest() != slab[self.sum_key]:
            raise CheckpointError(f"{self.where}: dataset {path!r}: the slab {tuple(slab['shape'])} "
                                  f"at {tuple(slab['offsets'])} fails its {self.algo.upper()} "
                                  "checksum (corrupt data)")

    def _slab(self, d: Any, p: Piece, out: np.ndarray, offsets: tuple, lo: tuple, hi: tuple,
              h: Any, defer: bool = False) -> bool:
        """Read slab ``p`` from ``d``, put its part in [lo, hi) into ``out``, every byte of the
        slab fed to the hasher ``h`` in order; or, with ``defer`` where the whole slab of
        data.h5 is read by ``pread``, leave that to ``read_deferred`` and return True."""
        so, ss = tuple(p.slab["offsets"]), tuple(p.slab["shape"])
        item = out.dtype.itemsize
        blocks = _blocks(ss, item, READ_BLOCK_BYTES)
        raw = self._place(d, p, ss, item) if prod(ss) * item >= RAW_MIN_BYTES else None
        if lo == so and hi == tuple(a + n for a, n in zip(so, ss)):
            # the whole slab is wanted: read it in place, checksummed as it arrives or after
            rel = tuple(a - b for a, b in zip(so, offsets))
            if raw is not None and (view := out[_box(rel, ss)]).flags.c_contiguous:
                if defer and p.dset is not None:
                    # (its slab, not the Piece: no DatasetID stays open for the bulk reads)
                    self._deferred.append((raw[0], raw[1], view, h, p.slab, p.name))
                    return True
                self._read_checked(raw[0], raw[1], view, h)
                return False
            read_into(d, out, rel, p.at, ss)
            view = out[_box(rel, ss)]  # after the read: a 0-d array indexed thus is a copy
            if view.flags.c_contiguous:
                feed(h, view)
                return False
            for bo, bs in blocks:
                feed(h, view[_box(bo, bs)])
            return False
        for bo, bs in blocks:  # only part is wanted: never hold the whole slab
            buf = np.empty(bs, out.dtype)
            if raw is not None:  # the slab is one run of bytes: so is each C-order block of it
                self._read_checked(raw[0], raw[1] + flat_index(bo, ss) * item, buf, h)
            else:
                read_slab(d, buf, tuple(a + b for a, b in zip(p.at, bo)))
                feed(h, buf)
            g0 = tuple(a + b for a, b in zip(so, bo))
            blo = tuple(max(g, l) for g, l in zip(g0, lo))
            bhi = tuple(min(g + n, k) for g, n, k in zip(g0, bs, hi))
            if all(l < e for l, e in zip(blo, bhi)):
                out[tuple(slice(l - o, e - o) for l, e, o in zip(blo, bhi, offsets))] = \
                    buf[tuple(slice(l - g, e - g) for l, e, g in zip(blo, bhi, g0))]
        return False

    def _read_checked(self, fd: int, offset: int, dest: np.ndarray, h: Any) -> None:
        """Read the file's bytes at ``offset`` into the C-contiguous ``dest``, feeding them to
        the hasher ``h``: each piece straight after its read, from cache. The loop is lean (a
        memoryview slice, one ``preadv``, one ``update`` per piece; ``pread_into`` only to finish
        a short read): a load from the page cache runs it hundreds of times per GiB."""
        if not dest.flags.c_contiguous:  # a reshape would copy: the bytes would miss ``dest``
            raise ValueError("_read_checked: dest must be C-contiguous")
        flat = memoryview(dest.reshape(-1).view(np.uint8))
        preadv, step, n = os.preadv, RAW_BLOCK_BYTES, flat.nbytes
        parts = h.block_parts() if isinstance(h, BlockXxh3) and step == SUM_BLOCK_BYTES else None
        if parts is not None:  # format 4: each whole block hashed in one call
            add, digest = parts
            whole = n - n % step
            for a in range(0, whole, step):
                piece = flat[a:a + step]
                got = preadv(fd, [piece], offset + a)
                if got != step:
                    pread_into(fd, piece[got:], offset + a + got)
                add(digest(piece))
            if whole < n:
                piece = flat[whole:]
                pread_into(fd, piece, offset + whole)
                h.update(piece)
            return
        update = h.update
        for a in range(0, n, step):
            piece = flat[a:a + step]
            got = preadv(fd, [piece], offset + a)
            if got != len(piece):
                pread_into(fd, piece[got:], offset + a + got)
            update(piece)

    # -- the state ---------------------------------------------------------------------------
    def _check_dtype(self, path: str, meta: dict, dtype: Any) -> None:
        dt = np.dtype(dtype)
        ok = (type_note(dt) or "") == (meta["type"] if meta["type"] == "bfloat16" else "")
        try:
            ok = ok and storage_dtype(dt) == np.dtype(meta["dtype"])
        except TypeError:
            ok = False
        if not ok:
            raise CheckpointError(f"{self.where}: dataset {path!r} holds {meta['type']}, like has {dt}")

    def from_like(self, like: Any, node: dict, where: str, mode: str = "new") -> Any:
        """The state shaped as ``like``. ``mode`` "into": ``like`` is ``load``'s ``out=``, whose
        arrays receive the data in place (its dicts and lists the loaded scalars); "check":
        every structure, shape and dtype checked as for "into", no array read or written."""
        t, fn = node["t"], self.fn
        into = mode == "into"
        what = node["seq"] if t == "seq" else t  # in messages: a stored list is a list
        if isinstance(like, dict):
            if t != "dict":
                raise CheckpointError(f"load {fn}: {where} is a {what} in the checkpoint, a dict in like")
            items = {str(it["k"]): it["v"] for it in node["items"]}
            out = {}
            for k, v in like.items():
                if str(k) not in items:
                    raise CheckpointError(f"load {fn}: key {where}[{k!r}] is not in the checkpoint")
                out[k] = self.from_like(v, items[str(k)], f"{where}[{k!r}]", mode)
            # Entries like does not have (e.g. optimizer state created lazily) are loaded whole.
            known = {str(k) for k in like}
            for it in node["items"]:
                if str(it["k"]) not in known and mode != "check":
                    k = int(it["k"]) if it["kt"] == "int" else it["k"]
                    out[k] = self.whole(it["v"])
            if into:
                like.update(out)
                return like
            return out
        if isinstance(like, (list, tuple)) and t == "seq":
            values = self._seq_like(like, node, where)
            if into and isinstance(like, list):
                like[:] = values
                return like
            return values
        if isinstance(like, (list, tuple)):
            if t not in ("list", "tuple") or len(node["items"]) != len(like):
                n = len(node.get("items", ()))
                raise CheckpointError(f"load {fn}: {where} is a {what} of {n} in the checkpoint, "
                                      f"like has a {type(like).__name__} of {len(like)}")
            items = [self.from_like(v, c, f"{where}[{i}]", mode)
                     for i, (v, c) in enumerate(zip(like, node["items"]))]
            if into and isinstance(like, list):
                like[:] = items
                return like
            return items if isinstance(like, list) else tuple(items)
        if isinstance(like, Shard) or (hasattr(like, "shape") and hasattr(like, "dtype")
                                       and not isinstance(like, np.generic)):
            if t not in ("array", "shard"):
                raise CheckpointError(f"load {fn}: {where} is a {what} in the checkpoint, an array in like")
            path = node["path"]
            meta = self.m["datasets"][path]
            if isinstance(like, Shard):
                gshape, offsets, local = like.global_shape, like.offsets, like.local
            else:
                gshape, offsets, local = tuple(like.shape), (0,) * len(like.shape), like
            if tuple(gshape) != tuple(meta["shape"]):
                raise CheckpointError(f"load {fn}: dataset {path!r} has shape {tuple(meta['shape'])}, "
                                      f"like has {tuple(gshape)} at {where}")
            self._check_dtype(path, meta, local.dtype)
            if mode != "new":
                if into:
                    _fill(self, path, tuple(offsets), local, meta)
                return like
            a = self.region(path, tuple(offsets), tuple(local.shape), defer=not is_cupy(local))
            a = _as_like(a, meta["type"], local)  # (a view of it, or a copy to the GPU: read)
            return Shard(a, gshape, offsets) if isinstance(like, Shard) else a
        if t != "scalar":
            raise CheckpointError(f"load {fn}: {where} is a {what} in the checkpoint, a scalar in like")
        return scalar_value(node)

    def seq(self, node: dict) -> list | tuple:
        """The list or tuple a "seq" node stands for, from its verified dataset."""
        shape = tuple(self.m["datasets"][node["path"]]["shape"])
        return seq_value(node, self.region(node["path"], (0,), shape))

    def _seq_like(self, like: list | tuple, node: dict, where: str) -> list | tuple:
        """A stored list where ``like`` has a list or tuple of scalars: its values, in ``like``'s
        container type (as for a list kept as a group)."""
        values = self.seq(node)
        if len(values) != len(like):
            raise CheckpointError(f"load {self.fn}: {where} is a {node['seq']} of {len(values)} in "
                                  f"the checkpoint, like has a {type(like).__name__} of {len(like)}")
        for i, v in enumerate(like):
            if isinstance(v, (dict, list, tuple, Shard)) or (hasattr(v, "shape") and hasattr(v, "dtype")
                                                             and not isinstance(v, np.generic)):
                raise CheckpointError(f"load {self.fn}: {where}[{i}] is a scalar in the checkpoint, "
                                      f"a {type(v).__name__} in like")
        return list(values) if isinstance(like, list) else tuple(values)

    def whole(self, node: dict) -> Any:
        """The subtree ``node`` with every array read whole, at its global shape."""
        arrays = {}
        stack = [node]
        while stack:
            n = stack.pop()
            if n["t"] == "seq":
                shape = tuple(self.m["datasets"][n["path"]]["shape"])
                arrays[n["path"]] = self.region(n["path"], (0,), shape)
            elif n["t"] in ("array", "shard"):
                meta = self.m["datasets"][n["path"]]
                shape = tuple(meta["shape"])
                a = self.region(n["path"], (0,) * len(shape), shape, defer=True)
                arrays[n["path"]] = _as_like(a, meta["type"], None)
            elif n["t"] == "dict":
                stack.extend(it["v"] for it in n["items"])
            elif n["t"] in ("list", "tuple"):
                stack.extend(n["items"])
        return unflatten(node, arrays)


def _fill(r: _Reader, path: str, offsets: tuple, dest: Any, meta: dict) -> None:
    """``load(out=)``'s read of one array: straight into ``dest`` where it is a C-contiguous,
    writeable numpy array (viewed as the storage dtype: bfloat16 as its bits), else into a new
    array copied into ``dest`` (a cupy array, a strided view)."""
    storage = np.dtype(meta["dtype"])
    if (type(dest) is np.ndarray and dest.flags.c_contiguous and dest.flags.writeable
            and dest.dtype.itemsize == storage.itemsize):
        r.region(path, offsets, tuple(dest.shape), dest.view(storage), defer=True)
        return
    a = _as_like(r.region(path, offsets, tuple(dest.shape)), meta["type"], dest)
    dest[...] = a


def _check_out(out: Any, where: str) -> None:
    """``out=`` is filled in place: every array in it must be writeable, and the containers
    that hold scalars must be ones that can take new values."""
    stack = [(out, "state")]
    while stack:
        x, at = stack.pop()
        if isinstance(x, dict):
            stack.extend((v, f"{at}[{k!r}]") for k, v in x.items())
        elif isinstance(x, (list, tuple)):
            stack.extend((v, f"{at}[{i}]") for i, v in enumerate(x))
        elif isinstance(x, Shard):
            stack.append((x.local, at))
        elif hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, np.generic):
            flags = getattr(x, "flags", None)
            if flags is not None and not getattr(flags, "writeable", True):  # (cupy: no such flag)
                raise ValueError(f"{where}: out={at} is read-only; load(out=) fills arrays in place")


def _as_like(a: np.ndarray, note: str, like: Any) -> Any:
    note = "bfloat16" if note == "bfloat16" else ""
    if like is not None:
        a = a.view(like.dtype) if note else a
        if is_cupy(like):
            import cupy

            return cupy.asarray(a)
        return a
    return a.view(memory_dtype(a.dtype.str, note)) if note else a


def _read(fn: str, like: Any, into: bool = False) -> Any:
    """The load's reading part, in spans (``HPCDP_TRACE``) that say where its time goes: open,
    manifest, survey (metadata only), walk (the state built, small arrays read), close (HDF5's
    file), bulk (the large slabs left to ``read_deferred``: read and verified)."""
    with trace.span("checkpoint.open", "checkpoint"):
        f = _open(fn)
    r, closed = None, False
    try:
        r = _Reader(f, fn)
        with trace.span("checkpoint.walk", "checkpoint"):
            if like is None:
                out = r.whole(r.m["tree"])
            else:
                if into:  # every shape and dtype checked before the first byte lands in ``out``
                    r.from_like(like, r.m["tree"], "state", "check")
                out = r.from_like(like, r.m["tree"], "state", "into" if into else "new")
        with trace.span("checkpoint.close", "checkpoint"):
            r.close()
            _close_file(f)
            closed = True
        with trace.span("checkpoint.bulk", "checkpoint"):
            r.read_deferred()
        return out
    finally:
        # (after the bulk reads, as little as can be: what they left in the caches is cold)
        if not closed:
            if r is not None:
                r.close()
            _close_file(f)
        if r is not None:
            r.close_fd()


def load(path: str | os.PathLike, like: Any = None, *, out: Any = None, group: Any = None) -> Any:
    """Read the checkpoint ``path`` (collective over ``group``); returns a new state, or ``out``
    filled in place.

    A re-save of ``path`` that died between moving the old copy aside and renaming the new one in
    left only temporary names: the old copy is put back under ``path`` first.

    Args:
        path: a checkpoint directory (as passed to ``save``) or its ``data.h5``.
        like: a state of the same structure: its arrays give the expected shapes and dtypes, its
            ``Shard``s the blocks this rank wants (any layout: loading reshards), and the result
            mirrors it (numpy or cupy, int or str keys); saved entries that ``like`` lacks (say,
            optimizer state not created yet) come back whole. ``like`` itself is not modified.
            None: the whole saved state, every array at its global shape.
        out: instead of ``like``, a state to load into (as ``torch.distributed.checkpoint``
            loads): its arrays (and ``Shard``s' local arrays) receive the data in place, so a
            load needs no second copy of the model in memory and writes pages already touched;
            its dicts and lists get the loaded scalars and the entries it lacks (a tuple
            cannot change: its scalars are in the returned state only); returns ``out``.
            Every structure, shape and dtype is checked before the first byte is written,
            but a slab that fails its checksum is found only as it is read: after a
            ``CheckpointError`` from that, ``out``'s arrays may hold part of the file. Load
            with ``like=`` where the current values must survive a corrupt file.
        group: the ranks that load together (default: the default group, or none at all).

    Collective: every rank of ``group`` must call ``load``; one guarded by ``if rank == 0:``
    raises (a ``CommTimeoutError``, ``PeerFailureError`` or ``CollectiveMismatchError``) saying
    that ``load`` is collective.
    """
    from ._save import raised_from

    if out is not None and like is not None:
        raise TypeError("load: pass like= (a new state) or out= (filled in place), not both")
    try:
        return _load(path, like if out is None else out, group, out is not None)
    except HpcdpError as exc:
        raise raised_from("load", path, group, exc)  # noqa: B904 - exc is its __context__


def _agree(group: Any, err: str | None) -> list[str | None]:
    """Every rank's error (None: none), in rank order: one small reduction when all went well,
    as a load usually does; the messages themselves only when some rank has one."""
    if not group.allreduce(np.array([err is not None], np.int32), "max")[0]:
        return [None] * group.size
    return group.all_gather_object(err)


def _load(path: str | os.PathLike, like: Any, group: Any, into: bool = False) -> Any:
    from ._save import wait_pending

    group = resolve_group(group)
    wait_pending(group)
    fn = data_file(path)
    result, err = None, None
    try:
        if not os.path.lexists(fn) or os.path.isdir(fn):
            # whichever rank put it back, it is back for all; ``fn`` is looked at again, as
            # another rank may have restored the directory since ``data_file`` saw no directory
            recover(os.fspath(path))
            fn = data_file(path)
        if into:  # (inside the try: a bad ``out`` on one rank fails the load on every rank)
            _check_out(like, f"load {fn}")
        with trace.span("checkpoint.read", "checkpoint"):
            result = _read(fn, like, into)
    except CheckpointError as exc:
        err = str(exc)
    except Exception as exc:  # noqa: BLE001 - any failure becomes the same error on every rank
        err = f"load {fn}: {type(exc).__name__}: {exc}"
    errs = [err]
    if group.size > 1:
        with trace.span("checkpoint.agree", "checkpoint"):
            errs = _agree(group, err)
    bad = [(r, e) for r, e in enumerate(errs) if e is not None]
    if bad:
        if len({e for _, e in bad}) == 1:
            raise CheckpointError(f"{bad[0][1]} (rank(s) {[r for r, _ in bad]})")
        raise CheckpointError(f"load {fn}: failed on rank(s) {[r for r, _ in bad]}: "
                              + "; ".join(f"rank {r}: {e}" for r, e in bad))
    return result

"""``load``: read a checkpoint on any number of ranks, verify it, and reshard.

Each rank opens ``data.h5`` read-only with the default driver and, before it allocates anything,
validates the manifest (``_manifest``) and where every dataset's bytes are (``_layout``: nothing
from outside the checkpoint, stored bytes behind every declared shape). It then reads only what it
needs: whole datasets for replicated arrays, and for a ``Shard`` of ``like`` the slabs that meet
its block. Every slab is checked against its checksum before any byte of it is used; one that a
rank keeps only part of is read and checked in C-order blocks of ``READ_BLOCK_BYTES``, so a rank
holds its own part plus one block, never a whole foreign slab. A large slab stored as one run of
bytes that HDF5 would copy unconverted is read with ``pread`` straight into its place, a
``RAW_BLOCK_BYTES`` piece at a time, each checksummed at once while it is still in the CPU's
cache: one pass over memory instead of a read pass and then a checksum pass. Errors are gathered
so every rank raises the same ``CheckpointError`` naming the file and dataset; nothing is loaded
in part: ``load`` returns a new state and never modifies ``like``. ``load(out=)`` reads into the
caller's arrays instead (no second copy of the state; pages already touched), after checking
every shape and dtype; only a checksum failure found mid-read can leave it filled in part.
"""
from __future__ import annotations

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
    Shard, feed, memory_dtype, new_checksum, scalar_value, seq_value, slab_sum_key, storage_dtype,
    type_note, unflatten,
)
from ._group import resolve as resolve_group
from ._h5util import flat_index, pread_into, raw_place, read_into, read_slab
from ._layout import Names, Piece, open_rank_file, read_manifest, survey

__all__ = ["load", "verify_structure", "data_file", "READ_BLOCK_BYTES", "RAW_BLOCK_BYTES"]

#: a slab a rank keeps only part of is read and verified in pieces of at most this many bytes
READ_BLOCK_BYTES = 16 << 20
#: a slab read with ``pread`` is read and checksummed this many bytes at a time (a core's L2)
RAW_BLOCK_BYTES = 512 << 10
#: slabs smaller than this go through HDF5's read (finding the raw place costs a few HDF5 calls)
RAW_MIN_BYTES = 1 << 20
#: rank files kept open at once while one load reads (a 1000-rank checkpoint has 1000 of them)
OPEN_RANK_FILES = 16


def data_file(path: str | os.PathLike) -> str:
    p = os.fspath(path)
    return os.path.join(p, DATA) if os.path.isdir(p) else p


def _open(fn: str) -> Any:
    if not os.path.exists(fn):
        raise CheckpointError(f"load {fn}: no such checkpoint")
    try:
        return h5py.File(fn, "r")
    except OSError as exc:
        raise CheckpointError(f"load {fn}: cannot open as HDF5 (truncated or not a checkpoint): {exc}") from None


def verify_structure(directory: str) -> None:
    """Check before commit: manifest intact, every dataset present, stored and mapped as it must be."""
    fn = os.path.join(directory, DATA)
    with _open(fn) as f:
        survey(f, fn, read_manifest(f, f"load {fn}"))


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
        self.m = read_manifest(f, self.where)
        self.algo = self.m["checksum"]
        self.sum_key = slab_sum_key(self.m["format_version"])
        try:  # a package the checksum needs is missing: said before anything is read
            new_checksum(self.algo)
        except CheckpointError as exc:
            raise CheckpointError(f"{self.where}: {exc}") from None
        self.pieces = survey(f, fn, self.m)
        self._rank_files: OrderedDict[str, Any] = OrderedDict()

    def close(self) -> None:
        for g, _ in self._rank_files.values():
            g.close()
        self._rank_files.clear()

    def _dataset(self, p: Piece) -> Any:
        if p.dset is not None:
            return p.dset
        entry = self._rank_files.pop(p.file, None)
        if entry is None:
            g = open_rank_file(os.path.dirname(p.file), os.path.basename(p.file), self.where)
            entry = (g, Names(g, f"{self.where}: slab file {os.path.basename(p.file)}"))
            while len(self._rank_files) >= OPEN_RANK_FILES:
                self._rank_files.popitem(last=False)[1][0].close()
        self._rank_files[p.file] = entry
        return entry[1].get(p.name)

    # -- one region of one dataset, verified --------------------------------------------------
    def region(self, path: str, offsets: tuple, shape: tuple, dest: np.ndarray | None = None
               ) -> np.ndarray:
        """The verified block ``shape`` at ``offsets`` of dataset ``path`` (storage dtype), read
        into ``dest`` when given (a writeable host array of that shape and dtype: ``load(out=)``)."""
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
            try:
                self._slab(self._dataset(p), p, out, offsets, lo, hi, h)
            except CheckpointError:
                raise
            except (OSError, ValueError, TypeError, RuntimeError, KeyError) as exc:
                raise CheckpointError(f"{self.where}: dataset {path!r} cannot be read (truncated?): "
                                      f"{exc}") from None
            if h.intdigest() != p.slab[self.sum_key]:
                raise CheckpointError(f"{self.where}: dataset {path!r}: the slab {ss} at {so} fails "
                                      f"its {self.algo.upper()} checksum (corrupt data)")
        return out

    def _slab(self, d: Any, p: Piece, out: np.ndarray, offsets: tuple, lo: tuple, hi: tuple,
              h: Any) -> None:
        """Read slab ``p`` from ``d``, put its part in [lo, hi) into ``out``, every byte of the
        slab fed to the hasher ``h`` in order."""
        so, ss = tuple(p.slab["offsets"]), tuple(p.slab["shape"])
        item = out.dtype.itemsize
        blocks = _blocks(ss, item, READ_BLOCK_BYTES)
        raw = raw_place(d, p.at, ss) if prod(ss) * item >= RAW_MIN_BYTES else None
        if lo == so and hi == tuple(a + n for a, n in zip(so, ss)):
            # the whole slab is wanted: read it in place, checksummed as it arrives or after
            rel = tuple(a - b for a, b in zip(so, offsets))
            if raw is not None and (view := out[_box(rel, ss)]).flags.c_contiguous:
                self._read_checked(raw[0], raw[1], view, h)
                return
            read_into(d, out, rel, p.at, ss)
            view = out[_box(rel, ss)]  # after the read: a 0-d array indexed thus is a copy
            if view.flags.c_contiguous:
                feed(h, view)
                return
            for bo, bs in blocks:
                feed(h, view[_box(bo, bs)])
            return
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

    def _read_checked(self, fd: int, offset: int, dest: np.ndarray, h: Any) -> None:
        """Read the file's bytes at ``offset`` into the C-contiguous ``dest``, feeding them to
        the hasher ``h``: each piece straight after its read, from cache."""
        if not dest.flags.c_contiguous:  # a reshape would copy: the bytes would miss ``dest``
            raise ValueError("_read_checked: dest must be C-contiguous")
        flat = dest.reshape(-1).view(np.uint8)
        update = h.update
        for a in range(0, flat.size, RAW_BLOCK_BYTES):
            piece = flat[a:a + RAW_BLOCK_BYTES]
            pread_into(fd, piece, offset + a)
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
            a = _as_like(self.region(path, tuple(offsets), tuple(local.shape)), meta["type"], local)
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
                a = self.region(n["path"], (0,) * len(shape), shape)
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
        r.region(path, offsets, tuple(dest.shape), dest.view(storage))
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
    with _open(fn) as f:
        r = _Reader(f, fn)
        try:
            if like is None:
                return r.whole(r.m["tree"])
            if into:  # every shape and dtype checked before the first byte lands in ``out``
                r.from_like(like, r.m["tree"], "state", "check")
            return r.from_like(like, r.m["tree"], "state", "into" if into else "new")
        finally:
            r.close()



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
    errs = group.all_gather_object(err) if group.size > 1 else [err]
    bad = [(r, e) for r, e in enumerate(errs) if e is not None]
    if bad:
        if len({e for _, e in bad}) == 1:
            raise CheckpointError(f"{bad[0][1]} (rank(s) {[r for r, _ in bad]})")
        raise CheckpointError(f"load {fn}: failed on rank(s) {[r for r, _ in bad]}: "
                              + "; ".join(f"rank {r}: {e}" for r, e in bad))
    return result

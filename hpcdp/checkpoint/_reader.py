"""``load``: read a checkpoint on any number of ranks, verify it, and reshard.

Each rank opens ``data.h5`` read-only with the default driver and reads only what it needs: whole
datasets for replicated arrays, and for a ``Shard`` of ``like`` the slabs that intersect its block.
Every slab read is checked against its CRC32 in the manifest before any byte of it is used. Errors
are gathered so every rank raises the same ``CheckpointError`` naming the file and dataset; nothing
is loaded in part: ``load`` returns a new state and never modifies ``like``.
"""
from __future__ import annotations

import os
from typing import Any

import h5py
import numpy as np

from .._arrays import is_cupy
from ..errors import CheckpointError
from ._commit import DATA
from ._format import MANIFEST, Shard, checksum_of, decode_manifest, memory_dtype, scalar_value, storage_dtype, type_note, unflatten
from ._group import resolve
from ._h5util import read_slab

__all__ = ["load", "verify_structure", "data_file"]


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


def _manifest(f: Any, fn: str) -> dict:
    if MANIFEST not in f:
        raise CheckpointError(f"load {fn}: not an hpcdp checkpoint: no manifest dataset {MANIFEST!r}")
    try:
        d = f[MANIFEST]
        raw, crc = d[()], d.attrs.get("crc32")
    except (OSError, KeyError, ValueError) as exc:
        raise CheckpointError(f"load {fn}: the manifest cannot be read (truncated?): {exc}") from None
    m = decode_manifest(raw, crc, f"load {fn}")
    algo = m.get("checksum", "crc32")
    for meta in m.get("datasets", {}).values():
        meta["checksum"] = algo
    base = os.path.dirname(fn)
    for name in m.get("files", []):
        src = os.path.join(base, name)
        try:
            with h5py.File(src, "r"):
                pass
        except OSError as exc:
            raise CheckpointError(f"load {fn}: slab file {name} is missing or unreadable: {exc}") from None
    return m


def _dataset(f: Any, fn: str, path: str, meta: dict) -> Any:
    try:
        d = f[path]
    except KeyError:
        raise CheckpointError(f"load {fn}: dataset {path!r} is missing") from None
    want_shape, want_dtype = tuple(meta["shape"]), np.dtype(meta["dtype"])
    if not isinstance(d, h5py.Dataset) or d.shape != want_shape or d.dtype != want_dtype:
        raise CheckpointError(f"load {fn}: dataset {path!r} is {getattr(d, 'shape', '?')} "
                              f"{getattr(d, 'dtype', '?')}, the manifest says {want_shape} {want_dtype}")
    return d


def verify_structure(directory: str) -> None:
    """Cheap check before commit: manifest intact, every dataset present at its shape and dtype."""
    fn = os.path.join(directory, DATA)
    with _open(fn) as f:
        m = _manifest(f, fn)
        for path, meta in m["datasets"].items():
            _dataset(f, fn, path, meta)


def _read_region(f: Any, fn: str, path: str, meta: dict, offsets: tuple, shape: tuple) -> np.ndarray:
    """The verified block ``shape`` at ``offsets`` of dataset ``path`` (storage dtype)."""
    d = _dataset(f, fn, path, meta)
    dtype = np.dtype(meta["dtype"])
    out = np.empty(shape, dtype)
    full = tuple(offsets) == (0,) * len(shape) and tuple(shape) == tuple(meta["shape"])
    try:
        if full:
            read_slab(d, out, offsets)
        for s in meta["slabs"]:
            so, ss = tuple(s["offsets"]), tuple(s["shape"])
            lo = [max(a, b) for a, b in zip(so, offsets)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(so, ss, offsets, shape)]
            if len(shape) and any(l >= h for l, h in zip(lo, hi)):
                continue  # this slab does not meet the region
            if full:
                block = out[tuple(slice(o, o + n) for o, n in zip(so, ss))]
            elif so == tuple(offsets) and ss == tuple(shape):
                block = read_slab(d, out, so)
            else:
                block = read_slab(d, np.empty(ss, dtype), so)
                dst = tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, offsets))
                src = tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, so))
                out[dst] = block[src]
            if checksum_of(block, meta["checksum"]) != int(s["crc32"]):
                raise CheckpointError(f"load {fn}: dataset {path!r}: the slab {ss} at {so} fails its "
                                      f"{meta['checksum'].upper()} checksum (corrupt data)")
    except CheckpointError:
        raise
    except (OSError, ValueError, TypeError, RuntimeError) as exc:
        raise CheckpointError(f"load {fn}: dataset {path!r} cannot be read (truncated?): {exc}") from None
    return out


def _as_like(a: np.ndarray, note: str, like: Any) -> Any:
    if like is not None:
        a = a.view(like.dtype) if note == "bfloat16" else a
        if is_cupy(like):
            import cupy

            return cupy.asarray(a)
        return a
    return a.view(memory_dtype(a.dtype.str, note)) if note else a


def _check_dtype(fn: str, path: str, meta: dict, dtype: Any) -> None:
    dt = np.dtype(dtype)
    ok = (type_note(dt) or "") == (meta.get("type") if meta.get("type") == "bfloat16" else "")
    try:
        ok = ok and storage_dtype(dt) == np.dtype(meta["dtype"])
    except TypeError:
        ok = False
    if not ok:
        raise CheckpointError(f"load {fn}: dataset {path!r} holds {meta.get('type')}, like has {dt}")


def _from_like(f: Any, fn: str, m: dict, like: Any, node: dict, where: str) -> Any:
    t = node["t"]
    if isinstance(like, dict):
        if t != "dict":
            raise CheckpointError(f"load {fn}: {where} is a {t} in the checkpoint, a dict in like")
        items = {str(it["k"]): it["v"] for it in node["items"]}
        out = {}
        for k, v in like.items():
            if str(k) not in items:
                raise CheckpointError(f"load {fn}: key {where}[{k!r}] is not in the checkpoint")
            out[k] = _from_like(f, fn, m, v, items[str(k)], f"{where}[{k!r}]")
        # Entries like does not have (e.g. optimizer state created lazily) are loaded whole.
        known = {str(k) for k in like}
        for it in node["items"]:
            if str(it["k"]) not in known:
                k = int(it["k"]) if it["kt"] == "int" else it["k"]
                out[k] = _whole(f, fn, m, it["v"])
        return out
    if isinstance(like, (list, tuple)):
        if t not in ("list", "tuple") or len(node["items"]) != len(like):
            n = len(node.get("items", ()))
            raise CheckpointError(f"load {fn}: {where} is a {t} of {n} in the checkpoint, "
                                  f"like has a {type(like).__name__} of {len(like)}")
        items = [_from_like(f, fn, m, v, c, f"{where}[{i}]") for i, (v, c) in enumerate(zip(like, node["items"]))]
        return items if isinstance(like, list) else tuple(items)
    if isinstance(like, Shard) or (hasattr(like, "shape") and hasattr(like, "dtype") and not isinstance(like, np.generic)):
        if t not in ("array", "shard"):
            raise CheckpointError(f"load {fn}: {where} is a {t} in the checkpoint, an array in like")
        path = node["path"]
        meta = m["datasets"][path]
        if isinstance(like, Shard):
            gshape, offsets, local = like.global_shape, like.offsets, like.local
        else:
            gshape, offsets, local = tuple(like.shape), (0,) * len(like.shape), like
        if tuple(gshape) != tuple(meta["shape"]):
            raise CheckpointError(f"load {fn}: dataset {path!r} has shape {tuple(meta['shape'])}, "
                                  f"like has {tuple(gshape)} at {where}")
        _check_dtype(fn, path, meta, local.dtype)
        a = _as_like(_read_region(f, fn, path, meta, tuple(offsets), tuple(local.shape)), meta.get("type", ""), local)
        return Shard(a, gshape, offsets) if isinstance(like, Shard) else a
    if t != "scalar":
        raise CheckpointError(f"load {fn}: {where} is a {t} in the checkpoint, a scalar in like")
    return scalar_value(node)


def _whole(f: Any, fn: str, m: dict, node: dict) -> Any:
    """The subtree ``node`` with every array read whole, at its global shape."""
    arrays = {}
    stack = [node]
    while stack:
        n = stack.pop()
        if n["t"] in ("array", "shard"):
            meta = m["datasets"][n["path"]]
            shape = tuple(meta["shape"])
            a = _read_region(f, fn, n["path"], meta, (0,) * len(shape), shape)
            arrays[n["path"]] = _as_like(a, "bfloat16" if meta.get("type") == "bfloat16" else "", None)
        elif n["t"] == "dict":
            stack.extend(it["v"] for it in n["items"])
        elif n["t"] in ("list", "tuple"):
            stack.extend(n["items"])
    return unflatten(node, arrays)


def _read(fn: str, like: Any) -> Any:
    with _open(fn) as f:
        m = _manifest(f, fn)
        if like is not None:
            return _from_like(f, fn, m, like, m["tree"], "state")
        return _whole(f, fn, m, m["tree"])


def load(path: str | os.PathLike, like: Any = None, *, group: Any = None) -> Any:
    """Read the checkpoint ``path`` (collective over ``group``); returns a new state.

    Args:
        path: a checkpoint directory (as passed to ``save``) or its ``data.h5``.
        like: a state of the same structure: its arrays give the expected shapes and dtypes, its
            ``Shard``s the blocks this rank wants (any layout: loading reshards), and the result
            mirrors it (numpy or cupy, int or str keys); saved entries that ``like`` lacks (say,
            optimizer state not created yet) come back whole. ``like`` itself is not modified.
            None: the whole saved state, every array at its global shape.
        group: the ranks that load together (default: the default group, or none at all).
    """
    from ._save import wait_pending

    group = resolve(group)
    wait_pending(group)
    fn = data_file(path)
    result, err = None, None
    try:
        result = _read(fn, like)
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

"""The manifest as untrusted input: check its CRC, parse it, and validate every field before use.

A checkpoint is a file someone may have sent you. Everything the reader later takes on trust is
checked here, once, so that no reader code meets a value of the wrong type (an ``AttributeError``
inside an error message) and no dataset escapes verification:
- the top level, the dataset table and every tree node have the fields and types ``save`` writes;
- every dataset's slabs tile its shape exactly (no hole, no overlap, none outside), so the slab
  checksums cover every byte; ``"slabs": []`` on a non-empty dataset is refused, never "unchecked";
- dtypes are numbers or bool (``type_note`` bfloat16 stored as ``<u2``), never object, string,
  compound or subarray types;
- the tree is at most ``MAX_DEPTH`` deep (the reader recurses over it) and names only datasets the
  table holds; rank files are plain names (``rank-NNNNN.h5``), never paths;
- a list stored as a dataset ("seq" node) names a 1-D, non-empty, replicated dataset of exactly
  the dtype its element type is written as (``SEQ_DTYPES``), so what ``tolist`` returns is a
  list of that Python type and nothing else.
"""
from __future__ import annotations

import json
import re
import zlib
from math import prod
from typing import Any

import numpy as np

from ..errors import CheckpointError
from ._format import CHECKSUMS, FORMAT, FORMAT_VERSION, MANIFEST, SEQ_DTYPES, slab_sum_key

__all__ = ["decode_manifest", "validate_manifest", "RANK_FILE_RE", "MAX_DEPTH", "MAX_AXES",
           "tiling_problem"]

#: the rank files a VDS-mode checkpoint may hold, by name; nothing with a "/" or a ".."
RANK_FILE_RE = re.compile(r"rank-[0-9]{5,9}\.h5")
#: nesting deeper than this is refused (the reader walks the tree recursively)
MAX_DEPTH = 200
#: HDF5's own limit on a dataset's number of axes
MAX_AXES = 32
_NODES = ("dict", "list", "tuple", "array", "shard", "scalar", "seq")
_SCALARS = ("np", "complex", "int", "float", "bool", "str", "none")
_KINDS = ("replicated", "shard")
_MODES = ("owned", "split", "shard")


class _Invalid(Exception):
    """Internal: what is wrong, turned into one CheckpointError by ``validate_manifest``."""


def _json_type(v: Any) -> str:
    if isinstance(v, dict):
        return "object"
    if isinstance(v, (list, tuple)):
        return "array"
    if isinstance(v, str):
        return "string"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    return "null" if v is None else type(v).__name__


def _show(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _field(obj: dict, key: str, where: str, kind: type) -> Any:
    """``obj[key]``, which must exist and be a ``kind`` (``int`` excludes bool)."""
    if key not in obj:
        raise _Invalid(f"{where} lacks {key!r}")
    v = obj[key]
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        names = {dict: "a JSON object", list: "a JSON array", str: "a string", int: "an integer"}
        name = f"manifest[{key!r}]" if where == "manifest" else f"{where}.{key}"
        raise _Invalid(f"{name} must be {names[kind]}, got a JSON {_json_type(v)} {_show(v)}")
    return v


def _ints(v: Any, where: str, n: int | None = None) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(_is_int(x) and x >= 0 for x in v):
        raise _Invalid(f"{where} must be a list of non-negative integers, got {_show(v)}")
    if n is not None and len(v) != n:
        raise _Invalid(f"{where} has {len(v)} axes, the dataset has {n}")
    if len(v) > MAX_AXES:
        raise _Invalid(f"{where} has {len(v)} axes (HDF5 allows at most {MAX_AXES})")
    return tuple(v)


def numeric_dtype(s: Any, where: str) -> np.dtype:
    """The numpy dtype named by ``s`` if it is a number or bool type, written as numpy writes it."""
    if not isinstance(s, str) or len(s) > 8:
        raise _Invalid(f"{where} must be a numpy dtype string such as '<f4', got {_show(s)}")
    try:
        dt = np.dtype(s)
    except (TypeError, ValueError):
        raise _Invalid(f"{where} {s!r} is not a numpy dtype") from None
    if dt.kind not in "biufc" or dt.fields is not None or dt.subdtype is not None or dt.str != s:
        raise _Invalid(f"{where} {s!r} is not a supported dtype (numbers and bool only: no object, "
                       "string, compound or subarray types)")
    return dt


def tiling_problem(shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]
                   ) -> str | None:
    """None if the (offsets, shape) boxes tile ``shape`` exactly; otherwise what is wrong.

    In bounds, non-empty, volumes summing to the whole and no two overlapping is exact tiling.
    Overlaps are found by a sweep along the axis with the most distinct offsets, so row- or
    column-sharded layouts cost O(n log n), not O(n^2).
    """
    total, volume = prod(shape), 0
    for off, ext in boxes:
        if any(o + n > g for o, n, g in zip(off, ext, shape)):
            return f"the slab {ext} at {off} falls outside the shape {shape}"
        if prod(ext) == 0:
            return f"the slab {ext} at {off} is empty"
        volume += prod(ext)
    if not shape or len(boxes) < 2:
        return None if volume == total else f"the slabs cover {volume} of {total} elements"
    axis = max(range(len(shape)), key=lambda a: len({off[a] for off, _ in boxes}))
    active: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for off, ext in sorted(boxes, key=lambda b: b[0][axis]):
        active = [b for b in active if b[0][axis] + b[1][axis] > off[axis]]
        for o2, e2 in active:
            if all(a < b + m and b < a + n for a, n, b, m in zip(off, ext, o2, e2)):
                return f"the slabs {e2} at {o2} and {ext} at {off} overlap"
        active.append((off, ext))
    return None if volume == total else f"the slabs cover {volume} of {total} elements"


def _dataset(path: Any, d: Any, world: int, key: str, bits: int) -> None:
    where = f"datasets[{path!r}]"
    if not isinstance(path, str) or not path or path.startswith(("/", MANIFEST)) \
            or any(p in ("", ".", "..") for p in path.split("/")):
        raise _Invalid(f"dataset name {_show(path)} is not a relative HDF5 path")
    if not isinstance(d, dict):
        raise _Invalid(f"{where} must be a JSON object, got a JSON {_json_type(d)}")
    shape = _ints(_field(d, "shape", where, list), f"{where}.shape")
    dt = numeric_dtype(_field(d, "dtype", where, str), f"{where}.dtype")
    note = _field(d, "type", where, str)
    if note not in (dt.str, "bfloat16") or (note == "bfloat16" and dt.str != "<u2"):
        raise _Invalid(f"{where}.type {note!r} does not fit dtype {dt.str!r} (it is the dtype "
                       "itself, or 'bfloat16' stored as '<u2')")
    kind, mode = _field(d, "kind", where, str), _field(d, "mode", where, str)
    if kind not in _KINDS or mode not in _MODES:
        raise _Invalid(f"{where}: kind {kind!r} / mode {mode!r} are not among {_KINDS} / {_MODES}")
    slabs = _field(d, "slabs", where, list)
    boxes, ranks = [], set()
    for i, s in enumerate(slabs):
        sw = f"{where}.slabs[{i}]"
        if not isinstance(s, dict):
            raise _Invalid(f"{sw} must be a JSON object, got a JSON {_json_type(s)}")
        for k in ("rank", "offsets", "shape", key):
            if k not in s:
                raise _Invalid(f"{sw} lacks {k!r}")
        r, crc = s["rank"], s[key]
        if not _is_int(r) or not 0 <= r < world:
            raise _Invalid(f"{sw}.rank {_show(r)} is not a rank of the world of {world} that saved it")
        if r in ranks:
            raise _Invalid(f"{where} has two slabs of rank {r} (each rank writes one)")
        ranks.add(r)
        if not _is_int(crc) or not 0 <= crc < 2**bits:
            raise _Invalid(f"{sw}.{key} {_show(crc)} is not a {bits}-bit checksum")
        boxes.append((_ints(s["offsets"], f"{sw}.offsets", len(shape)),
                      _ints(s["shape"], f"{sw}.shape", len(shape))))
    problem = tiling_problem(shape, boxes)
    if problem is not None:
        raise _Invalid(f"{where}: {problem}: the slabs must tile the dataset exactly, or some "
                       "bytes would go unverified")


def _scalar(node: dict, where: str) -> None:
    t = node.get("type")
    if t not in _SCALARS or "value" not in node:
        raise _Invalid(f"{where} is a scalar of unknown type {_show(t)}")
    v = node["value"]
    if t == "np":
        dt = numeric_dtype(node.get("dtype"), f"{where}.dtype")
        ok = (isinstance(v, list) and len(v) == 2 and all(map(_is_number, v))) if dt.kind == "c" \
            else isinstance(v, bool) if dt.kind == "b" \
            else (_is_int(v) and int(np.iinfo(dt).min) <= v <= int(np.iinfo(dt).max)) if dt.kind in "iu" \
            else _is_number(v)
    elif t == "complex":
        ok = isinstance(v, list) and len(v) == 2 and all(map(_is_number, v))
    else:
        ok = {"int": _is_int(v), "float": _is_number(v), "bool": isinstance(v, bool),
              "str": isinstance(v, str), "none": v is None}[t]
    if not ok:
        raise _Invalid(f"{where} is a scalar of type {t!r} with the value {_show(v)}")


def _seq(node: dict, where: str, d: dict) -> None:
    """A list or tuple of Python ints, floats or bools stored as the dataset ``d`` (validated)."""
    kind, of = node.get("seq"), node.get("of")
    if kind not in ("list", "tuple") or of not in SEQ_DTYPES:
        raise _Invalid(f"{where} is a stored sequence with seq {_show(kind)} and of {_show(of)} "
                       f"(seq is 'list' or 'tuple', of one of {sorted(SEQ_DTYPES)})")
    want = SEQ_DTYPES[of]
    if d["dtype"] != want or d["type"] != want or len(d["shape"]) != 1 or d["shape"][0] < 1 \
            or d["kind"] != "replicated":
        raise _Invalid(f"{where}: a {kind} of {of} is a non-empty 1-D replicated {want} dataset; "
                       f"{node['path']!r} is {d['kind']} {d['type']} of shape {tuple(d['shape'])}")


def _tree(root: Any, datasets: dict) -> None:
    if not isinstance(root, dict) or root.get("t") != "dict":
        raise _Invalid("tree must be a dict node (the saved state is a dict)")
    stack: list[tuple[Any, str, int]] = [(root, "tree", 0)]
    while stack:
        node, where, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise _Invalid(f"the tree is nested too deeply (more than {MAX_DEPTH} levels at {where})")
        if not isinstance(node, dict):
            raise _Invalid(f"{where} must be a JSON object, got a JSON {_json_type(node)}")
        t = node.get("t")
        if t not in _NODES:
            raise _Invalid(f"{where} has node type {_show(t)}, not one of {_NODES}")
        if t in ("dict", "list", "tuple"):
            items = _field(node, "items", where, list)
            if t != "dict":
                stack.extend((c, f"{where}[{i}]", depth + 1) for i, c in enumerate(items))
                continue
            seen = set()
            for i, it in enumerate(items):
                iw = f"{where}.items[{i}]"
                if not isinstance(it, dict) or not {"k", "kt", "h", "v"} <= it.keys():
                    raise _Invalid(f"{iw} must be an object with 'k', 'kt', 'h' and 'v'")
                k, kt = it["k"], it["kt"]
                if not ((kt == "int" and _is_int(k)) or (kt == "str" and isinstance(k, str))) \
                        or not isinstance(it["h"], str):
                    raise _Invalid(f"{iw}: key {_show(k)} with kt {_show(kt)} (kt is 'int' or 'str' "
                                   "and says what k is)")
                if str(k) in seen:
                    raise _Invalid(f"{where} has the key {k!r} twice")
                seen.add(str(k))
                stack.append((it["v"], f"{where}[{k!r}]", depth + 1))
        elif t in ("array", "shard", "seq"):
            path = node.get("path")
            if not isinstance(path, str) or path not in datasets:
                raise _Invalid(f"{where} names the dataset {_show(path)}, which is not in datasets")
            if t == "seq":
                _seq(node, where, datasets[path])
        else:
            _scalar(node, where)


def validate_manifest(m: Any, where: str) -> dict:
    """``m`` if it is a manifest this hpcdp can read, else a CheckpointError saying what is wrong."""
    if not isinstance(m, dict):
        raise CheckpointError(f"{where}: not an hpcdp checkpoint: the manifest is a JSON "
                              f"{_json_type(m)}, not an object")
    if m.get("format") != FORMAT:
        raise CheckpointError(f"{where}: not an hpcdp checkpoint (manifest format "
                              f"{_show(m.get('format'))})")
    try:
        version = _field(m, "format_version", "manifest", int)
        if version > FORMAT_VERSION:
            raise CheckpointError(f"{where}: format version {version} is newer than this hpcdp "
                                  f"reads ({FORMAT_VERSION})")
        world = _field(m, "world_size", "manifest", int)
        if world < 1:
            raise _Invalid(f"manifest['world_size'] {world} is not a world size")
        if _field(m, "mode", "manifest", str) not in ("mpio", "vds"):
            raise _Invalid(f"manifest['mode'] {m['mode']!r} is not 'mpio' or 'vds'")
        algo = _field(m, "checksum", "manifest", str)
        if algo not in CHECKSUMS:
            raise _Invalid(f"manifest['checksum'] {algo!r} is not one of {sorted(CHECKSUMS)}")
        key, bits = slab_sum_key(version), CHECKSUMS[algo][1]
        files = _field(m, "files", "manifest", list)
        for name in files:
            if not isinstance(name, str) or not RANK_FILE_RE.fullmatch(name):
                raise _Invalid(f"manifest['files'] holds {_show(name)}, which is not a rank file "
                               "name (rank-NNNNN.h5, in the checkpoint's own directory)")
        if len(set(files)) != len(files):
            raise _Invalid("manifest['files'] names a file twice")
        datasets = _field(m, "datasets", "manifest", dict)
        for path, d in datasets.items():
            _dataset(path, d, world, key, bits)
        if "tree" not in m:
            raise _Invalid("manifest lacks 'tree'")
        _tree(m["tree"], datasets)
    except _Invalid as exc:
        raise CheckpointError(f"{where}: invalid manifest: {exc}") from None
    return m


def decode_manifest(raw: bytes | np.ndarray, crc: Any, where: str) -> dict:
    """Check the manifest bytes (UTF-8 JSON text, or format 1's uint8 array of it) against their
    CRC32, parse and validate them."""
    data = raw if isinstance(raw, bytes) else np.asarray(raw, np.uint8).tobytes()
    # (an integer scalar: a numpy one, as h5py reads it, or a Python int; never bool)
    ok = isinstance(crc, np.integer) or (isinstance(crc, int) and not isinstance(crc, bool)) \
        or (isinstance(crc, np.ndarray) and crc.ndim == 0 and crc.dtype.kind in "iu")
    if not ok or zlib.crc32(data) != int(crc):
        raise CheckpointError(f"{where}: the manifest fails its CRC32 check (corrupt file)")
    try:
        m = json.loads(data)
    except RecursionError:
        raise CheckpointError(f"{where}: invalid manifest: its JSON is nested too deeply") from None
    except ValueError as exc:
        raise CheckpointError(f"{where}: the manifest is not valid JSON: {str(exc)[:200]}") from None
    return validate_manifest(m, where)

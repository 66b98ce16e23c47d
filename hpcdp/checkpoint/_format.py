"""The file format: state <-> (tree, leaves), dataset names, dtypes, and the manifest.

A checkpoint's state is a tree of dicts (str or int keys), lists and tuples whose leaves are arrays,
``Shard``s and scalars. ``flatten`` turns it into a JSON-able *tree* (containers, scalar values, and
for every array the HDF5 path of its dataset) plus the list of array leaves in a fixed order.
The manifest (JSON text, ``/_hpcdp_manifest`` with a CRC32 attribute) holds the tree, every
dataset's shape, dtype and per-slab checksums: a reader needs nothing else, and no object is ever
pickled.

The same file reads without hpcdp (format 2; README "Reading a checkpoint without hpcdp"): dicts
are groups, arrays datasets; a non-empty list or tuple of Python ints, floats or bools alone is a
1-D ``<i8``/``<f8``/bool dataset (a leaf like any array, so its bytes are checksummed) whose
attribute ``hpcdp_type`` says "list" or "tuple"; any other list or tuple is a group of members
"0", "1", ... with that attribute; scalars are attributes of their group, strings variable-length
UTF-8, ``None`` an attribute with an empty (null) dataspace, which h5py reads as ``h5py.Empty``;
the manifest is one fixed-length UTF-8 string (its stored size is checked before it is read).
Format 3 keeps format 2's layout and checksums each slab with XXH3-64 (``CHECKSUMS``), under
the slab's key "checksum"; format 4 keeps format 3's and checksums each slab as the XXH3-64 of
its 512 KiB blocks' XXH3-64 digests ("xxh3_64_512k", ``BlockXxh3``). Formats 3, 2 (CRC32C
under "crc32") and 1 (a group of attributes per list, ``None`` as the string 'None', the
manifest as uint8 bytes) still load. hpcdp loads
every value from the manifest and the checksummed datasets; the attributes are for people.
"""
from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .._arrays import is_cupy
from ..errors import CheckpointError

__all__ = ["Shard", "Leaf", "flatten", "unflatten", "MANIFEST", "FORMAT", "FORMAT_VERSION",
           "encode_manifest", "storage_dtype", "type_note", "checksum_of", "new_checksum", "feed",
           "default_checksum", "usable_checksums", "slab_sum_key", "SEQ_DTYPES", "seq_value",
           "h5_attrs", "BF16_META", "rank_file", "vds_name", "BlockXxh3", "SUM_BLOCK_BYTES"]

MANIFEST = "_hpcdp_manifest"
MANIFEST_CRC_ATTR = "crc32"
FORMAT = "hpcdp-checkpoint"
#: 2: numeric lists as datasets, None as an empty attribute, the manifest as a UTF-8 string;
#: 3: a slab's checksum under "checksum" (it was "crc32"), XXH3-64 by default;
#: 4: the slab checksum "xxh3_64_512k" (``BlockXxh3``) by default, the layout unchanged
FORMAT_VERSION = 4
#: a list or tuple of only these Python types (and at least one) is stored as one dataset
SEQ_DTYPES = {"int": "<i8", "float": "<f8", "bool": "|b1"}
#: numpy dtype metadata that marks a uint16 array as raw bfloat16 bits (when ml_dtypes is absent)
BF16_META = {"hpcdp_type": "bfloat16"}


@dataclass(frozen=True)
class Shard:
    """This rank's block ``local`` of an array of ``global_shape``, starting at ``offsets``.

    Args:
        local: numpy or cupy array, the block this rank holds (may be empty).
        global_shape: shape of the whole array.
        offsets: index of ``local[0, 0, ...]`` in the whole array, one per axis.
    """

    local: Any
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "global_shape", tuple(int(s) for s in self.global_shape))
        object.__setattr__(self, "offsets", tuple(int(o) for o in self.offsets))
        shape = tuple(getattr(self.local, "shape", ()))
        if not hasattr(self.local, "dtype") or not hasattr(self.local, "shape"):
            raise TypeError(f"Shard: local must be an array, got {type(self.local).__name__}")
        if len(shape) != len(self.global_shape) or len(self.offsets) != len(shape):
            raise ValueError(f"Shard: local shape {shape}, global_shape {self.global_shape} and "
                             f"offsets {self.offsets} must have the same number of axes")
        for ax, (o, n, g) in enumerate(zip(self.offsets, shape, self.global_shape)):
            if o < 0 or (n > 0 and o + n > g):
                raise ValueError(f"Shard: block {shape} at offsets {self.offsets} does not fit in "
                                 f"global shape {self.global_shape} (axis {ax})")


@dataclass
class Leaf:
    """One array of the state: where it lives in the file and this rank's data for it."""

    path: str               # HDF5 dataset path
    kind: str               # "replicated" or "shard"
    shape: tuple[int, ...]  # global shape
    dtype: str              # storage dtype (numpy dtype.str)
    note: str               # "" or "bfloat16"
    data: Any               # host numpy array: the whole array, or this rank's block
    offsets: tuple[int, ...] = field(default_factory=tuple)  # shard block offsets

    def spec(self) -> tuple:
        """What every rank must agree on."""
        return (self.path, self.kind, self.shape, self.dtype, self.note)


# -- names and dtypes -----------------------------------------------------------------------
def rank_file(rank: int) -> str:
    """The file a rank's slabs go to in VDS mode, in the checkpoint's directory."""
    return f"rank-{rank:05d}.h5"


def vds_name(name: str) -> str:
    """``name`` as HDF5 wants a virtual source's file or dataset name: it parses them as printf-like
    patterns (``%b`` = block number), so a literal "%" (our "/" in a key is escaped as "%2F") must be
    doubled, or H5Pset_virtual fails with "invalid format specifier"."""
    return name.replace("%", "%%")


def _h5name(key: str) -> str:
    name = key.replace("%", "%25").replace("/", "%2F")
    if name in ("", ".", ".."):
        name = {"": "%00", ".": "%2E", "..": "%2E%2E"}[name]
    return name


def type_note(dtype: np.dtype) -> str:
    if dtype.name == "bfloat16" or (dtype.metadata or {}).get("hpcdp_type") == "bfloat16":
        return "bfloat16"
    return ""


def storage_dtype(dtype: np.dtype) -> np.dtype:
    """What goes into HDF5: bfloat16 as its raw uint16 bits, everything else as is."""
    if type_note(dtype) == "bfloat16":
        return np.dtype("<u2")
    if dtype.kind not in "biufc" or dtype.fields is not None or dtype.subdtype is not None:
        raise TypeError(f"dtype {dtype} is not supported (numbers and bool only)")
    return dtype


def memory_dtype(storage: str, note: str) -> np.dtype:
    """The dtype a loaded array gets when there is no ``like`` to copy it from."""
    if note == "bfloat16":
        try:
            import ml_dtypes  # optional

            return np.dtype(ml_dtypes.bfloat16)
        except ImportError:
            return np.dtype("<u2", metadata=dict(BF16_META))
    return np.dtype(storage)


def to_host(x: Any, *, copy: bool) -> np.ndarray:
    """A C-contiguous host numpy array of ``x`` (a copy when asked)."""
    if is_cupy(x):
        return np.require(x.get(), requirements="C")
    a = np.asarray(x)
    return np.array(a, order="C", copy=True) if copy else np.require(a, requirements="C")


def as_storage(a: np.ndarray) -> np.ndarray:
    return a.view(np.dtype("<u2")) if type_note(a.dtype) == "bfloat16" else a


class _RunningCrc:
    """A CRC computed as ``fn(bytes, running_value)``, with a hasher's ``update``/``intdigest``."""

    __slots__ = ("_fn", "_value")

    def __init__(self, fn: Callable[[Any, int], int]) -> None:
        self._fn, self._value = fn, 0

    def update(self, data: Any) -> None:
        self._value = self._fn(data, self._value)

    def intdigest(self) -> int:
        return self._value


def _xxh3_64() -> Any:
    import xxhash

    return xxhash.xxh3_64()


#: the block of format 4's slab checksum ("xxh3_64_512k"): one one-shot XXH3-64 per block
SUM_BLOCK_BYTES = 512 << 10


class BlockXxh3:
    """Format 4's slab checksum, "xxh3_64_512k": the XXH3-64 of the concatenated 8-byte digests
    (``xxhash.xxh3_64_digest``) of the slab's bytes cut into ``SUM_BLOCK_BYTES`` blocks (the last
    may be shorter). A hasher (``update``/``intdigest``) that takes the bytes in pieces of any
    size. Why: XXH3's one-shot call runs at about 1.5x its streaming ``update`` on data in cache,
    and a load from the page cache is a memory copy plus this checksum; the reader reads a slab
    in blocks of this size and hashes each whole block in one call (``block_parts``).
    """

    __slots__ = ("_outer", "_cur", "_fill", "_digest")

    def __init__(self) -> None:
        import xxhash

        self._outer = xxhash.xxh3_64()     # over the blocks' digests
        self._cur = xxhash.xxh3_64()       # the block under way, when pieces split it
        self._fill = 0                     # bytes of that block seen
        self._digest = xxhash.xxh3_64_digest

    def block_parts(self) -> tuple[Callable[[Any], None], Callable[[Any], bytes]] | None:
        """(add a block's digest, a block's digest) while no block is under way: feeding
        ``add(digest(block))`` for each whole block is ``update(block)``, without its loop."""
        return (self._outer.update, self._digest) if self._fill == 0 else None

    def update(self, data: Any) -> None:
        mv = memoryview(data).cast("B")
        n, i, block = mv.nbytes, 0, SUM_BLOCK_BYTES
        while i < n:
            if self._fill == 0 and n - i >= block:  # a whole block: one call
                self._outer.update(self._digest(mv[i:i + block]))
                i += block
                continue
            k = min(block - self._fill, n - i)
            self._cur.update(mv[i:i + k])
            self._fill += k
            i += k
            if self._fill == block:
                self._outer.update(self._cur.digest())
                self._cur.reset()
                self._fill = 0

    def intdigest(self) -> int:
        if not self._fill:
            return self._outer.intdigest()
        last = self._outer.copy()
        last.update(self._cur.digest())
        return last.intdigest()


def _crc32c() -> Any:
    import crc32c

    return _RunningCrc(crc32c.crc32c)


#: Slab checksums by the name the manifest records: (a new hasher with ``update(bytes)`` and
#: ``intdigest()``, so a slab is checked piece by piece as it is read; the digest's bits). They
#: detect corruption (a flipped bit, a torn write), not forgery, which no checksum stored beside
#: the data could. XXH3-64 (the ``xxhash`` package, format 3 on) runs at about 3x the CPU's
#: CRC32C instruction on data in cache, where the reader checks each piece straight after
#: reading it: a load from the page cache is a memory copy plus this, so the checksum's speed
#: is a fixed share of it (PERF.md G2); format 4's XXH3-64 of 512 KiB blocks' XXH3-64s
#: (``BlockXxh3``) lets each block be hashed in one call. Plain XXH3-64 (format 3), CRC32C
#: (formats 1-2) and zlib's CRC32 still load.
CHECKSUMS: dict[str, tuple[Callable[[], Any], int]] = {
    "xxh3_64_512k": (BlockXxh3, 64),
    "xxh3_64": (_xxh3_64, 64),
    "crc32c": (_crc32c, 32),
    "crc32": (lambda: _RunningCrc(zlib.crc32), 32),
}
#: what ``save`` writes, best first: the first whose package imports
_PREFERRED = ("xxh3_64_512k", "crc32c", "crc32")


def slab_sum_key(version: int) -> str:
    """The key of a slab's checksum in a manifest of format ``version``."""
    return "checksum" if version >= 3 else "crc32"


def usable_checksums() -> tuple[str, ...]:
    """The checksums this process can compute, best first (zlib's CRC32 always)."""
    out = []
    for name in _PREFERRED:
        try:
            CHECKSUMS[name][0]()
        except ImportError:
            continue
        out.append(name)
    return tuple(out)


def default_checksum() -> str:
    """The best checksum this process can compute."""
    return usable_checksums()[0]


def new_checksum(algorithm: str) -> Any:
    """A fresh hasher of ``algorithm`` (from CHECKSUMS): ``update(bytes)``, ``intdigest()``."""
    try:
        make = CHECKSUMS[algorithm][0]
    except KeyError:
        raise CheckpointError(f"unknown checksum {algorithm!r} in the manifest") from None
    try:
        return make()
    except ImportError as exc:
        raise CheckpointError(f"the checkpoint's {algorithm} checksums need the {exc.name} "
                              "package (pip install hpcdp pulls it in)") from None


def feed(h: Any, a: np.ndarray) -> None:
    """Add the array's bytes in C order to the hasher ``h``."""
    if a.size:
        h.update(np.require(a, requirements="C").reshape(-1).view(np.uint8))


def checksum_of(a: np.ndarray, algorithm: str = "crc32") -> int:
    """Checksum (``algorithm`` from CHECKSUMS) of the array's bytes in C order."""
    h = new_checksum(algorithm)
    feed(h, a)
    return int(h.intdigest())


# -- state <-> tree -----------------------------------------------------------------------------
_SCALARS = (bool, int, float, complex, str, type(None))


def _scalar_node(v: Any, where: str) -> dict:
    if isinstance(v, np.generic):
        dt = np.dtype(v.dtype)
        if dt.kind not in "biufc":
            raise CheckpointError(f"save: unsupported numpy scalar {dt} at {where}")
        val = v.item()
        if dt.kind == "c":
            val = [val.real, val.imag]
        return {"t": "scalar", "type": "np", "dtype": dt.str, "value": val}
    if isinstance(v, complex):
        return {"t": "scalar", "type": "complex", "value": [v.real, v.imag]}
    return {"t": "scalar", "type": type(v).__name__ if v is not None else "none", "value": v}


def scalar_value(node: dict) -> Any:
    t, v = node["type"], node["value"]
    if t == "np":
        dt = np.dtype(node["dtype"])
        return dt.type(complex(*v) if dt.kind == "c" else v)
    if t == "complex":
        return complex(*v)
    if t == "int":
        return int(v)
    if t == "float":
        return float(v)
    return v


def flatten(state: Any, *, copy: bool) -> tuple[dict, list[Leaf]]:
    """(tree, array leaves in tree order) of a nested state."""
    if not isinstance(state, dict):
        raise CheckpointError(f"save: state must be a dict, got {type(state).__name__}")
    leaves: list[Leaf] = []

    def walk(v: Any, path: str, where: str) -> dict:
        if isinstance(v, dict):
            items = []
            names: set[str] = set()
            for k, child in v.items():
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    raise CheckpointError(f"save: key {k!r} at {where or '/'} is not a str or int")
                name = _h5name(str(k))
                if not path and name.startswith("_hpcdp"):
                    raise CheckpointError(f"save: top-level key {k!r} is reserved")
                if name in names:
                    raise CheckpointError(f"save: keys at {where or '/'} collide as {name!r}")
                names.add(name)
                items.append({"k": k, "kt": "int" if isinstance(k, int) else "str", "h": name,
                              "v": walk(child, f"{path}/{name}" if path else name, f"{where}[{k!r}]")})
            return {"t": "dict", "items": items}
        if isinstance(v, (list, tuple)):
            of = _seq_of(v)
            if of is not None:
                data = np.array(v, dtype=SEQ_DTYPES[of])
                leaves.append(Leaf(path, "replicated", data.shape, data.dtype.str, "", data))
                return {"t": "seq", "seq": "list" if isinstance(v, list) else "tuple", "of": of,
                        "path": path}
            return {"t": "list" if isinstance(v, list) else "tuple",
                    "items": [walk(c, f"{path}/{i}" if path else str(i), f"{where}[{i}]")
                              for i, c in enumerate(v)]}
        if isinstance(v, Shard):
            local = as_storage_src(v.local, where)
            leaves.append(Leaf(path, "shard", v.global_shape, storage_dtype(local.dtype).str,
                               type_note(local.dtype), as_storage(to_host(local, copy=copy)),
                               v.offsets))
            return {"t": "shard", "path": path}
        if hasattr(v, "__array_interface__") or is_cupy(v) or isinstance(v, np.ndarray):
            if isinstance(v, np.generic):
                return _scalar_node(v, where)
            a = as_storage_src(v, where)
            leaves.append(Leaf(path, "replicated", tuple(a.shape), storage_dtype(a.dtype).str,
                               type_note(a.dtype), as_storage(to_host(a, copy=copy))))
            return {"t": "array", "path": path}
        if isinstance(v, (_SCALARS, np.generic)):
            return _scalar_node(v, where)
        raise CheckpointError(f"save: unsupported value of type {type(v).__name__} at {where} "
                              "(arrays, Shard, int, float, bool, complex, str, None, dict, list, tuple)")

    tree = walk(state, "", "state")
    return tree, leaves


def _seq_of(v: list | tuple) -> str | None:
    """"int", "float" or "bool" if ``v`` holds only Python values of that one type (ints within
    int64), else None (empty, mixed, nested, numpy scalars: those keep the group layout)."""
    if not v:
        return None
    t = type(v[0])
    if t not in (int, float, bool) or any(type(x) is not t for x in v):
        return None
    if t is int and not all(-2**63 <= x < 2**63 for x in v):
        return None
    return t.__name__


def seq_value(node: dict, a: np.ndarray) -> list | tuple:
    """The list or tuple a "seq" node's dataset ``a`` (dtype checked against ``of``) stands for:
    ``tolist`` gives Python ints, floats and bools, exactly as saved."""
    items = a.tolist()
    return items if node["seq"] == "list" else tuple(items)


def as_storage_src(a: Any, where: str) -> Any:
    try:
        storage_dtype(np.dtype(a.dtype))
    except TypeError as exc:
        raise CheckpointError(f"save: {where}: {exc}") from None
    return a


def unflatten(tree: dict, arrays: dict[str, Any]) -> Any:
    """Rebuild the state from a tree and ``{dataset path: array}``."""
    t = tree["t"]
    if t == "dict":
        return {(int(it["k"]) if it["kt"] == "int" else it["k"]): unflatten(it["v"], arrays)
                for it in tree["items"]}
    if t in ("list", "tuple"):
        items = [unflatten(c, arrays) for c in tree["items"]]
        return items if t == "list" else tuple(items)
    if t in ("array", "shard"):
        return arrays[tree["path"]]
    if t == "seq":
        return seq_value(tree, arrays[tree["path"]])
    return scalar_value(tree)


def h5_attrs(tree: dict, path: str = "") -> list[tuple[str, str, Any]]:
    """(object path, attribute name, value) for people reading the file without hpcdp: every
    scalar on its group, and ``hpcdp_type`` ("list"/"tuple") on every list or tuple, group or
    dataset. Never on a dict's group, where a key of that name is a scalar's attribute."""
    out: list[tuple[str, str, Any]] = []
    kids: list[tuple[str, dict]] = []
    if tree["t"] == "dict":
        kids = [(it["h"], it["v"]) for it in tree["items"]]
    elif tree["t"] in ("list", "tuple"):
        kids = [(str(i), c) for i, c in enumerate(tree["items"])]
        out.append((path or "/", "hpcdp_type", tree["t"]))
    for name, child in kids:
        p = f"{path}/{name}" if path else name
        if child["t"] == "scalar":
            out.append((path or "/", name, _attr_value(child)))
        elif child["t"] == "seq":
            out.append((p, "hpcdp_type", child["seq"]))
        elif child["t"] in ("dict", "list", "tuple"):
            out.extend(h5_attrs(child, p))
    return out


def _attr_value(node: dict) -> Any:
    v = scalar_value(node)
    if v is None:
        import h5py

        return h5py.Empty(np.int8)  # a null dataspace: nothing else in the file reads as Empty
    if isinstance(v, int) and not isinstance(v, bool) and not -2**63 <= v < 2**63:
        return str(v)  # beyond 64 bits: its decimal digits (the manifest holds the int)
    return v


def container_groups(tree: dict, path: str = "") -> list[str]:
    """HDF5 groups to create, parents first (every container that is not the root)."""
    out: list[str] = []
    kids: list[tuple[str, dict]] = []
    if tree["t"] == "dict":
        kids = [(it["h"], it["v"]) for it in tree["items"]]
    elif tree["t"] in ("list", "tuple"):
        kids = [(str(i), c) for i, c in enumerate(tree["items"])]
    for name, child in kids:
        if child["t"] in ("dict", "list", "tuple"):
            p = f"{path}/{name}" if path else name
            out.append(p)
            out.extend(container_groups(child, p))
    return out


# -- manifest (decoding and validation: _manifest.py) ----------------------------------------
def encode_manifest(manifest: dict) -> tuple[bytes, int]:
    """The manifest as UTF-8 JSON text and its CRC32 (of exactly those bytes)."""
    try:
        raw = json.dumps(manifest, sort_keys=True, separators=(",", ":"),
                         ensure_ascii=False).encode()
    except UnicodeEncodeError:  # a lone surrogate in a str: only escapes can carry it
        raw = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    return raw, zlib.crc32(raw)

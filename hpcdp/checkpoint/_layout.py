"""Where a checkpoint's bytes may come from, checked before any of them is read or allocated for.

A checkpoint is a file someone may have sent you (``_manifest`` checks its JSON side). Here, the
HDF5 side:
- names resolve through hard links only: a soft link may point anywhere in the file and an
  external link opens any HDF5 file on the machine;
- data is stored contiguously or in chunks inside the file itself: no external storage (the raw
  bytes of any file, ``/etc/passwd`` included), no filters (a few compressed bytes may expand to
  any size), no other layout; virtual datasets only in the exact form the VDS writer makes (each
  manifest slab mapped whole from the rank file of its rank, listed in the manifest), and their
  bytes are then read from those rank files directly, by a path built here: HDF5's own search for
  a source file (``HDF5_VDS_PREFIX``, the working directory) is never used;
- stored bytes back the declared shape before anything is allocated: contiguous storage of exactly
  the declared size inside the file, every chunk of a chunked dataset present, and the datasets
  of one file adding up to no more than its size (chunks or datasets that alias the same bytes
  cannot multiply a small file).
"""
from __future__ import annotations

import functools
import os
import stat
from dataclasses import dataclass, field
from math import prod
from typing import Any

import h5py
import numpy as np

from ..errors import CheckpointError
from ._format import FORMAT, MANIFEST, MANIFEST_CRC_ATTR, rank_file, vds_name
from ._h5util import read_slab, same_type
from ._manifest import decode_manifest

__all__ = ["Piece", "Names", "read_manifest", "survey", "open_rank_file", "file_id"]

_LAYOUTS = {h5py.h5d.COMPACT: "compact", h5py.h5d.CONTIGUOUS: "contiguous",
            h5py.h5d.CHUNKED: "chunked", h5py.h5d.VIRTUAL: "virtual"}


@dataclass(frozen=True)
class Piece:
    """One manifest slab and where its bytes are: dataset ``name`` of ``file``, at ``at``."""

    slab: dict
    file: str               # data.h5 itself, or a rank file in its directory
    name: str
    at: tuple[int, ...]     # offsets of the slab within that dataset
    dset: Any = field(default=None, compare=False)  # its open DatasetID, for data.h5's own
    #: data.h5's own: the dataset's byte offset in data.h5 when ``pread`` there reads exactly
    #: what HDF5 would (``raw_offset``), else None; found by ``survey`` with the other facts
    raw: int | None = None


def file_id(f: Any) -> Any:
    """The low-level FileID of an open file: ``f`` itself, or an ``h5py.File``'s ``id``."""
    return f.id if isinstance(f, h5py.File) else f


class Names:
    """The objects of one open HDF5 file by path, reached through hard links only.

    Low-level h5py (link info, ``H5Oopen``): an order of magnitude cheaper per dataset than
    ``Group.__getitem__``, which matters for checkpoints of thousands of arrays. Groups and the
    objects found are cached (a load asks for some twice: the manifest, a slab read in blocks).
    """

    def __init__(self, f: Any, where: str) -> None:
        self.where = where
        self._groups: dict[str, Any] = {"": h5py.h5g.open(file_id(f), b"/")}
        self._found: dict[str, Any] = {}

    def exists(self, name: str) -> bool:
        """Whether the root holds a link ``name`` (never followed: ``name in f`` would open the
        file an external link names)."""
        return bool(self._groups[""].links.exists(name.encode()))

    def get(self, path: str, what: str = "dataset") -> Any:
        """The ObjectID at ``path`` (a DatasetID for datasets)."""
        obj = self._found.get(path)
        if obj is None:
            obj = self._found[path] = self._get(path, what)
        return obj

    def _get(self, path: str, what: str) -> Any:
        parts = path.split("/")
        prefix = ""
        for i, part in enumerate(parts):
            parent = self._groups.get(prefix)
            if parent is None:
                raise CheckpointError(f"{self.where}: {what} {path!r} is missing")
            name = part.encode()
            try:
                kind = parent.links.get_info(name).type
            except (KeyError, RuntimeError, ValueError):
                raise CheckpointError(f"{self.where}: {what} {path!r} is missing") from None
            if kind != h5py.h5l.TYPE_HARD:
                link = {h5py.h5l.TYPE_SOFT: "a soft",
                        h5py.h5l.TYPE_EXTERNAL: "an external"}.get(kind, "a special")
                raise CheckpointError(f"{self.where}: {what} {path!r} is reached through {link} link: "
                                      "a checkpoint holds its data itself, behind hard links only")
            prefix = f"{prefix}/{part}" if prefix else part
            if i == len(parts) - 1:
                return h5py.h5o.open(parent, name)
            if prefix not in self._groups:
                obj = h5py.h5o.open(parent, name)
                self._groups[prefix] = obj if isinstance(obj, h5py.h5g.GroupID) else None
        raise CheckpointError(f"{self.where}: {what} {path!r} is missing")  # empty path


def _check_type(d: Any, where: str, path: str, shape: tuple, dtype: np.dtype) -> bool:
    """Refuse ``d`` unless it is a dataset of ``shape`` and ``dtype`` (a number type); True when
    its file type is the very type numpy's ``dtype`` maps to (``same_type``: HDF5 would copy
    its bytes unconverted), as it is when hpcdp wrote it."""
    if not isinstance(d, h5py.h5d.DatasetID):
        ok, have = False, "not a dataset"
    else:
        try:
            have_shape = d.shape
            if have_shape == shape and same_type(d, dtype):  # (then d.dtype is dtype)
                return True
            have_dtype = d.dtype
            ok = have_shape == shape and have_dtype == dtype and have_dtype.kind in "biufc"
            have = f"{have_shape} {have_dtype}"
        except (TypeError, ValueError):  # an HDF5 type numpy has no equivalent for
            ok, have = False, "of a type numpy cannot hold"
    if not ok:
        raise CheckpointError(f"{where}: dataset {path!r} is {have}, the manifest says {shape} {dtype}")
    return False


def _stored(d: Any, where: str, path: str, file_size: int, dcpl: Any = None) -> int:
    """The bytes dataset ``d`` (a DatasetID; ``dcpl`` its creation properties) occupies in its
    file, once they are known to back its whole shape."""
    return _stored_at(d, where, path, file_size, dcpl)[0]


def _stored_at(d: Any, where: str, path: str, file_size: int, dcpl: Any = None,
               shape: tuple | None = None, dtype: np.dtype | None = None) -> tuple[int, int | None]:
    """``_stored``, and the byte offset of contiguous storage (None: chunked or empty).
    ``shape`` and ``dtype``: ``d``'s, where the caller has checked them (``_check_type``)."""
    dcpl = d.get_create_plist() if dcpl is None else dcpl
    if dcpl.get_external_count():
        name = dcpl.get_external(0)[0]
        name = name.decode(errors="replace") if isinstance(name, bytes) else name
        raise CheckpointError(f"{where}: dataset {path!r} keeps its bytes in the external file "
                              f"{name!r}: only data stored in the checkpoint's own files is read")
    layout = dcpl.get_layout()
    if layout not in (h5py.h5d.CONTIGUOUS, h5py.h5d.CHUNKED):
        raise CheckpointError(f"{where}: dataset {path!r} uses {_LAYOUTS.get(layout, 'unknown')} "
                              "storage: only contiguous or chunked data in the file itself is read")
    if dcpl.get_nfilters():
        raise CheckpointError(f"{where}: dataset {path!r} passes its data through HDF5 filters "
                              "(compression): hpcdp reads raw data only, so that the stored size "
                              "bounds what loading allocates")
    if shape is None or dtype is None:
        shape, dtype = d.shape, d.dtype
    nbytes = prod(shape) * dtype.itemsize
    stored = d.get_storage_size()
    if layout == h5py.h5d.CONTIGUOUS:
        if stored != nbytes:
            raise CheckpointError(f"{where}: dataset {path!r} stores {stored} bytes, its shape "
                                  f"{shape} and dtype {dtype} need {nbytes}")
        offset = d.get_offset() if nbytes else 0
        if offset is None or offset + nbytes > file_size:
            raise CheckpointError(f"{where}: dataset {path!r} lies beyond the end of its file "
                                  f"({file_size} bytes): truncated")
        return stored, offset if nbytes else None
    chunk = dcpl.get_chunk()
    want = prod(-(-s // c) for s, c in zip(shape, chunk))
    have = d.get_num_chunks() if want else 0
    if have != want or stored != have * prod(chunk) * dtype.itemsize:
        raise CheckpointError(f"{where}: dataset {path!r} has {have} of its {want} chunks stored "
                              f"({stored} bytes for the {nbytes} its shape declares): every chunk "
                              "must be written")
    return stored, None


def _scalar_attr(obj: Any, name: bytes) -> Any:
    """The value of the scalar attribute ``name`` of the object ``obj`` (an ObjectID), as h5py's
    ``attrs.get`` reads it (a string as ``str`` or ``bytes``, a number as a numpy scalar); None if
    it is absent, not a scalar, or of a type h5py cannot read. Low-level: a fraction of the cost
    of ``attrs.get``, which a load pays twice."""
    try:
        if not h5py.h5a.exists(obj, name):
            return None
        a = h5py.h5a.open(obj, name)
        if a.shape != ():
            return None
        t = a.get_type()
        if isinstance(t, h5py.h5t.TypeStringID) and t.is_variable_str() \
                and t.get_cset() == h5py.h5t.CSET_UTF8:  # (the format marker, as h5py writes it)
            buf = np.empty((), _VSTR)
            a.read(buf, mtype=_vstr_type())
        else:
            buf = np.empty((), a.dtype)
            a.read(buf)
        return buf[()]
    except Exception:  # noqa: BLE001 - an attribute h5py cannot read is as good as none
        return None


#: a variable-length UTF-8 string, as h5py reads one (``str``)
_VSTR = h5py.string_dtype()


@functools.lru_cache(maxsize=None)
def _vstr_type() -> Any:
    """The HDF5 memory type of ``_VSTR``, made once (h5py would make it anew at every read)."""
    return h5py.h5t.py_create(_VSTR)


def read_manifest(f: Any, where: str, names: Names | None = None, size: int | None = None) -> dict:
    """The validated manifest of the open ``data.h5`` ``f`` (an ``h5py.File`` or its FileID;
    ``names`` its ``Names`` and ``size`` its size in bytes, if the caller has them), format
    marker first."""
    fid = file_id(f)
    marker = _scalar_attr(fid, b"hpcdp_format")
    if isinstance(marker, bytes):
        marker = marker.decode(errors="replace")
    if marker != FORMAT:
        raise CheckpointError(f"{where}: not an hpcdp checkpoint: no {FORMAT!r} format marker")
    names = Names(fid, where) if names is None else names
    if not names.exists(MANIFEST):
        raise CheckpointError(f"{where}: not an hpcdp checkpoint: no manifest dataset {MANIFEST!r}")
    d = names.get(MANIFEST, "the manifest")
    try:
        dt, shape = d.dtype, d.shape
        text = isinstance(d, h5py.h5d.DatasetID) and shape == () and dt.kind == "S"  # format 2
        ok = text or (isinstance(d, h5py.h5d.DatasetID) and len(shape) == 1 and dt == np.uint8)
    except (AttributeError, TypeError, ValueError):  # a group; an HDF5 type numpy cannot hold
        ok = False
    if not ok:
        raise CheckpointError(f"{where}: the manifest {MANIFEST!r} is neither a fixed-length string "
                              "dataset nor (format 1) a 1-D uint8 array")
    if size is None:
        size = os.path.getsize(os.fsdecode(h5py.h5f.get_name(fid)))
    _stored(d, where, MANIFEST, size)
    try:
        if text:  # read as the file's own UTF-8 type: numpy's "S" alone is ASCII to HDF5
            raw = read_slab(d, np.empty((), dt), ()).item()
        else:
            raw = read_slab(d, np.empty(shape, np.uint8), (0,))
        crc = _scalar_attr(d, MANIFEST_CRC_ATTR.encode())
    except (OSError, KeyError, ValueError, TypeError) as exc:
        raise CheckpointError(f"{where}: the manifest cannot be read (truncated?): {exc}") from None
    return decode_manifest(raw, crc, where)


def open_rank_file(directory: str, name: str, where: str) -> Any:
    """Open the rank file ``name`` (already validated as ``rank-NNNNN.h5``) of a checkpoint."""
    path = os.path.join(directory, name)
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise CheckpointError(f"{where}: slab file {name} is missing ({exc.strerror}): a checkpoint "
                              f"is its directory, data.h5 reads its arrays from the rank files beside "
                              f"it; copy the whole directory") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{where}: slab file {name} is not a regular file")
    try:
        return h5py.File(path, "r")
    except OSError as exc:
        raise CheckpointError(f"{where}: slab file {name} is unreadable: {exc}") from None


def _box(space: Any) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(offsets, shape) of a selection that is one solid block, else None."""
    try:
        if space.get_select_type() not in (h5py.h5s.SEL_ALL, h5py.h5s.SEL_HYPERSLABS):
            return None
        lo, hi = space.get_select_bounds()
        shape = tuple(int(b) - int(a) + 1 for a, b in zip(lo, hi))
        if space.get_select_npoints() != prod(shape):
            return None
        return tuple(int(a) for a in lo), shape
    except Exception:  # noqa: BLE001 - unlimited or otherwise unusual selections
        return None


def _mapping(dcpl: Any, where: str, path: str, meta: dict, files: list[str]) -> list[tuple[dict, str]]:
    """(slab, rank file) for each source of the virtual dataset with creation properties ``dcpl``:
    exactly the VDS writer's form."""
    slabs = {(tuple(s["offsets"]), tuple(s["shape"])): s for s in meta["slabs"]}
    n = dcpl.get_virtual_count()
    if n != len(slabs):
        raise CheckpointError(f"{where}: virtual dataset {path!r} maps {n} sources for its "
                              f"{len(slabs)} slabs")
    out = []
    for i in range(n):
        fname, dname = dcpl.get_virtual_filename(i), dcpl.get_virtual_dsetname(i)
        if fname not in files:
            raise CheckpointError(f"{where}: virtual dataset {path!r} maps the file {fname!r}: only "
                                  "the checkpoint's own rank files (rank-NNNNN.h5 in its directory, "
                                  "listed in the manifest) may be sources")
        box = _box(dcpl.get_virtual_vspace(i))
        s = slabs.pop(box, None) if box is not None else None
        # The source must be selected whole ("all": its extent is read from the rank file, where
        # survey checks it is the slab's shape).
        whole = dcpl.get_virtual_srcspace(i).get_select_type() == h5py.h5s.SEL_ALL
        if s is None or fname != rank_file(s["rank"]) or dname != vds_name(path) or not whole:
            raise CheckpointError(f"{where}: virtual dataset {path!r}: source {i} ({fname!r}, "
                                  f"{dname!r}) is not one of its slabs mapped whole from the rank "
                                  "file that wrote it")
        out.append((s, fname))
    return out


def survey(f: Any, fn: str, m: dict, names: Names | None = None, fsize: int | None = None,
           raw_min: int | None = None) -> dict[str, list[Piece]]:
    """Check every dataset of the manifest ``m`` of the open ``data.h5`` ``fn`` (``names``: its
    ``Names``, ``fsize``: its size in bytes, if the caller has them); where each slab is, and,
    for data.h5's own datasets of at least ``raw_min`` bytes, where ``pread`` may read them
    (``Piece.raw``; asked here, where their creation properties are at hand).

    Metadata only: nothing is allocated for the data. Opens each rank file once, in turn.
    """
    where = f"load {fn}"
    directory = os.path.dirname(os.path.abspath(fn))
    names = Names(f, where) if names is None else names
    size = {fn: os.path.getsize(fn) if fsize is None else fsize}
    used = {fn: names.get(MANIFEST, "the manifest").get_storage_size()}
    pieces: dict[str, list[Piece]] = {}
    remote: dict[str, list[tuple[str, dict]]] = {}
    for path, meta in m["datasets"].items():
        shape, dtype = tuple(meta["shape"]), np.dtype(meta["dtype"])
        d = names.get(path)
        exact = _check_type(d, where, path, shape, dtype)
        dcpl = d.get_create_plist()
        if dcpl.get_layout() == h5py.h5d.VIRTUAL:
            for s, fname in _mapping(dcpl, where, path, meta, m["files"]):
                remote.setdefault(fname, []).append((path, s))
                pieces.setdefault(path, []).append(
                    Piece(s, os.path.join(directory, fname), path, (0,) * len(shape)))
        else:
            stored, at = _stored_at(d, where, path, size[fn], dcpl, shape, dtype)
            used[fn] += stored
            # (contiguous, inside the file: ``_stored_at`` checked it)
            raw = at if exact and at is not None and raw_min is not None and stored >= raw_min else None
            pieces[path] = [Piece(s, fn, path, tuple(s["offsets"]), d, raw) for s in meta["slabs"]]
    for fname in m["files"]:
        full, here = os.path.join(directory, fname), f"{where}: slab file {fname}"
        with open_rank_file(directory, fname, where) as g:
            size[full], used[full] = os.path.getsize(full), 0
            rank_names = Names(g, here)
            for path, s in remote.get(fname, []):
                d = rank_names.get(path)
                _check_type(d, here, path, tuple(s["shape"]), np.dtype(m["datasets"][path]["dtype"]))
                dcpl = d.get_create_plist()
                if dcpl.get_layout() == h5py.h5d.VIRTUAL:
                    raise CheckpointError(f"{here}: dataset {path!r} is virtual itself: a rank file "
                                          "holds its data")
                used[full] += _stored(d, here, path, size[full], dcpl)
    for name, n in used.items():
        if n > size[name]:
            raise CheckpointError(f"{where}: the datasets of {os.path.basename(name)} claim {n} "
                                  f"bytes, more than the file's {size[name]}")
    return pieces

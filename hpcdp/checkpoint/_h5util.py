"""Small h5py helpers shared by the writers and the reader (low-level calls, no fill values)."""
from __future__ import annotations

import os
from typing import Any, Sequence

import h5py
import numpy as np

__all__ = ["dcpl", "create_dataset", "write_slab", "write_nothing", "read_slab", "read_into",
           "file_space", "SlabWriteError", "text_dtype", "create_text", "write_text", "posix_fd",
           "raw_offset", "same_type", "run_offset", "pread_into", "flat_index"]


class SlabWriteError(Exception):
    """HDF5's write call itself failed (``__cause__``): in a collective transfer this rank took part,
    unlike a failure before the call, after which it must still join with an empty selection."""


def dcpl() -> Any:
    """Contiguous, allocated at creation, never filled: the writer covers every byte anyway."""
    p = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    p.set_layout(h5py.h5d.CONTIGUOUS)
    p.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    p.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    return p


def create_dataset(f: Any, path: str, shape: Sequence[int], dtype: Any) -> Any:
    if len(shape) == 0 or 0 in shape:
        return f.create_dataset(path, shape=tuple(shape), dtype=dtype)
    return f.create_dataset(path, shape=tuple(shape), dtype=dtype, dcpl=dcpl())


def _did(dset: Any) -> Any:
    """The low-level DatasetID of an h5py Dataset, or the DatasetID itself."""
    return dset if isinstance(dset, h5py.h5d.DatasetID) else dset.id


def file_space(dset: Any, offsets: Sequence[int] | None, shape: Sequence[int] | None) -> Any:
    space = _did(dset).get_space()
    if offsets is None:
        space.select_none()
    elif len(shape) > 0:
        space.select_hyperslab(tuple(offsets), tuple(shape))
    return space


def _mem_space(shape: Sequence[int] | None) -> Any:
    if shape is None:
        m = h5py.h5s.create_simple((1,))
        m.select_none()
        return m
    if len(shape) == 0:
        return h5py.h5s.create(h5py.h5s.SCALAR)
    return h5py.h5s.create_simple(tuple(shape))


def _h5write(dset: Any, mem: Any, space: Any, buf: np.ndarray, dxpl: Any) -> None:
    try:
        dset.id.write(mem, space, buf, dxpl=dxpl)
    except Exception as exc:  # noqa: BLE001
        raise SlabWriteError(f"{type(exc).__name__}: {exc}") from exc


def write_slab(dset: Any, data: np.ndarray | None, offsets: Sequence[int] | None, dxpl: Any = None) -> None:
    """Write ``data`` at ``offsets``; ``data=None`` takes part in a collective write with nothing.

    Raises ``SlabWriteError`` when HDF5's write call failed, anything else when it was not reached.
    """
    if data is None or data.size == 0:
        write_nothing(dset, dxpl)
        return
    data = np.require(data, requirements="C")
    _h5write(dset, _mem_space(data.shape), file_space(dset, offsets, data.shape), data, dxpl)


def write_nothing(dset: Any, dxpl: Any = None) -> None:
    """Take part in a (collective) write of ``dset`` with an empty selection."""
    _h5write(dset, _mem_space(None), file_space(dset, None, None), np.zeros(1, dset.dtype), dxpl)


def read_slab(dset: Any, out: np.ndarray, offsets: Sequence[int]) -> np.ndarray:
    """Read the block of ``out.shape`` at ``offsets`` of ``dset`` (a Dataset or DatasetID) into
    ``out`` (C-contiguous)."""
    if out.size == 0:
        return out
    _did(dset).read(_mem_space(out.shape), file_space(dset, offsets, out.shape), out)
    return out


def read_into(dset: Any, out: np.ndarray, out_offsets: Sequence[int], offsets: Sequence[int],
              shape: Sequence[int]) -> None:
    """Read the block ``shape`` at ``offsets`` of ``dset`` straight into ``out`` at ``out_offsets``
    (HDF5 scatters it into the C-contiguous ``out``: no temporary the size of the block)."""
    if len(shape) == 0:
        read_slab(dset, out, ())
        return
    if 0 in shape:
        return
    mem = h5py.h5s.create_simple(tuple(out.shape))
    mem.select_hyperslab(tuple(out_offsets), tuple(shape))
    _did(dset).read(mem, file_space(dset, offsets, shape), out)


def posix_fd(fid: Any, sec2: bool = False) -> int | None:
    """The file descriptor under the open HDF5 file ``fid`` (a FileID) when HDF5 reads it with its
    POSIX driver, so that ``pread`` at a dataset's offset sees the bytes HDF5 would; else None.
    Asked once per file: the driver and handle are the file's, not each dataset's. ``sec2``: the
    caller opened the file on that driver itself (HDF5 is not asked, a cost on cold caches)."""
    try:
        if not sec2 and fid.get_access_plist().get_driver() != h5py.h5fd.SEC2:
            return None
        fd = fid.get_vfd_handle()
    except Exception:  # noqa: BLE001 - anything unusual: HDF5's own read path
        return None
    return fd if isinstance(fd, int) else None


def raw_offset(dset: Any, dcpl: Any = None) -> int | None:
    """The byte offset in its file of ``dset`` (a Dataset or DatasetID; ``dcpl`` its creation
    properties, if the caller has them) when reading its bytes there with ``pread`` gives exactly
    what HDF5's read would: it is stored contiguously and its file type is the very type numpy's
    dtype maps to (HDF5 would convert nothing). Else None. The caller has checked that the stored
    bytes lie inside the file (``_layout``) and asks ``posix_fd`` about the file."""
    did = _did(dset)
    try:
        dcpl = did.get_create_plist() if dcpl is None else dcpl
        if dcpl.get_layout() != h5py.h5d.CONTIGUOUS:
            return None
        if not same_type(did, did.dtype):
            return None
        base = did.get_offset()
    except Exception:  # noqa: BLE001 - anything unusual: HDF5's own read path
        return None
    return base if isinstance(base, int) else None


#: numpy dtype -> the HDF5 type h5py maps it to (``same_type``; made once per dtype)
_H5TYPES: dict[np.dtype, Any] = {}


def same_type(did: Any, dtype: np.dtype) -> bool:
    """Whether the file type of ``did`` (a DatasetID) is the very type numpy's ``dtype`` maps to:
    HDF5 would then copy its bytes unconverted (and h5py reads its dtype as ``dtype``)."""
    try:
        t = _H5TYPES.get(dtype)
        if t is None:
            t = _H5TYPES[dtype] = h5py.h5t.py_create(dtype)
        return bool(did.get_type().equal(t))
    except Exception:  # noqa: BLE001 - anything unusual: HDF5's own read path
        return False


def run_offset(offsets: Sequence[int], shape: Sequence[int], dshape: Sequence[int],
               itemsize: int) -> int | None:
    """Where the block ``shape`` at ``offsets`` of a C-order array of ``dshape`` starts, in bytes
    from the array's first byte, when the block is one run of bytes; else None."""
    if len(offsets) != len(dshape):
        return None
    # one run: after the first axis along which the block is longer than 1, it spans whole axes
    k = next((a for a, n in enumerate(shape) if n > 1), len(shape))
    if any(n != d or o != 0 for n, d, o in zip(shape[k + 1:], dshape[k + 1:], offsets[k + 1:])):
        return None
    return flat_index(offsets, dshape) * itemsize


def flat_index(offsets: Sequence[int], shape: Sequence[int]) -> int:
    """C-order index of ``offsets`` in an array of ``shape``."""
    i = 0
    for o, n in zip(offsets, shape):
        i = i * n + o
    return i


def pread_into(fd: int, buf: np.ndarray, offset: int) -> None:
    """Fill the C-contiguous ``buf`` with the file's bytes at ``offset`` (short reads retried; a
    file that ends first raises ``OSError``)."""
    mv = memoryview(buf).cast("B")  # (raises on a non-contiguous buffer: no silent copy)
    got, n = 0, mv.nbytes
    while got < n:
        k = os.preadv(fd, [mv[got:]], offset + got)
        if k <= 0:
            raise OSError(f"the file ends {n - got} bytes before the end of the data")
        got += k


def text_dtype(n: int) -> np.dtype:
    """A fixed-length UTF-8 string of ``n`` bytes: h5py reads it as ``bytes`` (``.asstr()``: str),
    and unlike a variable-length string its stored size is in the dataset's own storage, which
    the reader checks against the file before it allocates anything."""
    return h5py.string_dtype("utf-8", max(1, n))


def create_text(f: Any, path: str, n: int) -> Any:
    """A scalar dataset for ``n`` bytes of UTF-8 text (collective in an mpio file)."""
    return f.create_dataset(path, shape=(), dtype=text_dtype(n))


def write_text(dset: Any, text: bytes | None, dxpl: Any = None) -> None:
    """Write ``text`` (UTF-8, the dataset's length) into a ``create_text`` dataset; None takes
    part with nothing."""
    if text is None:
        write_nothing(dset, dxpl)
        return
    buf = np.array(text, dtype=dset.dtype)  # the file's type: numpy's own "S" would be ASCII
    _h5write(dset, h5py.h5s.create(h5py.h5s.SCALAR), file_space(dset, (), ()), buf, dxpl)

"""Parallel write: one HDF5 file opened by every rank with ``driver="mpio"``.

Collective contract (all ranks, same order, same arguments; the plan was checked across ranks
before the file is opened): open, create groups, datasets and attributes, write slabs, then
``finish`` (create and fill the manifest dataset, close). Split and shard datasets are written with
collective transfers, every rank taking part (with an empty selection when it has no slab);
datasets owned by one rank are written by it alone with an independent transfer.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

import h5py
import numpy as np

from ._commit import DATA, fsync_path
from ._format import MANIFEST, Leaf, container_groups, scalar_attrs
from ._h5util import create_dataset, write_slab
from ._plan import DatasetPlan, slab_data

__all__ = ["MpioWriter"]

#: data at least this big is aligned to this boundary (file-system block / stripe friendly)
ALIGN = 1 << 20


class MpioWriter:
    def __init__(self, tmpdir: str, comm: Any, rank: int) -> None:
        self.path = os.path.join(tmpdir, DATA)
        self.comm, self.rank = comm, rank
        self.f: Any = None

    def files(self) -> list[str]:
        return []

    def write(self, plans: Sequence[DatasetPlan], leaves: Sequence[Leaf], tree0: dict) -> list[tuple]:
        """Create everything and write this rank's slabs; returns ``(plan index, slab)`` written here."""
        from mpi4py import MPI

        info = MPI.Info.Create()
        # Collective buffering on: few large contiguous accesses per aggregator.
        info.Set("romio_cb_write", "enable")
        self.f = h5py.File(self.path, "w", driver="mpio", comm=self.comm, info=info, libver="latest",
                           alignment_threshold=ALIGN, alignment_interval=ALIGN)
        info.Free()
        f = self.f
        f.attrs["hpcdp_format"] = "hpcdp-checkpoint"
        for g in container_groups(tree0):
            f.create_group(g)
        dsets = []
        for p in plans:
            d = create_dataset(f, p.path, p.shape, np.dtype(p.dtype))
            if p.note:
                d.attrs["hpcdp_type"] = p.note
            dsets.append(d)
        for gpath, name, value in scalar_attrs(tree0):
            f[gpath].attrs[name] = value
        coll = h5py.h5p.create(h5py.h5p.DATASET_XFER)
        coll.set_dxpl_mpio(h5py.h5fd.MPIO_COLLECTIVE)
        mine = []
        for i, (p, leaf, d) in enumerate(zip(plans, leaves, dsets)):
            data = slab_data(leaf, p, self.rank)
            s = p.slab_of(self.rank)
            if p.mode == "owned":
                if s is not None:
                    write_slab(d, data, s.offsets)
                    mine.append((i, s))
            elif 0 not in p.shape:
                write_slab(d, data, None if s is None else s.offsets, dxpl=coll)
                if s is not None:
                    mine.append((i, s))
        return mine

    def finish(self, manifest_bytes: np.ndarray, crc: int) -> list[str]:
        """Write the manifest (collective create, rank 0 writes), close; the files to fsync."""
        d = create_dataset(self.f, MANIFEST, manifest_bytes.shape, np.uint8)
        d.attrs["crc32"] = np.uint32(crc)
        write_slab(d, manifest_bytes if self.rank == 0 else None, (0,))
        self.f.close()
        self.f = None
        return [self.path]

    def abort(self) -> None:
        if self.f is not None:
            try:
                self.f.close()
            except Exception:  # noqa: BLE001 - best effort; the directory is discarded
                pass
            self.f = None


def fsync_files(paths: Sequence[str]) -> None:
    for p in paths:
        fsync_path(p)

"""Fallback write without MPI-enabled h5py (and on the sim and TCP backends).

Each rank writes its slabs to ``rank-NNNNN.h5`` of its own (independently, in parallel); after the
slabs' checksums are gathered, rank 0 writes ``data.h5``: the groups, attributes and manifest, every
dataset written by rank 0 alone as a plain dataset, and every other dataset as an HDF5 virtual
dataset mapping the slabs in the rank files (relative names, so the directory can be renamed).
Readers see the same single-file view as in mpio mode: ``h5py.File("data.h5")["a/b"][...]``.

A checkpoint is its directory: ``data.h5`` copied alone maps nothing, and HDF5 then reads each
virtual dataset's fill value without a word. So that no reader can take that for data, every
virtual dataset gets a fill value that cannot pass for it (``missing_source_fill``: NaN for
floating and complex types and bfloat16, the smallest value of a signed integer type, the largest
of an unsigned one, True for bool) and an attribute ``hpcdp_sources`` naming the rank files it
needs; the file's attribute ``hpcdp_files`` names them all, beside a sentence saying to copy the
whole directory. hpcdp's own loader refuses a missing rank file, naming it.
"""
from __future__ import annotations

import os
from math import prod
from typing import Callable, Sequence

import h5py
import numpy as np

from ._commit import DATA
from ._format import MANIFEST, Leaf, container_groups, h5_attrs, rank_file, vds_name
from ._h5util import create_dataset, create_text, write_slab, write_text
from ._plan import DatasetPlan, slab_data

__all__ = ["VdsWriter", "rank_file", "vds_name", "missing_source_fill", "SOURCES_ATTR", "FILES_ATTR"]

#: attribute of each virtual dataset: the rank files it reads from (names in its directory)
SOURCES_ATTR = "hpcdp_sources"
#: attribute of data.h5: every rank file of the checkpoint, and a note on what to copy
FILES_ATTR = "hpcdp_files"
NOTE_ATTR = "hpcdp_note"
NOTE = ("this checkpoint is its directory: data.h5 maps datasets from the rank files listed in "
        "hpcdp_files, which must sit beside it; copy the whole directory. Where one is missing, "
        "h5py reads the fill value (NaN for floats, the extreme value of an integer type).")


def missing_source_fill(dtype: np.dtype, note: str = "") -> object:
    """The value a virtual dataset reads where its source file is missing: one that cannot pass
    for data. NaN for floats and complex numbers (bfloat16, stored as uint16 bits: its quiet NaN
    0x7FC0), the most negative value of a signed integer type, the largest of an unsigned one
    (all bits set), and True for bool (no third value exists; ``hpcdp_sources`` is the signal)."""
    dt = np.dtype(dtype)
    if note == "bfloat16":
        return np.uint16(0x7FC0)
    if dt.kind in "fc":
        return dt.type(np.nan)
    if dt.kind == "i":
        return np.iinfo(dt).min
    if dt.kind == "u":
        return np.iinfo(dt).max
    if dt.kind == "b":
        return True
    return None


def _in_main(p: DatasetPlan) -> bool:
    """Datasets rank 0 writes straight into the main file (and those with no slab at all)."""
    return not p.slabs or (p.mode == "owned" and p.slabs[0].rank == 0)


class VdsWriter:
    def __init__(self, tmpdir: str, rank: int) -> None:
        self.dir, self.rank = tmpdir, rank
        self.own = os.path.join(tmpdir, rank_file(rank))
        self.wrote_own = False
        self.plans: Sequence[DatasetPlan] = ()
        self.leaves: Sequence[Leaf] = ()
        self.tree0: dict = {}

    def write(self, plans: Sequence[DatasetPlan], leaves: Sequence[Leaf], tree0: dict, *,
              failed: bool = False, wrote: Callable[[str, int], None] | None = None) -> list[tuple]:
        """Write this rank's slabs to its own file (nothing collective: ``failed`` skips it all);
        ``wrote`` is told the bytes of each slab once written (``Flusher.wrote``)."""
        self.plans, self.leaves, self.tree0 = plans, leaves, tree0
        if failed:
            return []
        todo = [(i, p, p.slab_of(self.rank)) for i, p in enumerate(plans)
                if not _in_main(p) and p.slab_of(self.rank) is not None]
        mine = []
        if todo:
            # "w-": created exclusively (O_EXCL), so never through a link planted in the directory
            with h5py.File(self.own, "w-", libver="latest") as f:
                for i, p, s in todo:
                    d = create_dataset(f, p.path, s.shape, np.dtype(p.dtype))
                    write_slab(d, slab_data(leaves[i], p, self.rank), (0,) * len(s.shape))
                    mine.append((i, s))
                    if wrote is not None:
                        wrote(self.own, prod(s.shape) * np.dtype(p.dtype).itemsize)
            self.wrote_own = True
        if self.rank == 0:
            mine += [(i, p.slabs[0]) for i, p in enumerate(plans) if _in_main(p) and p.slabs]
        return mine

    def files(self) -> list[str]:
        return [self.own] if self.wrote_own else []

    def early_files(self) -> list[str]:
        """What to fsync early, once the slabs are written: this rank's own file (closed)."""
        return self.files()

    def finish(self, manifest: bytes, crc: int) -> list[str]:
        """Rank 0 writes the main file (the manifest: UTF-8 JSON text); every rank returns the
        files it wrote (to fsync)."""
        if self.rank != 0:
            return self.files()
        main = os.path.join(self.dir, DATA)
        with h5py.File(main, "w-", libver="latest") as f:
            f.attrs["hpcdp_format"] = "hpcdp-checkpoint"
            every = sorted({rank_file(s.rank) for p in self.plans if not _in_main(p) for s in p.slabs})
            if every:
                f.attrs[FILES_ATTR] = every
                f.attrs[NOTE_ATTR] = NOTE
            for g in container_groups(self.tree0):
                f.create_group(g)
            for i, p in enumerate(self.plans):
                dt = np.dtype(p.dtype)
                if _in_main(p):
                    d = create_dataset(f, p.path, p.shape, dt)
                    if p.slabs:
                        write_slab(d, slab_data(self.leaves[i], p, 0), p.slabs[0].offsets)
                else:
                    layout = h5py.VirtualLayout(shape=p.shape, dtype=dt)
                    for s in p.slabs:
                        src = h5py.VirtualSource(vds_name(rank_file(s.rank)), vds_name(p.path),
                                                 shape=s.shape, dtype=dt)
                        layout[tuple(slice(o, o + n) for o, n in zip(s.offsets, s.shape))] = src
                    d = f.create_virtual_dataset(p.path, layout,
                                                 fillvalue=missing_source_fill(dt, p.note or ""))
                    d.attrs[SOURCES_ATTR] = sorted({rank_file(s.rank) for s in p.slabs})
                if p.note:
                    d.attrs["hpcdp_type"] = p.note
            for opath, name, value in h5_attrs(self.tree0):
                f[opath].attrs[name] = value
            manifest = bytes(manifest)
            m = create_text(f, MANIFEST, len(manifest))
            write_text(m, manifest)
            m.attrs["crc32"] = np.uint32(crc)
        return self.files() + [main]

    def abort(self) -> None:
        pass

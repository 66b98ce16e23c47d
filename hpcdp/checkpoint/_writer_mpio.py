"""Parallel write: one HDF5 file opened by every rank with ``driver="mpio"``.

Collective contract (all ranks, same order, same arguments; the plan was checked across ranks
before the file is opened): open, create groups, datasets and attributes, write slabs, then
``finish`` (create and fill the manifest dataset, close) or ``abort`` (close). Split and shard
datasets are written with collective transfers, every rank taking part (with an empty selection
when it has no slab); datasets owned by one rank are written by it alone with an independent
transfer.

A Python-level failure on one rank must not break that contract, or the other ranks wait forever
in a collective write (or in the collective close the failing rank would call too early). So a rank
that fails records the error and keeps joining every remaining collective write with an empty
selection; ``write`` raises it only at the end, ``_save`` then agrees on failure across ranks and
every rank calls ``abort`` together. A failure inside HDF5's own write call counts as having taken
part in that call (it is not joined again). A rank that dies outright is the launcher's business.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import h5py
import numpy as np

from ._commit import DATA, fsync_path
from ._format import MANIFEST, Leaf, container_groups, h5_attrs
from ._h5util import (
    SlabWriteError, create_dataset, create_text, write_nothing, write_slab, write_text,
)
from ._plan import DatasetPlan, slab_data

__all__ = ["MpioWriter"]

#: data at least this big is aligned to this boundary (file-system block / stripe friendly)
ALIGN = 1 << 20


class MpioWriter:
    def __init__(self, tmpdir: str, comm: Any, rank: int) -> None:
        self.path = os.path.join(tmpdir, DATA)
        self.comm, self.rank = comm, rank
        self.f: Any = None
        self.error: BaseException | None = None

    def files(self) -> list[str]:
        return []

    def early_files(self) -> list[str]:
        """What to fsync early, once the slabs are written: the one shared file, from one rank
        (every rank fsyncs it after ``finish``)."""
        return [self.path] if self.rank == 0 else []

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc.__cause__ if isinstance(exc, SlabWriteError) and exc.__cause__ else exc

    def write(self, plans: Sequence[DatasetPlan], leaves: Sequence[Leaf], tree0: dict, *,
              failed: bool = False, wrote: Callable[[str, int], None] | None = None) -> list[tuple]:
        """Create everything and write this rank's slabs; returns ``(plan index, slab)`` written here.

        Args:
            failed: this rank already failed: take part in every collective, write nothing.
            wrote: told (on rank 0: the file is shared) the bytes of each dataset once written,
                for early write-back (``Flusher.wrote``).
        """
        from mpi4py import MPI

        info = MPI.Info.Create()
        # Collective buffering on: few large contiguous accesses per aggregator.
        info.Set("romio_cb_write", "enable")
        # "w-": created exclusively (MPI_MODE_EXCL), never through a link planted in the directory
        self.f = h5py.File(self.path, "w-", driver="mpio", comm=self.comm, info=info, libver="latest",
                           alignment_threshold=ALIGN, alignment_interval=ALIGN)
        info.Free()
        f = self.f
        dsets = []
        try:
            f.attrs["hpcdp_format"] = "hpcdp-checkpoint"
            for g in container_groups(tree0):
                f.create_group(g)
            for p in plans:
                d = create_dataset(f, p.path, p.shape, np.dtype(p.dtype))
                if p.note:
                    d.attrs["hpcdp_type"] = p.note
                dsets.append(d)
            for opath, name, value in h5_attrs(tree0):
                f[opath].attrs[name] = value
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)
        # Metadata calls do not communicate one by one, so agree once before the collective writes:
        # if any rank could not create everything, no rank writes anything.
        if self.comm.allreduce(self.error is not None or failed, op=MPI.LOR):
            if self.error is None and not failed:
                return []  # another rank failed: its error is the one reported
            raise self.error or RuntimeError("failed before writing")
        coll = h5py.h5p.create(h5py.h5p.DATASET_XFER)
        coll.set_dxpl_mpio(h5py.h5fd.MPIO_COLLECTIVE)
        mine = []
        for i, (p, leaf, d) in enumerate(zip(plans, leaves, dsets)):
            s = p.slab_of(self.rank)
            if p.mode == "owned":
                if s is not None and self.error is None:
                    try:
                        write_slab(d, slab_data(leaf, p, self.rank), s.offsets)
                        mine.append((i, s))
                    except Exception as exc:  # noqa: BLE001
                        self._fail(exc)
            elif 0 not in p.shape:
                self._collective(d, leaf, p, s, coll, i, mine)
            if wrote is not None and self.rank == 0 and self.error is None:
                wrote(self.path, p.nbytes)
        if self.error is not None:
            raise self.error
        return mine

    def _collective(self, d: Any, leaf: Leaf, p: DatasetPlan, s: Any, coll: Any, i: int,
                    mine: list) -> None:
        """This rank's part of one collective write, always joined exactly once."""
        if self.error is None:
            try:
                write_slab(d, slab_data(leaf, p, self.rank) if s is not None else None,
                           None if s is None else s.offsets, dxpl=coll)
                if s is not None:
                    mine.append((i, s))
                return
            except SlabWriteError as exc:
                self._fail(exc)  # HDF5's call was entered: joined already
                return
            except Exception as exc:  # noqa: BLE001 - failed before joining: join empty below
                self._fail(exc)
        try:
            write_nothing(d, coll)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def finish(self, manifest: bytes, crc: int) -> list[str]:
        """Write the manifest text (collective create, rank 0 writes), close; the files to fsync."""
        err: BaseException | None = None
        try:
            manifest = bytes(manifest)
            d = create_text(self.f, MANIFEST, len(manifest))
            d.attrs["crc32"] = np.uint32(crc)
            write_text(d, manifest if self.rank == 0 else None)
        except Exception as exc:  # noqa: BLE001 - the close below is collective: never skip it
            err = exc
        f, self.f = self.f, None
        try:
            f.close()  # flushes the metadata: its failure is the save's failure
        except Exception as exc:  # noqa: BLE001
            err = err or exc
        if err is not None:
            raise err
        return [self.path]

    def abort(self) -> None:
        """Close the file (collective: every rank calls it, after the ranks agreed to)."""
        if self.f is not None:
            f, self.f = self.f, None
            try:
                f.close()
            except Exception:  # noqa: BLE001 - best effort; the directory is discarded
                pass


def fsync_files(paths: Sequence[str]) -> None:
    for p in paths:
        fsync_path(p)

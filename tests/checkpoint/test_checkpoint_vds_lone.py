"""A VDS-mode checkpoint's ``data.h5`` copied without its rank files (issue 21, item 2).

``data.h5`` maps most datasets from ``rank-NNNNN.h5`` beside it. Copied alone, plain h5py used to
read the optimizer's arrays as zeros, without a word. Now every virtual dataset reads a fill value
that cannot pass for data (NaN for floats, the most negative value of a signed integer type) and
names the files it needs in an attribute, the file lists them all, and hpcdp's loader refuses
the lone file naming the missing one.
"""
from __future__ import annotations

import os
import shutil

import h5py
import numpy as np
import pytest

import hpcdp
from conftest import run_ranks
from hpcdp import nn, optim
from hpcdp.checkpoint import Shard
from hpcdp.checkpoint._save import choose_mode
from hpcdp.errors import CheckpointError

WORLD = 2


def body_save(rank: int, path: str) -> str:
    """Two Adam steps under DDP, then save model, optimizer and an integer shard in VDS mode."""
    g = hpcdp.get_default_group()
    mode = choose_mode(g, None)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).astype(np.float64)
    ddp = hpcdp.DDP(model)
    opt = optim.Adam(ddp.parameters(), lr=1e-2)
    rng = np.random.default_rng(rank)
    for _ in range(2):
        out = ddp(rng.standard_normal((4, 64)))
        ddp.backward(out - 1.0)
        opt.step()
        opt.zero_grad()
    counts = Shard(np.arange(10, dtype=np.int64) + 100 * rank, (10 * g.size,), (10 * rank,))
    hpcdp.checkpoint.save(path, {"model": ddp.state_dict(), "optim": opt.state_dict(),
                                 "counts": counts, "step": 2})
    return mode


def _virtual(f: h5py.File) -> dict[str, h5py.Dataset]:
    found: dict[str, h5py.Dataset] = {}

    def visit(name: str, obj: object) -> None:   # returning anything but None stops the visit
        if isinstance(obj, h5py.Dataset) and obj.is_virtual:
            found[name] = obj

    f.visititems(visit)
    return found


@pytest.mark.timeout(120)
def test_lone_data_file_reads_nan_and_names_its_rank_files(tmp_path) -> None:
    path = str(tmp_path / "ck" / "step-2")
    modes = run_ranks("sim", WORLD, body_save, path)
    assert modes == ["vds"] * WORLD
    rank_files = sorted(n for n in os.listdir(path) if n.startswith("rank-"))
    assert rank_files, os.listdir(path)

    # The whole directory: the data is there (the optimizer's moments are not NaN nor zero).
    with h5py.File(os.path.join(path, "data.h5"), "r") as f:
        virtual = _virtual(f)
        whole = {n: d[...] for n, d in virtual.items()}
    assert any(n.startswith("optim/") for n in virtual), sorted(virtual)
    assert any(n.startswith("counts") for n in virtual), sorted(virtual)
    for n, a in whole.items():
        if a.dtype.kind == "f":
            assert not np.isnan(a).any(), n

    lone_dir = tmp_path / "copied"
    lone_dir.mkdir()
    lone = str(lone_dir / "data.h5")
    shutil.copy(os.path.join(path, "data.h5"), lone)
    with h5py.File(lone, "r") as f:
        assert sorted(f.attrs["hpcdp_files"]) == rank_files
        assert "copy the whole directory" in str(f.attrs["hpcdp_note"])
        virtual = _virtual(f)
        moments = [n for n in virtual if n.startswith("optim/") and "exp_avg" in n]
        assert moments, sorted(virtual)
        for n, d in virtual.items():
            a = d[...]
            sources = [str(s) for s in d.attrs["hpcdp_sources"]]
            assert sources and set(sources) <= set(rank_files), (n, sources)
            if a.dtype.kind == "f":
                assert np.isnan(a).all(), f"{n} reads {a.ravel()[:4]}, not NaN, without its rank files"
            elif a.dtype.kind == "i":
                assert (a == np.iinfo(a.dtype).min).all(), f"{n} reads {a.ravel()[:4]}"
        assert any(np.dtype(virtual[n].dtype).kind == "i" for n in virtual)

    with pytest.raises(CheckpointError, match=r"rank-0000[01]\.h5 is missing"):
        hpcdp.checkpoint.load(lone)
    with pytest.raises(CheckpointError, match=r"rank-0000[01]\.h5 is missing"):
        hpcdp.checkpoint.load(str(lone_dir))

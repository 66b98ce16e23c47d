"""Checkpoints a collaborator reads with plain h5py (issue 25, item 7), and exact round trips.

A list of Python floats, ints or bools is a 1-D dataset; None an empty attribute; strings UTF-8;
the manifest a JSON string. hpcdp loads every value back as the type it was saved as, and the
format-1 layout (groups of attributes, 'None' strings, uint8 manifest) still loads: the files
under data/ were written by hpcdp before this format (data/README.md).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import struct
from typing import Any

import h5py
import numpy as np
import pytest

import hpcdp
from hpcdp.testing import run_ranks
from hpcdp.testing.fixtures import World, worlds
from hpcdp.checkpoint import Shard, load, save
from hpcdp.checkpoint._format import FORMAT_VERSION

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


# -- what a collaborator without hpcdp runs (README "Reading a checkpoint without hpcdp") ------
def read_plain(ckpt_dir: str) -> dict:
    """Plain h5py only: no hpcdp import in here."""
    with h5py.File(f"{ckpt_dir}/data.h5", "r") as f:
        w = f["model/w"][...]                        # arrays are datasets
        loss = f["loss"][...].tolist()               # a list of floats: a 1-D dataset ...
        kind = f["loss"].attrs["hpcdp_type"]         # ... with "list" or "tuple" here
        step = int(f.attrs["step"])                  # scalars are attributes of their group
        best = f.attrs["best"]                       # None is h5py.Empty (a null dataspace)
        tag, name = f.attrs["tag"], f.attrs["name"]  # strings: UTF-8 str
        manifest = json.loads(f["_hpcdp_manifest"].asstr()[()])
    return {"w": w, "loss": loss, "kind": kind, "step": step, "best_is_none": isinstance(best, h5py.Empty),
            "tag": tag, "name": name, "manifest": manifest}


def _plain_state(rank: int, n: int) -> dict:
    w = np.arange(24, dtype=np.float32).reshape(6, 4)
    lo, hi = rank * 6 // n, (rank + 1) * 6 // n
    return {"model": {"w": Shard(w[lo:hi], (6, 4), (lo, 0)), "b": np.ones(4, np.float64)},
            "loss": [2.5, 1.25, 0.625, 0.1], "step": 42, "best": None, "tag": "None",
            "name": "r\u00e9sum\u00e9", "betas": (0.9, 0.999)}


def _body_plain(rank: int, path: str) -> list[str]:
    n = hpcdp.world_size()
    save(path, _plain_state(rank, n))
    fails: list[str] = []
    if rank == 0:
        got = read_plain(path)
        want = np.arange(24, dtype=np.float32).reshape(6, 4)
        if not (np.array_equal(got["w"], want) and got["w"].dtype == np.float32):
            fails.append(f"w: {got['w']!r}")
        if got["loss"] != [2.5, 1.25, 0.625, 0.1] or not all(type(x) is float for x in got["loss"]):
            fails.append(f"loss: {got['loss']!r}")
        for key, value in (("kind", "list"), ("step", 42), ("best_is_none", True), ("tag", "None"),
                           ("name", "r\u00e9sum\u00e9")):
            if got[key] != value or type(got[key]) is not type(value):
                fails.append(f"{key}: {got[key]!r} ({type(got[key]).__name__}), not {value!r}")
        m = got["manifest"]
        if m.get("format") != "hpcdp-checkpoint" or m.get("world_size") != n \
                or m["datasets"]["model/w"]["shape"] != [6, 4] or "loss" not in m["datasets"]:
            fails.append(f"manifest: {json.dumps(m)[:300]}")
    # and hpcdp itself loads it back exactly, with and without like
    full = load(path)
    want_full = dict(_plain_state(0, 1), model={"w": np.arange(24, dtype=np.float32).reshape(6, 4),
                                                 "b": np.ones(4)})
    fails += [f"load: {d}" for d in _diff(want_full, full)]
    mine = load(path, like=_plain_state(rank, n))
    fails += [f"like: {d}" for d in _diff(_plain_state(rank, n), mine)]
    return fails


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", worlds("sim-1", "sim-2", "sim-4", "mpi"), indirect=True)
def test_plain_h5py_reads_a_checkpoint(world: World, shared_tmp_path: str) -> None:
    out = world.run(_body_plain, os.path.join(shared_tmp_path, "ck", "step-42"))
    assert out == [[]] * world.size, out


# -- exact round trips ------------------------------------------------------------------------
def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


def _diff(a: Any, b: Any, where: str = "state") -> list[str]:
    """Where ``b`` is not exactly ``a``: same types all the way down (list vs tuple, int vs bool
    vs float vs numpy scalar), floats bit for bit (NaN, -0.0), arrays by dtype, shape and bytes."""
    if type(a) is not type(b):
        return [f"{where}: {type(b).__name__} {b!r:.80}, not {type(a).__name__} {a!r:.80}"]
    if isinstance(a, dict):
        if list(a) != list(b):
            return [f"{where}: keys {list(b)}, not {list(a)}"]
        return [d for k in a for d in _diff(a[k], b[k], f"{where}[{k!r}]")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: {len(b)} items, not {len(a)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diff(x, y, f"{where}[{i}]")]
    if isinstance(a, Shard):
        if (a.global_shape, a.offsets) != (b.global_shape, b.offsets):
            return [f"{where}: shard {b.global_shape} at {b.offsets}"]
        return _diff(a.local, b.local, f"{where}.local")
    if isinstance(a, np.ndarray):
        ok = a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
        return [] if ok else [f"{where}: {b.dtype}{b.shape}, not {a.dtype}{a.shape} (or other bytes)"]
    if isinstance(a, float):
        return [] if _bits(a) == _bits(b) else [f"{where}: {b!r}, not {a!r}"]
    if isinstance(a, np.generic):
        ok = a.dtype == b.dtype and a.tobytes() == b.tobytes()
        return [] if ok else [f"{where}: {b!r}, not {a!r}"]
    return [] if a == b else [f"{where}: {b!r}, not {a!r}"]


def exact_state() -> dict:
    nan = float("nan")
    return {
        "floats": [0.1, -0.0, float("inf"), -float("inf"), nan, 5e-324, 1.7976931348623157e308],
        "ints": [0, -1, 2**63 - 1, -2**63, 7],
        "bools": [True, False, True],
        "one": [3.5],
        "tuple_f": (0.9, 0.999),
        "tuple_i": (1, 2, 3),
        "tuple_b": (False,),
        "int_and_bool": [1, True, 0, False],           # stays a group: bools are not ints here
        "int_and_float": [1, 2.0],
        "huge_int": [2**63, 1],                        # beyond int64: a group, still exact
        "np_floats": [np.float64(0.5), np.float64(1.5)],   # numpy scalars come back as numpy scalars
        "strings": ["a", "None", ""],
        "nones": [None, None],
        "nested": [[1.0, 2.0], (3, 4), [[True]], [], ()],
        "empty_l": [],
        "empty_t": (),
        "none": None,
        "none_str": "None",
        "empty_str": "",
        "unicode": "\u00e9\u4e2d\U0001f600",
        "step": 10,
        "big": 2**70,
        "lr": 0.001,
        "flag": False,
        "c": 1 - 2j,
        "np_i": np.int32(-4),
        "arr": np.arange(5, dtype=np.int16),
        "params": {"groups": [{"lr": 0.1, "params": [0, 1, 2], "betas": (0.9, 0.99)}]},
        7: {"hist": [1.0] * 1000},
    }


def _body_exact(rank: int, path: str) -> list[str]:
    st = exact_state()
    save(path, st)
    fails = [f"whole: {d}" for d in _diff(exact_state(), load(path))]
    fails += [f"like: {d}" for d in _diff(exact_state(), load(path, like=exact_state()))]
    return fails


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", worlds("sim-1", "sim-2", "sim-4", "mpi"), indirect=True)
def test_round_trip_is_exact(world: World, shared_tmp_path: str) -> None:
    out = world.run(_body_exact, os.path.join(shared_tmp_path, "ck", "step-1"))
    assert out == [[]] * world.size, out


def test_layout_of_lists_none_and_strings(tmp_path) -> None:
    """What a plain h5py reader sees for each kind of value."""
    path = str(tmp_path / "step-1")
    save(path, exact_state())
    with h5py.File(os.path.join(path, "data.h5"), "r") as f:
        for name, dtype, kind in (("floats", "<f8", "list"), ("ints", "<i8", "list"),
                                  ("bools", "|b1", "list"), ("tuple_f", "<f8", "tuple"),
                                  ("params/groups/0/params", "<i8", "list")):
            d = f[name]
            assert isinstance(d, h5py.Dataset) and d.ndim == 1 and d.dtype == np.dtype(dtype), name
            assert d.attrs["hpcdp_type"] == kind, name
        assert f["floats"][...].tolist()[:4] == [0.1, -0.0, float("inf"), -float("inf")]
        assert math.isnan(f["floats"][4])
        assert f["bools"][...].tolist() == [True, False, True]
        # mixed, nested and empty lists are groups of members "0", "1", ... marked list or tuple
        for name, kind in (("int_and_bool", "list"), ("huge_int", "list"), ("nested", "list"),
                           ("empty_t", "tuple"), ("strings", "list")):
            assert isinstance(f[name], h5py.Group) and f[name].attrs["hpcdp_type"] == kind, name
        flag = f["int_and_bool"].attrs["1"]
        assert isinstance(flag, np.bool_) and bool(flag), repr(flag)
        assert isinstance(f["nested/0"], h5py.Dataset) and isinstance(f["nested/2"], h5py.Group)
        assert "hpcdp_type" not in f.attrs and "hpcdp_type" not in f["params"].attrs  # dicts: none
        # None: an empty attribute, never the string 'None'; the string 'None' stays a string
        assert isinstance(f.attrs["none"], h5py.Empty)
        assert isinstance(f["nones"].attrs["0"], h5py.Empty)
        assert f.attrs["none_str"] == "None" and f["strings"].attrs["1"] == "None"
        for name in ("unicode", "none_str", "empty_str"):
            t = f.attrs.get_id(name).get_type()
            assert t.is_variable_str() and t.get_cset() == h5py.h5t.CSET_UTF8, name
        assert f.attrs["unicode"] == "\u00e9\u4e2d\U0001f600"
        # the manifest: one UTF-8 JSON string, checksummed
        m = f["_hpcdp_manifest"]
        assert m.shape == () and m.id.get_type().get_cset() == h5py.h5t.CSET_UTF8
        text = m.asstr()[()]
        assert isinstance(text, str) and json.loads(text)["format_version"] == FORMAT_VERSION
        import zlib

        assert zlib.crc32(text.encode()) == int(m.attrs["crc32"])


def _body_lists_differ(rank: int, path: str, longer: bool) -> str:
    loss = [1.0, 2.0] + [3.0] * rank if longer else [1.0, 2.0 + rank]
    try:
        save(path, {"loss": loss, "w": np.zeros(3)})
    except hpcdp.CheckpointError as exc:
        return str(exc)
    return ""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", worlds("sim-2", "mpi"), indirect=True)
@pytest.mark.parametrize("longer", [False, True], ids=["values", "length"])
def test_ranks_must_save_the_same_lists(world: World, longer: bool, shared_tmp_path: str) -> None:
    """A list stored as a dataset is still checked like a scalar: every rank the same values."""
    msgs = world.run(_body_lists_differ, os.path.join(shared_tmp_path, "ck", "step-1"), longer)
    assert all(msgs) and len(set(msgs)) == 1, msgs
    why = "a list of 2 floats on rank 0, a list of 3 floats" if longer else \
        "a list of 2 floats on rank 0, a list of 2 floats of other values"
    assert "state['loss']" in msgs[0] and why in msgs[0], msgs[0]
    assert not os.path.exists(os.path.join(shared_tmp_path, "ck", "step-1"))


# -- format 1 (written by hpcdp before format 2) still loads ---------------------------------
def v1_state(rank: int, n: int) -> dict:
    """The state the files under data/ were saved from (data/README.md), on rank ``rank`` of ``n``."""
    rows = np.arange(18, dtype=np.int32).reshape(6, 3)
    lo, hi = rank * 6 // n, (rank + 1) * 6 // n
    return {
        "model": {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.array([0.5, -1.0])},
        "rows": Shard(rows[lo:hi], (6, 3), (lo, 0)),
        "loss": [0.5, 0.25, 0.125],
        "betas": (0.9, 0.999),
        "params": [0, 1, 2],
        "flags": [True, False],
        "mixed": [1, "a", None, 2.5, [1, 2]],
        "empty": [],
        "step": 7,
        "best": None,
        "name": "None",
        "note": "h\u00e9llo",
        "big_int": 2**70,
        "c": 1 + 2j,
        "np_f32": np.float32(1.5),
        3: {"x": 1},
    }


def _body_load_v1(rank: int, path: str) -> list[str]:
    n = hpcdp.world_size()
    want = dict(v1_state(0, 1), rows=np.arange(18, dtype=np.int32).reshape(6, 3))
    fails = [f"whole: {d}" for d in _diff(want, load(path))]
    fails += [f"like: {d}" for d in _diff(v1_state(rank, n), load(path, like=v1_state(rank, n)))]
    return fails


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("name", ["v1-vds-2", "v1-mpio-2", "v2-vds-2", "v2-mpio-2", "v3-mpio-2"])
def test_older_format_checkpoints_still_load(name: str, n: int, tmp_path) -> None:
    """Files of formats 1, 2 and 3 (data/README.md) load with the current code."""
    path = str(tmp_path / "ck" / name)
    shutil.copytree(os.path.join(DATA_DIR, name), path)
    with h5py.File(os.path.join(path, "data.h5"), "r") as f:    # it really is the old layout
        if name.startswith("v1"):
            assert f["_hpcdp_manifest"].dtype == np.uint8 and f.attrs["best"] == "None"
            assert isinstance(f["loss"], h5py.Group)
            assert json.loads(f["_hpcdp_manifest"][...].tobytes())["format_version"] == 1
        elif name.startswith("v2"):   # format 2: CRC32C slab checksums under "crc32"
            m = json.loads(f["_hpcdp_manifest"].asstr()[()])
            assert m["format_version"] == 2 and m["checksum"] == "crc32c"
            assert all("crc32" in s and "checksum" not in s
                       for d in m["datasets"].values() for s in d["slabs"])
        else:   # format 3: plain XXH3-64 of each slab under "checksum"
            m = json.loads(f["_hpcdp_manifest"].asstr()[()])
            assert m["format_version"] == 3 and m["checksum"] == "xxh3_64"
            assert all("checksum" in s and "crc32" not in s
                       for d in m["datasets"].values() for s in d["slabs"])
    out = run_ranks("sim", n, _body_load_v1, path)
    assert out == [[]] * n, out


def test_older_format_fixtures_stay_small() -> None:
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(DATA_DIR) for f in fs)
    assert total < 100 << 10, total


def test_like_against_a_stored_list(tmp_path) -> None:
    """``like`` meets a stored list as it meets a list kept as a group: same length, scalars."""
    path = str(tmp_path / "step-1")
    save(path, {"loss": [1.0, 2.0]})
    assert load(path, like={"loss": [0.0, 0.0]}) == {"loss": [1.0, 2.0]}
    assert load(path, like={"loss": (0.0, 0.0)}) == {"loss": (1.0, 2.0)}   # like's container
    for like, why in (({"loss": [0.0]}, "is a list of 2 in the checkpoint, like has a list of 1"),
                      ({"loss": np.zeros(2)}, "is a list in the checkpoint, an array in like"),
                      ({"loss": [np.zeros(1), 0.0]}, "['loss'][0] is a scalar in the checkpoint"),
                      ({"loss": 1.0}, "is a list in the checkpoint, a scalar in like")):
        with pytest.raises(hpcdp.CheckpointError) as info:
            load(path, like=like)
        assert why in str(info.value), str(info.value)

"""Checkpoint test bodies (module level, so every backend and mpirun can run them)."""
from __future__ import annotations

import json
import os
import zlib
from typing import Any, Callable

import h5py
import numpy as np
import pytest

import hpcdp
from hpcdp.testing import shared_dir  # noqa: F401 - the MPI-safe temporary directory, used by the tests
from hpcdp.checkpoint import Shard, latest, load, save
from hpcdp.checkpoint._format import BF16_META, FORMAT, MANIFEST, type_note
from hpcdp.checkpoint._plan import row_bounds

DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "float16", "float32", "float64", "complex64", "complex128", ">f8"]
BF16 = np.dtype("<u2", metadata=dict(BF16_META))
SH_ROWS = (37, 11)   # sharded by uneven rows
SH_COLS = (6, 10)    # sharded by uneven columns
SH_SLASH = (9, 4)    # sharded by uneven rows, under a key with "/" (always a virtual dataset in VDS)


def _arr(dtype: str, shape: tuple, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, shape, dtype=dt, endpoint=True)
    if dt.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dt)
    return rng.standard_normal(shape).astype(dt)


def uneven(total: int, n: int, rank: int) -> tuple[int, int]:
    """An uneven split: rank r gets about (r+1) parts, the last rank takes the rest."""
    weights = list(range(1, n + 1))
    edges = [0]
    for w in weights:
        edges.append(min(total, edges[-1] + max(1, total * w // sum(weights))))
    edges[-1] = total
    return edges[rank], edges[rank + 1]


def global_arrays() -> dict[str, np.ndarray]:
    return {"rows": _arr("int32", SH_ROWS, 1), "cols": _arr("float64", SH_COLS, 2),
            "enc/w": _arr("float32", SH_SLASH, 3)}


def make_state(rank: int, n: int, *, shards: str = "uneven") -> dict:
    """The same replicated content on every rank, and this rank's blocks of the sharded arrays."""
    g = global_arrays()
    if shards == "uneven":
        lo, hi = uneven(SH_ROWS[0], n, rank)
        clo, chi = uneven(SH_COLS[1], n, n - 1 - rank)
        slo, shi = uneven(SH_SLASH[0], n, rank)
    else:
        lo, hi = row_bounds(SH_ROWS[0], n)[rank]
        clo, chi = row_bounds(SH_COLS[1], n)[rank]
        slo, shi = row_bounds(SH_SLASH[0], n)[rank]
    return {
        "arrays": {dt.replace(">", "be_"): _arr(dt, (3, 5), k) for k, dt in enumerate(DTYPES)},
        "bf16": _arr("uint16", (4, 4), 99).view(BF16),
        "big": _arr("float32", (600, 512), 7),          # > 1 MiB: split across ranks
        "scalar0d": np.array(2.5),
        "empty": np.zeros((0, 4), np.float32),
        "sharded": {"rows": Shard(g["rows"][lo:hi], SH_ROWS, (lo, 0)),
                    "cols": Shard(g["cols"][:, clo:chi], SH_COLS, (0, clo)),
                    "enc/w": Shard(g["enc/w"][slo:shi], SH_SLASH, (slo, 0))},
        "scalars": {"i": 7, "big_int": 2**70, "f": 0.1, "b": True, "s": "héllo/wörld", "none": None,
                    "c": 1 + 2j, "np_f32": np.float32(1.5), "np_i64": np.int64(-3),
                    "nan": float("inf")},
        "opt": {"state": {0: {"step": 3, "m": _arr("float32", (5,), 11)}, 1: {"step": 3}},
                "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "params": [0, 1]}]},
        "odd/key": {"": 1, ".": 2, "%": 3, "w/b%": _arr("int16", (2, 3), 12)},
    }


def _eq(a: Any, b: Any, where: str, fails: list[str]) -> None:
    if isinstance(a, dict):
        if not isinstance(b, dict) or list(map(str, a)) != list(map(str, b)):
            fails.append(f"{where}: keys {list(a)} vs {list(b) if isinstance(b, dict) else type(b)}")
            return
        for (k, v), (k2, v2) in zip(a.items(), b.items()):
            if k != k2 and str(k) != str(k2):
                fails.append(f"{where}: key {k!r} vs {k2!r}")
            _eq(v, v2, f"{where}[{k!r}]", fails)
    elif isinstance(a, (list, tuple)):
        if type(a) is not type(b) and not isinstance(b, np.ndarray) or len(a) != len(b):
            fails.append(f"{where}: {a!r} vs {b!r}")
            return
        for i, (x, y) in enumerate(zip(a, b)):
            _eq(x, y, f"{where}[{i}]", fails)
    elif isinstance(a, Shard):
        if not isinstance(b, Shard) or a.offsets != b.offsets or a.global_shape != b.global_shape:
            fails.append(f"{where}: shard {b!r}")
            return
        _eq(a.local, b.local, where + ".local", fails)
    elif isinstance(a, np.ndarray):
        # dtype != ignores numpy dtype metadata, which is where bfloat16 lives without ml_dtypes
        if not isinstance(b, np.ndarray) or a.shape != b.shape or a.dtype != b.dtype \
                or type_note(a.dtype) != type_note(b.dtype) or a.tobytes() != b.tobytes():
            fails.append(f"{where}: {a.dtype}{a.shape} (type {type_note(a.dtype) or '-'}) != "
                         f"{getattr(b, 'dtype', type(b))}{getattr(b, 'shape', '')}"
                         f" (type {type_note(b.dtype) if isinstance(b, np.ndarray) else '-'})")
    else:
        if type(a) is not type(b) or a != b:
            fails.append(f"{where}: {a!r} ({type(a).__name__}) != {b!r} ({type(b).__name__})")


def expected_full(n_saved: int) -> dict:
    """What ``load(path)`` without ``like`` gives: shards at their global shape, str keys kept."""
    st = make_state(0, n_saved)
    st["sharded"] = global_arrays()
    return st


def body_save(rank: int, path: str, mode: str | None = None, shards: str = "uneven",
              keep_last: int | None = None) -> str:
    n = hpcdp.world_size()
    return save(path, make_state(rank, n, shards=shards), mode=mode, keep_last=keep_last)


def body_load_check(rank: int, path: str, n_saved: int, group: Any = None) -> list[str]:
    """Load with and without ``like`` (this group's own even layout) and compare."""
    g = group or hpcdp.get_default_group()
    n, r = g.size, g.rank
    fails: list[str] = []
    full = load(path, group=g)
    _eq(expected_full(n_saved), full, "full", fails)
    like = make_state(r, n, shards="even")
    # mutate like so a load that just returned it would be caught
    like["sharded"]["rows"].local[...] = -1
    got = load(path, like=like, group=g)
    want = make_state(r, n, shards="even")
    _eq(want, got, "like", fails)
    for name, st in (("full", full), ("like", got)):
        if type_note(st["bf16"].dtype) != "bfloat16":
            fails.append(f"{name}: bf16 came back as {st['bf16'].dtype!r}, without its bfloat16 note")
    if not np.all(like["sharded"]["rows"].local == -1):
        fails.append("load modified like")
    if r == 0:
        with h5py.File(os.path.join(path, "data.h5"), "r") as f:  # plain h5py, global view
            if not np.array_equal(f["sharded/rows"][...], global_arrays()["rows"]):
                fails.append("plain h5py: sharded/rows differs")
            if not np.array_equal(f["sharded/enc%2Fw"][...], global_arrays()["enc/w"]):
                fails.append("plain h5py: sharded/enc%2Fw differs")
            if not np.array_equal(f["big"][...], make_state(0, 1)["big"]):
                fails.append("plain h5py: big differs")
            if f["bf16"].attrs.get("hpcdp_type") != "bfloat16" or f["bf16"].dtype != np.uint16:
                fails.append("bf16 note missing")
            if f["scalars"].attrs["s"] != "héllo/wörld" or f["scalars"].attrs["i"] != 7:
                fails.append("scalar attributes missing")
    return fails


def body_roundtrip(rank: int, path: str, mode: str | None = None) -> list[str]:
    body_save(rank, path, mode)
    fails = body_load_check(rank, path, hpcdp.world_size())
    if latest(os.path.dirname(path)) != os.path.abspath(path):
        fails.append(f"latest is {latest(os.path.dirname(path))}")
    return fails


def body_reshard_subgroups(rank: int, path: str, mode: str | None = None) -> list[str]:
    """Save on the whole world, then load on sub-groups of every size 1..n."""
    n = hpcdp.world_size()
    body_save(rank, path, mode)
    fails: list[str] = []
    for k in range(1, n + 1):
        sub = hpcdp.new_group(list(range(k)))
        if rank < k:
            fails += [f"k={k}: {f}" for f in body_load_check(rank, path, n, group=sub)]
    hpcdp.barrier()
    return fails


def body_load_error(rank: int, path: str, like_state: bool = False) -> str:
    """The CheckpointError message this rank got ('' if none)."""
    like = make_state(rank, hpcdp.world_size(), shards="even") if like_state else None
    try:
        load(path, like=like)
    except hpcdp.CheckpointError as exc:
        return str(exc)
    return ""


def body_async(rank: int, path: str) -> list[str]:
    n = hpcdp.world_size()
    st = make_state(rank, n)
    want = make_state(rank, n)
    h = save(path, st, async_save=True)
    # training goes on: mutate the arrays and run collectives while the write runs
    st["big"][...] = -7
    st["sharded"]["rows"].local[...] = -7
    for _ in range(20):
        hpcdp.allreduce(np.ones(1000))
    fails: list[str] = []
    if h.wait(timeout=120) != os.path.abspath(path):
        fails.append("wait() returned another path")
    _eq(want, load(path, like=make_state(rank, n)), "async", fails)
    h2 = save(path + "-b", want, async_save=True)   # a second one, collected by load's wait
    _eq(want, load(path + "-b", like=make_state(rank, n)), "async2", fails)
    h2.wait()
    return fails


# -- forging checkpoints: the tests of untrusted input (test_checkpoint_untrusted/_manifest) -----
#: Python's own exception names: a validation error must say what is wrong, not leak one of these
RAW_ERRORS = ("AttributeError", "KeyError", "TypeError", "IndexError", "RecursionError",
              "MemoryError", "ValueError")


def crc(data: Any) -> int:
    return zlib.crc32(np.ascontiguousarray(data).tobytes())


def slab(offsets: list[int], shape: list[int], data: Any, rank: int = 0) -> dict:
    return {"rank": rank, "offsets": offsets, "shape": shape, "crc32": crc(data)}


def meta(shape: list[int], dtype: str, slabs: list[dict], *, type_: str | None = None,
         kind: str = "replicated", mode: str = "owned") -> dict:
    return {"shape": shape, "dtype": dtype, "type": type_ or dtype, "kind": kind, "mode": mode,
            "slabs": slabs}


def tree(*names: str) -> dict:
    return {"t": "dict", "items": [{"k": n, "kt": "str", "h": n, "v": {"t": "array", "path": n}}
                                   for n in names]}


def manifest(datasets: dict, tree_: dict, *, files: list[str] = (), mode: str = "vds",
             world_size: int = 1) -> dict:
    return {"format": FORMAT, "format_version": 1, "hpcdp_version": "0", "world_size": world_size,
            "mode": mode, "checksum": "crc32", "created_unix": None, "tree": tree_,
            "datasets": datasets, "files": list(files)}


class RawJSON(str):
    """Manifest text given as is (json.dumps cannot write what json.loads must survive)."""


def write_manifest(f: h5py.File, m: Any) -> None:
    """``m`` as the manifest dataset, with a CRC that matches (any JSON value, on purpose)."""
    raw = (m if isinstance(m, RawJSON) else json.dumps(m)).encode()
    d = f.create_dataset(MANIFEST, data=np.frombuffer(raw, np.uint8))
    d.attrs["crc32"] = np.uint32(zlib.crc32(raw))


def forge(path: str, build: Callable[[h5py.File], None], m: Any) -> str:
    """A checkpoint directory ``path`` whose data.h5 ``build`` fills, with manifest ``m``."""
    os.makedirs(path, exist_ok=True)
    with h5py.File(os.path.join(path, "data.h5"), "w") as f:
        f.attrs["hpcdp_format"] = FORMAT
        build(f)
        write_manifest(f, m)
    return path


def load_error(path: str, like: Any = None) -> str:
    """The CheckpointError loading ``path`` must raise (its directory masked), free of Python's
    own exception names."""
    with pytest.raises(hpcdp.CheckpointError) as info:
        got = load(path, like=like)
        print("loaded:", got)                          # shows what leaked when the test fails
    # the test's own directory name (it holds words like "manifest") is no evidence either way
    msg = str(info.value).replace(os.path.abspath(path), "<ck>")
    assert not any(e in msg for e in RAW_ERRORS), msg
    return msg


DATA = np.arange(16, dtype=np.uint8)


def plain_w(f: h5py.File, data: Any = DATA) -> None:
    f.create_dataset("w", data=data)


def good_manifest() -> dict:
    return manifest({"w": meta([16], "|u1", [slab([0], [16], DATA)])}, tree("w"))


def _zeroed(x: Any) -> Any:
    """``x`` with every array replaced by a zero-filled one of its shape and dtype (a fresh
    model to load into) and every scalar by a different value."""
    if isinstance(x, dict):
        return {k: _zeroed(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_zeroed(v) for v in x]
    if isinstance(x, tuple):
        return tuple(_zeroed(v) for v in x)
    if isinstance(x, Shard):
        return Shard(_zeroed(x.local), x.global_shape, x.offsets)
    if isinstance(x, np.ndarray):
        return np.zeros(x.shape, x.dtype)
    return "not loaded"


def _arrays_of(x: Any) -> list[np.ndarray]:
    if isinstance(x, dict):
        return [a for v in x.values() for a in _arrays_of(v)]
    if isinstance(x, (list, tuple)):
        return [a for v in x for a in _arrays_of(v)]
    if isinstance(x, Shard):
        return [x.local]
    return [x] if isinstance(x, np.ndarray) else []


def body_load_out(rank: int, path: str) -> list[str]:
    """``load(out=)``: saved with uneven shards, loaded into this world's even layout in place
    (every array keeps its identity, the dicts get the scalars); a shape that does not match,
    found in the last array checked, leaves every array of ``out`` untouched on every rank; a
    read-only array in ``out`` is refused on every rank; ``like=`` with ``out=`` is a TypeError."""
    n = hpcdp.world_size()
    body_save(rank, path)
    fails: list[str] = []
    want = make_state(rank, n, shards="even")
    out = _zeroed(want)
    before = _arrays_of(out)
    got = load(path, out=out)
    if got is not out:
        fails.append("load(out=) did not return out")
    after = _arrays_of(out)
    if len(before) != len(after) or any(a is not b for a, b in zip(before, after)):
        fails.append("load(out=) replaced arrays instead of filling them")
    _eq(want, out, "out", fails)
    # a mismatch in the last leaf checked: nothing may have been written before it was found
    bad = _zeroed(want)
    bad["odd/key"]["w/b%"] = np.zeros((3, 3), np.int16)  # saved (2, 3)
    try:
        load(path, out=bad)
        fails.append("a wrong shape in out= loaded")
    except hpcdp.CheckpointError as exc:
        if "w/b%" not in str(exc) and "shape" not in str(exc):
            fails.append(f"wrong shape: {exc}")
    if any(np.any(a != 0) for a in _arrays_of(bad)):
        fails.append("a load that failed its checks wrote into out")
    ro = _zeroed(want)
    if rank == n - 1:  # on one rank only: every rank must still raise
        ro["big"].flags.writeable = False
    try:
        load(path, out=ro)
        fails.append("a read-only array in out= was accepted")
    except hpcdp.CheckpointError as exc:
        if rank == n - 1 and "read-only" not in str(exc):
            fails.append(f"read-only: {exc}")
    try:
        load(path, like=want, out=_zeroed(want))
        fails.append("like= and out= together were accepted")
    except TypeError:
        pass
    return fails

"""Loading a checkpoint someone sent you (issue 9, items 4-6; item 7 in test_checkpoint_manifest;
issue 25 item 7: the format-2 encodings, lists as datasets and the manifest as text).

Every test forges ``data.h5`` (and rank files) with plain h5py, with a manifest whose CRC is right,
so that the only thing between the forged file and the caller is hpcdp's validation:
- 4: no byte comes from outside the checkpoint directory (external storage, virtual sources, links);
- 5: slabs tile every dataset exactly, so checksums always cover every byte; numbers and bool only;
- 6: a dataset's stored bytes back its declared shape before anything is allocated, and a rank
  reads (and holds) only what it needs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import zlib
from typing import Any, Callable

import h5py
import numpy as np
import pytest

import hpcdp
from ckpt_bodies import (
    DATA, RAW_ERRORS, forge, good_manifest, load_error, manifest, meta, plain_w, slab, tree,
)
from hpcdp.testing import run_ranks
from hpcdp.testing.fixtures import World, worlds
from hpcdp.checkpoint import Shard, load, save
from hpcdp.checkpoint._format import FORMAT, FORMAT_VERSION, MANIFEST

SECRET = bytes(range(48, 80)) * 2          # what an attacker wants to read (64 bytes)
N = len(SECRET)


def _secret_files(tmp: str) -> tuple[str, str]:
    """The secret as a raw file and inside an HDF5 file, both outside any checkpoint."""
    raw = os.path.join(tmp, "secret.bin")
    with open(raw, "wb") as fh:
        fh.write(SECRET)
    h5 = os.path.join(tmp, "foreign.h5")
    with h5py.File(h5, "w") as f:
        f["x"] = np.frombuffer(SECRET, np.uint8)
    return raw, h5


SECRET_META = {"w": meta([N], "|u1", [slab([0], [N], np.frombuffer(SECRET, np.uint8))])}


def _vds(f: h5py.File, file_name: str, dset: str = "x") -> None:
    layout = h5py.VirtualLayout(shape=(N,), dtype=np.uint8)
    layout[:] = h5py.VirtualSource(file_name, dset, shape=(N,), dtype=np.uint8)
    f.create_virtual_dataset("w", layout)


def _rank_file(path: str, name: str, build: Callable[[h5py.File], None]) -> None:
    os.makedirs(os.path.dirname(os.path.join(path, name)), exist_ok=True)
    with h5py.File(os.path.join(path, name), "w") as g:
        build(g)


# -- 4: nothing is read from outside the checkpoint directory -----------------------------------
def _attack(kind: str, tmp: str) -> tuple[str, str]:
    """(checkpoint path, what the error must mention) for one way of pointing outside."""
    raw, h5 = _secret_files(tmp)
    ck = os.path.join(tmp, "ck", "step-1")
    files: list[str] = []
    if kind == "external-absolute":
        build, why = (lambda f: f.create_dataset("w", (N,), np.uint8, external=[(raw, 0, N)])), "external"
    elif kind == "external-relative":
        build, why = (lambda f: f.create_dataset("w", (N,), np.uint8,
                                                 external=[("../secret.bin", 0, N)])), "external"
    elif kind == "vds-absolute":
        build, why = (lambda f: _vds(f, h5)), "foreign.h5"
    elif kind == "vds-dotdot":
        build, why = (lambda f: _vds(f, "../../foreign.h5")), "foreign.h5"
    elif kind == "vds-subdir":
        _rank_file(ck, "sub/rank-00000.h5",
                   lambda g: g.create_dataset("w", data=np.frombuffer(SECRET, np.uint8)))
        build, why, files = (lambda f: _vds(f, "sub/rank-00000.h5", "w")), "sub/rank-00000.h5", []
    elif kind == "vds-unlisted-rank-file":
        # not in the manifest's files: HDF5 would look for it in the working directory too
        build, why = (lambda f: _vds(f, "rank-00003.h5", "w")), "rank-00003.h5"
    elif kind == "vds-nested-external":
        # the rank file is ours by name, but its dataset keeps its bytes in the secret file
        _rank_file(ck, "rank-00000.h5",
                   lambda g: g.create_dataset("w", (N,), np.uint8, external=[(raw, 0, N)]))
        build, why, files = (lambda f: _vds(f, "rank-00000.h5", "w")), "external", ["rank-00000.h5"]
    elif kind == "external-link":
        build, why = (lambda f: f.__setitem__("w", h5py.ExternalLink(h5, "x"))), "link"
    elif kind == "vds-rank-file-link":
        # the rank file's dataset is an external link to the foreign file
        _rank_file(ck, "rank-00000.h5", lambda g: g.__setitem__("w", h5py.ExternalLink(h5, "x")))
        build, why, files = (lambda f: _vds(f, "rank-00000.h5", "w")), "link", ["rank-00000.h5"]
    else:
        raise AssertionError(kind)
    forge(ck, build, manifest(SECRET_META, tree("w"), files=files))
    return ck, why


ATTACKS = ["external-absolute", "external-relative", "vds-absolute", "vds-dotdot", "vds-subdir",
           "vds-unlisted-rank-file", "vds-nested-external", "external-link", "vds-rank-file-link"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("with_like", [False, True])
@pytest.mark.parametrize("kind", ATTACKS)
def test_no_bytes_from_outside_the_checkpoint(kind: str, with_like: bool, tmp_path,
                                              monkeypatch) -> None:
    ck, why = _attack(kind, str(tmp_path))
    # a copy of the secret where HDF5 would look for a missing virtual source: the working directory
    work = tmp_path / "cwd"
    work.mkdir()
    with h5py.File(work / "rank-00003.h5", "w") as g:
        g["w"] = np.frombuffer(SECRET, np.uint8)
    monkeypatch.chdir(work)
    msg = load_error(ck, {"w": np.zeros(N, np.uint8)} if with_like else None)
    assert "'w'" in msg and why in msg, msg
    assert "data.h5" in msg, msg


_LOAD_SCRIPT = textwrap.dedent("""
    import sys
    import hpcdp
    from hpcdp.checkpoint import latest, load
    try:
        load(sys.argv[1])
        print("LOADED")
    except hpcdp.CheckpointError as exc:
        print("ERROR", exc)
    print("LATEST", latest(sys.argv[2]))
""")


@pytest.mark.timeout(120)
def test_a_linked_manifest_is_never_followed(tmp_path) -> None:
    """An external link is refused before HDF5 opens what it names: here a FIFO, whose opening
    would block for ever (so the load runs in a process with a hard cap)."""
    fifo = str(tmp_path / "pipe")
    os.mkfifo(fifo)
    ck = str(tmp_path / "ck" / "step-1")
    os.makedirs(ck)
    with h5py.File(os.path.join(ck, "data.h5"), "w") as f:
        f.attrs["hpcdp_format"] = FORMAT
        f[MANIFEST] = h5py.ExternalLink(fifo, "/m")
    out = subprocess.run([sys.executable, "-c", _LOAD_SCRIPT, ck, os.path.dirname(ck)],
                         capture_output=True, text=True, timeout=60, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ERROR" in out.stdout and "external link" in out.stdout, out.stdout
    assert "LATEST None" in out.stdout, out.stdout


@pytest.mark.timeout(60)
def test_own_vds_checkpoint_still_loads_from_another_cwd(tmp_path, monkeypatch) -> None:
    """The legitimate case next to the attacks: rank files mapped by relative name."""
    from ckpt_bodies import body_load_check, body_save

    path = str(tmp_path / "ck" / "step-1")
    run_ranks("sim", 3, body_save, path, "vds")
    assert any(n.startswith("rank-") for n in os.listdir(path))
    monkeypatch.chdir(tmp_path)
    assert run_ranks("sim", 2, body_load_check, path, 3) == [[], []]


# -- 5: slabs tile each dataset; numbers and bool only -------------------------------------------
TILING = {
    "no-slabs": ([], "cover 0 of 16"),
    "half": ([slab([0], [8], DATA[:8])], "cover 8 of 16"),
    "overlap-and-hole": ([slab([0], [8], DATA[:8]), slab([4], [8], DATA[4:12], rank=1)], "overlap"),
    "outside": ([slab([0], [16], DATA), slab([16], [4], DATA[:4], rank=1)], "outside"),
    "empty-slab": ([slab([0], [16], DATA), slab([3], [0], DATA[:0], rank=1)], "empty"),
    "same-rank-twice": ([slab([0], [8], DATA[:8]), slab([8], [8], DATA[8:])], "rank 0"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(TILING))
def test_slabs_must_tile_each_dataset(case: str, tmp_path) -> None:
    slabs, why = TILING[case]
    bad = DATA.copy()
    bad[12] ^= 0xFF                                    # a byte no slab (or two slabs) vouches for
    ck = forge(str(tmp_path / "step-1"), lambda f: plain_w(f, bad),
               manifest({"w": meta([16], "|u1", slabs)}, tree("w"), world_size=2))
    msg = load_error(ck)
    assert "'w'" in msg and why in msg and "slab" in msg, msg


def test_slabs_of_a_scalar_and_an_empty_array(tmp_path) -> None:
    """0-d arrays have one slab of shape (); empty arrays none: both load, both are checked."""
    zero = np.array(2.5)
    ds = {"s": meta([], "<f8", [slab([], [], zero)]), "e": meta([0, 4], "<f4", [])}

    def build(f: h5py.File) -> None:
        f["s"] = zero
        f.create_dataset("e", shape=(0, 4), dtype=np.float32)

    ck = forge(str(tmp_path / "ok"), build, manifest(ds, tree("s", "e")))
    got = load(ck)
    assert got["s"] == 2.5 and got["e"].shape == (0, 4)
    ds["s"]["slabs"] = []
    ck = forge(str(tmp_path / "bad"), build, manifest(ds, tree("s", "e")))
    assert "cover 0 of 1" in load_error(ck)


DTYPES = {
    "vlen-str": (lambda f: f.create_dataset("w", data=np.array(["a", "bc"], dtype=object),
                                             dtype=h5py.string_dtype()), "|O", None),
    "vlen-bytes": (lambda f: f.create_dataset("w", data=np.array([b"a", b"bc"], dtype=object),
                                               dtype=h5py.string_dtype("ascii")), "|O", None),
    "fixed-bytes": (lambda f: f.create_dataset("w", data=np.array([b"ab", b"cd"])), "|S2", None),
    "compound": (lambda f: f.create_dataset("w", data=np.zeros(2, "i4,f4")), "|V8", None),
    "bf16-not-u2": (lambda f: f.create_dataset("w", data=np.zeros(2, np.float32)), "<f4", "bfloat16"),
    "type-differs": (lambda f: f.create_dataset("w", data=np.zeros(2, np.float32)), "<f4", "<f8"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(DTYPES))
def test_only_numbers_and_bool(case: str, tmp_path) -> None:
    build, dtype, type_ = DTYPES[case]
    ck = forge(str(tmp_path / "step-1"), build,
               manifest({"w": meta([2], dtype, [], type_=type_)}, tree("w")))
    msg = load_error(ck)
    assert "'w'" in msg and ("dtype" in msg or "type" in msg), msg


def test_forged_bfloat16_and_bool_load(tmp_path) -> None:
    """What the format documents is accepted: bfloat16 as uint16 bits with its type, and bool."""
    bits = np.arange(6, dtype=np.uint16)
    flags = np.array([True, False, True])
    ds = {"h": meta([6], "<u2", [slab([0], [6], bits)], type_="bfloat16"),
          "b": meta([3], "|b1", [slab([0], [3], flags)])}
    ck = forge(str(tmp_path / "step-1"), lambda f: (f.__setitem__("h", bits), f.__setitem__("b", flags)),
               manifest(ds, tree("h", "b")))
    got = load(ck)
    assert got["h"].view(np.uint16).tolist() == bits.tolist() and got["h"].dtype.itemsize == 2
    assert got["b"].dtype == bool and got["b"].tolist() == flags.tolist()


# -- 6: stored size before allocating; read only what a rank needs -------------------------------
_ALLOC_SCRIPT = textwrap.dedent("""
    import os, resource, sys, tracemalloc
    import hpcdp
    from hpcdp.checkpoint import load
    # No more than 1 GiB beyond what is mapped now: allocating the declared 2 GiB fails outright.
    with open("/proc/self/status") as fh:
        vm = next(int(l.split()[1]) * 1024 for l in fh if l.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.RLIM_INFINITY))
    tracemalloc.start()
    try:
        load(sys.argv[1])
        print("LOADED")
    except hpcdp.CheckpointError as exc:
        print("ERROR", exc)
    print("PEAK", tracemalloc.get_traced_memory()[1])
""")

BIG = 2 << 30                                          # 2 GiB declared


def _big_chunked(f: h5py.File) -> None:
    f.create_dataset("w", shape=(BIG,), dtype=np.uint8, chunks=(1 << 20,))   # no chunk written


def _big_contiguous(f: h5py.File) -> None:
    f.create_dataset("w", shape=(BIG,), dtype=np.uint8)                       # never allocated


def _big_partly_written(f: h5py.File) -> None:
    d = f.create_dataset("w", shape=(1 << 24,), dtype=np.uint8, chunks=(1 << 16,))
    d[: 1 << 16] = 1                                   # one chunk of 256


@pytest.mark.timeout(120)
@pytest.mark.parametrize("build,size,why", [(_big_chunked, BIG, "chunk"),
                                            (_big_contiguous, BIG, "stores 0"),
                                            (_big_partly_written, 1 << 24, "1 of its 256 chunks")],
                         ids=["chunked-empty", "contiguous-unallocated", "chunked-partial"])
def test_declared_size_needs_stored_bytes(build, size: int, why: str, tmp_path) -> None:
    ck = forge(str(tmp_path / "step-1"), build,
               manifest({"w": meta([size], "|u1", [{"rank": 0, "offsets": [0], "shape": [size],
                                                     "crc32": 0}])}, tree("w")))
    assert os.path.getsize(os.path.join(ck, "data.h5")) < (1 << 20) or size < BIG
    out = subprocess.run([sys.executable, "-c", _ALLOC_SCRIPT, ck], capture_output=True, text=True,
                         timeout=100, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    msg = lines.get("ERROR", "").replace(ck, "<ck>")
    assert msg and "'w'" in msg and why in msg, out.stdout
    assert not any(e in msg for e in RAW_ERRORS), msg
    assert int(lines["PEAK"]) < (64 << 20), out.stdout     # refused before allocating


def test_compressed_data_is_refused(tmp_path) -> None:
    """Filters (compression) would let a tiny file expand to any size: raw data only."""
    data = np.zeros(1 << 16, np.uint8)
    ck = forge(str(tmp_path / "step-1"),
               lambda f: f.create_dataset("w", data=data, chunks=(4096,), compression="gzip"),
               manifest({"w": meta([1 << 16], "|u1", [slab([0], [1 << 16], data)])}, tree("w")))
    assert "filter" in load_error(ck)


def _body_save_two_slabs(rank: int, path: str, rows: int, cols: int) -> str:
    lo = rank * rows // 2
    local = np.arange(lo * cols, (lo + rows // 2) * cols, dtype=np.float32).reshape(rows // 2, cols)
    return save(path, {"w": Shard(local, (rows, cols), (lo, 0))})


@pytest.mark.timeout(120)
def test_a_rank_holds_only_what_it_needs(tmp_path, monkeypatch) -> None:
    """One row of an 8 MiB slab: the slab is verified in blocks, never held whole."""
    import tracemalloc

    from hpcdp.checkpoint import _reader

    rows, cols = 1024, 4096                             # two slabs of 8 MiB
    path = str(tmp_path / "step-1")
    run_ranks("sim", 2, _body_save_two_slabs, path, rows, cols)
    monkeypatch.setattr(_reader, "READ_BLOCK_BYTES", 1 << 20, raising=False)
    like = {"w": Shard(np.zeros((1, cols), np.float32), (rows, cols), (700, 0))}
    tracemalloc.start()
    try:
        got = load(path, like=like)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert np.array_equal(got["w"].local[0], np.arange(700 * cols, 701 * cols, dtype=np.float32))
    assert peak < (4 << 20), peak                       # a block (1 MiB) and the row, not the slab
    # and it still catches a flipped byte in the part of the slab it does not keep
    fn = os.path.join(path, "rank-00001.h5")
    with h5py.File(fn, "r") as f:
        off = f["w"].id.get_offset()
    with open(fn, "r+b") as fh:
        fh.seek(off + 4 * cols * (1000 - 512) + 1)     # row 1000 of the array, far from row 700
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 1]))
    assert "checksum" in load_error(path, like)


# -- every rank raises the same error -------------------------------------------------------------
def _body_load_error(rank: int, path: str) -> str:
    try:
        load(path)
    except hpcdp.CheckpointError as exc:
        return str(exc)
    return ""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", worlds("sim-3", "mpi"), indirect=True)
@pytest.mark.parametrize("case", ["vds-absolute", "tiling", "manifest"])
def test_every_rank_refuses(world: World, case: str, shared_tmp_path: str) -> None:
    ck = world.from_root(_forged_for, case, shared_tmp_path)
    msgs = world.run(_body_load_error, ck)
    assert all(msgs) and len(set(msgs)) == 1, msgs
    assert f"rank(s) {list(range(world.size))}" in msgs[0], msgs[0]   # [0, 1, 2] on sim-3
    assert not any(e in msgs[0] for e in RAW_ERRORS), msgs[0]


def _forged_for(case: str, tmp: str) -> str:
    if case == "vds-absolute":
        return _attack("vds-absolute", tmp)[0]
    if case == "tiling":
        return forge(os.path.join(tmp, "step-1"), plain_w,
                     manifest({"w": meta([16], "|u1", [])}, tree("w")))
    return forge(os.path.join(tmp, "step-1"), plain_w, [good_manifest()])



# -- format 2: lists as datasets, the manifest as text (issue 25, item 7) -------------------------
def forge_text(path: str, build: Callable[[h5py.File], None], m: Any, *,
               manifest_dtype: Any = None) -> str:
    """Like ``forge``, with the manifest as format 2 writes it: one fixed-length UTF-8 string."""
    os.makedirs(path, exist_ok=True)
    raw = json.dumps(m).encode()
    with h5py.File(os.path.join(path, "data.h5"), "w") as f:
        f.attrs["hpcdp_format"] = FORMAT
        build(f)
        dt = manifest_dtype or h5py.string_dtype("utf-8", len(raw))
        d = f.create_dataset(MANIFEST, data=np.array(raw.decode() if dt.kind == "O" else raw, dtype=dt))
        d.attrs["crc32"] = np.uint32(zlib.crc32(raw))
    return path


LOSS = np.array([0.5, 0.25, 0.125])


def seq_manifest(node: dict | None = None, d: dict | None = None, version: int = 2) -> dict:
    """A checkpoint {"loss": [0.5, 0.25, 0.125]} stored as a dataset, with ``node``/``d`` merged
    into its tree node and dataset entry."""
    m = manifest({"loss": {**meta([3], "<f8", [slab([0], [3], LOSS)]), **(d or {})}},
                 {"t": "dict", "items": [{"k": "loss", "kt": "str", "h": "loss",
                                          "v": {"t": "seq", "seq": "list", "of": "float",
                                                "path": "loss", **(node or {})}}]})
    m["format_version"] = version
    return m


def _loss(f: h5py.File) -> None:
    f["loss"] = LOSS


def test_forged_format_2_loads(tmp_path) -> None:
    """The legitimate forged case, next to the attacks below: a seq node and a text manifest."""
    got = load(forge_text(str(tmp_path / "step-1"), _loss, seq_manifest()))
    assert got == {"loss": [0.5, 0.25, 0.125]} and all(type(x) is float for x in got["loss"])
    got = load(forge_text(str(tmp_path / "step-2"), _loss, seq_manifest({"seq": "tuple"})))
    assert got == {"loss": (0.5, 0.25, 0.125)}


SEQ_CASES = {
    "of-object": ({"of": "object"}, None, "'object'"),
    "of-str": ({"of": "str"}, None, "'str'"),
    "seq-set": ({"seq": "set"}, None, "'set'"),
    "of-int-on-f8": ({"of": "int"}, None, "<i8"),
    "of-bool-on-f8": ({"of": "bool"}, None, "|b1"),
    "shard": (None, {"kind": "shard", "mode": "shard"}, "shard"),
    "no-path": ({"path": "nope"}, None, "'nope'"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(SEQ_CASES))
def test_a_stored_list_must_be_what_its_node_says(case: str, tmp_path) -> None:
    node, d, why = SEQ_CASES[case]
    msg = load_error(forge_text(str(tmp_path / "step-1"), _loss, seq_manifest(node, d)))
    assert "loss" in msg and why in msg, msg


def test_a_stored_list_is_1d_and_not_empty(tmp_path) -> None:
    two_d = seq_manifest(None, meta([3, 1], "<f8", [slab([0, 0], [3, 1], LOSS)]))
    ck = forge_text(str(tmp_path / "a"), lambda f: f.__setitem__("loss", LOSS.reshape(3, 1)), two_d)
    assert "1-D" in load_error(ck)
    empty = seq_manifest(None, meta([0], "<f8", []))
    ck = forge_text(str(tmp_path / "b"), lambda f: f.__setitem__("loss", LOSS[:0]), empty)
    assert "non-empty" in load_error(ck)


def test_a_bogus_hpcdp_type_attribute_is_only_a_label(tmp_path) -> None:
    """hpcdp loads from the checksummed manifest and datasets; the attributes are for people,
    so one that lies changes nothing (and is never evaluated)."""
    def build(f: h5py.File) -> None:
        f["loss"] = LOSS
        f["loss"].attrs["hpcdp_type"] = "__import__('os').system('false')"
        f.attrs["hpcdp_type"] = "tuple"
    got = load(forge_text(str(tmp_path / "step-1"), build, seq_manifest()))
    assert got == {"loss": [0.5, 0.25, 0.125]} and type(got["loss"]) is list


def test_a_newer_format_is_refused(tmp_path) -> None:
    newer = FORMAT_VERSION + 1
    msg = load_error(forge_text(str(tmp_path / "step-1"), _loss, seq_manifest(version=newer)))
    assert f"format version {newer}" in msg and "newer" in msg, msg


TEXT_CASES = {
    "vlen-string": (h5py.string_dtype("utf-8"), "fixed-length string"),
    "1-D-strings": (None, "fixed-length string"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(TEXT_CASES))
def test_the_manifest_text_has_one_form(case: str, tmp_path) -> None:
    dt, why = TEXT_CASES[case]
    path = str(tmp_path / "step-1")
    if case == "1-D-strings":
        raw = json.dumps(seq_manifest()).encode()
        os.makedirs(path)
        with h5py.File(os.path.join(path, "data.h5"), "w") as f:
            f.attrs["hpcdp_format"] = FORMAT
            _loss(f)
            f[MANIFEST] = np.array([raw])
            f[MANIFEST].attrs["crc32"] = np.uint32(zlib.crc32(raw))
    else:
        forge_text(path, _loss, seq_manifest(), manifest_dtype=dt)
    msg = load_error(path)
    assert why in msg, msg


def test_the_manifest_text_is_checksummed(tmp_path) -> None:
    path = forge_text(str(tmp_path / "step-1"), _loss, seq_manifest())
    fn = os.path.join(path, "data.h5")
    with h5py.File(fn, "r") as f:
        off, n = f[MANIFEST].id.get_offset(), f[MANIFEST].dtype.itemsize
    with open(fn, "r+b") as fh:                       # world_size 1 -> 2: still a valid manifest
        fh.seek(off)
        text = fh.read(n)
        i = text.index(b'"world_size": 1')
        fh.seek(off + i + len(b'"world_size": '))
        fh.write(b"2")
    assert "CRC32" in load_error(path)


def _huge_list(f: h5py.File) -> None:
    f.create_dataset("loss", shape=(10**12,), dtype="<f8")              # never allocated


def _huge_chunked_list(f: h5py.File) -> None:
    f.create_dataset("loss", shape=(10**12,), dtype="<f8", chunks=(1 << 16,))   # no chunk written


def _huge_manifest(path: str) -> None:
    """A manifest string type of 2 GiB - 1 whose bytes were never written."""
    os.makedirs(path)
    with h5py.File(os.path.join(path, "data.h5"), "w") as f:
        f.attrs["hpcdp_format"] = FORMAT
        f.create_dataset(MANIFEST, shape=(), dtype=h5py.string_dtype("utf-8", (1 << 31) - 1))
        f[MANIFEST].attrs["crc32"] = np.uint32(0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case,why", [("list", "stores 0"), ("chunked-list", "chunks"),
                                      ("manifest", "stores 0")])
def test_a_huge_claim_is_refused_before_allocating(case: str, why: str, tmp_path) -> None:
    path = str(tmp_path / "step-1")
    if case == "manifest":
        _huge_manifest(path)
    else:
        n = 10**12
        m = seq_manifest(None, meta([n], "<f8", [{"rank": 0, "offsets": [0], "shape": [n],
                                                   "crc32": 0}]))
        forge_text(path, _huge_list if case == "list" else _huge_chunked_list, m)
    assert os.path.getsize(os.path.join(path, "data.h5")) < (1 << 20)
    out = subprocess.run([sys.executable, "-c", _ALLOC_SCRIPT, path], capture_output=True,
                         text=True, timeout=100, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    msg = lines.get("ERROR", "").replace(path, "<ck>")
    assert msg and why in msg, out.stdout
    assert ("'loss'" if case != "manifest" else MANIFEST) in msg, msg
    assert not any(e in msg for e in RAW_ERRORS), msg
    assert int(lines["PEAK"]) < (64 << 20), out.stdout

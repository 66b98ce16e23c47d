"""A manifest of the wrong structure gets a CheckpointError that says what is wrong (issue 9, item 7).

The manifest is untrusted JSON: every field is validated before any reader code meets it, so a
JSON list, a wrong type or a missing key never surfaces as an ``AttributeError`` or ``KeyError``.
"""
from __future__ import annotations

import copy
import json
from typing import Any, Callable

import pytest

import hpcdp
from ckpt_bodies import DATA, RawJSON, forge, good_manifest, load_error, plain_w
from hpcdp.checkpoint import load


# -- 7: the manifest's structure ----------------------------------------------------------------
def _set(path: tuple, value: Any) -> Callable[[dict], Any]:
    def mutate(m: dict) -> Any:
        m = copy.deepcopy(m)
        node = m
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
        return m
    return mutate


def _deep(m: dict) -> RawJSON:
    """A tree nested 5000 lists deep (deeper than Python's recursion limit)."""
    m = copy.deepcopy(m)
    m["tree"]["items"][0]["v"] = {"t": "list", "items": ["@"]}
    text = json.dumps(m)
    n = 5000
    return RawJSON(text.replace('"@"', '{"t": "list", "items": [' * n + '{"t": "array", "path": "w"}'
                                + "]}" * n))


MANIFESTS = {
    "json-list": (lambda m: [m], "JSON array"),
    "json-string": (lambda m: "hpcdp-checkpoint", "JSON string"),
    "datasets-list": (_set(("datasets",), [1, 2]), "'datasets'"),
    "no-tree": (lambda m: {k: v for k, v in m.items() if k != "tree"}, "'tree'"),
    "version-string": (_set(("format_version",), "1"), "'format_version'"),
    "checksum-unknown": (_set(("checksum",), "md5"), "'md5'"),
    "shape-string": (_set(("datasets", "w", "shape"), "16"), "datasets['w'].shape"),
    "shape-negative": (_set(("datasets", "w", "shape"), [-16]), "datasets['w'].shape"),
    "dtype-number": (_set(("datasets", "w", "dtype"), 8), "datasets['w'].dtype"),
    "slabs-dict": (_set(("datasets", "w", "slabs"), {"0": 1}), "datasets['w'].slabs"),
    "slab-no-crc": (lambda m: _set(("datasets", "w", "slabs"), [{"rank": 0, "offsets": [0],
                                                                  "shape": [16]}])(m),
                    "datasets['w'].slabs[0]"),
    "slab-crc-string": (_set(("datasets", "w", "slabs", 0, "crc32"), "abc"), "crc32"),
    "slab-offsets-axes": (_set(("datasets", "w", "slabs", 0, "offsets"), [0, 0]), "offsets"),
    "tree-not-dict": (_set(("tree",), ["w"]), "tree"),
    "tree-unknown-node": (_set(("tree", "items", 0, "v"), {"t": "pickle", "data": "x"}), "'pickle'"),
    "tree-items-dict": (_set(("tree", "items"), {"w": 1}), "items"),
    "tree-missing-dataset": (_set(("tree", "items", 0, "v", "path"), "nope"), "'nope'"),
    "tree-key-type": (_set(("tree", "items", 0, "kt"), "float"), "kt"),
    "scalar-wrong-value": (_set(("tree", "items", 0, "v"), {"t": "scalar", "type": "int",
                                                            "value": "7"}), "int"),
    "files-dotdot": (_set(("files",), ["../rank-00000.h5"]), "../rank-00000.h5"),
    "too-deep": (_deep, "deep"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(MANIFESTS))
def test_manifest_structure_is_validated(case: str, tmp_path) -> None:
    mutate, why = MANIFESTS[case]
    ck = forge(str(tmp_path / "step-1"), plain_w, mutate(good_manifest()))
    msg = load_error(ck)
    assert "manifest" in msg and why in msg, msg
    assert msg.startswith("load ") and "data.h5" in msg, msg


@pytest.mark.timeout(120)
def test_random_manifest_damage_gives_only_checkpoint_errors() -> None:
    """Thousands of seeded random replacements anywhere in a manifest: each is accepted or gets a
    CheckpointError, never another exception (the validator runs before any reader code)."""
    import random

    from hpcdp.checkpoint._manifest import validate_manifest

    values = [None, True, 0, -1, 2**40, 1.5, "", "x", "<f4", "|O", [], [0], [-1], [[]], {},
              {"t": "dict"}, {"t": "array", "path": "w"}]

    def places(node: Any, at: tuple = ()) -> Any:
        yield at
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in items:
            yield from places(v, at + (k,))

    base = good_manifest()
    where = list(places(base))
    rng = random.Random(9)
    refused = 0
    for _ in range(3000):
        m: Any = copy.deepcopy(base)
        for _ in range(rng.randint(1, 3)):
            at = rng.choice(where)
            try:
                node = m
                for k in at[:-1]:
                    node = node[k]
                if at:
                    node[at[-1]] = rng.choice(values)
                else:
                    m = rng.choice(values)
            except (KeyError, IndexError, TypeError):
                pass                                   # an earlier change removed that place
        try:
            validate_manifest(m, "load x")
        except hpcdp.CheckpointError:
            refused += 1
    assert refused > 2000                              # most damage is caught, all of it cleanly


def test_the_unmutated_forgery_loads(tmp_path) -> None:
    """The forging helpers make a valid checkpoint: every refusal above is the mutation's doing."""
    ck = forge(str(tmp_path / "step-1"), plain_w, good_manifest())
    assert load(ck)["w"].tolist() == DATA.tolist()


# -- format 3: a slab's checksum under "checksum", XXH3-64 (64 bits) by default ----------------
def _format3(algo: str = "xxh3_64") -> dict:
    """``good_manifest()`` as format 3 writes it, checksummed with ``algo``."""
    from hpcdp.checkpoint._format import checksum_of

    m = copy.deepcopy(good_manifest())
    m["format_version"], m["checksum"] = 3, algo
    for s in m["datasets"]["w"]["slabs"]:
        del s["crc32"]
        s["checksum"] = checksum_of(DATA, algo)
    return m


def test_format_3_forgery_loads_with_each_checksum(tmp_path) -> None:
    for algo in ("xxh3_64", "crc32c", "crc32"):
        ck = forge(str(tmp_path / algo), plain_w, _format3(algo))
        assert load(ck)["w"].tolist() == DATA.tolist(), algo
    # a digest over 32 bits: XXH3-64's own, which a 32-bit field could not hold
    assert _format3()["datasets"]["w"]["slabs"][0]["checksum"] >= 2**32


# -- format 4: the slab checksum "xxh3_64_512k", XXH3-64 over 512 KiB blocks' XXH3-64s ----------
def _blocks_recipe(data: bytes) -> int:
    """The format-4 slab checksum as a collaborator computes it with ``xxhash`` alone."""
    import xxhash

    block = 512 << 10
    return xxhash.xxh3_64_intdigest(b"".join(xxhash.xxh3_64_digest(data[i:i + block])
                                             for i in range(0, len(data), block)))


@pytest.mark.parametrize("n", [0, 1, 1000, (512 << 10) - 1, 512 << 10, (512 << 10) + 1, 3 << 20,
                               (3 << 20) + 12345])
def test_block_checksum_is_the_recipe_whatever_the_pieces(n: int) -> None:
    """``BlockXxh3`` fed in pieces of any size (the reader's blocks, a partial slab's C-order
    blocks, a whole array) is the recipe's digest; it differs from plain XXH3-64 of the bytes."""
    import numpy as np
    import xxhash

    from hpcdp.checkpoint._format import BlockXxh3, checksum_of

    rng = np.random.default_rng(n)
    data = rng.integers(0, 256, n, dtype=np.uint8)
    want = _blocks_recipe(data.tobytes())
    assert checksum_of(data, "xxh3_64_512k") == want
    for sizes in ([512 << 10], [1], [4096, 777, 100_000], [1 << 20]):
        h, i, k = BlockXxh3(), 0, 0
        while i < n:
            step = sizes[k % len(sizes)]
            h.update(data[i:i + step])
            i, k = i + step, k + 1
        assert h.intdigest() == want, sizes
        assert h.intdigest() == want  # (reading the digest does not change the state)
    if n > 1:
        assert want != xxhash.xxh3_64_intdigest(data.tobytes())
        flipped = data.copy()
        flipped[n // 2] ^= 4
        assert checksum_of(flipped, "xxh3_64_512k") != want


def test_save_writes_format_4_block_checksums_a_collaborator_can_check(tmp_path) -> None:
    """What ``save`` writes: format 4, "xxh3_64_512k", each slab's checksum the recipe's over the
    bytes h5py reads (README "Reading a checkpoint without hpcdp")."""
    import h5py
    import numpy as np

    from hpcdp.checkpoint import save
    from hpcdp.checkpoint._format import FORMAT_VERSION

    w = np.arange(3 * (1 << 18) + 5, dtype=np.float32).reshape(-1, 1)  # 3 MiB: several blocks
    save(str(tmp_path / "step-1"), {"w": w, "step": 1})
    with h5py.File(str(tmp_path / "step-1" / "data.h5"), "r") as f:
        m = json.loads(f["_hpcdp_manifest"].asstr()[()])
        got = f["w"][...]
    assert FORMAT_VERSION == 4 and m["format_version"] == 4 and m["checksum"] == "xxh3_64_512k", m
    (slab,) = m["datasets"]["w"]["slabs"]
    assert slab["checksum"] == _blocks_recipe(got.tobytes())
    assert load(str(tmp_path / "step-1"))["w"].tobytes() == w.tobytes()


def test_format_4_forgery_loads_and_a_wrong_checksum_is_corruption(tmp_path) -> None:
    m = _format3("xxh3_64_512k")
    m["format_version"] = 4
    assert load(forge(str(tmp_path / "good"), plain_w, m))["w"].tolist() == DATA.tolist()
    m["datasets"]["w"]["slabs"][0]["checksum"] ^= 1 << 50
    msg = load_error(forge(str(tmp_path / "bad"), plain_w, m))
    assert "XXH3_64_512K checksum" in msg and "corrupt" in msg, msg


def test_format_3_with_plain_xxh3_still_loads_after_format_4(tmp_path) -> None:
    """A format-3 slab checksum (plain XXH3-64 of the bytes) is checked as such, not as blocks."""
    m = _format3("xxh3_64")
    assert load(forge(str(tmp_path / "good"), plain_w, m))["w"].tolist() == DATA.tolist()
    m["checksum"] = "xxh3_64_512k"  # the same digest read as format 4's: refused
    msg = load_error(forge(str(tmp_path / "bad"), plain_w, m))
    assert "checksum" in msg and "corrupt" in msg, msg


FORMAT3 = {
    "old-key": (lambda m: _set(("datasets", "w", "slabs"), [{"rank": 0, "offsets": [0], "shape": [16],
                                                              "crc32": 0}])(m), "lacks 'checksum'"),
    "over-64-bits": (_set(("datasets", "w", "slabs", 0, "checksum"), 2**64), "64-bit"),
    "negative": (_set(("datasets", "w", "slabs", 0, "checksum"), -1), "64-bit"),
    "crc-over-32-bits": (lambda m: _set(("datasets", "w", "slabs", 0, "checksum"), 2**32)(
        _set(("checksum",), "crc32c")(m)), "32-bit"),
}


@pytest.mark.parametrize("case", list(FORMAT3))
def test_format_3_slab_checksums_are_validated(case: str, tmp_path) -> None:
    mutate, why = FORMAT3[case]
    msg = load_error(forge(str(tmp_path / "step-1"), plain_w, mutate(_format3())))
    assert "manifest" in msg and why in msg, msg


def test_a_wrong_xxh3_checksum_is_corruption(tmp_path) -> None:
    m = _format3()
    m["datasets"]["w"]["slabs"][0]["checksum"] ^= 1 << 40   # a bit a 32-bit check never sees
    msg = load_error(forge(str(tmp_path / "step-1"), plain_w, m))
    assert "XXH3_64 checksum" in msg and "corrupt" in msg, msg


def test_a_checksum_whose_package_is_missing_says_so(tmp_path, monkeypatch) -> None:
    from hpcdp.checkpoint import _format

    def missing() -> None:
        raise ImportError("No module named 'xxhash'", name="xxhash")

    ck = forge(str(tmp_path / "step-1"), plain_w, _format3())
    for name in ("xxh3_64", "xxh3_64_512k"):  # (both come from the xxhash package)
        monkeypatch.setitem(_format.CHECKSUMS, name, (missing, 64))
    msg = load_error(ck)
    assert "xxhash package" in msg and msg.startswith("load "), msg
    # and save falls back to the next checksum instead of failing
    assert _format.default_checksum() == "crc32c"


def test_ranks_with_different_checksum_packages_agree(tmp_path, monkeypatch) -> None:
    """A rank without the xxhash package: ``save`` takes the best checksum every rank can
    compute (CRC32C), and the checkpoint loads."""
    import numpy as np

    from hpcdp.checkpoint import _save, save
    from hpcdp.testing import run_ranks

    def usable() -> tuple[str, ...]:
        full = ("xxh3_64", "crc32c", "crc32")
        return full[1:] if hpcdp.get_rank() == 1 else full

    monkeypatch.setattr(_save, "usable_checksums", usable)
    path = str(tmp_path / "step-1")

    def body(rank: int) -> tuple[str, list]:
        save(path, {"w": np.arange(6.0), "step": 3})
        import h5py
        with h5py.File(path + "/data.h5", "r") as f:
            algo = json.loads(f["_hpcdp_manifest"].asstr()[()])["checksum"]
        return algo, load(path)["w"].tolist()

    out = run_ranks("sim", 2, body)
    assert out == [("crc32c", [0.0, 1.0, 2.0, 3.0, 4.0, 5.0])] * 2, out

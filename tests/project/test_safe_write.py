"""Every file hpcdp writes goes through ``hpcdp._atomic``: never through a link someone planted.

A trace directory (or benchmark output, or checkpoint directory) may hold links to files outside
it under the names hpcdp writes; after hpcdp ran, the files outside are unchanged and hpcdp's
outputs are regular files.
"""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import numpy as np
import pytest

from hpcdp import trace
from hpcdp.trace import _chrome

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def fresh():
    trace.reset()
    yield
    trace.disable()
    trace.reset()


def _regular(path) -> bool:
    return stat.S_ISREG(os.lstat(path).st_mode)


def _precious(tmp_path, names) -> dict:
    """Files outside the directory under attack, each with content that must survive."""
    out = tmp_path / "outside"
    out.mkdir(exist_ok=True)
    files = {}
    for n in names:
        f = out / f"victim-{n}"
        f.write_text(f"precious {n}")
        files[n] = f
    return files


def _unchanged(files: dict) -> None:
    for n, f in files.items():
        assert _regular(f) and f.read_text() == f"precious {n}", n


def _trace_dir(d) -> None:
    for rank in (0, 1):
        tl = _chrome.Timeline(rank, str(d))
        tl.complete("forward", "phase", tl.epoch_ns, tl.epoch_ns + 2_000_000)
        tl.complete("allreduce", "phase", tl.epoch_ns + 2_000_000, tl.epoch_ns + 3_000_000)
        tl.close()


# -- item: trace merge / plot ------------------------------------------------------------------
@pytest.mark.timeout(240)
def test_merge_and_plot_never_write_through_planted_links(tmp_path) -> None:
    d = tmp_path / "trace"
    d.mkdir()
    _trace_dir(d)
    names = ["merged-trace.json", "merged-trace.json.tmp", "phases.png"]
    victims = _precious(tmp_path, names)
    for n in names:
        os.symlink(victims[n], d / n)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for cmd in (["merge", str(d)], ["plot", str(d)]):
        p = subprocess.run([sys.executable, "-m", "hpcdp.trace", *cmd], capture_output=True, text=True,
                           timeout=180, env=env, stdin=subprocess.DEVNULL)
        assert p.returncode == 0, p.stderr
    _unchanged(victims)
    assert _regular(d / "merged-trace.json") and _regular(d / "phases.png")
    assert {e["pid"] for e in json.loads((d / "merged-trace.json").read_text())["traceEvents"]} == {0, 1}
    assert (d / "phases.png").read_bytes()[:8] == PNG
    # no temporary left behind; the planted .tmp link is the only other entry
    assert sorted(os.listdir(d)) == sorted(["merged-trace.json", "merged-trace.json.tmp", "phases.png",
                                            "trace-rank0.json", "trace-rank1.json"])
    assert os.path.islink(d / "merged-trace.json.tmp")


def test_timeline_and_flight_record_replace_links_at_their_names(tmp_path) -> None:
    d = tmp_path / "trace"
    d.mkdir()
    victims = _precious(tmp_path, ["trace-rank0.json", "flight-rank0.json"])
    for n, f in victims.items():
        os.symlink(f, d / n)
    tl = _chrome.Timeline(0, str(d), flush_every=1)
    tl.complete("step", "train", tl.epoch_ns, tl.epoch_ns + 10)
    tl.close()
    rec = trace.recorder(0)
    rec.end(rec.begin("allreduce", "world", 1))
    assert trace.dump("t", directory=d) == [str(d / "flight-rank0.json")]
    _unchanged(victims)
    assert _regular(d / "trace-rank0.json") and _regular(d / "flight-rank0.json")
    assert json.loads((d / "trace-rank0.json").read_text())["otherData"]["rank"] == 0
    assert json.loads((d / "flight-rank0.json").read_text())["rank"] == 0


# -- the helper ------------------------------------------------------------------------------
def test_atomic_write_replaces_a_link_and_never_follows_it(tmp_path) -> None:
    from hpcdp._atomic import atomic_write, atomic_write_bytes, atomic_write_text

    victims = _precious(tmp_path, ["a", "b"])
    os.symlink(victims["a"], tmp_path / "out.txt")
    atomic_write_text(tmp_path / "out.txt", "mine")
    os.symlink(victims["b"], tmp_path / "out.bin")
    with atomic_write(tmp_path / "out.bin", "wb", fsync=True) as fh:
        fh.write(b"\x00\x01")
    _unchanged(victims)
    assert _regular(tmp_path / "out.txt") and (tmp_path / "out.txt").read_text() == "mine"
    assert (tmp_path / "out.bin").read_bytes() == b"\x00\x01"
    atomic_write_bytes(tmp_path / "out.bin", b"again")        # an existing regular file: replaced
    assert (tmp_path / "out.bin").read_bytes() == b"again"
    assert sorted(os.listdir(tmp_path)) == ["out.bin", "out.txt", "outside"]
    with pytest.raises(ValueError, match="mode must be"):
        atomic_write(tmp_path / "x", "a").__enter__()


def test_atomic_write_removes_its_temporary_on_error(tmp_path) -> None:
    from hpcdp._atomic import atomic_write

    (tmp_path / "out.json").write_text("old")
    with pytest.raises(RuntimeError, match="writer failed"):
        with atomic_write(tmp_path / "out.json") as fh:
            fh.write("half")
            raise RuntimeError("writer failed")
    assert os.listdir(tmp_path) == ["out.json"] and (tmp_path / "out.json").read_text() == "old"
    os.mkdir(tmp_path / "adir")                                  # the rename itself fails
    with pytest.raises(OSError):
        with atomic_write(tmp_path / "adir") as fh:
            fh.write("x")
    assert sorted(os.listdir(tmp_path)) == ["adir", "out.json"] and os.listdir(tmp_path / "adir") == []


def test_a_planted_temporary_name_is_never_used(tmp_path, monkeypatch) -> None:
    """The temporary is created with O_EXCL | O_NOFOLLOW: if a guessed name is there (a link
    included), another fresh name is taken and the link is left alone."""
    from hpcdp import _atomic

    victims = _precious(tmp_path, ["t"])
    tokens = iter(["0" * 16, "0" * 16, "1" * 16])
    monkeypatch.setattr(_atomic.secrets, "token_hex", lambda n: next(tokens))
    planted = tmp_path / f".out.json.{'0' * 16}.tmp"
    os.symlink(victims["t"], planted)
    _atomic.atomic_write_text(tmp_path / "out.json", "{}")
    _unchanged(victims)
    assert os.path.islink(planted) and (tmp_path / "out.json").read_text() == "{}"
    monkeypatch.setattr(_atomic.secrets, "token_hex", lambda n: "0" * 16)   # every name taken
    with pytest.raises(FileExistsError, match="fresh temporary"):
        _atomic.atomic_write_text(tmp_path / "out.json", "[]")
    _unchanged(victims)
    assert (tmp_path / "out.json").read_text() == "{}"


def test_open_new_and_open_append(tmp_path) -> None:
    from hpcdp._atomic import open_append, open_new

    victims = _precious(tmp_path, ["n", "a"])
    os.symlink(victims["n"], tmp_path / "stream.json")
    with open_new(tmp_path / "stream.json") as fh:
        assert _regular(tmp_path / "stream.json")          # in place before anything is written
        fh.write("streamed")
    assert (tmp_path / "stream.json").read_text() == "streamed"
    with open_append(tmp_path / "log.jsonl") as fh:
        fh.write("1\n")
    with open_append(tmp_path / "log.jsonl") as fh:
        fh.write("2\n")
    assert (tmp_path / "log.jsonl").read_text() == "1\n2\n"
    os.symlink(victims["a"], tmp_path / "linked.jsonl")
    with pytest.raises(OSError, match="symbolic link"):
        open_append(tmp_path / "linked.jsonl")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling.jsonl")   # would create the target
    with pytest.raises(OSError, match="symbolic link"):
        open_append(tmp_path / "dangling.jsonl")
    assert not (tmp_path / "nowhere").exists()
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(OSError, match="fifo"):          # never blocks waiting for a reader
        open_append(tmp_path / "fifo")
    _unchanged(victims)


# -- benchmarks --------------------------------------------------------------------------------
def test_benchmark_json_lines_never_append_through_a_link(tmp_path) -> None:
    from hpcdp.bench._common import JsonSink

    victims = _precious(tmp_path, ["json"])
    os.symlink(victims["json"], tmp_path / "rows.jsonl")
    with pytest.raises(OSError, match="symbolic link"):
        JsonSink(str(tmp_path / "rows.jsonl")).write({"bench": "x"})
    _unchanged(victims)
    sink = JsonSink(str(tmp_path / "real.jsonl"))
    sink.write({"bench": "x", "n": 1})
    sink.close()
    sink = JsonSink(str(tmp_path / "real.jsonl"))                # a second run appends
    sink.write({"bench": "x", "n": 2})
    sink.close()
    assert [json.loads(s)["n"] for s in (tmp_path / "real.jsonl").read_text().splitlines()] == [1, 2]


@pytest.mark.timeout(180)
def test_benchmark_plot_replaces_a_link(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from hpcdp.bench import _plot

    victims = _precious(tmp_path, ["png"])
    os.symlink(victims["png"], tmp_path / "bench.png")
    rows = [{"bench": "sim", "op": "allreduce", "size": s, "ranks": 4, "time_us": 900.0,
             "base_time_us": 600.0, "ratio": 1.5} for s in (1 << 20, 4 << 20)]
    out = _plot.plot_rows(rows, str(tmp_path / "bench.png"))
    _unchanged(victims)
    assert _regular(out) and open(out, "rb").read(8) == PNG


# -- checkpoints -------------------------------------------------------------------------------
def test_checkpoint_temporary_directory_is_fresh_and_exclusive(tmp_path, monkeypatch) -> None:
    """A link planted under the temporary directory's name is never used: another random name is."""
    from hpcdp.checkpoint import _commit, load, save

    victims = tmp_path / "outside"
    victims.mkdir()
    ck = tmp_path / "ckpt"
    ck.mkdir()
    tokens = iter(["deadbeef", "deadbeef", "0badf00d"])
    monkeypatch.setattr(_commit.secrets, "token_hex", lambda n: next(tokens))
    os.symlink(victims, ck / ".tmp-step-1-deadbeef")
    save(str(ck / "step-1"), {"w": np.arange(6.0)})
    got = load(str(ck / "step-1"))
    assert np.array_equal(got["w"], np.arange(6.0))
    assert os.listdir(victims) == [] and os.path.islink(ck / ".tmp-step-1-deadbeef")
    assert stat.S_ISDIR(os.lstat(ck / "step-1").st_mode)


def test_checkpoint_files_are_created_exclusively(tmp_path) -> None:
    """The HDF5 files of a save are created with "w-" (O_EXCL): a link planted in the temporary
    directory makes the save fail; the file it points to is not truncated."""
    from hpcdp.checkpoint._writer_vds import VdsWriter

    victims = _precious(tmp_path, ["data.h5"])
    tmp = tmp_path / ".tmp-step-1-0badf00d"
    tmp.mkdir()
    os.symlink(victims["data.h5"], tmp / "data.h5")
    w = VdsWriter(str(tmp), 0)
    w.write([], [], {})
    with pytest.raises(OSError):
        w.finish(np.zeros(4, np.uint8), 0)
    _unchanged(victims)

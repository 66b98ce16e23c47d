"""Chrome-trace timelines: the writer, spans, merge across ranks with clock offsets, and the plot."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from hpcdp import trace
from hpcdp.trace import hooks
from hpcdp.trace import _chrome
from hpcdp.trace._merge import assign_lanes, merged_events
from hpcdp.trace._plot import self_times

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def fresh():
    trace.reset()
    yield
    trace.disable()
    trace.reset()
    for r in list(trace._clock._offsets):
        hooks.set_clock_offset(r, 0)


class G:
    def __init__(self, name="world", ranks=(0, 1)):
        self.name, self.ranks, self.rank = name, ranks, 0


def _load(path) -> dict:
    with open(path) as fh:
        return json.load(fh)


def test_timeline_writes_valid_chrome_json(tmp_path) -> None:
    tl = _chrome.Timeline(3, str(tmp_path), flush_every=2)  # several chunks
    rec = trace.Recorder(3, 16)
    rec.attach_timeline(tl)
    g = G("world", (0, 1, 2, 3))
    for s in range(1, 4):
        rec.end(rec.begin("allreduce", g, s, (8, 2), np.dtype("float16"), -1))
    rec.end(rec.begin("send", g, 0, (4,), np.dtype("int32"), 2), trace.TIMED_OUT)
    tl.complete("backward", "ddp", 100, 2100, {"step": 1})
    tl.instant("bucket ready", "ddp", {"bucket": 0})
    tl.counter("buckets in flight", "ddp", {"n": 2})
    tl.close()
    doc = _load(tl.path)
    evs = doc["traceEvents"]
    assert doc["otherData"]["rank"] == 3 and doc["otherData"]["format"] == "hpcdp.trace/1"
    ops = [e for e in evs if e["ph"] == "X" and e["cat"] in ("collective", "p2p")]
    assert [e["args"]["seq"] for e in ops] == [1, 2, 3, 0]
    a = ops[0]
    assert (a["name"], a["pid"], a["args"]["group"], a["args"]["group_ranks"], a["args"]["shape"],
            a["args"]["dtype"], a["args"]["state"]) == ("allreduce", 3, "world", [0, 1, 2, 3], [8, 2],
                                                          "float16", "completed")
    assert a["dur"] >= 0 and "line" in a["args"]  # timelines record source lines
    assert ops[3]["cat"] == "p2p" and ops[3]["args"]["peer"] == 2 and ops[3]["args"]["state"] == "timed out"
    kinds = {(e["ph"], e["name"]) for e in evs}
    assert {("X", "backward"), ("i", "bucket ready"), ("C", "buckets in flight"),
            ("M", "process_name"), ("M", "thread_name")} <= kinds
    bw = next(e for e in evs if e["name"] == "backward")
    assert bw["dur"] == pytest.approx(2.0) and bw["args"] == {"step": 1}


def test_span_instant_counter_follow_the_switch(tmp_path) -> None:
    @trace.span("decorated", "user", k=1)
    def work() -> int:
        return 7

    with trace.span("nothing"):  # tracing off: no file, no error
        assert work() == 7
    trace.instant("nothing")
    trace.counter("nothing", v=1)
    assert not os.listdir(tmp_path)
    trace.enable(tmp_path)
    hooks.install(0, 1)
    with trace.span("outer", "phase", step=2):
        assert work() == 7
        try:
            with trace.span("fails", "phase"):
                raise KeyError("x")
        except KeyError:
            pass
    trace.instant("mark", "m", a=1)
    trace.counter("bytes", "io", written=10.0)
    rec = trace.recorder(0)
    rec.end(rec.begin("barrier", G(), 1))
    trace.disable()
    evs = _load(tmp_path / "trace-rank0.json")["traceEvents"]
    by = {e["name"]: e for e in evs}
    assert by["decorated"]["args"] == {"k": 1} and by["outer"]["args"] == {"step": 2}
    assert by["fails"]["args"] == {"error": "KeyError"}
    assert by["barrier"]["cat"] == "collective" and by["mark"]["ph"] == "i" and by["bytes"]["args"] == {"written": 10.0}
    o, d = by["outer"], by["decorated"]
    assert o["ts"] <= d["ts"] and d["ts"] + d["dur"] <= o["ts"] + o["dur"] + 1e-3


def test_sim_ranks_get_one_timeline_each(tmp_path) -> None:
    import hpcdp

    trace.enable(tmp_path)

    def body(rank: int) -> None:
        hooks.install(rank, 3)
        with trace.span("step", "train", rank=rank):
            hpcdp.barrier()

    hpcdp.spawn(body, 3, timeout=30, join_timeout=60)
    trace.disable()
    for r in range(3):
        evs = _load(tmp_path / f"trace-rank{r}.json")["traceEvents"]
        (step,) = [e for e in evs if e["name"] == "step"]
        assert step["pid"] == r and step["args"] == {"rank": r}


def _write_rank(directory, rank: int, offset_ns: int, spans: list[tuple[str, int, int]]) -> None:
    """A timeline of spans at the given reference-clock times (ns after a common epoch), written
    by a rank whose clock reads ``reference - offset_ns``."""
    hooks.set_clock_offset(rank, offset_ns)
    tl = _chrome.Timeline(rank, str(directory))
    for name, t0, t1 in spans:
        tl.complete(name, "phase", tl.epoch_ns + t0 - offset_ns, tl.epoch_ns + t1 - offset_ns)
    tl.close()
    doc = _load(tl.path)
    doc["otherData"]["epoch_wall_ns"] = 10**18  # every rank's timeline started at one instant
    with open(tl.path, "w") as fh:
        json.dump(doc, fh)


def test_merge_applies_clock_offsets_and_orders_every_rank(tmp_path) -> None:
    # rank 1's clock runs 5 ms behind the reference: its spans must land where rank 0's do
    _write_rank(tmp_path, 0, 0, [("forward", 1_000_000, 3_000_000), ("allreduce", 3_000_000, 4_000_000)])
    _write_rank(tmp_path, 1, 5_000_000, [("forward", 1_000_000, 3_000_000), ("allreduce", 3_000_000, 4_000_000)])
    _write_rank(tmp_path, 2, -2_000_000, [("forward", 2_000_000, 3_500_000)])
    out = trace.merge(str(tmp_path))
    doc = _load(out)  # valid JSON
    evs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in evs} == {0, 1, 2}
    ts = [e["ts"] for e in evs]
    assert ts == sorted(ts) and ts[0] == 0.0
    fw = {e["pid"]: e["ts"] for e in evs if e["name"] == "forward"}
    assert fw[0] == pytest.approx(0.0, abs=0.01) and fw[1] == pytest.approx(0.0, abs=0.01)
    assert fw[2] == pytest.approx(1000.0, abs=0.01)  # 1 ms later on the reference clock
    assert doc["otherData"]["clock_offsets_ns"] == {"0": 0, "1": 5_000_000, "2": -2_000_000}
    names = {(e["pid"], e["args"]["name"]) for e in doc["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {(0, "rank 0"), (1, "rank 1"), (2, "rank 2")}


def test_merge_repairs_a_timeline_cut_short(tmp_path) -> None:
    tl = _chrome.Timeline(0, str(tmp_path))
    tl.complete("a", "phase", tl.epoch_ns, tl.epoch_ns + 1000)
    tl.flush()  # the process dies here: no closing bracket
    text = (tmp_path / "trace-rank0.json").read_text()
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    events, _ = merged_events(str(tmp_path))
    assert [e["name"] for e in events if e["ph"] == "X"] == ["a"]
    tl._fh.close()


def test_overlapping_async_ops_move_to_extra_lanes() -> None:
    evs = [
        {"name": "a", "ph": "X", "pid": 0, "tid": 0, "ts": 0.0, "dur": 10.0},
        {"name": "b", "ph": "X", "pid": 0, "tid": 0, "ts": 5.0, "dur": 10.0},  # overlaps a, not nested
        {"name": "c", "ph": "X", "pid": 0, "tid": 0, "ts": 1.0, "dur": 2.0},   # nested in a
        {"name": "d", "ph": "X", "pid": 0, "tid": 0, "ts": 20.0, "dur": 1.0},
    ]
    out = assign_lanes(evs)
    tid = {e["name"]: e["tid"] for e in out if e["ph"] == "X"}
    assert tid["a"] == tid["c"] == tid["d"] == 0 and tid["b"] != 0
    assert any(e["ph"] == "M" and e["tid"] == tid["b"] for e in out)


def test_self_time_does_not_count_nested_spans_twice() -> None:
    evs = [
        {"name": "backward", "ph": "X", "pid": 0, "tid": 0, "ts": 0.0, "dur": 1000.0},
        {"name": "allreduce", "ph": "X", "pid": 0, "tid": 0, "ts": 100.0, "dur": 300.0},
        {"name": "allreduce", "ph": "X", "pid": 0, "tid": 0, "ts": 500.0, "dur": 200.0},
        {"name": "optimizer", "ph": "X", "pid": 1, "tid": 0, "ts": 0.0, "dur": 50.0},
    ]
    st = self_times(evs)
    assert st[0]["backward"] == pytest.approx(500e-6) and st[0]["allreduce"] == pytest.approx(500e-6)
    assert st[1] == {"optimizer": pytest.approx(50e-6)}


@pytest.mark.timeout(180)
def test_cli_merge_and_plot(tmp_path) -> None:
    _write_rank(tmp_path, 0, 0, [("forward", 0, 2_000_000), ("allreduce", 2_000_000, 3_000_000)])
    _write_rank(tmp_path, 1, 0, [("forward", 0, 2_500_000), ("allreduce", 2_500_000, 3_000_000)])
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = lambda *a: subprocess.run([sys.executable, "-m", "hpcdp.trace", *a], capture_output=True,  # noqa: E731
                                    text=True, timeout=120, env=env, stdin=subprocess.DEVNULL)
    p = run("--help")
    assert p.returncode == 0 and "analyze" in p.stdout and "merge" in p.stdout and "plot" in p.stdout
    for sub in ("analyze", "merge", "plot", "plot-bench"):
        h = run(sub, "--help")
        assert h.returncode == 0 and "usage" in h.stdout, (sub, h.stderr)
    m = run("merge", str(tmp_path), "-o", str(tmp_path / "all.json"))
    assert m.returncode == 0, m.stderr
    assert {e["pid"] for e in _load(tmp_path / "all.json")["traceEvents"]} == {0, 1}
    png = tmp_path / "phases.png"
    pl = run("plot", str(tmp_path), "-o", str(png))
    assert pl.returncode == 0, pl.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    pl2 = run("plot", str(tmp_path / "all.json"), "-o", str(tmp_path / "from-merged.png"))
    assert pl2.returncode == 0 and (tmp_path / "from-merged.png").exists(), pl2.stderr
    bad = run("merge", str(tmp_path / "missing"))
    assert bad.returncode == 1 and "not a directory" in bad.stderr


def test_merge_falls_back_to_flight_records(tmp_path) -> None:
    for r in (0, 1):
        rec = trace.recorder(r)
        rec.end(rec.begin("allreduce", G(), 1, (2,), np.dtype("float32")))
        rec.begin("barrier", G(), 2)
    trace.dump("t", directory=tmp_path)
    events, meta = merged_events(str(tmp_path))
    assert meta["source"] == "flight records"
    xs = [e for e in events if e["ph"] == "X"]
    assert sorted((e["pid"], e["name"]) for e in xs) == [(0, "allreduce"), (0, "barrier"),
                                                         (1, "allreduce"), (1, "barrier")]
    assert {e["args"]["state"] for e in xs if e["name"] == "barrier"} == {"started"}


def test_timeline_is_thread_safe(tmp_path) -> None:
    tl = _chrome.Timeline(0, str(tmp_path), flush_every=64)

    def work(k: int) -> None:
        for i in range(300):
            tl.complete(f"t{k}", "x", i, i + 1)

    ts = [threading.Thread(target=work, args=(k,)) for k in range(6)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    tl.close()
    evs = [e for e in _load(tl.path)["traceEvents"] if e["ph"] == "X"]
    assert len(evs) == 1800 and len({e["tid"] for e in evs}) == 6


def test_flush_time_is_counted_and_args_render_by_type(tmp_path) -> None:
    """``flush_ns`` grows with each chunk written (benchmarks add it back); args keep their
    JSON types (True is not 1, 1.0 is not 1) and non-scalar args go through the encoder."""
    tl = _chrome.Timeline(0, str(tmp_path), flush_every=2)
    assert tl.flush_ns == 0
    tl.complete("a", "x", 0, 1000, {"flag": True, "n": 1, "f": 1.5, "s": 'q"', "none": None})
    tl.instant("b", "x", {"n": 1, "flag": False, "shape": (2, 3)})
    first = tl.flush_ns
    assert first > 0  # the second event filled a chunk
    tl.instant("c", "x", {"inf": math.inf})
    tl.close()
    assert tl.flush_ns > first
    evs = {e["name"]: e for e in _load(tl.path)["traceEvents"]}
    assert evs["a"]["args"] == {"flag": True, "n": 1, "f": 1.5, "s": 'q"', "none": None}
    assert type(evs["a"]["args"]["flag"]) is bool and type(evs["a"]["args"]["n"]) is int
    assert evs["a"]["dur"] == 1.0
    assert evs["b"]["args"] == {"n": 1, "flag": False, "shape": [2, 3]}
    assert evs["c"]["args"]["inf"] == "inf"  # a string: JSON has no infinity


def test_merge_and_plot_drop_malformed_events(tmp_path) -> None:
    _write_rank(tmp_path, 0, 0, [("forward", 0, 2_000_000)])
    path = tmp_path / "trace-rank0.json"
    doc = _load(path)
    doc["traceEvents"] += [
        {"name": "huge", "ph": "X", "pid": 0, "tid": 0, "ts": 1e307, "dur": 1.0},    # overflows ns
        {"name": "nodur", "ph": "X", "pid": 0, "tid": 0, "ts": 1.0},
        {"name": "badtid", "ph": "X", "pid": 0, "tid": 2**70, "ts": 1.0, "dur": 1.0},
        {"name": "twophase", "ph": "Xi", "pid": 0, "tid": 0, "ts": 1.0, "dur": 1.0},
    ]
    path.write_text(json.dumps(doc))
    events, _ = merged_events(str(tmp_path))
    assert sorted(e["name"] for e in events if e["ph"] == "X") == ["badtid", "forward"]
    assert next(e for e in events if e["name"] == "badtid")["tid"] == 0
    # a merged file given to plot is read as untrusted too: only well-formed 'X' events count
    merged = tmp_path / "merged.json"
    merged.write_text(json.dumps({"traceEvents": [
        {"name": "ok", "ph": "X", "pid": 0, "tid": 0, "ts": 0.0, "dur": 5.0},
        {"name": "nodur", "ph": "X", "pid": 0, "tid": 0, "ts": 1.0},
        {"name": "nopid", "ph": "X", "tid": 0, "ts": 1.0, "dur": 1.0},
        {"name": "strts", "ph": "X", "pid": 0, "tid": 0, "ts": "1", "dur": 1.0},
    ]}))
    from hpcdp.trace._plot import load_events

    assert [e["name"] for e in load_events(str(merged))] == ["ok"]
    assert self_times(load_events(str(merged))) == {0: {"ok": pytest.approx(5e-6)}}


def test_timeline_never_writes_through_a_symlink(tmp_path, capsys) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("precious")
    d = tmp_path / "trace"
    d.mkdir()
    os.symlink(outside, d / "trace-rank0.json")
    tl = _chrome.Timeline(0, str(d), flush_every=1)
    tl.complete("step", "train", tl.epoch_ns, tl.epoch_ns + 10)   # flushes: must not raise
    tl.complete("step", "train", tl.epoch_ns, tl.epoch_ns + 10)
    tl.close()
    assert outside.read_text() == "precious"
    assert not os.path.islink(d / "trace-rank0.json")           # the link was replaced
    assert len([e for e in _load(d / "trace-rank0.json")["traceEvents"] if e["ph"] == "X"]) == 2
    assert capsys.readouterr().err == ""
    # a timeline that cannot be written is reported once, and stops (tracing never breaks the job)
    (tmp_path / "file").write_text("")
    tl = _chrome.Timeline(0, str(tmp_path / "file" / "trace"), flush_every=1)
    tl.complete("step", "train", tl.epoch_ns, tl.epoch_ns + 10)
    tl.complete("step", "train", tl.epoch_ns, tl.epoch_ns + 10)
    tl.close()
    assert tl.closed and capsys.readouterr().err.count("timeline stops") == 1


def test_overlapping_events_use_a_bounded_number_of_lanes() -> None:
    from hpcdp.trace._merge import MAX_LANES

    # 2000 ops each overlapping the next without nesting (as a damaged file may claim)
    evs = [{"name": f"op{i}", "ph": "X", "pid": 0, "tid": 0, "ts": float(i), "dur": 10_000.0} for i in range(2000)]
    out = assign_lanes(evs)
    tids = {e["tid"] for e in out if e["ph"] == "X"}
    assert len(tids) == MAX_LANES + 1
    assert sum(1 for e in out if e["ph"] == "M") == MAX_LANES


def test_span_and_mark_args_round_trip(tmp_path) -> None:
    """Span, mark and counter args are formatted without the JSON encoder when they are plain
    scalars: what a reader parses back must equal what was recorded, odd values included."""
    tl = _chrome.Timeline(0, str(tmp_path), flush_every=1000)
    cases = [
        {"bucket": 3, "bytes": 1 << 40, "neg": -7},
        {"f": 0.1, "tiny": 1e-300, "big": 1.5e300, "whole": 2.0, "flag": True, "off": False,
         "none": None},
        {"text": 'quote " backslash \\ tab \t nl \n é 日本 \x00', "": "empty key"},
        {"nan": float("nan")},                       # JSON has no NaN: written as "nan"
        {"arr": [1, 2], "nested": {"a": (1, 2)}},    # not scalars: the encoder
        {"odd": object()},                           # default=str
        {3: "int key"},
    ]
    for i, args in enumerate(cases):
        tl.instant(f"mark {i}", "test", args)
        tl.complete("span é", "te\"st", 1000, 3500, args)
        tl.counter("ctr", "test", {"n": i, "x": 0.5})
    tl.instant("no args", "test", None)
    tl.close()
    evs = _load(tl.path)["traceEvents"]
    marks = [e for e in evs if e["ph"] == "i" and e["name"].startswith("mark")]
    spans = [e for e in evs if e["ph"] == "X"]
    assert len(marks) == len(spans) == len(cases)
    for e, s, args in zip(marks, spans, cases):
        assert e["s"] == "t" and e["cat"] == "test" and s["cat"] == 'te"st' and s["name"] == "span é"
        assert s["dur"] == pytest.approx(2.5)
        for got in (e["args"], s["args"]):
            if "nan" in args:
                assert got["nan"] == "nan"
            elif "odd" in args:
                assert got["odd"].startswith("<object object")
            else:
                want = json.loads(json.dumps(args))
                assert got == want, (got, args)
                # == cannot tell True from 1 or 2.0 from 2: the re-encoded texts can
                assert json.dumps(got, sort_keys=True) == json.dumps(want, sort_keys=True), (got, args)
    assert [e["args"] for e in evs if e["ph"] == "C"] == [{"n": i, "x": 0.5} for i in range(len(cases))]
    assert "args" not in next(e for e in evs if e["name"] == "no args")


def _reference(tl, ev) -> dict:
    """What an event of ``tl``'s buffer must read as in the file: its fields, times in microseconds
    rounded to three places (the writer's text, however it is made, must parse to this)."""
    ph, name, cat, t, dur, tid, args = ev
    out = {"name": name, "ph": ph, "pid": tl.rank, "cat": cat, "tid": tid,
           "ts": round((t - tl.epoch_ns) / 1e3, 3)}
    if ph == "X":
        out["dur"] = round(dur / 1e3, 3)
    if ph == "i":
        out["s"] = "t"
    if isinstance(args, tuple):  # a recorder row
        row, st = args
        out["args"] = {"group": "world", "group_ranks": [0, 1], "state": st, "seq": row[3]}
        if row[4] is not None:
            out["args"]["shape"] = list(row[4])
        if row[5] is not None:
            out["args"]["dtype"] = str(row[5])
        if row[6] >= 0:
            out["args"]["peer"] = row[6]
    elif args:
        out["args"] = json.loads(json.dumps(args, default=str).replace("NaN", '"nan"')
                                 .replace("Infinity", '"inf"'))
    return out


def test_timeline_text_matches_the_events_whatever_repeats(tmp_path) -> None:
    # The writer keeps the parts of events that repeat; values equal across types (True == 1,
    # 0.0 == -0.0, 1 == np.int64(1)), names with '%', times before the epoch and times whose
    # nanoseconds have leading zeros must still each come out as themselves.
    tl = _chrome.Timeline(0, str(tmp_path))
    e0 = tl.epoch_ns
    g = G()
    rec = trace.Recorder(0, 64)
    rec.attach_timeline(tl)
    values = [True, 1, False, 0, 1.0, 0.0, -0.0, float("nan"), float("inf"), None, "a%db", "1",
              np.int64(1), np.float64(-0.0), 2 ** 70]
    for rnd in range(2):  # the second round reads what the first kept
        for i, v in enumerate(values):
            tl.complete("span%d", "c%s", e0 + 1_000_007 * i, e0 + 1_000_007 * i + 5 + i * 1000,
                        {"v": v})
            tl.instant("mark", "m", {"v": v})
        tl.complete("early", "c", e0 - 2_500_001, e0 + 1_000)      # begun before the epoch
        tl.complete("zeros", "c", e0 + 1_000_001, e0 + 1_000_001 + 1_000_009)
        tl.counter("ctr", "counter", {"x": 1.5 * rnd, "y": 7})
        tl.instant("plain", "m")
        for shape, dtype, peer in [((4, 2), np.dtype(np.float32), -1), ([3], np.dtype(np.int64), 1),
                                   (None, None, 0)]:
            tok = rec.begin("allreduce" if peer < 0 else "send", g, rnd + 1 if peer < 0 else 0,
                            shape, dtype, peer)
            rec.end(tok, trace.COMPLETED if peer else trace.FAILED)
    events = [e for e in map(_chrome._event, tl._buf) if e[0] != "M"]
    tl.close()
    got = [e for e in _load(tl.path)["traceEvents"] if e["ph"] != "M"]
    want = [_reference(tl, e) for e in events]
    assert len(got) == len(want) == 2 * (2 * len(values) + 4 + 3)
    for g_, w in zip(got, want):
        w_args, g_args = w.pop("args", None), g_.pop("args", None)
        if g_args is not None:
            g_args.pop("line", None)                 # where the op was called (checked elsewhere)
            g_args.pop("group_ranks", None), (w_args or {}).pop("group_ranks", None)
            if w_args is not None and "group" in w_args and "group" in g_args:
                g_args["group"] = w_args["group"]    # the group's name (describe_group's)
        assert g_ == w
        assert g_args == w_args, (g_, w_args)
    text = open(tl.path).read()
    assert '"v":true}' in text and '"v":1}' in text and '"v":-0.0' in text and '"v":0.0' in text
    assert '"ts":-2500.001' in text and '"dur":1000.009' in text and "a%db" in text


def test_thread_name_metadata_reads_as_the_encoder_writes_it(tmp_path) -> None:
    # A thread's name is written without the JSON encoder: quotes, backslashes, control and
    # non-ASCII characters must come out as the encoder writes them, and metadata of any other
    # shape still goes through the encoder.
    tl = _chrome.Timeline(3, str(tmp_path))
    names = ["MainThread", 'a"b\\c', "tab\tnl\n", "\u00e9\u7ebf\U0001f600", ""]
    events = [("M", "thread_name", "", 0, 0, tid, {"name": n}) for tid, n in enumerate(names)]
    events += [("M", "thread_name", "", 0, 0, 7, {"name": 5}),
               ("M", "thread_name", "", 0, 0, 8, {"name": "x", "extra": 1}),
               ("M", "other", "", 0, 0, 9, {"name": "y"}), ("M", "bare", "", 0, 0, 2, None)]
    for ev in events:
        ph, name, _, _, _, tid, args = ev
        want = {"name": name, "ph": ph, "pid": 3, "tid": tid}
        if args:
            want["args"] = args
        assert tl._render([ev]) == _chrome._encode(want), ev
    with trace.span("s", "t"):  # a traced thread's name event, written and read back
        pass
    tl.close()
    trace.enable(tmp_path / "real")
    t = threading.Thread(target=lambda: trace.instant("m", "t"), name='w\u00f6rker "1"')
    t.start()
    t.join(30)
    trace.disable()
    evs = _load(tmp_path / "real" / "trace-rank0.json")["traceEvents"]
    assert {"name": "thread_name", "ph": "M", "pid": 0, "tid": 0,
            "args": {"name": 'w\u00f6rker "1"'}} in evs


def test_timeline_replaces_an_earlier_jobs_file(tmp_path) -> None:
    old = tmp_path / "trace-rank0.json"
    old.write_text('{"traceEvents":[' + '{"name":"old"},' * 1000 + "{}]}")
    tl = _chrome.Timeline(0, str(tmp_path))
    tl.instant("new", "m")
    tl.close()
    names = [e["name"] for e in _load(old)["traceEvents"]]
    assert "new" in names and "old" not in names
    fresh = tmp_path / "sub" / "dir"                  # a directory that does not exist yet
    tl = _chrome.Timeline(1, str(fresh))
    tl.close()
    assert _load(fresh / "trace-rank1.json")["traceEvents"][0]["name"] == "process_name"


def test_a_thread_follows_its_timeline_through_restarts_and_rank_changes(tmp_path) -> None:
    """Spans and marks find their timeline through a per-thread cache: a new directory after
    ``disable``/``enable``, a new process rank (``install``) or a thread bound to another rank
    (``bind_rank``) must each send the next events to the right file."""
    first, second = tmp_path / "a", tmp_path / "b"
    trace.enable(first)
    hooks.install(0, 2)
    with trace.span("one", "t"):
        pass
    trace.disable()
    trace.enable(second)
    trace.timeline(1)  # made before: changing the process rank alone must be noticed
    trace.instant("two", "t")
    hooks.install(1, 2)  # the process is now rank 1: its timeline, not rank 0's
    with trace.span("three", "t"):
        pass
    seen: list[str] = []

    def bound() -> None:
        trace.bind_rank(0)
        trace.instant("four", "t")
        trace.bind_rank(1)
        trace.instant("five", "t")
        seen.append("ok")

    t = threading.Thread(target=bound)
    t.start()
    t.join(30)
    trace.disable()
    hooks.install(0, 2)

    def names(path) -> list[str]:
        return [e["name"] for e in _load(path)["traceEvents"] if e["ph"] != "M"]

    assert seen == ["ok"]
    assert names(first / "trace-rank0.json") == ["one"]
    assert names(second / "trace-rank0.json") == ["two", "four"]
    assert names(second / "trace-rank1.json") == ["three", "five"]

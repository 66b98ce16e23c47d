"""Benchmark pictures from the JSON lines every benchmark writes with --json."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import asdict

import pytest

from conftest import job_env
from hpcdp.bench import _plot
from hpcdp.trace import benchplot
from hpcdp.bench._common import Row

PNG = b"\x89PNG\r\n\x1a\n"


def _rows() -> list[dict]:
    """One row of every shape the benchmarks write (as in hpcdp/bench/*.py)."""
    rows: list[dict] = []
    for op in ("allreduce", "all_gather"):
        for size in (8, 1024, 1 << 20, 4 << 20):
            t = 5 + size / 1e3
            rows.append(asdict(Row("collectives", op, size, size // 4, "float32", "sum", -1, t, size / t / 1e3,
                                   size / t / 1e3 * 1.0, t * 0.98, 1.02, 2, {"ratios": [1.02]})))
    for size in (8, 64, 1024):
        rows.append({"bench": "latency", "op": "allreduce", "size": size, "time_us": 6.0, "base_time_us": 4.5,
                     "diff_us": 1.5})
    rows.append({"bench": "summary", "name": "A1 allreduce busbw ratio (>= 1 MiB)", "value": 0.98,
                 "target": ">= 0.97", "ranks": 2})
    rows.append({"bench": "summary", "name": "A2 allreduce latency overhead us (8 B - 1 KiB, worst size)",
                 "value": 4.0, "target": "<= +3 us", "ranks": 2})
    for size in (1 << 20, 4 << 20):
        rows.append({"bench": "sim", "op": "allreduce", "size": size, "ranks": 4, "time_us": 900.0,
                     "base_time_us": 600.0, "ratio": 1.5})
        rows.append({"bench": "B1", "size": size, "iters": 10, "hpcdp_us": 400.0, "raw_us": 380.0,
                     "hpcdp_GBps": 2.5, "raw_GBps": 2.7, "time_ratio": 1.05, "bw_ratio": 0.95})
        rows.append({"bench": "B2", "ranks": 2, "size": size, "iters": 5, "hpcdp_us": 900.0,
                     "hpcdp_busbw_GBps": 1.2, "gloo_us": 1500.0, "gloo_busbw_GBps": 0.7, "busbw_ratio": 1.7})
    rows.append({"bench": "B1", "size": 8, "iters": 10, "hpcdp_us": 20.0, "raw_us": 16.0, "hpcdp_GBps": 0.0004,
                 "raw_GBps": 0.0005, "time_ratio": 1.25, "bw_ratio": 0.8})
    rows.append(asdict(Row("ddp", "D1 sync 1000 tensors", 4000, 1000, "float32", "mean", -1, 900.0, 0.004, 0.0,
                           3000.0, 0.3, 2, {"buckets": 1, "target": "<= 0.5"})))
    rows.append({"bench": "ddp", "op": "D4", "ranks": 2, "efficiency": 0.9, "t1_ms": 10.0, "t2_ms": 11.1})
    rows.append(asdict(Row("checkpoint", "save", 64 << 20, 16 << 20, "float32", "-", 0, 1e5, 0.6, 0.6, 9e4, 1.1, 2,
                           {"bw_ratio": 0.9, "target": 0.8})))
    return rows


def test_every_panel_is_built_with_its_target() -> None:
    rows = _rows()
    panels = benchplot._collective_panels(rows) + benchplot._pair_panels(rows)
    titles = [p.title for p in panels]
    assert "allreduce, 2 ranks: bus bandwidth" in titles and "all_gather, 2 ranks: time per op" in titles
    assert "allreduce latency (barrier between calls)" in titles
    assert {"TCP send/recv (B1): bandwidth", "TCP send/recv (B1): latency",
            "TCP allreduce (B2), 2 ranks: bus bandwidth"} <= set(titles)
    bw = panels[titles.index("allreduce, 2 ranks: bus bandwidth")]
    names = [s[0] for s in bw.series]
    assert names == ["hpcdp", "mpi4py", "target: >= 0.97 x mpi4py (>= 1 MiB)"]
    hp, base, tgt = bw.series
    # the baseline's busbw comes from its time: same bytes, busbw scales with 1/time
    assert base[2][-1] == pytest.approx(hp[2][-1] * (1 / 0.98))
    assert tgt[1] == [1 << 20, 4 << 20] and tgt[2][-1] == pytest.approx(base[2][-1] * 0.97)
    figs = {lab: (v, d, t) for lab, v, d, t in benchplot._figure_rows(rows)}
    assert figs["A2 allreduce latency overhead us (8 B - 1 KiB, worst size)"] == (4.0, "<=", 3.0)
    assert figs["D1 sync 1000 tensors: time / baseline"] == (0.3, "<=", 0.5)
    assert figs["D4 weak scaling efficiency, 2 ranks"] == (0.9, ">=", 0.85)
    assert figs["checkpoint save, 2 ranks: bw / MPI-IO"] == (0.9, ">=", 0.8)


@pytest.mark.timeout(180)
def test_plot_files_and_both_clis(tmp_path) -> None:
    src = tmp_path / "bench.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in _rows()) + "\n\n")
    out = _plot.plot_files([str(src)], str(tmp_path / "direct.png"))
    assert open(out, "rb").read(8) == PNG and os.path.getsize(out) > 20_000
    env = job_env()
    for cmd in (["-m", "hpcdp.trace", "plot-bench"], ["-m", "hpcdp.bench._plot"]):
        png = tmp_path / f"{cmd[1]}.png"
        p = subprocess.run([sys.executable, *cmd, str(src), "-o", str(png)], capture_output=True, text=True,
                           timeout=120, env=env, stdin=subprocess.DEVNULL)
        assert p.returncode == 0, p.stderr
        assert png.read_bytes()[:8] == PNG


def test_bad_input_is_reported_with_file_and_line(tmp_path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"bench": "sim"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not JSON"):
        _plot.load_rows([str(bad)])
    bad.write_text('[1, 2]\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: not a benchmark row"):
        _plot.load_rows([str(bad)])
    with pytest.raises(ValueError, match="no benchmark rows to plot"):
        _plot.plot_rows([{"bench": "unknown"}], str(tmp_path / "x.png"))


def test_plot_option_for_benchmarks(tmp_path) -> None:
    p = argparse.ArgumentParser()
    _plot.add_plot_argument(p)
    assert _plot.maybe_plot(p.parse_args([]), _rows()) is None
    rows = [Row(**{k: v for k, v in r.items()}) for r in _rows() if r["bench"] == "collectives"]
    out = _plot.maybe_plot(p.parse_args(["--plot", str(tmp_path / "sub" / "b.png")]), rows)
    assert out and open(out, "rb").read(8) == PNG


def test_pipeline_rows_are_figures_against_their_targets() -> None:
    rows = [{"bench": "F1", "schedule": "1f1b", "ranks": 4, "ratio": 1.04, "bubble": 0.30,
             "bubble_theory": 0.2727},
            {"bench": "F1", "schedule": "zero_bubble", "ranks": 4, "ratio": 1.2, "bubble": 0.2,
             "bubble_theory": 0.1}]
    figs = {lab: (v, d, t) for lab, v, d, t in benchplot._figure_rows(rows)}
    assert figs["F1 1f1b, 4 ranks: step / ideal"] == (1.04, "<=", 1.10)
    v, d, t = figs["F1 zero_bubble, 4 ranks: |bubble - theory|"]
    assert (v, d, t) == (pytest.approx(0.1), "<=", 0.03)


def test_deeply_nested_line_is_reported_with_file_and_line(tmp_path) -> None:
    bad = tmp_path / "deep.jsonl"
    bad.write_text('{"bench": "sim"}\n' + "[" * 100_000 + "\n")
    with pytest.raises(ValueError, match=r"deep.jsonl:2: not JSON \(RecursionError"):
        _plot.load_rows([str(bad)])


@pytest.mark.timeout(180)
def test_pipeline_benchmark_draws_its_plot(tmp_path) -> None:
    env = job_env()
    png = tmp_path / "pipeline.png"
    p = subprocess.run([sys.executable, "-m", "hpcdp.bench", "pipeline", "--ranks", "2", "--microbatches", "2",
                        "--trials", "1", "--t-f", "0.5", "--t-i", "0.5", "--t-w", "0.5", "--plot", str(png)],
                       capture_output=True, text=True, timeout=150, env=env, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"# plot: {png}" in p.stdout and png.read_bytes()[:8] == PNG


def test_fsdp_and_trace_rows_are_figures_against_their_targets() -> None:
    rows = [{"bench": "E3", "kind": "zero3", "ranks": 2, "ratio": 1.4},
            {"bench": "E3", "kind": "zero2", "ranks": 2, "ratio": 1.0},  # no target: not a figure
            {"bench": "E4", "ranks": 4, "ratio": 3.5},
            {"bench": "summary", "name": "T1 DDP example step: HPCDP_TRACE=1 / off", "value": 1.02,
             "target": "<= 1.05"}]
    figs = {lab: (v, d, t) for lab, v, d, t in benchplot._figure_rows(rows)}
    assert figs == {"E3 ZeRO-3 step / DDP step, 2 ranks": (1.4, "<=", 1.3),
                    "E4 ZeRO-3 / DDP model size, 4 ranks": (3.5, ">=", pytest.approx(3.2)),
                    "T1 DDP example step: HPCDP_TRACE=1 / off": (1.02, "<=", 1.05)}


def test_plot_sink_keeps_what_it_forwards() -> None:
    seen: list = []

    class Inner:
        def write(self, obj) -> None:
            seen.append(obj)

        def close(self) -> None:
            seen.append("closed")

    sink = _plot.PlotSink(Inner())
    sink.write({"bench": "sim"})
    sink.close()
    assert sink.rows == [{"bench": "sim"}] and seen == [{"bench": "sim"}, "closed"]


@pytest.mark.timeout(180)
def test_trace_benchmark_runs_and_draws_its_plot(tmp_path) -> None:
    """``python -m hpcdp.bench trace`` end to end on one simulated rank (the figures are noise here)."""
    env = job_env("HPCDP_TRACE", "HPCDP_TRACE_DIR")  # not the scratch one conftest sets
    png, js = tmp_path / "trace.png", tmp_path / "rows.jsonl"
    p = subprocess.run([sys.executable, "-m", "hpcdp.bench", "trace", "--trials", "2", "--steps", "3",
                        "--calls", "20", "--json", str(js), "--plot", str(png)],
                       capture_output=True, text=True, timeout=150, env=env, stdin=subprocess.DEVNULL,
                       cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "recorded operations per step" in p.stdout and "8 B allreduce fast path: recorder on" in p.stdout
    names = [json.loads(line)["name"] for line in js.read_text().splitlines()]
    assert names[0].startswith("T1 DDP example step") and len(names) == 3, names
    assert f"# plot: {png}" in p.stdout and png.read_bytes()[:8] == PNG
    assert not (tmp_path / "hpcdp-trace").exists()  # the traced trials wrote to a scratch directory


def test_files_with_summary_records_draw_those_alone() -> None:
    """A benchmark that writes summary records (with an id) is drawn from them: its own rows
    would draw the same figure twice, against a target typed apart from ``bench/_targets``."""
    rows = [{"bench": "E3", "kind": "zero3", "ranks": 2, "ratio": 1.4},
            {"bench": "summary", "id": "E3", "part": "zero3", "value": 1.4, "target": "<= 1.3",
             "ranks": 2},
            {"bench": "summary", "id": "G1", "name": "G1 save", "value": 0.97, "target": ">= 0.95"}]
    figs = {lab: (v, d, t) for lab, v, d, t in benchplot._figure_rows(rows)}
    assert figs == {"E3 zero3": (1.4, "<=", 1.3), "G1 save": (0.97, ">=", 0.95)}

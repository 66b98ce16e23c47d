"""examples/04_pipeline_gpt.py (simulated ranks, plain script, mpirun) and the pipeline benchmark's
figures that are not timings (F2, the theory it compares against)."""
from __future__ import annotations

import os
import runpy
import subprocess
import sys

import pytest

from conftest import run_mpi, run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "04_pipeline_gpt.py")
SHORT = ["--steps", "3", "--layers", "2", "--dim", "16", "--block", "16", "--batch-size", "4"]


def body_example(rank: int, extra: list[str]) -> dict:
    mod = runpy.run_path(EXAMPLE, run_name="example")
    return mod["train"](mod["parse_args"](SHORT + extra))


def _check_results(results: list[dict]) -> None:
    first = results[0]
    assert len(first["losses"]) == len(first["reference"]) == 3
    assert first["max_diff"] < 1e-9, first
    for r in results:   # every rank returns the same (replica-averaged) loss curve
        assert r["losses"] == first["losses"]
        assert r["peak_activations"] == r["predicted_peak"]


@pytest.mark.timeout(300)
def test_example_sim() -> None:
    _check_results(run_ranks("sim", 4, body_example, [], join_timeout=240))
    _check_results(run_ranks("sim", 4, body_example, ["--dp", "2", "--schedule", "zero_bubble"],
                             join_timeout=240))
    _check_results(run_ranks("sim", 2, body_example,
                             ["--schedule", "interleaved_1f1b", "--virtual", "2"], join_timeout=240))


@pytest.mark.timeout(300)
def test_example_plain_python() -> None:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI", "PMIX", "SLURM", "HPCDP_", "MASTER_"))}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, EXAMPLE, *SHORT, "--check"], capture_output=True,
                         text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "4 pipeline stages x 1 replicas" in out.stdout
    assert "max |pipeline - unpipelined| loss difference" in out.stdout


# Not a world of test_example_sim: that one runs three fixed layouts; the MPI world runs the one
# its size allows (data parallel only on an even size above 2).
@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
def test_example_mpi(mpi_world) -> None:
    extra = ["--dp", "2"] if mpi_world.size % 2 == 0 and mpi_world.size > 2 else []
    results = run_mpi(body_example, extra)
    _check_results(results)


def test_bench_theory() -> None:
    from hpcdp.bench.pipeline import theory

    t, b = theory("1f1b", 4, 8, 1, 1.0, 1.0, 1.0)
    assert (t, b) == (33.0, pytest.approx(3 / 11))
    t, b = theory("interleaved_1f1b", 4, 8, 2, 1.0, 1.0, 1.0)
    assert t == 24 + 4.5 and b == pytest.approx(3 / 19)
    t, b = theory("zero_bubble", 4, 8, 1, 1.0, 1.0, 1.0)
    assert (t, b) == (27.0, pytest.approx(3 / 27))


@pytest.mark.timeout(120)
def test_bench_f2_exact() -> None:
    # short sleeps: the peaks are what this checks, not the (machine-dependent) times
    import argparse

    from hpcdp.bench.pipeline import measure, report

    args = argparse.Namespace(ranks=4, microbatches=6, trials=1, t_f=0.5, t_i=0.5, t_w=0.5,
                              json=None, check=False)
    rows = measure(args)
    peaks = {r["schedule"]: r["peak"] for r in rows}
    assert peaks["gpipe"] == [6, 6, 6, 6]
    assert peaks["1f1b"] == [4, 3, 2, 1]
    assert peaks["zero_bubble"] == [4, 4, 4, 4]
    for r in rows:
        assert r["peak"] == r["predicted_peak"], r
        assert r["step_s"] > 0 and 0 <= r["bubble_theory"] < 1
    import io

    text = io.StringIO()
    report(rows, args, out=text)
    assert "F2 peak stashed activations" in text.getvalue() and "MISMATCH" not in text.getvalue()

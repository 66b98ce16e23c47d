"""The GPU check (``make test-gpu``, ``ci/gpu/run.sh``) runs here as a dry run, so it cannot rot
between the rare sessions that are lent a GPU machine: the same steps, on the numpy stand-in for
cupy, under the same time caps, writing the same report."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_gpu_check_dry_run_runs_every_step_and_reports(tmp_path) -> None:
    out = tmp_path / "gpu"
    env = dict(os.environ, PYTHON=sys.executable)
    for k in ("HPCDP_TEST_CUPY", "HPCDP_CUDA_AWARE", "OUT"):
        env.pop(k, None)
    p = subprocess.run(["bash", os.path.join(ROOT, "ci", "gpu", "run.sh"), "--dry-run", "--out", str(out)],
                       env=env, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    assert report["dry_run"] and report["passed"]
    steps = {s["name"]: s for s in report["steps"]}
    assert list(steps) == ["found", "cupy-single", "cupy-mpi2", "bench"]
    assert all(s["rc"] == 0 for s in steps.values()), steps
    for name in ("cupy-single", "cupy-mpi2"):  # the pytest steps ran tests, and none failed
        assert " passed" in steps[name]["summary"] and "failed" not in steps[name]["summary"], steps[name]
    found = report["found"]
    assert found["cupy"]["stand_in"] is True and "CUDA-aware" in found["cuda_aware"]
    assert "Open MPI" in found["mpi"]["library"] or "MPICH" in found["mpi"]["library"]
    a6 = [r for r in report["figures"] if r["bench"] == "gpu" and r["id"] == "A6"]
    assert [r["size"] for r in a6] == [4096, 1048576]
    for r in a6:
        assert r["a6"] > 0 and r["staging_overhead"] > 0 and r["target"] == 0.95
    assert sorted(r["strategy"] for r in report["figures"] if r["id"] == "train") == ["ddp", "full_shard"]
    summary = [r for r in report["figures"] if r["bench"] == "summary"]
    assert [r["id"] for r in summary] == ["A6"] and summary[0]["value"] == min(
        r["a6"] for r in a6 if r["size"] >= 1 << 20), summary
    assert (out / "gpu-check.log").read_text().count("== [") == 4

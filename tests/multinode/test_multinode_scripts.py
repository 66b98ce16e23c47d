"""What of the simulated cluster the single-process stage can check without building it: the
scripts parse, the Slurm template is filled in, the checks stay out of every other stage, and the
multinode benchmark runs (on one node, two TCP ranks: its arithmetic, not the network)."""
from __future__ import annotations

import glob
import json
import os
import re
import secrets
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CI = os.path.join(ROOT, "ci", "multinode")
SCRIPTS = sorted(glob.glob(os.path.join(CI, "*.sh")))


def test_the_scripts_are_there() -> None:
    names = {os.path.basename(p) for p in SCRIPTS}
    assert {"common.sh", "up.sh", "down.sh", "on.sh", "rsh.sh", "slurm.sh", "slurm-jobs.sh",
            "shape.sh", "test.sh", "bench.sh"} <= names, names


@pytest.mark.parametrize("script", SCRIPTS, ids=os.path.basename)
def test_script_parses_and_is_strict(script: str) -> None:
    res = subprocess.run(["bash", "-n", script], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    if not script.endswith("common.sh"):  # sourced, not run
        assert "set -euo pipefail" in open(script).read()


def test_slurm_template_is_fully_filled_in() -> None:
    template = open(os.path.join(CI, "slurm.conf.in")).read()
    start = open(os.path.join(CI, "slurm.sh")).read()
    names = set(re.findall(r"@[A-Z_0-9]+@", template))
    assert names and all(f"s|{n}|" in start or f'"{n}"' in start for n in names), names


def test_the_cluster_checks_stay_out_of_every_other_stage() -> None:
    """``check_*.py`` are collected only when asked for (``-o python_files=check_*.py``)."""
    res = subprocess.run([sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider",
                          os.path.join(HERE)], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert "check_" not in res.stdout, res.stdout
    checks = glob.glob(os.path.join(HERE, "*", "check_*.py"))
    assert len(checks) >= 4, checks


def test_multinode_benchmark_runs_on_one_node(tmp_path) -> None:
    out = tmp_path / "mn.jsonl"
    env = {k: v for k, v in os.environ.items()
           if k not in ("HPCDP_BACKEND", "MASTER_ADDR", "RANK", "WORLD_SIZE", "HPCDP_MASTER_ADDR")}
    env.update(PYTHONPATH=ROOT, HPCDP_SECRET=secrets.token_hex(32), OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-m", "hpcdp.run", "-n", "2", "-m", "hpcdp.bench",
                          "multinode", "--sizes", "0.0625", "--trials", "1", "--link-gbit", "2",
                          "--json", str(out)],
                         capture_output=True, text=True, timeout=120, env=env, cwd=ROOT,
                         stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "one node only" in res.stdout, res.stdout
    rows = [json.loads(line) for line in open(out)]
    m1 = [r for r in rows if r["op"] == "M1"]
    assert len(m1) == 1 and m1[0]["size"] == 64 << 10 and m1[0]["busbw_gbs"] > 0, rows
    assert 0 < m1[0]["hier_over_flat"] < 100, rows

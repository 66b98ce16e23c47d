"""Every jobs/*.sbatch tells ci/slurm/run-jobs.sh how to run and judge it on the one-node cluster;
the CI scripts parse. (The jobs themselves run under a real Slurm in ``make test-slurm``.)"""
from __future__ import annotations

import glob
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOBS = sorted(glob.glob(os.path.join(ROOT, "jobs", "*.sbatch")))
CI = os.path.join(ROOT, "ci", "slurm")


def _directives(path: str, key: str) -> list[str]:
    prefix = f"# ci: {key} "
    with open(path) as f:
        return [line[len(prefix):].rstrip("\n") for line in f if line.startswith(prefix)]


@pytest.mark.parametrize("path", JOBS, ids=os.path.basename)
def test_job_declares_how_ci_runs_and_checks_it(path: str) -> None:
    expects = _directives(path, "expect")
    assert expects, "no '# ci: expect REGEX' line: CI could not check the job's output"
    for regex in expects:
        re.compile(regex)  # POSIX ERE as grep -E reads it; these stay in the common subset
    sbatch = " ".join(_directives(path, "sbatch")).split()
    assert "--nodes=1" in sbatch, "CI's cluster has one node"
    # the example the job runs is the one CI checks for
    text = open(path).read()
    run = re.findall(r"python -m hpcdp\.run (examples/\S+\.py)", text)
    assert run and _directives(path, "needs") == run[:1], (run, _directives(path, "needs"))
    for t in _directives(path, "timeout"):
        assert t.isdigit() and 0 < int(t) <= 600


def test_every_example_job_is_there() -> None:
    names = {os.path.basename(p) for p in JOBS}
    assert {"collectives.sbatch", "ddp_train.sbatch", "fsdp_gpt.sbatch", "pipeline_gpt.sbatch",
            "preempt_requeue.sbatch", "task_farm.sbatch", "heat2d.sbatch"} <= names


def test_preemption_job_is_requeueable_and_signalled() -> None:
    text = open(os.path.join(ROOT, "jobs", "preempt_requeue.sbatch")).read()
    for line in ("#SBATCH --signal=USR1@60", "#SBATCH --requeue", "#SBATCH --open-mode=append"):
        assert line in text.splitlines()


@pytest.mark.parametrize("script", ["common.sh", "start.sh", "stop.sh", "run-jobs.sh", "test.sh"])
def test_ci_scripts_parse(script: str) -> None:
    res = subprocess.run(["bash", "-n", os.path.join(CI, script)], capture_output=True, text=True,
                         timeout=30)
    assert res.returncode == 0, res.stderr


def test_config_template_is_fully_filled_in() -> None:
    template = open(os.path.join(CI, "slurm.conf.in")).read()
    start = open(os.path.join(CI, "start.sh")).read()
    names = set(re.findall(r"@[A-Z_]+@", template))
    assert names and all(f"s|{n}|" in start for n in names), names
    for line in ("SlurmdParameters=config_overrides", "JobRequeue=1", "MinJobAge=4"):
        assert line in template.splitlines()

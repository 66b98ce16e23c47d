"""A node's network cut mid-step, on the TCP backend under ``hpcdp-run --max-restarts``:

- every rank, on both sides of the cut, fails with a clear error within the job's timeout;
- each rank's flight record names the node it lost (host name and address), not only ranks;
- once the link is back, both launchers restart their ranks, which rendezvous again and resume
  from the last checkpoint on the shared directory, ending where a run that was never cut ends.

Runs outside the nodes (``ci/multinode/test.sh``: ``pytest -o python_files=check_*.py
tests/multinode/host``): it starts one ``hpcdp-run`` per node through
``ci/multinode/on.sh`` and takes node 1's interface down with ``ip -n hpcdp-n1 link set eth0 down``.
"""
from __future__ import annotations

import glob
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
ON = os.path.join(REPO, "ci", "multinode", "on.sh")
TRAIN = os.path.join(REPO, "tests", "multinode", "host", "train_link.py")
RUN = [sys.executable, "-m", "hpcdp.run"]
NODES = ("hpcdp-n0", "hpcdp-n1")
TIMEOUT = 8.0           # HPCDP_TIMEOUT of the job: the bound on every rank's error
STEPS, SAVE_EVERY, STEP_TIME = 120, 10, 0.05


def _shared() -> str:
    path = os.environ.get("HPCDP_MN_SHARED")
    if not path or not os.path.isdir(path):
        pytest.fail("HPCDP_MN_SHARED is not set: run through ci/multinode/test.sh")
    return path


def _env(work: str, secret: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "SLURM_", "HPCDP_MN_", "MASTER_", "RANK"))}
    env.update(HPCDP_SECRET=secret, HPCDP_TIMEOUT=str(TIMEOUT), HPCDP_CONNECT_TIMEOUT="90",
               HPCDP_TRACE_DIR=os.path.join(work, "trace"), PYTHONPATH=REPO)
    env.pop("HPCDP_BACKEND", None)
    return env


def _launch(node_rank: int, nnodes: int, nproc: int, work: str, env: dict[str, str],
            restarts: int) -> subprocess.Popen:
    cmd = [ON, NODES[node_rank], *RUN, "-n", str(nproc), "--nnodes", str(nnodes),
           "--node-rank", str(node_rank), "--master-addr", NODES[0],
           "--max-restarts", str(restarts), TRAIN, os.path.join(work, "ckpt"), str(STEPS),
           str(SAVE_EVERY), str(STEP_TIME)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=REPO, stdin=subprocess.DEVNULL)


def _link(node: str, state: str) -> None:
    subprocess.run(["ip", "-n", node, "link", "set", "eth0", state], check=True, timeout=10)


def _failure_records(trace: str) -> dict[int, dict]:
    """The flight records that ranks dumped on an uncaught error, by rank."""
    out = {}
    for path in glob.glob(os.path.join(trace, "flight-rank*.json")):
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            continue  # being written
        if "uncaught" in doc.get("reason", ""):
            out[int(doc["rank"])] = doc
    return out


def _checksum(text: str) -> str:
    m = re.search(rf"done: {STEPS} steps, checksum (\S+)", text)
    assert m, text[-3000:]
    return m.group(1)


def test_cut_link_fails_every_rank_in_time_and_restarts_from_the_checkpoint() -> None:
    work = tempfile.mkdtemp(prefix="link-cut-", dir=_shared())
    env = _env(work, secrets.token_hex(32))
    procs = [_launch(k, 2, 2, work, env, restarts=1) for k in (1, 0)][::-1]
    cut = None
    try:
        first = os.path.join(work, "ckpt", f"step-{3 * SAVE_EVERY}")
        deadline = time.monotonic() + 90
        while not os.path.isdir(first):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                "the job did not reach its third checkpoint"
            time.sleep(0.05)
        # mid-step, not inside the save that just committed (its last barrier may still run)
        time.sleep(4 * STEP_TIME)
        saved = sorted(int(d.rsplit("-", 1)[1]) for d in os.listdir(os.path.join(work, "ckpt"))
                       if re.fullmatch(r"step-\d+", d))
        _link(NODES[1], "down")
        cut = time.monotonic()
        records: dict[int, dict] = {}
        while len(records) < 4 and time.monotonic() < cut + TIMEOUT + 20:
            records = _failure_records(os.path.join(work, "trace"))
            time.sleep(0.05)
        took = time.monotonic() - cut
        # kept before the restart overwrites them (flight-rank<N>.json per rank, not per attempt)
        records = {r: json.loads(json.dumps(d)) for r, d in records.items()}
    finally:
        if cut is not None:
            _link(NODES[1], "up")
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=150)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate()[0])
    assert sorted(records) == [0, 1, 2, 3], (sorted(records), outs)
    # every rank failed, and within the job's timeout (plus the time to write the record)
    assert took <= TIMEOUT + 4, f"the last rank's error came {took:.1f} s after the cut"
    for r, doc in records.items():
        lost = NODES[1 - r // 2]
        reason = doc["reason"]
        assert re.search(r"CommTimeoutError|PeerFailureError", reason), reason
        assert f"timed out after {TIMEOUT:g} s" in reason or "closed" in reason, reason
        assert doc["host"] == NODES[r // 2], doc["host"]
        # the record names the node that went missing, by name and address
        assert lost in reason and "10.213.0." in reason, f"rank {r}: {reason}"
    for k, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"node {k}: exit code {p.returncode}\n{out[-4000:]}"
        assert "restarting all 2 rank(s) (restart 1 of 1)" in out, out[-4000:]
    resumed = re.search(r"attempt 1 on 4 ranks: resumed from step-(\d+)", outs[0])
    assert resumed and int(resumed.group(1)) == saved[-1], (saved, outs[0][-3000:])
    # the same job never cut, on one node: the same parameters, bit for bit
    ref = tempfile.mkdtemp(prefix="link-ref-", dir=_shared())
    try:
        p = _launch(0, 1, 4, ref, _env(ref, secrets.token_hex(32)), restarts=0)
        out = p.communicate(timeout=120)[0]
        assert p.returncode == 0, out[-3000:]
        assert _checksum(outs[0]) == _checksum(out), (outs[0][-2000:], out[-2000:])
    finally:
        shutil.rmtree(ref, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)

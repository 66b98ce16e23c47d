"""Cluster layout for the launcher: SLURM nodelists and this node's place in a multi-node job."""
from __future__ import annotations

import re
import shutil
import subprocess
from typing import Mapping

__all__ = ["parse_nodelist", "expand_nodelist", "node_layout", "SCONTROL_TIMEOUT"]

#: seconds ``scontrol show hostnames`` may take before the built-in expansion is used instead
SCONTROL_TIMEOUT = 10.0


def parse_nodelist(spec: str) -> list[str]:
    """Expand a SLURM nodelist such as ``node[01-03,7],gpu7`` into host names.

    Slurm's own ``scontrol show hostnames`` when it is on ``PATH`` (it knows every syntax the
    installed Slurm accepts); when it is absent, fails, prints nothing or takes more than
    ``SCONTROL_TIMEOUT`` s, the built-in expansion (``expand_nodelist``).
    """
    if spec and shutil.which("scontrol"):
        try:
            res = subprocess.run(["scontrol", "show", "hostnames", spec], capture_output=True,
                                 text=True, timeout=SCONTROL_TIMEOUT, stdin=subprocess.DEVNULL)
            hosts = res.stdout.split()
            if res.returncode == 0 and hosts:
                return hosts
        except (OSError, subprocess.SubprocessError):
            pass
    return expand_nodelist(spec)


def expand_nodelist(spec: str) -> list[str]:
    """The built-in expansion: ``node[01-03,7],gpu7`` or ``r[1-2]-n[1-2]`` into host names
    (zero-padded ranges, several bracket groups, later ones varying fastest as in SLURM)."""
    hosts: list[str] = []
    for item in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", spec):  # commas outside brackets split
        hosts += _expand_hosts(item)
    return hosts


def _expand_hosts(pattern: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", pattern)
    if m is None:
        return [pattern]
    head, tail = pattern[:m.start()], pattern[m.end():]
    out: list[str] = []
    for part in m.group(1).split(","):
        if "-" in part:
            a, b = part.split("-", 1)
            values = [f"{i:0{len(a)}d}" for i in range(int(a), int(b) + 1)]
        else:
            values = [part]
        for v in values:
            out += _expand_hosts(head + v + tail)  # later brackets vary fastest, as in SLURM
    return out


def _slurm_int(environ: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        raw = environ.get(name)
        if raw:
            if not raw.isdigit():
                raise SystemExit(f"hpcdp-run: {name}={raw!r} is not a number")
            return int(raw)
    return None


def node_layout(nnodes: int | None, node_rank: int | None, master_addr: str | None,
                environ: Mapping[str, str]) -> tuple[int, int, str]:
    """``(nnodes, node_rank, master_addr)``: the flags given, the rest from SLURM or defaults.

    Under SLURM (``SLURM_JOB_ID`` set) the node count and master (first host) come from the
    srun step (``SLURM_STEP_NUM_NODES``, ``SLURM_STEP_NODELIST``) or, in the batch script
    itself, from the job (``SLURM_JOB_NUM_NODES``/``SLURM_NNODES``, ``SLURM_JOB_NODELIST``);
    this node's rank from ``SLURM_NODEID``. Without SLURM: one node, master 127.0.0.1.

    Args:
        nnodes, node_rank, master_addr: the command-line values (None where not given).
        environ: the environment to read, normally ``os.environ``.
    """
    if environ.get("SLURM_JOB_ID"):
        step = bool(environ.get("SLURM_STEP_NODELIST"))
        nodelist = (environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
                    or environ.get("SLURM_NODELIST") or "")
        hosts = parse_nodelist(nodelist)
        if step:
            count = _slurm_int(environ, "SLURM_STEP_NUM_NODES")
            tasks = _slurm_int(environ, "SLURM_STEP_NUM_TASKS")
            if nnodes is None and node_rank is None and tasks is not None and count is not None \
                    and tasks > count:
                raise SystemExit(
                    f"hpcdp-run: this srun step runs {tasks} tasks on {count} node(s); start one "
                    f"launcher per node (srun -n {count} --ntasks-per-node=1 hpcdp-run -n "
                    f"RANKS_PER_NODE ...: inside a batch job srun takes the job's task count, "
                    f"and --ntasks-per-node=1 alone is ignored)")
        else:
            count = _slurm_int(environ, "SLURM_JOB_NUM_NODES", "SLURM_NNODES")
        if nnodes is None:
            nnodes = count if count is not None else (len(hosts) or None)
        if node_rank is None:
            node_rank = _slurm_int(environ, "SLURM_NODEID")
        if master_addr is None and hosts:
            master_addr = hosts[0]
    nnodes = 1 if nnodes is None else nnodes
    node_rank = 0 if node_rank is None else node_rank
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise SystemExit(f"hpcdp-run: --node-rank {node_rank} is outside --nnodes {nnodes}")
    return nnodes, node_rank, master_addr or "127.0.0.1"

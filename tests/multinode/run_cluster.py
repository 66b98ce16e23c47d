"""Run the checks of ``tests/multinode/cluster`` on every rank of a job spanning the simulated nodes.

    mpirun --host hpcdp-n0:2,hpcdp-n1:2 ... python tests/multinode/run_cluster.py --min-tests N
    hpcdp-run -n 2 --nnodes 2 --node-rank K ... tests/multinode/run_cluster.py --min-tests N
    srun ... python tests/multinode/run_cluster.py --min-tests N

Like ``tests/run_mpi.py`` (whose rules it follows: rank 0 prints, the others write
``rank<N>.log`` and copy it to stderr only when their pytest failed; a run in which fewer than
``--min-tests`` tests ran fails), but for any launcher: the rank comes from ``RANK`` (hpcdp-run)
or the MPI/Slurm variables, and the logs go to ``HPCDP_MN_LOGS`` (a directory every node sees).

The checks live in ``check_*.py`` files, which pytest collects only when told to
(``-o python_files=check_*.py``, as here and in ``ci/multinode/test.sh``): every other run of the
suite (``make test``'s single-process and ``mpirun -n 2/-n 4`` stages, a plain ``pytest tests``)
does not even import them, so they cannot disturb it, and they need a cluster to mean anything.
"""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RANK_VARS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")
TOO_FEW_TESTS = 6


def _rank() -> int:
    for name in RANK_VARS:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


class _Counter:
    """Counts the tests whose body ran on this rank (passed or failed, not skipped)."""

    def __init__(self) -> None:
        self.ran = 0

    def pytest_runtest_logreport(self, report) -> None:  # noqa: ANN001 - pytest's TestReport
        if report.when == "call":
            self.ran += 1


def main(argv: list[str]) -> int:
    minimum = 0
    if argv[:1] == ["--min-tests"]:
        minimum, argv = int(argv[1]), argv[2:]
    rank = _rank()
    logs = os.environ.get("HPCDP_MN_LOGS") or os.path.join(os.getcwd(), ".pytest-mpi")
    log_path = os.path.join(logs, f"multinode-rank{rank}.log")
    real_stderr = None
    if rank != 0:
        os.makedirs(logs, exist_ok=True)
        sys.stdout.flush()
        sys.stderr.flush()
        real_stderr = os.dup(2)
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)

    import pytest

    counter = _Counter()
    paths = [a for a in argv if not a.startswith("-")] or [os.path.join(HERE, "cluster")]
    opts = [a for a in argv if a.startswith("-")]
    code = int(pytest.main(["-q", "-p", "no:cacheprovider", "-o", "python_files=check_*.py",
                            *opts, *paths],
                           plugins=[counter]))
    if code == 0 and counter.ran < minimum:
        print(f"run_cluster: rank {rank}: only {counter.ran} test(s) ran, --min-tests asks for "
              f"{minimum}: failing", flush=True)
        code = TOO_FEW_TESTS
    sys.stdout.flush()
    sys.stderr.flush()
    if real_stderr is not None and code != 0:
        with open(log_path, "rb") as f:
            text = f.read()
        # not the "===== rank N" markers of tests/run_mpi.py: `make test`'s summary would read
        # this rank's count as a stage's, and this stage ends with a count of its own
        os.write(real_stderr, f"----- rank {rank}: pytest exit code {code}; its log -----\n".encode()
                 + text + f"----- end of rank {rank}'s log -----\n".encode())
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

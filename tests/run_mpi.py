"""Run the MPI-marked tests on every rank of an mpirun/srun job.

    mpirun -n 2 --oversubscribe .venv/bin/python tests/run_mpi.py [pytest args...]

Every rank runs ``pytest -q --with-mpi -m mpi -p no:cacheprovider tests`` (pytest-mpi's marker
``@pytest.mark.mpi(min_size=...)``).  Rank 0 prints normally; every other rank writes its output to
``.pytest-mpi/rank<N>.log`` (``rank<N>.<job>.log`` when the launcher names the job: two jobs
running side by side in one checkout must not overwrite each other's logs; kept only when its
pytest failed) and, only if its pytest failed, copies that log to the real stderr at the end.
Each rank exits with its pytest exit code, so mpirun fails when any rank failed.  Exit code 5
("no tests collected") counts as success: a subset with no MPI tests is not an error.

The rank is read from the launcher's environment, before anything imports mpi4py (MPI is
initialised by the tests' own import of mpi4py, with all output already redirected).
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOG_DIR = os.path.join(REPO, ".pytest-mpi")
RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")
SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")
JOB_VARS = ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "SLURM_JOB_ID")


def _env_int(names: tuple[str, ...], default: int) -> int:
    for name in names:
        value = os.environ.get(name)
        if value is not None and value.strip().lstrip("-").isdigit():
            return int(value)
    return default


def _log_name(rank: int) -> str:
    """``rank<N>.log``, with the launcher's job id when it gives one (a job of its own)."""
    for name in JOB_VARS:
        job = "".join(c for c in os.environ.get(name, "") if c.isalnum() or c in "-_")
        if job:
            if name == "SLURM_JOB_ID" and os.environ.get("SLURM_STEP_ID", "").isdigit():
                job += "." + os.environ["SLURM_STEP_ID"]
            return f"rank{rank}.{job}.log"
    return f"rank{rank}.log"


def _pytest_args(extra: list[str]) -> list[str]:
    args = ["-q", "--with-mpi", "-m", "mpi", "-p", "no:cacheprovider"]
    # Default to the whole tests/ directory unless the caller named test paths of its own
    # (an argument that exists on disk, optionally with a ::node suffix).
    if not any(not a.startswith("-") and os.path.exists(a.split("::")[0]) for a in extra):
        args.append(os.path.relpath(os.path.join(REPO, "tests")))
    return args + extra


def main() -> int:
    rank = _env_int(RANK_VARS, 0)
    size = _env_int(SIZE_VARS, 1)
    log_path = None
    real_stderr = None
    if rank != 0:
        os.makedirs(LOG_DIR, exist_ok=True)
        log_path = os.path.join(LOG_DIR, _log_name(rank))
        sys.stdout.flush()
        sys.stderr.flush()
        real_stderr = os.dup(2)
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    else:
        others = "rank 1" if size == 2 else f"ranks 1-{size - 1}"
        print(f"run_mpi: {size} ranks; output of {others} in "
              f"{os.path.relpath(LOG_DIR)}/{_log_name(0).replace('rank0', 'rank<N>')}", flush=True)

    import pytest  # after the redirect, so plugin import noise lands in the log too

    class _CompactMPIInfo:
        """Replace pytest-mpi's long "MPI Information" section (whose library-version string ends
        in a NUL byte with Open MPI 4, which makes CI logs look binary) by one line."""

        @pytest.hookimpl(trylast=True)
        def pytest_configure(self, config):
            for plugin in config.pluginmanager.get_plugins():
                if type(plugin).__name__ == "MPIPlugin" and hasattr(plugin, "_is_testing_mpi"):
                    plugin._is_testing_mpi = False  # only gates that section

        def pytest_terminal_summary(self, terminalreporter):
            mpi = sys.modules.get("mpi4py.MPI")
            if mpi is not None:
                version = mpi.Get_library_version().replace("\0", "").strip()
                version = version.splitlines()[0].split(",")[0] if version else "?"
                terminalreporter.write_line(
                    f"MPI: rank {mpi.COMM_WORLD.Get_rank()} of {mpi.COMM_WORLD.Get_size()}, "
                    f"{version}, mpi4py {sys.modules['mpi4py'].__version__}")

    code = int(pytest.main(_pytest_args(sys.argv[1:]), plugins=[_CompactMPIInfo()]))
    if code == pytest.ExitCode.NO_TESTS_COLLECTED:
        code = 0

    if log_path is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        if code != 0:
            with open(log_path, errors="replace") as f:
                text = f.read()
            msg = (f"\n===== rank {rank}: pytest exit code {code}; its log ({log_path}) =====\n"
                   f"{text}\n===== end of rank {rank} log =====\n")
            os.write(real_stderr, msg.encode())
        elif os.path.basename(log_path) != f"rank{rank}.log":
            os.unlink(log_path)  # one file per job would pile up; a passing rank's log is noise
    return code


if __name__ == "__main__":
    sys.exit(main())

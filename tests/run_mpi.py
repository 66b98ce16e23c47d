"""Run the MPI-marked tests on every rank of an mpirun/srun job.

    mpirun -n 2 --oversubscribe .venv/bin/python tests/run_mpi.py [--min-tests N] [pytest args...]

Every rank runs ``pytest -q --with-mpi -m mpi -p no:cacheprovider tests`` (pytest-mpi's marker
``@pytest.mark.mpi(min_size=...)``).  Rank 0 prints normally; every other rank writes its output to
``.pytest-mpi/rank<N>.log`` (``rank<N>.<job>.log`` when the launcher names the job: two jobs
running side by side in one checkout must not overwrite each other's logs; kept only when its
pytest failed) and, only if its pytest failed, copies that log to the real stderr at the end.
Each rank exits with its pytest exit code, so mpirun fails when any rank failed.

A run that tests nothing must not pass for one that tested everything (a broken ``-m mpi``
selection, a conftest that stops collecting, a plugin that skips all): so exit code 5 ("no tests
collected") is success only when the caller narrowed the selection itself (named test paths, or
``-k``/``-m``/``--deselect``/``--ignore``/``--lf``: a subset with no MPI tests is not an error),
and ``--min-tests N`` (the ``make test`` stages pass it) makes every rank fail with exit code 6
unless at least N tests ran on it (passed or failed; skipped ones do not count).  The minimum is
not checked on a narrowed selection, which says so on rank 0.

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
#: pytest options that narrow the selection on purpose (an empty or small result is then fine)
NARROWING = ("-k", "-m", "--deselect", "--ignore", "--ignore-glob", "--lf", "--last-failed",
             "--sw", "--stepwise", "--co", "--collect-only")
#: exit code of a rank on which fewer tests ran than ``--min-tests`` asked (pytest uses 0-5)
TOO_FEW_TESTS = 6


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


def _names_paths(extra: list[str]) -> bool:
    """Whether the caller named test paths of its own (an argument that exists on disk,
    optionally with a ::node suffix)."""
    return any(not a.startswith("-") and os.path.exists(a.split("::")[0]) for a in extra)


def _narrowed(extra: list[str]) -> bool:
    """Whether the caller chose a subset: named paths or a selecting option."""
    return _names_paths(extra) or any(a.split("=")[0] in NARROWING or
                                      (a.startswith("-k") and a != "-k") for a in extra)


def _split_min_tests(argv: list[str]) -> tuple[int | None, list[str]]:
    """``--min-tests N`` / ``--min-tests=N`` taken out of ``argv`` (the rest goes to pytest)."""
    minimum: int | None = None
    rest: list[str] = []
    it = iter(argv)
    for a in it:
        if a == "--min-tests" or a.startswith("--min-tests="):
            value = a.partition("=")[2] if "=" in a else next(it, "")
            if not value.isdigit():
                raise SystemExit(f"run_mpi: --min-tests needs a count >= 0, got {value!r}")
            minimum = int(value)
        else:
            rest.append(a)
    return minimum, rest


def _pytest_args(extra: list[str]) -> list[str]:
    args = ["-q", "--with-mpi", "-m", "mpi", "-p", "no:cacheprovider"]
    # Default to the whole tests/ directory unless the caller named test paths of its own.
    if not _names_paths(extra):
        args.append(os.path.relpath(os.path.join(REPO, "tests")))
    return args + extra


class _Counter:
    """Counts the tests whose body ran on this rank (passed or failed, not skipped)."""

    def __init__(self) -> None:
        self.ran = 0

    def pytest_runtest_logreport(self, report) -> None:  # noqa: ANN001 - pytest's TestReport
        if report.when == "call":
            self.ran += 1


def _verdict(code: int, ran: int, minimum: int | None, narrowed: bool,
             rank: int) -> tuple[int, str | None]:
    """This rank's exit code from pytest's and the count of tests that ran, and why it changed
    (None: kept)."""
    import pytest

    if code == pytest.ExitCode.NO_TESTS_COLLECTED:
        if narrowed:
            return 0, None
        return code, (f"run_mpi: rank {rank}: no MPI test collected from the whole of tests/ "
                      "(is the '-m mpi' selection or a conftest broken?): failing")
    if code == 0 and minimum is not None and not narrowed and ran < minimum:
        return TOO_FEW_TESTS, (f"run_mpi: rank {rank}: only {ran} test(s) ran, "
                               f"--min-tests asks for at least {minimum}: failing "
                               f"(exit code {TOO_FEW_TESTS})")
    return code, None


def main() -> int:
    minimum, extra = _split_min_tests(sys.argv[1:])
    narrowed = _narrowed(extra)
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

    counter = _Counter()
    code = int(pytest.main(_pytest_args(extra), plugins=[_CompactMPIInfo(), counter]))
    code, why = _verdict(code, counter.ran, minimum, narrowed, rank)
    if why is not None:
        print(why, flush=True)
    elif minimum is not None and narrowed and rank == 0:
        print(f"run_mpi: a narrowed selection: --min-tests {minimum} not checked "
              f"({counter.ran} ran)", flush=True)

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

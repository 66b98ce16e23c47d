"""cupy arrays on MPI: straight to the library when it is CUDA-aware, else through pinned host copies.

Whether the library can read device memory is found by a functional probe, not by asking it:
``MPIX_Query_cuda_support`` and ``MPI_Query_cuda_support`` report how Open MPI was built, not
whether the transport in use at run time handles device pointers (a CUDA build running over a
transport without CUDA support says yes; an MPICH or a wheel without the extension cannot say at
all). The probe sends a device buffer to itself over ``COMM_SELF`` and compares. A library that
is not CUDA-aware dereferences the device pointer on the host and crashes, so the probe runs in a
child process (a singleton MPI job of its own, with the launcher's variables removed so it does
not join this job): a crash, a hang past its time limit or a wrong value all mean "not CUDA-aware"
and host staging, never a segfault in the caller.
"""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ..._config import raw, setting
from .._staging import HostPool, stage
from ..base import Request

if TYPE_CHECKING:
    from ._backend import MPIBackend

__all__ = ["Staging", "cuda_aware", "staged", "probe_cuda_aware", "PROBE_TIMEOUT"]

Staging = HostPool  # the MPI backend's name for its pool

#: seconds the probe's child process may take (starting MPI and CUDA in it included)
PROBE_TIMEOUT = 60.0

#: The child: send 4096 float64 on the device to itself over COMM_SELF and compare. Exit 0 and
#: "aware" only when the values arrived; any failure (including a crash) means staging.
_PROBE = r"""
import sys
import cupy
print("cupy", flush=True)  # cupy imports: a failure from here on is MPI's or the copy's
from mpi4py import MPI
n = 4096
src = cupy.arange(n, dtype=cupy.float64) * 3.0 + 1.0
dst = cupy.zeros(n, dtype=cupy.float64)
cupy.cuda.get_current_stream().synchronize()
MPI.COMM_SELF.Barrier()
print("sent", flush=True)  # MPI started; a crash from here on is the library reading device memory
MPI.COMM_SELF.Sendrecv([src, MPI.DOUBLE], 0, 7, [dst, MPI.DOUBLE], 0, 7)  # device pointers (CAI)
ok = bool((dst == src).all())
print("aware" if ok else "wrong-values", flush=True)
"""

#: The variables a launcher sets to make a process one rank of its job (Open MPI 4 and 5, MPICH's
#: hydra, PMI/PMIx, Slurm): without them the probe starts a singleton job of its own. Settings
#: (``OMPI_MCA_plm_rsh_agent``, ``OMPI_MCA_btl``, ...) stay: a lent GPU machine without ssh runs
#: mpirun only because its image sets the launch agent, and a probe that dropped it failed there.
_LAUNCHER_PREFIXES = ("OMPI_COMM_WORLD_", "OMPI_UNIVERSE_SIZE", "OMPI_FIRST_RANKS", "OMPI_APP_CTX_",
                      "OMPI_NUM_APP_CTX", "OMPI_FILE_LOCATION", "OMPI_ARGV", "OMPI_COMMAND",
                      "OMPI_MCA_ess", "OMPI_MCA_orte_", "OMPI_MCA_pmix", "OMPI_MCA_initial_wdir",
                      "OMPI_MCA_shmem_RUNTIME_QUERY_hint", "PMIX_", "PMI_", "PRTE_", "HYDRA_",
                      "MPIR_", "SLURM_", "I_MPI_HYDRA")


def probe_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without the launcher's job variables."""
    env = dict(os.environ if env is None else env)
    return {k: v for k, v in env.items() if not k.startswith(_LAUNCHER_PREFIXES)}


def probe_cuda_aware(*, timeout: float = PROBE_TIMEOUT, script: str = _PROBE) -> tuple[bool, str]:
    """(CUDA-aware, what the probe saw), from a child process that sends device memory to itself.

    The child starts as a singleton MPI job; where the library cannot start one (Open MPI 4
    without a working ``orted`` spawn, seen on a lent GPU machine), it runs once more under
    ``mpirun -n 1``. A child killed by a signal answers at once: the library read device memory
    as host memory, which is what "not CUDA-aware" looks like.
    """
    aware, why, started = _probe_once([sys.executable, "-c", script], timeout)
    if aware or started:
        return aware, why
    launcher = _launcher()
    if launcher is None:
        return False, why + "; no mpirun/mpiexec to retry under"
    aware2, why2, _ = _probe_once([*launcher, "-n", "1", sys.executable, "-c", script], timeout)
    return aware2, f"{why2} (under {os.path.basename(launcher[0])} -n 1; as a singleton: {why})"


def _launcher() -> list[str] | None:
    exe = shutil.which("mpirun") or shutil.which("mpiexec")
    if exe is None:
        return None
    if "Open MPI" not in _version_text(exe):
        return [exe]
    return [exe, "--oversubscribe"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])


def _version_text(exe: str) -> str:
    try:
        return subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30,
                              stdin=subprocess.DEVNULL).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def _probe_once(cmd: list[str], timeout: float) -> tuple[bool, str, bool]:
    """(aware, why, whether the child got as far as sending): a child that could not start MPI
    proves nothing either way."""
    try:
        p = subprocess.run(cmd, env=probe_env(), capture_output=True, text=True, timeout=timeout,
                           stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return False, f"probe did not finish in {timeout:g} s", True
    except OSError as exc:
        return False, f"probe could not start: {exc}", False
    out = p.stdout.strip()
    if p.returncode == 0 and out.endswith("aware") and not out.endswith("wrong-values"):
        return True, "device buffer sent to itself over COMM_SELF arrived intact", True
    if out.endswith("wrong-values"):
        return False, "device buffer sent to itself arrived with wrong values", True
    if p.returncode < 0 or "signal 11" in p.stderr or "Segmentation fault" in p.stderr:
        sig = -p.returncode if p.returncode < 0 else 11
        return False, f"probe killed by signal {sig} (the library read device memory as host memory)", True
    tail = " | ".join((p.stderr.strip() or out or "no output").splitlines()[-3:])[:400]
    # (a child that could not import cupy has nothing to retry; one that could not start MPI has)
    return False, f"probe exit {p.returncode}: {tail}", "sent" in out or "cupy" not in out.split()


def cuda_aware() -> bool:
    """Whether the MPI library reads device memory (``HPCDP_CUDA_AWARE=0/1`` overrides the probe)."""
    forced = setting("HPCDP_CUDA_AWARE")
    return _probed()[0] if forced is None else forced


@functools.lru_cache(maxsize=1)
def _probed() -> tuple[bool, str]:
    """The probe, once per process (it costs a process start, MPI's and CUDA's)."""
    return probe_cuda_aware()


def describe() -> str:
    """One line for ``python -m hpcdp info`` and the GPU report."""
    env = raw("HPCDP_CUDA_AWARE")
    if env is not None:
        return f"CUDA-aware: {cuda_aware()} (HPCDP_CUDA_AWARE={env.strip()})"
    aware, why = _probed()
    return f"CUDA-aware: {aware} ({why})"


def staged(be: "MPIBackend", method: Callable[..., Request], names: Sequence[str],
           args: tuple[Any, ...]) -> Request:
    """``method`` on cupy ``args``: directly when MPI is CUDA-aware (after the stream is
    synchronised: MPI must see finished kernels), else on pinned host copies."""
    import cupy  # type: ignore[import-not-found]

    if be.cuda_aware is None:  # decided at the first cupy call, not at every group's creation
        be.cuda_aware = cuda_aware()
    if be.cuda_aware:
        cupy.cuda.get_current_stream().synchronize()
        req = method(be, *args)
        req.keep = (args, req.keep)
        return req
    return stage(be._staging, functools.partial(method, be), method.__name__, names, args)

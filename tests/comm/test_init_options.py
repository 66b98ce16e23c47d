"""``hpcdp.init(some_typo=1)``: every backend refuses an option it does not take, with the same
``TypeError`` naming the option, the backend and what it accepts (before this, MPI and TCP
silently ignored it)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import hpcdp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _expected(name: str, accepted: str) -> str:
    return (f"init(backend={name!r}): unknown option(s) 'some_typo'; the {name} backend accepts "
            f"{accepted} (besides timeout)")


def test_sim_refuses_an_unknown_option() -> None:
    with pytest.raises(TypeError) as info:
        hpcdp.init("sim", some_typo=1)
    assert str(info.value) == _expected("sim", "rank, world, world_size")
    assert not hpcdp.is_initialized()


def _in_process(code: str, **env: str) -> subprocess.CompletedProcess:
    full = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                **env)
    for k in ("HPCDP_BACKEND", "HPCDP_MASTER_ADDR", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        full.pop(k, None)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120, env=full, stdin=subprocess.DEVNULL)


CHECK = """
    import sys
    import hpcdp
    try:
        hpcdp.init({backend!r}, some_typo=1)
    except TypeError as exc:
        print(exc)
        sys.exit(0)
    print("accepted: init returned", hpcdp.get_default_group())
    sys.exit(1)
"""


def test_tcp_refuses_an_unknown_option() -> None:
    from hpcdp.launch._processes import free_port

    res = _in_process(CHECK.format(backend="tcp"), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.strip() == _expected("tcp", "connect_timeout")


def test_tcp_accepts_its_own_option() -> None:
    from hpcdp.launch._processes import free_port

    res = _in_process("""
        import hpcdp
        g = hpcdp.init("tcp", connect_timeout=20, timeout=20)
        print(g.size, g.backend.name)
        hpcdp.finalize()
    """, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
       HPCDP_SECRET="0123456789abcdef" * 4)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.strip() == "1 tcp"


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not found")
def test_mpi_refuses_an_unknown_option_under_mpirun() -> None:
    code = textwrap.dedent(CHECK.format(backend="mpi"))
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("HPCDP_BACKEND", None)
    res = subprocess.run(["mpirun", "--oversubscribe", "-n", "2", sys.executable, "-c", code],
                         capture_output=True, text=True, timeout=120, env=env,
                         stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stdout + res.stderr
    # (mpirun merges the ranks' stdout: two lines printed at once may interleave)
    assert res.stdout.count(_expected("mpi", "no options")) == 2, res.stdout


@pytest.mark.mpi(min_size=2)
def test_mpi_refuses_an_unknown_option(mpi_world) -> None:
    """Inside the MPI test job (the world is initialised): the typo is still a ``TypeError``,
    not 'already initialised' and not ignored."""
    with pytest.raises(TypeError) as info:
        hpcdp.init("mpi", some_typo=1)
    assert str(info.value) == _expected("mpi", "no options")

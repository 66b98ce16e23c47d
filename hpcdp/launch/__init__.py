"""Every way ranks are started.

- ``spawn`` (``_spawn``): ``fn(rank)`` on N simulated ranks (threads here) or N local TCP
  processes (``_processes``), results collected;
- ``hpcdp-run`` / ``python -m hpcdp.run`` (``cli``): a script on local TCP ranks (``_local``:
  start, prefix output, stop, restart), across nodes from the SLURM layout (``_slurm``), or
  in-process under ``mpirun`` with abort-on-error; each rank's script runs through ``_boot``,
  which remembers a preemption signal that arrives before the script has a handler.
"""
from __future__ import annotations

from typing import Sequence

from ._processes import free_port, spawn_processes
from ._spawn import spawn

__all__ = ["spawn", "spawn_processes", "free_port", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point of ``hpcdp-run`` (imported late: ``import hpcdp`` stays light)."""
    from .cli import main as cli_main

    return cli_main(argv)

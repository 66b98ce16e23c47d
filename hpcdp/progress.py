"""Rank-aware output: a tqdm progress bar on rank 0 only, and loggers that prefix ``[rank N]``.

The rank is read when something is printed (not when the logger is made), so one logger serves
every simulated rank (threads) correctly; before ``hpcdp.init`` it is the launcher's (``RANK``,
``OMPI_COMM_WORLD_RANK``, ``PMI_RANK``...), so ranks do not all say 0. A line reads
``[rank N] LEVEL name: message`` under every launcher: ``hpcdp-run`` prefixes each line of a rank
with ``[rank N] `` too, but not one that starts with that already.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Any, Iterable, Iterator

from .comm.world import is_initialized, rank

__all__ = ["progress", "get_logger", "NullBar", "launcher_rank"]

#: where launchers put the rank of the process they start (Open MPI, MPICH and Intel MPI, PMIx,
#: hpcdp-run/torchrun, Slurm): an MPI launcher's own variable first, since a ``RANK`` may be left
#: over in the environment a job script exports
_RANK_ENV = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "RANK", "SLURM_PROCID")


def launcher_rank() -> int | None:
    """The rank the launcher gave this process, from its environment; None outside a launcher."""
    for key in _RANK_ENV:
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return None


def _rank() -> int:
    try:
        if is_initialized():
            return int(rank())
    except Exception:  # noqa: BLE001 - output helpers must never fail a run
        return 0
    r = launcher_rank()
    return 0 if r is None else r


class NullBar:
    """What non-zero ranks get: iterates like the bar, every display method does nothing."""

    def __init__(self, iterable: Iterable[Any] | None = None, **_: Any) -> None:
        self.iterable = iterable

    def __iter__(self) -> Iterator[Any]:
        return iter(self.iterable if self.iterable is not None else ())

    def __len__(self) -> int:
        return len(self.iterable)  # type: ignore[arg-type]

    def __enter__(self) -> NullBar:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def set_postfix(self, *args: Any, **kwargs: Any) -> None:
        """Do nothing."""

    def set_description(self, *args: Any, **kwargs: Any) -> None:
        """Do nothing."""

    def update(self, n: float = 1) -> None:
        """Do nothing."""

    def refresh(self) -> None:
        """Do nothing."""

    def close(self) -> None:
        """Do nothing."""

    def write(self, s: str, **kwargs: Any) -> None:
        """Do nothing (only rank 0 prints)."""


def progress(iterable: Iterable[Any] | None = None, *, rank: int | None = None, **kw: Any) -> Any:
    """Wrap ``iterable`` in a tqdm bar on rank 0 and in a silent stand-in elsewhere.

    Args:
        iterable: what to iterate (may be None with ``total=`` for manual ``update``).
        rank: the rank deciding who shows the bar (default ``hpcdp.rank()``).
        kw: passed to ``tqdm`` (``desc``, ``total``, ``disable``, ``leave``...).
    """
    if (_rank() if rank is None else rank) != 0:
        return NullBar(iterable, **kw)
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return NullBar(iterable, **kw)
    kw.setdefault("dynamic_ncols", True)
    kw.setdefault("file", sys.stderr)
    return tqdm(iterable, **kw)


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = _rank()
        return True


_FORMAT = "[rank %(rank)s] %(levelname)s %(name)s: %(message)s"


def get_logger(name: str = "hpcdp", level: int | str | None = None) -> logging.Logger:
    """Return a logger whose lines start with ``[rank N]`` (N read at each record).

    Args:
        name: logger name (``hpcdp.*`` names share the handler installed on ``hpcdp``).
        level: optional level to set on the returned logger.
    """
    logger = logging.getLogger(name)
    if not any(isinstance(f, _RankFilter) for f in logger.filters):
        logger.addFilter(_RankFilter())
    if not any(getattr(h, "_hpcdp", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT))
        handler._hpcdp = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.propagate = False
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)
    if level is not None:
        logger.setLevel(level)
    return logger

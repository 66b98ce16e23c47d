"""The default process group: ``init``, ``finalize`` and who-am-I queries.

Simulated ranks are threads, so the default group is looked up thread-locally first and then
process-wide. ``init`` also installs an excepthook that tells the other ranks when this process
dies of an uncaught exception (plain ``mpirun python train.py`` included), so they fail with a
``PeerFailureError`` naming it at once instead of waiting out their timeout.
"""
from __future__ import annotations

import inspect
import os
import re
import sys
import threading
import weakref
from typing import Any, Callable, Sequence

from .. import trace
from .._config import setting
from ..trace import hooks as trace_hooks
from ..backends import backend_factory
from .validation import check_timeout
from ..errors import BackendUnavailableError, HpcdpError
from .group import ProcessGroup
from . import reproducible, stragglers
from ._watchdog import set_warn_after

__all__ = [
    "init", "finalize", "is_initialized", "rank", "world_size", "get_default_group",
    "new_group", "detect_backend", "local_rank", "on_finalize", "group_or_default",
    "check_options", "start_tracing", "set_thread_default", "started_as", "report_death",
]

_default: ProcessGroup | None = None
#: the registered backend name each world group was started under (``init``, ``spawn``)
_started: "weakref.WeakKeyDictionary[ProcessGroup, str]" = weakref.WeakKeyDictionary()
#: run with the group at ``finalize``, before its transport goes (``on_finalize``)
_finalizers: list[Callable[[ProcessGroup], None]] = []
_tls = threading.local()
_lock = threading.Lock()

_MPI_ENV = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "PMI_RANK", "MPI_LOCALNRANKS")


def _mpi_env_size() -> int:
    for key in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MPI_LOCALNRANKS"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    if os.environ.get("SLURM_STEP_ID") is not None and os.environ.get("SLURM_NTASKS", "").isdigit():
        return int(os.environ["SLURM_NTASKS"])  # inside an srun step
    return 1 if "PMIX_RANK" in os.environ else 0


def detect_backend() -> str:
    """The backend ``init()`` picks here: explicit env, then MPI launcher, then TCP env, else sim."""
    explicit = setting("HPCDP_BACKEND")
    if explicit:
        return explicit
    if _mpi_env_size() > 0:
        return "mpi"
    if setting("HPCDP_MASTER_ADDR") or (
        os.environ.get("MASTER_ADDR") and os.environ.get("RANK") and os.environ.get("WORLD_SIZE")
    ):
        return "tcp"
    return "sim"


_thread_groups = 0  # simulated ranks alive; while 0 the thread-local lookup is skipped


def group_or_default(group: ProcessGroup | None) -> ProcessGroup:
    """``group``, else the default group, initialising hpcdp first (wrappers built before init)."""
    if group is not None:
        return group
    if not is_initialized():
        init()
    return get_default_group()


def get_default_group() -> ProcessGroup:
    """The group collectives use when ``group=None``."""
    if _thread_groups:
        g = getattr(_tls, "group", None)
        if g is not None:
            return g
    if _default is None:
        raise HpcdpError("hpcdp is not initialised: call hpcdp.init() first")
    return _default


def is_initialized() -> bool:
    return (getattr(_tls, "group", None) or _default) is not None


def init(backend: str | None = None, *, timeout: float | None = None,
         warn_after: float | None = None, deterministic: bool | None = None,
         **options: Any) -> ProcessGroup:
    """Start the default group and return it.

    Calling ``init`` again while initialised returns the current group when it asks for the
    same backend and no other timeout; a different backend, options or ``timeout`` raise
    ``HpcdpError`` rather than being ignored (set ``get_default_group().timeout`` to change the
    timeout of a running world, or ``finalize()`` first).

    Args:
        backend: "mpi", "tcp" or "sim"; None picks by environment (``detect_backend``).
        timeout: seconds any blocking call may wait (default ``HPCDP_TIMEOUT`` or 30 minutes);
            a finite number > 0.
        warn_after: seconds a call may stay blocked before this process logs, once, what it
            waits for and on whom (default ``HPCDP_WARN_AFTER`` or 60; 0: never); see
            ``comm._watchdog``.
        deterministic: exact, bit-reproducible float sums in every reduction of this world
            and its sub-groups (``comm.reproducible``; default ``HPCDP_DETERMINISTIC``). Every
            rank must ask for the same: init raises ``CollectiveMismatchError`` on every rank
            otherwise, naming which ranks asked for which.
        options: passed to the backend factory.
    """
    global _default
    if warn_after is not None:
        set_warn_after(warn_after)
    with _lock:
        current = getattr(_tls, "group", None) or _default
        name = backend or detect_backend()
        factory = backend_factory(name)
        if factory is not None:
            check_options(name, factory, options)
        where = f"init(backend={name!r}" + (f", timeout={timeout!r})" if timeout is not None else ")")
        t = None if timeout is None else check_timeout(where, timeout)
        if current is not None:
            if current.backend is not None and _started.get(current) == name and not options:
                if deterministic is not None and bool(deterministic) != current.deterministic:
                    raise HpcdpError(f"{where}: already initialised with deterministic="
                                     f"{current.deterministic}; finalize() first")
                if t is None or t == current.timeout:
                    return current
                raise HpcdpError(
                    f"{where}: already initialised with timeout {current.timeout:g} s; set "
                    f"hpcdp.get_default_group().timeout = {t:g} to change it, or finalize() first"
                )
            raise HpcdpError(
                f"{where}: already initialised with {current!r}; call finalize() first"
            )
        if factory is None:
            raise BackendUnavailableError(f"init: unknown backend {name!r}")
        try:
            be = factory(**options)
        except BackendUnavailableError:
            raise
        except ImportError as exc:
            raise BackendUnavailableError(f"init: backend {name!r} cannot start here: {exc}") from exc
        group = ProcessGroup(be, name="world", timeout=t)
        if deterministic is not None:
            group.deterministic = bool(deterministic)
        _started[group] = name
        _default = group
        if group.size > 1:
            reproducible.check_agreement(group, group.deterministic)
    _install_excepthook()
    start_tracing(group)
    return group


def check_options(name: str, factory: Callable[..., Any], options: dict[str, Any]) -> None:
    """Refuse ``options`` the backend's factory does not take, the same way for every backend:
    a typo (``init(timout=5)``) must not be ignored on one backend and refused on another.
    A factory taking ``**kwargs`` (a third-party backend) checks its own."""
    if not options:
        return
    params = inspect.signature(factory).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    accepted = sorted(p.name for p in params
                      if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "timeout")
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise TypeError(
            f"init(backend={name!r}): unknown option(s) {', '.join(map(repr, unknown))}; the "
            f"{name} backend accepts " + (", ".join(accepted) if accepted else "no options")
            + " (besides timeout)")


_hooked = False


def _install_excepthook() -> None:
    """Chain an excepthook (once per process) that reports this rank's death to its peers."""
    global _hooked
    if _hooked:
        return
    _hooked = True
    previous = sys.excepthook

    def hpcdp_excepthook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        try:
            report_death(exc_type, exc)
        finally:
            previous(exc_type, exc, tb)

    sys.excepthook = hpcdp_excepthook


def report_death(exc_type: type[BaseException], exc: BaseException) -> None:
    """The main thread ends in an uncaught exception (the excepthook, or ``hpcdp-run``'s catch
    before it aborts an MPI job): tell the default group's peers (the
    backend's ``report_death``, where it has one) what this rank died of. Not in an interactive
    interpreter, where the excepthook runs for every error and the process lives on; threads
    other than the main one do not come here (``threading.excepthook``) and end nothing."""
    g = _default
    if g is None or hasattr(sys, "ps1") or sys.flags.interactive:
        return
    report = getattr(g.backend, "report_death", None)
    if report is None:
        return
    text = str(exc).split("\n", 1)[0]
    try:
        report(f"{exc_type.__name__}: {text}" if text else exc_type.__name__)
    except Exception:  # noqa: BLE001 - the traceback must still be printed
        pass


def start_tracing(group: ProcessGroup) -> None:
    """Arm the flight-record dumps for this rank; with ``HPCDP_TRACE`` line the clocks up
    (collective; not for ranks that are threads of one process, which share its clock); with
    ``HPCDP_STRAGGLER=N`` start the straggler report (``comm.stragglers``)."""
    trace_hooks.install(group.ranks[group.rank], group.size)
    if trace.enabled() and not group.backend.shares_process:
        trace.estimate_clock_offset(group)
    stragglers.from_env(group)


def set_thread_default(group: ProcessGroup | None, started_as: str | None = None) -> None:
    """This thread's default group (a simulated rank of ``spawn``), started under backend
    ``started_as``; None clears it."""
    global _thread_groups
    if group is not None and started_as is not None:
        _started[group] = started_as
    with _lock:
        _thread_groups += (group is not None) - (getattr(_tls, "group", None) is not None)
    _tls.group = group


def started_as(group: ProcessGroup) -> str | None:
    """The registered backend name ``group`` was started under (``init``, ``spawn``), if any."""
    return _started.get(group)


def on_finalize(fn: Callable[[ProcessGroup], None]) -> Callable[[ProcessGroup], None]:
    """Run ``fn(group)`` in ``finalize`` before the transport goes (once per registration; e.g.
    the checkpoint layer lets a pending async save commit). Returns ``fn`` (a decorator)."""
    if fn not in _finalizers:
        _finalizers.append(fn)
    return fn


def finalize() -> None:
    """Release the default group's transport; ``init`` may be called again afterwards.

    A pending ``hpcdp.checkpoint.save(..., async_save=True)`` is waited for first. The group and
    every group made from it raise ``HpcdpError`` when used afterwards. On MPI, operations still
    in flight get a short grace period; what is still running then keeps its buffers alive
    until ``MPI_Finalize`` and the other ranks are told that this rank left.
    """
    global _default, _thread_groups
    current = getattr(_tls, "group", None) or _default
    if current is not None:
        for fn in list(_finalizers):
            fn(current)
        trace_hooks.record_finalize(current)  # last: the hooks above may still communicate
    with _lock:
        g = getattr(_tls, "group", None)
        if g is not None:
            _thread_groups -= 1
            _tls.group = None
        else:
            g, _default = _default, None
    if g is not None:
        stragglers.stop()
        trace.flush_timelines()
        g.shutdown()


def rank() -> int:
    """This process's rank in the default group (0 when not initialised)."""
    return get_default_group().rank if is_initialized() else 0


def world_size() -> int:
    """Ranks in the default group (1 when not initialised)."""
    return get_default_group().size if is_initialized() else 1


def local_rank() -> int:
    """Rank among the processes of this node, from the launcher's environment."""
    for key in ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 0


def local_world_size() -> int | None:
    """Processes on this node, from the launcher's environment; None when it does not say.

    Open MPI, MPICH and torchrun-style launchers name it directly; srun's direct launch
    (``--mpi=pmix``) gives only the tasks of every node (``SLURM_STEP_TASKS_PER_NODE``, e.g.
    ``2(x3),1``), read at this node's ``SLURM_NODEID``."""
    for key in ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "LOCAL_WORLD_SIZE"):
        v = os.environ.get(key, "").strip()
        if v.isdigit() and int(v) > 0:
            return int(v)
    spec = os.environ.get("SLURM_STEP_TASKS_PER_NODE") or os.environ.get("SLURM_TASKS_PER_NODE", "")
    node = os.environ.get("SLURM_NODEID", "").strip()
    if not spec or not node.isdigit():
        return None
    counts: list[int] = []
    for part in spec.split(","):
        m = _TASKS.fullmatch(part.strip())
        if m is None:
            return None
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[int(node)] if int(node) < len(counts) and counts[int(node)] > 0 else None


_TASKS = re.compile(r"(\d+)(?:\(x(\d+)\))?")


def new_group(ranks: Sequence[int], *, name: str | None = None, timeout: float | None = None) -> ProcessGroup:
    """Collective over the default group: a group of the given world ranks."""
    return get_default_group().new_group(ranks, name=name, timeout=timeout)

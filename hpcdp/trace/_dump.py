"""Writing flight records: on ``CommTimeoutError``, on SIGUSR1, after an uncaught exception, and
when a rank of a multi-process job finishes (``hpcdp.finalize``, or interpreter exit without it).

One JSON file per rank, ``<HPCDP_TRACE_DIR>/flight-rank<R>.json`` (default ``./hpcdp-trace/``),
written to a temporary name and renamed, so a reader never sees half a record. A later dump
replaces an earlier one: it holds everything the earlier did plus what happened since.

The record a finishing rank writes (``"finished": "finalize"``) is what lets ``analyze`` say
"rank 1 finished normally" instead of "wrote no record (killed?)" when a peer later times out
waiting for it: without it, a rank that left in good order and one that was killed look alike.
Ranks that are threads of one process write nothing then (a peer's dump writes every rank of the
process), nor does a one-rank job (there is no peer to explain).
"""
from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
import weakref
from typing import Any, Callable

from .._atomic import atomic_write_text
from .._config import setting, source
from ..errors import CommTimeoutError, PeerFailureError
from ._clock import WALL_MINUS_MONO_NS, clock_offset_ns, now_ns
from ._recorder import (
    FAILED, TIMED_OUT, STARTED, Op, Recorder, _process_rank, all_recorders, bind_rank, recorder,
    user_frame, where_of, world_size_seen,
)

__all__ = ["FORMAT", "trace_dir", "dump", "install", "record_path", "describe_group", "op_json",
           "on_error", "job_id", "mark_finished", "record_finalize", "count_p2p", "p2p_counts"]

FORMAT = "hpcdp.flight/1"
_dump_lock = threading.RLock()
_reasons: list[str] = []
_installed: set[str] = set()
#: world size this process's main thread was installed into (``install``); 0: none
_process_world = [0]
#: run at every dump (the timeline module flushes, so a rank killed after it leaves its events)
on_dump: list[Callable[[], None]] = []


def trace_dir(directory: str | os.PathLike[str] | None = None) -> str:
    """``directory``, else ``HPCDP_TRACE_DIR``, else ``./hpcdp-trace``."""
    return os.fspath(directory) if directory else setting("HPCDP_TRACE_DIR")


def record_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"flight-rank{rank}.json")


def job_id() -> str:
    """Which job (and restart attempt) this process belongs to, from the launcher's environment.

    ``analyze`` uses it to set aside records that an earlier job left in the same directory.
    """
    env = os.environ
    if env.get("SLURM_JOB_ID"):
        return f"slurm-{env['SLURM_JOB_ID']}.{env.get('SLURM_RESTART_COUNT', '0')}.{env.get('SLURM_STEP_ID', '')}"
    for key in ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid"):
        if env.get(key):
            return f"mpi-{env[key]}"
    secret = setting("HPCDP_SECRET")
    if secret:  # hpcdp-run: a fresh secret per attempt (only a digest is kept)
        import hashlib

        return "run-" + hashlib.sha256(secret.encode()).hexdigest()[:16]
    return f"pid-{socket.gethostname()}-{os.getpid()}"


def describe_group(group: Any) -> tuple[str, list[int] | None, int]:
    """(name, global ranks or None, this rank's group rank or -1) of a group object or a name."""
    if isinstance(group, str):
        return group, None, -1
    name = str(getattr(group, "name", group))
    try:
        ranks = [int(r) for r in getattr(group, "ranks")]
    except (AttributeError, TypeError, ValueError):
        ranks = None
    try:
        grank = int(getattr(group, "rank"))
    except (AttributeError, TypeError, ValueError):
        grank = -1
    return name, ranks, grank


def _jsonable_shape(shape: Any) -> list[int] | None:
    if shape is None:
        return None
    try:
        return [int(s) for s in shape]
    except (TypeError, ValueError):
        return None


def op_json(o: Op, line: str | None = None, groups: dict[int, Any] | None = None) -> dict[str, Any]:
    """One entry of a flight record (times: this process's wall clock, nanoseconds).

    ``groups`` caches ``describe_group`` by group identity across the entries of one dump.
    """
    if groups is None:
        name, ranks, grank = describe_group(o.group)
    else:
        hit = groups.get(id(o.group))
        if hit is None or hit[0] is not o.group:
            hit = groups[id(o.group)] = (o.group, describe_group(o.group))
        name, ranks, grank = hit[1]
    return {
        "id": o.id, "seq": int(o.seq), "op": str(o.op), "group": name, "group_ranks": ranks,
        "group_rank": grank, "shape": _jsonable_shape(o.shape),
        "dtype": None if o.dtype is None else str(o.dtype), "peer": int(o.peer),
        "start_ns": o.start_ns + WALL_MINUS_MONO_NS,
        "end_ns": None if o.end_ns is None else o.end_ns + WALL_MINUS_MONO_NS,
        "state": o.state, "thread": o.thread, "line": o.line or line,
    }


_TRACE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _outside_trace(f: Any) -> Any:
    """Skip the dump machinery itself (this package's frames) at the top of a stack."""
    while f is not None and os.path.abspath(f.f_code.co_filename).startswith(_TRACE_DIR):
        f = f.f_back
    return f


def _in_pkg(f: Any) -> bool:
    return user_frame(f) is not f


def _stacks(idents: set[int]) -> dict[int, dict[str, Any]]:
    """For each live thread in ``idents``: its name, where it is, and whether it is inside hpcdp.

    A thread blocked in an operation sits in stdlib or C code called from hpcdp: its line is
    the caller of the innermost hpcdp frame. Otherwise it is the innermost frame itself.
    """
    frames = sys._current_frames()
    names = {t.ident: t.name for t in threading.enumerate()}
    out: dict[int, dict[str, Any]] = {}
    for ident in idents:
        f = _outside_trace(frames.get(ident))
        if f is None:
            continue
        g = f
        while g is not None and not _in_pkg(g):
            g = g.f_back
        u = f if g is None else user_frame(g)
        stack = [f"{fs.filename}:{fs.lineno} ({fs.name})" for fs in traceback.extract_stack(f, limit=12)]
        out[ident] = {
            "name": names.get(ident, str(ident)),
            "line": None if u is None else where_of((u.f_code, u.f_lineno)),
            "in_hpcdp": g is not None,
            "stack": stack,
        }
    return out


#: global rank -> the point-to-point counters of its groups (``count_p2p``), weakly held, in
#: the order they were made
_p2p_sources: dict[int, list["weakref.ref[Any]"]] = {}


def count_p2p(rank: int, source: Any) -> None:
    """Make the flight record of global ``rank`` list ``source``'s point-to-point messages.

    ``source.counts()`` returns ``{(op, peer, tag): messages}`` (``op`` "send" or "recv",
    ``peer`` a rank of ``source.group``). The collective layer registers one per group: the
    recorder's ring keeps only the point-to-point calls that had to wait, so these counts are
    what tells, after a hang, how many messages each pair exchanged before it."""
    with _dump_lock:
        refs = _p2p_sources.setdefault(int(rank), [])
        refs[:] = [r for r in refs if r() is not None]
        refs.append(weakref.ref(source))


def p2p_counts(rank: int) -> list[dict[str, Any]]:
    """The ``p2p_counts`` of global ``rank``'s flight record: one entry per group, op, peer
    and tag with messages, ``peer_rank`` the peer's global rank (None where not known). Of
    groups of one name, the newest (an ``init`` after a ``finalize`` makes "world" again)."""
    newest: dict[str, tuple[Any, list[int] | None]] = {}
    for ref in list(_p2p_sources.get(int(rank), ())):
        src = ref()
        if src is None:
            continue
        try:
            name, ranks, _ = describe_group(src.group)
        except Exception:  # noqa: BLE001 - a group being torn down: a dump must not fail
            continue
        newest[name] = (src, ranks)
    out: list[dict[str, Any]] = []
    for name, (src, ranks) in newest.items():
        try:
            counts = src.counts()
        except Exception:  # noqa: BLE001 - (as above)
            continue
        for (op, peer, tag), n in sorted(counts.items(), key=lambda kv: (str(kv[0][0]), kv[0][1:])):
            out.append({"group": name, "op": str(op), "peer": int(peer),
                        "peer_rank": (ranks[peer] if ranks is not None and 0 <= peer < len(ranks)
                                      else None),
                        "tag": int(tag), "messages": int(n)})
    return out


def _record(rec: Recorder, reason: str) -> dict[str, Any]:
    ops = rec.snapshot()
    threads = _stacks({o.thread for o in ops})
    # A thread blocked inside hpcdp is in its newest unfinished operation: give that one the
    # thread's current line (the line the rank is stuck at) when it recorded none itself.
    newest: dict[int, Op] = {}
    for o in ops:
        if o.state == STARTED:
            newest[o.thread] = o
    entries = []
    groups: dict[int, Any] = {}
    for o in ops:
        line = None
        t = threads.get(o.thread)
        if o.line is None and t is not None and t["in_hpcdp"] and newest.get(o.thread) is o:
            line = t["line"]
        entries.append(op_json(o, line, groups))
    seen = [r for _, d in groups.values() for r in (d[1] or ())]
    world = max(world_size_seen[0], rec.rank + 1, max(seen, default=-1) + 1)
    return {
        "format": FORMAT,
        "rank": rec.rank,
        "world_size": world,
        "job": job_id(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "reason": reason,
        "reasons": list(_reasons),
        "dumped_at_ns": now_ns() + WALL_MINUS_MONO_NS,
        "clock_offset_ns": clock_offset_ns(rec.rank),
        "capacity": rec.capacity,
        "total_ops": rec.total(),
        "finished": None if rec.finished is None else rec.finished[0],
        "finished_at_ns": None if rec.finished is None else rec.finished[1] + WALL_MINUS_MONO_NS,
        "threads": [dict(v, ident=k) for k, v in sorted(threads.items())],
        "p2p_counts": p2p_counts(rec.rank),
        "entries": entries,
    }


def dump(reason: str = "requested", *, directory: str | os.PathLike[str] | None = None,
         rank: int | None = None, raise_errors: bool = False, _headline: str | None = None) -> list[str]:
    """Write the flight record of every rank recorded in this process (or only ``rank``).

    Called by the collective layer on ``CommTimeoutError``, by the SIGUSR1 handler and by the
    excepthook; safe from any thread and re-entrant. Returns the paths written. Errors (a
    read-only directory, a full disk) are reported on stderr and swallowed unless
    ``raise_errors``: a dump must never hide the error that caused it.
    """
    with _dump_lock:
        _reasons.append(reason)
        del _reasons[:-20]
        d = trace_dir(directory)
        written: list[str] = []
        recs = [r for r in (all_recorders() if rank is None else [recorder(rank)]) if r.capacity]
        try:
            # nothing recorded here (recording off, or hpcdp never used): no directory either
            if recs and os.path.lexists(d) and not os.path.isdir(d):
                raise NotADirectoryError(f"HPCDP_TRACE_DIR {d!r} exists and is not a directory")
            if recs:
                os.makedirs(d, exist_ok=True)
            for rec in recs:
                path = record_path(d, rec.rank)
                # a fresh exclusive temporary renamed onto ``path``: never through a link planted
                # under either name. dumps, not dump: one call into the C encoder (json.dump
                # streams through the pure-Python one, several times slower, and a dump sits on
                # the error path)
                atomic_write_text(path, json.dumps(_record(rec, _headline or reason), default=str), perms=0o644)
                written.append(path)
        except Exception as exc:  # noqa: BLE001 - reported; the caller has a worse error to raise
            if raise_errors:
                raise
            print(f"hpcdp.trace: could not write the flight record to {d!r} ({reason}): {exc}",
                  file=sys.stderr)
        for hook in on_dump:
            try:
                hook()
            except Exception as exc:  # noqa: BLE001 - same: never mask the caller's error
                print(f"hpcdp.trace: {exc}", file=sys.stderr)
        return written


_last_auto = [0.0]


def _auto_interval() -> float:
    # read on the error path: a bad value reads as the default rather than hide the error
    return setting("HPCDP_TRACE_DUMP_INTERVAL", strict=False)


def on_error(rec: Recorder | None, token: int, exc: BaseException) -> None:
    """What the collective layer calls when operation ``token`` raised ``exc``.

    Ends it as timed out (``CommTimeoutError``) or failed, and on a timeout or a peer failure
    dumps every rank of this process, at most once per ``HPCDP_TRACE_DUMP_INTERVAL`` seconds
    (default 1), so code that polls with short timeouts does not write a file per poll.
    """
    if rec is not None:
        rec.end(token, TIMED_OUT if isinstance(exc, CommTimeoutError) else FAILED)
    if isinstance(exc, (CommTimeoutError, PeerFailureError)):
        now = time.monotonic()
        with _dump_lock:
            if now - _last_auto[0] < _auto_interval() and _last_auto[0]:
                return
            _last_auto[0] = now
        dump(f"{type(exc).__name__}: {exc}")


def install(rank: int, world_size: int, *, signals: bool = True) -> None:
    """Make this process (or thread, for simulated ranks) rank ``rank`` of ``world_size`` and arm the dumps.

    Idempotent. From the main thread it also sets the process rank, a SIGUSR1 handler (which
    chains to any handler already there, e.g. a preemption helper's) and, once per process,
    an excepthook for the main and other threads. From another thread it only binds the rank.
    """
    rank, world_size = int(rank), int(world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"install: rank {rank} is not in [0, {world_size})")
    world_size_seen[0] = max(world_size_seen[0], world_size)
    recorder(rank).finished = None  # a fresh init: this rank is running again
    if threading.current_thread() is not threading.main_thread():
        bind_rank(rank)
        return
    _process_rank[0] = rank
    _process_world[0] = world_size
    with _dump_lock:
        if signals and "signal" not in _installed and hasattr(signal, "SIGUSR1"):
            _chain_signal(signal.SIGUSR1)
            _installed.add("signal")
        if "excepthook" not in _installed:
            _chain_excepthooks()
            atexit.register(_at_exit)
            _installed.add("excepthook")


def _chain_signal(signum: int) -> None:
    prev = signal.getsignal(signum)

    def on_signal(sig: int, frame: Any) -> None:
        dump(f"signal {signal.Signals(sig).name}")
        if callable(prev):
            prev(sig, frame)

    signal.signal(signum, on_signal)


_uncaught: list[str] = []


def _chain_excepthooks() -> None:
    prev_hook: Callable[..., Any] = sys.excepthook
    prev_thread_hook: Callable[..., Any] = threading.excepthook

    def hook(tp: type[BaseException], value: BaseException, tb: Any) -> None:
        _uncaught.append(f"uncaught {tp.__name__}: {value}")
        dump(_uncaught[-1])
        prev_hook(tp, value, tb)

    def thread_hook(args: Any) -> None:
        if args.exc_type is not SystemExit:
            _uncaught.append(f"uncaught {args.exc_type.__name__} in thread "
                             f"{getattr(args.thread, 'name', '?')}: {args.exc_value}")
            dump(_uncaught[-1])
        prev_thread_hook(args)

    sys.excepthook = hook
    threading.excepthook = thread_hook


def mark_finished(how: str, rank: int | None = None, *, write: bool = True) -> list[str]:
    """Record that ``rank`` (default: the current one) is done, ``how``: "finalize" or "exit".

    ``write``: also write its flight record now (a rank that is a process of its own: nobody
    else will, and a peer that times out later reads it). Returns the paths written.
    """
    rec = recorder(rank)
    if not rec.capacity:
        return []
    rec.finished = (how, now_ns())
    if not write:
        return []
    what = "hpcdp.finalize()" if how == "finalize" else "interpreter exit without hpcdp.finalize()"
    with _dump_lock:
        earlier = _reasons[-1] if _reasons else None
    # an earlier dump's reason (a timeout this rank handled, a SIGUSR1) stays the record's headline:
    # it says more than "finished", which the record's "finished" field and reasons hold anyway
    return dump(f"finished: {what} on rank {rec.rank}", rank=rec.rank, _headline=earlier)


def _keep_finished_records() -> bool:
    """Whether a rank that finished in good order writes its record: only when the user asked
    for traces (``HPCDP_TRACE=1``) or named where they go (``HPCDP_TRACE_DIR``). A clean run
    otherwise leaves no files in the working directory; ``analyze`` then learns that a rank
    finished from the notice its waiting peers recorded."""
    return source("HPCDP_TRACE_DIR") == "environment" or setting("HPCDP_TRACE", strict=False)


def record_finalize(group: Any) -> None:
    """``hpcdp.finalize`` calls this (after its ``on_finalize`` hooks, before the transport
    goes): this rank finished in good order. Called from ``comm``, so ``trace`` needs no
    import of the layer above it."""
    try:
        rank = int(group.ranks[group.rank])
        alone = group.size <= 1 or bool(getattr(group.backend, "shares_process", False))
        mark_finished("finalize", rank, write=not alone and _keep_finished_records())
    except Exception as exc:  # noqa: BLE001 - finishing must not fail because of its record
        print(f"hpcdp.trace: could not record that this rank finished: {exc}", file=sys.stderr)


def _at_exit() -> None:
    """After an uncaught exception, dump once more at exit: handlers and ``finally`` blocks
    may have run (and timed out) operations since the excepthook's dump. A rank of a
    multi-process job that exits without ``hpcdp.finalize`` says that it exited."""
    if _uncaught:
        dump(f"exit after {_uncaught[-1]}")
    elif _process_world[0] > 1:
        rec = recorder(_process_rank[0])
        if rec.capacity and rec.finished is None and rec.total():
            mark_finished("exit", rec.rank, write=_keep_finished_records())


def reset_hooks_for_tests() -> None:
    """Forget dump reasons, uncaught exceptions and the last automatic dump (the hooks stay)."""
    _reasons.clear()
    _uncaught.clear()
    _last_auto[0] = 0.0

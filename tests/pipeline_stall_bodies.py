"""Pipeline bodies for a stalled stage and a stage that vanished (module level, so simulated
threads, TCP processes and mpirun ranks can all run them).

A stalled rank does not sleep a guessed time: it stops calling the transport until every rank
that waits on it has raised and said so by creating a file (message ordering through the file
system, which a stalled rank can read without progressing MPI). An MPI send to a rank that stopped
calling MPI stays pending; ``stand_in`` reproduces that on backends whose small sends complete
at once (sim, TCP), by handing the pipeline a receive that never completes in place of its
control sends to the stalled ranks (the real message still goes out).
"""
from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

import hpcdp
import hpcdp.pipeline as pp
from hpcdp.pipeline._channel import CTRL_TAG
from pipeline_bodies import make_data, make_loss, make_model

#: a tag the pipeline's own traffic never uses (its tags stay below 1 + 2n + 2nm)
_SPARE_TAG = 100_000
#: longest a stalled rank waits to be released (a cap, not a guess: release is by message)
_RELEASE_CAP = 60.0


def stalled_ranks(n: int) -> set[int]:
    """The middle ranks (rank 1 of 2): with 4 ranks each rank that times out has two stalled peers."""
    return set(range(1, n - 1)) if n > 2 else {1}


def body_stalled_stage(rank: int, release_dir: str, timeout: float, stand_in: bool) -> dict[str, Any]:
    """Every stalled rank stops before its second step until the others raised; the others
    time out waiting for it (or hear from one that did)."""
    g = hpcdp.get_default_group()
    n = g.size
    stalled = stalled_ranks(n)
    waiting = [r for r in range(n) if r not in stalled]
    stage = pp.PipelineStage(make_model())
    pipe = pp.Pipeline(stage, schedule="1f1b", n_microbatches=4, loss_fn=make_loss("ce"),
                       timeout=60.0)
    x, y = make_data("ce", 0, 8)
    pipe.step(x, y)   # the first step exchanges shapes: the second waits on data only
    # the first step is not about stalls: under a long timeout, as a healthy wait can outlast
    # ``timeout`` on a loaded machine (4 ranks on 2 cores); the stalled step under ``timeout``
    pipe.timeout = pipe._channel.timeout = timeout
    out: dict[str, Any] = {"rank": g.rank, "stalled": g.rank in stalled, "released": None}
    names = [os.path.join(release_dir, f"raised-{r}") for r in waiting]
    if g.rank in stalled:   # stops before the step (posting nothing) until the others raised
        until = time.monotonic() + _RELEASE_CAP
        while not all(os.path.exists(f) for f in names) and time.monotonic() < until:
            time.sleep(0.01)
        out["released"] = all(os.path.exists(f) for f in names)
    if stand_in and g.rank not in stalled:
        comm = pipe._channel.comm
        send = comm.isend

        def isend(buf: Any, dst: int, tag: int = 0, **kw: Any) -> Any:
            work = send(buf, dst, tag, **kw)
            if tag == CTRL_TAG and dst in stalled:   # as MPI leaves it: pending until dst calls in
                return comm.irecv(np.zeros(1, np.uint8), dst, _SPARE_TAG)
            return work

        comm.isend = isend
    start = time.monotonic()
    try:
        pipe.step(x, y)
        out["error"] = None
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["error"] = (type(exc).__name__, str(exc))
    out["elapsed"] = time.monotonic() - start
    if g.rank not in stalled:
        with open(os.path.join(release_dir, f"raised-{g.rank}.tmp"), "w") as fh:
            fh.write("raised")
        os.replace(os.path.join(release_dir, f"raised-{g.rank}.tmp"),
                   os.path.join(release_dir, f"raised-{g.rank}"))
    return out


def body_vanished_stage(rank: int) -> dict[str, Any]:
    """Rank 1 returns instead of stepping (its process or thread is gone): the others raise, and
    what they say about rank 1 names its action or says why it is unknown."""
    stage = pp.PipelineStage(make_model())
    pipe = pp.Pipeline(stage, schedule="gpipe", n_microbatches=4, loss_fn=make_loss("ce"), timeout=30)
    x, y = make_data("ce", 0, 8)
    pipe.step(x, y)
    if rank == 1:
        return {"rank": rank, "error": None}
    try:
        pipe.step(x, y)
        return {"rank": rank, "error": None}
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"rank": rank, "error": (type(exc).__name__, str(exc))}

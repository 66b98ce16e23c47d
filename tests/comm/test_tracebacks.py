"""Errors are raised from the public call a user wrote, not from forty lines of hpcdp internals.

Issue 21, item 10: the traceback printed for a ``CommTimeoutError`` or ``CollectiveMismatchError``
holds at most a few hpcdp frames (the public call), while the full internal traceback stays
reachable in the chain (``__context__``) and is printed with ``HPCDP_FULL_TRACEBACK=1``.
Item 5: ``checkpoint.save``/``load`` called on one rank only say that they are collective.
"""
from __future__ import annotations

import os
import time
import traceback
from typing import Any

import numpy as np
import pytest

import hpcdp
from conftest import run_ranks
from hpcdp.testing.failure import tell_late_rank, wait_until_others_gave_up

PKG = os.path.dirname(os.path.abspath(hpcdp.__file__)) + os.sep


def _hpcdp_frames(exc: BaseException) -> list[str]:
    """The hpcdp frames of ``exc``'s own traceback (its chain left out)."""
    return [f"{fr.filename}:{fr.lineno} {fr.name}" for fr in traceback.extract_tb(exc.__traceback__)
            if fr.filename.startswith(PKG)]


def _chain_frames(exc: BaseException) -> int:
    """hpcdp frames in the exceptions ``exc`` chains to (``__cause__``/``__context__``)."""
    n, seen, e = 0, set(), exc.__cause__ or exc.__context__
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        n += len(_hpcdp_frames(e))
        e = e.__cause__ or e.__context__
    return n


def _report(exc: BaseException) -> dict[str, Any]:
    own = "".join(traceback.format_exception(exc, chain=False))
    return {"type": type(exc).__name__, "frames": _hpcdp_frames(exc), "text": own,
            "in_text": own.count(PKG), "chained": _chain_frames(exc), "message": str(exc)}


def body_timeout_traceback(rank: int, how: str) -> dict[str, Any]:
    """Rank 1 joins only after rank 0 gave up (message-ordered): rank 0's error, described."""
    sub = hpcdp.new_group([0, 1])
    out: dict[str, Any] = {"rank": rank}
    if rank == 1:
        wait_until_others_gave_up(1, 60.0, from_ranks=[0])
        return out
    try:
        if how == "allreduce":
            hpcdp.allreduce(np.ones(4), group=sub, timeout=0.5)
        elif how == "group":
            sub.all_gather(np.ones(2), timeout=0.5)
        elif how == "wait":
            sub.reduce_scatter(np.ones(4), async_op=True, timeout=0.5).wait()
        out["error"] = None
    except hpcdp.HpcdpError as exc:
        out["error"] = _report(exc)
    tell_late_rank(1, 60.0)
    return out


def body_mismatch_traceback(rank: int) -> dict[str, Any]:
    sub = hpcdp.new_group([0, 1])
    sub.debug = "detail"
    try:
        hpcdp.allreduce(np.ones(2 + rank), group=sub)
        return {"error": None}
    except hpcdp.CollectiveMismatchError as exc:
        return {"error": _report(exc)}


@pytest.mark.parametrize("how", ["allreduce", "group", "wait"])
def test_timeout_is_raised_from_the_public_call(how: str) -> None:
    got = run_ranks("sim", 2, body_timeout_traceback, how, timeout=30)[0]["error"]
    assert got is not None and got["type"] in ("CommTimeoutError", "PeerFailureError"), got
    assert len(got["frames"]) <= 3, "\n".join(got["frames"]) + "\n" + got["text"]
    assert got["in_text"] <= 3, got["text"]
    assert "HPCDP_FULL_TRACEBACK" in got["text"], got["text"]  # says how to see the rest
    assert got["chained"] >= (1 if how == "allreduce" else 3), got  # kept in the chain


@pytest.mark.parametrize("backend", ["sim", "tcp"])
def test_mismatch_is_raised_from_the_public_call(backend: str) -> None:
    for got in (o["error"] for o in run_ranks(backend, 2, body_mismatch_traceback, timeout=30)):
        assert got is not None and got["type"] == "CollectiveMismatchError", got
        assert len(got["frames"]) <= 3, "\n".join(got["frames"]) + "\n" + got["text"]
        assert got["chained"] >= 2, got


def test_full_traceback_keeps_internal_frames(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPCDP_FULL_TRACEBACK", "1")  # read when an error is raised (sim: threads)
    for got in (o["error"] for o in run_ranks("sim", 2, body_mismatch_traceback, timeout=30)):
        assert got is not None and len(got["frames"]) > 3, got


def test_not_initialised_is_raised_from_the_public_call() -> None:
    """Before ``init``, every collective's error is the trimmed public one (``allreduce``
    finds its group inside the lane's try, the others in their ``public`` wrapper)."""
    assert not hpcdp.is_initialized()
    for fn in (hpcdp.allreduce, hpcdp.broadcast, hpcdp.all_gather, hpcdp.reduce_scatter):
        with pytest.raises(hpcdp.HpcdpError, match="not initialised") as info:
            fn(np.ones(2))
        assert getattr(info.value, "_hpcdp_public", False), fn.__name__
        assert len(_hpcdp_frames(info.value)) <= 3, (fn.__name__, _hpcdp_frames(info.value))


def test_success_path_has_no_wrapper() -> None:
    """The allreduce latency path pays no wrapper call: the trimming is a try/except in place."""
    assert not hasattr(hpcdp.allreduce, "__wrapped__")
    assert not hasattr(hpcdp.ProcessGroup.allreduce, "__wrapped__")
    assert not hasattr(hpcdp.ProcessGroup.send, "__wrapped__")
    assert not hasattr(hpcdp.ProcessGroup.recv, "__wrapped__")


# -- item 5: checkpoint.save / load on one rank only -------------------------------------------
def body_ckpt_on_rank0_only(rank: int, call: str, path: str) -> dict[str, Any]:
    """Rank 0 alone calls ``save``/``load`` (the torch habit); rank 1 waits until it gave up."""
    if call == "load":  # a checkpoint to load, written by both ranks
        hpcdp.checkpoint.save(path, {"w": np.arange(4.0)})
    hpcdp.get_default_group().timeout = 1.0
    if rank == 1:
        wait_until_others_gave_up(1, 60.0, from_ranks=[0])
        return {"rank": 1}
    t0 = time.monotonic()
    out: dict[str, Any] = {"rank": 0}
    try:
        if call == "save":
            hpcdp.checkpoint.save(path, {"w": np.arange(4.0)})
        else:
            hpcdp.checkpoint.load(path)
        out["error"] = None
    except hpcdp.HpcdpError as exc:
        out["error"] = _report(exc)
    out["elapsed"] = time.monotonic() - t0
    tell_late_rank(1, 60.0)
    return out


@pytest.mark.parametrize("call", ["save", "load"])
def test_checkpoint_on_one_rank_says_it_is_collective(call: str, tmp_path) -> None:
    path = str(tmp_path / "ckpt" / "step-1")
    got = run_ranks("sim", 2, body_ckpt_on_rank0_only, call, path, timeout=30,
                    join_timeout=120)[0]
    err = got["error"]
    assert err is not None, got
    assert err["type"] in ("CommTimeoutError", "PeerFailureError", "CollectiveMismatchError"), err
    msg = err["message"]
    assert msg.startswith(f"checkpoint.{call}("), msg
    assert (f"checkpoint.{call} is collective: every rank of the group must call it "
            "(a `if rank == 0:` guard around it is the usual cause)") in msg, msg
    assert "rank 0" in msg, msg
    assert len(err["frames"]) <= 3, err["text"]
    assert err["chained"] >= 2, err  # the internal collective's error is kept


def test_checkpoint_docstrings_say_collective() -> None:
    for fn in (hpcdp.checkpoint.save, hpcdp.checkpoint.load):
        doc = fn.__doc__ or ""
        assert "every rank" in doc and "if rank == 0:" in doc, fn

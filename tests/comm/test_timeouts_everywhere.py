"""Every public entry point that takes a timeout refuses one that could not pass or is not a
number, naming the parameter (issue 20, item 9): ``init_rpc(rpc_timeout=inf)`` used to be
accepted, and every call then raised ``OverflowError: timestamp out of range``."""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
import pytest

import hpcdp
import hpcdp.rpc as rpc
import rpc_bodies as B

pytestmark = pytest.mark.timeout(120)

BAD = [(math.inf, ValueError), (-math.inf, ValueError), (math.nan, ValueError), (0, ValueError),
       (0.0, ValueError), (-1, ValueError), ("5", TypeError), (True, TypeError)]


def _refused(fn: Callable[[Any], Any], bad: Any, exc: type, name: str) -> str | None:
    """None if ``fn(bad)`` raises ``exc`` naming ``name``; else what happened."""
    try:
        fn(bad)
    except exc as e:
        return None if name in str(e) else f"{exc.__name__} without {name!r}: {e}"
    except BaseException as e:  # noqa: BLE001 - reported
        return f"{type(e).__name__}: {e}"
    return "accepted"


def _rpc_entry_points(rank: int) -> list[tuple[str, str, Callable[[Any], Any]]]:
    peer = B.peer(rank)
    t = rpc.remote(peer, B.Table, args=(3,))
    fut = rpc.rpc_async(peer, B.add, args=(1, 2))
    return [
        ("rpc_sync", "timeout", lambda v: rpc.rpc_sync(peer, B.add, args=(1, 1), timeout=v)),
        ("rpc_async", "timeout", lambda v: rpc.rpc_async(peer, B.add, args=(1, 1), timeout=v)),
        ("remote", "timeout", lambda v: rpc.remote(peer, B.add, args=(1, 1), timeout=v)),
        ("RRef.to_here", "timeout", lambda v: t.to_here(timeout=v)),
        ("RRef.rpc_sync", "timeout", lambda v: t.rpc_sync(timeout=v).size()),
        ("RRef.rpc_async", "timeout", lambda v: t.rpc_async(timeout=v).size()),
        ("RRef.remote", "timeout", lambda v: t.remote(timeout=v).size()),
        ("Future.wait", "timeout", lambda v: fut.wait(timeout=v)),
        ("rpc.shutdown", "timeout", lambda v: rpc.shutdown(timeout=v)),
    ]


def body_rpc_timeouts(rank: int) -> list[str]:
    fails: list[str] = []
    for bad, exc in BAD:
        for kw in ("rpc_timeout", "init_timeout"):
            why = _refused(lambda v: rpc.init_rpc(f"worker{rank}", **{kw: v}), bad, exc, kw)
            if why is not None:
                fails.append(f"init_rpc({kw}={bad!r}): {why}")
            if rpc.is_initialized():
                return fails + ["init_rpc started with a bad timeout"]
    B.start(rank, rpc_timeout=20)
    for name, param, fn in _rpc_entry_points(rank):
        for bad, exc in BAD:
            why = _refused(fn, bad, exc, param)
            if why is not None:
                fails.append(f"{name}({param}={bad!r}): {why}")
    # still running, and calls work after all those refusals
    B.check(fails, rpc.is_initialized(), "a refused shutdown(timeout=...) stopped RPC")
    B.check(fails, rpc.rpc_sync(B.peer(rank), B.add, args=(2, 2), timeout=30) == 4, "calls")
    hpcdp.barrier()
    rpc.shutdown()
    return fails


def test_rpc_entry_points_refuse_bad_timeouts() -> None:
    res = hpcdp.spawn(body_rpc_timeouts, 2, backend="sim", timeout=60, join_timeout=100)
    assert res == [[], []], res


@pytest.mark.parametrize("raw", ["inf", "nan", "0", "-1", "five"])
def test_rpc_timeout_env_refused(raw: str, monkeypatch) -> None:
    from hpcdp.rpc._api import _default_timeout

    monkeypatch.setenv("HPCDP_RPC_TIMEOUT", raw)
    with pytest.raises(ValueError, match="HPCDP_RPC_TIMEOUT"):
        _default_timeout()


@pytest.mark.parametrize("bad,exc", BAD)
def test_world_entry_points_refuse_bad_timeouts(bad: Any, exc: type) -> None:
    """init, collectives, p2p and Work.wait: one rank of the simulated backend."""

    def body(rank: int) -> list[str]:
        fails = []
        work = hpcdp.allreduce(np.ones(2), async_op=True)
        for name, param, fn in [
            ("allreduce", "timeout", lambda v: hpcdp.allreduce(np.ones(2), timeout=v)),
            ("barrier", "timeout", lambda v: hpcdp.barrier(timeout=v)),
            ("broadcast", "timeout", lambda v: hpcdp.broadcast(np.ones(2), timeout=v)),
            ("new_group", "timeout", lambda v: hpcdp.new_group([0], timeout=v)),
            ("Work.wait", "timeout", lambda v: work.wait(timeout=v)),
            ("wait_all", "timeout", lambda v: hpcdp.wait_all([work], timeout=v)),
        ]:
            why = _refused(fn, bad, exc, param)
            if why is not None:
                fails.append(f"{name}({param}={bad!r}): {why}")
        work.wait()
        return fails

    res = hpcdp.spawn(body, 1, backend="sim", timeout=30, join_timeout=60)
    assert res == [[]], res


@pytest.mark.parametrize("bad,exc", BAD)
def test_async_checkpoint_wait_refuses_bad_timeouts(bad: Any, exc: type) -> None:
    from hpcdp.checkpoint._save import AsyncSave

    handle = AsyncSave("/nonexistent/ckpt")
    handle._done.set()  # a finished save: only the timeout is in question
    why = _refused(lambda v: handle.wait(timeout=v), bad, exc, "timeout")
    assert why is None, f"AsyncSave.wait(timeout={bad!r}): {why}"


@pytest.mark.parametrize("bad,exc", BAD)
def test_spawn_pipeline_and_tcp_refuse_bad_timeouts(bad: Any, exc: type, monkeypatch) -> None:
    """hpcdp.spawn's timeouts, Pipeline(timeout=...) and the TCP backend's connect timeout."""
    from hpcdp.backends.tcp._backend import _connect_timeout

    fails = []
    for name, param, fn in [
        ("spawn", "timeout", lambda v: hpcdp.spawn(lambda r: r, 1, timeout=v)),
        ("spawn", "join_timeout", lambda v: hpcdp.spawn(lambda r: r, 1, join_timeout=v)),
        ("init(backend='tcp')", "connect_timeout", _connect_timeout),
    ]:
        why = _refused(fn, bad, exc, param)
        if why is not None:
            fails.append(f"{name}({param}={bad!r}): {why}")

    def pipeline_body(rank: int) -> str | None:
        from hpcdp import nn
        from hpcdp.pipeline import Pipeline, PipelineStage

        stage = PipelineStage(nn.Sequential(nn.Linear(2, 2, seed=0)))
        return _refused(lambda v: Pipeline(stage, schedule="1f1b", n_microbatches=2,
                                           loss_fn=nn.MSELoss(), timeout=v), bad, exc, "timeout")

    why = hpcdp.spawn(pipeline_body, 1, timeout=30, join_timeout=60)[0]
    if why is not None:
        fails.append(f"Pipeline(timeout={bad!r}): {why}")
    assert fails == [], fails


@pytest.mark.parametrize("raw", ["inf", "nan", "0", "-1", "five"])
def test_connect_timeout_env_refused(raw: str, monkeypatch) -> None:
    from hpcdp.backends.tcp._backend import _connect_timeout

    monkeypatch.setenv("HPCDP_CONNECT_TIMEOUT", raw)
    with pytest.raises(ValueError, match="HPCDP_CONNECT_TIMEOUT"):
        _connect_timeout(None)
    monkeypatch.setenv("HPCDP_CONNECT_TIMEOUT", "12.5")
    assert _connect_timeout(None) == 12.5 and _connect_timeout(3) == 3.0

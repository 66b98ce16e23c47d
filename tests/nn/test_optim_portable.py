"""Optimizer state crosses DDP <-> FSDP <-> one process through a checkpoint (issue 21, item 3).

Every layer's optimizer ``state_dict`` is keyed by parameter name, and every load takes it: a run
saved under one layer and resumed under another ends, after one more step, where an
uninterrupted run in one process ends (parameters and Adam's moments, float64, 1e-12). Only the
README's calls are used: ``opt.state_dict()`` and ``opt.load_state_dict()``.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import hpcdp
from conftest import run_ranks
from hpcdp import nn, optim
from hpcdp.checkpoint import Shard, load, save
from hpcdp.fsdp import FSDP

pytestmark = pytest.mark.timeout(240)

BATCH = 12   # global batch: divisible by 1, 2 and 3 ranks
TOL = 1e-12


def make_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 8, seed=1), nn.Tanh(), nn.Linear(8, 3, seed=2)).astype(np.float64)


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + step)
    return rng.standard_normal((BATCH, 6)), rng.integers(0, 3, BATCH)


def _held(v: Any) -> tuple[tuple[int, ...], np.ndarray]:
    if isinstance(v, Shard):
        return tuple(v.offsets), np.array(v.local, copy=True)
    a = np.array(v, copy=True)
    return (0,) * a.ndim, a


def body_segment(rank: int, kind: str, start: int, stop: int, load_from: str | None,
                 save_to: str | None) -> dict[str, Any]:
    """Train steps [start, stop) under ``kind`` ("plain", "ddp", "fsdp:<strategy>"), loading model
    and optimizer from ``load_from`` first, saving to ``save_to`` after; return what this rank
    holds: parameters and optimizer arrays as (offsets, block), and each parameter's step."""
    g = hpcdp.get_default_group()
    model = make_model()
    if kind == "plain":
        w, params = model, model.named_parameters()
    elif kind == "ddp":
        w = hpcdp.DDP(model)
        params = w.parameters()
    else:
        w = FSDP(model, strategy=kind.split(":")[1])
        params = w.parameters()
    opt = optim.Adam(params, lr=0.05)

    def state(step: int) -> dict[str, Any]:
        return {"model": w.state_dict(), "optim": opt.state_dict(), "step": step}

    if load_from is not None:
        got = load(load_from, like=state(0))
        w.load_state_dict(got["model"])
        opt.load_state_dict(got["optim"])
        assert int(got["step"]) == start, got["step"]
    loss_fn = nn.CrossEntropyLoss()
    b = BATCH // g.size
    for s in range(start, stop):
        x, y = batch(s)
        mine = slice(g.rank * b, (g.rank + 1) * b)
        loss_fn(w(x[mine]), y[mine])
        w.backward(loss_fn.backward())
        opt.step()
        opt.zero_grad()
    if save_to is not None:
        save(save_to, state(stop))
    sd = opt.state_dict()
    return {"params": {k: _held(v) for k, v in w.state_dict().items()},
            "moments": {(n, k): _held(v) for n, st in sd["state"].items() for k, v in st.items()
                        if k != "step"},
            "steps": {n: int(st["step"]) for n, st in sd["state"].items()},
            "keys": sorted(map(str, sd["state"]))}


def _stitch(per_rank: list[dict[str, Any]], part: str, like: dict[Any, np.ndarray]) -> dict[Any, np.ndarray]:
    """Every rank's blocks of ``part`` put together into arrays shaped as in ``like``."""
    out = {k: np.full(v.shape, np.nan) for k, v in like.items()}
    for res in per_rank:
        for k, (off, block) in res[part].items():
            out[k][tuple(slice(o, o + n) for o, n in zip(off, block.shape))] = block
    return out


def reference(steps: int) -> dict[str, Any]:
    return run_ranks("sim", 1, body_segment, "plain", 0, steps, None, None)[0]


def _check_against_reference(per_rank: list[dict[str, Any]], ref: dict[str, Any],
                             what: str) -> None:
    for part in ("params", "moments"):
        want = {k: b for k, (_, b) in ref[part].items()}
        got = _stitch(per_rank, part, want)
        assert set(got) == set(want), (what, part)
        for k in want:
            err = float(np.max(np.abs(got[k] - want[k])))
            assert err <= TOL, f"{what}: {part} {k} differs by {err:.3g}"
    for r, res in enumerate(per_rank):
        assert res["keys"] == ref["keys"], f"{what}: rank {r}'s optimizer state is keyed {res['keys']}"
        assert res["steps"] == ref["steps"], (what, r, res["steps"])


def test_state_dicts_are_keyed_by_name(tmp_path) -> None:
    names = ["0.weight", "0.bias", "2.weight", "2.bias"]
    for kind, n in (("ddp", 2), ("fsdp:full_shard", 3), ("plain", 1)):
        res = run_ranks("sim", n, body_segment, kind, 0, 1, None, None)
        assert all(r["keys"] == sorted(names) for r in res), (kind, res[0]["keys"])


@pytest.mark.parametrize("target", ["fsdp:full_shard", "fsdp:shard_grad_op", "plain"])
def test_ddp_to_fsdp_and_plain(tmp_path, target: str) -> None:
    path = str(tmp_path / "ck" / "step-2")
    run_ranks("sim", 2, body_segment, "ddp", 0, 2, None, path)
    n = 1 if target == "plain" else 3
    resumed = run_ranks("sim", n, body_segment, target, 2, 3, path, None)
    _check_against_reference(resumed, reference(3), f"ddp(2) -> {target}({n})")


@pytest.mark.parametrize("target", ["ddp", "plain"])
def test_fsdp_to_ddp_and_plain(tmp_path, target: str) -> None:
    path = str(tmp_path / "ck" / "step-2")
    run_ranks("sim", 3, body_segment, "fsdp:full_shard", 0, 2, None, path)
    n = 1 if target == "plain" else 2
    resumed = run_ranks("sim", n, body_segment, target, 2, 3, path, None)
    _check_against_reference(resumed, reference(3), f"fsdp(3) -> {target}({n})")


def test_index_keyed_state_from_older_checkpoints_still_loads(tmp_path) -> None:
    """An optimizer over unnamed parameters saves torch's index keys; they load by position."""
    path = str(tmp_path / "ck" / "step-2")

    def body_unnamed(rank: int) -> None:
        model = make_model()
        opt = optim.Adam(model.parameters(), lr=0.05)
        loss_fn = nn.CrossEntropyLoss()
        for s in range(2):
            x, y = batch(s)
            loss_fn(model(x), y)
            model.backward(loss_fn.backward())
            opt.step()
            opt.zero_grad()
        sd = opt.state_dict()
        assert sorted(sd["state"]) == [0, 1, 2, 3], sd["state"].keys()
        save(path, {"model": model.state_dict(), "optim": sd, "step": 2})

    run_ranks("sim", 1, body_unnamed)
    for kind, n in (("fsdp:full_shard", 3), ("ddp", 2)):
        resumed = run_ranks("sim", n, body_segment, kind, 2, 3, path, None)
        _check_against_reference(resumed, reference(3), f"index-keyed -> {kind}({n})")


def test_name_keyed_state_into_an_unnamed_optimizer_says_what_to_do(tmp_path) -> None:
    path = str(tmp_path / "ck" / "step-1")
    run_ranks("sim", 2, body_segment, "ddp", 0, 1, None, path)
    model = make_model()
    opt = optim.Adam(model.parameters(), lr=0.05)
    got = load(path)
    with pytest.raises(ValueError, match=r"keyed by parameter name.*named_parameters\(\)"):
        opt.load_state_dict(got["optim"])
    assert not opt.state
    converted = optim.name_keyed({"state": {0: {"step": 1}}, "param_groups": [{"lr": 1.0, "params": [0, 1]}]},
                                 ["a", "b"])
    assert converted == {"state": {"a": {"step": 1}}, "param_groups": [{"lr": 1.0, "params": ["a", "b"]}]}

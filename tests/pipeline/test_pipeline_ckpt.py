"""Pipeline checkpoints: a 4-stage pipeline's checkpoint loads into the plain model, into a
2-stage pipeline and under DDP (state dicts use the unsplit model's names), optimizer state too."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import hpcdp
from conftest import run_mpi, run_ranks
from hpcdp import optim
from hpcdp import pipeline as pp
from pipeline_bodies import (_subgroup, body_ckpt_ddp, body_ckpt_load, body_ckpt_plain, body_ckpt_save,
                             make_data, make_loss, make_model)


def _merge(per_rank: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    merged: dict[str, np.ndarray] = {}
    for params in per_rank:
        assert not set(params) & set(merged), "a parameter saved by two ranks"
        merged.update(params)
    return merged


@pytest.mark.timeout(180)
def test_pipeline4_to_plain_and_pipeline2(tmp_path) -> None:
    path = str(tmp_path / "ck" / "step-1")
    trained = _merge(run_ranks("sim", 4, body_ckpt_save, path))
    plain = make_model(seed=11)
    assert set(trained) == {n for n, _ in plain.named_parameters()}
    state = hpcdp.checkpoint.load(path, like={"model": plain.state_dict(), "step": 0})
    plain.load_state_dict(state["model"])
    for n, p in plain.named_parameters():
        assert np.array_equal(p.data, trained[n]), n
    assert not np.array_equal(trained["0.weight"], make_model(seed=3)[0].weight.data), \
        "the saved model should differ from its initialisation (a step ran)"
    for n_load in (2, 1):
        fails = run_ranks("sim", n_load, body_ckpt_load, path, trained)
        assert not any(fails), fails
    fails = run_ranks("sim", 2, body_ckpt_ddp, path, trained)
    assert not any(fails), fails


# Not a world of the test above: spawned worlds save on 4 ranks and load on fresh worlds of 2
# and 1; one mpirun job cannot change its size, so it saves on the whole world and loads on
# sub-groups (as does the optimizer-state test below).
@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(180)
def test_pipeline_checkpoint_mpi(mpi_world, tmp_path_factory) -> None:
    # saved by a pipeline of the whole world; loaded by one of 2 ranks and by the plain model
    path = str(tmp_path_factory.mktemp("pipeline-ckpt") / "step-1") if mpi_world.rank == 0 else None
    path = hpcdp.broadcast_object(path)
    trained = _merge(run_mpi(body_ckpt_save, path))
    for fails in (run_mpi(body_ckpt_load, path, trained, 2), run_mpi(body_ckpt_plain, path, trained)):
        assert not any(fails), fails


# -- optimizer state (issue 21, item 4) ----------------------------------------------------------
# Adam under a 4-stage pipeline for 2 steps, saved with pipe.optim_state_dict(opt); resumed under
# DDP on 2 ranks, in one process and under a 2-stage pipeline for one more step: parameters and
# moments equal an uninterrupted run of the plain model on the whole batch.
OPT_STEPS = 2
OPT_TOL = 1e-10


def _adam(params: Any) -> Any:
    return optim.Adam(params, lr=0.05)


def _held_optim(opt: Any, sd: dict[str, Any]) -> dict[str, Any]:
    """This rank's parameters' optimizer arrays ((name, key) -> array) and steps, from ``sd``."""
    from hpcdp.checkpoint import Shard

    moments, steps = {}, {}
    for n, st in sd["state"].items():
        for k, v in st.items():
            if k == "step":
                steps[n] = int(v)
            elif not isinstance(v, Shard) or v.local.shape == tuple(v.global_shape):
                moments[(n, k)] = np.array(v.local if isinstance(v, Shard) else v, copy=True)
    return {"moments": moments, "steps": steps}


def body_opt_reference(rank: int, steps: int) -> dict[str, Any]:
    """The plain model, Adam over its named parameters, the whole batch, ``steps`` steps."""
    model = make_model(seed=3)
    opt = _adam(model.named_parameters())
    loss_fn = make_loss("ce")
    for s in range(steps):
        x, y = make_data("ce", s)
        loss_fn(model(x), y)
        model.backward(loss_fn.backward())
        opt.step()
        opt.zero_grad()
    out = _held_optim(opt, opt.state_dict())
    out["params"] = {n: p.data.copy() for n, p in model.named_parameters()}
    return out


def body_opt_pipeline_save(rank: int, path: str) -> dict[str, Any]:
    stage = pp.PipelineStage(make_model(seed=3))
    pipe = pp.Pipeline(stage, schedule="1f1b", n_microbatches=4, loss_fn=make_loss("ce"))
    opt = _adam(stage.parameters())
    for s in range(OPT_STEPS):
        x, y = make_data("ce", s)
        pipe.step(x, y)
        opt.step()
        opt.zero_grad()
    sd = pipe.optim_state_dict(opt)
    hpcdp.checkpoint.save(path, {"model": pipe.state_dict(), "optim": sd, "step": OPT_STEPS})
    again = opt.state_dict()   # the same, collective too: what a torch habit saves
    return {"names": sorted(sd["state"]), "again": sorted(again["state"]),
            "groups": [list(g["params"]) for g in sd["param_groups"]]}


def body_opt_resume(rank: int, kind: str, path: str, n: int) -> dict[str, Any] | None:
    """Load the checkpoint under ``kind`` ("ddp", "plain", "pipeline") on the first ``n`` ranks,
    run step OPT_STEPS, return what this rank holds."""
    group = _subgroup(n)
    if not group.is_member:
        return None
    model = make_model(seed=11)
    if kind == "pipeline":
        w: Any = pp.PipelineStage(model, group=group)
        pipe = pp.Pipeline(w, schedule="gpipe", n_microbatches=2, loss_fn=make_loss("ce"))
        opt = _adam(w.parameters())
        osd = pipe.optim_state_dict(opt)
    else:
        w = hpcdp.DDP(model, group=group) if kind == "ddp" else model
        opt = _adam(w.parameters() if kind == "ddp" else model.named_parameters())
        osd = opt.state_dict()
    got = hpcdp.checkpoint.load(path, like={"model": w.state_dict(), "optim": osd, "step": 0},
                                group=group)
    w.load_state_dict(got["model"])
    opt.load_state_dict(got["optim"])
    assert int(got["step"]) == OPT_STEPS
    x, y = make_data("ce", OPT_STEPS)
    loss_fn = make_loss("ce")
    if kind == "pipeline":
        pipe.step(x, y)
    else:
        b = len(x) // group.size
        mine = slice(group.rank * b, (group.rank + 1) * b)
        loss_fn(w(x[mine]), y[mine])
        w.backward(loss_fn.backward())
    opt.step()
    sd = pipe.optim_state_dict(opt) if kind == "pipeline" else opt.state_dict()
    out = _held_optim(opt, sd)
    out["params"] = {nm: p.data.copy() for nm, p in w.named_parameters()}
    return out


def _compare_resumed(per_rank: list[Any], ref: dict[str, Any], what: str) -> None:
    seen: dict[str, set] = {"params": set(), "moments": set()}
    for r, res in enumerate(per_rank):
        if res is None:
            continue
        for part in ("params", "moments"):
            for k, v in res[part].items():
                err = float(np.max(np.abs(v - ref[part][k])))
                assert err <= OPT_TOL, f"{what}: rank {r}'s {part} {k} differs by {err:.3g}"
                seen[part].add(k)
        for nm, step in res["steps"].items():
            assert step == OPT_STEPS + 1, (what, r, nm, step)
    for part in ("params", "moments"):
        assert seen[part] == set(ref[part]), (what, part, sorted(set(ref[part]) - seen[part]))


def _check_saved(saved: list[dict[str, Any]]) -> None:
    names = sorted(n for n, _ in make_model().named_parameters())
    for res in saved:
        assert res["names"] == names and res["again"] == names, res
        assert [sorted(g) for g in res["groups"]] == [names], res["groups"]


@pytest.mark.timeout(180)
def test_pipeline_optimizer_state_resumes_under_ddp_and_one_process(tmp_path) -> None:
    path = str(tmp_path / "ck" / "step-2")
    _check_saved(run_ranks("sim", 4, body_opt_pipeline_save, path))
    ref = run_ranks("sim", 1, body_opt_reference, OPT_STEPS + 1)[0]
    for kind, n in (("ddp", 2), ("plain", 1), ("pipeline", 2)):
        _compare_resumed(run_ranks("sim", n, body_opt_resume, kind, path, n), ref, f"{kind} on {n}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(180)
def test_pipeline_optimizer_state_mpi(mpi_world, tmp_path_factory) -> None:
    path = str(tmp_path_factory.mktemp("pipeline-opt") / "step-2") if mpi_world.rank == 0 else None
    path = hpcdp.broadcast_object(path)
    _check_saved(run_mpi(body_opt_pipeline_save, path))
    ref = body_opt_reference(0, OPT_STEPS + 1)
    for kind, n in (("ddp", 2), ("plain", 1)):
        _compare_resumed(run_mpi(body_opt_resume, kind, path, n), ref, f"{kind} on {n}")

"""Pipeline checkpoints: a 4-stage pipeline's checkpoint loads into the plain model, into a
2-stage pipeline and under DDP (state dicts use the unsplit model's names)."""
from __future__ import annotations

import numpy as np
import pytest

import hpcdp
from conftest import run_mpi, run_ranks
from pipeline_bodies import body_ckpt_ddp, body_ckpt_load, body_ckpt_plain, body_ckpt_save, make_model


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


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(180)
def test_pipeline_checkpoint_mpi(mpi_world, tmp_path_factory) -> None:
    # saved by a pipeline of the whole world; loaded by one of 2 ranks and by the plain model
    path = str(tmp_path_factory.mktemp("pipeline-ckpt") / "step-1") if mpi_world.rank == 0 else None
    path = hpcdp.broadcast_object(path)
    trained = _merge(run_mpi(body_ckpt_save, path))
    for fails in (run_mpi(body_ckpt_load, path, trained, 2), run_mpi(body_ckpt_plain, path, trained)):
        assert not any(fails), fails

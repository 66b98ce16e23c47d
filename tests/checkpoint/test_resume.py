"""Resume parity: the DDP example interrupted and resumed ends with the same parameters."""
from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

import hpcdp
from hpcdp.testing import run_mpi, run_ranks, spawn_backends

SPAWN_BACKENDS = spawn_backends()

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "examples", "02_ddp_train.py")


def _example():
    spec = importlib.util.spec_from_file_location("ddp_train_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def body_train(rank: int, argv: list[str]) -> dict:
    out = _example().main(argv + ["--no-progress"])
    return {k: out[k] for k in ("step", "params", "start_step", "steps_run", "resumed_from")}


BASE = ["--epochs", "2", "--batch-size", "32", "--hidden", "32", "--seed", "3"]


def _parity(run, ckdir: str) -> None:
    full = run(BASE)
    total = full[0]["step"]
    assert all(r["start_step"] == 0 and r["steps_run"] == total for r in full), full[0]
    stop = total * 2 // 3
    every = max(2, stop // 3)
    if stop % every == 0:
        stop += 1  # stop between two saves, so the resumed run replays some steps
    first = run(BASE + ["--ckpt-dir", ckdir, "--save-every", str(every), "--max-steps", str(stop)])
    assert all(r["step"] == stop for r in first), (stop, [r["step"] for r in first])
    assert all(r["start_step"] == 0 and r["resumed_from"] is None for r in first)
    saved = stop // every * every
    path = hpcdp.checkpoint.latest(ckdir)
    assert path.endswith(f"step-{saved}")
    resumed = run(BASE + ["--ckpt-dir", ckdir, "--save-every", str(every), "--resume"])
    for r, b in enumerate(resumed):
        # --resume really resumed: from that checkpoint, at its step, running only the rest
        assert b["resumed_from"] == path, (r, b["resumed_from"], path)
        assert (b["start_step"], b["steps_run"]) == (saved, total - saved), (r, b["start_step"], b["steps_run"])
    for r, (a, b) in enumerate(zip(full, resumed)):
        assert a["step"] == b["step"], (a["step"], b["step"])
        assert list(a["params"]) == list(b["params"])
        for k in a["params"]:
            assert np.array_equal(a["params"][k], b["params"][k]), f"rank {r}: {k} differs"


@pytest.mark.parametrize("backend", SPAWN_BACKENDS)
@pytest.mark.parametrize("world_size", [1, 2])
def test_resume_parity(backend: str, world_size: int, tmp_path) -> None:
    _parity(lambda argv: run_ranks(backend, world_size, body_train, argv, timeout=120),
            str(tmp_path / "ck"))


@pytest.mark.mpi(min_size=2)
def test_resume_parity_mpi(mpi_world) -> None:
    from ckpt_bodies import shared_dir

    d = shared_dir()
    _parity(lambda argv: run_mpi(body_train, argv), os.path.join(d, "ck"))
    hpcdp.barrier()
    if hpcdp.rank() == 0:
        import shutil

        shutil.rmtree(d, ignore_errors=True)

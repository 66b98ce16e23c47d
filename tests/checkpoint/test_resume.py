"""Resume parity: the DDP example interrupted and resumed ends with the same parameters."""
from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

import hpcdp
from hpcdp.testing.fixtures import World, grid, worlds

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


@pytest.mark.parametrize("world", worlds(*grid([1, 2]), "mpi"), indirect=True)
def test_resume_parity(world: World, shared_tmp_path: str) -> None:
    _parity(lambda argv: world.run(body_train, argv, timeout=120), os.path.join(shared_tmp_path, "ck"))

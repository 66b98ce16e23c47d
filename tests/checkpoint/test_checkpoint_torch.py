"""A torch model's and torch optimizer's state through ``hpcdp.checkpoint`` (issue 23, item 4).

Saved under ``hpcdp.DDP`` at one world size, it resumes under DDP at another and in one process of
plain torch (``torch.nn.Module`` + ``torch.optim``), ending where an uninterrupted run ends; no
pickle and no ``torch.load`` anywhere. A tampered file or state is refused with an error naming
the entry, changes nothing, and allocates no more than the file holds.
"""
from __future__ import annotations

import json
import os
import tracemalloc
import zlib
from typing import Any, Callable

import h5py
import numpy as np
import pytest
import torch

import hpcdp
from checkpoint_torch_bodies import (
    SAVED_AT, body_resume, body_save, make_model, make_opt, resume_plain, save_plain,
)
from hpcdp.checkpoint import load, load_into, save, state_of
from hpcdp.checkpoint._format import MANIFEST
from hpcdp.optim import get_optimizer_state_dict, set_optimizer_state_dict
from hpcdp.testing import check, run_ranks
from hpcdp.testing.fixtures import World, worlds

pytestmark = pytest.mark.timeout(240)

KINDS = ["adamw", "sgd"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world", worlds("sim-2", "tcp-2", "mpi"), indirect=True)
def test_ddp_resume_any_world_size_and_plain_torch(world: World, kind: str, shared_tmp_path: str) -> None:
    """Saved at this world's size; resumed on 1, 3 and 4 simulated ranks (or, under MPI, on the
    same world) and in one process of plain torch: parameters within 1e-12 of 5 straight steps."""
    path = os.path.join(shared_tmp_path, f"ck-{kind}")
    check(world.run(body_save, kind, path, timeout=60))
    if world.is_mpi:
        check(world.run(body_resume, kind, path))
    else:
        for n in (1, 3, 4):
            check(run_ranks("sim", n, body_resume, kind, path))
    check([resume_plain(kind, path)])


def test_plain_torch_round_trip_and_hpcdp_adam_interop(tmp_path: Any) -> None:
    """No hpcdp layer at all: ``state_of(model, opt)`` in one process resumes under DDP; and torch
    AdamW's state loads into hpcdp's Adam and back (the same entry names and meanings)."""
    path = str(tmp_path / "plain")
    save_plain("adamw", path)
    check(run_ranks("sim", 2, body_resume, "adamw", path))
    check([resume_plain("adamw", path)])
    m = make_model()
    state = load(path)["optim"]
    hp = hpcdp.optim.AdamW(hpcdp.nn.from_torch(m).named_parameters(), lr=0.5)
    hp.load_state_dict(state)
    assert hp.param_groups[0]["betas"] == (0.8, 0.95) and hp.param_groups[0]["lr"] == 0.05
    first = hp.state[next(iter(hp.state))]
    assert first["step"] == SAVED_AT and isinstance(first["step"], int)
    opt = make_opt("adamw", m.parameters())
    set_optimizer_state_dict(m, opt, hp.state_dict())        # hpcdp's int step -> torch's tensor
    step = opt.state[next(m.parameters())]["step"]
    assert isinstance(step, torch.Tensor) and step.dtype == torch.float32 and float(step) == SAVED_AT
    for n, p in m.named_parameters():
        np.testing.assert_array_equal(opt.state[p]["exp_avg"].numpy(), state["state"][n]["exp_avg"])


def test_state_is_views_and_load_copies(tmp_path: Any) -> None:
    """``get_optimizer_state_dict`` hands out views (save copies them); loading copies, so the
    optimizer's new state never aliases the arrays it was given."""
    m = make_model()
    opt = make_opt("adamw", m.parameters())
    m(torch.ones(2, 5, dtype=torch.float64)).sum().backward()
    opt.step()
    sd = get_optimizer_state_dict(m, opt)
    p = next(m.parameters())
    assert np.shares_memory(sd["state"]["0.weight"]["exp_avg"], opt.state[p]["exp_avg"].numpy())
    m2 = make_model()
    opt2 = make_opt("adamw", m2.parameters())
    set_optimizer_state_dict(m2, opt2, sd)
    p2 = next(m2.parameters())
    assert not np.shares_memory(sd["state"]["0.weight"]["exp_avg"], opt2.state[p2]["exp_avg"].numpy())
    np.testing.assert_array_equal(opt2.state[p2]["exp_avg"].numpy(), opt.state[p]["exp_avg"].numpy())


# -- untrusted ------------------------------------------------------------------------------------
TAMPERED: dict[str, tuple[Callable[[dict], Any], type, str]] = {
    "wrong shape": (lambda s: s["state"]["0.weight"].update(exp_avg=np.zeros((7, 4))),
                    ValueError, "has shape (7, 4), the parameter (7, 5)"),
    "wrong dtype": (lambda s: s["state"]["0.weight"].update(exp_avg=np.zeros((7, 5), np.complex128)),
                    TypeError, "dtype complex128"),
    "bool moments": (lambda s: s["state"]["2.bias"].update(exp_avg_sq=np.ones(3, bool)),
                     TypeError, "dtype bool"),
    "extra key": (lambda s: s["state"]["0.bias"].update(exp_avg_cube=np.zeros(7)),
                  KeyError, "['exp_avg_cube'] this optimizer does not keep"),
    "missing key": (lambda s: s["state"]["0.bias"].pop("exp_avg_sq"), KeyError, "lacks ['exp_avg_sq']"),
    "fractional step": (lambda s: s["state"]["0.bias"].update(step=np.float32(2.5)),
                        ValueError, "non-negative whole number"),
    "negative step": (lambda s: s["state"]["0.bias"].update(step=-1), ValueError, "non-negative"),
    "array step": (lambda s: s["state"]["0.bias"].update(step=np.arange(3.0)), ValueError,
                   "single number"),
    "string step": (lambda s: s["state"]["0.bias"].update(step="3"), TypeError, "finite real"),
    "unknown parameter": (lambda s: s["state"].update({"9.weight": {}}), KeyError, "'9.weight'"),
    "betas of three": (lambda s: s["param_groups"][0].update(betas=(0.9, 0.9, 0.9)), TypeError,
                       "2 finite numbers"),
    "string lr": (lambda s: s["param_groups"][0].update(lr="0.1"), TypeError, "finite number"),
    "bool flag as number": (lambda s: s["param_groups"][0].update(amsgrad=1), TypeError, "bool"),
}


def _snapshot(m: torch.nn.Module, opt: Any) -> tuple[list[np.ndarray], dict, list]:
    params = [p.detach().numpy().copy() for p in m.parameters()]
    state = {id(p): {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items()}
             for p, st in opt.state.items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return params, state, groups


def _same(before: tuple, m: torch.nn.Module, opt: Any) -> None:
    params, state, groups = before
    for a, p in zip(params, m.parameters()):
        np.testing.assert_array_equal(a, p.detach().numpy())
    assert {id(p) for p in opt.state} == set(state)
    for p, st in opt.state.items():
        for k, v in st.items():
            assert torch.equal(v, state[id(p)][k])
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups


@pytest.mark.parametrize("case", list(TAMPERED))
def test_tampered_optimizer_state_is_refused(tmp_path: Any, case: str) -> None:
    """A checkpoint whose optimizer state was altered: ``load_into`` raises naming the entry, and
    neither the model nor the optimizer (which already holds state) changes."""
    good = str(tmp_path / "good")
    save_plain("adamw", good)
    state = load(good)
    change, exc, words = TAMPERED[case]
    change(state["optim"])
    bad = str(tmp_path / "bad")
    save(bad, state)
    m, opt = save_plain("adamw", str(tmp_path / "other"), steps=1)
    before = _snapshot(m, opt)
    with pytest.raises(exc) as info:
        load_into(bad, m, opt)
    assert words in str(info.value), str(info.value)
    _same(before, m, opt)


def test_huge_state_shape_is_refused_before_any_copy() -> None:
    """A state array declaring a huge shape (here a zero-stride view: no memory behind it) is
    refused on its shape before anything is copied."""
    m = make_model()
    opt = make_opt("adamw", m.parameters())
    m(torch.ones(2, 5, dtype=torch.float64)).sum().backward()
    opt.step()
    sd = get_optimizer_state_dict(m, opt)
    sd["state"]["0.weight"]["exp_avg"] = np.broadcast_to(np.zeros(()), (1 << 20, 1 << 20))
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=r"has shape \(1048576, 1048576\), the parameter \(7, 5\)"):
            set_optimizer_state_dict(m, opt, sd)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < (1 << 20), peak


def test_huge_declared_size_in_the_file_allocates_nothing(tmp_path: Any) -> None:
    """The file's manifest declares an optimizer moment of 2**34 float64 (its CRC fixed up): the
    load refuses it before allocating, and what it allocates stays below the file's size."""
    path = str(tmp_path / "ck")
    save_plain("adamw", path)
    fn = os.path.join(path, "data.h5")
    with h5py.File(fn, "r+") as f:
        raw = f[MANIFEST][()]
        m = json.loads(raw.decode() if isinstance(raw, bytes) else bytes(raw).decode())
        key = next(k for k in m["datasets"] if k.endswith("exp_avg") and "0.weight" in k)
        m["datasets"][key]["shape"] = [1 << 17, 1 << 17]
        m["datasets"][key]["slabs"][0]["shape"] = [1 << 17, 1 << 17]
        del f[MANIFEST]
        text = json.dumps(m).encode()
        d = f.create_dataset(MANIFEST, data=np.frombuffer(text, np.uint8))
        d.attrs["crc32"] = np.uint32(zlib.crc32(text))
    size = os.path.getsize(fn)
    mod, opt = make_model(), make_opt("adamw", make_model().parameters())
    tracemalloc.start()
    try:
        with pytest.raises(hpcdp.CheckpointError, match="exp_avg") as info:
            load_into(path, mod, opt)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "0.weight" in str(info.value), str(info.value)
    assert peak < size + (1 << 20), (peak, size)


def test_load_into_refuses_a_model_that_does_not_fit(tmp_path: Any) -> None:
    path = str(tmp_path / "ck")
    save_plain("sgd", path)
    other = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3)).double()
    opt = make_opt("sgd", other.parameters())
    with pytest.raises(ValueError, match=r"0.weight: saved \(7, 5\) float64, model \(6, 5\) float64"):
        load_into(path, other, opt)
    with pytest.raises(KeyError, match="'optim'"):
        save(str(tmp_path / "m"), state_of(make_model()))
        load_into(str(tmp_path / "m"), make_model(), opt)

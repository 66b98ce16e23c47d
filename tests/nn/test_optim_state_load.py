"""Optimizer state is checked at load (issue 20, item 8): shapes, dtypes, hyper-parameter types and
indices, by one checker shared by the plain optimizers, ZeroRedundancyOptimizer and FSDP. A bad
entry raises at load naming the entry, and leaves the optimizer as it was; nothing is dropped."""
from __future__ import annotations

import copy
from typing import Any, Callable

import numpy as np
import pytest

import hpcdp
from conftest import run_ranks
from hpcdp import nn, optim
from hpcdp.fsdp import FSDP

SHAPES = ((3, 4), (4,), (2, 2, 2))


def make_params(seed: int = 0) -> list[nn.Parameter]:
    rng = np.random.default_rng(seed)
    return [nn.Parameter(rng.standard_normal(s)) for s in SHAPES]


def trained(factory: Callable[[list], Any], params: list) -> dict[str, Any]:
    """The state dict of ``factory(params)`` after two steps (state for every parameter)."""
    opt = factory(params)
    for s in range(2):
        rng = np.random.default_rng(s)
        for p in params:
            p.grad = rng.standard_normal(p.shape)
        opt.step()
    return copy.deepcopy(opt.state_dict())


def _set(sd: dict[str, Any], path: tuple, value: Any) -> dict[str, Any]:
    sd = copy.deepcopy(sd)
    node = sd
    for k in path[:-1]:
        node = node[k]
    if value is _DROP:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return sd


_DROP = object()
ADAM = lambda ps: optim.Adam(ps, lr=1e-2)   # noqa: E731
SGD = lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9)   # noqa: E731

# (factory, where in the state dict, the bad value, the error class, what the message must name)
BAD = [
    (ADAM, ("state", 1, "exp_avg"), np.zeros((1, 4)), ValueError, "parameter 1['exp_avg'] has shape (1, 4)"),
    (ADAM, ("state", 0, "exp_avg_sq"), np.zeros((3, 4, 1)), ValueError, "parameter 0['exp_avg_sq'] has shape (3, 4, 1)"),
    (ADAM, ("state", 2, "exp_avg"), np.array(["x"] * 8).reshape(2, 2, 2), TypeError, "parameter 2['exp_avg'] has dtype <U1"),
    (ADAM, ("state", 0, "step"), "3", TypeError, "parameter 0['step'] must be a non-negative integer"),
    (ADAM, ("state", 0, "step"), -1, TypeError, "parameter 0['step'] must be a non-negative integer"),
    (ADAM, ("state", 1, "exp_avg"), 0.5, TypeError, "parameter 1['exp_avg'] must be an array"),
    (ADAM, ("state", 1, "exp_avg_sq"), _DROP, KeyError, "state of parameter 1 lacks ['exp_avg_sq']"),
    (ADAM, ("state", 1, "momentum"), np.zeros(4), KeyError, "entries ['momentum']"),
    (ADAM, ("state", 7), {"step": 1}, KeyError, "state for parameter 7, which no loaded param group lists"),
    (ADAM, ("param_groups", 0, "lr"), "0.1", TypeError, "param group 0 'lr' must be a finite number"),
    (ADAM, ("param_groups", 0, "lr"), float("nan"), TypeError, "param group 0 'lr' must be a finite number"),
    (ADAM, ("param_groups", 0, "betas"), (0.9,), TypeError, "param group 0 'betas' must be 2 finite numbers"),
    (ADAM, ("param_groups", 0, "amsgrad"), "no", TypeError, "param group 0 'amsgrad' must be a bool"),
    (SGD, ("state", 0, "momentum_buffer"), np.zeros(12), ValueError, "parameter 0['momentum_buffer'] has shape (12,)"),
    (SGD, ("param_groups", 0, "momentum"), None, TypeError, "param group 0 'momentum' must be a finite number"),
]


@pytest.mark.parametrize("factory,path,value,kind,needle", BAD,
                         ids=[f"{'adam' if f is ADAM else 'sgd'}-{'-'.join(map(str, p))}"
                              for f, p, *_ in BAD])
def test_plain_optimizer_refuses_bad_state(factory, path, value, kind, needle) -> None:
    sd = _set(trained(factory, make_params()), path, value)
    params = make_params(1)
    opt = factory(params)
    before = copy.deepcopy((opt.param_groups[0]["lr"], len(opt.state)))
    with pytest.raises(kind) as info:
        opt.load_state_dict(sd)
    assert needle in str(info.value), str(info.value)
    assert f"{type(opt).__name__}.load_state_dict" in str(info.value)
    assert (opt.param_groups[0]["lr"], len(opt.state)) == before, "a failed load changed the optimizer"


def test_good_state_still_loads_as_hdf5_gives_it_back() -> None:
    """String keys, numpy scalars, a float step and tuples as arrays are accepted and typed."""
    sd = trained(ADAM, make_params())
    sd["state"] = {str(k): dict(v, step=np.float64(v["step"])) for k, v in sd["state"].items()}
    sd["param_groups"][0] = dict(sd["param_groups"][0], lr=np.float64(0.01), betas=np.array([0.9, 0.99]),
                                 amsgrad=np.bool_(False))
    opt = optim.Adam(make_params(1), lr=1.0)
    opt.load_state_dict(sd)
    g = opt.param_groups[0]
    assert type(g["lr"]) is float and g["betas"] == (0.9, 0.99) and g["amsgrad"] is False
    assert all(type(st["step"]) is int and st["step"] == 2 for st in opt.state.values())


# -- ZeroRedundancyOptimizer and FSDP: every rank checks, the error names the entry -------------------
ZERO_CASES = [(("state", 1, "exp_avg"), "row", "parameter 1['exp_avg'] has shape (1, 4)"),
              (("state", 0, "exp_avg"), "3d", "parameter 0['exp_avg'] has shape (3, 4, 1)"),
              (("param_groups", 0, "lr"), "str", "param group 0 'lr' must be a finite number"),
              (("state", 9), "extra", "state for parameter 9, which no loaded param group lists")]
_VALUES = {"row": np.zeros((1, 4)), "3d": np.zeros((3, 4, 1)), "str": "0.01", "extra": {"step": 1}}


def body_zero_load(rank: int) -> list[str]:
    from hpcdp.optim import ZeroRedundancyOptimizer

    fails = []
    good = trained(ADAM, make_params())
    for path, value, needle in ZERO_CASES:
        zero = ZeroRedundancyOptimizer(make_params(1), optim.Adam, lr=1e-2)
        try:
            zero.load_state_dict(_set(good, path, _VALUES[value]))
            fails.append(f"rank {rank}: {value} loaded")
        except (ValueError, TypeError, KeyError) as exc:
            if needle not in str(exc) or f"rank {rank}" not in str(exc):
                fails.append(f"rank {rank}: {value}: {type(exc).__name__}: {exc}")
    zero = ZeroRedundancyOptimizer(make_params(1), optim.Adam, lr=1e-2)
    zero.load_state_dict(good)   # and a good one loads, each rank keeping its share
    mine = zero.local_optimizer_state()
    for i, p in enumerate(q for g in zero.param_groups for q in g["params"]):
        if (zero.owner[id(p)] == rank) != (p in mine):
            fails.append(f"rank {rank}: parameter {i} state kept by the wrong rank")
        elif p in mine and not np.array_equal(mine[p]["exp_avg"], good["state"][i]["exp_avg"]):
            fails.append(f"rank {rank}: parameter {i} exp_avg differs from the loaded one")
    return fails


@pytest.mark.timeout(60)
def test_zero_refuses_bad_state_on_every_rank() -> None:
    per_rank = run_ranks("sim", 2, body_zero_load, timeout=20, join_timeout=50)
    assert per_rank == [[], []], per_rank


def body_fsdp_load(rank: int) -> list[str]:
    fails = []
    model = nn.Sequential(nn.Linear(4, 6, dtype=np.float64, seed=1), nn.Tanh(),
                          nn.Linear(6, 3, dtype=np.float64, seed=2))
    fsdp = FSDP(model)
    opt = optim.Adam(fsdp.parameters(), lr=1e-2)
    x = np.random.default_rng(rank).standard_normal((4, 4))
    loss_fn = nn.MSELoss()
    loss_fn(fsdp(x), np.zeros((4, 3)))
    fsdp.backward(loss_fn.backward())
    opt.step()
    good = fsdp.optim_state_dict(opt)
    name = "0.weight"
    assert name in good["state"], sorted(good["state"])
    cases = [(("state", name, "exp_avg"), np.zeros((1, 24)), ValueError, f"'{name}'['exp_avg'] has shape (1, 24)"),
             (("state", name, "exp_avg_sq"), np.zeros((6, 4, 1)), ValueError, f"'{name}'['exp_avg_sq'] has shape (6, 4, 1)"),
             (("param_groups", 0, "lr"), "0.01", TypeError, "param group 0 'lr' must be a finite number"),
             (("state", name, "step"), np.array("1"), TypeError, f"'{name}'['step'] must be a non-negative integer")]
    for path, value, kind, needle in cases:
        bad = dict(good, state={k: dict(v) for k, v in good["state"].items()},
                   param_groups=[dict(g) for g in good["param_groups"]])
        node = bad
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
        lr = opt.param_groups[0]["lr"]
        try:
            fsdp.load_optim_state_dict(opt, bad)
            fails.append(f"rank {rank}: {path} = {value!r} loaded")
        except kind as exc:
            if needle not in str(exc) or f"rank {rank}" not in str(exc):
                fails.append(f"rank {rank}: {path}: {type(exc).__name__}: {exc}")
        if opt.param_groups[0]["lr"] != lr:
            fails.append(f"rank {rank}: a failed load changed lr")
    fsdp.load_optim_state_dict(opt, good)
    loss_fn(fsdp(x), np.zeros((4, 3)))
    fsdp.backward(loss_fn.backward())
    opt.step()   # the good state still steps
    return fails


@pytest.mark.timeout(60)
def test_fsdp_refuses_bad_optimizer_state_on_every_rank() -> None:
    per_rank = run_ranks("sim", 2, body_fsdp_load, timeout=20, join_timeout=50)
    assert per_rank == [[], []], per_rank


def test_state_check_is_shared() -> None:
    """One checker: the three loaders call the same functions."""
    from hpcdp.fsdp import _checkpoint
    from hpcdp.optim import state_check as _state_check
    from hpcdp.optim import optimizer, zero

    for mod in (optimizer, zero):  # index-keyed state: one function, built on the two below
        assert mod.check_index_keyed is _state_check.check_index_keyed, mod.__name__
    assert _checkpoint.load_param_state is _state_check.load_param_state
    assert _checkpoint.check_groups is _state_check.check_groups
    assert hpcdp.optim.Adam.state_spec["exp_avg"] == "param"

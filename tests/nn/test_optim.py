"""hpcdp.optim: updates against reference implementations of torch's formulas, state round trips, schedules."""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest

from hpcdp import nn, optim
from hpcdp.optim.lr_scheduler import CosineWarmupLR, LambdaLR, StepLR

STEPS = 5


def make_params(seed=0, shapes=((3, 4), (4,), (2, 2, 2))):
    rng = np.random.default_rng(seed)
    return [nn.Parameter(rng.standard_normal(s)) for s in shapes]


def grads_for(step, params):
    rng = np.random.default_rng(1000 + step)
    return [rng.standard_normal(p.shape) for p in params]


# -- reference implementations, transcribed from the pseudocode in torch's documentation ------------


def ref_sgd(ws, grads_seq, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False):
    ws = [w.copy() for w in ws]
    bufs = [None] * len(ws)
    for grads in grads_seq:
        for i, g in enumerate(grads):
            g = -g if maximize else g
            if weight_decay:
                g = g + weight_decay * ws[i]
            if momentum:
                bufs[i] = g.copy() if bufs[i] is None else momentum * bufs[i] + (1 - dampening) * g
                g = g + momentum * bufs[i] if nesterov else bufs[i]
            ws[i] = ws[i] - lr * g
    return ws


def ref_adam(ws, grads_seq, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, decoupled=False):
    b1, b2 = betas
    ws = [w.copy() for w in ws]
    m = [np.zeros_like(w) for w in ws]
    v = [np.zeros_like(w) for w in ws]
    vmax = [np.zeros_like(w) for w in ws]
    for t, grads in enumerate(grads_seq, start=1):
        for i, g in enumerate(grads):
            if weight_decay:
                if decoupled:
                    ws[i] = ws[i] * (1 - lr * weight_decay)
                else:
                    g = g + weight_decay * ws[i]
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            mhat = m[i] / (1 - b1**t)
            if amsgrad:
                vmax[i] = np.maximum(vmax[i], v[i])
                vhat = vmax[i] / (1 - b2**t)
            else:
                vhat = v[i] / (1 - b2**t)
            ws[i] = ws[i] - lr * mhat / (np.sqrt(vhat) + eps)
    return ws


def run(opt_factory, steps=STEPS, seed=0):
    params = make_params(seed)
    start = [p.data.copy() for p in params]
    data_ids = [id(p.data) for p in params]
    opt = opt_factory(params)
    seq = []
    for s in range(steps):
        grads = grads_for(s, params)
        seq.append(grads)
        for p, g in zip(params, grads):
            p.grad = g.copy()
        opt.step()
        opt.zero_grad()
    assert [id(p.data) for p in params] == data_ids  # updated in place
    return start, seq, params


SGD_CASES = [
    dict(lr=0.1),
    dict(lr=0.1, momentum=0.9),
    dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.01),
    dict(lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.1),
    dict(lr=0.05, momentum=0.8, weight_decay=0.1, maximize=True),
]


@pytest.mark.parametrize("kw", SGD_CASES)
def test_sgd_matches_reference(kw):
    start, seq, params = run(lambda ps: optim.SGD(ps, **kw))
    for got, want in zip(params, ref_sgd(start, seq, **kw)):
        np.testing.assert_allclose(got.data, want, rtol=1e-12, atol=1e-14)


ADAM_CASES = [
    dict(lr=1e-2),
    dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
    dict(lr=1e-2, amsgrad=True),
    dict(lr=1e-2, amsgrad=True, weight_decay=0.05),
]


@pytest.mark.parametrize("kw", ADAM_CASES)
def test_adam_matches_reference(kw):
    start, seq, params = run(lambda ps: optim.Adam(ps, **kw))
    for got, want in zip(params, ref_adam(start, seq, **kw)):
        np.testing.assert_allclose(got.data, want, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("kw", ADAM_CASES[:3] + [dict(lr=1e-2, weight_decay=0.3, amsgrad=True)])
def test_adamw_matches_reference(kw):
    kw = dict(kw)
    kw.setdefault("weight_decay", 0.01)  # AdamW's default, as torch
    start, seq, params = run(lambda ps: optim.AdamW(ps, **kw))
    for got, want in zip(params, ref_adam(start, seq, decoupled=True, **kw)):
        np.testing.assert_allclose(got.data, want, rtol=1e-10, atol=1e-13)
    assert optim.AdamW(make_params()).defaults["weight_decay"] == 0.01


def test_adam_first_step_is_lr_sign():
    p = nn.Parameter(np.array([1.0, -2.0, 3.0]))
    p.grad = np.array([0.5, -4.0, 1e-3])
    optim.Adam([p], lr=0.1, eps=0.0).step()
    np.testing.assert_allclose(p.data, [0.9, -1.9, 2.9], rtol=1e-12)


def test_float32_keeps_dtype():
    p = nn.Parameter(np.ones(4, np.float32))
    for opt in (optim.SGD([p], lr=0.1, momentum=0.9), optim.Adam([p]), optim.AdamW([p], amsgrad=True)):
        p.grad = np.full(4, 0.5, np.float32)
        opt.step()
        opt.step()
        assert p.data.dtype == np.float32
        assert all(v.dtype == np.float32 for v in opt.state[p].values() if hasattr(v, "dtype"))


def test_params_without_grad_are_skipped_and_groups():
    a, b = make_params(shapes=((2,), (3,)))
    b0 = b.data.copy()
    opt = optim.SGD([{"params": [a], "lr": 1.0}, {"params": [b]}], lr=0.1, momentum=0.5)
    a.grad = np.ones(2)
    opt.step()
    np.testing.assert_array_equal(b.data, b0)
    assert b not in opt.state and "momentum_buffer" in opt.state[a]
    assert opt.param_groups[0]["lr"] == 1.0 and opt.param_groups[1]["lr"] == 0.1
    opt.zero_grad(set_to_none=False)
    assert np.all(a.grad == 0)
    opt.zero_grad()
    assert a.grad is None
    with pytest.raises(ValueError):
        optim.SGD([a, a], lr=0.1)
    with pytest.raises(ValueError):
        optim.SGD([], lr=0.1)
    with pytest.raises(ValueError):
        optim.SGD([a], lr=0.1, nesterov=True)


def _hdf5_like(sd):
    """What comes back from an HDF5 file: string keys, numpy scalars, tuples as arrays, copied arrays."""
    def conv(v):
        if isinstance(v, dict):
            return {str(k): conv(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return np.asarray(v) if all(isinstance(x, (int, float)) for x in v) else [conv(x) for x in v]
        if isinstance(v, np.ndarray):
            return v.copy()
        if isinstance(v, bool):
            return np.bool_(v)
        if isinstance(v, (int, float)):
            return np.asarray(v)[()]
        return v
    out = conv(sd)
    out["param_groups"] = [dict(g, params=list(g["params"])) for g in out["param_groups"]]
    return out


@pytest.mark.parametrize("factory", [
    lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    lambda ps: optim.Adam(ps, lr=1e-2, amsgrad=True),
    lambda ps: optim.AdamW([{"params": ps[:1]}, {"params": ps[1:], "lr": 3e-3}], lr=1e-2),
])
@pytest.mark.parametrize("convert", [copy.deepcopy, _hdf5_like])
def test_state_dict_round_trip_continues_identically(factory, convert):
    params = make_params()
    opt = factory(params)
    for s in range(3):
        for p, g in zip(params, grads_for(s, params)):
            p.grad = g
        opt.step()
    saved_params = [p.data.copy() for p in params]
    sd = convert(opt.state_dict())
    assert set(opt.state_dict()) == {"state", "param_groups"}
    assert all(isinstance(k, int) for k in opt.state_dict()["state"])

    clone = make_params(seed=99)
    for c, w in zip(clone, saved_params):
        c.data[...] = w
    opt2 = factory(clone)
    opt2.load_state_dict(sd)
    for s in range(3, 6):
        for ps in (params, clone):
            for p, g in zip(ps, grads_for(s, ps)):
                p.grad = g
        opt.step()
        opt2.step()
    for a, b in zip(params, clone):
        np.testing.assert_array_equal(a.data, b.data)
    for g1, g2 in zip(opt.param_groups, opt2.param_groups):
        assert {k: v for k, v in g1.items() if k != "params"} == {k: v for k, v in g2.items() if k != "params"}
        if "betas" in g2:
            assert isinstance(g2["betas"], tuple)


def test_load_state_dict_copies_and_validates():
    params = make_params()
    opt = optim.Adam(params)
    for p, g in zip(params, grads_for(0, params)):
        p.grad = g
    opt.step()
    sd = opt.state_dict()
    opt2 = optim.Adam(make_params())
    opt2.load_state_dict(sd)
    assert opt2.state[opt2.param_groups[0]["params"][0]]["exp_avg"] is not sd["state"][0]["exp_avg"]
    with pytest.raises(ValueError, match="parameters"):
        optim.Adam(make_params()[:2]).load_state_dict(sd)


# -- schedules ----------------------------------------------------------------------------------------


def _opt(lr=1.0):
    return optim.SGD(make_params(shapes=((1,),)), lr=lr)


def _lrs(sched, n):
    out = []
    for _ in range(n):
        out.append(sched.get_last_lr()[0])
        assert sched.optimizer.param_groups[0]["lr"] == out[-1]
        sched.step()
    return out


def test_step_lr():
    assert _lrs(StepLR(_opt(), step_size=2, gamma=0.5), 6) == pytest.approx([1, 1, 0.5, 0.5, 0.25, 0.25])


def test_cosine_warmup_lr():
    sched = CosineWarmupLR(_opt(2.0), warmup_steps=4, total_steps=8, min_lr=0.2)
    got = _lrs(sched, 11)
    want = [2.0 * (t + 1) / 4 for t in range(4)]
    want += [0.2 + 1.8 * 0.5 * (1 + math.cos(math.pi * (t - 4) / 4)) for t in range(4, 9)]
    want += [0.2, 0.2]
    assert got == pytest.approx(want)
    assert got[3] == got[4] == pytest.approx(2.0) and got[8] == pytest.approx(0.2)
    assert _lrs(CosineWarmupLR(_opt(), 0, 2), 3) == pytest.approx([1.0, 0.5, 0.0])


def test_lambda_lr_per_group():
    p, q = make_params(shapes=((1,), (1,)))
    opt = optim.SGD([{"params": [p]}, {"params": [q], "lr": 10.0}], lr=1.0)
    sched = LambdaLR(opt, [lambda t: 0.5**t, lambda t: t + 1])
    sched.step()
    sched.step()
    assert sched.get_last_lr() == pytest.approx([0.25, 30.0])


def test_scheduler_state_dict_round_trip():
    opt = _opt()
    sched = CosineWarmupLR(opt, warmup_steps=3, total_steps=10)
    for _ in range(5):
        sched.step()
    sd = sched.state_dict()
    assert "optimizer" not in sd and sd["last_epoch"] == 5
    assert all(isinstance(v, (int, float, list)) for v in sd.values())
    opt2 = _opt()
    sched2 = CosineWarmupLR(opt2, warmup_steps=3, total_steps=10)
    sched2.load_state_dict(sd)
    sched.step()
    sched2.step()
    assert sched2.get_last_lr() == sched.get_last_lr() and opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    lam = LambdaLR(_opt(), lambda t: 1.0)
    assert "lr_lambdas" not in lam.state_dict()

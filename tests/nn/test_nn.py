"""hpcdp.nn: finite-difference gradient checks of every layer and loss, hooks, state dicts, init."""
from __future__ import annotations

import math

import numpy as np
import pytest

from hpcdp import nn
from hpcdp.nn.utils import clip_grad_norm_, parameters_to_vector, vector_to_parameters

F64 = np.float64


def numgrad(f, arr, eps=1e-6):
    """Central finite differences of the scalar f() with respect to arr (perturbed in place)."""
    g = np.zeros(arr.shape, dtype=np.float64)
    it = np.nditer(arr, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        old = arr[i]
        arr[i] = old + eps
        fp = f()
        arr[i] = old - eps
        fm = f()
        arr[i] = old
        g[i] = (fp - fm) / (2 * eps)
    return g


def check_layer(layer, x, *, input_grad=True, before_forward=lambda: None, rtol=1e-5, atol=1e-7):
    """Compare analytic input and parameter gradients of sum(layer(x) * R) with finite differences."""
    rng = np.random.default_rng(123)
    before_forward()
    R = rng.standard_normal(layer(x).shape)

    def f():
        before_forward()
        return float((layer(x) * R).sum())

    layer.zero_grad()
    before_forward()
    layer(x)
    dx = layer.backward(R)
    if input_grad:
        np.testing.assert_allclose(dx, numgrad(f, x), rtol=rtol, atol=atol)
    else:
        assert dx is None
    checked = 0
    for name, p in layer.named_parameters():
        assert p.grad is not None, name
        assert p.grad.dtype == p.data.dtype and p.grad.shape == p.data.shape
        np.testing.assert_allclose(p.grad, numgrad(f, p.data), rtol=rtol, atol=atol, err_msg=name)
        checked += 1
    return checked


def randn(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


# -- gradient checks --------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(4, 3), (2, 3, 3)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_grad(shape, bias):
    layer = nn.Linear(3, 5, bias=bias, dtype=F64, seed=1)
    assert check_layer(layer, randn(*shape)) == (2 if bias else 1)


@pytest.mark.parametrize("act", [nn.ReLU, nn.GELU, nn.Tanh, nn.Sigmoid, nn.Identity, nn.Flatten])
def test_activation_grad(act):
    assert check_layer(act(), randn(3, 2, 4)) == 0


def test_gelu_matches_tanh_formula():
    x = np.linspace(-5, 5, 101)
    ref = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    # GELU() is now exact (erf) as in torch; the tanh formula is GELU(approximate="tanh").
    np.testing.assert_allclose(nn.GELU(approximate="tanh")(x), ref, rtol=1e-12)


@pytest.mark.parametrize("normalized_shape,shape", [(6, (4, 6)), (6, (2, 3, 6)), ((2, 3), (4, 2, 3))])
def test_layernorm_grad(normalized_shape, shape):
    ln = nn.LayerNorm(normalized_shape, dtype=F64)
    rng = np.random.default_rng(5)
    ln.weight.data[...] = rng.standard_normal(ln.weight.shape)  # non-trivial affine part
    ln.bias.data[...] = rng.standard_normal(ln.bias.shape)
    assert check_layer(ln, randn(*shape) * 3 + 1) == 2


def test_layernorm_without_affine_and_values():
    x = randn(5, 8)
    y = nn.LayerNorm(8, elementwise_affine=False, dtype=F64)(x)
    np.testing.assert_allclose(y.mean(-1), 0, atol=1e-12)
    np.testing.assert_allclose(y.var(-1), 1 / (1 + 1e-5 / x.var(-1)), rtol=1e-9)
    assert check_layer(nn.LayerNorm(8, elementwise_affine=False, dtype=F64), x) == 0


def test_embedding_grad_with_repeated_indices():
    emb = nn.Embedding(7, 3, dtype=F64, seed=0)
    idx = np.array([[1, 2, 1], [6, 1, 0]])
    assert check_layer(emb, idx, input_grad=False) == 1
    assert np.all(emb.weight.grad[[3, 4, 5]] == 0)
    with pytest.raises(TypeError):
        emb(np.array([0.5]))


def test_dropout_grad_uses_forward_mask():
    d = nn.Dropout(0.4, seed=7)
    x = randn(6, 5) + 3.0  # away from 0 so out/x recovers the mask
    reseed = lambda: setattr(d, "generator", np.random.default_rng(7))  # noqa: E731 - same mask every forward
    check_layer(d, x, before_forward=reseed)
    out = d(x)
    mask = out / x
    assert set(np.round(np.unique(mask), 12)) <= {0.0, round(1 / 0.6, 12)}
    assert 0 < np.count_nonzero(mask) < mask.size
    g = randn(6, 5, seed=9)
    np.testing.assert_array_equal(d.backward(g), g * mask.round(12).astype(bool) / 0.6)


def test_dropout_eval_identity_and_determinism():
    x = np.ones((50, 40))
    a, b = nn.Dropout(0.5, seed=3), nn.Dropout(0.5, seed=3)
    np.testing.assert_array_equal(a(x), b(x))
    assert abs((a(x) == 0).mean() - 0.5) < 0.1
    a.eval()
    assert a(x) is x and a.backward(x) is x
    assert nn.Dropout(0.0)(x) is x


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_mse_grad(reduction):
    x, y = randn(4, 3), randn(4, 3, seed=1)
    loss_fn = nn.MSELoss(reduction)
    loss = loss_fn(x, y)
    assert loss.shape == () and loss.dtype == F64
    ref = ((x - y) ** 2).sum() / (x.size if reduction == "mean" else 1)
    assert float(loss) == pytest.approx(ref, rel=1e-12)
    g = loss_fn.backward()
    np.testing.assert_allclose(g, numgrad(lambda: float(loss_fn(x, y)), x), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("shape", [(5, 4), (2, 3, 4)])
def test_cross_entropy_grad(reduction, shape):
    x = randn(*shape) * 2
    t = np.random.default_rng(1).integers(0, shape[-1], size=shape[:-1])
    loss_fn = nn.CrossEntropyLoss(reduction)
    loss = float(loss_fn(x, t))
    flat, ft = x.reshape(-1, shape[-1]), t.reshape(-1)
    nll = -(flat[np.arange(ft.size), ft] - np.log(np.exp(flat).sum(1)))
    assert loss == pytest.approx(nll.mean() if reduction == "mean" else nll.sum(), rel=1e-12)
    g = loss_fn.backward()
    assert g.shape == x.shape
    np.testing.assert_allclose(g, numgrad(lambda: float(loss_fn(x, t)), x), rtol=1e-6, atol=1e-8)


def test_loss_reduction_none_and_grad_output():
    x, t = randn(4, 3), np.array([0, 2, 1, 2])
    ce = nn.CrossEntropyLoss("none")
    per = ce(x, t)
    assert per.shape == (4,)
    w = randn(4, seed=3)
    np.testing.assert_allclose(ce.backward(w), numgrad(lambda: float((ce(x, t) * w).sum()), x), rtol=1e-6, atol=1e-8)
    mse = nn.MSELoss()
    mse(x, x + 1)
    np.testing.assert_allclose(mse.backward(2.0), -2 * 2.0 * np.ones_like(x) / x.size)


def test_cross_entropy_stable_and_validates():
    x = np.array([[1000.0, -1000.0, 0.0], [-5e4, 5e4, 5e4]], dtype=np.float32)
    loss_fn = nn.CrossEntropyLoss()
    loss = loss_fn(x, np.array([0, 1]))
    assert loss.dtype == np.float32 and loss.shape == ()
    assert float(loss) == pytest.approx(math.log(2) / 2, rel=1e-5)
    assert np.all(np.isfinite(loss_fn.backward()))
    with pytest.raises(ValueError):
        loss_fn(x, np.array([0, 3]))
    with pytest.raises(TypeError):
        loss_fn(x, np.array([0.0, 1.0]))
    with pytest.raises(ValueError):
        loss_fn(x, np.array([0]))


def test_sequential_grad():
    nn.manual_seed(11)
    model = nn.Sequential(
        nn.Linear(4, 6, dtype=F64), nn.GELU(), nn.LayerNorm(6, dtype=F64), nn.Tanh(),
        nn.Linear(6, 5, dtype=F64), nn.ReLU(), nn.Linear(5, 3, dtype=F64),
    )
    assert check_layer(model, randn(7, 4)) == 8


def test_training_loop_grad_through_loss():
    nn.manual_seed(2)
    model = nn.Sequential(nn.Linear(3, 8, dtype=F64), nn.Tanh(), nn.Linear(8, 4, dtype=F64))
    x, y = randn(6, 3), np.array([0, 1, 2, 3, 0, 1])
    loss_fn = nn.CrossEntropyLoss()
    out = model(x)
    loss_fn(out, y)
    model.backward(loss_fn.backward())
    for name, p in model.named_parameters():
        num = numgrad(lambda: float(loss_fn(model(x), y)), p.data)
        np.testing.assert_allclose(p.grad, num, rtol=1e-5, atol=1e-8, err_msg=name)


def test_backward_without_forward_raises():
    for layer in (nn.Linear(2, 2), nn.ReLU(), nn.GELU(), nn.LayerNorm(2), nn.Dropout(), nn.Embedding(3, 2)):
        with pytest.raises(RuntimeError, match="without a preceding forward"):
            layer.backward(np.ones((1, 2), dtype=np.float32))
    with pytest.raises(RuntimeError):
        nn.MSELoss().backward()


# -- hooks --------------------------------------------------------------------------------------------


def _mlp(dtype=F64):
    nn.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4, dtype=dtype), nn.ReLU(), nn.Linear(4, 4, dtype=dtype),
                         nn.LayerNorm(4, dtype=dtype), nn.Linear(4, 2, dtype=dtype))


def test_hooks_fire_in_reverse_parameter_order_once_with_complete_grad():
    model = _mlp()
    names = [n for n, _ in model.named_parameters()]
    fired, seen_grads = [], {}

    def hook_for(name):
        def hook(p):
            fired.append(name)
            seen_grads.setdefault(name, []).append(p.grad.copy())
        return hook

    for n, p in model.named_parameters():
        p.register_hook(hook_for(n))
    x = randn(5, 3)
    for step in range(2):
        fired.clear()
        model(x)
        model.backward(np.ones((5, 2)))
        assert fired == names[::-1]  # each parameter exactly once, last layer first
    for n, p in model.named_parameters():
        assert len(seen_grads[n]) == 2
        np.testing.assert_array_equal(seen_grads[n][1], p.grad)  # complete (accumulated) at hook time
        np.testing.assert_allclose(seen_grads[n][1], 2 * seen_grads[n][0])


def test_last_layer_hook_fires_before_first_layer_grad_exists():
    model = _mlp()
    state = {}
    model[4].weight.register_hook(lambda p: state.setdefault("first_grad", model[0].weight.grad))
    model(randn(2, 3))
    model.backward(np.ones((2, 2)))
    assert state["first_grad"] is None and model[0].weight.grad is not None


def test_hook_remove_and_frozen_parameters():
    model = _mlp()
    calls = []
    h = model[0].weight.register_hook(lambda p: calls.append("w"))
    model[2].requires_grad_(False)
    model[2].weight.register_hook(lambda p: calls.append("frozen"))
    x = randn(4, 3)
    model(x)
    dx = model.backward(np.ones((4, 2)))
    assert calls == ["w"] and model[2].weight.grad is None and model[2].bias.grad is None
    h.remove()
    h.remove()  # idempotent
    model(x)
    np.testing.assert_array_equal(model.backward(np.ones((4, 2))), dx)  # input grad unaffected by freezing
    assert calls == ["w"]


def test_accumulate_grad_in_place_and_checks():
    p = nn.Parameter(np.zeros(3))
    buf = np.zeros(3)
    p.grad = buf  # e.g. a view into a DDP bucket
    p.accumulate_grad(np.ones(3))
    assert p.grad is buf and np.all(buf == 1)
    with pytest.raises(ValueError, match="shape"):
        p.accumulate_grad(np.ones(4))
    p.zero_grad(set_to_none=False)
    assert p.grad is buf and np.all(buf == 0)
    p.zero_grad()
    assert p.grad is None
    g = np.ones(3, dtype=np.float32)
    p.accumulate_grad(g)
    assert p.grad is not g and p.grad.dtype == F64
    with pytest.raises(TypeError):
        nn.Parameter(np.arange(3))
    assert nn.Parameter(np.zeros((2, 3), np.float32)).shape == (2, 3)


# -- module machinery ---------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 2, seed=0)
        self.scale = nn.Parameter(np.ones(2, np.float32))
        self.register_buffer("running", np.zeros(2, np.float32))
        self.register_buffer("scratch", np.zeros(1, np.float32), persistent=False)
        self.note = "plain attribute"


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(Block(), nn.ReLU(), Block())
        self.head = nn.Linear(2, 3, bias=False, seed=1)
        self.tied = self.head  # the same module twice: its parameters appear once


def test_named_parameters_buffers_children():
    net = Net()
    assert [n for n, _ in net.named_parameters()] == [
        # torch's order: a module's own parameters, then each child's (registration order at each level)
        "encoder.0.scale", "encoder.0.fc.weight", "encoder.0.fc.bias",
        "encoder.2.scale", "encoder.2.fc.weight", "encoder.2.fc.bias", "head.weight",
    ]
    assert len(list(net.parameters())) == 7
    assert [n for n, _ in net.named_buffers()] == ["encoder.0.running", "encoder.0.scratch",
                                                   "encoder.2.running", "encoder.2.scratch"]
    assert [n for n, _ in net.named_children()] == ["encoder", "head", "tied"]
    assert len(list(net.modules())) == 1 + 1 + 3 + 2 + 1  # net, encoder, 3 children, 2 fc, head
    assert [n for n, _ in net.named_parameters(prefix="model")][0] == "model.encoder.0.scale"
    assert net.encoder[0].note == "plain attribute" and net.encoder[0].fc.weight.name == "weight"
    assert nn.Linear(2, 2, bias=False).bias is None


def test_parameters_shared_between_modules_appear_once():
    a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    b.weight = a.weight
    seq = nn.Sequential(a, b)
    assert [n for n, _ in seq.named_parameters()] == ["0.weight", "0.bias", "1.bias"]


def test_setattr_registration_rules():
    m = nn.Module()
    m.w = nn.Parameter(np.zeros(2))
    with pytest.raises(TypeError):
        m.w = np.zeros(2)
    m.w = nn.Linear(1, 1)  # replacing a parameter by a module moves it
    assert "w" in m._modules and "w" not in m._parameters
    del m.w
    assert list(m.parameters()) == []

    class Bad(nn.Module):
        def __init__(self):
            self.x = 1

    with pytest.raises(AttributeError, match="__init__"):
        Bad()


def test_train_eval_propagate():
    net = Net()
    assert net.training and net.encoder[0].fc.training
    assert net.eval() is net
    assert not any(m.training for m in net.modules())
    net.train()
    assert all(m.training for m in net.modules())


def test_state_dict_round_trip():
    src, dst = Net(), Net()
    for p in src.parameters():
        p.data[...] = np.random.default_rng(p.size).standard_normal(p.shape)
    src.encoder[0].running[...] = 7
    sd = src.state_dict()
    assert list(sd) == [n for n, _ in src.named_parameters()] + ["encoder.0.running", "encoder.2.running"]
    assert sd["head.weight"] is src.head.weight.data  # live arrays, like torch
    before = {k: id(v) for k, v in dst.state_dict().items()}
    assert dst.load_state_dict({k: v.copy() for k, v in sd.items()}) == ([], [])
    assert {k: id(v) for k, v in dst.state_dict().items()} == before  # copied in place
    for k in sd:
        np.testing.assert_array_equal(dst.state_dict()[k], sd[k])
    x = np.ones((3, 2), np.float32)
    np.testing.assert_array_equal(src.head(src.encoder[0].fc(x)), dst.head(dst.encoder[0].fc(x)))


def test_load_state_dict_strict_errors():
    net = Net()
    sd = {k: v.copy() for k, v in net.state_dict().items()}
    del sd["head.weight"]
    sd["bogus"] = np.zeros(1)
    with pytest.raises(KeyError, match=r"missing keys \['head.weight'\].*unexpected keys \['bogus'\]"):
        net.load_state_dict(sd)
    res = net.load_state_dict(sd, strict=False)
    assert res.missing_keys == ["head.weight"] and res.unexpected_keys == ["bogus"]
    bad = dict(net.state_dict())
    bad["head.weight"] = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match="head.weight"):
        net.load_state_dict(bad)
    bad["head.weight"] = np.zeros((3, 2), np.float64)
    with pytest.raises(ValueError, match="float64"):
        net.load_state_dict(bad)


def test_deterministic_init():
    def build():
        return nn.Sequential(nn.Linear(5, 7), nn.Dropout(0.1), nn.Linear(7, 2), nn.Embedding(4, 3))

    nn.manual_seed(42)
    a = build()
    nn.manual_seed(42)
    b = build()
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        np.testing.assert_array_equal(pa.data, pb.data, err_msg=na)
    nn.manual_seed(43)
    assert not np.array_equal(build()[0].weight.data, a[0].weight.data)
    l1, l2 = nn.Linear(9, 4, seed=5), nn.Linear(9, 4, seed=5)
    np.testing.assert_array_equal(l1.weight.data, l2.weight.data)
    assert np.abs(l1.weight.data).max() <= 1 / 3 and np.abs(l1.bias.data).max() <= 1 / 3
    assert np.abs(l1.weight.data).max() > 0.25  # actually spans the bound
    l64 = nn.Linear(9, 4, seed=5, dtype=F64)
    np.testing.assert_array_equal(l64.weight.data.astype(np.float32), l1.weight.data)


def test_float32_end_to_end_and_astype():
    model = _mlp(np.float32)
    x = np.random.default_rng(0).standard_normal((8, 3)).astype(np.float32)
    out = model(x)
    assert out.dtype == np.float32
    loss_fn = nn.CrossEntropyLoss()
    loss = loss_fn(out, np.zeros(8, dtype=np.int64))
    assert loss.dtype == np.float32 and isinstance(float(loss), float)
    assert model.backward(loss_fn.backward()).dtype == np.float32
    assert all(p.grad.dtype == np.float32 for p in model.parameters())
    model.astype(np.float64)
    assert all(p.data.dtype == F64 and p.grad.dtype == F64 for p in model.parameters())
    assert model(x.astype(F64)).dtype == F64
    assert model.to("cpu") is model


def test_zero_grad_and_utils():
    model = _mlp()
    model(randn(4, 3))
    model.backward(np.ones((4, 2)) * 100)
    params = list(model.parameters())
    norm = math.sqrt(sum(float((p.grad**2).sum()) for p in params))
    assert clip_grad_norm_(params, 1.0) == pytest.approx(norm)
    assert math.sqrt(sum(float((p.grad**2).sum()) for p in params)) == pytest.approx(1.0, rel=1e-5)
    assert clip_grad_norm_(params, 10.0) == pytest.approx(1.0, rel=1e-5)  # below the cap: unchanged
    vec = parameters_to_vector(params)
    assert vec.shape == (sum(p.size for p in params),)
    vector_to_parameters(vec * 2, params)
    np.testing.assert_array_equal(parameters_to_vector(params), vec * 2)
    with pytest.raises(ValueError):
        vector_to_parameters(vec[:-1], params)
    model.zero_grad()
    assert all(p.grad is None for p in params)


def test_tied_weights_sum_grads_and_fire_hook_per_use():
    emb, head = nn.Embedding(5, 3, dtype=F64, seed=0), nn.Linear(3, 5, bias=False, dtype=F64, seed=1)
    head.weight = emb.weight  # weight tying: one Parameter used by two layers
    calls = []
    emb.weight.register_hook(lambda p: calls.append(p.grad.copy()))
    idx = np.array([0, 3, 3, 1])

    def loss():
        return float((head(emb(idx)) ** 2).sum())

    out = head(emb(idx))
    emb.backward(head.backward(2 * out))
    assert len(calls) == 2  # one accumulate_grad per use; the last call sees the complete gradient
    np.testing.assert_array_equal(calls[-1], emb.weight.grad)
    np.testing.assert_allclose(emb.weight.grad, numgrad(loss, emb.weight.data), rtol=1e-6, atol=1e-8)

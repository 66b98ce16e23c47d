"""hpcdp.nn with several microbatches in flight and a split backward (input part now, weight part later)."""
from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np
import pytest

from hpcdp import nn
from hpcdp.errors import HpcdpError
from test_nn_layers import GatedMLP, ResidualBlock

F64 = np.float64
V, S, E, H, C, B = 7, 4, 4, 2, 3, 3


def build_every_layer(seed: int = 0) -> nn.Sequential:
    """A model holding every layer type of hpcdp.nn (containers included), float64."""
    nn.manual_seed(seed)
    return nn.Sequential(
        nn.Embedding(V, E, padding_idx=0, dtype=F64),
        ResidualBlock(E, H, causal=True, seed=seed + 1),   # LayerNorm, MHA, RMSNorm, GELU, ModuleDict
        GatedMLP(E, seed=seed + 10),                        # ModuleList, SiLU, a fused backward
        nn.Dropout(0.25, seed=seed + 20),
        nn.Linear(E, E, dtype=F64), nn.ReLU(), nn.Linear(E, E, dtype=F64), nn.Tanh(), nn.Sigmoid(),
        nn.GELU(approximate="tanh"), nn.Identity(), nn.Softmax(), nn.LogSoftmax(dim=1),
        nn.Sequential(nn.Flatten(), nn.Linear(S * E, C, dtype=F64)),
    )


def _data(n: int, loss: str) -> list[tuple[Any, Any]]:
    rng = np.random.default_rng(n)
    out = []
    for _ in range(n):
        x = rng.integers(0, V, size=(B, S))
        x[0, 0] = 0  # the padding row is used
        if loss == "ce":
            y = rng.integers(0, C, size=B)
            y[1] = -100  # an ignored target
        else:
            y = rng.standard_normal((B, C))
        out.append((x, y))
    return out


def _loss_fn(loss: str) -> nn.Module:
    return nn.CrossEntropyLoss(label_smoothing=0.1) if loss == "ce" else nn.MSELoss()


def _grads(model: nn.Module) -> dict[str, Any]:
    return {n: p.grad.copy() for n, p in model.named_parameters()}


def _assert_same_grads(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys()
    for n in want:
        np.testing.assert_allclose(got[n], want[n], rtol=1e-11, atol=1e-14, err_msg=n)


def one_at_a_time(data: list[tuple[Any, Any]], loss: str) -> tuple[dict[str, Any], list[float], int]:
    """Reference: forward, loss and backward of each microbatch in turn (microbatch 0)."""
    model, loss_fn = build_every_layer(), _loss_fn(loss)
    losses, per_forward = [], 0
    for x, y in data:
        losses.append(float(loss_fn(model(x), y)))
        per_forward = model.saved_count()
        model.run_backward(loss_fn.backward())
        assert model.saved_count() == 0
    return _grads(model), losses, per_forward


ORDERS = {2: [[2, 1], [1, 2]], 3: [[3, 1, 2], [2, 3, 1]]}


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("loss", ["ce", "mse"])
def test_microbatches_in_flight_match_one_at_a_time(n, loss):
    data = _data(n, loss)
    want, want_losses, per_forward = one_at_a_time(data, loss)
    assert per_forward > 10
    for order in ORDERS[n]:
        model, loss_fn = build_every_layer(), _loss_fn(loss)
        losses = []
        for i, (x, y) in enumerate(data, start=1):
            with nn.microbatch(i):
                losses.append(float(loss_fn(model(x), y)))
        np.testing.assert_allclose(losses, want_losses, rtol=1e-13)
        assert model.saved_count() == n * per_forward and loss_fn.saved_count() == n
        for i in order:
            with nn.microbatch(i):
                model.run_backward(loss_fn.backward())
        _assert_same_grads(_grads(model), want)
        assert model.saved_count() == 0 and loss_fn.saved_count() == 0


@pytest.mark.parametrize("n", [2, 3])
def test_split_backward_in_flight_matches_one_at_a_time(n):
    """Zero-bubble style: every input part first, then the weight parts in another order."""
    data = _data(n, "ce")
    want, _, _ = one_at_a_time(data, "ce")
    model, loss_fn = build_every_layer(), _loss_fn("ce")
    last = model[-1][1].weight
    fired = []
    last.register_hook(lambda p: fired.append(1))
    for i, (x, y) in enumerate(data, start=1):
        with nn.microbatch(i):
            loss_fn(model(x), y)
    input_order, weight_order = ORDERS[n][0], ORDERS[n][1]
    for i in input_order:
        with nn.microbatch(i):
            model.run_backward_input(loss_fn.backward())
    assert last.grad is None and model[0].weight.grad is None and not fired  # weight parts deferred
    assert model.saved_count() > 0  # what the weight gradients need is still held
    for i in weight_order:
        with nn.microbatch(i):
            model.backward_weight()
    assert len(fired) == n
    _assert_same_grads(_grads(model), want)
    assert model.saved_count() == 0


def test_one_f_one_b_interleaving_with_split_backward():
    """F1 F2 B1(input) F3 W1 B2 B3 W3 W2: any interleaving gives the sequential gradients."""
    data = _data(3, "mse")
    want, _, _ = one_at_a_time(data, "mse")
    model, loss_fn = build_every_layer(), _loss_fn("mse")

    def f(i):
        with nn.microbatch(i):
            loss_fn(model(data[i - 1][0]), data[i - 1][1])

    def b(i):
        with nn.microbatch(i):
            model.run_backward_input(loss_fn.backward())

    def w(i):
        with nn.microbatch(i):
            model.backward_weight()

    # Dropout masks follow forward order, so the forwards run in the reference's order 1, 2, 3.
    for step in (lambda: f(1), lambda: f(2), lambda: b(1), lambda: f(3), lambda: w(1), lambda: b(2),
                 lambda: b(3), lambda: w(3), lambda: w(2)):
        step()
    _assert_same_grads(_grads(model), want)
    assert model.saved_count() == 0


# -- split backward, layer by layer -------------------------------------------------------------------


def _rand(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape)


WEIGHTED: dict[str, tuple[Callable[[], nn.Module], Callable[[int], Any]]] = {
    "linear": (lambda: nn.Linear(4, 3, dtype=F64, seed=0), lambda s: _rand((2, 5, 4), s)),
    "linear_nobias": (lambda: nn.Linear(4, 3, bias=False, dtype=F64, seed=0), lambda s: _rand((5, 4), s)),
    "layernorm": (lambda: nn.LayerNorm(4, dtype=F64), lambda s: _rand((3, 4), s)),
    "rmsnorm": (lambda: nn.RMSNorm(4, dtype=F64), lambda s: _rand((3, 2, 4), s)),
    "embedding": (lambda: nn.Embedding(6, 4, padding_idx=2, dtype=F64, seed=0),
                  lambda s: np.random.default_rng(s).integers(0, 6, size=(3, 4))),
    "attention": (lambda: nn.MultiheadAttention(4, 2, dtype=F64, seed=0), lambda s: _rand((2, 3, 4), s)),
    "attention_causal_nobias": (lambda: nn.MultiheadAttention(4, 2, bias=False, causal=True, dtype=F64, seed=0),
                                lambda s: _rand((2, 3, 4), s)),
    "residual_block": (lambda: ResidualBlock(4, 2, causal=False, seed=0), lambda s: _rand((2, 3, 4), s)),
    "sequential": (lambda: nn.Sequential(nn.Linear(4, 4, dtype=F64, seed=1), nn.SiLU(), nn.RMSNorm(4, dtype=F64),
                                         nn.Linear(4, 2, dtype=F64, seed=2)), lambda s: _rand((3, 4), s)),
}


def _randomise(layer: nn.Module) -> nn.Module:
    for i, p in enumerate(layer.parameters()):  # non-trivial affine parts and biases
        p.data[...] = _rand(p.shape, 50 + i) * 0.5
    return layer


@pytest.mark.parametrize("name", list(WEIGHTED))
def test_split_backward_equals_backward(name):
    make, inputs = WEIGHTED[name]
    fused, split = _randomise(make()), _randomise(make())
    x = inputs(0)
    out = fused(x)
    g = _rand(out.shape, 1)
    dx = fused.backward(g)
    split(x)
    dx_split = split.backward_input(g)
    assert all(p.grad is None for p in split.parameters())  # nothing accumulated before the weight part
    split.backward_weight()
    if dx is None:
        assert dx_split is None
    else:
        np.testing.assert_array_equal(dx_split, dx)
    for (n, p), (_, q) in zip(fused.named_parameters(), split.named_parameters()):
        np.testing.assert_array_equal(q.grad, p.grad, err_msg=n)
    assert fused.saved_count() == 0 and split.saved_count() == 0


@pytest.mark.parametrize("name", list(WEIGHTED))
def test_split_backward_interleaved_microbatches(name):
    make, inputs = WEIGHTED[name]
    seq, fly = _randomise(make()), _randomise(make())
    xs = [inputs(10 + i) for i in range(3)]
    gs = [_rand(seq(x).shape, 20 + i) for i, x in enumerate(xs)]
    seq.free_saved()
    dxs = []
    for x, g in zip(xs, gs):
        seq(x)
        dxs.append(seq.backward(g))
    for i, x in enumerate(xs):
        with nn.microbatch(i):
            fly(x)
    got = {}
    for i in (1, 2, 0):
        with nn.microbatch(i):
            got[i] = fly.backward_input(gs[i])
    for i in (2, 0, 1):
        with nn.microbatch(i):
            fly.backward_weight()
    for i, dx in enumerate(dxs):
        if dx is None:
            assert got[i] is None
        else:
            np.testing.assert_allclose(got[i], dx, rtol=1e-13, atol=1e-15)
    for (n, p), (_, q) in zip(seq.named_parameters(), fly.named_parameters()):
        np.testing.assert_allclose(q.grad, p.grad, rtol=1e-12, atol=1e-14, err_msg=n)
    assert fly.saved_count() == 0


def test_frozen_parameters_with_split_backward():
    lin = nn.Linear(3, 2, dtype=F64, seed=0).requires_grad_(False)
    lin(np.ones((1, 3)))
    np.testing.assert_allclose(lin.backward_input(np.ones((1, 2))), np.ones((1, 2)) @ lin.weight.data)
    lin.backward_weight()
    assert lin.weight.grad is None and lin.saved_count() == 0


# -- the microbatch context and saved-tensor bookkeeping ----------------------------------------------


def test_microbatch_context_is_thread_local_and_nests():
    assert nn.current_microbatch() == 0
    seen = {}
    with nn.microbatch(3):
        t = threading.Thread(target=lambda: seen.setdefault("other", nn.current_microbatch()))
        t.start()
        t.join(timeout=30)
        assert not t.is_alive()
        with nn.microbatch(5) as i:
            assert i == 5 and nn.current_microbatch() == 5
        assert nn.current_microbatch() == 3
    assert nn.current_microbatch() == 0 and seen["other"] == 0
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ValueError):
            with nn.microbatch(bad):  # type: ignore[arg-type]
                pass
    assert nn.current_microbatch() == 0


def test_backward_under_wrong_microbatch_and_misordered_parts_raise():
    lin = nn.Linear(2, 2, dtype=F64, seed=0)
    with nn.microbatch(1):
        lin(np.ones((1, 2)))
    with pytest.raises(HpcdpError, match="without a preceding forward under microbatch 2"):
        with nn.microbatch(2):
            lin.backward(np.ones((1, 2)))
    assert lin.pending_microbatches() == ([1], [])
    with nn.microbatch(1):
        with pytest.raises(HpcdpError, match="backward_weight called without a preceding backward_input"):
            lin.backward_weight()
        lin.backward_input(np.ones((1, 2)))
        lin(np.ones((1, 2)))
        with pytest.raises(HpcdpError, match="call backward_weight first"):
            lin.backward_input(np.ones((1, 2)))
    assert lin.pending_microbatches() == ([], [1])
    lin.free_saved(1)
    assert lin.saved_count() == 0


def test_repeated_forward_replaces_saved_tensors_and_free_saved():
    model = nn.Sequential(nn.Linear(3, 3, dtype=F64, seed=0), nn.Tanh())
    for _ in range(5):  # e.g. evaluation: no backward, memory does not grow
        model(np.ones((2, 3)))
    assert model.saved_count() == 2
    with nn.microbatch(4):
        model(np.ones((2, 3)))
    assert model.saved_count() == 4
    model.free_saved(microbatch=0)
    assert model.saved_count() == 2
    model.free_saved()
    assert model.saved_count() == 0
    assert not any(k.startswith("_x") or k in ("_cache", "_mask") for m in model.modules() for k in vars(m))


# -- a module called more than once in one forward pass -----------------------------------------------


class TwiceAct(nn.Module):
    """One GELU applied twice (``act(lin(act(x)))``), its backward written in reverse order."""

    def __init__(self) -> None:
        super().__init__()
        self.act = nn.GELU()
        self.lin = nn.Linear(4, 4, dtype=F64, seed=5)

    def forward(self, x: Any) -> Any:
        return self.act(self.lin(self.act(x)))

    def backward_input(self, g: Any) -> Any:
        return self.act.run_backward_input(self.lin.run_backward_input(self.act.run_backward_input(g)))

    def backward_weight(self) -> None:
        self.lin.backward_weight()


def _shared_and_tied() -> tuple[nn.Module, nn.Module]:
    """The same network twice: once reusing modules, once with distinct modules tying the weights."""
    lin, act = nn.Linear(4, 4, dtype=F64, seed=3), nn.Tanh()
    shared = nn.Sequential(lin, act, lin, act, TwiceAct())
    copy = nn.Linear(4, 4, dtype=F64, seed=9)
    copy.weight, copy.bias = lin.weight, lin.bias     # tied: the same Parameter objects
    inner = TwiceAct()
    inner.lin.weight, inner.lin.bias = shared[4].lin.weight, shared[4].lin.bias
    tied = nn.Sequential(nn.Linear(4, 4, dtype=F64, seed=3), nn.Tanh(), copy, nn.Tanh(), inner)
    tied[0].weight, tied[0].bias = lin.weight, lin.bias
    return shared, tied


@pytest.mark.parametrize("split", [False, True])
def test_module_called_twice_in_one_forward(split):
    """Sequential(lin, act, lin, act, ...) keeps one entry per call: gradients equal tied weights'."""
    xs = [_rand((3, 4), 60 + i) for i in range(2)]
    gs = [_rand((3, 4), 70 + i) for i in range(2)]
    results = []
    for model in _shared_and_tied():
        for i, x in enumerate(xs):            # two microbatches in flight
            with nn.microbatch(i):
                model(x)
        dxs = []
        for i in (1, 0):
            with nn.microbatch(i):
                if split:
                    dxs.append(model.run_backward_input(gs[i]))
                else:
                    dxs.append(model.run_backward(gs[i]))
        if split:
            for i in (0, 1):
                with nn.microbatch(i):
                    model.backward_weight()
        assert model.saved_count() == 0
        results.append((dxs, {id(p): p.grad.copy() for p in model.parameters()}))
        model.zero_grad()
    (dx_shared, g_shared), (dx_tied, g_tied) = results
    for a, b in zip(dx_shared, dx_tied):
        np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-15)
    assert g_shared.keys() == g_tied.keys()
    for k in g_shared:
        np.testing.assert_allclose(g_shared[k], g_tied[k], rtol=1e-13, atol=1e-15)


def test_module_called_twice_matches_finite_differences():
    lin = nn.Linear(3, 3, dtype=F64, seed=4)
    model = nn.Sequential(lin, nn.Tanh(), lin)
    x = _rand((2, 3), 80)
    model.run_backward(model(x))        # loss = sum(out^2) / 2
    eps, num = 1e-6, np.zeros_like(lin.weight.data)
    for i in np.ndindex(*num.shape):
        old = lin.weight.data[i]
        lin.weight.data[i] = old + eps
        up = float((model(x) ** 2).sum() / 2)
        lin.weight.data[i] = old - eps
        down = float((model(x) ** 2).sum() / 2)
        lin.weight.data[i] = old
        num[i] = (up - down) / (2 * eps)
    np.testing.assert_allclose(lin.weight.grad, num, rtol=1e-6, atol=1e-8)
    # 18 probe passes, no backward: only the last pass's entries remain (two of lin, one of Tanh)
    assert model.saved_count() == 3

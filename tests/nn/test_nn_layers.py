"""hpcdp.nn layers for transformers: finite-difference checks (float64) and reference formulas."""
from __future__ import annotations

import math
import sys

import numpy as np
import pytest

from hpcdp import nn
from hpcdp.nn import backend as _backend
from test_nn import check_layer, numgrad, randn

F64 = np.float64


# -- activations --------------------------------------------------------------------------------------


@pytest.mark.parametrize("layer", [
    nn.SiLU(), nn.GELU(), nn.GELU(approximate="tanh"), nn.Softmax(), nn.Softmax(dim=1),
    nn.LogSoftmax(), nn.LogSoftmax(dim=0),
], ids=repr)
def test_new_activation_grad(layer):
    assert check_layer(layer, randn(3, 4, 5) * 2) == 0


def test_gelu_default_is_exact_erf_formula():
    x = np.linspace(-6, 6, 241)
    ref = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x])
    np.testing.assert_allclose(nn.GELU()(x), ref, rtol=1e-13, atol=1e-300)
    assert nn.GELU().approximate == "none"
    tanh = nn.GELU(approximate="tanh")(x)
    assert 1e-5 < np.abs(tanh - ref).max() < 1e-2  # a different (approximate) function
    y32 = nn.GELU()(x.astype(np.float32))
    assert y32.dtype == np.float32
    with pytest.raises(ValueError):
        nn.GELU(approximate="erf")


def test_erf_without_scipy(monkeypatch):
    x = np.linspace(-3, 3, 13)
    expected = np.array([math.erf(v) for v in x])
    monkeypatch.setitem(sys.modules, "scipy.special", None)  # import fails: the math.erf fallback
    np.testing.assert_allclose(_backend.erf(x), expected, rtol=1e-15)
    assert _backend.erf(x.astype(np.float32)).dtype == np.float32


def test_softmax_values_and_stability():
    x = np.array([[1000.0, 1000.0, -1000.0], [0.0, 1.0, 2.0]])
    y = nn.Softmax()(x)
    np.testing.assert_allclose(y[0], [0.5, 0.5, 0.0])
    np.testing.assert_allclose(y.sum(-1), 1.0)
    # log-softmax stays finite where softmax underflows to 0.
    np.testing.assert_allclose(nn.LogSoftmax()(x)[0], [-math.log(2), -math.log(2), -2000 - math.log(2)], rtol=1e-14)
    np.testing.assert_allclose(nn.LogSoftmax()(x)[1], np.log(y[1]), rtol=1e-13)
    np.testing.assert_allclose(nn.Softmax(dim=0)(x).sum(0), 1.0)
    np.testing.assert_allclose(nn.SiLU()(x[1]), x[1] / (1 + np.exp(-x[1])))


# -- RMSNorm ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("normalized_shape,shape", [(6, (4, 6)), ((2, 3), (2, 4, 2, 3))])
@pytest.mark.parametrize("eps", [None, 1e-3])
def test_rmsnorm_grad(normalized_shape, shape, eps):
    norm = nn.RMSNorm(normalized_shape, eps=eps, dtype=F64)
    norm.weight.data[...] = randn(*norm.weight.shape, seed=4)
    assert check_layer(norm, randn(*shape) * 3 + 1) == 1
    assert check_layer(nn.RMSNorm(normalized_shape, eps=eps, elementwise_affine=False, dtype=F64), randn(*shape)) == 0


def test_rmsnorm_values():
    x = randn(5, 8)
    norm = nn.RMSNorm(8, dtype=F64)
    assert [n for n, _ in norm.named_parameters()] == ["weight"]
    ref = x / np.sqrt((x**2).mean(-1, keepdims=True) + np.finfo(F64).eps)
    np.testing.assert_allclose(norm(x), ref, rtol=1e-14)
    norm.weight.data[...] = 2.0
    np.testing.assert_allclose(nn.RMSNorm(8, eps=0.5, dtype=F64)(x), x / np.sqrt((x**2).mean(-1, keepdims=True) + 0.5))
    np.testing.assert_allclose(norm(x), 2 * ref, rtol=1e-14)
    with pytest.raises(ValueError, match="RMSNorm"):
        norm(randn(5, 7))


# -- Embedding ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("padding_idx", [0, -1])
def test_embedding_padding_idx_gets_no_gradient(padding_idx):
    emb = nn.Embedding(6, 3, padding_idx=padding_idx, dtype=F64, seed=1)
    pad = padding_idx % 6
    assert emb.padding_idx == pad and np.all(emb.weight.data[pad] == 0)
    idx = np.array([[pad, 2, 2], [5 - pad, pad, 1]])
    out = emb(idx)
    assert np.all(out[0, 0] == 0)
    g = randn(2, 3, 3)
    assert emb.backward(g) is None
    expected = np.zeros((6, 3))
    for (i, j), r in np.ndenumerate(idx):
        if r != pad:
            expected[r] += g[i, j]
    np.testing.assert_allclose(emb.weight.grad, expected)
    assert np.all(emb.weight.grad[pad] == 0)
    with pytest.raises(ValueError):
        nn.Embedding(6, 3, padding_idx=6)


def test_embedding_rejects_out_of_range_indices():
    emb = nn.Embedding(4, 2)
    for bad in (np.array([0, 4]), np.array([-1, 2])):
        with pytest.raises(IndexError, match=r"\[0, 4\)"):
            emb(bad)
    assert emb.saved_count() == 0


# -- CrossEntropyLoss ---------------------------------------------------------------------------------


def _ce_reference(logits_nc, t, ignore_index, smoothing):
    """Per-row torch loss for (N, C) logits: (1-s) nll + s * mean_c(-logp); 0 where ignored."""
    logp = logits_nc - np.log(np.exp(logits_nc).sum(1, keepdims=True))
    per = np.zeros(len(t))
    for i, ti in enumerate(t):
        if ti != ignore_index:
            per[i] = -(1 - smoothing) * logp[i, ti] - smoothing * logp[i].mean()
    return per, int((t != ignore_index).sum())


@pytest.mark.parametrize("layout", ["NC", "NCd", "BTC"])
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_ignore_index_and_smoothing(layout, smoothing, reduction):
    rng = np.random.default_rng(7)
    c = 5
    shape = {"NC": (6, c), "NCd": (2, c, 3, 2), "BTC": (2, 3, c)}[layout]
    x = rng.standard_normal(shape) * 2
    tshape = shape[:-1] if layout != "NCd" else shape[:1] + shape[2:]
    t = rng.integers(0, c, size=tshape)
    t.reshape(-1)[[1, 4]] = 3 if layout == "NC" else -7   # some ignored targets (ignore_index below)
    ignore = 3 if layout == "NC" else -7
    loss_fn = nn.CrossEntropyLoss(reduction, ignore_index=ignore, label_smoothing=smoothing)
    flat = np.moveaxis(x, 1, -1).reshape(-1, c) if layout == "NCd" else x.reshape(-1, c)
    per, count = _ce_reference(flat, t.reshape(-1), ignore, smoothing)
    loss = loss_fn(x, t)
    w = rng.standard_normal(tshape)
    if reduction == "none":
        np.testing.assert_allclose(loss, per.reshape(tshape), rtol=1e-12, atol=1e-15)
        f = lambda: float((loss_fn(x, t) * w).sum())  # noqa: E731
        g = loss_fn.backward(w)
    else:
        ref = per.sum() / (count if reduction == "mean" else 1)
        assert float(loss) == pytest.approx(ref, rel=1e-12)
        f = lambda: float(loss_fn(x, t))  # noqa: E731
        g = loss_fn.backward()
    assert g.shape == x.shape
    num = numgrad(f, x)
    np.testing.assert_allclose(g, num, rtol=1e-6, atol=1e-8)
    ignored_rows = (t == ignore)
    moved = np.moveaxis(g, 1, -1) if layout == "NCd" else g
    assert np.all(moved[ignored_rows] == 0)


def test_cross_entropy_layouts_and_edge_cases():
    loss_fn = nn.CrossEntropyLoss()
    x = randn(2, 3, 3)
    with pytest.raises(ValueError, match="ambiguous"):
        loss_fn(x, np.zeros((2, 3), dtype=np.int64))
    with pytest.raises(ValueError, match="classes on axis 1"):
        loss_fn(randn(2, 3, 4), np.zeros((2, 5), dtype=np.int64))
    # Unbatched (C,) logits with a 0-d target.
    v = randn(4)
    assert float(loss_fn(v, np.array(2))) == pytest.approx(-(v[2] - np.log(np.exp(v).sum())), rel=1e-12)
    assert loss_fn.backward().shape == (4,)
    # Every target ignored: nan loss as torch, and a zero (not nan) gradient.
    loss = loss_fn(randn(3, 4), np.full(3, -100))
    assert math.isnan(float(loss)) and np.all(loss_fn.backward() == 0)
    assert float(nn.CrossEntropyLoss("sum")(randn(3, 4), np.full(3, -100))) == 0.0
    with pytest.raises(ValueError, match="ignore_index"):
        loss_fn(randn(2, 4), np.array([0, -100 + 1]))
    with pytest.raises(ValueError):
        nn.CrossEntropyLoss(label_smoothing=1.5)


# -- MultiheadAttention -------------------------------------------------------------------------------


def mha_reference(x, w_in, b_in, w_out, b_out, num_heads, causal):
    """torch's formula written out head by head and row by row in plain numpy."""
    bsz, seq, e = x.shape
    d = e // num_heads
    q = x @ w_in[:e].T + b_in[:e]
    k = x @ w_in[e:2 * e].T + b_in[e:2 * e]
    v = x @ w_in[2 * e:].T + b_in[2 * e:]
    ctx = np.zeros_like(x)
    for b in range(bsz):
        for h in range(num_heads):
            cols = slice(h * d, (h + 1) * d)
            for i in range(seq):
                scores = np.array([q[b, i, cols] @ k[b, j, cols] / math.sqrt(d) for j in range(seq)])
                if causal:
                    scores[i + 1:] = -np.inf
                p = np.exp(scores - scores.max())
                p /= p.sum()
                ctx[b, i, cols] = sum(p[j] * v[b, j, cols] for j in range(seq))
    return ctx @ w_out.T + b_out


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_multihead_attention_matches_reference(causal, bias):
    e, h = 6, 3
    attn = nn.MultiheadAttention(e, h, bias=bias, causal=causal, dtype=F64, seed=0)
    names = ["in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"]
    expect = names if bias else [names[0], names[2]]
    assert [n for n, _ in attn.named_parameters()] == expect
    shapes = {"in_proj_weight": (3 * e, e), "in_proj_bias": (3 * e,), "out_proj.weight": (e, e), "out_proj.bias": (e,)}
    assert {n: p.shape for n, p in attn.named_parameters()} == {n: shapes[n] for n in expect}
    sd = {n: randn(*shapes[n], seed=i + 1) * 0.5 for i, n in enumerate(expect)}
    attn.load_state_dict(sd)
    x = randn(2, 5, e)
    zeros = {"in_proj_bias": np.zeros(3 * e), "out_proj.bias": np.zeros(e)}
    full = {**zeros, **sd}
    ref = mha_reference(x, full["in_proj_weight"], full["in_proj_bias"], full["out_proj.weight"],
                        full["out_proj.bias"], h, causal)
    out = attn(x)
    assert isinstance(out, np.ndarray) and out.shape == x.shape
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12)
    if causal:  # the first position sees only itself: changing later positions leaves it alone
        x2 = x.copy()
        x2[:, 1:] += 1.0
        np.testing.assert_allclose(attn(x2)[:, 0], out[:, 0], rtol=1e-13)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_multihead_attention_grad(causal, bias):
    attn = nn.MultiheadAttention(4, 2, bias=bias, causal=causal, dtype=F64, seed=3)
    for i, p in enumerate(attn.parameters()):  # non-zero biases so their gradients are exercised
        p.data[...] = randn(*p.shape, seed=10 + i) * 0.5
    assert check_layer(attn, randn(2, 3, 4)) == (4 if bias else 2)


def test_multihead_attention_init_and_validation():
    attn = nn.MultiheadAttention(8, 2, seed=0)
    bound = math.sqrt(6 / (8 + 24))
    assert np.abs(attn.in_proj_weight.data).max() <= bound
    assert np.abs(attn.in_proj_weight.data).max() > 0.8 * bound
    assert np.all(attn.in_proj_bias.data == 0) and np.all(attn.out_proj.bias.data == 0)
    assert attn.in_proj_weight.dtype == np.float32
    with pytest.raises(ValueError, match="multiple"):
        nn.MultiheadAttention(6, 4)
    with pytest.raises(ValueError, match="batch, seq"):
        attn(np.zeros((3, 8), np.float32))
    assert attn(np.zeros((1, 2, 8), np.float32)).dtype == np.float32


# -- ModuleList / ModuleDict --------------------------------------------------------------------------


class ResidualBlock(nn.Module):
    """A user-written pre-norm transformer block over a ModuleDict, with a split backward."""

    def __init__(self, e: int, h: int, causal: bool, seed: int) -> None:
        super().__init__()
        self.parts = nn.ModuleDict({
            "norm1": nn.LayerNorm(e, dtype=F64),
            "attn": nn.MultiheadAttention(e, h, causal=causal, dtype=F64, seed=seed),
            "norm2": nn.RMSNorm(e, dtype=F64),
            "mlp": nn.Sequential(nn.Linear(e, 2 * e, dtype=F64, seed=seed + 1), nn.GELU(),
                                 nn.Linear(2 * e, e, dtype=F64, seed=seed + 2)),
        })

    def forward(self, x):
        p = self.parts
        h = x + p["attn"](p["norm1"](x))
        return h + p["mlp"](p["norm2"](h))

    def backward_input(self, g):
        p = self.parts
        gh = g + p["norm2"].run_backward_input(p["mlp"].run_backward_input(g))
        return gh + p["norm1"].run_backward_input(p["attn"].run_backward_input(gh))

    def backward_weight(self):
        for m in reversed(self.parts.values()):
            m.backward_weight()


class GatedMLP(nn.Module):
    """A user module over a ModuleList with a fused backward (the pre-split style)."""

    def __init__(self, e: int, seed: int) -> None:
        super().__init__()
        self.fcs = nn.ModuleList([nn.Linear(e, 2 * e, dtype=F64, seed=seed + i) for i in range(2)])
        self.fcs.append(nn.Linear(2 * e, e, dtype=F64, seed=seed + 2))
        self.act = nn.SiLU()

    def forward(self, x):
        a, b = self.act(self.fcs[0](x)), self.fcs[1](x)
        self.save_for_backward(a, b)
        return self.fcs[2](a * b)

    def backward(self, g):
        a, b = self.saved_tensors()
        gab = self.fcs[2].run_backward(g)
        return self.fcs[0].run_backward(self.act.run_backward(gab * b)) + self.fcs[1].run_backward(gab * a)


def test_custom_blocks_over_module_containers_grad():
    assert check_layer(ResidualBlock(4, 2, causal=True, seed=0), randn(2, 3, 4)) == 11
    assert check_layer(GatedMLP(3, seed=5), randn(4, 3)) == 6


def test_module_list_behaviour():
    a, b, c = nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 3)
    ml = nn.ModuleList([a, b])
    ml.append(c)
    assert len(ml) == 3 and list(ml) == [a, b, c] and ml[-1] is c
    assert [n for n, _ in ml.named_parameters()] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    ml.insert(0, nn.Tanh())
    assert [type(m).__name__ for m in ml] == ["Tanh", "Linear", "ReLU", "Linear"]
    assert [n for n, _ in ml.named_children()] == ["0", "1", "2", "3"]
    del ml[0]
    assert list(ml) == [a, b, c]
    ml[1] = nn.Identity()
    assert isinstance(ml[1], nn.Identity) and len(ml[0:2]) == 2
    with pytest.raises(IndexError):
        ml[3]
    with pytest.raises(TypeError):
        ml.append("not a module")  # type: ignore[arg-type]
    with pytest.raises(NotImplementedError):
        ml(np.ones(2))
    assert set(nn.ModuleList([a]).state_dict()) == {"0.weight", "0.bias"}


def test_module_dict_behaviour():
    a, b = nn.Linear(2, 2), nn.Linear(2, 1)
    md = nn.ModuleDict([("enc", a), ("training", b)])   # a key named like an attribute is safe
    assert md.training is True and md["training"] is b
    assert md.keys() == ["enc", "training"] and md.values() == [a, b] and "enc" in md
    assert [n for n, _ in md.named_parameters()] == ["enc.weight", "enc.bias", "training.weight", "training.bias"]
    md.eval()
    assert not a.training and not b.training
    md.update({"head": nn.ReLU()})
    assert list(md) == ["enc", "training", "head"] and md.enc is a
    assert md.pop("head").__class__ is nn.ReLU and len(md) == 2
    with pytest.raises(KeyError, match="no module"):
        md["missing"]
    with pytest.raises(KeyError):
        md["a.b"] = nn.ReLU()
    del md["enc"]
    assert md.keys() == ["training"]

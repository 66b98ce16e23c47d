"""hpcdp.nn module hooks: torch's call order and arguments, replacement returns, removal, wrappers."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import hpcdp
from hpcdp.testing import run_ranks
from hpcdp import nn

F64 = np.float64


def _nested() -> nn.Sequential:
    nn.manual_seed(3)
    inner = nn.Sequential(nn.ReLU(), nn.Linear(4, 4, dtype=F64))
    return nn.Sequential(nn.Linear(3, 4, dtype=F64), inner, nn.Tanh())


def _record_all(model: nn.Module) -> tuple[list[tuple], list[Any]]:
    """Register all four hooks on every module; log (kind, name, args...) in call order."""
    log: list[tuple] = []
    handles = []
    for name, m in model.named_modules():
        label = name or "root"
        handles += [
            m.register_forward_pre_hook(lambda mod, args, n=label: log.append(("fpre", n, mod, args))),
            m.register_forward_hook(lambda mod, args, out, n=label: log.append(("fpost", n, mod, args, out))),
            m.register_full_backward_pre_hook(lambda mod, go, n=label: log.append(("bpre", n, mod, go))),
            m.register_full_backward_hook(lambda mod, gi, go, n=label: log.append(("bpost", n, mod, gi, go))),
        ]
    return log, handles


def test_nested_sequential_hook_order_and_arguments():
    model = _nested()
    log, _ = _record_all(model)
    x = np.random.default_rng(0).standard_normal((5, 3))
    y = model(x)
    assert [(e[0], e[1]) for e in log] == [
        ("fpre", "root"), ("fpre", "0"), ("fpost", "0"),
        ("fpre", "1"), ("fpre", "1.0"), ("fpost", "1.0"), ("fpre", "1.1"), ("fpost", "1.1"), ("fpost", "1"),
        ("fpre", "2"), ("fpost", "2"), ("fpost", "root"),
    ]
    fwd = {(e[0], e[1]): e for e in log}
    mods = {(n or "root"): m for n, m in model.named_modules()}
    for kind, name in fwd:
        e = fwd[kind, name]
        assert e[2] is mods[name] and isinstance(e[3], tuple) and len(e[3]) == 1
    assert fwd["fpre", "root"][3][0] is x and fwd["fpost", "root"][4] is y
    # Each child's input is its predecessor's output, and forward hooks see the same args as pre-hooks.
    assert fwd["fpre", "1"][3][0] is fwd["fpost", "0"][4]
    assert fwd["fpre", "2"][3][0] is fwd["fpost", "1"][4]
    assert fwd["fpost", "1.1"][3][0] is fwd["fpre", "1.1"][3][0]

    log.clear()
    g = np.ones_like(y)
    dx = model.run_backward(g)
    assert [(e[0], e[1]) for e in log] == [
        ("bpre", "root"), ("bpre", "2"), ("bpost", "2"),
        ("bpre", "1"), ("bpre", "1.1"), ("bpost", "1.1"), ("bpre", "1.0"), ("bpost", "1.0"), ("bpost", "1"),
        ("bpre", "0"), ("bpost", "0"), ("bpost", "root"),
    ]
    bwd = {(e[0], e[1]): e for e in log}
    assert bwd["bpre", "root"][3] == (g,) and bwd["bpre", "root"][3][0] is g
    assert bwd["bpost", "root"][3][0] is dx and bwd["bpost", "root"][4][0] is g
    # grad_input of a child is grad_output of the child before it (tuples, as in torch).
    assert bwd["bpre", "1"][3][0] is bwd["bpost", "2"][3][0]
    assert bwd["bpre", "1.0"][3][0] is bwd["bpost", "1.1"][3][0]
    assert bwd["bpre", "0"][3][0] is bwd["bpost", "1"][3][0]
    assert bwd["bpost", "0"][3][0] is dx
    assert dx.shape == x.shape and dx.dtype == F64


def test_hook_free_backward_matches_hooked_one():
    a, b = _nested(), _nested()
    _record_all(b)
    x = np.random.default_rng(1).standard_normal((4, 3))
    g = np.random.default_rng(2).standard_normal((4, 4))
    a(x)
    b(x)
    np.testing.assert_array_equal(a.backward(g), b.run_backward(g))
    for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        np.testing.assert_array_equal(pa.grad, pb.grad, err_msg=n)


def test_replacement_returns():
    lin = nn.Linear(3, 2, dtype=F64, seed=0)
    ref = nn.Linear(3, 2, dtype=F64, seed=0)
    x = np.random.default_rng(0).standard_normal((4, 3))
    h1 = lin.register_forward_pre_hook(lambda m, args: 2.0 * args[0])       # a bare value is wrapped
    h2 = lin.register_forward_hook(lambda m, args, out: out + 1.0)
    np.testing.assert_allclose(lin(x), ref(2.0 * x) + 1.0)
    h3 = lin.register_full_backward_pre_hook(lambda m, go: (3.0 * go[0],))
    h4 = lin.register_full_backward_hook(lambda m, gi, go: (gi[0] * 0.0,))
    g = np.ones((4, 2))
    dx = lin.run_backward(g)
    ref.backward(3.0 * g)
    assert np.all(dx == 0.0)
    np.testing.assert_allclose(lin.weight.grad, ref.weight.grad)  # saved input was 2x, grad_output 3g
    np.testing.assert_allclose(lin.bias.grad, ref.bias.grad)
    # A replaced grad_input is what the container passes on to the layer before.
    seen = []
    first = nn.Linear(3, 3, dtype=F64, seed=1)
    first.register_full_backward_pre_hook(lambda m, go: seen.append(go[0]))
    seq = nn.Sequential(first, lin)
    seq(x)
    seq.run_backward(g)
    assert np.all(seen[0] == 0.0)
    for h in (h1, h2, h3, h4):
        h.remove()
    lin.zero_grad()
    ref.zero_grad()
    np.testing.assert_allclose(lin(x), ref(x))
    np.testing.assert_allclose(lin.run_backward(g), ref.backward(g))
    with pytest.raises(ValueError, match="expected 1"):
        lin.register_full_backward_pre_hook(lambda m, go: (go[0], go[0]))
        lin(x)
        lin.run_backward(g)


def test_removal_by_handle_prepend_and_context():
    m = nn.ReLU()
    calls = []
    h1 = m.register_forward_hook(lambda *a: calls.append(1))
    h2 = m.register_forward_hook(lambda *a: calls.append(2))
    h0 = m.register_forward_hook(lambda *a: calls.append(0), prepend=True)
    m(np.ones(2))
    assert calls == [0, 1, 2]
    h1.remove()
    h1.remove()  # idempotent
    calls.clear()
    m(np.ones(2))
    assert calls == [0, 2]
    with m.register_forward_pre_hook(lambda *a: calls.append("pre")):
        calls.clear()
        m(np.ones(2))
        assert calls == ["pre", 0, 2]
    calls.clear()
    h0.remove()
    h2.remove()
    m(np.ones(2))
    assert calls == []
    with pytest.raises(TypeError):
        m.register_full_backward_hook("not callable")  # type: ignore[arg-type]


class FusedOnly(nn.Module):
    """A user module written before the split: forward and a fused backward, state on self."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(np.full((3, 3), 0.5))

    def forward(self, x: Any) -> Any:
        self._x = x
        return x @ self.w.data

    def backward(self, g: Any) -> Any:
        self.w.accumulate_grad(self._x.T @ g)
        return g @ self.w.data.T


def test_fused_user_module_gets_hooks_and_split_entry_points():
    m = FusedOnly()
    calls = []
    m.register_forward_pre_hook(lambda mod, args: calls.append("fpre"))
    m.register_full_backward_hook(lambda mod, gi, go: calls.append(("bpost", gi[0].shape)))
    x, g = np.ones((2, 3)), np.ones((2, 3))
    seq = nn.Sequential(m, nn.Identity())
    seq(x)
    dx = seq.run_backward(g)
    assert calls == ["fpre", ("bpost", (2, 3))]
    grad = m.w.grad.copy()
    m.zero_grad()
    seq(x)
    np.testing.assert_array_equal(seq.run_backward_input(g), dx)  # the fused backward ran here
    np.testing.assert_array_equal(m.w.grad, grad)
    seq.backward_weight()  # nothing left to do for a fused module
    np.testing.assert_array_equal(m.w.grad, grad)

    class Neither(nn.Module):
        def forward(self, x):
            return x

    with pytest.raises(NotImplementedError, match="neither"):
        Neither().backward(g)
    with pytest.raises(NotImplementedError, match="neither"):
        Neither().run_backward_input(g)


def test_loss_and_embedding_hook_arguments():
    ce = nn.CrossEntropyLoss()
    seen = {}
    ce.register_forward_hook(lambda m, args, out: seen.update(fwd=(args, out)))
    logits, t = np.random.default_rng(0).standard_normal((3, 4)), np.array([0, 3, 1])
    loss = ce(logits, t)
    assert seen["fwd"][0][0] is logits and seen["fwd"][0][1] is t and seen["fwd"][1] is loss
    emb = nn.Embedding(5, 2, dtype=F64, seed=0)
    emb.register_full_backward_hook(lambda m, gi, go: seen.update(emb=(gi, go)))
    out = emb(np.array([1, 2]))
    assert emb.run_backward(np.ones_like(out)) is None
    assert seen["emb"][0] == (None,) and seen["emb"][1][0].shape == (2, 2)


def body_ddp_root_hooks(rank: int) -> list[str]:
    """DDP.backward starts the root's backward through run_backward, so its hooks fire."""
    fails: list[str] = []
    nn.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4, dtype=F64), nn.Tanh(), nn.Linear(4, 2, dtype=F64))
    calls: list[str] = []
    model.register_full_backward_pre_hook(lambda m, go: calls.append("root-pre"))
    model.register_full_backward_hook(lambda m, gi, go: calls.append("root-post"))
    model[0].register_full_backward_hook(lambda m, gi, go: calls.append("first-post"))
    ddp = hpcdp.DDP(model)
    out = ddp(np.full((2, 3), float(rank + 1)))
    ddp.backward(np.ones_like(out))
    if calls != ["root-pre", "first-post", "root-post"]:
        fails.append(f"hook calls {calls}")
    if model[0].weight.grad is None:
        fails.append("no gradient")
    return fails


def test_ddp_backward_fires_root_hooks():
    per_rank = run_ranks("sim", 2, body_ddp_root_hooks)
    assert per_rank == [[], []]

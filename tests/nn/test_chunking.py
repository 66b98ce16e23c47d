"""``nn.chunking``: with chunked gradients on, each layer's gradient for chunk j is, to the bit,
the gradient it computes for chunk j's samples alone; mean losses average per chunk; dropout
masks keyed by sample do not depend on the batch a sample is in."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hpcdp import nn
from hpcdp.nn import chunking


def _model(kind: str) -> tuple[Any, Any]:
    """(model, input of 8 samples) for each layer with parameters."""
    rng = np.random.default_rng(0)
    if kind == "linear-2d":
        return nn.Linear(6, 5, seed=1), rng.standard_normal((8, 6)).astype(np.float32)
    if kind == "linear-3d":
        return nn.Linear(6, 5, seed=1), rng.standard_normal((8, 3, 6)).astype(np.float32)
    if kind == "embedding":
        return nn.Embedding(7, 4, padding_idx=2, seed=1), rng.integers(0, 7, (8, 5))
    if kind == "layernorm":
        return nn.LayerNorm(6), rng.standard_normal((8, 3, 6)) * 3
    return nn.MultiheadAttention(8, 2, causal=True, seed=1), rng.standard_normal((8, 4, 8))


def _grads(model: Any, x: Any, chunk: int | None, lo: int = 0) -> dict[str, Any]:
    """Gradients for samples ``lo..lo+len(x)`` of one fixed output gradient of 8 samples."""
    for p in model.parameters():
        p.grad, p.chunk_grads = None, None
    with chunking.chunked(chunk):
        y = model(x)
        g = np.random.default_rng(5).standard_normal((8, *y.shape[1:])).astype(y.dtype)
        model.run_backward(g[lo:lo + x.shape[0]])
    if chunk is None:
        return {n: p.grad for n, p in model.named_parameters()}
    return {n: np.concatenate(p.chunk_grads) for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", ["linear-2d", "linear-3d", "embedding", "layernorm", "attention"])
def test_chunk_gradients_are_each_chunk_alone(kind: str) -> None:
    model, x = _model(kind)
    per_chunk = _grads(model, x, 2)
    for name, stack in per_chunk.items():
        assert stack.shape[0] == 4
    for j in range(4):
        # the same chunk through the chunked code on its own (one chunk) gives the same bits
        alone = _grads(model, x[2 * j:2 * j + 2], 2, 2 * j)
        for name, stack in per_chunk.items():
            assert np.array_equal(stack[j], alone[name][0]), (kind, name, j)
    whole = _grads(model, x, None)
    for name, stack in per_chunk.items():   # and they add up to the ordinary gradient
        np.testing.assert_allclose(stack.sum(axis=0), whole[name], rtol=1e-4, atol=1e-5)


def test_batch_not_divisible_is_refused() -> None:
    model, x = _model("linear-2d")
    with chunking.chunked(3), pytest.raises(ValueError, match="chunks of 3"):
        model(x)


def test_losses_average_per_chunk() -> None:
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((4, 3, 5))
    target = rng.integers(0, 5, (4, 3))
    target[0, :2] = -100                       # chunk 0 has fewer counted targets
    ce = nn.CrossEntropyLoss()
    with chunking.chunked(2):
        ce(logits, target)
        g = ce.backward()
    whole = nn.CrossEntropyLoss()
    for j in range(2):
        part = whole(logits[2 * j:2 * j + 2], target[2 * j:2 * j + 2])
        assert np.isclose(ce.chunk_values[j], float(part))
        assert np.array_equal(g[2 * j:2 * j + 2], whole.backward())
    mse = nn.MSELoss()
    a, b = rng.standard_normal((4, 3)), rng.standard_normal((4, 3))
    with chunking.chunked(2):
        mse(a, b)
        gm = mse.backward()
    np.testing.assert_array_equal(gm, 2.0 * (a - b) * (1.0 / 6))   # each chunk's 6 elements


def test_dropout_keyed_by_sample() -> None:
    drop = nn.Dropout(0.5, seed=3)
    x = np.ones((6, 10))
    with chunking.sample_keys(np.arange(6), step=4):
        full = drop(x)
    with chunking.sample_keys(np.arange(3, 6), step=4):   # the same samples in another batch
        part = drop(x[3:])
    assert np.array_equal(full[3:], part)
    with chunking.sample_keys(np.arange(6), step=5):      # another step, other masks
        assert not np.array_equal(drop(x), full)
    with chunking.chunked(2), pytest.raises(ValueError, match="sample_keys"):
        drop(x)

"""Multi-head self-attention with torch's parameter names, so weights move between the two."""
from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import numpy as np

from . import chunking, init
from .backend import xp_of
from .activations import softmax
from .linear import Linear
from .module import Module
from .parameter import Parameter

__all__ = ["MultiheadAttention"]


class MultiheadAttention(Module):
    """Self-attention on ``(batch, seq, embed_dim)`` input: ``attn(x)`` returns the output array.

    Computes torch's ``nn.MultiheadAttention(E, H, batch_first=True)(x, x, x, need_weights=False)[0]``
    without dropout: ``q, k, v = split(x @ in_proj_weight.T + in_proj_bias)``, per head
    ``softmax(q k^T / sqrt(E/H) [+ causal mask]) v``, heads concatenated, then ``out_proj``.
    Parameters ``in_proj_weight`` (3E, E), ``in_proj_bias`` (3E,), ``out_proj.weight`` (E, E) and
    ``out_proj.bias`` (E,) carry torch's names, shapes and initialisation (xavier-uniform in
    projection, zero biases). ``out_proj`` is a child :class:`Linear` called through the module
    machinery, so its hooks fire (unlike torch, which reads its weight directly).

    Args:
        embed_dim: E, the last input axis; must be divisible by ``num_heads``.
        num_heads: H.
        bias: learn ``in_proj_bias`` and ``out_proj.bias``.
        causal: position i attends only to positions <= i.
        dtype: parameter dtype.
        seed: own Generator seed; None draws from the global one.
        xp: array module for the parameters.
    """

    def __init__(self, embed_dim: int, num_heads: int, bias: bool = True, causal: bool = False, *,
                 dtype: Any = np.float32, seed: int | np.random.Generator | None = None,
                 xp: ModuleType = np) -> None:
        super().__init__()
        e, h = int(embed_dim), int(num_heads)
        if e <= 0 or h <= 0 or e % h:
            raise ValueError(f"MultiheadAttention: embed_dim {embed_dim} must be a positive multiple of "
                             f"num_heads {num_heads}")
        self.embed_dim, self.num_heads, self.head_dim = e, h, e // h
        self.causal = bool(causal)
        gen = init.generator_for(seed)
        bound = math.sqrt(6.0 / (e + 3 * e))  # xavier_uniform on the (3E, E) matrix, as torch
        self.in_proj_weight = Parameter(init.uniform((3 * e, e), -bound, bound, dtype=dtype, xp=xp, generator=gen))
        if bias:
            self.in_proj_bias = Parameter(xp.zeros((3 * e,), dtype=dtype))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = Linear(e, e, bias=bias, dtype=dtype, seed=gen, xp=xp)
        if bias:
            self.out_proj.bias.data[...] = 0

    def _heads(self, a: Any, b: int, s: int) -> Any:
        """(B, S, E) -> (B, H, S, D)."""
        return a.reshape(b, s, self.num_heads, self.head_dim).transpose(0, 2, 1, 3)

    def _merge(self, a: Any, b: int, s: int) -> Any:
        """(B, H, S, D) -> (B, S, E)."""
        return a.transpose(0, 2, 1, 3).reshape(b, s, self.embed_dim)

    def forward(self, x: Any) -> Any:
        """Return the attention output, shape ``(batch, seq, embed_dim)``."""
        if x.ndim != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(f"MultiheadAttention({self.embed_dim}, {self.num_heads}) needs input "
                             f"(batch, seq, {self.embed_dim}), got {tuple(x.shape)}")
        xp = xp_of(x)
        b, s, e = x.shape
        qkv = chunking.matmul_t(x, self.in_proj_weight.data)
        if self.in_proj_bias is not None:
            qkv = qkv + self.in_proj_bias.data
        q, k, v = (self._heads(qkv[..., i * e:(i + 1) * e], b, s) for i in range(3))
        scores = (q @ k.swapaxes(-1, -2)) * (1.0 / math.sqrt(self.head_dim))
        if self.causal:
            scores = xp.where(xp.triu(xp.ones((s, s), dtype=bool), 1), -xp.inf, scores)
        attn = softmax(scores, -1)
        self.save_for_backward(x, q, k, v, attn)
        return self.out_proj(self._merge(attn @ v, b, s))

    def backward_input(self, grad_output: Any) -> Any:
        """Return dL/dx; keep x and dL/dqkv for ``in_proj``'s gradient (``out_proj`` keeps its own)."""
        x, q, k, v, attn = self.saved_tensors()
        xp = xp_of(x)
        b, s, _ = x.shape
        d_ctx = self._heads(self.out_proj.run_backward_input(grad_output), b, s)
        d_attn = d_ctx @ v.swapaxes(-1, -2)
        d_v = attn.swapaxes(-1, -2) @ d_ctx
        d_scores = attn * (d_attn - (d_attn * attn).sum(axis=-1, keepdims=True)) * (1.0 / math.sqrt(self.head_dim))
        d_q = d_scores @ k
        d_k = d_scores.swapaxes(-1, -2) @ q
        d_qkv = xp.concatenate([self._merge(d, b, s) for d in (d_q, d_k, d_v)], axis=-1)
        if self._needs_weight_grad():
            self.save_for_weight(x, d_qkv)
        else:
            self.save_for_weight()
        return chunking.matmul(d_qkv, self.in_proj_weight.data)

    def backward_weight(self) -> None:
        """Accumulate out_proj's gradients, then in_proj_bias and in_proj_weight (reverse parameter order)."""
        self.out_proj.backward_weight()
        kept = self.saved_for_weight()
        if not kept:
            return
        x, d_qkv = kept
        if self.in_proj_bias is not None and self.in_proj_bias.requires_grad:
            self.in_proj_bias.accumulate_grad(chunking.sample_sum(d_qkv, 1))
        if self.in_proj_weight.requires_grad:
            self.in_proj_weight.accumulate_grad(chunking.weight_grad(d_qkv, x))

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                f"bias={self.in_proj_bias is not None}, causal={self.causal}")

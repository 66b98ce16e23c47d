"""Adam and AdamW with torch's formulas (bias correction, optional AMSGrad, decoupled decay)."""
from __future__ import annotations

import math
from typing import Any, Iterable

from ..nn.backend import xp_of
from .optimizer import Optimizer

__all__ = ["Adam", "AdamW"]


class Adam(Optimizer):
    """Adam as in torch.optim.Adam (non-fused, single-tensor path).

    Per step t: ``g += wd * p`` (Adam) or ``p *= 1 - lr * wd`` (AdamW); ``m = lerp(m, g, 1 - b1)``;
    ``v = b2 v + (1 - b2) g^2``; ``denom = sqrt(v or max(v_max, v)) / sqrt(1 - b2^t) + eps``;
    ``p -= lr / (1 - b1^t) * m / denom``. State per parameter: ``step`` (int), ``exp_avg``,
    ``exp_avg_sq`` and with AMSGrad ``max_exp_avg_sq``.

    Args:
        params: parameters or param-group dicts.
        lr: learning rate.
        betas: decay rates of the first and second moment averages.
        eps: added to the denominator for stability.
        weight_decay: L2 penalty (coupled into the gradient for Adam, decoupled for AdamW).
        amsgrad: use the running maximum of the second moment.
        maximize: ascend instead of descend.
    """

    _decoupled = False
    state_spec = {"step": "count", "exp_avg": "param", "exp_avg_sq": "param",
                  "max_exp_avg_sq": "param?"}

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, *,
                 maximize: bool = False) -> None:
        if lr < 0.0:
            raise ValueError(f"{type(self).__name__}: invalid learning rate {lr}")
        if eps < 0.0:
            raise ValueError(f"{type(self).__name__}: invalid eps {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"{type(self).__name__}: invalid betas {betas}")
        if weight_decay < 0.0:
            raise ValueError(f"{type(self).__name__}: invalid weight_decay {weight_decay}")
        defaults = dict(lr=lr, betas=(float(betas[0]), float(betas[1])), eps=eps, weight_decay=weight_decay,
                        amsgrad=amsgrad, maximize=maximize)
        super().__init__(params, defaults)

    def _update(self, p: Any, grad: Any, group: dict[str, Any], state: dict[str, Any]) -> None:
        xp = xp_of(p.data)
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        g = -grad if group["maximize"] else grad
        if not state:
            state["step"] = 0
            state["exp_avg"] = xp.zeros_like(p.data)
            state["exp_avg_sq"] = xp.zeros_like(p.data)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = xp.zeros_like(p.data)
        state["step"] += 1
        step = state["step"]
        if wd != 0:
            if self._decoupled:
                p.data *= 1.0 - lr * wd
            else:
                g = g + wd * p.data
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m += (1.0 - beta1) * (g - m)  # torch's lerp_
        v *= beta2
        v += (1.0 - beta2) * g * g
        bias_correction1 = 1.0 - beta1 ** step
        bias_correction2_sqrt = math.sqrt(1.0 - beta2 ** step)
        if group["amsgrad"]:
            vmax = state.setdefault("max_exp_avg_sq", xp.zeros_like(p.data))
            xp.maximum(vmax, v, out=vmax)
            denom = xp.sqrt(vmax) / bias_correction2_sqrt + eps
        else:
            denom = xp.sqrt(v) / bias_correction2_sqrt + eps
        p.data -= (lr / bias_correction1) * (m / denom)


class AdamW(Adam):
    """Adam with decoupled weight decay (``p *= 1 - lr * wd`` before the Adam step), as torch.optim.AdamW."""

    _decoupled = True

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *,
                 maximize: bool = False) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize)

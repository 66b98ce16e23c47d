"""SGD with momentum, dampening, Nesterov and weight decay, following torch.optim.SGD exactly."""
from __future__ import annotations

from typing import Any, Iterable

from .optimizer import Optimizer

__all__ = ["SGD"]


class SGD(Optimizer):
    """Stochastic gradient descent with torch's update rule.

    For each parameter: ``g = grad + wd * p``; with momentum, ``buf = g`` on the first step and
    ``buf = momentum * buf + (1 - dampening) * g`` afterwards, and ``g = g + momentum * buf``
    (Nesterov) or ``g = buf``; then ``p -= lr * g``. ``maximize`` negates the gradient first.

    Args:
        params: parameters or param-group dicts.
        lr: learning rate.
        momentum: momentum factor (0 disables the buffer).
        dampening: dampening of the momentum buffer update.
        weight_decay: L2 penalty added to the gradient.
        nesterov: Nesterov momentum (needs momentum > 0 and dampening == 0).
        maximize: ascend instead of descend.
    """

    state_spec = {"momentum_buffer": "param?"}

    def __init__(self, params: Iterable[Any], lr: float, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *, maximize: bool = False) -> None:
        if lr < 0.0:
            raise ValueError(f"SGD: invalid learning rate {lr}")
        if momentum < 0.0:
            raise ValueError(f"SGD: invalid momentum {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"SGD: invalid weight_decay {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("SGD: Nesterov momentum requires momentum > 0 and dampening == 0")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, maximize=maximize)
        super().__init__(params, defaults)

    def _update(self, p: Any, grad: Any, group: dict[str, Any], state: dict[str, Any]) -> None:
        lr, momentum, wd = group["lr"], group["momentum"], group["weight_decay"]
        g = -grad if group["maximize"] else grad  # torch >= 2: negate first, so decay still shrinks p
        if wd != 0:
            g = g + wd * p.data
        if momentum != 0:
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = g.astype(p.data.dtype, copy=True)
                state["momentum_buffer"] = buf
            else:
                buf *= momentum
                buf += (1.0 - group["dampening"]) * g
            g = g + momentum * buf if group["nesterov"] else buf
        p.data -= lr * g

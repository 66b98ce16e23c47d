"""Learning-rate schedules: closed forms of the step count, so state is just ``last_epoch``."""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from .optimizer import Optimizer

__all__ = ["LRScheduler", "StepLR", "CosineWarmupLR", "LambdaLR"]


class LRScheduler:
    """Base: sets each group's ``lr`` to ``_lr_at(base_lr, step)``; construction applies step 0.

    Each group's starting lr is kept as ``initial_lr`` in the group (as torch does), so a scheduler
    rebuilt on a loaded optimizer keeps the same base. Call ``step()`` after ``optimizer.step()``.
    """

    def __init__(self, optimizer: Optimizer, last_epoch: int = -1) -> None:
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"{type(self).__name__} needs an hpcdp.optim.Optimizer, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        for g in optimizer.param_groups:
            if last_epoch == -1:
                g.setdefault("initial_lr", g["lr"])
            elif "initial_lr" not in g:
                raise KeyError(f"{type(self).__name__}: resuming (last_epoch={last_epoch}) needs 'initial_lr' in every group")
        self.base_lrs: list[float] = [float(g["initial_lr"]) for g in optimizer.param_groups]
        self.last_epoch = last_epoch
        self._last_lr: list[float] = []
        self.step()

    def _lr_at(self, group_index: int, base_lr: float, step: int) -> float:
        raise NotImplementedError

    def get_lr(self) -> list[float]:
        """Return the lr of every group at the current step (without applying it)."""
        return [self._lr_at(i, b, self.last_epoch) for i, b in enumerate(self.base_lrs)]

    def step(self) -> None:
        """Advance one step and write the new lr into every param group."""
        self.last_epoch += 1
        lrs = self.get_lr()
        for g, lr in zip(self.optimizer.param_groups, lrs):
            g["lr"] = lr
        self._last_lr = lrs

    def get_last_lr(self) -> list[float]:
        """Return the lr of every group as last set by ``step``."""
        return list(self._last_lr)

    def state_dict(self) -> dict[str, Any]:
        """Return the scheduler's scalars (no optimizer, no callables): saveable to HDF5."""
        return {k: (list(v) if isinstance(v, list) else v) for k, v in self.__dict__.items()
                if k != "optimizer" and not callable(v) and not (isinstance(v, list) and v and callable(v[0]))}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the scalars from ``state_dict`` (call after loading the optimizer's state)."""
        for k, v in state_dict.items():
            if k in ("optimizer", "lr_lambdas"):
                continue
            if isinstance(getattr(self, k, None), list):
                v = [float(x) for x in v]
            elif isinstance(getattr(self, k, None), int) and not isinstance(getattr(self, k, None), bool):
                v = int(v)
            setattr(self, k, v)


class StepLR(LRScheduler):
    """Multiply the lr by ``gamma`` every ``step_size`` steps: ``base * gamma ** (t // step_size)``."""

    def __init__(self, optimizer: Optimizer, step_size: int, gamma: float = 0.1, last_epoch: int = -1) -> None:
        if step_size <= 0:
            raise ValueError(f"StepLR: step_size must be positive, got {step_size}")
        self.step_size, self.gamma = int(step_size), float(gamma)
        super().__init__(optimizer, last_epoch)

    def _lr_at(self, group_index: int, base_lr: float, step: int) -> float:
        return base_lr * self.gamma ** (step // self.step_size)


class CosineWarmupLR(LRScheduler):
    """Linear warm-up then cosine decay to ``min_lr``, the usual transformer schedule.

    At step t < warmup_steps: ``base * (t + 1) / warmup_steps`` (so the very first update is not
    wasted at lr 0 and step warmup_steps - 1 reaches base). For warmup_steps <= t <= total_steps:
    ``min_lr + (base - min_lr) * (1 + cos(pi * (t - warmup) / (total - warmup))) / 2``; after
    total_steps the lr stays at ``min_lr``.
    """

    def __init__(self, optimizer: Optimizer, warmup_steps: int, total_steps: int, min_lr: float = 0.0,
                 last_epoch: int = -1) -> None:
        if warmup_steps < 0 or total_steps < warmup_steps:
            raise ValueError(f"CosineWarmupLR: need 0 <= warmup_steps <= total_steps, got {warmup_steps}, {total_steps}")
        self.warmup_steps, self.total_steps, self.min_lr = int(warmup_steps), int(total_steps), float(min_lr)
        super().__init__(optimizer, last_epoch)

    def _lr_at(self, group_index: int, base_lr: float, step: int) -> float:
        if step < self.warmup_steps:
            return base_lr * (step + 1) / self.warmup_steps
        span = self.total_steps - self.warmup_steps
        progress = 1.0 if span == 0 else min(1.0, (step - self.warmup_steps) / span)
        return self.min_lr + (base_lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


class LambdaLR(LRScheduler):
    """Set the lr to ``base * lr_lambda(t)`` (one function, or one per param group)."""

    def __init__(self, optimizer: Optimizer, lr_lambda: Callable[[int], float] | Sequence[Callable[[int], float]],
                 last_epoch: int = -1) -> None:
        n = len(optimizer.param_groups)
        lambdas = list(lr_lambda) if isinstance(lr_lambda, (list, tuple)) else [lr_lambda] * n
        if len(lambdas) != n:
            raise ValueError(f"LambdaLR: {len(lambdas)} lr_lambdas for {n} param groups")
        self.lr_lambdas = lambdas
        super().__init__(optimizer, last_epoch)

    def _lr_at(self, group_index: int, base_lr: float, step: int) -> float:
        return base_lr * float(self.lr_lambdas[group_index](step))

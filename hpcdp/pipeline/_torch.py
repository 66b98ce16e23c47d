"""Torch models in a pipeline: the stages of a split ``torch.nn.Sequential`` and a torch loss.

``PipelineStage(torch_sequential)`` cuts the torch model between its children exactly as it cuts
an ``nn.Sequential``; each stage is a ``torch.nn.Sequential`` of the same child modules (not
copies) under their names in the whole model, presented to the runtime through
:func:`hpcdp.nn.from_torch`. The runtime then drives torch autograd per microbatch: a stage's
forward keeps its torch graph, ``B`` runs one backward from the received output gradient, and the
zero-bubble schedule's ``I`` and ``W`` are a real split (the input gradient with
``torch.autograd.grad`` over the kept graph, the weight gradient later by a second backward
restricted to the parameters), so the deferred weight work is real deferred work.

The last stage's loss is torch's: any callable ``loss_fn(output, target) -> 0-d tensor``
(``torch.nn.CrossEntropyLoss()``, ``torch.nn.functional.mse_loss``, a ``functools.partial`` of
one). :class:`TorchLoss` gives it the runtime's loss protocol: the output arrives as a leaf tensor
over the stage output's memory, and ``backward(scale)`` returns ``scale * dloss/doutput``.
Microbatch shares of the batch's loss follow the loss's ``reduction`` and ``ignore_index`` (read
from a torch loss module's attributes or a partial's keywords; torch's functional defaults
otherwise), as for hpcdp's own losses.
"""
from __future__ import annotations

import functools
import sys
from collections import OrderedDict
from typing import Any, Sequence

import numpy as np

from ..nn.torch_module import TorchModule, from_torch, is_tensor, is_torch_module, to_array, to_tensor

__all__ = ["TorchLoss", "torch_children", "torch_stage", "torch_entries", "as_pipeline_loss"]


def _torch() -> Any:
    return sys.modules["torch"]   # only called with a torch object in hand


def torch_children(model: Any, where: str) -> list[tuple[str, Any]]:
    """The children of a ``torch.nn.Sequential`` (the units a pipeline cuts), checked."""
    torch = _torch()
    if not isinstance(model, torch.nn.Sequential):
        raise TypeError(f"{where}: a torch model must be a torch.nn.Sequential (its children are "
                        f"split into stages), got {type(model).__name__}")
    own = [n for n, _ in model.named_parameters(recurse=False)] + \
          [n for n, _ in model.named_buffers(recurse=False)]
    if own:
        raise ValueError(f"{where}: the Sequential holds parameters or buffers of its own ({own}); "
                         f"move them into a child module")
    return list(model.named_children())


@functools.lru_cache(maxsize=None)
def _stage_class() -> type:
    torch = _torch()

    class _TorchStage(torch.nn.Sequential):
        """A stage's children under their names in the whole model. A stage whose first layer works
        in place (``ReLU(inplace=True)``) gets a copy of its input: the input is a leaf tensor that
        requires grad (its gradient is what the stage sends back), which torch refuses to modify."""

        def forward(self, x: Any) -> Any:
            first = next(iter(self._modules.values()), None)
            if getattr(first, "inplace", False) and x.is_leaf and x.requires_grad:
                x = x.clone()
            return super().forward(x)

    return _TorchStage


def torch_stage(children: Sequence[tuple[str, Any]], split_backward: bool) -> TorchModule:
    """One stage: ``children`` (name, module) as a torch Sequential, adapted for the runtime."""
    return from_torch(_stage_class()(OrderedDict(children)), split_backward=split_backward)


def torch_entries(model: Any) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """``{name: (shape, dtype)}`` of the whole torch model's state dict (numpy dtypes)."""
    return {k: (tuple(v.shape), np.dtype(to_array(v).dtype)) for k, v in model.state_dict().items()}


_CROSS_ENTROPY_LIKE = ("cross_entropy", "nll_loss")


class TorchLoss:
    """A torch loss callable in the pipeline's loss protocol (what the last stage calls).

    Args:
        fn: ``fn(output, target) -> 0-d tensor``: a torch loss module, a torch functional loss or
            any callable of torch operations.
        reduction: "mean" (each microbatch's loss is a mean over its samples) or "sum"; default:
            ``fn.reduction`` (a torch loss module), a partial's ``reduction=`` keyword, else "mean".
        ignore_index: a target value that does not count towards a mean (default: ``fn``'s, or
            torch's -100 for ``cross_entropy``/``nll_loss`` and their modules; None for others).

    ``Pipeline(loss_fn=...)`` wraps a torch loss in this itself; construct one to pass
    ``reduction``/``ignore_index`` for a callable that does not declare them.
    """

    def __init__(self, fn: Any, *, reduction: str | None = None, ignore_index: int | None = None) -> None:
        if not callable(fn):
            raise TypeError(f"TorchLoss: fn must be callable, got {type(fn).__name__}")
        self.fn = fn
        keywords = fn.keywords if isinstance(fn, functools.partial) else {}
        base = fn.func if isinstance(fn, functools.partial) else fn
        if reduction is None:
            reduction = keywords.get("reduction", getattr(base, "reduction", None)
                                     if is_torch_module(base) else None) or "mean"
        if reduction not in ("mean", "sum"):
            raise ValueError(f"TorchLoss: reduction must be 'mean' or 'sum' (a pipeline adds the "
                             f"microbatches' losses up to the batch's), got {reduction!r}")
        self.reduction = reduction
        if ignore_index is None:
            ignore_index = keywords.get("ignore_index", getattr(base, "ignore_index", None))
        if ignore_index is None and getattr(base, "__name__", None) in _CROSS_ENTROPY_LIKE:
            ignore_index = -100   # torch's functional default
        self.ignore_index = ignore_index
        weight = keywords.get("weight", getattr(base, "weight", None) if is_torch_module(base) else None)
        if weight is not None and reduction == "mean":
            raise ValueError("TorchLoss: a class-weighted loss with reduction='mean' divides each "
                             "microbatch by its own total weight, so microbatch means do not add up to "
                             "the batch's; use reduction='sum' (and scale the learning rate)")
        self._saved: tuple[Any, Any] | None = None

    def __call__(self, output: Any, target: Any) -> float:
        """The microbatch's loss (a float); the graph from ``output`` is kept for ``backward``."""
        torch = _torch()
        out = (output.detach() if is_tensor(output) else to_tensor(output)).requires_grad_(True)
        tgt = target if is_tensor(target) else to_tensor(target)
        with torch.enable_grad():
            loss = self.fn(out, tgt)
        if not is_tensor(loss) or loss.numel() != 1:
            got = f"a tensor of shape {tuple(loss.shape)}" if is_tensor(loss) else type(loss).__name__
            raise TypeError(f"TorchLoss: the loss function returned {got}; it must return one value "
                            f"(a 0-d tensor): reduce with reduction='mean' or 'sum'")
        self._saved = (out, loss)
        return float(loss.detach())

    def backward(self, scale: float = 1.0) -> Any:
        """``scale * dloss/doutput`` for the last call, as a numpy array of the output's shape."""
        if self._saved is None:
            raise RuntimeError("TorchLoss.backward called without a preceding loss call")
        torch = _torch()
        out, loss = self._saved
        self._saved = None
        if not scale:   # a microbatch that counts for nothing (every target ignored): no nan from 0/0
            return np.zeros(tuple(out.shape), dtype=to_array(out).dtype)
        (g,) = torch.autograd.grad(loss, out, torch.full_like(loss, float(scale)))
        return to_array(g)

    def free_saved(self) -> None:
        self._saved = None

    def __repr__(self) -> str:
        return f"TorchLoss({self.fn!r}, reduction={self.reduction!r}, ignore_index={self.ignore_index!r})"


def as_pipeline_loss(loss_fn: Any, torch_stage: bool) -> Any:
    """``loss_fn`` as the runtime calls it: an hpcdp loss as it is, a torch loss wrapped."""
    if callable(getattr(loss_fn, "backward", None)) and not is_torch_module(loss_fn):
        return loss_fn
    if callable(loss_fn) and (torch_stage or is_torch_module(loss_fn)):
        return TorchLoss(loss_fn)
    raise TypeError("Pipeline: loss_fn must be an nn loss (callable, with backward()) or, for a torch "
                    "model, a torch loss (loss_fn(output, target) -> 0-d tensor)")

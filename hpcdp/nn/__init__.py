"""A small numpy/cupy layer library with explicit, split backward, per-microbatch saved tensors and hooks.

Used directly by users and by DDP/FSDP/pipeline stages (see :class:`Module` for the backward
contract, :mod:`.hooks` for hook order and :mod:`.microbatch` for several forwards in flight).
"""
from __future__ import annotations

from . import init, utils
from .activations import GELU, Identity, LogSoftmax, ReLU, Sigmoid, SiLU, Softmax, Tanh
from .attention import MultiheadAttention
from .container import ModuleDict, ModuleList, Sequential
from .init import manual_seed
from .layers import Dropout, Flatten
from .linear import Embedding, Linear
from .losses import CrossEntropyLoss, MSELoss
from .microbatch import current_microbatch, microbatch
from .module import IncompatibleKeys, Module
from .normalization import LayerNorm, RMSNorm
from . import chunking
from .parameter import Parameter, RemovableHandle
from .torch_module import TorchModule, TorchParameter, from_torch

__all__ = [
    "Parameter", "RemovableHandle", "Module", "IncompatibleKeys", "Sequential", "ModuleList", "ModuleDict",
    "Linear", "LayerNorm", "RMSNorm", "Embedding", "Dropout", "Flatten", "MultiheadAttention",
    "ReLU", "GELU", "Tanh", "Sigmoid", "SiLU", "Identity", "Softmax", "LogSoftmax",
    "MSELoss", "CrossEntropyLoss", "manual_seed", "init", "utils", "microbatch", "current_microbatch",
    "from_torch", "TorchModule", "TorchParameter",
]

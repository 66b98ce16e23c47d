"""A small numpy/cupy layer library with explicit backward and gradient-ready hooks (used by DDP/FSDP)."""
from __future__ import annotations

from . import init, utils
from .activations import GELU, Identity, ReLU, Sigmoid, Tanh
from .container import Sequential
from .init import manual_seed
from .layers import Dropout, Embedding, Flatten, LayerNorm, Linear
from .losses import CrossEntropyLoss, MSELoss
from .module import IncompatibleKeys, Module
from .parameter import Parameter, RemovableHandle

__all__ = [
    "Parameter", "RemovableHandle", "Module", "IncompatibleKeys", "Sequential",
    "Linear", "LayerNorm", "Embedding", "Dropout", "Flatten",
    "ReLU", "GELU", "Tanh", "Sigmoid", "Identity",
    "MSELoss", "CrossEntropyLoss", "manual_seed", "init", "utils",
]

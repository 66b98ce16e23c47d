"""Compatibility alias of ``hpcdp.launch._processes`` (moved there); the same module object."""
from __future__ import annotations

import sys

from ..launch import _processes

sys.modules[__name__] = _processes

"""Compatibility alias of ``hpcdp.backends.tcp._wire`` (moved there); the same module object."""
from __future__ import annotations

import sys

from .tcp import _wire

sys.modules[__name__] = _wire

"""Compatibility alias of ``hpcdp.backends.tcp._accept`` (moved there); the same module object."""
from __future__ import annotations

import sys

from .tcp import _accept

sys.modules[__name__] = _accept

"""The package version, in a module of its own so that the layers (a checkpoint's manifest
records it) read it without importing the top package they sit under."""
from __future__ import annotations

__version__ = "0.1.0"

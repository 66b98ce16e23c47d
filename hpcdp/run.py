"""``python -m hpcdp.run``: the launcher CLI, kept at its documented path (see ``hpcdp.launch``)."""
from __future__ import annotations

import sys

from .launch.cli import GRACE, attempt_secret, launch, main, node_layout, parse_nodelist, run_inprocess

__all__ = ["main", "parse_nodelist", "node_layout", "launch", "attempt_secret", "run_inprocess",
           "GRACE"]

if __name__ == "__main__":
    sys.exit(main())

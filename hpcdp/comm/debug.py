"""``HPCDP_DEBUG=detail`` (or ``1``): check op, shape, dtype and root across ranks before each
collective, and every point-to-point message against its receive (``_debug_p2p``).

Each rank packs a fingerprint of its call into a fixed-size buffer, so the check itself can never
mismatch; every rank then sees every fingerprint and all raise the same error together.
"""
from __future__ import annotations

import json
import os
import sys
import zlib
from typing import TYPE_CHECKING, Any

import numpy as np

from .._config import setting
from ..errors import CollectiveMismatchError
from .work import wait_for

if TYPE_CHECKING:
    from .group import ProcessGroup

_FP_BYTES = 1024
_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # hpcdp/


#: the levels a group accepts; ``HPCDP_DEBUG`` also takes "", "0", "false" and "no" for "off"
#: and "1", "true", "yes" and "on" for "detail" (its declaration in ``_config``)
LEVELS = frozenset({"off", "detail"})


def debug_level() -> str:
    """``HPCDP_DEBUG`` as a level; an unknown value is an error, not silently "off"."""
    return setting("HPCDP_DEBUG")


def caller_line() -> str:
    """The first frame outside hpcdp: where the user called the collective."""
    f = sys._getframe(1)
    while f is not None and os.path.abspath(f.f_code.co_filename).startswith(_PKG_DIR):
        f = f.f_back
    if f is None:
        return "?"
    return f"{f.f_code.co_filename}:{f.f_lineno}"


def check_across(group: "ProcessGroup", opname: str, seq: int, timeout: float, **call: Any) -> None:
    """Raise CollectiveMismatchError on every rank if the ranks' calls differ."""
    mine = {"call": opname, **{k: (list(v) if isinstance(v, tuple) else str(v) if not isinstance(v, (int, float)) else v)
                               for k, v in call.items() if v is not None}}
    record = dict(mine, rank=group.rank, line=caller_line())
    raw = json.dumps(record, default=str).encode()  # ASCII: json escapes the rest
    if len(raw) >= _FP_BYTES:  # keep it valid JSON: shorten the source path, then the call
        record["line"] = "..." + record["line"][-120:]
        raw = json.dumps(record, default=str).encode()
        if len(raw) >= _FP_BYTES:
            # the same on every rank for the same call (str hash() is salted per process)
            digest = zlib.crc32(json.dumps(mine, sort_keys=True, default=str).encode())
            record = {"call": opname, "digest": digest, "rank": group.rank, "line": record["line"]}
            raw = json.dumps(record, default=str).encode()
    send = np.zeros(_FP_BYTES, np.uint8)
    send[: len(raw)] = np.frombuffer(raw, np.uint8)
    recv = np.empty((group.size, _FP_BYTES), np.uint8)
    wait_for(group, f"{opname} (HPCDP_DEBUG check)", seq,
             group.backend.all_gather(send, recv), timeout)
    records = [json.loads(bytes(row).rstrip(b"\0").decode()) for row in recv]
    keys = [{k: v for k, v in r.items() if k not in ("rank", "line")} for r in records]
    if any(k != keys[0] for k in keys[1:]):
        lines = "\n".join(
            f"  rank {r['rank']}: {_fmt(k)} at {r['line']}" for r, k in zip(records, keys)
        )
        raise CollectiveMismatchError(
            f"collective #{seq} on group {group.name}: ranks called different collectives "
            f"(seen on rank {group.rank}):\n{lines}"
        )


def _fmt(call: dict[str, Any]) -> str:
    name = call.get("call")
    args = ", ".join(f"{k}={v}" for k, v in call.items() if k != "call")
    return f"{name}({args})"

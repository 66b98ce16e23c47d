"""Checks that the ranks of a group make the same collective call, at three levels
(``HPCDP_DEBUG``):

- ``sample`` (the default): the first ``SAMPLE_FIRST`` collectives of each group, and after them
  every ``SAMPLE_EVERY``-th, exchange a fixed-size binary signature (operation, dtype, shape,
  reduction, root, sequence number) before they run. Chosen by sequence number, the sampled
  calls are the same on every rank, so the exchange itself always matches; a program that
  passes float64[4] on one rank and float32[8] (or shape (3, 2) against (2, 3)) on another,
  anywhere it does so on every step, raises ``CollectiveMismatchError`` on every rank within
  its first steps, before the collective runs (no rank is left with a result). A mismatch in a
  call that is not sampled (one odd step) goes unchecked, as it did before; ``detail`` checks
  every call.
- ``detail`` (or ``1``): every collective, with each rank's source line in the error, and every
  point-to-point message against its receive (``_debug_p2p``).
- ``off``: no checks.

Each rank packs its fingerprint into a fixed-size buffer, so the check itself can never
mismatch; every rank then sees every fingerprint and all raise the same error together.
"""
from __future__ import annotations

import json
import os
import sys
import time
import zlib
from typing import TYPE_CHECKING, Any

import numpy as np

from .._arrays import SUPPORTED_DTYPES
from .._config import setting
from ..backends.base import Request
from ..errors import CollectiveMismatchError
from ..ops import ReduceOp
from .work import wait_for

if TYPE_CHECKING:
    from .group import ProcessGroup

_FP_BYTES = 1024
_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # hpcdp/


#: the levels a group accepts; ``HPCDP_DEBUG`` also takes "", "0", "false" and "no" for "off"
#: and "1", "true", "yes" and "on" for "detail" (its declaration in ``_config``)
LEVELS = frozenset({"off", "sample", "detail"})

#: ``sample``: the collectives checked are #1 to #SAMPLE_FIRST of each group, then every
#: SAMPLE_EVERY-th (a power of two: ``seq & SAMPLE_MASK == 0``). A check costs one small
#: all_gather; spread this thin it does not show in a small allreduce's latency (A2).
SAMPLE_FIRST, SAMPLE_EVERY = 32, 128
SAMPLE_MASK = SAMPLE_EVERY - 1

_OPS = ("allreduce", "broadcast", "reduce", "all_gather", "gather", "scatter", "reduce_scatter",
        "all_to_all", "barrier")
_REDOPS = tuple(o.value for o in ReduceOp)
_SIG_WORDS = 16  # int64: magic, seq, op, dtype, redop, root, ndim, size, shape[:6], crc, pad
_MAGIC = 0x48504344  # "HPCD": a word that no other collective's payload is likely to start with
_SHAPE_WORDS = 6


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


def sampled(seq: int) -> bool:
    """Whether collective ``seq`` of a group is checked at level ``sample``."""
    return seq <= SAMPLE_FIRST or not seq & SAMPLE_MASK


#: call -> its signature with seq 0: a loop makes the same few calls, and building one is most
#: of a check's own cost; cleared when full (a program of many shapes just builds them again)
_signatures: dict[tuple[Any, ...], np.ndarray] = {}
_SIGNATURES_MAX = 256


def _signature(opname: str, seq: int, op: Any, root: Any, shape: Any, dtype: Any) -> np.ndarray:
    try:
        key = (opname, op, root, shape, dtype)
        known = _signatures.get(key)
    except TypeError:  # an unhashable argument (a list shape): built every time
        return _build_signature(opname, seq, op, root, shape, dtype)
    if known is None:
        if len(_signatures) >= _SIGNATURES_MAX:
            _signatures.clear()
        known = _signatures[key] = _build_signature(opname, 0, op, root, shape, dtype)
        known.flags.writeable = False
    sig = known.copy()
    sig[1] = seq
    return sig


def _build_signature(opname: str, seq: int, op: Any, root: Any, shape: Any,
                     dtype: Any) -> np.ndarray:
    sig = np.zeros(_SIG_WORDS, np.int64)
    sig[0], sig[1] = _MAGIC, seq
    sig[2] = _OPS.index(opname) + 1 if opname in _OPS else 1000 + zlib.crc32(opname.encode()) % 1000
    dt = None if dtype is None else np.dtype(dtype)
    sig[3] = -1 if dt is None else (SUPPORTED_DTYPES.index(dt) if dt in SUPPORTED_DTYPES
                                    else 1000 + zlib.crc32(dt.str.encode()) % 1000)
    sig[4] = -1 if op is None else (_REDOPS.index(op) if op in _REDOPS else 99)
    sig[5] = -1 if root is None else int(root)
    if shape is not None:
        shape = tuple(int(n) for n in shape)
        sig[6] = len(shape)
        sig[7] = int(np.prod(shape, dtype=np.int64)) if shape else 1
        head = shape[:_SHAPE_WORDS]
        sig[8:8 + len(head)] = head
        sig[8 + _SHAPE_WORDS] = zlib.crc32(repr(shape).encode())
    else:
        sig[6] = -1
    return sig


def _describe(sig: np.ndarray) -> str:
    """A rank's call as its signature tells it: ``allreduce(float64, shape (2, 3), op=sum) #4``."""
    if sig[0] != _MAGIC:
        return "a call that is not a checked collective (its ranks are out of step)"
    op = int(sig[2])
    name = _OPS[op - 1] if 1 <= op <= len(_OPS) else f"collective <{op}>"
    parts = []
    if sig[3] >= 0:
        dt = (str(SUPPORTED_DTYPES[sig[3]]) if sig[3] < len(SUPPORTED_DTYPES)
              else f"dtype <{int(sig[3])}>")
        ndim = int(sig[6])
        dims = [int(n) for n in sig[8:8 + min(max(ndim, 0), _SHAPE_WORDS)]]
        more = ", ..." if ndim > _SHAPE_WORDS else ""
        shape = (f"({dims[0]},)" if ndim == 1 else f"({', '.join(map(str, dims))}{more})")
        parts.append(f"{dt}, shape {shape}")
    if sig[4] >= 0:
        parts.append(f"op={_REDOPS[sig[4]] if sig[4] < len(_REDOPS) else '?'}")
    if sig[5] >= 0:
        parts.append(f"root={int(sig[5])}")
    return f"{name}({', '.join(parts)}) #{int(sig[1])}"


def post_sampled(group: "ProcessGroup", opname: str, seq: int, *, op: Any = None,
                 root: Any = None, shape: Any = None, dtype: Any = None) -> tuple[Any, np.ndarray]:
    """Post the ``sample`` check of collective ``seq``: (its request, the array that receives
    every rank's signature). On the backend's ``check_all_gather``: on MPI a communicator of its
    own, so a check can never be matched with a collective of another rank."""
    sig = _signature(opname, seq, op, root, shape, dtype)
    got = np.empty((group.size, _SIG_WORDS), np.int64)
    return group._post(opname, seq, group.backend.check_all_gather, sig, got), got


def judge_sampled(group: "ProcessGroup", opname: str, seq: int, got: np.ndarray) -> None:
    """``CollectiveMismatchError`` if the gathered signatures differ (every rank sees the same
    ones, so every rank raises the same error)."""
    raw = got.tobytes()  # every row equal: the rows shifted by one are the same bytes
    if raw[_SIG_WORDS * 8:] == raw[:-_SIG_WORDS * 8]:
        return
    lines = "\n".join(f"  rank {r}: {_describe(row)}" for r, row in enumerate(got))
    raise CollectiveMismatchError(
        f"{opname} #{seq} on group {group.name} (rank {group.rank} of {group.size}): the ranks "
        f"called different collectives (every rank checked the calls' signatures; "
        f"HPCDP_DEBUG=detail names each rank's source line):\n{lines}")


def check_sampled(group: "ProcessGroup", opname: str, seq: int, timeout: float, **call: Any) -> None:
    """The ``sample`` check of a blocking collective, before it is posted: a mismatch raises on
    every rank and nothing was posted, so the group stays usable."""
    req, got = post_sampled(group, opname, seq, **call)
    # named as the collective itself: a rank that never arrives has not joined *it*
    wait_for(group, opname, seq, req, timeout)
    judge_sampled(group, opname, seq, got)


class CheckedRequest(Request):
    """An asynchronous collective posted beside its ``sample`` check (an ``async_op=True`` call
    must not block, and a rank's peers may make the same call blocking): the check is judged
    first when the request is tested or waited on, so a mismatch raises on every rank before
    any of them looks at a result. The collective itself was posted with mismatched arguments
    then and cannot be withdrawn: the error breaks the group as a failed collective does."""

    __slots__ = ("_group", "_op", "_seq", "_check", "_got", "_inner", "_judged")

    def __init__(self, group: "ProcessGroup", opname: str, seq: int, check: Request,
                 got: np.ndarray, inner: Request) -> None:
        self._group, self._op, self._seq = group, opname, seq
        self._check, self._got, self._inner = check, got, inner
        self._judged = False

    def _judge(self) -> None:
        self._judged = True
        judge_sampled(self._group, self._op, self._seq, self._got)

    def test(self) -> bool:
        if not self._judged:
            if not self._check.test():
                return False
            self._judge()
        return self._inner.test()

    def wait(self, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._judged:
            if not self._check.wait(timeout):
                return False
            self._judge()
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return self._inner.wait(left)

    def pending(self) -> str:
        return self._inner.pending() if self._judged else self._check.pending()

    def abandon(self) -> bool | None:
        if self._judged:
            return self._inner.abandon()
        self._check.abandon()
        self._inner.abandon()
        return None

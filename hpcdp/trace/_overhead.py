"""``python -m hpcdp.trace overhead``: what recording costs per operation, in nanoseconds.

Times ``begin`` + ``end`` pairs (the calls included) in each mode against an empty loop, over
interleaved trials (the machine is shared and noisy), and prints the median extra cost:
off (the collective layer's ``if rec is not None`` check), the default ring, the ring with
source lines, and full ``HPCDP_TRACE`` timelines (events buffered, written to a temporary dir).
"""
from __future__ import annotations

import gc
import statistics
import tempfile
import time
from typing import Any, Callable

import numpy as np

from ._chrome import Timeline
from ._recorder import Recorder

__all__ = ["measure", "main"]


class _Group:
    name, ranks, rank = "world", (0, 1), 0


def _loop(n: int, rec: Recorder | None, shape: Any, dtype: Any, g: Any) -> float:
    t0 = time.perf_counter()
    if rec is None:
        for i in range(n):
            if rec is not None:
                pass
    else:
        begin, end = rec.begin, rec.end
        for i in range(n):
            end(begin("allreduce", g, i, shape, dtype, -1))
    return time.perf_counter() - t0


def measure(n: int = 200_000, trials: int = 7) -> dict[str, float]:
    """Median nanoseconds per begin+end pair in each mode, over a bare loop."""
    shape, dtype, g = (1024,), np.dtype("float32"), _Group()
    with tempfile.TemporaryDirectory() as d:
        tl = Timeline(0, d)  # default chunking, as in a real run
        modes: dict[str, Callable[[], float]] = {
            "bare loop iteration (scale)": lambda: _bare(n),
            "off (one None check)": lambda: _loop(n, None, shape, dtype, g) - _bare(n),
            "ring (default)": lambda: _loop(n, ring, shape, dtype, g) - _bare(n),
            "ring + source lines": lambda: _loop(n, lined, shape, dtype, g) - _bare(n),
            "ring + HPCDP_TRACE timeline": lambda: _traced(n, traced, tl, shape, dtype, g),
        }
        ring, lined = Recorder(0, 2048), Recorder(0, 2048, lines=True)
        traced = Recorder(0, 2048)
        traced.attach_timeline(tl)
        out: dict[str, list[float]] = {k: [] for k in modes}
        for _ in range(trials):
            for k, fn in modes.items():
                gc.collect()  # each mode starts from the same heap
                out[k].append(fn() / n * 1e9)
        tl.close()
    return {k: statistics.median(v) for k, v in out.items()}


def _bare(n: int) -> float:
    t0 = time.perf_counter()
    for i in range(n):
        pass
    return time.perf_counter() - t0


def _traced(n: int, rec: Recorder, tl: Any, shape: Any, dtype: Any, g: Any) -> float:
    t = _loop(n, rec, shape, dtype, g) - _bare(n)
    t0 = time.perf_counter()
    tl.flush()  # writing the events is part of the cost, amortised per operation
    return t + time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m hpcdp.trace overhead")
    p.add_argument("-n", type=int, default=200_000, help="begin+end pairs per trial")
    p.add_argument("--trials", type=int, default=7)
    a = p.parse_args(argv)
    res = measure(a.n, a.trials)
    print(f"# hpcdp.trace overhead: median extra ns per begin+end pair, {a.trials} interleaved trials of {a.n}")
    for k, v in res.items():
        print(f"  {k:<30} {v:>8.0f} ns")
    return 0

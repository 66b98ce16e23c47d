"""Every target a benchmark is judged by, declared once (the table of ../shared/PERF.md).

A benchmark prints a target as ``target(ID, PART).text`` and judges a figure with
``target(ID, PART).met(value)``, so what it prints, what it writes to its JSON lines and what
``python -m hpcdp.bench report`` checks are one number: copied from PERF.md here, and nowhere
else in ``hpcdp/bench`` (tests/project/test_bench_report.py greps for a stray one). A few parts
are not rows of PERF.md but figures the benchmarks have always judged (``source`` names where
the bound comes from: README's benchmark table, or the benchmark itself).

A figure measured over several sizes is the median over the sizes the target covers (as A1 and
A3 have always been), except where a benchmark has always judged its worst size (A6, H2); the
other one is written beside it in the summary record.

``ranks`` is the world size a figure is gated at (PERF.md: "gate on 2 ranks"); the report lists
a record of another size apart, as a trend, not judged. ``None``: judged at any size (byte and
memory counts, schedules of simulated ranks).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Target", "TARGETS", "OPS", "target", "targets_of", "ids"]

#: how a figure is compared with its bound
OPS = (">=", "<=", "<", "exact", "within", "report")


@dataclass(frozen=True)
class Target:
    """One figure's bound: ``value OP bound`` (``within``: ``|value - bound| <= tol``, ``tol`` a
    share of ``bound`` when ``relative``, plus a record's own ``slack``)."""

    id: str
    part: str
    what: str
    op: str
    bound: float | None = None
    tol: float = 0.0
    relative: bool = False
    unit: str = ""
    ranks: int | None = 2
    source: str = "PERF.md"
    #: the bound as PERF.md spells it (``1.10``, ``2.0``), or the whole target's words where
    #: the bound alone would mislead (E1's padding, F1's bubble against each schedule's theory)
    shown: str = ""

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"target {self.key}: op {self.op!r} is not one of {OPS}")
        if (self.op == "report") != (self.bound is None):
            raise ValueError(f"target {self.key}: a bound is given exactly when op is not 'report'")

    @property
    def key(self) -> str:
        """``ID`` or ``ID part``: how the report and the summary records name the figure."""
        return f"{self.id} {self.part}" if self.part else self.id

    @property
    def text(self) -> str:
        """The target as printed: ``>= 0.95``, ``<= +3 us``, ``within 2% of 1.5``, ``= 0``."""
        if self.op == "report":
            return "report"
        if self.shown and not self.shown[0].isdigit():
            return self.shown
        b = self.shown or f"{self.bound:g}"
        if self.op == "exact":
            return f"= {b}{self.unit}"
        if self.op == "within":
            tol = f"{self.tol * 100:g}%" if self.relative else f"{self.tol:g}"
            return f"within {tol} of {b}{self.unit}"
        sign = "+" if self.unit.strip() == "us" else ""  # an overhead over the baseline's time
        return f"{self.op} {sign}{b}{self.unit}"

    def met(self, value: float | None, slack: float = 0.0) -> bool | None:
        """Whether ``value`` meets the target; ``None`` for a report-only figure or no figure."""
        if self.op == "report" or value is None or not math.isfinite(value):
            return None
        assert self.bound is not None
        if self.op == ">=":
            return value >= self.bound
        if self.op == "<=":
            return value <= self.bound
        if self.op == "<":
            return value < self.bound
        if self.op == "exact":
            return value == self.bound
        allowed = self.tol * (abs(self.bound) if self.relative else 1.0) + slack
        return abs(value - self.bound) <= allowed


def _t(id: str, part: str, what: str, op: str, bound: str | None = None, **kw: object) -> Target:
    """A target whose bound is written as PERF.md writes it (a string: ``"1.10"`` stays 1.10)."""
    if bound is not None and "shown" not in kw:
        kw["shown"] = bound
    return Target(id, part, what, op, None if bound is None else float(bound), **kw)  # type: ignore[arg-type]


_README = "README's benchmark table"
_BENCH = "the benchmark's own bound"

#: in PERF.md's order, then the ids README adds
TARGETS: tuple[Target, ...] = (
    _t("A1", "", "MPI allreduce busbw >= 1 MiB / mpi4py Allreduce, either import order", ">=", "0.97"),
    _t("A2", "mean", "MPI allreduce latency - mpi4py's, 8 B - 1 KiB, worst size (mean calls)", "<=", "3",
       unit=" us"),
    _t("A2", "median call", "the same, median calls (robust to preempted calls)", "<=", "3", unit=" us"),
    _t("A2'", "", "sampled call checks' share of A2 (HPCDP_DEBUG=sample - off, 8 B, mean call)", "<=", "0.3",
       unit=" us", source=_README),
    _t("A3", "all_gather", "all_gather busbw >= 1 MiB / mpi4py Allgather", ">=", "0.95"),
    _t("A3", "reduce_scatter", "reduce_scatter busbw >= 1 MiB / mpi4py Reduce_scatter_block", ">=", "0.95"),
    _t("A3", "broadcast", "broadcast busbw >= 1 MiB / mpi4py Bcast", ">=", "0.95"),
    _t("A5", "", "8 B ndarray allreduce time / mpi4py pickle allreduce time", "<=", "0.1"),
    _t("A7", "latency", "8 B send/recv round trip / mpi4py Send/Recv", "<=", "1.5", unit="x", ranks=None),
    _t("A7", "halo", "halo step (1-D, 2-D) / mpi4py Isend/Irecv/Waitall or Sendrecv", "<=", "1.3", unit="x",
       ranks=None),
    _t("A7", "batch", "batch_isend_irecv halo step / hpcdp isend/irecv (no slower)", "<=", "1.0", unit="x",
       ranks=None),
    _t("A6", "", "cupy allreduce busbw >= 1 MiB / mpi4py on the same arrays (worst size)", ">=", "0.95",
       ranks=None),
    _t("B1", "bandwidth", "TCP send/recv bandwidth >= 1 MiB / raw socket ping-pong", ">=", "0.9"),
    _t("B1", "latency", "TCP send/recv 8 B time / raw socket ping-pong", "<=", "1.5", unit="x"),
    _t("B2", "2 ranks", "TCP allreduce busbw >= 4 MiB / torch gloo all_reduce, 2 ranks", ">=", "1.5"),
    _t("B2", "4 ranks", "TCP allreduce busbw >= 4 MiB / torch gloo all_reduce, 4 ranks", ">=", "1.0", ranks=4),
    _t("C1", "", "sim allreduce >= 1 MiB, 4 ranks / numpy sum of the arrays plus copies", "<=", "2.0", unit="x",
       ranks=4),
    _t("D1", "", "DDP sync of 1000 small tensors / one allreduce per tensor", "<=", "0.5", unit="x"),
    _t("D2", "", "DDP sync in 25 MB buckets / one mpi4py Allreduce of a flat buffer", "<=", "1.3", unit="x"),
    _t("D4", "", "DDP weak scaling efficiency, 2 ranks vs 1, MLP 784-1024-1024-10", ">=", "0.85"),
    _t("E1", "", "FSDP/ZeRO bytes held per rank / ZeRO formula (plus padding)", "within", "1.0", tol=0.02,
       relative=True, ranks=None, shown="within 2% plus padding"),
    _t("E2", "zero3", "ZeRO-3 bytes sent per step / DDP's (theory 1.5)", "within", "1.5", tol=0.02,
       relative=True, ranks=None),
    _t("E2", "zero2", "ZeRO-2 bytes sent per step / DDP's (theory 1.0)", "within", "1.0", tol=0.02,
       relative=True, ranks=None),
    _t("E2", "zero1", "ZeRO-1 bytes sent per step / DDP's (theory 1.5)", "within", "1.5", tol=0.02,
       relative=True, ranks=None, source=_README),
    _t("E3", "zero3", "ZeRO-3 step time / DDP's, communication-bound model", "<=", "1.3", unit="x"),
    _t("E3", "zero2", "ZeRO-2 step time / DDP's, communication-bound model", "<=", "1.15", unit="x"),
    _t("E3", "hidden", "share of ZeRO-3's all-gather wait hidden by prefetch", "report"),
    _t("E4", "", "largest model in a per-rank budget: ZeRO-3 / DDP parameters / ranks N", ">=", "0.8",
       ranks=None),
    _t("F1", "step", "pipeline step / its schedule's ideal (sleep-based stages)", "<=", "1.10", unit="x",
       ranks=None),
    _t("F1", "bubble", "pipeline bubble - theory ((p-1)/(m+p-1) for GPipe, 1F1B)", "within", "0.0", tol=0.03,
       ranks=None, shown="within 0.03 of theory"),
    _t("F1", "zero-bubble", "zero-bubble step / 1F1B step (below)", "<", "1.0", unit="x", ranks=None),
    _t("F2", "", "peak stashed activations per rank - m (GPipe), p - rank (1F1B), verify's (others), "
                 "largest difference", "exact", "0", ranks=None, shown="exact"),
    _t("R1", "", "rpc_sync no-op round trip / raw send/recv round trip", "<=", "3", unit="x"),
    _t("R2", "", "64 rpc_async of 1 MiB in flight / raw p2p bandwidth", ">=", "0.8"),
    _t("T1", "", "DDP example step, HPCDP_TRACE=1 / off", "<=", "1.05", unit="x"),
    _t("T1", "ring", "flight-recorder ring / HPCDP_FLIGHT_RECORDER=0 (off costs nothing measurable)", "<=",
       "1.05", unit="x", source=_README),
    _t("T1", "fast path", "flight recorder on - off, 8 B allreduce fast path", "<=", "0.5", unit=" us",
       source=_BENCH),
    _t("D5", "efficiency", "torch model under hpcdp.DDP over MPI, weak scaling 2 vs 1 rank", ">=", "0.85"),
    _t("D5", "overhead", "hpcdp.DDP adapter at 1 rank / plain torch", "<=", "1.05", unit="x"),
    _t("H1", "", "GPT example step, deterministic_chunk=2 / mode off", "<=", "1.2", unit="x"),
    _t("H2", "", "deterministic allreduce busbw >= 1 MiB / plain allreduce (worst size)", ">=", "0.3"),
    _t("M1", "", "allreduce busbw across simulated nodes / the link's configured rate (best size)", "report",
       ranks=None),
    _t("M2", "", "DDP weak scaling, 2 nodes x 2 ranks vs 1 node x 2 ranks", "report", ranks=None),
    _t("G1", "", "checkpoint save >= 64 MiB with fsync / MPI Write_at_all + Sync (bandwidth)", ">=", "0.95"),
    _t("G2", "page cache", "checkpoint load from the page cache / MPI Read_at_all (bandwidth)", ">=", "0.8"),
    _t("G2", "evicted", "checkpoint load, pages evicted / MPI Read_at_all (bandwidth)", ">=", "0.8"),
)

_BY_KEY: dict[tuple[str, str], Target] = {}
for _x in TARGETS:
    if (_x.id, _x.part) in _BY_KEY:
        raise ValueError(f"target {_x.key} declared twice")
    _BY_KEY[(_x.id, _x.part)] = _x


def target(id: str, part: str = "") -> Target:
    """The target of figure ``id`` (and ``part``, for an id with several figures)."""
    try:
        return _BY_KEY[(id, part)]
    except KeyError:
        parts = [t.part for t in TARGETS if t.id == id]
        hint = f"; its parts: {parts}" if parts else ""
        raise KeyError(f"no target {id!r} part {part!r} in hpcdp.bench._targets{hint}") from None


def targets_of(id: str) -> list[Target]:
    """Every part of ``id``, in declaration order."""
    return [t for t in TARGETS if t.id == id]


def ids() -> list[str]:
    """Every id, once each, in declaration order."""
    return list(dict.fromkeys(t.id for t in TARGETS))

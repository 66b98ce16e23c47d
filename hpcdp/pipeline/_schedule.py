"""``Schedule``: each pipeline rank's list of actions, as data that prints as a grid and parses back.

Stages are placed in a loop: with ``stages`` ranks and ``virtual`` stages per rank there are
``stages * virtual`` model stages, and stage ``s`` lives on rank ``s % stages`` (Megatron's
interleaved placement; ``virtual=1`` is one stage per rank).

A schedule may hold compute actions only (what the built-in schedules produce and what reads best)
or compute and communication actions. :meth:`Schedule.with_comms` lowers the first into the second:
after each forward whose next stage is on another rank it sends the activation, after each backward
whose previous stage is elsewhere it sends the gradient, and it posts every receive one compute
action before the action that consumes it, so a transfer overlaps with the compute before it.

Declared sizes are bounded by what the schedule holds: a schedule that runs every stage on every
microbatch has at least two actions per (stage, microbatch) pair, so ``stages x virtual x
microbatches`` may not exceed the number of actions (or the number of ranks, for a schedule still
being written), nor :data:`MAX_PAIRS`. A few bytes of text (``microbatches=1000000000``) then raise
``ScheduleError`` at once instead of making ``verify`` allocate per pair; an incomplete schedule
within the bound still verifies, and ``verify`` lists what is missing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from ..errors import HpcdpError
from ._actions import COMM_OPS, Action, Op

__all__ = ["Schedule", "ScheduleError", "MAX_PAIRS"]

_EMPTY = "."
#: most (stage, microbatch) pairs a schedule may declare, whatever it holds: what ``verify`` walks
MAX_PAIRS = 1 << 24
#: digits of a size in the text form (more cannot be within ``MAX_PAIRS``)
_MAX_DIGITS = 12


class ScheduleError(HpcdpError, ValueError):
    """A schedule that would deadlock, skip a microbatch, run a backward before its forward, or
    declares more stages or microbatches than it could hold."""


@dataclass(frozen=True)
class Schedule:
    """Per rank, the ordered actions of one training step.

    Args:
        actions: ``actions[r]`` is rank ``r``'s list (``Action`` or ``"2F0"``-style strings).
        microbatches: microbatches per step.
        virtual: model stages per rank (stage ``s`` runs on rank ``s % len(actions)``).
        name: a label that the text form keeps.

    Raises ``ScheduleError`` when ``len(actions) x virtual x microbatches`` exceeds the number of
    actions given (or of ranks) or ``MAX_PAIRS``: no complete schedule could be that sparse.
    """

    actions: tuple[tuple[Action, ...], ...]
    microbatches: int
    virtual: int = 1
    name: str = "custom"

    def __post_init__(self) -> None:
        ranks = tuple(tuple(a if isinstance(a, Action) else Action.parse(a) for a in row)
                      for row in self.actions)
        object.__setattr__(self, "actions", ranks)
        for field, value in (("microbatches", self.microbatches), ("virtual", self.virtual)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Schedule: {field} must be a positive int, got {value!r}")
        if not ranks:
            raise ValueError("Schedule: needs at least one rank")
        if not isinstance(self.name, str) or not self.name or any(c.isspace() for c in self.name):
            raise ValueError(f"Schedule: name must be a non-empty word, got {self.name!r}")
        self._check_sizes(sum(len(row) for row in ranks))
        n, p, m = len(ranks) * self.virtual, len(ranks), self.microbatches
        for r, row in enumerate(ranks):
            for i, a in enumerate(row):
                if not 0 <= a.stage < n:
                    raise ValueError(f"Schedule: rank {r} step {i}: {a} names stage {a.stage}, but "
                                     f"there are {n} stages ({p} ranks x {self.virtual} virtual)")
                if not 0 <= a.mb < m:
                    raise ValueError(f"Schedule: rank {r} step {i}: {a} names microbatch {a.mb}, "
                                     f"but there are {m}")
                if a.stage % p != r:
                    raise ValueError(f"Schedule: rank {r} step {i}: {a} belongs to rank "
                                     f"{a.stage % p} (stage s runs on rank s % {p})")

    def _check_sizes(self, n_actions: int) -> None:
        """Refuse declared sizes that the actions present could not fill (module docstring)."""
        p, v, m = len(self.actions), self.virtual, self.microbatches
        pairs = p * v * m
        room = max(p, n_actions)
        if pairs <= min(room, MAX_PAIRS):
            return
        if p > MAX_PAIRS:
            culprit = f"stages={p}"
        else:
            culprit = f"microbatches={m}" if m >= v else f"virtual={v}"
        why = (f"at most {MAX_PAIRS} are allowed" if pairs > MAX_PAIRS and room >= MAX_PAIRS else
               f"each needs a forward and a backward, but the schedule holds {n_actions} action(s)")
        raise ScheduleError(f"Schedule {self.name!r}: {culprit} is too large: {p} rank(s) x {v} "
                            f"virtual x {m} microbatch(es) = {pairs} (stage, microbatch) pairs; "
                            f"{why}")

    # -- shape of the pipeline ----------------------------------------------------------------
    @property
    def stages(self) -> int:
        """Number of pipeline ranks."""
        return len(self.actions)

    @property
    def n_stages(self) -> int:
        """Number of model stages (ranks x virtual)."""
        return len(self.actions) * self.virtual

    def rank_of(self, stage: int) -> int:
        """The rank that runs ``stage``."""
        return stage % self.stages

    def stages_of(self, rank: int) -> list[int]:
        """The stages ``rank`` runs, in model order."""
        return list(range(rank, self.n_stages, self.stages))

    @property
    def has_comms(self) -> bool:
        return any(a.op in COMM_OPS for row in self.actions for a in row)

    # -- lowering -----------------------------------------------------------------------------
    def compute_only(self) -> Schedule:
        """The same schedule without its send/receive actions."""
        return Schedule(tuple(tuple(a for a in row if a.is_compute) for row in self.actions),
                        self.microbatches, self.virtual, self.name)

    def with_comms(self) -> Schedule:
        """The schedule with send and receive actions (unchanged if it already has some)."""
        if self.has_comms:
            return self
        return Schedule(tuple(self._lower_rank(row) for row in self.actions),
                        self.microbatches, self.virtual, self.name)

    def needs_recv(self, a: Action) -> Action | None:
        """The receive compute action ``a`` consumes, or None (first/last stage, same rank)."""
        p, last = self.stages, self.n_stages - 1
        if p == 1:
            return None
        if a.op is Op.FORWARD and a.stage > 0:
            return Action(a.stage, Op.RECV_F, a.mb)
        if a.op in (Op.BACKWARD, Op.BACKWARD_INPUT) and a.stage < last:
            return Action(a.stage, Op.RECV_B, a.mb)
        return None

    def produces_send(self, a: Action) -> Action | None:
        """The send that follows compute action ``a``, or None."""
        p, last = self.stages, self.n_stages - 1
        if p == 1:
            return None
        if a.op is Op.FORWARD and a.stage < last:
            return Action(a.stage, Op.SEND_F, a.mb)
        if a.op in (Op.BACKWARD, Op.BACKWARD_INPUT) and a.stage > 0:
            return Action(a.stage, Op.SEND_B, a.mb)
        return None

    def _lower_rank(self, row: Sequence[Action]) -> tuple[Action, ...]:
        out: list[Action] = []
        posted: set[Action] = set()

        def post(a: Action | None) -> None:
            recv = None if a is None else self.needs_recv(a)
            if recv is not None and recv not in posted:
                posted.add(recv)
                out.append(recv)

        for i, a in enumerate(row):
            post(a)                                         # in case nothing came before it
            post(row[i + 1] if i + 1 < len(row) else None)  # one action ahead
            out.append(a)
            send = self.produces_send(a)
            if send is not None:
                out.append(send)
        return tuple(out)

    # -- text ---------------------------------------------------------------------------------
    def header(self) -> str:
        return (f"schedule {self.name} stages={self.stages} microbatches={self.microbatches} "
                f"virtual={self.virtual}")

    def format(self, marks: dict[int, int] | None = None) -> str:
        """The step x rank grid; ``marks`` {rank: step} puts ``>`` before those cells."""
        marks = marks or {}
        steps = max((len(row) for row in self.actions), default=0)
        cells = [[str(row[i]) if i < len(row) else _EMPTY for row in self.actions]
                 for i in range(steps)]
        width = max([len(f"rank{self.stages - 1}")] + [len(c) for line in cells for c in line]) + 1
        sw = max(4, len(str(max(steps - 1, 0))))
        lines = [self.header(), "step".rjust(sw) + "  " + "".join(
            f" {f'rank{r}':<{width}}" for r in range(self.stages)).rstrip()]
        for i, line in enumerate(cells):
            row = "".join((">" if marks.get(r) == i else " ") + f"{c:<{width}}"
                          for r, c in enumerate(line))
            lines.append(f"{i:>{sw}}  {row}".rstrip())
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()

    @classmethod
    def parse(cls, text: str) -> Schedule:
        """Read the text form (``str(schedule)``) back into a ``Schedule``.

        Raises ``ScheduleError`` (a ``ValueError``) naming the line; nothing is built per
        declared rank before the column header has shown that many columns.
        """
        lines = [(n, ln.strip()) for n, ln in enumerate(text.splitlines(), 1)]
        lines = [(n, ln) for n, ln in lines if ln and not ln.startswith("#")]
        if not lines:
            raise ScheduleError("Schedule.parse: empty text")
        n0, head = lines[0]
        words = head.split()
        if len(words) != 5 or words[0] != "schedule":
            raise ScheduleError(f"Schedule.parse line {n0}: expected 'schedule NAME stages=P "
                                f"microbatches=M virtual=V', got {head[:200]!r}")
        meta = {}
        for w in words[2:]:
            key, _, val = w.partition("=")
            if key not in ("stages", "microbatches", "virtual") or not val.isdigit():
                raise ScheduleError(f"Schedule.parse line {n0}: bad field {w[:80]!r}")
            if len(val.lstrip("0")) > _MAX_DIGITS:
                raise ScheduleError(f"Schedule.parse line {n0}: {key}={val[:20]}... is too large "
                                    f"({len(val)} digits; at most {MAX_PAIRS} (stage, microbatch) "
                                    f"pairs are allowed)")
            meta[key] = int(val)
        if len(meta) != 3:
            raise ScheduleError(f"Schedule.parse line {n0}: each of stages, microbatches, virtual once")
        p = meta["stages"]
        if p < 1:
            raise ScheduleError(f"Schedule.parse line {n0}: stages must be >= 1")
        cols = lines[1][1].split() if len(lines) > 1 else []
        if len(cols) != p + 1:   # counted before any per-rank name or row is built
            got = repr(lines[1][1][:200]) if len(lines) > 1 else "nothing"
            raise ScheduleError(f"Schedule.parse: stages={p} is too large for the column header "
                                f"after line {n0}, which names {max(len(cols) - 1, 0)} rank(s): "
                                f"expected 'step rank0 ... rank{p - 1}', got {got}"
                                if len(cols) < p + 1 else
                                f"Schedule.parse: expected the column header 'step rank0 ... "
                                f"rank{p - 1}' after line {n0}, got {got}")
        if cols != ["step"] + [f"rank{r}" for r in range(p)]:
            raise ScheduleError(f"Schedule.parse: expected the column header 'step rank0 ... "
                                f"rank{p - 1}' after line {n0}, got {lines[1][1][:200]!r}")
        rows: list[list[Action]] = [[] for _ in range(p)]
        ended = [False] * p
        for i, (n, ln) in enumerate(lines[2:]):
            toks = ln.replace(">", " ").split()
            if len(toks) != p + 1 or toks[0] != str(i):
                raise ScheduleError(f"Schedule.parse line {n}: expected step {i} and {p} cells, "
                                    f"got {ln[:200]!r}")
            for r, tok in enumerate(toks[1:]):
                if tok == _EMPTY:
                    ended[r] = True
                    continue
                if ended[r]:
                    raise ScheduleError(f"Schedule.parse line {n}: rank {r} has an action after "
                                        f"an empty cell")
                try:
                    rows[r].append(Action.parse(tok))
                except ValueError as exc:
                    raise ScheduleError(f"Schedule.parse line {n}: {exc}") from None
        return cls(tuple(tuple(r) for r in rows), meta["microbatches"], meta["virtual"], words[1])

    @classmethod
    def from_lists(cls, lists: Iterable[Iterable[Action | str]], microbatches: int,
                   virtual: int = 1, name: str = "custom") -> Schedule:
        """Build from per-rank iterables of actions or their text."""
        return cls(tuple(tuple(row) for row in lists), microbatches, virtual, name)

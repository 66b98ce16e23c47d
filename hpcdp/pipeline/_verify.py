"""``verify``: run a schedule on a simulated clock and say whether it is correct, without running it.

Three kinds of check:

1. Program order on each rank: every microbatch's forward precedes its backward on its stage, a
   weight gradient follows its input gradient, a send follows the compute that produced it, and a
   compute that needs a transfer from another rank posted its receive first.
2. Completeness: every stage runs forward and backward (``B``, or ``I`` then ``W``) exactly once for
   every microbatch, and every send has exactly one matching receive and the other way round.
3. The simulated clock: ranks execute their actions in order; a compute waits until its input has
   been sent (non-blocking sends, posted receives, as the runtime does). If some rank can never
   continue the schedule deadlocks; otherwise the clock gives the makespan and the bubble (the
   fraction of rank time spent idle). Peak activations count, per rank, the microbatches whose
   forward ran and whose backward has not finished (``B``, or ``W`` after a split backward): what
   the runtime must keep in memory at once.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ._actions import Action, Op
from ._schedule import Schedule, ScheduleError

__all__ = ["Costs", "Report", "ScheduleError", "verify", "simulate"]


@dataclass(frozen=True)
class Costs:
    """Simulated durations: forward, input gradient, weight gradient (a full backward is both),
    and the latency of one transfer."""

    forward: float = 1.0
    backward_input: float = 1.0
    backward_weight: float = 1.0
    comm: float = 0.0

    def __post_init__(self) -> None:
        for name in ("forward", "backward_input", "backward_weight", "comm"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or v < 0 or v != v:
                raise ValueError(f"Costs: {name} must be a non-negative number, got {v!r}")

    def of(self, op: Op) -> float:
        if op is Op.FORWARD:
            return self.forward
        if op is Op.BACKWARD:
            return self.backward_input + self.backward_weight
        if op is Op.BACKWARD_INPUT:
            return self.backward_input
        if op is Op.BACKWARD_WEIGHT:
            return self.backward_weight
        return 0.0


@dataclass(frozen=True)
class Report:
    """What ``verify`` found.

    Attributes:
        ok: no errors.
        errors: one line per problem, naming rank, step and action.
        peak_activations: per rank, the most microbatches stashed at once.
        bubble: idle fraction of all ranks' time on the simulated clock (nan after a deadlock).
        makespan: simulated duration of the step.
        busy: per rank, simulated compute time.
        schedule: the schedule that was simulated (with its send/receive actions).
        marks: ``{rank: step}`` where a rank got stuck or first went wrong.
        timeline: per rank, ``(action, start, end)`` of each compute action that ran.
    """

    ok: bool
    errors: tuple[str, ...]
    peak_activations: tuple[int, ...]
    bubble: float
    makespan: float
    busy: tuple[float, ...]
    schedule: Schedule
    costs: Costs = field(default_factory=Costs)
    marks: dict[int, int] = field(default_factory=dict)
    timeline: tuple[tuple[tuple[Action, float, float], ...], ...] = ()

    def __bool__(self) -> bool:
        return self.ok

    def raise_for_errors(self) -> None:
        """Raise ``ScheduleError`` with the report when the schedule is wrong."""
        if not self.ok:
            raise ScheduleError(str(self))

    def __str__(self) -> str:
        s, c = self.schedule, self.costs
        lines = [f"verify {s.name} stages={s.stages} microbatches={s.microbatches} "
                 f"virtual={s.virtual}: {'ok' if self.ok else f'{len(self.errors)} error(s)'}",
                 f"peak activations per rank: {list(self.peak_activations)}",
                 f"bubble: {self.bubble:.4f} (makespan {self.makespan:g} with F={c.forward:g} "
                 f"I={c.backward_input:g} W={c.backward_weight:g} comm={c.comm:g})"]
        if not self.ok:
            lines += [f"  {e}" for e in self.errors]
            lines.append(s.format(self.marks))
        return "\n".join(lines)


def verify(schedule: Schedule, *, costs: Costs | None = None) -> Report:
    """Check ``schedule`` without running it; see the module docstring for what is checked.

    Args:
        schedule: compute-only (lowered first, as the runtime does) or with send/receive actions.
        costs: simulated durations (default: every compute 1, transfers free).
    """
    if not isinstance(schedule, Schedule):
        raise TypeError(f"verify: expected a Schedule, got {type(schedule).__name__}")
    costs = costs or Costs()
    s = schedule.with_comms()
    errors: list[str] = []
    marks: dict[int, int] = {}
    _check_order(s, errors, marks)
    _check_complete(s, errors)
    sim = simulate(s, costs)
    if sim.stuck:
        errors.append("deadlock: " + "; ".join(sim.stuck_reasons))
        for r, i in sim.stuck.items():
            marks.setdefault(r, i)
    return Report(ok=not errors, errors=tuple(errors), peak_activations=peak_activations(s),
                  bubble=sim.bubble, makespan=sim.makespan, busy=tuple(sim.busy), schedule=s,
                  costs=costs, marks=marks, timeline=sim.timeline)


def peak_activations(s: Schedule) -> tuple[int, ...]:
    """Per rank, the most microbatches whose forward ran and whose backward has not finished."""
    peaks = []
    for row in s.actions:
        live = peak = 0
        for a in row:
            if a.op is Op.FORWARD:
                live += 1
                peak = max(peak, live)
            elif a.op in (Op.BACKWARD, Op.BACKWARD_WEIGHT):
                live -= 1
        peaks.append(peak)
    return tuple(peaks)


# -- checks ---------------------------------------------------------------------------------------
def _check_order(s: Schedule, errors: list[str], marks: dict[int, int]) -> None:
    last = s.n_stages - 1
    for r, row in enumerate(s.actions):
        seen: set[Action] = set()

        def bad(i: int, msg: str) -> None:
            errors.append(f"rank {r} step {i}: {msg}")
            marks.setdefault(r, i)

        for i, a in enumerate(row):
            k, mb = a.stage, a.mb
            if a in seen and a.op not in (Op.RECV_F, Op.RECV_B):
                bad(i, f"{a} runs twice")
            if a.op in (Op.BACKWARD, Op.BACKWARD_INPUT) and Action(k, Op.FORWARD, mb) not in seen:
                bad(i, f"backward {a} before its forward {k}F{mb}")
            elif a.op is Op.BACKWARD_WEIGHT and Action(k, Op.BACKWARD_INPUT, mb) not in seen:
                bad(i, f"weight gradient {a} before its input gradient {k}I{mb}")
            elif a.op is Op.SEND_F and Action(k, Op.FORWARD, mb) not in seen:
                bad(i, f"{a} sends an activation its forward {k}F{mb} has not computed")
            elif a.op is Op.SEND_B and not ({Action(k, Op.BACKWARD, mb),
                                              Action(k, Op.BACKWARD_INPUT, mb)} & seen):
                bad(i, f"{a} sends a gradient its backward has not computed")
            elif a.op in (Op.RECV_F, Op.RECV_B) and a in seen:
                bad(i, f"{a} posts the same receive twice")
            if a.op in (Op.SEND_F, Op.RECV_B) and k == last:
                bad(i, f"{a}: the last stage has no next stage")
            if a.op in (Op.SEND_B, Op.RECV_F) and k == 0:
                bad(i, f"{a}: stage 0 has no previous stage")
            if a.op in (Op.SEND_F, Op.SEND_B, Op.RECV_F, Op.RECV_B) and s.stages == 1:
                bad(i, f"{a}: with one rank every stage is local, nothing is sent")
            need = s.needs_recv(a) if a.is_compute else None
            if need is not None and need not in seen:
                bad(i, f"{a} consumes a transfer whose receive {need} was never posted before it")
            seen.add(a)


def _check_complete(s: Schedule, errors: list[str]) -> None:
    counts = Counter(a for row in s.actions for a in row)
    for k in range(s.n_stages):
        r = s.rank_of(k)
        for mb in range(s.microbatches):
            f = counts[Action(k, Op.FORWARD, mb)]
            b = counts[Action(k, Op.BACKWARD, mb)]
            i = counts[Action(k, Op.BACKWARD_INPUT, mb)]
            w = counts[Action(k, Op.BACKWARD_WEIGHT, mb)]
            where = f"stage {k} (rank {r}) microbatch {mb}"
            if f == 0:
                errors.append(f"{where}: missing microbatch: no forward")
            if b == 0 and i == 0:
                errors.append(f"{where}: missing microbatch: no backward")
            elif b and i:
                errors.append(f"{where}: both a full backward and an input gradient")
            elif i and w == 0:
                errors.append(f"{where}: input gradient {k}I{mb} without its weight gradient")
            elif b and w:
                errors.append(f"{where}: a weight gradient after a full backward")
    sends = Counter()
    recvs = Counter()
    for row in s.actions:
        for a in row:
            if a.op is Op.SEND_F:
                sends[("activation", a.stage + 1, a.mb)] += 1
            elif a.op is Op.SEND_B:
                sends[("gradient", a.stage - 1, a.mb)] += 1
            elif a.op is Op.RECV_F:
                recvs[("activation", a.stage, a.mb)] += 1
            elif a.op is Op.RECV_B:
                recvs[("gradient", a.stage, a.mb)] += 1
    for key in sorted(set(sends) | set(recvs)):
        what, k, mb = key
        if sends[key] and not recvs[key]:
            errors.append(f"the {what} for stage {k} microbatch {mb} is sent but rank "
                          f"{s.rank_of(k)} never posts its receive")
        elif recvs[key] and not sends[key]:
            errors.append(f"rank {s.rank_of(k)} posts a receive of the {what} for stage {k} "
                          f"microbatch {mb} that no rank sends (it would wait forever)")


# -- the simulated clock ------------------------------------------------------------------------
@dataclass
class Simulation:
    """Result of :func:`simulate`."""

    makespan: float
    busy: list[float]
    bubble: float
    timeline: tuple[tuple[tuple[Action, float, float], ...], ...]
    stuck: dict[int, int]            # rank -> index of the action it cannot run
    stuck_reasons: list[str]


def _input_key(s: Schedule, a: Action) -> tuple[str, int, int] | None:
    """What compute ``a`` waits for: ("act", producer stage, mb) or ("grad", producer stage, mb)."""
    if a.op is Op.FORWARD and a.stage > 0:
        return ("act", a.stage - 1, a.mb)
    if a.op in (Op.BACKWARD, Op.BACKWARD_INPUT) and a.stage < s.n_stages - 1:
        return ("grad", a.stage + 1, a.mb)
    return None


def simulate(s: Schedule, costs: Costs | None = None) -> Simulation:
    """Run ``s`` (with comms, or with one rank) on a simulated clock."""
    costs = costs or Costs()
    p = s.stages
    ptr = [0] * p
    clock = [0.0] * p
    busy = [0.0] * p
    ready: dict[tuple[str, int, int], float] = {}
    timeline: list[list[tuple[Action, float, float]]] = [[] for _ in range(p)]
    local = p == 1
    progress = True
    while progress:
        progress = False
        for r in range(p):
            row = s.actions[r]
            while ptr[r] < len(row):
                a = row[ptr[r]]
                t = clock[r]
                if a.is_compute:
                    key = _input_key(s, a)
                    if key is not None:
                        if key not in ready:
                            break
                        t = max(t, ready[key])
                    end = t + costs.of(a.op)
                    timeline[r].append((a, t, end))
                    busy[r] += end - t
                    clock[r] = end
                    if local:  # the consumer runs on this rank: no send action
                        if a.op is Op.FORWARD:
                            ready[("act", a.stage, a.mb)] = end
                        elif a.op in (Op.BACKWARD, Op.BACKWARD_INPUT):
                            ready[("grad", a.stage, a.mb)] = end
                elif a.op is Op.SEND_F:
                    ready.setdefault(("act", a.stage, a.mb), t + costs.comm)
                elif a.op is Op.SEND_B:
                    ready.setdefault(("grad", a.stage, a.mb), t + costs.comm)
                ptr[r] += 1
                progress = True
    stuck = {r: ptr[r] for r in range(p) if ptr[r] < len(s.actions[r])}
    reasons = [_why_stuck(s, r, i, stuck) for r, i in stuck.items()]
    makespan = max(clock) if clock else 0.0
    if stuck or makespan <= 0:
        bubble = float("nan") if stuck else 0.0
    else:
        bubble = 1.0 - sum(busy) / (p * makespan)
    return Simulation(makespan, busy, bubble, tuple(tuple(t) for t in timeline), stuck, reasons)


def _why_stuck(s: Schedule, r: int, i: int, stuck: dict[int, int]) -> str:
    a = s.actions[r][i]
    what, k, mb = _input_key(s, a)  # a blocked action always waits for an input
    src = s.rank_of(k)
    noun = "activation" if what == "act" else "gradient"
    send = Action(k, Op.SEND_F if what == "act" else Op.SEND_B, mb)
    if src == r and s.stages == 1:
        send = Action(k, Op.FORWARD if what == "act" else Op.BACKWARD, mb)
    row = s.actions[src]
    where = [j for j, b in enumerate(row) if b == send or (s.stages == 1 and b.stage == k
                                                          and b.mb == mb and b.is_compute)]
    if not where:
        tail = f"which rank {src} never sends"
    elif src in stuck:
        tail = (f"which rank {src} sends at its step {where[0]}, but rank {src} is itself stuck "
                f"at step {stuck[src]} ({s.actions[src][stuck[src]]})")
    else:
        tail = f"from rank {src}"
    return f"rank {r} step {i}: {a} waits for the {noun} of stage {k} microbatch {mb} {tail}"

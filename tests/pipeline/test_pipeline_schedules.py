"""Pipeline schedules as data: built-ins, text round trip, and the verifier (no ranks needed)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import hpcdp.pipeline as pp
from hpcdp.pipeline import Action, Costs, Op, Schedule, ScheduleError, verify
from hpcdp.pipeline._actions import B, F, I, W

PS = (1, 2, 3, 4, 5)
MS = (1, 2, 3, 4, 8, 13)


def _variants() -> list[tuple[str, int]]:
    return [("gpipe", 1), ("1f1b", 1), ("zero_bubble", 1),
            ("interleaved_1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 3)]


@pytest.mark.parametrize("name,v", _variants())
def test_builtins_verify_and_round_trip(name: str, v: int) -> None:
    for p in PS:
        for m in MS:
            s = pp.schedule(name, stages=p, microbatches=m, virtual=v)
            assert (s.stages, s.microbatches, s.virtual, s.name) == (p, m, v, name)
            report = verify(s)
            assert report.ok, str(report)
            assert Schedule.parse(str(s)) == s
            lowered = s.with_comms()
            assert Schedule.parse(str(lowered)) == lowered
            assert lowered.compute_only() == s
            assert verify(lowered).ok


def test_peak_activations_per_schedule() -> None:
    for p in PS:
        for m in MS:
            assert verify(pp.schedule("gpipe", p, m)).peak_activations == (m,) * p
            assert verify(pp.schedule("1f1b", p, m)).peak_activations == tuple(
                min(p - r, m) for r in range(p))
            # ZB-H1 holds back r weight gradients on rank r: min(p, m) on every rank
            assert verify(pp.schedule("zero_bubble", p, m)).peak_activations == (min(p, m),) * p


def test_bubbles_match_theory() -> None:
    costs = Costs(forward=1.0, backward_input=1.0, backward_weight=1.0)   # t_b = 2 t_f
    for p in (2, 3, 4, 6):
        for m in (p, 2 * p, 8, 16):
            gp = verify(pp.schedule("gpipe", p, m), costs=costs)
            ob = verify(pp.schedule("1f1b", p, m), costs=costs)
            ideal = (m + p - 1) * 3.0
            assert gp.makespan == ob.makespan == ideal
            assert gp.bubble == pytest.approx((p - 1) / (m + p - 1))
            assert ob.bubble == pytest.approx((p - 1) / (m + p - 1))
            zb = verify(pp.schedule("zero_bubble", p, m), costs=costs)
            # (p - 1)(t_F + t_I - t_W) idle per rank instead of 1F1B's (p - 1)(t_F + t_I + t_W)
            assert zb.makespan == 3 * m + (p - 1)
            assert zb.bubble == pytest.approx((p - 1) / (3 * m + p - 1))
            for v in (2, 3):
                if m % p == 0:
                    il = verify(pp.schedule("interleaved_1f1b", p, m, v), costs=costs)
                    assert il.bubble == pytest.approx((p - 1) / (v * m + p - 1))
    # other costs: the bubble of gpipe/1f1b does not depend on t_f/t_b, ZB-H1's does
    c2 = Costs(forward=1.0, backward_input=1.5, backward_weight=0.5)
    for p, m in ((4, 8), (3, 9)):
        assert verify(pp.schedule("1f1b", p, m), costs=c2).bubble == pytest.approx((p - 1) / (m + p - 1))
        zb = verify(pp.schedule("zero_bubble", p, m), costs=c2)
        idle = (p - 1) * (1.0 + 1.5 - 0.5)
        assert zb.bubble == pytest.approx(idle / (m * 3.0 + idle))


def test_printed_grid_and_actions() -> None:
    s = pp.schedule("1f1b", stages=2, microbatches=3)
    text = str(s)
    assert text.splitlines()[0] == "schedule 1f1b stages=2 microbatches=3 virtual=1"
    assert text.splitlines()[1].split() == ["step", "rank0", "rank1"]
    assert [ln.split()[1:] for ln in text.splitlines()[2:]] == [
        ["0F0", "1F0"], ["0F1", "1B0"], ["0B0", "1F1"], ["0F2", "1B1"], ["0B1", "1F2"], ["0B2", "1B2"]]
    for op in Op:
        a = Action(12, op, 7)
        assert Action.parse(str(a)) == a
    assert str(pp.schedule("zero_bubble", 2, 2).actions[1][1]) == "1I0"
    lowered = str(pp.schedule("gpipe", 2, 1).with_comms())
    assert "0SEND_F0" in lowered and "1RECV_F0" in lowered and "1SEND_B0" in lowered
    assert "0RECV_B0" in lowered


@pytest.mark.parametrize("text,needle", [
    ("", "empty"),
    ("schedule x stages=2 microbatches=1\nstep rank0 rank1\n", "expected 'schedule"),
    ("schedule x stages=2 microbatches=1 virtual=1\nstep rank0\n", "column header"),
    ("schedule x stages=1 microbatches=1 virtual=1\nstep rank0\n 0 0X0\n", "not a pipeline action"),
    ("schedule x stages=1 microbatches=1 virtual=1\nstep rank0\n 1 0F0\n", "expected step 0"),
    ("schedule x stages=2 microbatches=2 virtual=1\nstep rank0 rank1\n0 0F0 .\n1 0B0 1F0\n",
     "after an empty cell"),
    ("schedule x stages=2 microbatches=1 virtual=1\nstep rank0 rank1\n0 1F0 0F0\n", "belongs to rank"),
    ("schedule x stages=1 microbatches=1 virtual=1\nstep rank0\n0 0F3\n", "microbatch 3"),
])
def test_parse_rejects_bad_text(text: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        Schedule.parse(text)


def _custom(rows: list[list[str]], m: int) -> Schedule:
    return Schedule.from_lists(rows, m)


def test_verifier_finds_a_deadlock() -> None:
    # rank 0 waits for microbatch 0's gradient while rank 1 waits for microbatch 1's activation,
    # which rank 0 only sends after that gradient arrived
    s = _custom([["0F0", "0B0", "0F1", "0B1"], ["1F1", "1B1", "1F0", "1B0"]], 2)
    r = verify(s)
    assert not r.ok and not r
    text = "\n".join(r.errors)
    assert "deadlock" in text
    assert "rank 0 step" in text and "rank 1 step" in text and "stuck" in text
    assert r.bubble != r.bubble   # nan: no makespan after a deadlock
    shown = str(r)
    assert ">" in shown and "deadlock" in shown
    # the arrow points at each stuck rank's action in the lowered grid
    marked = {ln.split(">")[1].split()[0] for ln in shown.splitlines() if ">" in ln and "step" not in ln}
    assert marked == {"0B0", "1F1"}
    with pytest.raises(ScheduleError, match="deadlock"):
        r.raise_for_errors()


def test_verifier_finds_backward_before_forward() -> None:
    r = verify(_custom([["0F0", "0B1", "0F1", "0B0"], ["1F0", "1B0", "1F1", "1B1"]], 2))
    assert not r.ok
    assert any("backward 0B1 before its forward 0F1" in e for e in r.errors), r.errors
    r = verify(_custom([["0F0", "0W0", "0I0"], ["1F0", "1I0", "1W0"]], 1))
    assert any("weight gradient 0W0 before its input gradient" in e for e in r.errors), r.errors


def test_verifier_finds_a_missing_microbatch() -> None:
    full = pp.schedule("1f1b", 3, 4)
    rows = [list(r) for r in full.actions]
    rows[1] = [a for a in rows[1] if a.mb != 2]            # stage 1 forgets microbatch 2
    r = verify(Schedule.from_lists(rows, 4))
    assert not r.ok
    assert any("stage 1 (rank 1) microbatch 2: missing microbatch: no forward" in e for e in r.errors)
    assert any("no backward" in e for e in r.errors)
    rows = [list(r) for r in pp.schedule("zero_bubble", 2, 2).actions]
    rows[0] = [a for a in rows[0] if a != W(0, 1)]          # an input gradient without its weight part
    r = verify(Schedule.from_lists(rows, 2))
    assert any("without its weight gradient" in e for e in r.errors), r.errors


def test_verifier_checks_transfers() -> None:
    good = pp.schedule("gpipe", 2, 2).with_comms()
    rows = [list(r) for r in good.actions]
    rows[1] = [a for a in rows[1] if a != Action(1, Op.RECV_F, 1)]   # never posts a receive
    r = verify(Schedule.from_lists(rows, 2))
    assert any("sent but rank 1 never posts its receive" in e for e in r.errors), r.errors
    assert any("never posted before it" in e for e in r.errors), r.errors
    rows = [list(r) for r in good.actions]
    rows[0] = [a for a in rows[0] if a != Action(0, Op.SEND_F, 0)]   # never sends
    r = verify(Schedule.from_lists(rows, 2))
    assert any("that no rank sends" in e for e in r.errors), r.errors
    assert any("deadlock" in e for e in r.errors)


def test_verifier_rejects_duplicates_and_mixed_backward() -> None:
    r = verify(_custom([["0F0", "0F0", "0B0"]], 1))
    assert any("runs twice" in e for e in r.errors)
    r = verify(Schedule.from_lists([[F(0, 0), B(0, 0), I(0, 0), W(0, 0)]], 1))
    assert any("both a full backward and an input gradient" in e for e in r.errors)


def test_schedule_argument_checks() -> None:
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        pp.schedule("nope", 2, 2)
    with pytest.raises(ValueError, match="virtual"):
        pp.schedule("1f1b", 2, 2, virtual=2)
    with pytest.raises(ValueError, match="microbatches"):
        pp.schedule("gpipe", 2, 0)
    with pytest.raises(ValueError, match="belongs to rank"):
        Schedule.from_lists([["1F0"], ["0F0"]], 1)
    with pytest.raises(ValueError, match="Costs"):
        Costs(forward=-1)


def test_register_schedule() -> None:
    def reversed_gpipe(p: int, m: int, v: int) -> Schedule:
        rows = [[F(r, k) for k in range(m)] + [B(r, k) for k in reversed(range(m))] for r in range(p)]
        return Schedule.from_lists(rows, m, v, "rgpipe")

    pp.register_schedule("rgpipe", reversed_gpipe)
    try:
        s = pp.schedule("rgpipe", 3, 4)
        assert verify(s).ok and s.actions[0][4] == B(0, 3)
        assert "rgpipe" in pp.available_schedules()
    finally:
        from hpcdp.pipeline import _builtin

        _builtin._REGISTRY.pop("rgpipe", None)


def test_balanced_split() -> None:
    assert pp.balanced_split([10, 0, 10, 0, 10, 0, 10], 4) == [1, 3, 5]
    assert pp.balanced_split([1, 1, 1, 1], 4) == [1, 2, 3]
    assert pp.balanced_split([100, 1, 1, 1, 1], 2) == [1]
    assert pp.balanced_split([5, 5], 1) == []
    with pytest.raises(ValueError):
        pp.balanced_split([1, 2], 3)


def test_interleaved_any_microbatch_count() -> None:
    # m not a multiple of p: the last round is short and some ranks need a longer warm-up
    for p in (3, 4, 5, 6):
        for m in (1, 2, 5, 6, 7, 9, 11, 13, 14):
            for v in (2, 3, 4):
                report = verify(pp.schedule("interleaved_1f1b", p, m, v))
                assert report.ok, str(report)


# -- declared sizes are bounded by the actions present (issue 20, item 2) ----------------------------
_SIZES_SCRIPT = textwrap.dedent("""
    import json, resource, sys
    # At most 512 MiB beyond what is mapped now: building 10^9 of anything fails at once.
    with open("/proc/self/status") as fh:
        vm = next(int(l.split()[1]) * 1024 for l in fh if l.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20), resource.RLIM_INFINITY))
    from hpcdp.pipeline import Schedule, ScheduleError, verify
    out = []
    for case in json.loads(sys.argv[1]):
        try:
            if case["kind"] == "text":
                verify(Schedule.parse(case["text"]))
            else:
                verify(Schedule.from_lists(case["rows"], case["m"], case["v"]))
            out.append(["accepted", ""])
        except ScheduleError as exc:
            out.append(["ScheduleError", str(exc)])
        except Exception as exc:  # MemoryError included: reported, not fatal
            out.append([type(exc).__name__, str(exc)[:300]])
    print(json.dumps(out))
""")

_HUGE = [
    ({"kind": "text", "text": "schedule x stages=1000000000 microbatches=1 virtual=1\nstep rank0\n"},
     "stages=1000000000"),
    ({"kind": "text", "text": "schedule x stages=1 microbatches=1000000000 virtual=1\n"
                              "step rank0\n0 0F0\n1 0B0\n"}, "microbatches=1000000000"),
    ({"kind": "text", "text": "schedule x stages=1 microbatches=1 virtual=1000000000\n"
                              "step rank0\n0 0F0\n1 0B0\n"}, "virtual=1000000000"),
    ({"kind": "text", "text": "schedule x stages=2 microbatches=" + "9" * 5000 + " virtual=1\n"
                              "step rank0 rank1\n"}, "microbatches"),
    ({"kind": "rows", "rows": [["0F0", "0B0"]], "m": 10**9, "v": 1}, "microbatches=1000000000"),
    ({"kind": "rows", "rows": [["0F0", "0B0"], ["1F0", "1B0"]], "m": 3, "v": 10**8},
     "virtual=100000000"),
]


@pytest.mark.timeout(120)
def test_huge_declared_sizes_raise_schedule_error() -> None:
    """A few bytes of text cannot make ``parse`` or ``verify`` allocate per declared stage or
    microbatch: each case fails fast with ``ScheduleError`` naming the number that is too large
    (run under a memory cap, in a subprocess with a wall-clock cap)."""
    cases = [c for c, _ in _HUGE]
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _SIZES_SCRIPT, json.dumps(cases)], env=env,
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for (case, needle), (kind, msg) in zip(_HUGE, got):
        assert kind == "ScheduleError", (case, kind, msg)
        assert needle in msg and "too large" in msg, (case, msg)


def test_declared_sizes_within_the_actions_still_verify() -> None:
    """The bound leaves room for incomplete schedules, so ``verify`` can still say what is missing."""
    r = verify(Schedule.from_lists([["0F0", "0B0", "0F1"], ["1F0", "1B0"]], 2))
    assert not r.ok and any("microbatch 1: missing microbatch: no backward" in e for e in r.errors)
    with pytest.raises(ScheduleError, match="microbatches=5 is too large"):
        Schedule.from_lists([["0F0", "0B0"], ["1F0", "1B0"]], 5)

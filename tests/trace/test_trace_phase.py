"""``hooks.Phase``: a repeated phase (DDP's backward) recorded as one timeline entry must write
exactly the events ``span``/``instant``/``step`` would, pin the source line as ``pinned_line``
does, and cost nothing when tracing is off."""
from __future__ import annotations

import json
import os
import sys
import threading

import numpy as np
import pytest

from hpcdp import trace
from hpcdp.trace import hooks
from hpcdp.trace import _steps
from hpcdp.trace._recorder import Recorder

HERE = os.path.abspath(__file__)


@pytest.fixture(autouse=True)
def fresh():
    trace.reset()
    yield
    trace.disable()
    trace.reset()


def _phase() -> hooks.Phase:
    return hooks.Phase("backward", "ddp", args=("sync",), inner="wait gradients",
                       mark="bucket ready", mark_args=("bucket", "bytes", "in_flight"))


def _events(path) -> list[dict]:
    with open(path) as fh:
        return [e for e in json.load(fh)["traceEvents"] if e["ph"] != "M"]


def _within(e: dict, outer: dict) -> bool:
    return outer["ts"] <= e["ts"] and e["ts"] + e.get("dur", 0) <= outer["ts"] + outer["dur"]


VALUES = [True, 1, False, 0, None, "a%sb", 2.5, -0.0, 2 ** 70, np.int64(3)]


def test_phase_writes_the_events_span_instant_and_step_would(tmp_path) -> None:
    trace.enable(tmp_path)
    ph = _phase()
    for _ in range(2):  # the second round reads the texts the first kept
        for v in VALUES:
            with ph(v):
                ph.mark(0, 1 << 40, 1)
                ph.mark(1, v, 2)
                with ph.inner:
                    ph.step()
    with ph(True):  # no inner span, no marks
        pass
    with pytest.raises(KeyError):  # an error inside the inner span: both spans say so
        with ph(True):
            with ph.inner:
                raise KeyError("x")
    with pytest.raises(ValueError):  # after it: only the outer one
        with ph(False):
            with ph.inner:
                pass
            raise ValueError("y")
    tl = trace.timeline()
    entries = [e for e in tl._buf if len(e) == 10]
    assert len(entries) == 2 * len(VALUES) + 3
    for ev in entries:  # the kept texts are the general path's, event for event
        assert ev[0]._text(tl, ev) == tl._render(ev[0]._events(ev))
    trace.disable()
    evs = _events(tmp_path / "trace-rank0.json")
    blocks = [evs[i:i + 5] for i in range(0, 5 * 2 * len(VALUES), 5)]
    for k, (m0, m1, step, wait, bw) in enumerate(blocks):
        v = VALUES[k % len(VALUES)]
        want = json.loads(json.dumps(v, default=str))  # (what ``span`` writes: np.int64 as text)
        assert [e["name"] for e in (m0, m1, step, wait, bw)] == [
            "bucket ready", "bucket ready", "step", "wait gradients", "backward"]
        assert m0["args"] == {"bucket": 0, "bytes": 1 << 40, "in_flight": 1} and m0["ph"] == "i"
        assert m1["args"] == {"bucket": 1, "bytes": want, "in_flight": 2} and m1["s"] == "t"
        assert step["cat"] == "step" and step["ph"] == "i" and "args" not in step
        assert wait["ph"] == "X" and "args" not in wait and wait["cat"] == "ddp"
        assert bw["args"] == {"sync": want} and bw["cat"] == "ddp"
        # == cannot tell True from 1: the re-encoded texts can
        assert json.dumps(bw["args"]) == json.dumps({"sync": want})
        assert all(_within(e, bw) for e in (m0, m1, step, wait)) and _within(step, wait)
    rest = [(e["name"], e.get("args")) for e in evs[5 * 2 * len(VALUES):]]
    assert rest == [("backward", {"sync": True}),
                    ("wait gradients", {"error": "KeyError"}),
                    ("backward", {"sync": True, "error": "KeyError"}),
                    ("wait gradients", None), ("backward", {"sync": False, "error": "ValueError"})], rest


def test_phase_before_the_epoch_takes_the_general_path(tmp_path) -> None:
    trace.enable(tmp_path)
    ph = _phase()
    with ph(True):
        ph.mark(0, 8, 1)
        with ph.inner:
            pass
    tl = trace.timeline()
    (ev,) = [e for e in tl._buf if len(e) == 10]
    tl.epoch_ns = ev[2] + 1_000_000  # the timeline began after the phase ended
    text = ev[0]._text(tl, ev)
    assert text == tl._render(ev[0]._events(ev)) and '"ts":-1' in text


def test_marks_and_steps_outside_the_phase_are_plain_events(tmp_path) -> None:
    trace.enable(tmp_path)
    ph = _phase()
    seen = []
    obs = _steps.on_step(lambda: seen.append(1) or "report")
    try:
        ph.mark(5, 64, 1)  # not timed: an ordinary instant
        assert ph.step() == "report" and seen == [1]  # the mark and the observers
        with ph(True):
            t = threading.Thread(target=ph.mark, args=(6, 32, 2), name="other")
            t.start()
            t.join()
            assert ph.step() == "report" and seen == [1, 1]
    finally:
        _steps._observers.remove(obs)
    trace.disable()
    evs = _events(tmp_path / "trace-rank0.json")
    by = {(e["name"], e.get("args", {}).get("bucket")): e for e in evs}
    assert by[("bucket ready", 5)]["args"] == {"bucket": 5, "bytes": 64, "in_flight": 1}
    other, bw = by[("bucket ready", 6)], by[("backward", None)]
    assert other["tid"] != bw["tid"] and _within(other, bw)  # the marking thread's own track
    assert [e["name"] for e in evs].count("step") == 2


def test_phase_pins_the_line_like_pinned_line() -> None:
    rec = Recorder(0, 8, lines=True)
    ph = _phase()

    def deep(n: int) -> int:
        return deep(n - 1) if n else rec.begin("allreduce", "world", 1)

    trace.configure(lines=True)
    pin = sys._getframe().f_lineno + 1
    with ph(True):
        rec.end(deep(4))
        with hooks.pinned_line():  # nested: the outer call stays the user's line
            rec.end(deep(2))
    rec.end(deep(1))
    trace.configure(lines=False)
    with ph(True):  # lines off: nothing pinned, the operation's own caller as before
        rec.end(deep(3))
    inner = deep.__code__.co_firstlineno + 1
    lines = [o.line for o in rec.snapshot()]
    assert lines[0].startswith(f"{HERE}:{pin} ") and lines[1].startswith(f"{HERE}:{pin} "), lines
    assert lines[2].startswith(f"{HERE}:{inner} (deep)") and lines[3].startswith(f"{HERE}:{inner} "), lines


def test_phase_pins_each_steps_own_call_site() -> None:
    # pin_line remembers the stack it walked last (each training step repeats it): a call from
    # another line, from another function, or from a frame hidden since must each still pin
    # the user's own line, and the same site the same entry.
    rec = Recorder(0, 32, lines=True)
    ph = _phase()
    ns = {"ph": ph, "rec": rec}
    # a layer's method running the phase, as DDP.backward does: code of a file inside hpcdp
    exec(compile("def run():\n    with ph(True):\n        rec.end(rec.begin('allreduce', 'world', 1))\n",
                 os.path.join(os.path.dirname(os.path.abspath(trace.__file__)), "_layer.py"), "exec"), ns)
    run = ns["run"]

    def helper() -> int:
        run(); return sys._getframe().f_lineno  # noqa: E702

    def caller() -> int:
        return helper()

    trace.configure(lines=True)
    want: list[tuple[str, int]] = []
    for _ in range(2):
        run(); want.append(("test_phase_pins_each_steps_own_call_site", sys._getframe().f_lineno))  # noqa: E702
        run(); want.append(("test_phase_pins_each_steps_own_call_site", sys._getframe().f_lineno))  # noqa: E702
        want.append(("helper", helper()))
        want.append(("helper", caller()))
    hooks.hide_frames(helper)  # hidden since the last walk: the pin moves to helper's caller
    helper(); want.append(("test_phase_pins_each_steps_own_call_site", sys._getframe().f_lineno))  # noqa: E702
    caller()
    want.append(("caller", caller.__code__.co_firstlineno + 1))
    run(); want.append(("test_phase_pins_each_steps_own_call_site", sys._getframe().f_lineno))  # noqa: E702
    trace.configure(lines=False)
    ops = rec.snapshot()
    got = [(o.where[0].co_name, o.where[1]) for o in ops]
    assert got == want
    assert all(o.line.startswith(f"{HERE}:") for o in ops)
    assert ops[0].where is ops[4].where and ops[2].where is ops[6].where  # one site, one entry


def test_phase_does_nothing_when_tracing_is_off(tmp_path) -> None:
    ph = _phase()
    with ph(True):
        ph.mark(0, 8, 1)
        with ph.inner:
            assert ph.step() is None
    assert ph._h is None and not ph._marks and not trace.enabled()
    assert not os.listdir(tmp_path)


def test_sim_ddp_ranks_trace_their_backward(tmp_path) -> None:
    """Sim ranks (threads) each trace DDP's backward on their own timeline, the bucket allreduce
    named by the user's backward call (TCP and MPI: test_trace_wiring's job)."""
    import hpcdp
    from hpcdp import nn

    trace.enable(tmp_path)
    line = {}

    def body(rank: int) -> None:
        hooks.install(rank, 2)
        ddp = hpcdp.DDP(nn.Sequential(nn.Linear(4, 8, seed=0), nn.ReLU(), nn.Linear(8, 2, seed=1)))
        x = np.ones((3, 4), np.float32)
        for _ in range(3):
            out = ddp(x)
            line[rank] = sys._getframe().f_lineno + 1
            ddp.backward(np.ones_like(out))

    hpcdp.spawn(body, 2, timeout=30, join_timeout=60)
    trace.disable()
    for r in range(2):
        evs = _events(tmp_path / f"trace-rank{r}.json")
        bws = [e for e in evs if e["name"] == "backward"]
        assert len(bws) == 3 and all(e["args"] == {"sync": True} and e["pid"] == r for e in bws)
        for name in ("wait gradients", "step", "bucket ready"):
            got = [e for e in evs if e["name"] == name]
            assert len(got) >= 3 and all(any(_within(e, b) for b in bws) for e in got), (name, got)
        ars = [e for e in evs if e["name"] == "allreduce" and e.get("cat") == "collective"]
        assert len(ars) >= 3 and all(e["args"]["line"].startswith(f"{HERE}:{line[r]} (body)")
                                     for e in ars if any(_within(e, b) for b in bws)), ars


def test_a_dump_inside_a_phase_writes_its_marks_so_far(tmp_path) -> None:
    """A rank stuck inside DDP's backward (a bucket allreduce that never completes) dumps its
    flight record: the timeline then holds the bucket marks made so far, as ``instant`` wrote
    them at once, and the phase's entry does not write them a second time when it ends."""
    trace.enable(tmp_path / "tl")
    ph = _phase()
    with ph(True):
        ph.mark(0, 100, 1)
        ph.mark(1, 200, 2)
        trace.dump("stuck", directory=tmp_path / "fr")
        with open(tmp_path / "tl" / "trace-rank0.json") as fh:   # the file so far: no closing
            text = fh.read()
        assert text.count('"bucket ready"') == 2 and '"backward"' not in text, text
        ph.mark(2, 300, 3)
        with ph.inner:
            ph.step()
    trace.disable()
    evs = _events(tmp_path / "tl" / "trace-rank0.json")
    marks = [e["args"]["bucket"] for e in evs if e["name"] == "bucket ready"]
    assert marks == [0, 1, 2], marks                          # each once, in order
    assert [e["name"] for e in evs].count("backward") == 1
    assert [e["name"] for e in evs].count("step") == 1


def test_a_dump_between_a_marks_time_and_values_writes_whole_marks_only(tmp_path) -> None:
    """A dump at a signal may land while a mark is half recorded (its time kept, its values not
    yet): it writes the whole marks before it, and the half one is written once, with the entry."""
    trace.enable(tmp_path / "tl")
    ph = _phase()
    with ph(True):
        ph.mark(0, 100, 1)
        ph._marks.append(ph._marks[0] + 1)  # a time without its values yet
        trace.dump("signal", directory=tmp_path / "fr")
        ph._marks.append((1, 200, 2))                              # ... and its values
        with ph.inner:
            ph.step()
    trace.disable()
    evs = _events(tmp_path / "tl" / "trace-rank0.json")
    marks = [e["args"]["bucket"] for e in evs if e["name"] == "bucket ready"]
    assert marks == [0, 1], marks
    assert [e["name"] for e in evs].count("step") == 1

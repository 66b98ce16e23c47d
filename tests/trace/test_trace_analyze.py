"""``analyze``: the first divergence across synthetic multi-rank flight records, and hostile input."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from hpcdp import trace
from hpcdp.trace import hooks
from hpcdp.trace import COMPLETED, FAILED, TIMED_OUT
from hpcdp.trace import _clock, _files
from hpcdp.trace import _dump as _dump_module
from hpcdp.trace._analyze import analyze, find_divergence, fmt_ranks
from hpcdp.trace._files import load_flight_records

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.abspath(__file__)
F32 = np.dtype("float32")


@pytest.fixture(autouse=True)
def fresh():
    trace.reset()
    # dump reasons and uncaught exceptions are per process: another test's crashed simulated
    # rank would read as this test's rank finishing "after an error"
    _dump_module.reset_hooks_for_tests()
    _clock._offsets.clear()  # other tests' clock offsets would reorder the synthetic ranks' ops
    trace.configure(lines=True)  # synthetic ranks record every line, as HPCDP_TRACE_LINES=1 does
    yield
    trace.reset()


class G:
    """A group as the collective layer passes it (name, global ranks, this rank's group rank)."""

    def __init__(self, name: str, ranks: tuple[int, ...], rank: int) -> None:
        self.name, self.ranks, self.rank = name, ranks, ranks.index(rank)


class Rank:
    """One synthetic rank: records ops the way the wired collective layer will."""

    def __init__(self, r: int, world: int) -> None:
        self.r, self.world = r, world
        self.rec = trace.recorder(r)
        self.seqs: dict[str, int] = {}

    @hooks.hide_frames
    def op(self, name: str, gname: str = "world", ranks: tuple[int, ...] | None = None,
           state: str = COMPLETED, shape=(4,), dtype=F32, peer: int = -1, seq: int | None = None) -> None:
        ranks = ranks or tuple(range(self.world))
        if seq is None:
            seq = self.seqs[gname] = self.seqs.get(gname, 0) + 1
        tok = self.rec.begin(name, G(gname, ranks, self.r), seq, shape, dtype, peer)
        if state != "started":
            self.rec.end(tok, state)


def _line_of(marker: str) -> int:
    with open(HERE) as fh:
        for i, text in enumerate(fh, 1):
            if marker in text and "_line_of" not in text:
                return i
    raise AssertionError(marker)


def _dump(tmp_path, drop=()) -> str:
    """Dump every synthetic rank; ``drop``: ranks whose record then goes missing."""
    trace.dump("CommTimeoutError: allreduce #3 on group world timed out", directory=tmp_path)
    for r in drop:
        os.remove(tmp_path / f"flight-rank{r}.json")
    return str(tmp_path)


def test_rank_calling_another_collective_is_named_with_lines(tmp_path) -> None:
    ranks = [Rank(r, 4) for r in range(4)]
    for rk in ranks:
        rk.op("allreduce")
        rk.op("allreduce")
    for rk in ranks:
        if rk.r == 2:
            rk.op("barrier", state=TIMED_OUT, shape=None, dtype=None)  # MARK-BARRIER
        else:
            rk.op("allreduce", state=TIMED_OUT)  # MARK-ALLREDUCE
    text = analyze(_dump(tmp_path))
    lines = text.splitlines()
    assert lines[0] == "First divergence: allreduce #3 on group world (shape (4,), float32)", text
    assert lines[1].startswith(f"Reached by ranks 0, 1, 3 (timed out) at {HERE}:{_line_of('MARK-ALLREDUCE')} "), text
    assert lines[2] == "Not reached by rank 2:", text
    assert lines[3].startswith("  rank 2: called barrier #3 on group world instead (no arguments; timed out) "
                               f"at {HERE}:{_line_of('MARK-BARRIER')} "), text
    assert lines[4] == "Record of ranks 0-3 written on: CommTimeoutError: allreduce #3 on group world timed out"


def test_rank_that_went_to_another_group_is_told_from_the_majority(tmp_path) -> None:
    """Rank 2 skipped allreduce #3 on world and waits in a side group's barrier instead: the same
    divergence shows on both groups; it is told as the op that three ranks reached."""
    ranks = [Rank(r, 4) for r in range(4)]
    for rk in ranks:
        rk.op("allreduce")
        rk.op("allreduce")
    for rk in ranks:
        if rk.r == 2:
            rk.op("barrier", gname="side", state=TIMED_OUT, shape=None, dtype=None)  # MARK-SIDE
        else:
            rk.op("allreduce", state=TIMED_OUT)
    d = find_divergence(load_flight_records(_dump(tmp_path)))
    assert (d.group, d.seq, d.expected.op, sorted(d.reached), d.not_reached) == ("world", 3, "allreduce",
                                                                                [0, 1, 3], [2])
    text = analyze(str(tmp_path))
    assert "\n  rank 2: was in barrier #1 on group side (timed out) at " in text, text
    assert f":{_line_of('MARK-SIDE')} " in text and "\n  rank 2: its last operation on group world was allreduce #2 at " in text


def test_rank_blocked_in_point_to_point(tmp_path) -> None:
    ranks = [Rank(r, 3) for r in range(3)]
    for rk in ranks:
        rk.op("allreduce")
    ranks[0].op("allreduce", state="started")
    ranks[1].op("allreduce", state="started")
    ranks[2].op("recv", seq=0, peer=0, state="started")  # MARK-RECV
    text = analyze(_dump(tmp_path))
    assert "Reached by rank 0 (started)" in text and "Reached by rank 1 (started)" in text, text
    assert "Not reached by rank 2:\n  rank 2: was in recv(peer 0) on group world (started)" in text, text
    assert f":{_line_of('MARK-RECV')} " in text


def test_rank_without_a_record_and_one_that_finished(tmp_path) -> None:
    ranks = [Rank(r, 4) for r in range(4)]
    for rk in ranks:
        rk.op("allreduce")
    for rk in ranks[:2]:
        rk.op("allreduce", state=TIMED_OUT)
    ranks[2].op("broadcast", gname="other", ranks=(2,), peer=0)  # finished, then did nothing more
    text = analyze(_dump(tmp_path, drop=[3]))  # rank 3's record is missing
    assert "Reached by ranks 0, 1 (timed out)" in text and "Not reached by ranks 2, 3:" in text, text
    assert "  rank 2: had finished broadcast #1 on group other" in text
    assert "  rank 3: wrote no flight record: killed or crashed hard" in text


def test_one_fact_per_line_when_a_rank_skipped_a_collective(tmp_path) -> None:
    """Issue 21 item 11: the divergent op, who reached it, who did not and what each was doing,
    each on a line of its own with its source line, not one ~400-character paragraph."""
    ranks = [Rank(r, 3) for r in range(3)]
    for rk in ranks:
        rk.op("allreduce")  # MARK-BOTH
    for rk in ranks:
        if rk.r == 1:
            rk.op("barrier", gname="side", ranks=(1,), state=TIMED_OUT, shape=None, dtype=None)  # MARK-SKIP
        else:
            rk.op("allreduce", state=TIMED_OUT)  # MARK-WAIT
    lines = analyze(_dump(tmp_path)).splitlines()
    fn = "(test_one_fact_per_line_when_a_rank_skipped_a_collective)"
    assert lines == [
        "First divergence: allreduce #2 on group world (shape (4,), float32)",
        f"Reached by ranks 0, 2 (timed out) at {HERE}:{_line_of('MARK-WAIT')} {fn}",
        "Not reached by rank 1:",
        f"  rank 1: was in barrier #1 on group side (timed out) at {HERE}:{_line_of('MARK-SKIP')} {fn}",
        f"  rank 1: its last operation on group world was allreduce #1 at {HERE}:{_line_of('MARK-BOTH')} {fn}",
        "Record of ranks 0-2 written on: CommTimeoutError: allreduce #3 on group world timed out",
    ], "\n".join(lines)


def test_a_peer_that_finalized_is_said_to_have_finished(tmp_path) -> None:
    """Rank 1 finished normally (``hpcdp.finalize`` marks its record) while rank 0 waits in a
    collective: not "killed or crashed", and no lead to a failed link."""
    ranks = [Rank(r, 2) for r in range(2)]
    for rk in ranks:
        rk.op("allreduce")
        rk.op("allreduce")  # MARK-LAST
    hooks.mark_finished("finalize", 1, write=False)
    ranks[0].op("allreduce", state=TIMED_OUT)  # MARK-ALONE
    lines = analyze(_dump(tmp_path)).splitlines()
    fn = "(test_a_peer_that_finalized_is_said_to_have_finished)"
    assert lines[:5] == [
        "First divergence: allreduce #3 on group world (shape (4,), float32)",
        f"Reached by rank 0 (timed out) at {HERE}:{_line_of('MARK-ALONE')} {fn}",
        "Not reached by rank 1:",
        f"  rank 1: finished normally: hpcdp.finalize() at {HERE}:{_line_of('def _dump(') + 2} (_dump)",
        f"  rank 1: its last operation on group world was allreduce #2 at {HERE}:{_line_of('MARK-LAST')} {fn}",
    ], "\n".join(lines)
    text = "\n".join(lines)
    assert "killed" not in text and "crashed" not in text and "failed link" not in text, text
    assert json.loads((tmp_path / "flight-rank1.json").read_text())["finished"] == "finalize"


_FINISHING_JOB = """
import sys
import numpy as np
import hpcdp
from hpcdp.errors import HpcdpError

def body(rank):
    g = hpcdp.get_default_group()
    for _ in range(2):
        g.allreduce(np.ones(4))
    if rank == 1:
        return "done"  # spawn calls hpcdp.finalize() on it while rank 0 still waits
    try:
        g.allreduce(np.ones(4), timeout=20.0)  # LINE-WAIT
    except HpcdpError as exc:
        return type(exc).__name__
    return "no error"

if __name__ == "__main__":
    print(hpcdp.spawn(body, 2, backend="tcp", timeout=30, join_timeout=60))
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("trace_dir", ["named", "default"])
def test_finalize_writes_a_finished_record_that_analyze_reads(tmp_path, trace_dir: str) -> None:
    """A real TCP job: rank 1 returns and finalizes, rank 0 is left in allreduce #3. Before, rank 1
    wrote no record and the analysis said "killed or crashed?" and "look for a failed link".
    With ``HPCDP_TRACE_DIR`` named, rank 1 writes a "finished" record; by default a clean rank
    leaves no file behind, and the analysis reads rank 1's finalize from rank 0's error."""
    script = tmp_path / "job.py"
    script.write_text(_FINISHING_JOB)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("HPCDP_BACKEND", "RANK", "WORLD_SIZE", "HPCDP_MASTER_ADDR", "MASTER_ADDR",
              "HPCDP_TRACE_DIR", "HPCDP_TRACE"):
        env.pop(k, None)
    if trace_dir == "named":
        d = tmp_path / "trace"
        env["HPCDP_TRACE_DIR"] = str(d)
    else:
        d = tmp_path / "hpcdp-trace"  # the default, under the job's working directory
    job = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=150,
                         env=env, stdin=subprocess.DEVNULL, cwd=tmp_path)
    assert job.returncode == 0 and "'done'" in job.stdout, job.stdout + job.stderr
    if trace_dir == "named":
        doc = json.loads((d / "flight-rank1.json").read_text())
        assert doc["finished"] == "finalize" and doc["reason"] == "finished: hpcdp.finalize() on rank 1", doc["reason"]
    else:
        assert not (d / "flight-rank1.json").exists()  # a clean rank leaves no litter
        assert (d / "flight-rank0.json").exists()  # the rank that failed wrote its record
    text = analyze(str(d))
    # rank 0 finalizes too once it has its error; whether its record says so depends on how far
    # its exit got before the launcher collected it
    lines = [ln for ln in text.splitlines() if not ln.startswith("  rank 0: finished")]
    line = next(i for i, t in enumerate(_FINISHING_JOB.split("\n"), 1) if "LINE-WAIT" in t)
    assert lines[0] == "First divergence: allreduce #3 on group world (shape (4,), float64)", text
    assert lines[1].startswith("Reached by rank 0 (") and lines[1].endswith(f"at {script}:{line} (body)"), text
    assert lines[2] == "Not reached by rank 1:", text
    if trace_dir == "named":
        assert lines[3].startswith("  rank 1: finished normally: hpcdp.finalize()"), text
        assert lines[4].startswith("  rank 1: its last operation on group world was allreduce #2"), text
    else:
        assert lines[3] == ("  rank 1: finished normally: it called hpcdp.finalize() and told its peers "
                            "(rank 0's error says so); it wrote no flight record of its own"), text
    assert "killed" not in text and "crashed" not in text and "failed link" not in text, text


def test_all_reached_but_stuck(tmp_path) -> None:
    ranks = [Rank(r, 2) for r in range(2)]
    for rk in ranks:
        rk.op("allreduce")
        rk.op("all_gather", state=TIMED_OUT)  # MARK-GATHER
    text = analyze(_dump(tmp_path))
    assert text.splitlines()[:4] == [
        "First divergence: all_gather #2 on group world (shape (4,), float32)",
        f"Reached by ranks 0, 1 (timed out) at {HERE}:{_line_of('MARK-GATHER')} (test_all_reached_but_stuck)",
        "Every member of group world with a record called it alike; it did not complete on ranks 0, 1",
        "Look for a peer stalled inside the transport or a failed link"], text


def test_argument_mismatch_is_a_divergence(tmp_path) -> None:
    ranks = [Rank(r, 3) for r in range(3)]
    for rk in ranks:
        rk.op("allreduce", shape=(4,) if rk.r != 1 else (5,), state=FAILED)
    text = analyze(_dump(tmp_path))
    assert "Reached by ranks 0, 2 (failed)" in text and "  rank 1: called allreduce #1 on group world instead (shape (5,)" in text, text


def test_no_divergence(tmp_path) -> None:
    ranks = [Rank(r, 2) for r in range(2)]
    for rk in ranks:
        for _ in range(5):
            rk.op("allreduce")
    assert analyze(_dump(tmp_path)).startswith("No divergence found in 2 flight records")


def test_ring_overflow_compares_only_what_every_rank_kept(tmp_path) -> None:
    trace.configure(capacity=4)
    ranks = [Rank(r, 2) for r in range(2)]
    for _ in range(10):
        ranks[0].op("allreduce")
    for _ in range(6):
        ranks[1].op("allreduce")
    ranks[1].op("barrier", gname="elsewhere", ranks=(1,), state="started")
    d = find_divergence(load_flight_records(_dump(tmp_path)))
    assert (d.kind, d.seq, sorted(d.reached), d.missing) == ("missing", 7, [0], [1]), d


def test_fmt_ranks() -> None:
    assert fmt_ranks([5, 0, 1, 2, 7, 8]) == "0-2, 5, 7, 8"
    assert fmt_ranks(range(512)) == "0-511"


# -- untrusted input ----------------------------------------------------------------------------

def _good(tmp_path) -> None:
    for r in range(2):
        Rank(r, 2).op("allreduce")
    trace.dump("t", directory=tmp_path)


def _rewrite(path, fn) -> None:
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize("damage, message", [
    (lambda d: d.update(format="pickle"), "not an hpcdp flight record"),
    (lambda d: d.update(rank="0"), "rank must be an integer"),
    (lambda d: d.update(rank=7), "is not below world_size"),
    (lambda d: d["entries"][0].update(state="exploded"), "state must be one of"),
    (lambda d: d["entries"][0].update(shape=[1, "x"]), "shape must be an integer"),
    (lambda d: d["entries"][0].update(start_ns=1.5), "start_ns must be an integer"),
    (lambda d: d.update(entries={"a": 1}), "entries must be a list"),
])
def test_damaged_records_give_clear_errors(tmp_path, damage, message) -> None:
    _good(tmp_path)
    _rewrite(tmp_path / "flight-rank1.json", damage)
    with pytest.raises(ValueError, match=message) as ei:
        load_flight_records(str(tmp_path))
    assert "flight-rank1.json" in str(ei.value)


def test_not_json_too_big_and_misnamed(tmp_path, monkeypatch) -> None:
    _good(tmp_path)
    (tmp_path / "flight-rank1.json").write_bytes(b"\x80\x81garbage")
    with pytest.raises(ValueError, match="not UTF-8"):
        load_flight_records(str(tmp_path))
    (tmp_path / "flight-rank1.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_flight_records(str(tmp_path))
    _good(tmp_path)
    os.replace(tmp_path / "flight-rank1.json", tmp_path / "flight-rank5.json")
    with pytest.raises(ValueError, match="file name says rank 5 but it holds rank 1"):
        load_flight_records(str(tmp_path))
    os.remove(tmp_path / "flight-rank5.json")
    monkeypatch.setattr(_files, "MAX_BYTES", 100)
    with pytest.raises(ValueError, match="more than the 100"):
        load_flight_records(str(tmp_path))


def test_symlinks_and_other_files_are_not_followed(tmp_path) -> None:
    outside = tmp_path / "outside"
    inside = tmp_path / "dumps"
    outside.mkdir()
    inside.mkdir()
    Rank(0, 2).op("allreduce")
    trace.dump("t", directory=outside)
    os.symlink(outside / "flight-rank0.json", inside / "flight-rank0.json")
    (inside / "notes.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no flight records"):
        load_flight_records(str(inside))


def test_control_characters_from_files_are_escaped(tmp_path) -> None:
    ranks = [Rank(r, 2) for r in range(2)]
    ranks[0].op("allreduce", state=TIMED_OUT)
    trace.dump("t", directory=tmp_path)
    os.remove(tmp_path / "flight-rank1.json")
    _rewrite(tmp_path / "flight-rank0.json",
             lambda d: d["entries"][0].update(op="all\x1b[2Jreduce", line="evil.py:1\x07"))
    text = analyze(str(tmp_path))
    assert "\x1b" not in text and "\x07" not in text and "all\\x1b[2Jreduce" in text


@pytest.mark.timeout(120)
def test_cli_analyze(tmp_path) -> None:
    ranks = [Rank(r, 2) for r in range(2)]
    for rk in ranks:
        rk.op("allreduce")
    ranks[0].op("allreduce", state=TIMED_OUT)
    ranks[1].op("barrier", state=TIMED_OUT, shape=None, dtype=None)
    trace.dump("t", directory=tmp_path)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "hpcdp.trace", "analyze", "-v", str(tmp_path)],
                       capture_output=True, text=True, timeout=60, env=env, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr
    assert "allreduce #2 on group world" in p.stdout and "  rank 1: called barrier #2" in p.stdout
    assert "rank 0 (" in p.stdout and "rank 1 (" in p.stdout  # -v: one line per rank
    q = subprocess.run([sys.executable, "-m", "hpcdp.trace", "analyze", str(tmp_path / "nope")],
                       capture_output=True, text=True, timeout=60, env=env, stdin=subprocess.DEVNULL)
    assert q.returncode == 1 and "is not a directory" in q.stderr


def test_records_of_an_earlier_job_are_set_aside(tmp_path) -> None:
    ranks = [Rank(r, 4) for r in range(4)]
    for rk in ranks[:3]:
        rk.op("allreduce")
    trace.dump("t", directory=tmp_path)

    def older(d):
        d["job"], d["dumped_at_ns"] = "slurm-41.0.0", d["dumped_at_ns"] - 10**12

    _rewrite(tmp_path / "flight-rank3.json", older)
    text = analyze(str(tmp_path))
    assert "\nSet aside the records of rank 3: they are from an earlier job." in text, text
    assert sorted(load_flight_records(str(tmp_path))) == [0, 1, 2]


@pytest.mark.parametrize("text, message", [
    ('{"format": ' + "[" * 100_000, "RecursionError"),                   # nesting deeper than the parser
    ("[" * 100_000, "not an hpcdp flight record"),                       # not even an object: not parsed
    ('{"format": "hpcdp.flight/1", "rank": ' + "9" * 5000 + "}", "not valid JSON"),  # a 5000-digit number
])
def test_unparseable_records_give_clear_errors(tmp_path, text, message) -> None:
    _good(tmp_path)
    (tmp_path / "flight-rank1.json").write_text(text)
    with pytest.raises(ValueError, match=message) as ei:
        load_flight_records(str(tmp_path))
    assert "flight-rank1.json" in str(ei.value)


@pytest.mark.parametrize("damage, message", [
    (lambda d: d.update(world_size=2**60), "world_size must be in"),             # per-rank lists of 2**60
    (lambda d: d["entries"][0].update(group_ranks=[0, 2**40]), "group_ranks must be in"),
    (lambda d: d["entries"][0].update(start_ns=10**400), "start_ns must be in"),   # not a 64-bit time
])
def test_records_claiming_absurd_sizes_are_refused(tmp_path, damage, message) -> None:
    _good(tmp_path)
    _rewrite(tmp_path / "flight-rank1.json", damage)
    with pytest.raises(ValueError, match=message):
        load_flight_records(str(tmp_path))


@pytest.mark.timeout(60)
def test_a_huge_sequence_number_does_not_stall_the_analysis(tmp_path) -> None:
    ranks = [Rank(r, 2) for r in range(2)]
    for rk in ranks:
        rk.op("allreduce")
    ranks[0].op("allreduce", seq=10**15)          # a damaged record: the walk must not count up to it
    text = analyze(_dump(tmp_path))
    assert "allreduce #1000000000000000 on group world" in text and "Not reached by rank 1" in text, text


# -- hostile sizes: time and memory stay bounded (issue 20, item 3) ------------------------------
_CAPPED = r"""
import json, resource, sys
limit = int(sys.argv[1])
if limit:
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
from hpcdp.trace.__main__ import main
code = main(sys.argv[2:]) if len(sys.argv) > 2 else 0
peak = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmPeak"))
print(json.dumps({"code": code, "vm_peak": peak}))
"""


def _capped(args: list[str], limit: int = 0, timeout: float = 60.0) -> subprocess.CompletedProcess:
    """``python -m hpcdp.trace ARGS`` under an address-space cap (0: none) and a wall-clock cap."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", _CAPPED, str(limit), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, stdin=subprocess.DEVNULL)


def _hostile(directory, n: int, k: int = 0) -> int:
    """Two ranks' records whose every entry names another group (each one a divergence), with a
    rank list of ``k`` distinct large numbers each; the bytes written."""
    rnd = np.random.default_rng(1)
    total = 0
    for rank in (0, 1):
        entries = []
        for i in range(n):
            gr = np.unique(rnd.integers(1000, 1 << 20, k)).tolist() + [0, 1] if k else [0, 1]
            entries.append({"id": i + 1, "seq": 1, "op": "allreduce", "group": f"g{rank}-{i}",
                            "group_ranks": gr, "shape": [4], "dtype": "float32", "peer": -1,
                            "start_ns": 1000 + i, "end_ns": 2000 + i, "state": "completed",
                            "line": f"train.py:{i}", "thread": 1})
        doc = {"format": "hpcdp.flight/1", "rank": rank, "world_size": 1 << 20, "job": "j", "host": "h",
               "pid": 1, "reason": "t", "dumped_at_ns": 10**9, "clock_offset_ns": 0, "capacity": n,
               "total_ops": n, "threads": [], "entries": entries}
        raw = json.dumps(doc, separators=(",", ":")).encode()
        (directory / f"flight-rank{rank}.json").write_bytes(raw)
        total += len(raw)
    return total


@pytest.mark.timeout(200)
def test_analysis_is_not_quadratic_in_groups(tmp_path) -> None:
    """Each of 2 x 30000 entries names its own group: once ~2 minutes (groups x entries), now seconds."""
    size = _hostile(tmp_path, 30_000)
    assert size > 8 << 20
    p = _capped(["analyze", str(tmp_path)], limit=2 << 30, timeout=60)   # raises TimeoutExpired if stuck
    assert p.returncode == 0 and json.loads(p.stdout.splitlines()[-1])["code"] == 0, p.stderr
    assert "First divergence: allreduce #1 on group g0-0" in p.stdout and "Not reached by rank 1" in p.stdout


@pytest.mark.timeout(200)
def test_reader_memory_is_a_small_multiple_of_the_record(tmp_path) -> None:
    """Rank lists of large numbers cost ~44 bytes per ~8 in the file loaded as a JSON tree (over
    30x the record at the peak); read entry by entry, with values shared, well under 12x."""
    base = json.loads(_capped([]).stdout)["vm_peak"]
    size = _hostile(tmp_path, 1000, 1000)
    assert size > 12 << 20
    limit = base + 12 * size + (64 << 20)
    p = _capped(["analyze", str(tmp_path)], limit=limit, timeout=60)
    assert p.returncode == 0 and json.loads(p.stdout.splitlines()[-1])["code"] == 0, (limit, p.stderr[-2000:])
    assert "First divergence: allreduce #1 on group g0-0" in p.stdout


def test_a_record_over_the_cap_is_refused_naming_the_cap(tmp_path) -> None:
    _good(tmp_path)
    big = tmp_path / "flight-rank1.json"
    os.truncate(big, _files.MAX_BYTES + 1)                          # sparse: no disk used
    p = _capped(["analyze", str(tmp_path)], timeout=60)
    assert p.returncode == 0 and json.loads(p.stdout.splitlines()[-1])["code"] == 1, p.stderr
    assert f"more than the {_files.MAX_BYTES} (128 MiB) this reader accepts" in p.stderr, p.stderr
    assert _files.MAX_BYTES <= 128 << 20
    with pytest.raises(ValueError, match="more than the 134217728"):
        load_flight_records(str(tmp_path))

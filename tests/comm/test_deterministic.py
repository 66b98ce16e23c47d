"""Deterministic mode's reductions (``comm.reproducible``, ``comm.exact``): every float sum is
the exact sum correctly rounded, so its bits cannot depend on the backend, the algorithm, the
world size or the rank order. Checked against an exact ``fractions.Fraction`` reference on
adversarial values, on every world; the mode's agreement check at init; the oracle's cases
come out at least as accurate as the plain sum."""
from __future__ import annotations

import math
import os
import pathlib
import subprocess
import sys
import zlib
from fractions import Fraction
from typing import Any

import numpy as np
import pytest

import hpcdp
from hpcdp.comm import exact, reproducible
from hpcdp.testing import check
from hpcdp.testing.fixtures import World, grid, worlds

from cases import make, shapes


# -- the exact reference --------------------------------------------------------------------------
def round_fraction(s: Fraction, dtype: Any) -> Any:
    """``s`` correctly rounded (to nearest, ties to even) to ``dtype``, overflow to +-inf."""
    dt = np.dtype(dtype)
    if s == 0:
        return dt.type(0.0)
    prec, qmin = exact.FORMATS[dt]
    a = abs(s)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    while Fraction(2) ** e > a:
        e -= 1
    while Fraction(2) ** (e + 1) <= a:
        e += 1
    q = max(e - prec + 1, qmin)
    k = a / Fraction(2) ** q
    whole = math.floor(k)
    rem = k - whole
    if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and whole % 2 == 1):
        whole += 1
    big = Fraction(whole) * Fraction(2) ** q
    top = {np.dtype(np.float64): 1024, np.dtype(np.float32): 128, np.dtype(np.float16): 16}[dt]
    if big >= Fraction(2) ** top:
        return dt.type(math.inf if s > 0 else -math.inf)
    return dt.type(float(big) if s > 0 else -float(big))


def exact_ref(arrs: list[np.ndarray], divisor: int = 1) -> np.ndarray:
    """Elementwise: IEEE's rule for non-finite values; otherwise the exact sum correctly
    rounded (a mean: that sum in float64, divided, then cast: the documented semantics)."""
    dt = arrs[0].dtype
    if dt.kind == "c":
        part = np.float64 if dt == np.complex128 else np.float32
        real = exact_ref([a.real.astype(part) for a in arrs], divisor)
        imag = exact_ref([a.imag.astype(part) for a in arrs], divisor)
        return (real + 1j * imag).astype(dt)
    flat = [a.reshape(-1) for a in arrs]
    out = np.empty(flat[0].shape, dt)
    for i in range(out.size):
        col = [float(f[i]) for f in flat]
        if not all(math.isfinite(v) for v in col):
            nan = any(math.isnan(v) for v in col) or (math.inf in col and -math.inf in col)
            out[i] = math.nan if nan else (math.inf if math.inf in col else -math.inf)
            continue
        s = sum((Fraction(v) for v in col), Fraction(0))
        if s == 0:
            out[i] = -0.0 if all(math.copysign(1, v) < 0 for v in col) else 0.0
        elif divisor == 1:
            out[i] = round_fraction(s, dt)
        else:
            out[i] = (np.float64(round_fraction(s, np.float64)) / divisor).astype(dt)
    return out.reshape(arrs[0].shape)


def same_bits(got: Any, want: Any) -> bool:
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if got.dtype.kind == "c":
        return same_bits(got.real, want.real) and same_bits(got.imag, want.imag)
    return bool(np.array_equal(got.view(f"u{got.dtype.itemsize}"), want.view(f"u{want.dtype.itemsize}")))


# -- adversarial inputs, rebuilt identically on every rank ------------------------------------------
def _seed(kind: str, rank: int, dtype: str) -> int:
    """The same in every process (``hash`` of a str is not: PYTHONHASHSEED)."""
    return zlib.crc32(f"{kind}/{rank}/{dtype}".encode())


KINDS = ["magnitudes", "cancel", "subnormal", "zeros", "special", "huge", "normal"]


def adversarial(kind: str, rank: int, n: int, dtype: str, size: int = 37) -> np.ndarray:
    """Rank ``rank``'s contribution of ``kind`` (``n`` ranks): any rank rebuilds all of them."""
    rng = np.random.default_rng(_seed(kind, rank, dtype))
    dt = np.dtype(dtype)
    if kind == "magnitudes":     # 1e-30 .. 1e30 side by side
        a = rng.standard_normal(size) * 10.0 ** rng.integers(-30, 31, size)
    elif kind == "cancel":       # the last rank takes back what the others added, nearly
        base = [np.random.default_rng(_seed(kind, r, dtype)).standard_normal(size) * 1e16
                for r in range(n)]
        a = base[rank] if rank < n - 1 or n == 1 else -np.sum(base[:-1], axis=0) + rng.standard_normal(size)
    elif kind == "subnormal":
        tiny = {"float64": 5e-324, "float32": 1.4e-45, "float16": 6e-8}[dtype]
        a = rng.integers(-1000, 1000, size) * tiny
        a[::5] = rng.standard_normal(a[::5].shape)   # beside ordinary values
    elif kind == "zeros":        # signed zeros: all -0 stays -0, anything else +0
        a = np.where(np.arange(size) % 2 == 0, -0.0, 0.0)
        if rank == 0:
            a[::3] = 0.0
    elif kind == "special":
        a = rng.standard_normal(size)
        a[rank % size] = np.inf
        a[(rank + 1) % size] = -np.inf if rank % 2 else np.nan
        a[7] = np.inf
    elif kind == "huge":         # exact sums beyond the format's range
        big = {"float64": 1e308, "float32": 3e38, "float16": 6e4}[dtype]
        a = np.full(size, big) * np.where(np.arange(size) % 3 == 0, -1, 1)
        a[::4] *= (-1) ** rank
    else:
        a = rng.standard_normal(size) * 3
    with np.errstate(over="ignore", invalid="ignore"):
        return a.astype(dt)


def body_adversarial(rank: int, dtypes: list[str]) -> list[str]:
    g = hpcdp.get_default_group()
    n = g.size
    fails: list[str] = []
    was = g.deterministic
    g.deterministic = True
    try:
        for dtype in dtypes:
            for kind in KINDS:
                arrs = [adversarial(kind, r, n, dtype) for r in range(n)]
                x = arrs[rank]
                want = exact_ref(arrs)
                got = hpcdp.allreduce(x)
                if not same_bits(got, want):
                    bad = np.nonzero(~np.isclose(got, want, equal_nan=True) | (np.signbit(got) != np.signbit(want)))[0][:3]
                    fails.append(f"allreduce {dtype} {kind}: elements {bad.tolist()} got "
                                 f"{got[bad].tolist()} want {want[bad].tolist()}")
                mean = hpcdp.allreduce(x, "mean")
                if not same_bits(mean, exact_ref(arrs, n)):
                    fails.append(f"allreduce mean {dtype} {kind}")
                root = n - 1
                red = hpcdp.reduce(x, root=root)
                if (red is None) != (rank != root) or (red is not None and not same_bits(red, want)):
                    fails.append(f"reduce {dtype} {kind}: {red}")
                rows = np.concatenate([x] * n)[:n * (x.size // n)].reshape(n, -1)
                parts = [np.concatenate([a] * n)[:n * (a.size // n)].reshape(n, -1) for a in arrs]
                rs = hpcdp.reduce_scatter(rows)
                if not same_bits(rs, exact_ref(parts)[rank:rank + 1]):
                    fails.append(f"reduce_scatter {dtype} {kind}")
                out = np.empty_like(x)
                w = hpcdp.allreduce(x, out=out, async_op=True)
                if w.wait() is not out and not same_bits(out, want):
                    fails.append(f"async allreduce out= {dtype} {kind}")
    finally:
        g.deterministic = was
    return fails


@pytest.mark.parametrize("world", worlds(*grid([1, 2, 3, 4]), "mpi"), indirect=True)
def test_exact_sums_on_every_world(world: World) -> None:
    check(world.run(body_adversarial, ["float64", "float32", "float16"]))


def body_shapes_and_dtypes(rank: int) -> list[str]:
    """The oracle's shapes (0-d, empty, odd sizes, non-contiguous views) and complex numbers."""
    g = hpcdp.get_default_group()
    n = g.size
    fails = []
    g.deterministic = True
    try:
        for dtype in ("float64", "float32", "complex128", "complex64"):
            for salt, shape in enumerate(shapes("allreduce", n)):
                arrs = [make(r, dtype, shape, salt, n) for r in range(n)]
                got = hpcdp.allreduce(arrs[rank])
                if not same_bits(got, exact_ref([a.copy() for a in arrs])):
                    fails.append(f"allreduce {dtype} {shape}")
            for salt, shape in enumerate(shapes("reduce_scatter", n)):
                if shape == () or shape == "nc":
                    continue
                arrs = [make(r, dtype, shape, salt, n) for r in range(n)]
                got = hpcdp.reduce_scatter(arrs[rank])
                per = shape[0] // n
                want = exact_ref(arrs)[rank * per:(rank + 1) * per]
                if not same_bits(got, want):
                    fails.append(f"reduce_scatter {dtype} {shape}")
        for op in ("max", "min"):   # order-free already: the plain path, unchanged
            x = make(rank, "float64", (7,), 3, n)
            want = getattr(np, "maximum" if op == "max" else "minimum").reduce(
                [make(r, "float64", (7,), 3, n) for r in range(n)])
            if not same_bits(hpcdp.allreduce(x, op), want):
                fails.append(f"{op}")
        try:
            hpcdp.allreduce(np.ones(3), "prod")
            fails.append("prod of floats was not refused")
        except ValueError as exc:
            if "deterministic" not in str(exc):
                fails.append(f"prod refusal does not say why: {exc}")
        ints = hpcdp.allreduce(np.arange(5, dtype=np.int64) + rank)
        if ints.tolist() != [n * i + n * (n - 1) // 2 for i in range(5)]:
            fails.append(f"int64 sum {ints}")
    finally:
        g.deterministic = False
    return fails


@pytest.mark.parametrize("world", worlds("sim-1", "sim-3", "tcp-2", "mpi"), indirect=True)
def test_shapes_dtypes_and_other_ops(world: World) -> None:
    check(world.run(body_shapes_and_dtypes))


def body_total(rank: int) -> list[str]:
    """``exact_total``: one float for all elements of all ranks, whatever the partition."""
    g = hpcdp.get_default_group()
    n = g.size
    rng = np.random.default_rng(5)
    everything = rng.standard_normal(120) * 10.0 ** rng.integers(-200, 200, 120)
    want = float(sum((Fraction(float(v)) for v in everything), Fraction(0)))
    mine = np.array_split(everything, n)[rank]
    got = reproducible.exact_total(g, mine)
    fails = [] if got == want else [f"exact_total {got!r} != {want!r}"]
    squares = (rng.standard_normal(50) * 10.0 ** rng.integers(-100, 100, 50)) ** 2
    sq = reproducible.exact_total(g, np.array_split(squares, n)[rank])
    if sq != float(sum((Fraction(float(v)) for v in squares), Fraction(0))):
        fails.append(f"sum of squares {sq}")
    if reproducible.exact_total(g, np.array_split(np.array([1e308] * 4), n)[rank]) != math.inf:
        fails.append("an exact total beyond the range is not inf")
    return fails


@pytest.mark.parametrize("world", worlds(*grid([1, 3]), "mpi"), indirect=True)
def test_exact_total_ignores_the_partition(world: World) -> None:
    check(world.run(body_total))


# -- accuracy on the numpy oracle's cases, no world needed -----------------------------------------
@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
def test_at_least_as_accurate_as_the_plain_sum(dtype: str) -> None:
    """Against the exact sum: never further from it than numpy's sum in the same dtype, over
    the collective oracle's inputs for 1-4 ranks (here summed without communication)."""
    worse = 0
    for n in (1, 2, 3, 4):
        for salt, shape in enumerate(shapes("allreduce", n)):
            arrs = [make(r, dtype, shape, salt, n).copy() for r in range(n)]
            rows = np.stack([a.reshape(-1) for a in arrs]).astype(np.float64)
            code = exact.codes(rows, np)
            width = exact.limb_width(n)
            acc = exact.to_limbs(rows, code, width, exact.nlimbs(code, np, width), np)
            ours = exact.round_limbs(acc, code, width, dtype, np)
            plain = arrs[0].reshape(-1).copy()
            for a in arrs[1:]:
                plain = plain + a.reshape(-1)
            for i in range(ours.size):
                s = sum((Fraction(float(a.reshape(-1)[i])) for a in arrs), Fraction(0))
                if abs(Fraction(float(ours[i])) - s) > abs(Fraction(float(plain[i])) - s):
                    worse += 1
            if not same_bits(ours, exact_ref([a.reshape(-1) for a in arrs])):
                worse += 1
    assert worse == 0


def test_limb_arithmetic_edges() -> None:
    """The kernel alone: a value next to 1e308's neighbour, the largest finite sum, ties."""
    rows = np.array([[1e308, 2.0 ** -1074, 1.0, 2.0 ** 53, np.finfo(np.float64).max],
                     [-1e308, 2.0 ** -1074, 2.0 ** -53, 1.0, np.finfo(np.float64).max],
                     [2.0 ** -1074, 0.0, 2.0 ** -106, 0.0, -np.finfo(np.float64).max]])
    code = exact.codes(rows, np)
    width = exact.limb_width(3)
    n_limbs = exact.nlimbs(code, np, width)
    assert n_limbs > 30   # 1e308 beside a subnormal: every bit between them
    got = exact.round_limbs(exact.to_limbs(rows, code, width, n_limbs, np), code, width, np.float64, np)
    want = exact_ref([r for r in rows])
    assert same_bits(got, want), (got, want)
    assert got[0] == 2.0 ** -1074 and got[1] == 2.0 ** -1073
    assert got[2] == 1.0 + 2.0 ** -52   # a tie broken by 2**-106
    assert got[4] == np.finfo(np.float64).max
    with pytest.raises(ValueError, match="contributions"):
        exact.limb_width(1 << 23)


# -- the switch ------------------------------------------------------------------------------------
def body_mode_flags(rank: int) -> list[str]:
    g = hpcdp.get_default_group()
    fails = []
    if g.deterministic is not (os.environ.get("HPCDP_DETERMINISTIC") == "1"):
        fails.append(f"group.deterministic {g.deterministic} under HPCDP_DETERMINISTIC")
    sub = g.new_group(list(range(g.size)))
    if sub.deterministic is not g.deterministic:
        fails.append("a sub-group did not inherit the mode")
    return fails


def test_env_switch_and_inheritance(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPCDP_DETERMINISTIC", "1")
    check(hpcdp.spawn(body_mode_flags, world_size=2, backend="sim"))


_MISMATCH = r"""
import os, sys, hpcdp
rank = int(os.environ["RANK"])
try:
    hpcdp.init("tcp", timeout=30, deterministic=(rank == 1))
    print("RESULT no error", flush=True)
except hpcdp.CollectiveMismatchError as exc:
    print("RESULT", exc, flush=True)
"""


def test_ranks_that_disagree_both_raise_at_init(tmp_path: Any) -> None:
    """One rank deterministic, the other not: CollectiveMismatchError on both, naming both."""
    script = tmp_path / "mismatch.py"
    script.write_text(_MISMATCH)
    proc = subprocess.run([sys.executable, "-m", "hpcdp.run", "-n", "2", str(script)],
                          capture_output=True, text=True, timeout=120)
    lines = [ln for ln in proc.stdout.splitlines() if "RESULT" in ln]
    assert len(lines) == 2, proc.stdout + proc.stderr
    for ln in lines:
        assert "deterministic=True on ranks [1]" in ln and "deterministic=False on ranks [0]" in ln, ln


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
@pytest.mark.parametrize("span", [3, 40])
def test_float_layouts_are_exact_in_any_order(dtype: str, span: int) -> None:
    """The fast path adds the values themselves (one float64 each) or their hi/lo halves (two)
    with plain float64 additions: in every order (here: shuffled, and the reverse) the result
    is the exact sum correctly rounded, signed zeros included; float32 sums that need the
    round-to-odd step get it."""
    rng = np.random.default_rng(11 + span)
    dt = np.dtype(dtype)
    seen = set()
    for m in (1, 2, 3, 5):
        signs = rng.choice([-1.0, 1.0], (m, 300))
        rows = (signs * rng.uniform(1, 2, (m, 300)) * 2.0 ** rng.integers(0, span, (m, 300)))
        with np.errstate(over="ignore"):
            rows = rows.astype(dt)
        rows[:, :7] = -0.0
        rows[0, 3] = 0.0
        if not np.isfinite(rows).all():
            continue
        wide = rows.astype(np.float64)
        code = exact.codes(wide, np, dt)
        halves, bad = exact.float_layout(code, m, np)
        seen.add(halves)
        want = exact_ref(list(rows))
        for order in (rng.permutation(m), np.arange(m)[::-1]):
            if halves == 1:
                total = wide[order[0]].copy()
                for r in order[1:]:
                    total = total + wide[r]
                got = total.astype(dt)
            else:
                part = np.empty((2, 300))
                hi, lo = None, None
                for r in order:
                    exact.split2(wide[r], code, m, np, part[0], part[1])
                    hi = part[0].copy() if hi is None else hi + part[0]
                    lo = part[1].copy() if lo is None else lo + part[1]
                got = exact.combine2(hi, lo, dt, np)
                got[code[0] == exact.NEG_ZERO] = -0.0
            ok = np.ones(300, bool) if bad is None else ~bad
            assert same_bits(got[ok], want[ok]), (dtype, span, m, halves)
    if dtype == "float64":
        assert 2 in seen       # 53 bits: one float64 only for a single summand
    elif span == 3:
        assert seen == {1}
    elif dtype == "float32":
        assert 2 in seen       # 40 binades of float32 take two halves (and round to odd)


_MPI4PY_FIRST = r"""
from mpi4py import MPI          # mpi4py first: it initialises MPI, hpcdp adopts it
import sys
import numpy as np
sys.path.insert(0, {tests!r})
import hpcdp
from comm.test_deterministic import KINDS, adversarial, exact_ref, same_bits
g = hpcdp.init("mpi", deterministic=True)
n = g.size
bad = []
for dtype in ("float64", "float32"):
    for kind in KINDS:
        arrs = [adversarial(kind, r, n, dtype) for r in range(n)]
        if not same_bits(hpcdp.allreduce(arrs[g.rank]), exact_ref(arrs)):
            bad.append(dtype + " " + kind)
with open(f"result-{{g.rank}}.txt", "w") as fh:   # (mpirun merges the ranks' stdout)
    fh.write("ok" if not bad else repr(bad))
hpcdp.finalize()
"""


@pytest.mark.parametrize("n", [2, 3])
def test_mpi4py_imported_first(tmp_path: Any, n: int) -> None:
    """The other import order of an MPI program (the ``mpi`` stage runs hpcdp first): exact
    sums on adversarial values, mpi4py having initialised MPI itself."""
    tests = str(pathlib.Path(__file__).resolve().parents[1])
    script = tmp_path / "job.py"
    script.write_text(_MPI4PY_FIRST.format(tests=tests))
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.pop("HPCDP_BACKEND", None)
    proc = subprocess.run(["mpirun", "-n", str(n), "--oversubscribe", sys.executable, str(script)],
                          capture_output=True, text=True, timeout=300, env=env, stdin=subprocess.DEVNULL,
                          cwd=str(tmp_path))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert [(tmp_path / f"result-{r}.txt").read_text() for r in range(n)] == ["ok"] * n, out[-3000:]

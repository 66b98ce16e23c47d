"""Rank-aware output: the tqdm bar is drawn on rank 0 only; log lines carry the rank."""
from __future__ import annotations

import io
import logging

import pytest

from hpcdp.testing import run_ranks
from hpcdp.progress import NullBar, get_logger, progress


def _draw(rank: int, file: io.StringIO | None = None) -> str:
    """Run a bar over three items with a postfix, as the DDP example does; return its type."""
    kw = {} if file is None else {"file": file}
    bar = progress(range(3), desc=f"bar-of-rank-{rank}", total=3, mininterval=0, **kw)
    for i in bar:
        bar.set_postfix(loss=f"{0.5 / (i + 1):.3f}", acc="0.90")
    bar.close()
    return type(bar).__name__


@pytest.mark.parametrize("world_size", [2, 3])
def test_bar_drawn_on_rank_zero_only(world_size: int) -> None:
    files = [io.StringIO() for _ in range(world_size)]
    kinds = run_ranks("sim", world_size, lambda r: _draw(r, files[r]))
    assert kinds[0] != "NullBar" and all(k == "NullBar" for k in kinds[1:]), kinds
    out = files[0].getvalue()
    assert "bar-of-rank-0" in out and "3/3" in out and "loss=0.167" in out and "acc=0.90" in out, out
    assert [f.getvalue() for f in files[1:]] == [""] * (world_size - 1)


@pytest.mark.parametrize("world_size", [2, 3])
def test_bar_on_default_stream(world_size: int, capsys: pytest.CaptureFixture[str]) -> None:
    run_ranks("sim", world_size, _draw)
    captured = capsys.readouterr()
    err = captured.err
    assert "bar-of-rank-0" in err and "3/3" in err, err
    assert not any(f"bar-of-rank-{r}" in err + captured.out for r in range(1, world_size)), err


def test_explicit_rank_and_null_bar() -> None:
    buf = io.StringIO()
    bar = progress([1, 2], rank=1, file=buf)
    assert isinstance(bar, NullBar) and list(bar) == [1, 2] and len(bar) == 2
    with bar as b:
        b.set_postfix(x=1)
        b.set_description("d")
        b.update()
        b.write("hidden")
    assert buf.getvalue() == ""
    assert isinstance(progress([1], rank=0, file=buf), NullBar) is False


def test_logger_prefixes_each_rank() -> None:
    buf = io.StringIO()
    name = "hpcdp.test_progress"
    log = get_logger(name)
    handler = next(h for h in log.handlers if getattr(h, "_hpcdp", False))
    old_stream = handler.setStream(buf)
    try:
        run_ranks("sim", 2, lambda r: log.info("hello from %d", r))
    finally:
        handler.setStream(old_stream)
        logging.getLogger(name).handlers.clear()
    lines = sorted(buf.getvalue().splitlines())
    assert lines == [f"[rank {r}] INFO {name}: hello from {r}" for r in range(2)], lines


def test_hpcdp_progress_stays_the_function_whatever_was_imported_first() -> None:
    """``hpcdp.progress`` is the function the README shows, even after ``get_logger`` or
    ``from hpcdp.progress import ...`` loaded the submodule of the same name (which Python binds
    on the package, so ``hpcdp.progress(...)`` raised "'module' object is not callable")."""
    import subprocess
    import sys

    code = ("import hpcdp, sys\n"
            "hpcdp.get_logger('x')\n"
            "from hpcdp.progress import NullBar\n"
            "import hpcdp.progress\n"
            "assert callable(hpcdp.progress), type(hpcdp.progress)\n"
            "assert list(hpcdp.progress(range(3), rank=1)) == [0, 1, 2]\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr

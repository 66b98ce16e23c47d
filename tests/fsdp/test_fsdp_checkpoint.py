"""FSDP checkpoints: Shards at global names, and round trips across strategies and world sizes
(FSDP 4 -> FSDP 3, -> DDP 2, -> a plain model in one process, and the reverse), model and
optimizer state, checked by training on after loading and comparing with uninterrupted training.

After a reload every rank's own parameters are compared (its shards, or its replica), not only
what rank 0 gathers: rank 0's ``full_state_dict`` is built from the first replica's shards alone,
and a DDP rank whose optimizer state loaded wrong drifts from rank 0 without changing rank 0's
parameters."""
from __future__ import annotations

import os
import shutil
from typing import Any

import numpy as np
import pytest

import hpcdp
from conftest import run_mpi, run_ranks
from fsdp_bodies import Block, OddNet, Sub, compare, data, snapshot
from hpcdp import nn, optim
from hpcdp.fsdp import FSDP

pytestmark = pytest.mark.timeout(240)


# -- checkpoints across strategies and world sizes ---------------------------------------------------
CKPT_BATCH = 12   # global batch: divisible by 1, 2, 3 and 4 ranks


def _ckpt_opt(params: Any) -> Any:
    return optim.AdamW(params, lr=0.02, weight_decay=0.05)


def _plain_optim_by_name(opt: Any, model: nn.Module) -> dict[str, Any]:
    """A plain optimizer's state in the name-keyed layout (what a single process without a wrapper saves)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {"state": {names[id(p)]: dict(st) for p, st in opt.state.items() if st},
            "param_groups": [{**{k: v for k, v in g.items() if k != "params"},
                              "params": [names[id(p)] for p in g["params"]]} for g in opt.param_groups]}


def _plain_load_by_name(opt: Any, model: nn.Module, osd: dict[str, Any]) -> None:
    """Name-keyed state into a plain optimizer through its own (index-keyed) ``load_state_dict``."""
    index = {n: i for i, (n, _) in enumerate(model.named_parameters())}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[str(n)] for n in g["params"]]}
              for g in osd["param_groups"]]
    opt.load_state_dict({"state": {index[str(n)]: st for n, st in osd["state"].items()}, "param_groups": groups})


def body_ckpt_segment(rank: int, kind: str, start: int, stop: int, load_from: str | None,
                      save_to: str | None, group: Any = None) -> dict[str, Any]:
    """Train steps [start, stop) under ``kind`` ("fsdp:<strategy>", "ddp" or "plain"), loading the
    model and optimizer from ``load_from`` first and saving them to ``save_to`` after; return
    ``{"held": what this rank holds (see _held), "full": rank 0's full_state_dict under FSDP
    (None elsewhere)}``."""
    from hpcdp.checkpoint import load, save

    g = group or hpcdp.get_default_group()
    n, r = g.size, g.rank
    model = OddNet(seed=21)
    if kind.startswith("fsdp"):
        strategy = kind.split(":")[1]
        w: Any = FSDP(model, strategy=strategy, group=g, auto_wrap={Block, Sub},
                      shard_size=2 if strategy == "hybrid_shard" else None)
    elif kind == "ddp":
        w = hpcdp.DDP(model, group=g)
    else:
        w = None
    opt = _ckpt_opt(w.parameters() if w is not None else model.parameters())

    def osd() -> dict[str, Any]:
        return w.optim_state_dict(opt) if w is not None else _plain_optim_by_name(opt, model)

    if load_from is not None:
        like = {"model": w.state_dict() if w is not None else model.state_dict(), "optim": osd(), "step": 0}
        got = load(load_from, like=like, group=g)
        if w is not None:
            w.load_state_dict(got["model"])
            w.load_optim_state_dict(opt, got["optim"])
        else:
            model.load_state_dict(got["model"])
            _plain_load_by_name(opt, model, got["optim"])
        if int(got["step"]) != start:
            raise AssertionError(f"checkpoint step {got['step']} != {start}")
    x, y = data(8 * CKPT_BATCH, seed=5)   # fixed size: the same samples whatever the segment
    loss_fn = nn.CrossEntropyLoss()
    b = CKPT_BATCH // n
    for s in range(start, stop):
        mine = slice(s * CKPT_BATCH + r * b, s * CKPT_BATCH + (r + 1) * b)
        out = (w or model)(x[mine])
        loss_fn(out, y[mine])
        (w.backward if w is not None else model.backward)(loss_fn.backward())
        opt.step()
        opt.zero_grad()
    if save_to is not None:
        save(save_to, {"model": w.state_dict() if w is not None else model.state_dict(), "optim": osd(),
                       "step": stop}, group=g)
    full = w.full_state_dict() if isinstance(w, FSDP) else None   # collective: every rank
    return {"held": _held(w if isinstance(w, FSDP) else None, model),
            "full": full if r == 0 else None}


def _held(fsdp: FSDP | None, model: nn.Module) -> dict[str, tuple[tuple[int, ...], np.ndarray]]:
    """Each parameter and buffer as this rank holds it: ``(offsets, block)``, the block of the
    global array at ``offsets`` (an FSDP Shard), or the whole array at offset 0 (a replica)."""
    from hpcdp.checkpoint import Shard

    out = {}
    for k, v in (fsdp.state_dict() if fsdp is not None else snapshot(model)).items():
        if isinstance(v, Shard):
            out[k] = (tuple(v.offsets), np.array(v.local, copy=True))
        else:
            a = np.array(v, copy=True)
            out[k] = ((0,) * a.ndim, a)
    return out


def compare_ranks(want: dict[str, np.ndarray], per_rank: list[Any], tol: float,
                  what: str) -> list[str]:
    """Every rank's held blocks against the matching blocks of ``want``, and rank 0's
    ``full_state_dict`` where there is one (a rank outside the group reports None)."""
    fails: list[str] = []
    for r, res in enumerate(per_rank):
        if res is None:
            continue
        held = res["held"]
        if set(held) != set(want):
            fails.append(f"{what}: rank {r} holds {sorted(held)}, want {sorted(want)}")
        for k, (off, block) in held.items():
            if k in want:
                part = want[k][tuple(slice(o, o + n) for o, n in zip(off, block.shape))]
                fails += compare({k: part}, {k: block}, tol, f"{what}, rank {r} at {off}")
        if res["full"] is not None:
            fails += compare(want, res["full"], tol, f"{what}, rank {r}'s full_state_dict")
    return fails


def reference_params(steps: int) -> dict[str, np.ndarray]:
    """One process, the whole batch, ``steps`` AdamW steps."""
    held = body_ckpt_segment(0, "plain", 0, steps, None, None, group=_SelfGroup())["held"]
    return {k: block for k, (_, block) in held.items()}


class _SelfGroup:
    """Enough of a group for ``body_ckpt_segment(kind="plain")`` without any backend."""

    size, rank = 1, 0


def body_ckpt_sharded_layout(rank: int) -> list[str]:
    """``state_dict`` gives Shards at global names and shapes; optimizer state too."""
    from hpcdp.checkpoint import Shard

    g = hpcdp.get_default_group()
    model = OddNet(seed=21)
    names = {n: tuple(p.data.shape) for n, p in model.named_parameters()}
    fsdp = FSDP(model, strategy="full_shard", auto_wrap={Block})
    opt = _ckpt_opt(fsdp.parameters())
    loss_fn = nn.CrossEntropyLoss()
    x, y = data(4, seed=rank)
    loss_fn(fsdp(x), y)
    fsdp.backward(loss_fn.backward())
    opt.step()
    fails = []
    sd = fsdp.state_dict()
    for n, shape in names.items():
        v = sd.get(n)
        if not isinstance(v, Shard) or v.global_shape != shape:
            fails.append(f"{n}: {type(v).__name__} {getattr(v, 'global_shape', None)}, expected a Shard of {shape}")
            continue
        rows = -(-shape[0] // g.size)
        lo = min(rank * rows, shape[0])
        if v.offsets[0] != lo or v.local.shape[0] != min(shape[0], lo + rows) - lo:
            fails.append(f"{n}: block {v.local.shape} at {v.offsets} on rank {rank}")
    st = fsdp.optim_state_dict(opt)
    for n, shape in names.items():
        ent = st["state"].get(n, {})
        if not isinstance(ent.get("exp_avg"), Shard) or ent["exp_avg"].global_shape != shape:
            fails.append(f"optimizer state of {n} is not a Shard of {shape}: {ent}")
        if ent.get("step") != 1:
            fails.append(f"optimizer step of {n}: {ent.get('step')}")
    if st["param_groups"][0]["params"] != list(names):
        fails.append(f"param group names {st['param_groups'][0]['params']}")
    return fails


ROUND_TRIPS = [  # (saved by, world size) -> (loaded by, world size)
    (("fsdp:full_shard", 4), ("fsdp:full_shard", 3)),
    (("fsdp:full_shard", 4), ("ddp", 2)),
    (("fsdp:full_shard", 4), ("plain", 1)),
    (("fsdp:full_shard", 3), ("fsdp:full_shard", 4)),
    (("ddp", 2), ("fsdp:full_shard", 4)),
    (("plain", 1), ("fsdp:full_shard", 4)),
    (("fsdp:shard_grad_op", 2), ("fsdp:no_shard", 3)),
    (("fsdp:no_shard", 3), ("fsdp:shard_grad_op", 4)),
    (("fsdp:hybrid_shard", 4), ("fsdp:full_shard", 2)),
    (("fsdp:full_shard", 2), ("fsdp:hybrid_shard", 4)),
]


@pytest.fixture(scope="module")
def want() -> dict:
    return reference_params(3)


@pytest.mark.parametrize("saver,loader", ROUND_TRIPS, ids=lambda c: f"{c[0]}x{c[1]}")
def test_round_trip(saver: tuple, loader: tuple, want: dict, tmp_path) -> None:
    path = str(tmp_path / "ck" / "step-2")
    run_ranks("sim", saver[1], body_ckpt_segment, saver[0], 0, 2, None, path)
    got = run_ranks("sim", loader[1], body_ckpt_segment, loader[0], 2, 3, path, None)
    assert len(got) == loader[1]
    fails = compare_ranks(want, got, 1e-10, f"{saver} -> {loader}, then one more step")
    assert not fails, "\n".join(fails)


def test_state_dict_is_shards_at_global_names() -> None:
    per_rank = run_ranks("sim", 4, body_ckpt_sharded_layout)
    fails = [f"rank {r}: {f}" for r, fs in enumerate(per_rank) for f in fs]
    assert not fails, "\n".join(fails)


def _mpi_round_trip(rank: int, path: str) -> list[str]:
    """Save under FSDP on the whole world, load under FSDP and DDP on smaller sub-groups."""
    n = hpcdp.world_size()
    body_ckpt_segment(rank, "fsdp:full_shard", 0, 2, None, path)
    fails = []
    ref = reference_params(3)
    for kind, size in (("fsdp:full_shard", n - 1), ("ddp", max(1, n // 2)), ("fsdp:no_shard", n)):
        sub = hpcdp.new_group(list(range(size)))
        if rank < size:
            got = body_ckpt_segment(rank, kind, 2, 3, path, None, group=sub)
            fails += compare_ranks(ref, [None] * rank + [got], 1e-10, f"FSDP {n} -> {kind} {size}")
    return fails


@pytest.mark.mpi(min_size=2)
def test_round_trip_mpi(mpi_world) -> None:
    from ckpt_bodies import shared_dir

    d = shared_dir()
    try:
        per_rank = run_mpi(_mpi_round_trip, os.path.join(d, "step-2"))
    finally:
        hpcdp.barrier()
        if hpcdp.rank() == 0:
            shutil.rmtree(d, ignore_errors=True)
    fails = [f"rank {r}: {f}" for r, fs in enumerate(per_rank) for f in fs]
    assert not fails, "\n".join(fails)


# -- DESIGN.md's pattern: opt.state_dict() on FSDP shards -------------------------------------------
def _design_pattern(rank: int, path: str, save: bool) -> dict[str, np.ndarray]:
    """Save (or load) {"model": fsdp.state_dict(), "optim": opt.state_dict()} with shapes that divide
    evenly by 2 and 4 ranks: the optimizer state must be whole arrays at global names, not rank 0's
    piece passed off as the array."""
    from hpcdp.checkpoint import load, save as ck_save

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)).astype(np.float64)
    fsdp = FSDP(model)
    opt = optim.Adam(fsdp.parameters(), lr=0.1)
    x = np.linspace(-1, 1, 16).reshape(4, 4)
    out = fsdp(x)
    fsdp.backward(out - 1.0)
    opt.step()
    if save:
        ck_save(path, {"model": fsdp.state_dict(), "optim": opt.state_dict()})
    else:
        st = load(path, like={"model": fsdp.state_dict(), "optim": opt.state_dict()})
        fsdp.load_state_dict(st["model"])
        opt.load_state_dict(st["optim"])
    got = {}
    for name, entry in opt.state_dict()["state"].items():
        v = entry["exp_avg"]          # a Shard: this rank's rows of the global array
        got[name] = (v.offsets[0], np.array(v.local))
    return got


def test_optimizer_state_dict_on_shards_saves_global_arrays(tmp_path) -> None:
    path = str(tmp_path / "ck")
    saved = run_ranks("sim", 4, _design_pattern, path, True)
    loaded = run_ranks("sim", 2, _design_pattern, path, False)
    # After loading on 2 ranks each rank's shard equals the matching rows of what 4 ranks held.
    def whole(per_rank: list, name: str) -> np.ndarray:
        return np.concatenate([b for _, b in sorted(r[name] for r in per_rank)])

    assert set(saved[0]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    for name in saved[0]:
        np.testing.assert_array_equal(whole(loaded, name), whole(saved, name), err_msg=name)
        assert whole(saved, name).shape[0] == (8 if name.startswith("0.") else 4)

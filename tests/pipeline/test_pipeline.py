"""Pipeline runtime: every schedule equals the unpipelined model (sim, TCP, MPI), PP x DP, the
stage API. Failures and checkpoints are in test_pipeline_faults.py and test_pipeline_ckpt.py."""
from __future__ import annotations

import numpy as np
import pytest

import hpcdp
import hpcdp.pipeline as pp
from conftest import run_mpi, run_ranks
from hpcdp.testing import check
from hpcdp.testing.fixtures import World, worlds
from hpcdp import nn
from pipeline_bodies import body_parity, body_parity_cases, body_pp_dp, make_model

VARIANTS = [("gpipe", 1), ("1f1b", 1), ("zero_bubble", 1), ("interleaved_1f1b", 2)]
MICROBATCHES = (1, 2, 3, 8)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", worlds("sim-1", "sim-2", "sim-3", "sim-4", "mpi"), indirect=True)
@pytest.mark.parametrize("schedule,v", VARIANTS, ids=[n for n, _ in VARIANTS])
def test_parity(world: World, schedule: str, v: int) -> None:
    # p stages on p spawned ranks; under mpirun, on sub-groups of the first p ranks (p >= 2)
    for p in range(2, world.size + 1) if world.is_mpi else [world.size]:
        for m in MICROBATCHES:
            check(world.run(body_parity, schedule, p, m, v))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["mse", "ce_ignore"])
def test_loss_scaling_sim(kind: str) -> None:
    # mean over non-ignored targets (uneven per microbatch), label smoothing, MSE
    for schedule, v in VARIANTS:
        check(run_ranks("sim", 3, body_parity, schedule, 3, 8, v, kind))


@pytest.mark.timeout(300)
def test_parity_tcp() -> None:
    cases = [(schedule, 3, 3, v) for schedule, v in VARIANTS]
    check(run_ranks("tcp", 3, body_parity_cases, cases, timeout=60))


@pytest.mark.timeout(120)
def test_pp_dp_sim() -> None:
    for schedule in ("1f1b", "zero_bubble"):
        check(run_ranks("sim", 4, body_pp_dp, schedule, 2))   # 2 stages x 2 replicas
    check(run_ranks("sim", 3, body_pp_dp, "gpipe", 1))         # 1 stage x 3 replicas


@pytest.mark.timeout(120)
def test_pp_dp_loss_scaling_across_replicas_sim() -> None:
    # replicas hold different numbers of ignored targets: the mean is over the global batch's
    check(run_ranks("sim", 4, body_pp_dp, "1f1b", 2, 2, 1, "ce_ignore"))
    check(run_ranks("sim", 3, body_pp_dp, "zero_bubble", 1, 2, 1, "ce_ignore"))


# Not merged with test_pp_dp_sim: the layouts follow the MPI world's size (size // 2 stages,
# every schedule), where the spawned test picks fixed layouts on 3 and 4 ranks.
@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
def test_pp_dp_mpi(mpi_world) -> None:
    # -n 4: 2 stages x 2 replicas (and 4 x 1); -n 2: 1 stage x 2 replicas (and 2 x 1)
    for schedule in ("1f1b", "zero_bubble", "gpipe"):
        check(run_mpi(body_pp_dp, schedule, mpi_world.size // 2))
    check(run_mpi(body_pp_dp, "interleaved_1f1b", mpi_world.size // 2, 2, 2))
    # replicas with different numbers of ignored targets: still the global mean
    check(run_mpi(body_pp_dp, "1f1b", mpi_world.size // 2, 2, 1, "ce_ignore"))


def _body_stage_api(rank: int) -> list[str]:
    model = make_model()
    names = [n for n, _ in model.named_parameters()]
    stage = pp.PipelineStage(model, virtual=2)
    fails = []
    mine = [n for n, _ in stage.named_parameters()]
    everyone = hpcdp.all_gather_object(mine)
    if sorted(n for ns in everyone for n in ns) != sorted(names):
        fails.append(f"unsplit names: {everyone} vs {names}")
    if any(set(a) & set(b) for i, a in enumerate(everyone) for b in everyone[i + 1:]):
        fails.append("a parameter on two ranks")
    if stage.stage_ids != (rank, rank + 2):
        fails.append(f"stage ids {stage.stage_ids}")
    if set(stage.local_state_dict()) != set(mine):   # the model has no buffers
        fails.append("local_state_dict keys")
    sd = stage.state_dict()
    if set(sd) != set(model.state_dict()):
        fails.append("state_dict must name every entry of the model")
    full = [n for n, s in sd.items() if s.local.size]
    if sorted(full) != sorted(stage.local_state_dict()):
        fails.append("only this rank's entries are whole blocks")
    if any(s.local.size for s in stage.state_dict(owner=False).values()):
        fails.append("owner=False must give empty blocks")
    return fails


def test_stage_api_sim() -> None:
    check(run_ranks("sim", 2, _body_stage_api))


def _body_stage_errors(rank: int) -> list[str]:
    fails = []
    model = make_model()
    for kwargs, needle in (({"split_points": [3]}, "split_points"),
                           ({"split_points": [5, 2, 7]}, "split_points"),
                           ({"virtual": 5}, "cannot fill")):
        try:
            pp.PipelineStage(model, **kwargs)
            fails.append(f"{kwargs}: no error")
        except ValueError as exc:
            if needle not in str(exc):
                fails.append(f"{kwargs}: {exc}")
    try:
        pp.PipelineStage(nn.Linear(2, 2))
        fails.append("a non-Sequential was accepted")
    except TypeError:
        pass
    # ranks that build different models raise together instead of hanging
    other = make_model() if rank == 0 else nn.Sequential(*list(make_model().children())[:-1],
                                                          nn.Linear(6, 4, dtype=np.float64))
    try:
        pp.PipelineStage(other)
        fails.append("different models were accepted")
    except hpcdp.CollectiveMismatchError:
        pass
    stage = pp.PipelineStage(make_model(), split_points=[2, 5, 7])
    if stage.bounds != ((0, 2), (2, 5), (5, 7), (7, 9)):
        fails.append(f"bounds {stage.bounds}")
    for sched, needle in ((pp.schedule("1f1b", 3, 4), "for 3 ranks"),
                          (pp.Schedule.from_lists([["0F0"]] + [[]] * 3, 1), "not valid")):
        try:
            pp.Pipeline(stage, schedule=sched, n_microbatches=sched.microbatches, loss_fn=nn.MSELoss())
            fails.append(f"schedule accepted: {needle}")
        except ValueError as exc:
            if needle not in str(exc):
                fails.append(f"{needle}: {exc}")
    try:
        pp.Pipeline(stage, schedule="1f1b", n_microbatches=2, loss_fn=nn.MSELoss(reduction="none"))
        fails.append("reduction='none' accepted")
    except ValueError:
        pass
    # a rank outside the stage group has no stages (it used to build all of them as "stage -1")
    sub = hpcdp.get_default_group().new_group([0])
    if not sub.is_member:
        try:
            pp.PipelineStage(make_model(), group=sub)
            fails.append("a non-member built stages")
        except ValueError as exc:
            if "not a member" not in str(exc):
                fails.append(f"non-member: {exc}")
    return fails


@pytest.mark.timeout(120)
def test_stage_and_pipeline_errors_sim() -> None:
    check(run_ranks("sim", 4, _body_stage_errors))


def test_loss_weights() -> None:
    from hpcdp.pipeline._runtime import loss_weights

    ys = [np.array([0, 1, -100, -100]), np.array([1, 1, 1, 1])]
    assert loss_weights(nn.CrossEntropyLoss(), ys) == [2 / 6, 4 / 6]
    assert loss_weights(nn.CrossEntropyLoss(reduction="sum"), ys) == [1.0, 1.0]
    assert loss_weights(nn.MSELoss(), [np.zeros(3)] * 4) == [0.25] * 4
    # every target ignored: equal shares (the loss is nan, as torch's)
    assert loss_weights(nn.CrossEntropyLoss(), [np.array([-100])] * 2) == [0.5, 0.5]


def test_wire_messages() -> None:
    from types import SimpleNamespace

    from hpcdp.pipeline._channel import (
        ABORTED, CTRL_BYTES, FAILED, Channel, ControlMessage, decode_meta, encode_meta,
    )

    msg = ControlMessage(FAILED, 2, 3, 2, float("nan"), "2F3", "ValueError: " + "x" * 2000)
    buf = msg.encode()
    assert buf.nbytes == CTRL_BYTES
    back = ControlMessage.decode(buf, 2)
    assert (back.kind, back.stage, back.mb, back.rank, back.action) == (FAILED, 2, 3, 2, "2F3")
    assert back.message.startswith("ValueError: xxx") and len(back.message) < CTRL_BYTES
    assert back.describe().startswith("stage 2 (rank 2) failed in action 2F3 (forward of microbatch 3)")
    fwd = ControlMessage(ABORTED, 0, -1, 0, float("nan"), "the input check", "ValueError: bad")
    assert ControlMessage.decode(fwd.encode(), 1).describe() == \
        "stage 0 (rank 0) failed in the input check: ValueError: bad"
    junk = np.full(CTRL_BYTES, 255, np.uint8)   # a peer that sends garbage is a failed peer
    bad = ControlMessage.decode(junk, 3)
    assert bad.kind == FAILED and bad.rank == 3 and "malformed" in bad.message

    x = np.zeros((2, 3, 4), np.float32)
    assert decode_meta(encode_meta(x), "t") == ((2, 3, 4), np.dtype(np.float32))
    for meta in ([99, 0] + [0] * 10, [1, 99] + [0] * 10, [2, 10, 5, -1] + [0] * 8,
                 [1, 10, 2**50] + [0] * 9):
        with pytest.raises(hpcdp.HpcdpError, match="malformed"):
            decode_meta(np.array(meta, np.int64), "t")
    # a transport with few tags: the pipeline says so instead of wrapping tags around
    comm = SimpleNamespace(rank=0, size=2, backend=SimpleNamespace(max_tag=100), name="g")
    with pytest.raises(ValueError, match="need tags up to"):
        Channel(comm, 4, 100, 1.0)
    assert Channel(comm, 2, 20, 1.0).data_tag(True, 1, 19) <= 100


@pytest.mark.timeout(120)
def test_trace_timeline_has_pipeline_events_sim(tmp_path) -> None:
    import json

    from hpcdp import trace
    from hpcdp.pipeline._actions import Action
    from pipeline_bodies import body_traced_step

    trace.reset()
    trace.enable(str(tmp_path))
    try:
        per_rank = run_ranks("sim", 2, body_traced_step, "zero_bubble")
    finally:
        trace.disable()      # closes the timelines
        trace.reset()
    for r, actions in enumerate(per_rank):
        with open(tmp_path / f"trace-rank{r}.json") as fh:
            events = [e for e in json.load(fh)["traceEvents"] if e.get("cat") == "pipeline"]
        got = [(e["name"], e["args"]["stage"], e["args"]["mb"]) for e in events]
        want = [(a.op.description, a.stage, a.mb) for a in map(Action.parse, actions)]
        assert got == want, (r, got)
        assert all(e["ph"] == "X" and e["dur"] >= 0 for e in events)


def test_shape_messages_round_trip_and_refuse_unsendable_dtypes() -> None:
    from hpcdp.errors import HpcdpError
    from hpcdp.pipeline._channel import decode_meta, encode_meta

    assert decode_meta(encode_meta(np.zeros((2, 3), np.float32)), "t") == ((2, 3), np.dtype(np.float32))
    with pytest.raises(TypeError, match="dtype datetime64"):
        encode_meta(np.zeros(2, "datetime64[s]"))
    bad = encode_meta(np.zeros(2))
    bad[2] = -5                                   # a damaged peer message: refused before any allocation
    with pytest.raises(HpcdpError, match="malformed shape message"):
        decode_meta(bad, "t")

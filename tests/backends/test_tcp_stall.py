"""A peer that stops in the middle of a message (SIGSTOP: swapped out, a hung node) never holds
a waiting rank past its timeout, and a receive given up on is not written into afterwards."""
from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest

import hpcdp
from hpcdp.testing.fixtures import World, worlds
from hpcdp.errors import HpcdpError
from tcp_helpers import stopped

MID = 16 << 20  # several times what the socket buffers hold


def _stop_half_way() -> None:
    """Make this rank's next send of ``MID`` bytes stop itself (SIGSTOP) after half the payload:
    deterministic, unlike a timer racing the transfer. SIGCONT from a peer resumes it."""
    from hpcdp.backends.tcp import _wire as wire

    tr = hpcdp.get_default_group().backend.transport
    whole = tr._write

    def half_then_stop(peer, hdr, view) -> None:
        if view.nbytes != MID:
            return whole(peer, hdr, view)
        kind, channel, tag, sig = hdr
        peer.sock.sendall(wire.pack_header(kind, 0, channel, tag, view.nbytes, sig))
        peer.sock.sendall(view[:MID // 2])
        os.kill(os.getpid(), signal.SIGSTOP)
        peer.sock.sendall(view[MID // 2:])

    tr._write = half_then_stop


def _stop_after(nbytes: int) -> None:
    """Make this rank stop itself (SIGSTOP) once ``nbytes`` more have gone out on its sockets:
    in the middle of the collective called next, at a point no timer races (a timer of 0.02 s
    can fire, on a loaded machine, after the whole transfer)."""
    tr = hpcdp.get_default_group().backend.transport
    whole, left = tr._put, [nbytes]

    def put_then_stop(peer, data, channel) -> None:
        whole(peer, data, channel)
        if left[0] > 0:
            left[0] -= len(data)
            if left[0] <= 0:
                os.kill(os.getpid(), signal.SIGSTOP)

    tr._put = put_then_stop


def stalled_sender(rank: int, out: str, what: str) -> str:
    data = np.full(MID, 3, np.uint8) if what == "recv" else np.ones(8 * MID // 8)
    pids = hpcdp.all_gather_object(os.getpid())
    hpcdp.barrier()
    if rank == 1:
        if what == "recv":
            _stop_half_way()
            hpcdp.send(data, 0)
        else:
            _stop_after(MID // 2)
            hpcdp.allreduce(data, timeout=60)
        return "not stopped"
    t0 = time.monotonic()
    try:
        if what == "recv":
            hpcdp.recv(np.zeros(MID, np.uint8), 1, timeout=2)
        else:
            hpcdp.allreduce(data, timeout=2)
        result = {"error": None}
    except hpcdp.CommTimeoutError as exc:
        result = {"error": "timeout", "message": str(exc)}
    except Exception as exc:  # noqa: BLE001 - reported to the test
        result = {"error": type(exc).__name__, "message": str(exc)}
    result["elapsed"] = time.monotonic() - t0
    with open(out, "w") as f:
        json.dump(result, f)
    os.kill(pids[1], signal.SIGKILL)  # still stopped: it ends here, not at spawn's join_timeout
    return "done"


@pytest.mark.parametrize("what", ["recv", "allreduce"])
def test_peer_stopped_mid_message_times_out_on_time(what: str, tmp_path) -> None:
    out = str(tmp_path / "rank0.json")
    t0 = time.monotonic()
    # rank 1 stays stopped, never reporting, until rank 0 has written its result and kills it
    with pytest.raises(HpcdpError, match=r"tcp rank 1 exited with code -9 without reporting"):
        hpcdp.spawn(stalled_sender, 2, backend="tcp", args=(out, what), timeout=30,
                    join_timeout=20)
    assert time.monotonic() - t0 < 30
    with open(out) as f:
        res = json.load(f)
    assert res["error"] == "timeout", res
    assert 1.9 <= res["elapsed"] <= 3.5, res
    assert ("recv(src=1" if what == "recv" else "allreduce #") in res["message"], res


class _Interrupt(Exception):
    pass


def resumed_sender(rank: int, mode: str) -> dict:
    """Rank 1 stops itself half-way through a send; rank 0 gives up on the receive (timeout) or is
    interrupted in it (a signal handler that raises, as Ctrl-C does), then wakes rank 1."""
    pids = hpcdp.all_gather_object(os.getpid())
    if rank == 1:
        data = np.full(MID, 3, np.uint8)
        _stop_half_way()
        hpcdp.barrier()
        hpcdp.send(data, 0, tag=7)
        hpcdp.send(np.full(10, 5.0), 0, tag=8)
        hpcdp.barrier(timeout=60)
        return {}
    out: dict = {}
    buf = np.zeros(MID, np.uint8)
    work = hpcdp.irecv(buf, 1, tag=7)  # posted before the message comes: it lands in buf
    hpcdp.barrier()
    # rank 1 has stopped half-way (it stops once this rank took half the message): waited for,
    # so the give-up below is mid-message however late rank 1 is scheduled
    deadline = time.monotonic() + 30
    while not stopped(pids[1]) and time.monotonic() < deadline:
        time.sleep(0.005)
    try:
        if mode == "timeout":
            work.wait(1.0)
        else:
            old = signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(_Interrupt()))
            signal.setitimer(signal.ITIMER_REAL, 1.0)
            try:
                work.wait(30)
            finally:
                signal.signal(signal.SIGALRM, old)
        out["first"] = "completed"
    except hpcdp.CommTimeoutError:
        out["first"] = "timeout"
    except _Interrupt:
        out["first"] = "interrupted"
    out["in_buf_at_give_up"] = int(np.count_nonzero(buf))
    os.kill(pids[1], signal.SIGCONT)
    if mode == "timeout":  # the message waits, whole, for a new receive
        again = hpcdp.recv(np.zeros(MID, np.uint8), 1, tag=7, timeout=30)
        out["again_ok"] = bool(np.all(again == 3))
    out["next"] = hpcdp.recv(np.zeros(10), 1, tag=8, timeout=30).tolist()
    out["in_buf_later"] = int(np.count_nonzero(buf))
    hpcdp.barrier(timeout=30)
    return out


def test_receive_abandoned_mid_message_keeps_stream_and_buffer() -> None:
    r0, _ = hpcdp.spawn(resumed_sender, 2, backend="tcp", args=("timeout",), timeout=60,
                        join_timeout=90)
    assert r0["first"] == "timeout", r0
    assert 0 < r0["in_buf_at_give_up"] < MID, r0  # it was stopped mid-message
    assert r0["in_buf_later"] == r0["in_buf_at_give_up"], r0  # nothing written after giving up
    assert r0["again_ok"] and r0["next"] == [5.0] * 10, r0


def test_receive_interrupted_mid_message_loses_no_byte() -> None:
    r0, _ = hpcdp.spawn(resumed_sender, 2, backend="tcp", args=("interrupt",), timeout=60,
                        join_timeout=90)
    assert r0["first"] == "interrupted" and 0 < r0["in_buf_at_give_up"] < MID, r0
    # the interrupted receive stays posted: its message completes into it, and the stream goes
    # on in step (the next message arrives intact)
    assert r0["next"] == [5.0] * 10 and r0["in_buf_later"] == MID, r0


def late_message(rank: int) -> list[str]:
    """rank 0 gives up on a receive; the message that comes later must not land in its buffer."""
    fails: list[str] = []
    if rank == 0:
        buf = np.zeros(1000)
        try:
            hpcdp.recv(buf, 1, tag=7, timeout=0.5)
            fails.append("recv returned without a sender")
        except hpcdp.CommTimeoutError:
            pass
        hpcdp.barrier()  # now rank 1 sends the late message
        hpcdp.barrier()
        fresh = hpcdp.recv(np.zeros(1000), 1, tag=7, timeout=10)  # a new receive gets it
        if buf.any():
            fails.append("the late message was written into the abandoned buffer")
        if not np.all(fresh == 1):
            fails.append("a new receive did not get the late message")
    else:
        hpcdp.barrier()
        # isend: under MPI a blocking send of 8 KB may wait for the matching receive
        w = hpcdp.isend(np.ones(1000), 0, tag=7) if rank == 1 else None
        hpcdp.barrier()
        if w is not None:
            w.wait(10)
    return fails


@pytest.mark.parametrize("world", worlds("tcp-2", "sim-2", "mpi"), indirect=True)
def test_abandoned_receive_is_not_written_into(world: World) -> None:
    res = world.run(late_message, timeout=30, join_timeout=60)
    assert res == [[]] * world.size, res

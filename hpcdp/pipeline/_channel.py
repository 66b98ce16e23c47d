"""The point-to-point traffic of one ``Pipeline``: tags, the first step's shape exchange, waits that
notice a failed peer, and the end-of-step handshake that carries the loss or the failure.

Every ``Pipeline`` talks on a communicator of its own (``new_group`` at construction), so its
tags cannot match anyone else's messages, nor those of an earlier pipeline that failed mid-step.

Tags: 0 is the control channel; ``1 + 2 s + d`` carries the shape of stage ``s``'s output (d=0) the
first time it is sent; data tags follow, one per (direction, producing stage, microbatch), so every
transfer of a step is unambiguous and receives can be posted in any order.

Control messages, exactly one from every rank to every other rank per step (so after a step that
went well the receives posted for them at its start have all completed): DONE (with the loss, from the last stage's rank),
FAILED (this rank raised: its stage, action, microbatch and message) or ABORTED (this rank stopped
because a peer failed; it forwards the root cause). Every wait polls them, so a failure anywhere
makes every rank raise within one compute action instead of blocking in a receive. A rank whose
account never came (its process died, its message was garbled) is described as having failed in
an unknown action, with the reason, not a bare ``?``.

Deadlines: a wait gives up after the timeout; the control messages that then tell the peers go
out without a second timeout of their own (``drain``), so the error reaches the user after one
timeout, with its own class.
"""
from __future__ import annotations

import struct
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._arrays import SUPPORTED_DTYPES
from ..errors import CommTimeoutError, HpcdpError, PeerFailureError
from ._actions import Action

__all__ = ["Channel", "ControlMessage", "PeerAborted", "DONE", "FAILED", "ABORTED"]

DONE, FAILED, ABORTED = 0, 1, 2
CTRL_TAG = 0
_CTRL = struct.Struct("<iiiid24sH")       # kind, stage, mb, rank, loss, action, message length
CTRL_BYTES = 512
_MSG_MAX = CTRL_BYTES - _CTRL.size
_META_LEN = 12                           # [ndim, dtype index, shape (up to 10 axes)]
_DTYPES = tuple(d.name for d in SUPPORTED_DTYPES)
#: longest a wait blocks on its transfer before it looks at the control messages again
_SLICE = 0.01
#: pause between tests where there is nothing to block on
_NAP = 1e-4
#: longest ``drain`` lets the failure reports go out after the error's own deadline passed: sends
#: to live peers complete at once; one to a stalled peer stays with the transport, which delivers
#: it when that peer takes it (MPI leaves a send pending until the receiver calls into MPI)
_DRAIN_GRACE = 0.1
#: the action field of a failure whose action and microbatch nobody knows (message says why)
UNKNOWN = "?"


@dataclass(frozen=True)
class ControlMessage:
    kind: int
    stage: int
    mb: int
    rank: int
    loss: float
    action: str
    message: str

    def encode(self) -> np.ndarray:
        msg = self.message.encode("utf-8", "replace")[:_MSG_MAX]
        head = _CTRL.pack(self.kind, self.stage, self.mb, self.rank, self.loss,
                          self.action.encode("utf-8", "replace")[:24], len(msg))
        buf = np.zeros(CTRL_BYTES, np.uint8)
        buf[: len(head) + len(msg)] = np.frombuffer(head + msg, np.uint8)
        return buf

    @classmethod
    def decode(cls, buf: np.ndarray, src: int) -> ControlMessage:
        """Read a peer's control message; anything malformed becomes a FAILED naming the sender."""
        raw = buf.tobytes()
        try:
            kind, stage, mb, rank, loss, action, n = _CTRL.unpack_from(raw)
            if kind not in (DONE, FAILED, ABORTED) or n > _MSG_MAX:
                raise ValueError("bad control header")
            text = raw[_CTRL.size: _CTRL.size + n].decode("utf-8", "replace")
            return cls(kind, stage, mb, rank, loss, action.rstrip(b"\0").decode("utf-8", "replace"), text)
        except (struct.error, ValueError):
            return cls(FAILED, -1, -1, src, float("nan"), UNKNOWN,
                       "its pipeline control message was malformed, so what it was doing is not known")

    def describe(self) -> str:
        """``"stage 2 (rank 2) failed in action 2F3 (forward of microbatch 3): ValueError: boom"``;
        ``"rank 1 failed in an unknown action and microbatch: <why>"`` when no account came."""
        where = f"stage {self.stage} (rank {self.rank})" if self.stage >= 0 else f"rank {self.rank}"
        if not self.action or self.action == UNKNOWN:
            return f"{where} failed in an unknown action and microbatch: {self.message}"
        try:
            a = Action.parse(self.action)
            what = f"action {a} ({a.op.description} of microbatch {a.mb})"
        except ValueError:
            what = self.action
        return f"{where} failed in {what}: {self.message}"


class PeerAborted(HpcdpError):
    """Raised inside a step when a peer's control message says the step failed."""

    def __init__(self, root: ControlMessage, via: int) -> None:
        super().__init__(root.describe())
        self.root = root
        self.via = via


def encode_meta(x: Any) -> np.ndarray:
    if x.ndim > _META_LEN - 2:
        raise ValueError(f"pipeline: activations with {x.ndim} axes (at most {_META_LEN - 2})")
    name = np.dtype(x.dtype).name
    if name not in _DTYPES:
        raise TypeError(f"pipeline: activations of dtype {name} cannot be sent (supported: {', '.join(_DTYPES)})")
    meta = np.zeros(_META_LEN, np.int64)
    meta[0] = x.ndim
    meta[1] = _DTYPES.index(name)
    meta[2: 2 + x.ndim] = x.shape
    return meta


def decode_meta(meta: np.ndarray, where: str) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype from a peer's meta message, checked before anything is allocated."""
    ndim, code = int(meta[0]), int(meta[1])
    if not 0 <= ndim <= _META_LEN - 2 or not 0 <= code < len(_DTYPES):
        raise HpcdpError(f"{where}: malformed shape message (ndim {ndim}, dtype code {code})")
    shape = tuple(int(d) for d in meta[2: 2 + ndim])
    if any(d < 0 or d > 2**40 for d in shape):
        raise HpcdpError(f"{where}: malformed shape message {shape}")
    return shape, np.dtype(_DTYPES[code])


class Channel:
    """Tags, waits and control messages of one pipeline on its own group ``comm``."""

    def __init__(self, comm: Any, n_stages: int, microbatches: int, timeout: float) -> None:
        self.comm = comm
        self.rank = comm.rank
        self.size = comm.size
        self.n_stages = n_stages
        self.m = microbatches
        self.timeout = float(timeout)
        self._data_base = 1 + 2 * n_stages
        top = self._data_base + 2 * n_stages * microbatches - 1
        max_tag = int(comm.backend.max_tag)  # the transport's capability (MPI: its TAG_UB)
        if top > max_tag:
            raise ValueError(f"Pipeline: {n_stages} stages x {microbatches} microbatches need tags up "
                             f"to {top}, but this transport allows {max_tag}; use fewer microbatches")
        self._ctrl: dict[int, tuple[Any, np.ndarray]] = {}
        self._got: dict[int, ControlMessage] = {}
        self.sends: list[tuple[Any, Any]] = []       # (work, buffer kept alive until it completes)
        self.ctrl_sends: list[tuple[Any, Any]] = []
        self.told = False   # whether this step's control message went out

    def _where(self) -> str:
        return f"pipeline on group {self.comm.name} (rank {self.rank} of {self.size})"

    # -- tags -----------------------------------------------------------------------------------
    def data_tag(self, grad: bool, producer: int, mb: int) -> int:
        return self._data_base + 2 * (mb * self.n_stages + producer) + int(grad)

    def meta_tag(self, producer: int) -> int:
        return 1 + 2 * producer

    # -- control ----------------------------------------------------------------------------------
    def begin_step(self) -> None:
        self._got = {}
        self._ctrl = {}
        self.told = False
        for peer in range(self.size):
            if peer != self.rank:
                buf = np.zeros(CTRL_BYTES, np.uint8)
                self._ctrl[peer] = (self.comm.irecv(buf, peer, CTRL_TAG), buf)

    def poll_control(self) -> None:
        """Collect arrived control messages; raise ``PeerAborted`` if one reports a failure.

        A relayed account (rank A says rank B failed) waits briefly for B's own message, which
        names the action and the error; which of the two a poll sees first is a race.
        """
        first: PeerAborted | None = None
        for peer in list(self._ctrl):
            got = self._take(peer)
            if got is not None and (first is None or (first.via != first.root.rank
                                                      and got.via == got.root.rank)):
                first = got
        if first is None:
            return
        root = first.root.rank
        if first.via != root and root in self._ctrl:
            deadline = time.monotonic() + min(1.0, self.timeout)
            while root in self._ctrl and time.monotonic() < deadline:
                own = self._take(root)
                if own is not None and own.root.rank == root and own.root.action != UNKNOWN:
                    raise own
                time.sleep(_NAP)
        raise first

    def _take(self, peer: int) -> PeerAborted | None:
        """Peer's control message if it has come: None for DONE or nothing yet, else the
        ``PeerAborted`` to raise (a transport error on it means the peer died without a word)."""
        work, buf = self._ctrl[peer]
        try:
            done = work.is_completed()
            if done:
                work.wait(0)
        except HpcdpError as exc:
            del self._ctrl[peer]
            msg = ControlMessage(FAILED, -1, -1, peer, float("nan"), UNKNOWN,
                                 f"it sent no account of its failure before its control channel "
                                 f"broke ({type(exc).__name__}: {exc})")
            self._got[peer] = msg
            return PeerAborted(msg, peer)
        if not done:
            return None
        del self._ctrl[peer]
        msg = ControlMessage.decode(buf, peer)
        self._got[peer] = msg
        return None if msg.kind == DONE else PeerAborted(msg, peer)

    def tell_all(self, msg: ControlMessage) -> None:
        """Send ``msg`` to every other rank (small: never blocks for long).

        Every peer is tried, even after one cannot be reached (that error is raised at the end),
        so a failure report still gets to the others when one of them is gone.
        """
        buf = msg.encode()
        self.told = True
        error: HpcdpError | None = None
        for peer in range(self.size):
            if peer != self.rank:
                try:
                    self.ctrl_sends.append((self.comm.isend(buf, peer, CTRL_TAG), buf))
                except HpcdpError as exc:
                    error = error or exc
        if error is not None:
            raise error

    def finish(self, loss: float) -> float:
        """End a step that went well here: DONE to every peer, wait for theirs; return the loss
        the last stage's rank sent (or ``loss`` if that is this rank)."""
        self.tell_all(ControlMessage(DONE, -1, -1, self.rank, loss, "", ""))
        deadline = time.monotonic() + self.timeout
        while True:
            self.poll_control()
            self.progress_sends()
            if not self._ctrl:
                break
            now = time.monotonic()
            if now >= deadline:
                late = sorted(self._ctrl)
                raise CommTimeoutError(f"{self._where()}: the end-of-step handshake did not complete "
                                       f"within {self.timeout:g} s: no word from rank(s) {late}")
            self._block(next(iter(self._ctrl.values()))[0], min(_SLICE, deadline - now))
        self.wait_sends()
        losses = [m.loss for m in self._got.values() if not np.isnan(m.loss)]
        return losses[0] if losses and np.isnan(loss) else loss

    def drain(self) -> None:
        """After a failure: give this step's control messages ``_DRAIN_GRACE`` seconds to go out,
        then leave the rest to the transport (never cancelled, see ``abandon``). Not a timeout
        of its own: the error being raised has waited its deadline already, and a report to a
        stalled peer stays pending until that peer takes it. Peers' control messages are not
        waited for: every other rank learns of the failure from this rank's message, and this
        pipeline is closed for good."""
        deadline = time.monotonic() + min(_DRAIN_GRACE, self.timeout)
        pending = [w for w, _ in self.ctrl_sends]
        while pending:
            pending = [w for w in pending if not _settled(w)]
            now = time.monotonic()
            if not pending or now >= deadline:
                break
            self._block(pending[0], min(_SLICE, deadline - now))
        self.abandon(pending + [w for w, _ in self._ctrl.values()] + [w for w, _ in self.sends])
        self._ctrl = {}
        self.ctrl_sends = []
        self.sends = []

    # -- transfers and waits --------------------------------------------------------------------
    def isend(self, x: Any, dst: int, tag: int) -> None:
        self.sends.append((self.comm.isend(x, dst, tag), x))

    def progress_sends(self) -> None:
        if self.sends:
            self.sends = [(w, b) for w, b in self.sends if not w.is_completed()]
        if self.ctrl_sends:
            self.ctrl_sends = [(w, b) for w, b in self.ctrl_sends if not w.is_completed()]

    def wait(self, work: Any, what: str, peer: int | None = None) -> Any:
        """``work.wait()``, but a failed peer raises ``PeerAborted`` and the group timeout a
        ``CommTimeoutError`` naming ``what``, this rank and the ``peer`` that did not answer.

        It blocks on the transfer itself (the transport wakes it as soon as the data is in), in
        slices of at most ``_SLICE`` seconds, and looks at the control messages between slices.
        """
        start = time.monotonic()
        deadline = start + self.timeout
        while not work.is_completed():
            self.poll_control()
            self.progress_sends()
            now = time.monotonic()
            if now >= deadline:
                silent = "" if peer is None else f": rank {peer} did not answer"
                raise CommTimeoutError(f"{self._where()}: {what} did not complete within "
                                       f"{self.timeout:g} s{silent}")
            self._block(work, min(_SLICE, deadline - now))
        try:
            return work.wait(0)
        except HpcdpError:
            self._explain()
            raise

    def _explain(self) -> None:
        """A transfer failed (its peer died or left): if that peer said why before it went, raise
        ``PeerAborted`` with its own account rather than the transport's."""
        deadline = time.monotonic() + min(1.0, self.timeout)
        while self._ctrl and time.monotonic() < deadline:
            self.poll_control()
            time.sleep(_NAP)

    @staticmethod
    def _block(work: Any, seconds: float) -> None:
        """Wait up to ``seconds`` for ``work`` without giving it up on timeout (``wait_for``;
        ``Work.wait`` would abandon what did not complete)."""
        try:
            work.wait_for(seconds)
        except HpcdpError:
            pass   # kept by the Work: the next is_completed()/wait() reports it

    def wait_sends(self) -> None:
        deadline = time.monotonic() + self.timeout
        while self.sends or self.ctrl_sends:
            self.progress_sends()
            if self.sends or self.ctrl_sends:
                self.poll_control()
                self._pause(deadline, f"sending {len(self.sends) + len(self.ctrl_sends)} message(s)")

    def _pause(self, deadline: float, what: str) -> None:
        if time.monotonic() >= deadline:
            raise CommTimeoutError(f"{self._where()}: {what} did not complete within "
                                   f"{self.timeout:g} s")
        time.sleep(_NAP)

    def abandon(self, works: list[Any]) -> None:
        """Let go of transfers of a failed step: polled once, then dropped, never waited for.

        Not cancelled either: the transport keeps their buffers until they complete or the
        process exits (a late message then lands in live memory), and the pipeline that posted
        them is closed for good, so nothing can confuse a late message with a new one. (Open MPI
        4.1 crashes when a receive is cancelled twice, as a timeout and the exit handler would.)
        """
        for w in works:
            try:
                w.is_completed()
            except HpcdpError:
                pass


def _settled(work: Any) -> bool:
    """Whether ``work`` completed or failed (a failed send is given up like a completed one)."""
    try:
        return bool(work.is_completed())
    except HpcdpError:
        return True


def peer_failure(where: str, exc: PeerAborted, ranks: tuple[int, ...]) -> PeerFailureError:
    """The error a rank raises when another stage failed."""
    root = exc.root
    glob = ranks[root.rank] if 0 <= root.rank < len(ranks) else root.rank
    return PeerFailureError(f"{where}: {root.describe()}", peers=[glob])

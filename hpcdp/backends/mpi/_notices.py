"""The MPI backend's side channel: "left" notices, roll calls, and MPI errors as hpcdp's.

Each group has a third communicator with a receive always posted on it. A rank that gives up on a
collective (timeout, MPI error, exit, finalize) sends every other member a "left" notice, so they
fail at once with ``PeerFailureError`` instead of waiting a timeout of their own; a rank whose
deadline passes asks the others whether they joined the call, to say who did not arrive.
Checking for a notice is one read of the posted buffer, which MPI fills during the progress our
own calls make: cheap enough for the small-message path to do on every call.

Messages are 32 int64 words: magic, kind, collective index, sender's world rank, nonce, text
length, then up to 208 bytes of text. The index counts collectives posted on the group, the same
on every rank, so a notice about call #7 fails calls #7 and later, never earlier ones. A "died"
notice (``report_death``: the rank's main thread ended in an uncaught exception, sent from the
excepthook ``hpcdp.init`` installs) fails every later wait of the group, point to point included:
plain ``mpirun python train.py`` peers learn within milliseconds who died of what. A roll call's
answer carries the name of the operation the answering rank has pending at the asked index, so a
timeout says which operation each rank is in, not only that each reached the call. A "waiting"
notice (``tell_waiting``) carries what a blocked rank waits for, written by the collectives
layer's watchdog; the newest one from each rank is kept process-wide (``WAITING``), so a rank
blocked in any group can name a deadlock cycle.
"""
from __future__ import annotations

import itertools
import time
from typing import Any

import numpy as np

from ...errors import CollectiveMismatchError, HpcdpError, PeerFailureError
from . import _requests as _rq

__all__ = ["Notices", "ROLL_CALL_WAIT", "report_death", "WAITING", "RESTART", "BROKEN_ADVICE"]

_MAGIC = 0x68706364704E4F54  # "hpcdpNOT"
_LEFT, _ASK, _ANSWER, _DIED, _WAITING = 1, 2, 3, 4, 5
_NOTICE_TAG, _ANSWER_TAG = 0, 1
_TEXT_AT, _WORDS = 48, 32
#: the way on after a failure MPI cannot undo: an MPI process cannot be initialised again, so
#: hpcdp.finalize() and hpcdp.init() do not give a clean world
RESTART = "restart the job (MPI cannot be initialised again within a process)"
#: the way on once a group refuses collectives (``MPIBackend.broken_advice``)
BROKEN_ADVICE = ("MPI cannot cancel a collective, so this group cannot run collectives any more "
                 "(new_group on it is one too): make new groups from a group that still works "
                 "(hpcdp.new_group on the default group, if this is not it), else " + RESTART)
#: world rank -> the newest "waiting" notice it sent this process (any group's channel)
WAITING: dict[int, tuple[float, str]] = {}
#: seconds a rank whose deadline passed waits for the others to say whether they joined (0.2
#: missed an answer now and then with 4 processes on 2 busy cores, and 0.5 once in a full
#: ``make test``, 2 ranks beside the test workers: a wrong diagnosis, not a hang). Paid only on
#: a timeout's error path, and in full only when a peer cannot answer at all.
ROLL_CALL_WAIT = 2.0


class Notices:
    """One group's side channel; the backend holds it as ``notices`` (and shuts it down).

    ``index`` counts the collectives posted on the group (the backend and its small-message path
    take the next one for each): it lives here because it is what notices and roll calls name.
    ``owner`` is the backend, under which the channel's sends are registered (``_requests``)."""

    def __init__(self, comm: Any, rank: int, size: int, ranks: tuple[int, ...], owner: Any) -> None:
        MPI = _rq._MPI
        self.comm = comm.Dup()
        self.rank, self.size, self.ranks, self.owner = rank, size, ranks, owner
        self.index = 0
        #: (index, world rank, why) of a peer that left; index 0: it died (every call fails)
        self.left: tuple[int, int, str] | None = None
        self.announced = False
        self._nonce = itertools.count(1)
        self._buf = np.zeros(_WORDS, np.int64)
        self.view = memoryview(self._buf)  # [0] turns non-zero when a notice landed
        self._req: Any = self.comm.Irecv([self._buf, MPI.INT64_T], MPI.ANY_SOURCE, _NOTICE_TAG)

    def mpi_error(self, exc: Any, what: str, index: int) -> HpcdpError:
        """hpcdp's error for an MPI exception in ``what``; the other ranks are told (collectives)."""
        MPI = _rq._MPI
        try:
            cls, text = exc.Get_error_class(), exc.Get_error_string().strip()
        except Exception:  # noqa: BLE001 - a broken exception object still gets reported
            cls, text = -1, str(exc)
        me = self.ranks[self.rank] if self.ranks else self.rank
        if cls == MPI.ERR_TRUNCATE:
            err: HpcdpError = CollectiveMismatchError(
                f"a message was longer than rank {me}'s receive buffer ({text}): the ranks "
                "passed different sizes" + ("; HPCDP_DEBUG=detail names each rank's call"
                                            if index else ""))
        elif cls == MPI.ERR_COMM:
            err = HpcdpError(f"rank {me}: the group's MPI communicator is gone ({text}); "
                             "was the group finalized?")
        elif index and cls in (MPI.ERR_OTHER, MPI.ERR_IN_STATUS, MPI.ERR_INTERN):
            # Open MPI's libnbc reports a truncated message inside a collective this way too
            err = HpcdpError(f"rank {me}: MPI error ({text}); inside a collective this is "
                             "usually ranks that passed different sizes, roots or dtypes: "
                             "HPCDP_DEBUG=detail compares the ranks' calls")
        else:
            err = HpcdpError(f"rank {me}: MPI error ({text})")
        if index:
            self.announce(index, f"failed in {what} ({text.split(':')[0]})")
        return err

    def _send_header(self, dst: int, tag: int, kind: int, index: int, nonce: int,
                     text: str = "") -> None:
        MPI = _rq._MPI
        raw = text.encode("utf-8", "replace")[: (_WORDS * 8 - _TEXT_AT)]
        buf = np.zeros(_WORDS, np.int64)
        buf[:6] = (_MAGIC, kind, index, self.ranks[self.rank], nonce, len(raw))
        buf.view(np.uint8)[_TEXT_AT: _TEXT_AT + len(raw)] = np.frombuffer(raw, np.uint8)
        try:
            req = _rq.MPIRequest(self.owner, [self.comm.Isend([buf, MPI.INT64_T], dst, tag)],
                                 "notice")
            req.keep = buf
        except MPI.Exception:
            pass  # a peer we cannot reach learns from its own timeout

    def announce(self, index: int, why: str) -> None:
        """Tell every other rank of the group that this one left (once): they fail at once."""
        if self.announced or self.size == 1 or self.comm == _rq._MPI.COMM_NULL:
            return
        self.announced = True
        for r in range(self.size):
            if r != self.rank:
                self._send_header(r, _NOTICE_TAG, _LEFT, index, 0, why)

    def died(self, why: str) -> None:
        """Tell the other ranks that this process is dying of ``why`` (once; not after an
        announced departure)."""
        if self.announced or self.size == 1 or self.comm == _rq._MPI.COMM_NULL:
            return
        self.announced = True
        for r in range(self.size):
            if r != self.rank:
                self._send_header(r, _NOTICE_TAG, _DIED, 0, 0, why)

    def tell_waiting(self, peers: Any, note: str) -> None:
        """Send group ranks ``peers`` a "waiting" notice (what this rank is blocked in)."""
        if self.comm == _rq._MPI.COMM_NULL:
            return
        for r in peers:
            if r != self.rank:
                self._send_header(r, _NOTICE_TAG, _WAITING, 0, 0, note)

    def waiting(self) -> bool:
        return self.view[0] != 0 or self.left is not None

    def check(self, index: int, p2p: bool = False) -> None:
        """Answer questions, take notices; raise if a peer left at or before collective ``index``
        (``p2p``: a point-to-point wait, which only a peer's death fails)."""
        if self.view[0]:
            with _rq._LOCK:
                while self._take_notice():  # the repost may match a queued message at once
                    pass
        left = self.left
        if left is not None and not left[0] and (index or p2p):
            raise PeerFailureError(
                f"rank {left[1]} died of an uncaught {left[2]}; the group cannot be used any "
                "more", peers=[left[1]])
        if left is not None and index and left[0] <= index:
            raise PeerFailureError(
                f"rank {left[1]} left this group: it {left[2]}; {BROKEN_ADVICE}",
                peers=[left[1]])

    def _take_notice(self) -> bool:
        """Under ``_LOCK``: handle the message in the posted buffer, if one landed; post again."""
        MPI = _rq._MPI
        req = self._req
        if req is None or self.comm == MPI.COMM_NULL:
            return False
        st = MPI.Status()
        try:
            if not req.Test(st):
                return False
        except MPI.Exception:
            self._req = None
            return False
        hdr = self._buf.copy()
        self._buf[:] = 0
        self._req = self.comm.Irecv([self._buf, MPI.INT64_T], MPI.ANY_SOURCE, _NOTICE_TAG)
        if hdr[0] != _MAGIC:
            return True
        kind, index, who, nonce, n = (int(v) for v in hdr[1:6])
        if kind in (_LEFT, _DIED):
            text = _text(hdr, n)
            if kind == _DIED:
                index = 0
            if self.left is None or index < self.left[0]:
                self.left = (index, who, text)
        elif kind == _WAITING:
            WAITING[who] = (time.monotonic(), _text(hdr, n))
        elif kind == _ASK:
            self._send_header(st.Get_source(), _ANSWER_TAG, _ANSWER, self.index, nonce,
                              self._pending_what(index))
        return True

    def _pending_what(self, index: int) -> str:
        """The operation this rank has pending as collective ``index`` ("" if none: finished)."""
        for r in _rq.pending_of(self.owner):
            if r.index == index and not r.done:
                return r.what
        return ""

    def roll_call(self, index: int, what: str) -> str:
        """Ask the other ranks whether they joined collective ``index``; what did not arrive."""
        MPI = _rq._MPI
        others = [r for r in range(self.size) if r != self.rank]
        if not others or self.comm == MPI.COMM_NULL:
            return f"{what} did not complete"
        nonce = next(self._nonce)
        for r in others:
            self._send_header(r, _NOTICE_TAG, _ASK, index, nonce)
        answers: dict[int, int] = {}
        names: dict[int, str] = {}  # what each rank has pending as call ``index``
        buf, st = np.zeros(_WORDS, np.int64), MPI.Status()
        deadline = time.monotonic() + ROLL_CALL_WAIT
        while len(answers) < len(others) and time.monotonic() < deadline:
            msg = self.comm.Improbe(MPI.ANY_SOURCE, _ANSWER_TAG, st)
            if msg is None:
                _rq.serve_all()  # a peer may be asking us the same thing
                time.sleep(1e-4)
                continue
            msg.Recv([buf, MPI.INT64_T])
            if buf[0] == _MAGIC and buf[1] == _ANSWER and buf[4] == nonce:
                answers[st.Get_source()] = int(buf[2])
                names[st.Get_source()] = _text(buf, int(buf[5]))
        g = self.ranks
        missing = [g[r] for r in others if answers.get(r, -1) < index]
        joined = sorted([g[self.rank]] + [g[r] for r in others if answers.get(r, -1) >= index])
        if not missing:
            return _all_reached(what, index, {g[r]: names.get(r, "") for r in others},
                                g[self.rank])
        return (f"rank(s) {missing} of the group have not joined {what} (no answer within "
                f"{ROLL_CALL_WAIT:g} s, or still in an earlier call); rank(s) {joined} have")

    def close(self) -> None:
        """Withdraw the posted notice receive (its buffer must outlive it)."""
        with _rq._LOCK:
            req, self._req = self._req, None
        if req is None:
            return
        try:
            req.Cancel()
            for _ in range(1000):
                if _rq._settled(req):
                    return
        except _rq._MPI.Exception:
            pass
        _rq.keep_forever((req, self._buf))


def _text(hdr: np.ndarray, n: int) -> str:
    raw = bytes(hdr.view(np.uint8)[_TEXT_AT: _TEXT_AT + max(0, min(n, _WORDS * 8 - _TEXT_AT))])
    return raw.decode("utf-8", "replace")


def _all_reached(what: str, index: int, names: dict[int, str], me: int) -> str:
    """The diagnosis when every rank reached collective ``index``: what each said it is in.

    "joined X" only when every rank said it is in X; otherwise the operations each named, and
    which ranks did not name one (they finished their call ``index`` already, e.g. a broadcast
    root, or answered from an older hpcdp)."""
    if all(n == what for n in names.values()):
        return (f"every rank of the group joined {what} (collective #{index} of this group) but "
                "it did not complete: the ranks' calls probably differ (size, root or dtype); "
                "HPCDP_DEBUG=detail compares them")
    known = {r: n for r, n in names.items() if n}
    said = "".join(f", rank {r}'s is {n}" for r, n in sorted(known.items()))
    unsaid = sorted(r for r, n in names.items() if not n)
    tail = (f"; rank(s) {unsaid} are past it (finished their part) or did not say" if unsaid
            else "")
    verdict = ("the ranks called different operations" if any(n != what for n in known.values())
               else "without HPCDP_DEBUG=detail the others' operations are not compared")
    return (f"every rank of the group reached collective #{index} of this group but it did not "
            f"complete (this rank's ({me}) is {what}{said}{tail}): {verdict}; HPCDP_DEBUG=detail "
            "compares each rank's call")


def report_death(why: str) -> None:
    """Tell the other ranks of every live group of this process that it is dying of ``why``
    (an uncaught exception); a group that announced a departure already is left alone."""
    if _rq._MPI is None or _rq._MPI.Is_finalized():
        return
    for be in list(_rq._LIVE):
        be.notices.died(why)

"""Collective signatures on the TCP wire: mismatched collectives raise instead of corrupting.

Every frame of a collective carries, in the header it already has (``_wire.HEADER``), the
signature of the call it belongs to: ``(code, dtype, seq, root, count)`` with ``code`` the
collective and reduce op, ``seq`` the group's collective sequence number (mod 2**32) and
``count`` the call's element count. No extra message, no extra round trip. A rank compares it
with its own call at these points:

1. a message meets the receive posted for it (reader thread), or a queued message meets a new
   receive (``irecv``): the signatures must be equal;
2. a message arrives for the collective this rank is running with another signature, or for one
   it has already finished (it never needed that message: the ranks disagree on roles);
3. a collective ends while messages of it are still queued, unconsumed;
4. a collective that has waited ``PROBE_AFTER`` seconds on a receive sends a PROBE frame with its
   signature to the peer it waits on, which compares it with its own call at that step: root
   mismatches in which every rank waits on another (gather, reduce) end here, not in a timeout.

A difference fails the group's channel with ``CollectiveMismatchError`` on this rank (pending and
later collectives of the group raise it) and sends a MISMATCH frame with the description to every
other member, which fails the channel there too. The text names both calls and both ranks.
A rank that only sends in the mismatched call (a broadcast root) may return from it; it raises at
its next collective on the group. MEAN travels as SUM (the API divides), so sum vs mean is the one
disagreement the transport cannot see; ``HPCDP_DEBUG=detail`` does.
"""
from __future__ import annotations

import collections
from typing import Any, Callable

import numpy as np

from ..._arrays import SUPPORTED_DTYPES
from ...errors import CollectiveMismatchError, PeerFailureError
from ._frames import COLL, MISMATCH, PROBE
from ._peer import _Req

__all__ = ["make_sig", "describe", "ChannelState", "CollChecks", "PROBE_AFTER",
           "PROBE_EVERY"]

NAMES = ("", "allreduce", "broadcast", "reduce", "all_gather", "gather", "scatter",
         "reduce_scatter", "all_to_all", "barrier")
_CODE = {name: i for i, name in enumerate(NAMES) if name}
_ROOTED = frozenset({_CODE["broadcast"], _CODE["reduce"], _CODE["gather"], _CODE["scatter"]})
_OPS = ("", "sum", "max", "min", "prod", "mean")
_OP_CODE = {name: i for i, name in enumerate(_OPS) if name}
_DTYPES: dict[np.dtype, int] = {dt: i + 1 for i, dt in enumerate(SUPPORTED_DTYPES)}
_OTHER_DTYPE = 255

SEQ_MOD = 1 << 32
#: finished collectives a channel remembers, to name the call a late message belonged to
HISTORY = 16
#: seconds a collective waits on one receive before it asks that peer what it is running
PROBE_AFTER = 1.0
PROBE_EVERY = 2.0
#: longest mismatch description sent to peers (bytes)
NOTE_BYTES = 2048

Sig = tuple  # (code, dtype, seq, root, count)


def make_sig(name: str, dtype: Any, count: int, op: Any, root: int, seq: int) -> Sig:
    """The signature of call number ``seq``: ``(code, dtype code, seq, root, count)``.

    ``op`` is a ``ReduceOp`` or its name (a str subclass: looked up without ``.value``, which
    costs more than the rest of this function on the latency path).
    """
    code = _CODE[name] << 4 | (_OP_CODE[op] if op is not None else 0)
    return code, _DTYPES.get(dtype, _OTHER_DTYPE), seq & 0xFFFFFFFF, root, count


def describe(sig: Sig) -> str:
    """``allreduce(op=sum, 4 x float32)``: a signature as the user wrote the call."""
    code, dt, _seq, root, count = sig
    coll, op = code >> 4, code & 15
    name = NAMES[coll] if 0 < coll < len(NAMES) else f"collective kind {coll}"
    args = []
    if op:
        args.append(f"op={_OPS[op] if op < len(_OPS) else op}")
    if coll in _ROOTED:
        args.append(f"root={root}")
    if name != "barrier":
        dtn = SUPPORTED_DTYPES[dt - 1].name if 0 < dt <= len(SUPPORTED_DTYPES) else "other dtype"
        args.append(f"{count} x {dtn}")
    return f"{name}({', '.join(args)})"


def _behind(a: int, b: int) -> bool:
    """Sequence number ``a`` comes before ``b`` (mod 2**32)."""
    return 0 < (b - a) % SEQ_MOD < SEQ_MOD // 2


class ChannelState:
    """What this rank runs on one group: read by reader threads without a lock, so ``now`` is
    replaced whole (signature, running) and the history is a fixed ring indexed by seq."""

    __slots__ = ("members", "now", "hist")

    def __init__(self, members: tuple[int, ...]) -> None:
        self.members = members
        self.now: tuple[Sig, bool] = ((0, 0, 0, 0, 0), False)
        self.hist: list[Sig | None] = [None] * HISTORY

    def finished(self, seq: int) -> Sig | None:
        old = self.hist[seq % HISTORY]
        return old if old is not None and old[2] == seq else None

    def call_at(self, seq: int) -> Sig | None:
        """This rank's call numbered ``seq``: the one running, or a recently finished one."""
        now = self.now[0]
        return now if now[2] == seq else self.finished(seq)


class CollChecks:
    """The collective mismatch checks of the mesh: ``Transport`` holds one (``transport.checks``),
    the runner's side (``_backend._GroupP2P``) opens channels and brackets each call, and the
    frame reader (``_frames.FrameReader``) reports what arrives.

    It is given, and shares with the transport: ``rank``, ``cap`` (largest frame), ``lock``
    guarding ``unexpected`` (queued messages: a collective's leftovers are found and dropped
    there), ``dead`` and ``aborted`` (peers and channels already failed: nothing to send them,
    nothing to report twice), and the transport's ``abort_channel`` and ``send_frame`` (to fail
    a channel here and tell its other members). It owns ``channels`` (what this rank runs on
    each group) and ``mismatched`` (channel -> the first mismatch seen on it).
    """

    __slots__ = ("rank", "cap", "lock", "unexpected", "dead", "aborted", "_abort_channel",
                 "_send_frame", "channels", "mismatched")

    def __init__(self, *, rank: int, cap: int, lock: Any,
                 unexpected: dict[tuple, collections.deque], dead: dict[int, str],
                 aborted: dict[tuple[int, int], str], abort_channel: Callable[..., None],
                 send_frame: Callable[..., None]) -> None:
        self.rank, self.cap, self.lock = rank, cap, lock
        self.unexpected, self.dead, self.aborted = unexpected, dead, aborted
        self._abort_channel = abort_channel
        self._send_frame = send_frame
        self.channels: dict[int, ChannelState] = {}
        #: channel -> description of the first mismatch seen on it
        self.mismatched: dict[int, str] = {}

    # -- the runner's side ------------------------------------------------------------------
    def open_channel(self, channel: int, members: tuple[int, ...]) -> ChannelState:
        st = self.channels[channel] = ChannelState(members)
        return st

    def coll_begin(self, st: ChannelState, sig: Sig) -> None:
        st.now = (sig, True)

    def coll_end(self, st: ChannelState, channel: int, ok: bool) -> None:
        """The collective finished here; its messages must all have been consumed (rule 3)."""
        sig = st.now[0]
        st.hist[sig[2] % HISTORY] = sig
        st.now = (sig, False)
        if ok and self.unexpected and not self._settled(channel):
            with self.lock:
                left = [(key[0], m[1]) for key, box in self.unexpected.items()
                        if key[1] == COLL and key[2] == channel for m in box
                        if not _behind(sig[2], m[1][2])]
            if left:
                src, theirs = left[0]
                self.coll_mismatch(channel, self._text(sig, src, theirs, "its message was "
                                                       "left over when this rank's call ended"))
                raise CollectiveMismatchError(self.mismatched[channel])

    def send_probe(self, dst: int, channel: int, sig: Sig) -> None:
        """Ask ``dst`` whether it runs the same call at this step (rule 4)."""
        if dst != self.rank and dst not in self.dead:
            self._send_frame(dst, PROBE, channel, 0, memoryview(b""), _Req(None, "probe"),
                             sig=sig)

    # -- the reader's side ------------------------------------------------------------------
    def _settled(self, channel: int) -> bool:
        """The channel already failed (mismatch, or a timeout: late messages of the call given
        up on are expected then, and must not be reported as a mismatch)."""
        return channel in self.mismatched or (COLL, channel) in self.aborted

    def sig_differs(self, src: int, channel: int, mine: Sig, theirs: Sig) -> Exception:
        """A message met a receive of another call (rule 1): fail the channel; the receive's error.

        The text names this rank's call at the message's step when it is known (a late message
        of a finished call meets the next call's receive)."""
        why = self.aborted.get((COLL, channel))
        if why is not None and channel not in self.mismatched:
            return PeerFailureError(why)
        st = self.channels.get(channel)
        then = st.call_at(theirs[2]) if st is not None else None
        how = "its message met this rank's receive"
        if then is not None and then != mine:
            how += f" in #{mine[2]} {describe(mine)}"
        self.coll_mismatch(channel, self._text(then or mine, src, theirs, how))
        return CollectiveMismatchError(self.mismatched[channel])

    def check_arrival(self, src: int, channel: int, theirs: Sig) -> None:
        """An unexpected collective message from ``src`` (rule 2)."""
        st = self.channels.get(channel)
        if st is None or self._settled(channel):
            return
        mine, running = st.now
        seq = theirs[2]
        if seq == mine[2] and mine[2]:
            if running and theirs != mine:
                self.coll_mismatch(channel, self._text(mine, src, theirs, "its message arrived"))
            elif not running:
                self.coll_mismatch(channel, self._text(mine, src, theirs, "its message "
                                                       "arrived after this rank's call ended"))
        elif _behind(seq, mine[2]):
            old = st.finished(seq) or (0, 0, seq, 0, 0)
            self.coll_mismatch(channel, self._text(old, src, theirs, "its message arrived "
                                                   "after this rank's call ended"))

    def on_probe(self, src: int, channel: int, theirs: Sig) -> None:
        """``src`` has waited on this rank in its call ``theirs`` (rule 4)."""
        st = self.channels.get(channel)
        if st is None or self._settled(channel):
            return
        mine = st.now[0]
        seq = theirs[2]
        if seq == mine[2]:
            if mine != theirs:
                self.coll_mismatch(channel, self._text(mine, src, theirs, "it waited on this "
                                                       "rank"))
        elif _behind(seq, mine[2]):
            old = st.finished(seq)
            if old is not None and old != theirs:
                self.coll_mismatch(channel, self._text(old, src, theirs, "it waited on this rank"))

    def on_mismatch_note(self, src: int, channel: int, note: bytes) -> None:
        text = note.decode("utf-8", "replace")
        self.coll_mismatch(channel, f"{text} (found by rank {src})", notify=False)

    # -- both -------------------------------------------------------------------------------
    def _text(self, mine: Sig, src: int, theirs: Sig, how: str) -> str:
        if not mine[2]:
            me = f"rank {self.rank} had not started collective #{theirs[2]}"
        elif not mine[0]:  # finished too long ago to be remembered
            me = f"rank {self.rank} had finished #{mine[2]}"
        else:
            me = f"rank {self.rank} called #{mine[2]} {describe(mine)}"
        return (f"ranks called different collectives on this group: {me}; rank {src} called "
                f"#{theirs[2]} {describe(theirs)} ({how})")

    def coll_mismatch(self, channel: int, text: str, notify: bool = True) -> None:
        """Fail the channel's pending and later collectives here, and tell the other members."""
        with self.lock:
            if channel in self.mismatched:
                return
            self.mismatched[channel] = text
            for key in [k for k in self.unexpected if k[1] == COLL and k[2] == channel]:
                del self.unexpected[key]  # never delivered now
        st = self.channels.get(channel)
        members = st.members if st is not None else ()
        self._abort_channel(COLL, channel, text, members, False, CollectiveMismatchError)
        if notify:
            note = text.encode()[:min(NOTE_BYTES, self.cap)]
            for r in members:
                if r != self.rank and r not in self.dead:
                    self._send_frame(r, MISMATCH, channel, 0, memoryview(note),
                                     _Req(None, "mismatch note"), queue_only=True)

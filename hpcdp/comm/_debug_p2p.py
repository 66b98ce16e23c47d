"""``HPCDP_DEBUG`` for point-to-point: every message carries a header naming its sender's call.

A collective can be compared across ranks before it starts; a send and its receive cannot (they
need not even run at the same time). So under ``HPCDP_DEBUG`` each send travels as one message of
a fixed-size header (magic, the send's name, rank, dtype, shape, byte count and source line)
followed by its bytes, and each receive takes the whole message into a buffer of the size the
transport reports for it (``Backend.probe``: the real size, never the header's word), checks the
header against what it expected and only then copies the payload into the user's buffer. A
receive that does not match raises ``CollectiveMismatchError`` naming both ranks, both calls and
their source lines, where without the check the transport would truncate, fail with a bare size
error or fill the buffer with the wrong values.

Receives of one (source, tag) on a group claim messages strictly one after the other, in the
order they were posted (a probe-then-receive must not let a later receive take an earlier
receive's message), so matching stays non-overtaking as the ``Backend`` contract requires. On
transports that progress only when called into (MPI) a thread takes messages for the waiting
receives, so a peer's large send, which completes only once its receive is posted, still does
while this rank waits in something else (see ``_Queue``).

Only the receiver raises: telling the sender would need an acknowledgement, which would make
every send synchronous under ``HPCDP_DEBUG`` and could deadlock programs that rely on eager
sends. Every rank must run with the same ``HPCDP_DEBUG`` (a receive that gets a message without
a header says so). On MPI a message over the backend's count limit (2 GiB) is split by the
transport and the probe sees its first piece only: such messages are reported as mismatched.
"""
from __future__ import annotations

import atexit
import collections
import json
import struct
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from .._arrays import SUPPORTED_SET, to_host, xp_of
from ..backends.base import Request, poll_until
from ..errors import CollectiveMismatchError, HpcdpError
from .debug import caller_line

if TYPE_CHECKING:
    from .group import ProcessGroup

__all__ = ["HEADER_BYTES", "p2p_sender", "p2p_receiver", "payload_nbytes"]

#: bytes in front of every message sent under ``HPCDP_DEBUG``
HEADER_BYTES = 512
_MAGIC = b"HPCDPDBG"
_LEN = struct.Struct("<H")
_TEXT_MAX = HEADER_BYTES - len(_MAGIC) - _LEN.size
_MAX_NDIM = 32
#: how a receive judges the sender: all of dtype and shape, the dtype only (``recv(None,
#: dtype=...)`` allocates a 1-D buffer), or the size only (``recv(None)``: raw bytes)
CHECKS = ("full", "dtype", "size")


def payload_nbytes(nbytes: int) -> int:
    """The user's bytes in a message of ``nbytes`` (what ``probe`` reports under debug)."""
    return max(0, nbytes - HEADER_BYTES)


def _describe(dtype: str, shape: Any, nbytes: int) -> str:
    return f"{dtype} {tuple(shape)} ({nbytes} bytes)"


def _header(name: str, rank: int, dtype: np.dtype, shape: tuple[int, ...], nbytes: int,
            line: str) -> bytes:
    rec: dict[str, Any] = {"op": name[:120], "rank": rank, "dtype": np.dtype(dtype).name,
                           "shape": list(shape), "nbytes": nbytes, "line": line}
    text = json.dumps(rec).encode()
    if len(text) > _TEXT_MAX:  # a long path or a deep shape: shorten, keep it valid JSON
        rec["line"] = "..." + line[-100:]
        if len(rec["shape"]) > _MAX_NDIM:
            rec["shape"] = None
        text = json.dumps(rec).encode()
    return _MAGIC + _LEN.pack(len(text)) + text


def _parse(raw: bytes) -> dict[str, Any] | None:
    """A peer's header, checked field by field; None if it is not one."""
    if not raw.startswith(_MAGIC):
        return None
    (n,) = _LEN.unpack_from(raw, len(_MAGIC))
    if n > _TEXT_MAX:
        return None
    start = len(_MAGIC) + _LEN.size
    try:
        rec = json.loads(raw[start: start + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(rec, dict):
        return None
    shape = rec.get("shape")
    ok = (isinstance(rec.get("op"), str) and isinstance(rec.get("dtype"), str)
          and isinstance(rec.get("line"), str) and type(rec.get("nbytes")) is int
          and type(rec.get("rank")) is int
          and (shape is None or isinstance(shape, list) and len(shape) <= _MAX_NDIM
               and all(type(d) is int for d in shape)))
    return rec if ok else None


def p2p_sender(group: "ProcessGroup", name: str, shape: tuple[int, ...]
               ) -> Callable[[Any, int, int], Request]:
    """A drop-in for ``backend.send`` that sends ``header + bytes`` (call it where the user's
    send is posted: it records the caller's source line)."""
    line = caller_line()

    def send(flat: Any, dst: int, tag: int) -> Request:
        head = _header(name, group.rank, flat.dtype, tuple(shape), flat.nbytes, line)
        xp = xp_of(flat)
        frame = xp.zeros(HEADER_BYTES + flat.nbytes, np.uint8)
        frame[: len(head)] = xp.asarray(np.frombuffer(head, np.uint8))
        frame[HEADER_BYTES:] = flat.reshape(-1).view(np.uint8)
        # (the group's transport for this frame: a cupy frame on a host-only backend is staged)
        return group._transport(frame).send(frame, dst, tag)  # (kept by the backend until sent)

    return send


class _Queue:
    """The debug receives of one group, per (source, tag), in the order they were posted.

    A receive is handed to the transport only once its message is there (it is sized by the
    probe), so nothing is "posted" in the transport's sense until then. Where the transport
    progresses only while called into (``Backend.needs_progress_thread``: MPI, whose large sends
    complete only once their receive is posted), a thread advances the queue while receives
    wait, as MPI's own progress would match a posted receive: a rank blocked in a send or a
    collective still takes the messages its peers are blocked on.
    """

    _IDLE = 0.5  # seconds the progress thread lingers with nothing to do

    def __init__(self, group: "ProcessGroup") -> None:
        self.group = weakref.ref(group)  # (a strong one would keep the group in ``_queues``)
        self.name = group.name
        self.backend = group.backend
        self.lock = threading.Lock()
        self.posted: dict[tuple[int, int], collections.deque[_Recv]] = {}
        self.thread: threading.Thread | None = None
        be = self.backend
        self.threaded = bool(be.needs_progress_thread) and be.thread_level == "multiple"

    def add(self, r: "_Recv") -> None:
        with self.lock:
            self.posted.setdefault(r.key, collections.deque()).append(r)
            if self.threaded and self.thread is None:
                self.thread = threading.Thread(target=self._progress, daemon=True,
                                               name=f"hpcdp-debug-p2p-{self.name}")
                self.thread.start()

    def advance(self, key: tuple[int, int]) -> None:
        """Let the receives of ``key`` take their messages, oldest first (lock held)."""
        q = self.posted.get(key)
        src, tag = key
        while q:
            head = q[0]
            try:
                if head.inner is None:
                    hit = self.backend.probe_meta(src, tag)
                    if hit is None:
                        return
                    if hit.dtype is not None and (hit.dtype != np.uint8 or len(hit.shape) != 1):
                        # sent as an array, not as a framed message: left where it is
                        head._headless(f"a {hit.dtype} {hit.shape} array")
                    head.scratch = xp_of(head.flat).empty(int(hit[2]), np.uint8)
                    group = self.group()
                    post = self.backend if group is None else group._transport(head.scratch)
                    head.inner = post.recv(head.scratch, src, tag)
                if not head.inner.test():
                    return
                head._judge()
            except Exception as exc:  # noqa: BLE001 - that receive's error, raised by its owner
                head.error = exc
            q.popleft()
        self.posted.pop(key, None)

    def _progress(self) -> None:
        idle = time.monotonic()
        while True:
            with self.lock:
                group = self.group()
                if group is None or group._closed or _exiting:
                    self.thread = None
                    return
                if self.posted:
                    for key in list(self.posted):
                        self.advance(key)
                    idle = time.monotonic()
                elif time.monotonic() - idle > self._IDLE:
                    self.thread = None
                    return
            group = None
            time.sleep(2e-4)


_queues: "weakref.WeakKeyDictionary[Any, _Queue]" = weakref.WeakKeyDictionary()
_queues_lock = threading.Lock()
_exiting = False


@atexit.register
def _stop_progress() -> None:
    """Before MPI is finalised (atexit runs in reverse order, mpi4py registered first): no
    progress thread may be inside the transport once this returns."""
    global _exiting
    _exiting = True
    with _queues_lock:
        queues = list(_queues.values())
    for q in queues:
        with q.lock:  # a round in progress ends; the next sees _exiting
            pass


def _queue_of(group: "ProcessGroup") -> _Queue:
    with _queues_lock:
        q = _queues.get(group)
        if q is None:
            q = _queues[group] = _Queue(group)
        return q


class _Recv(Request):
    """One debug receive: waits its turn, takes the whole message, checks it, copies it out."""

    def __init__(self, group: "ProcessGroup", name: str, flat: Any, shape: tuple[int, ...],
                 src: int, tag: int, check: str, line: str,
                 on_meta: Callable[[Any], None] | None = None) -> None:
        self.group, self.name = group, name
        self.flat, self.shape, self.src, self.tag = flat, tuple(shape), src, tag
        self.check, self.line = check, line
        self.on_meta = on_meta
        self.key = (src, tag)
        self.queue = _queue_of(group)
        self.inner: Request | None = None
        self.scratch: Any = None
        self.done = False
        self.error: BaseException | None = None
        self.queue.add(self)

    def _judge(self) -> None:
        """The whole message is in: check it against this receive and copy the payload out."""
        got = int(self.scratch.nbytes)
        rec = _parse(to_host(self.scratch[:HEADER_BYTES]).tobytes()) if got >= HEADER_BYTES else None
        want = _describe(np.dtype(self.flat.dtype).name, self.shape, int(self.flat.nbytes))
        me = f"rank {self.group.rank}: {self.name} into {want} at {self.line}"
        if rec is None or rec["nbytes"] != got - HEADER_BYTES:
            self._headless(f"{got} bytes")
        sent = (rec["dtype"], rec["shape"])
        bad = rec["nbytes"] != self.flat.nbytes
        if self.check in ("full", "dtype"):
            bad = bad or sent[0] != np.dtype(self.flat.dtype).name
        if self.check == "full":
            bad = bad or sent[1] is None or tuple(sent[1]) != self.shape
        if bad:
            them = _describe(rec["dtype"], rec["shape"] or (), rec["nbytes"])
            raise CollectiveMismatchError(
                f"a send and its receive do not match (HPCDP_DEBUG):\n"
                f"  rank {self.src}: {rec['op']} of {them} at {rec['line']}\n  {me}")
        self.flat.reshape(-1).view(np.uint8)[...] = self.scratch[HEADER_BYTES:]
        self.scratch = None
        if self.on_meta is not None:
            self.on_meta(_sent_meta(rec))
        self.done = True

    def _headless(self, what: str) -> None:
        """Raise: the message (``what``) was not sent under ``HPCDP_DEBUG``."""
        want = _describe(np.dtype(self.flat.dtype).name, self.shape, int(self.flat.nbytes))
        raise CollectiveMismatchError(
            f"the message from rank {self.src} (tag {self.tag}, {what}) carries no "
            f"HPCDP_DEBUG header: run every rank with the same HPCDP_DEBUG (or group.debug)"
            f"\n  rank {self.group.rank}: {self.name} into {want} at {self.line}")

    # -- Request ------------------------------------------------------------------------------
    def test(self) -> bool:
        if not self.done and self.error is None:
            with self.queue.lock:
                self.queue.advance(self.key)
        if self.error is not None:
            raise self.error
        return self.done

    def wait(self, timeout: float | None) -> bool:
        return poll_until(self.test, None if timeout is None else time.monotonic() + timeout)

    def pending(self) -> str:
        if self.inner is None:
            return f"no message from rank {self.src} with tag {self.tag}"
        return self.inner.pending()

    def abandon(self) -> bool | None:
        """Leave the queue; a message being taken is given up with the transport's abandon."""
        with self.queue.lock:
            if self.done:
                return True
            q = self.queue.posted.get(self.key)
            if q is not None and self in q:
                q.remove(self)
                if not q:
                    self.queue.posted.pop(self.key, None)
            inner = self.inner
        if inner is None or not inner.abandon():
            return None
        try:  # it completed as it was given up: judged like any other
            self._judge()
        except HpcdpError:
            return None
        return True


def _sent_meta(rec: dict[str, Any]) -> tuple[np.dtype, tuple[int, ...]] | None:
    """The (dtype, shape) a header says was sent, if they are a supported dtype and a shape that
    accounts for exactly its bytes (a header is a peer's word: never trusted past its size)."""
    try:
        dt = np.dtype(rec["dtype"])
        shape = tuple(int(d) for d in rec["shape"])
    except (TypeError, ValueError, KeyError):
        return None
    if dt not in SUPPORTED_SET or any(d < 0 for d in shape):
        return None
    n = 1
    for d in shape:
        n *= d
    return (dt, shape) if n * dt.itemsize == rec["nbytes"] else None


def p2p_receiver(group: "ProcessGroup", name: str, shape: tuple[int, ...], check: str = "full",
                 on_meta: Callable[[Any], None] | None = None
                 ) -> Callable[[Any, int, int], Request]:
    """A drop-in for ``backend.recv`` that takes a framed message and checks its header
    against ``shape``, the receive buffer's dtype and size (``check``: see ``CHECKS``).
    ``on_meta``, once the message is in, hears the (dtype, shape) its header says were sent
    (None if the header does not say it in a form that fits the message): ``recv(None)``
    returns the sender's array under ``HPCDP_DEBUG`` too."""
    if check not in CHECKS:
        raise ValueError(f"p2p debug check must be one of {CHECKS}, got {check!r}")
    line = caller_line()

    def recv(flat: Any, src: int, tag: int) -> Request:
        return _Recv(group, name, flat, shape, src, tag, check, line, on_meta)

    return recv

"""Reading RPC frames (``_wire``) from a stream socket, resumable at any byte: ``FrameReader``.

Whoever holds a connection's read token advances its reader: ``recv`` makes one non-blocking
read, into a staging buffer (many small frames per system call) or, for a large body or array
with the stage empty, straight into its destination (no copy); ``next_frame`` returns the next
complete frame. A thread can therefore take the reading over between any two calls: the
connection's background reader, a caller reading its own reply, or a replacement. Nothing is
allocated before the prefix and lengths have passed the limits; a refused frame is consumed
through the stage and delivered with ``refused`` set and its envelope (when small) alone.
"""
from __future__ import annotations

import socket
import struct
from typing import Any

import numpy as np

from ..errors import ProtocolError
from ._codec import Limits
from ._wire import MAX_ENVELOPE, PREFIX, RECV_BUFFERS, Frame, check_sizes, parse_prefix

__all__ = ["FrameReader", "STAGE"]

STAGE = 64 << 10
#: a part with at least this much still to come is read straight into place
_DIRECT = 16 << 10
_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)
_HEAD, _LENS, _ENV, _PARTS, _DRAIN = range(5)


class FrameReader:
    __slots__ = ("limits", "buf", "mv", "pos", "end", "phase", "env_len", "body_len", "nbuf",
                 "lens", "env", "body", "bufs", "refused", "part", "target", "off", "left")

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.buf = bytearray(STAGE)
        self.mv = memoryview(self.buf)
        self.pos = self.end = 0
        self._reset()

    def _reset(self) -> None:
        self.phase = _HEAD
        self.env_len = self.body_len = self.nbuf = 0
        self.lens: tuple[int, ...] = ()
        self.env: bytes | None = None
        self.body: Any = None
        self.bufs: list[np.ndarray] = []
        self.refused: str | None = None
        self.part = 0
        self.target: memoryview | None = None
        self.off = 0
        self.left = 0

    def buffered(self) -> bool:
        """Whether read bytes wait to be parsed (a frame may be complete without a read)."""
        return self.end > self.pos

    def recv(self, sock: socket.socket, block: bool = False) -> int:
        """One read: the bytes read, 0 if none were waiting (without ``block``).

        ``block``: wait for bytes of a large part being read into place (for a thread that may
        block on this peer; bytes already on their way arrive without another poll).
        ``ConnectionError`` at the end of the stream; other ``OSError`` as the socket raises.
        """
        t = self.target
        try:
            if t is not None and self.pos == self.end and len(t) - self.off >= _DIRECT:
                n = sock.recv_into(t[self.off:], 0, 0 if block else _DONTWAIT)
                if n == 0:
                    raise ConnectionError("connection closed by the peer")
                self.off += n
                return n
            if self.pos == self.end:
                self.pos = self.end = 0
            elif len(self.buf) - self.end < _DIRECT:  # make room: move the unparsed tail down
                k = self.end - self.pos
                self.mv[:k] = self.mv[self.pos:self.end]
                self.pos, self.end = 0, k
            n = sock.recv_into(self.mv[self.end:], 0, _DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return 0
        if n == 0:
            raise ConnectionError("connection closed by the peer")
        self.end += n
        return n

    def next_frame(self) -> Frame | None:
        """The next complete frame from the bytes read so far, or None.

        ``ProtocolError`` when the stream cannot be followed (a bad prefix).
        """
        mv = self.mv
        while True:
            avail = self.end - self.pos
            ph = self.phase
            if ph == _PARTS:
                t = self.target
                if t is not None:  # a body or array being filled
                    if avail:
                        k = min(avail, len(t) - self.off)
                        t[self.off:self.off + k] = mv[self.pos:self.pos + k]
                        self.off += k
                        self.pos += k
                    if self.off < len(t):
                        return None
                    self.target = None
                    self.part += 1
                    continue
                i = self.part
                if i > self.nbuf:
                    frame = Frame(self.env, self.body, self.bufs)
                    self._reset()
                    return frame
                if i == 0:
                    n = self.body_len
                    if n <= avail:  # the usual case: the whole body is staged
                        self.body = bytes(mv[self.pos:self.pos + n])
                        self.pos += n
                        self.part = 1
                        continue
                    self.body = bytearray(n)
                    self.target = memoryview(self.body)
                else:
                    a = RECV_BUFFERS.take(self.lens[i - 1])
                    self.bufs.append(a)
                    if not a.size:
                        self.part += 1
                        continue
                    self.target = memoryview(a)
                self.off = 0
            elif ph == _HEAD:
                if avail < PREFIX.size:
                    return None
                self.env_len, self.body_len, self.nbuf = parse_prefix(self.buf, self.limits,
                                                                      self.pos)
                self.pos += PREFIX.size
                self.phase = _LENS
            elif ph == _LENS:
                need = 8 * self.nbuf
                if avail < need:
                    return None
                self.lens = struct.unpack_from(f"<{self.nbuf}Q", self.buf, self.pos) \
                    if self.nbuf else ()
                self.pos += need
                self.refused = check_sizes(self.env_len, self.body_len, self.lens, self.limits)
                if self.refused is not None and self.body_len + sum(self.lens) > \
                        4 * (self.limits.max_message_bytes + self.limits.max_body_bytes):
                    # far past any limit: not a frame to drain but a stream to drop
                    raise ProtocolError(f"RPC frame announces {self.body_len + sum(self.lens)} "
                                        "bytes")
                if self.refused is not None and self.env_len > MAX_ENVELOPE:
                    self.left = self.env_len + self.body_len + sum(self.lens)
                    self.phase = _DRAIN
                else:
                    self.phase = _ENV
            elif ph == _ENV:
                n = self.env_len
                if avail < n:
                    return None
                self.env = bytes(mv[self.pos:self.pos + n])
                self.pos += n
                if self.refused is not None:
                    self.left = self.body_len + sum(self.lens)
                    self.phase = _DRAIN
                else:
                    self.phase = _PARTS
            else:  # _DRAIN: a refused frame's payload, dropped as it comes
                k = min(avail, self.left)
                self.pos += k
                self.left -= k
                if self.left:
                    return None
                frame = Frame(self.env, None, [], self.refused)
                self._reset()
                return frame

"""RPC message layout: a fixed prefix, the buffer lengths, the envelope, the body, the buffers.

::

    prefix  16 B  magic "HR", version, flags, envelope bytes (u32), body bytes (u32), buffers (u32)
    lengths 8 B per buffer (u64)
    envelope      msgpack array of plain values: kind, message id, routing fields
    body          the codec's msgpack value (arguments, result or error text)
    buffers       raw array bytes

The channel (``_channel``) sends the prefix, lengths, envelope and a small body as one head
message and the rest as data messages. Everything a receiver allocates is announced in the
prefix and the lengths and checked against its ``Limits`` first; a message that breaks a limit
but is well formed is reported to the agent with its envelope alone, so the caller gets a clear
error.

Large array parts are received into buffers from ``RECV_BUFFERS``, which reuses a buffer once
nothing refers to it any more (see ``RecvBuffers``).
"""
from __future__ import annotations

import struct
import threading
from typing import Any, Sequence

import msgpack
import numpy as np

from .._arrays import free_refs, refs_at
from .._config import setting
from ..errors import ProtocolError
from ._codec import Limits, _packer

__all__ = ["PREFIX", "MAX_ENVELOPE", "Frame", "pack_prefix", "parse_prefix", "check_sizes",
           "pack_envelope", "unpack_envelope", "RecvBuffers", "RECV_BUFFERS"]

PREFIX = struct.Struct("<2sBBIII")
_pack, _unpack_from = PREFIX.pack, PREFIX.unpack_from
MAGIC = b"HR"
VERSION = 1
#: envelopes hold ids, names and routing fields only
MAX_ENVELOPE = 4096
_ENV_ITEMS = 16


class Frame:
    """One received message; ``refused`` says why its body and buffers were dropped."""

    __slots__ = ("env", "body", "buffers", "refused", "queued")

    def __init__(self, env: bytes | None, body: Any, buffers: Sequence[Any],
                 refused: str | None = None) -> None:
        self.env, self.body, self.buffers, self.refused = env, body, buffers, refused
        self.queued = 0  # bytes charged to the agent's queue budget while it is served

    @property
    def nbytes(self) -> int:
        return len(self.env or b"") + len(self.body or b"") + sum(len(b) for b in self.buffers)


def pack_prefix(env: bytes, body: bytes, lengths: Sequence[int]) -> bytes:
    if not lengths:
        return _pack(MAGIC, VERSION, 0, len(env), len(body), 0)
    return _pack(MAGIC, VERSION, 0, len(env), len(body), len(lengths)) + \
        struct.pack(f"<{len(lengths)}Q", *lengths)


def parse_prefix(raw: Any, limits: Limits, pos: int = 0) -> tuple[int, int, int]:
    """(envelope, body, buffer count); ``ProtocolError`` when the stream cannot be followed."""
    magic, version, flags, env_len, body_len, nbuf = _unpack_from(raw, pos)
    if magic != MAGIC or version != VERSION or flags != 0:
        raise ProtocolError(f"malformed RPC frame prefix (magic {magic!r}, version {version})")
    if nbuf > limits.max_buffers:
        raise ProtocolError(f"RPC frame announces {nbuf} buffers; the limit is {limits.max_buffers}")
    return env_len, body_len, nbuf


def check_sizes(env_len: int, body_len: int, lengths: Sequence[int], limits: Limits) -> str | None:
    """Why a frame of these sizes is refused, or None."""
    if env_len > MAX_ENVELOPE:
        return f"envelope of {env_len} bytes exceeds {MAX_ENVELOPE}"
    if body_len > limits.max_body_bytes:
        return f"message body of {body_len} bytes exceeds the limit of {limits.max_body_bytes}"
    if len(lengths) > limits.max_buffers:
        return f"{len(lengths)} arrays exceed the limit of {limits.max_buffers}"
    total = body_len + sum(lengths)
    if total > limits.max_message_bytes:
        return f"message of {total} bytes exceeds the limit of {limits.max_message_bytes}"
    return None


def pack_envelope(fields: Sequence[Any]) -> bytes:
    return _packer().pack(fields if type(fields) is list else list(fields))


def unpack_envelope(env: bytes | None) -> list[Any]:
    """The envelope's fields: a list starting with two ints (kind, id)."""
    if env is None:
        raise ProtocolError("frame without an envelope")
    if len(env) > MAX_ENVELOPE:
        raise ProtocolError(f"envelope of {len(env)} bytes exceeds {MAX_ENVELOPE}")
    try:
        fields = msgpack.unpackb(env, use_list=True, raw=False, max_map_len=0, max_ext_len=0,
                                 max_array_len=_ENV_ITEMS)
    except Exception as exc:  # noqa: BLE001 - any decoding failure is the peer's malformed frame
        raise ProtocolError(f"malformed envelope ({type(exc).__name__}: {exc})") from None
    if (type(fields) is not list or len(fields) < 2 or type(fields[0]) is not int
            or type(fields[1]) is not int):
        raise ProtocolError("malformed envelope (expected [kind, id, ...])")
    return fields


class RecvBuffers:
    """Buffers for large received array parts, reused once nothing else refers to them.

    Why: a fresh megabyte is mapped page by page while the receive copies into it. On MPI the
    receiver makes that copy itself (shared memory: ``process_vm_readv``), so a message into
    fresh memory takes two to four times as long as one into memory already mapped; a raw
    ``irecv`` into a preallocated array never pays it. Callees usually drop their arguments
    (and callers their results) before the next message of the same size comes, so its buffer
    is reused.

    A buffer is handed out again only while this pool holds the sole reference to it: every
    array, view or memoryview of its memory (a decoded argument, an MPI receive in flight, a
    ``Frame``) refers to it, directly or through the views it came from, so memory still in
    use is never reused. Reference counts are calibrated at import; where the interpreter's
    cannot show this (``free_refs()`` is None) every part gets fresh memory. The pool keeps at
    most ``cap`` bytes of buffers (``HPCDP_RPC_RECV_CACHE``, 0 turns reuse off), forgetting the
    oldest first: a buffer a callee kept stays the callee's.
    """

    #: smaller parts come from the allocator (mapped already, and cheap to fault)
    MIN = 64 << 10
    MAX_ENTRIES = 128

    def __init__(self, cap: int) -> None:
        self.cap = max(0, cap)
        self._free = free_refs()
        self._lock = threading.Lock()
        self._entries: list[np.ndarray] = []
        self._bytes = 0
        self.reused = 0  # parts served from a reused buffer (tests and benchmarks read it)

    def take(self, n: int) -> np.ndarray:
        """A uint8 array of ``n`` bytes (contents undefined) that the caller fills entirely.

        ``n`` must already have passed the receiver's ``Limits``.
        """
        if n < self.MIN or n > self.cap or self._free is None:
            return np.empty(n, np.uint8)
        with self._lock:
            entries, free = self._entries, self._free
            hi = n + (n >> 3)  # a slightly larger free buffer serves too
            for i in range(len(entries) - 1, -1, -1):  # the newest first: warm in the caches
                if n <= entries[i].size <= hi and refs_at(entries, i) == free:
                    self.reused += 1
                    return entries[i][:n]
            buf = np.empty(n, np.uint8)
            entries.append(buf)
            self._bytes += n
            while self._bytes > self.cap or len(entries) > self.MAX_ENTRIES:
                self._bytes -= entries.pop(0).size
            return buf[:n]

    def clear(self) -> None:
        """Forget every buffer (those in use stay with their users)."""
        with self._lock:
            self._entries = []
            self._bytes = 0


#: shared by every channel of the process (simulated ranks are threads of one process)
RECV_BUFFERS = RecvBuffers(setting("HPCDP_RPC_RECV_CACHE"))

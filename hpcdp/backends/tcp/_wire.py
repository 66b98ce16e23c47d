"""TCP wire format: the HMAC-SHA256 handshake, the frame header, and the settings that bound them.

Handshake (fixed sizes, nothing is parsed beyond them before both sides have proved the secret)::

    client -> server  HELLO     48 B  magic "HPCD", version, role, init generation, claimed rank,
                                      target id, 32-byte client nonce
    server -> client  CHALLENGE 64 B  32-byte server nonce, HMAC(secret, "srv" | HELLO | nonce_s)
    client -> server  RESPONSE  32 B  HMAC(secret, "cli" | HELLO | nonce_s)
    server -> client  ACCEPT     4 B  "OK\\0\\0"

Fresh nonces on both sides make a replayed handshake fail; the role, the claimed rank, the target
and the generation (which ``hpcdp.init`` of the process this is: init -> finalize -> init must not
reach the previous store) are inside the MACs, so a handshake cannot be reused for another role,
rank or generation. After it, every message is ``[HEADER][payload]``; the 40-byte header carries
the collective's signature (``_coll``) and a length checked against a cap before anything is
allocated. Frames are neither authenticated nor encrypted: the threat model is a trusted network.

A point-to-point frame's signature fields carry the array's dtype and shape instead
(``p2p_sig``/``p2p_meta``): ``recv(None)`` returns what was sent, at no extra byte on the wire.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import math
import secrets
import socket
import string
import struct
import time

import numpy as np

from ..._config import SETTINGS, setting
from ...errors import AuthError, BackendUnavailableError, ConfigError, ProtocolError
from ..base import DTYPE_CODES, meta_of

__all__ = [
    "MAGIC", "HEADER", "ROLE_STORE", "ROLE_PEER", "client_handshake", "server_handshake",
    "recv_exact", "recv_into_exact", "pack_header", "unpack_header", "unpack_header_from",
    "unpack_frame_from", "max_frame", "handshake_timeout", "hello_timeout", "log_rejection",
    "get_secret", "check_secret", "is_loopback", "GenerationMismatch", "NOSIG", "LOG",
    "p2p_sig", "recv_sig", "p2p_meta", "p2p_refuses",
]

LOG = logging.getLogger("hpcdp.tcp")

MAGIC = b"HPCD"
VERSION = 2
ROLE_STORE = 1
ROLE_PEER = 2
STORE_ID = -1

#: magic, version, role, init generation (mod 2**16), claimed rank, target id, client nonce
_HELLO = struct.Struct("<4sBBHii32s")
HELLO_SIZE = _HELLO.size  # 48
NONCE = 32
MAC = 32
CHALLENGE_SIZE = NONCE + MAC
ACCEPT = b"OK\0\0"

#: kind, flags, then the collective signature (code, dtype, seq, root, count; zeros outside
#: collectives), then channel, tag and payload bytes: 40 bytes
HEADER = struct.Struct("<BBBBIIQIqQ")
#: the signature of frames that belong to no collective
NOSIG = (0, 0, 0, 0, 0)

_unpack_from = HEADER.unpack_from

DEFAULT_MAX_FRAME = SETTINGS["HPCDP_MAX_FRAME"].default
#: seconds a new connection gets to deliver its whole HELLO: a real client sends it at once
HELLO_TIMEOUT = 2.0
#: multi-node jobs need at least this many bits in HPCDP_SECRET (as estimated by check_secret)
SECRET_BITS = 128


class GenerationMismatch(ProtocolError):
    """A handshake from another ``hpcdp.init`` generation (a re-init racing the old store)."""

    def __init__(self, message: str, theirs: int) -> None:
        super().__init__(message)
        self.theirs = theirs


def get_secret(network: bool = False) -> bytes:
    """``HPCDP_SECRET`` as bytes; the TCP backend refuses to start without it.

    Args:
        network: the job listens on a non-loopback address, so the secret must be strong
            (``check_secret``); loopback-only jobs accept any non-empty secret.
    """
    raw = setting("HPCDP_SECRET")
    if not raw:
        raise BackendUnavailableError(
            "tcp backend: HPCDP_SECRET is not set; every connection is authenticated with it. "
            "Launch with `hpcdp-run` or hpcdp.spawn (they generate one), or export the same "
            "random value on every rank, e.g. python -c 'import secrets; print(secrets.token_hex(32))'"
        )
    if network:
        weak = check_secret(raw)
        if weak:
            raise BackendUnavailableError(
                f"tcp backend: HPCDP_SECRET is too weak for a job that listens on the network "
                f"({weak}); use at least {SECRET_BITS // 8} random bytes, e.g. python -c 'import "
                "secrets; print(secrets.token_hex(32))'")
    return raw.encode()


def check_secret(raw: str) -> str | None:
    """Why ``raw`` is too guessable for a network-facing job, or None if it is strong enough.

    The estimate is an upper bound, deliberately simple: hex digits count 4 bits each, other
    text log2 of the alphabet its character classes span (lower, upper, digits, punctuation),
    any non-ASCII byte 8 bits. Fewer than 8 distinct characters, or a string that is one short
    piece repeated, is refused whatever its length (``aaaa...``, ``abcabc...``).
    """
    bits = _estimate_bits(raw)
    if len(set(raw)) < 8:
        return f"only {len(set(raw))} distinct characters"
    for k in range(1, len(raw) // 2 + 1):
        if len(raw) % k == 0 and raw[:k] * (len(raw) // k) == raw:
            return f"one {k}-character piece repeated"
    if bits < SECRET_BITS:
        return f"about {bits:.0f} bits of entropy at most, {SECRET_BITS} needed"
    return None


def _estimate_bits(raw: str) -> float:
    if all(c in string.hexdigits for c in raw):
        return 4.0 * len(raw)
    ascii_part = [c for c in raw if c.isascii()]
    pool = 0
    for cls in (string.ascii_lowercase, string.ascii_uppercase, string.digits):
        if any(c in cls for c in ascii_part):
            pool += len(cls)
    if any(not c.isalnum() for c in ascii_part):
        pool += 33  # punctuation and space
    extra = len(raw.encode()) - len(ascii_part)  # bytes of non-ASCII characters
    return len(ascii_part) * math.log2(max(pool, 1)) + 8.0 * extra


def is_loopback(host: str) -> bool:
    """Whether ``host`` resolves to a loopback address (only this machine can reach it)."""
    try:
        return socket.gethostbyname(host).startswith("127.")
    except OSError:
        return False


def max_frame() -> int:
    """Largest payload one frame may carry (``HPCDP_MAX_FRAME`` bytes; default 1 GiB).

    Every frame a rank sends respects it (longer messages are split), and every frame it
    receives is checked against it before anything is allocated.
    """
    try:
        return setting("HPCDP_MAX_FRAME")
    except ConfigError as exc:  # the backend cannot start with it: see _unusable
        raise _unusable(exc) from exc


def handshake_timeout() -> float:
    """Seconds a new connection may take to authenticate (``HPCDP_HANDSHAKE_TIMEOUT``, default 10)."""
    try:
        return setting("HPCDP_HANDSHAKE_TIMEOUT")
    except ConfigError as exc:
        raise _unusable(exc) from exc


def _unusable(exc: ConfigError) -> BackendUnavailableError:
    """A bad TCP setting: the backend cannot start with it (and a listener already up refuses
    new connections), so a ``BackendUnavailableError``, caused by the ``ConfigError`` that names
    the variable, its value and what is allowed."""
    return BackendUnavailableError(f"tcp backend: {exc}")


def hello_timeout() -> float:
    """Seconds a new connection gets for its first 48 bytes (at most the handshake timeout)."""
    return min(HELLO_TIMEOUT, handshake_timeout())


def log_rejection(addr: object, where: str, exc: BaseException) -> None:
    LOG.warning("hpcdp.tcp: dropped connection from %s at %s: %s: %s", addr, where,
                type(exc).__name__, exc)


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf))
    return buf


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` completely; EOF before that raises ``ConnectionError``."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("connection closed by peer")
        got += k


def _mac(secret: bytes, label: bytes, hello: bytes, nonce_s: bytes) -> bytes:
    return hmac.new(secret, label + hello + nonce_s, hashlib.sha256).digest()


def _deadline_recv(sock: socket.socket, n: int, deadline: float) -> bytearray:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("handshake timed out")
    sock.settimeout(left)
    try:
        return recv_exact(sock, n)
    except socket.timeout:
        raise TimeoutError("handshake timed out (peer stayed silent)") from None


def hello(role: int, my_id: int, target: int, generation: int) -> bytes:
    return _HELLO.pack(MAGIC, VERSION, role, generation & 0xFFFF, my_id, target,
                       secrets.token_bytes(NONCE))


def check_hello(raw: bytes, role: int, my_id: int, generation: int) -> int:
    """The rank a HELLO claims, once it is for this endpoint; else ``ProtocolError``/``AuthError``."""
    magic, version, r, gen, claimed, target, _nonce = _HELLO.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError("malformed handshake (not an hpcdp peer)")
    if version != VERSION:
        raise ProtocolError(f"handshake of wire version {version}; this endpoint speaks "
                            f"{VERSION} (mixed hpcdp versions?)")
    if r != role or target != my_id:
        raise AuthError(f"handshake for role {r} target {target}; this endpoint is role {role} "
                        f"id {my_id}")
    if gen != generation & 0xFFFF:
        raise GenerationMismatch(f"handshake from init generation {gen}; this endpoint serves "
                                 f"generation {generation & 0xFFFF} (every rank must call "
                                 "hpcdp.init and finalize the same number of times)", gen)
    return claimed


def challenge(secret: bytes, raw_hello: bytes) -> tuple[bytes, bytes]:
    """(server nonce, CHALLENGE bytes) for a checked HELLO."""
    nonce_s = secrets.token_bytes(NONCE)
    return nonce_s, nonce_s + _mac(secret, b"srv", raw_hello, nonce_s)


def check_response(secret: bytes, raw_hello: bytes, nonce_s: bytes, resp: bytes) -> None:
    if not hmac.compare_digest(resp, _mac(secret, b"cli", raw_hello, nonce_s)):
        raise AuthError("wrong HMAC in handshake response (bad secret or replayed handshake)")


def client_handshake(sock: socket.socket, secret: bytes, role: int, my_id: int, target: int,
                     timeout: float, generation: int = 0) -> None:
    """Prove the secret to the server and check that the server knows it too."""
    deadline = time.monotonic() + timeout
    msg = hello(role, my_id, target, generation)
    sock.settimeout(timeout)
    sock.sendall(msg)
    chal = bytes(_deadline_recv(sock, CHALLENGE_SIZE, deadline))
    nonce_s, mac_s = chal[:NONCE], chal[NONCE:]
    if not hmac.compare_digest(mac_s, _mac(secret, b"srv", msg, nonce_s)):
        raise AuthError(f"handshake with {sock.getpeername()}: the server does not know the secret")
    sock.sendall(_mac(secret, b"cli", msg, nonce_s))
    if bytes(_deadline_recv(sock, len(ACCEPT), deadline)) != ACCEPT:
        raise AuthError(f"handshake with {sock.getpeername()}: not accepted")
    sock.settimeout(None)


def server_handshake(sock: socket.socket, secret: bytes, role: int, my_id: int,
                     timeout: float, generation: int = 0) -> int:
    """Authenticate a new connection on this thread (blocking); returns the id the client
    claimed. ``_accept`` runs the same steps without a thread per connection."""
    deadline = time.monotonic() + timeout
    raw = bytes(_deadline_recv(sock, HELLO_SIZE, deadline))
    claimed = check_hello(raw, role, my_id, generation)
    nonce_s, chal = challenge(secret, raw)
    sock.sendall(chal)
    check_response(secret, raw, nonce_s, bytes(_deadline_recv(sock, MAC, deadline)))
    sock.sendall(ACCEPT)
    sock.settimeout(None)
    return claimed


def pack_header(kind: int, flags: int, channel: int, tag: int, nbytes: int,
                sig: tuple[int, int, int, int, int] = NOSIG) -> bytes:
    return HEADER.pack(kind, flags, *sig, channel, tag, nbytes)


def unpack_header(raw: bytes | bytearray, kinds: frozenset[int], cap: int) -> tuple[int, int, int, int, int]:
    """(kind, flags, channel, tag, nbytes), or ``ProtocolError`` for anything unexpected."""
    return unpack_header_from(raw, 0, kinds, cap)


def unpack_header_from(buf: bytes | bytearray, pos: int, kinds: frozenset[int],
                       cap: int) -> tuple[int, int, int, int, int]:
    """``unpack_header`` of the header at ``buf[pos:]``."""
    kind, flags, _sig, channel, tag, nbytes = unpack_frame_from(buf, pos, kinds, cap)
    return kind, flags, channel, tag, nbytes


def unpack_frame_from(buf: bytes | bytearray, pos: int, kinds: frozenset[int], cap: int
                      ) -> tuple[int, int, tuple[int, int, int, int, int], int, int, int]:
    """(kind, flags, signature, channel, tag, nbytes) of the header at ``buf[pos:]``."""
    h = _unpack_from(buf, pos)
    kind, flags, nbytes = h[0], h[1], h[9]
    if kind not in kinds or flags > 1:
        raise ProtocolError(f"malformed frame header (kind {kind}, flags {flags})")
    if nbytes > cap:
        raise ProtocolError(f"frame of {nbytes} bytes exceeds the cap of {cap} bytes")
    return kind, flags, h[2:7], h[7], h[8], nbytes


def set_nodelay(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


# -- a point-to-point frame's dtype and shape, in its signature fields ----------------------------
# (ndim byte, dtype byte, seq I, root I, count Q): dtype byte = DTYPE_CODES + 1 (0: not said);
# ndim byte = ndim + 1 (0: shape not said, read as 1-D), + 128 where the last dimension is left
# out (it follows from the size). The dimensions are packed into the 128 bits of seq, root and
# count, 128 // k bits each for the k written: every shape of up to four dimensions fits, and
# any shape whose dimensions are small enough (a shape that does not fit travels as 1-D).
_DERIVED = 128
_M32, _M64 = (1 << 32) - 1, (1 << 64) - 1


def _packed(dims: tuple[int, ...]) -> int | None:
    bits = 128 // len(dims)
    top = 1 << bits
    v = 0
    for i, d in enumerate(dims):
        if d >= top:
            return None
        v |= d << (i * bits)
    return v


def _fields(nd: int, code: int, v: int) -> tuple[int, int, int, int, int]:
    return (nd, code, (v >> 64) & _M32, v >> 96, v & _M64)


def p2p_sig(buf: np.ndarray) -> tuple[int, int, int, int, int]:
    """The signature fields of a p2p frame that sends ``buf``: its dtype and shape."""
    code = DTYPE_CODES.get(buf.dtype)
    if code is None:
        return NOSIG
    shape = buf.shape
    nd = len(shape)
    if nd < 2:
        return (nd + 1, code + 1, 0, 0, 0)
    v = _packed(shape)
    if v is not None:
        return _fields(nd + 1, code + 1, v)
    lead = shape[:-1]
    if all(lead) and (v := _packed(lead)) is not None:
        return _fields(nd + 1 + _DERIVED, code + 1, v)
    return (0, code + 1, 0, 0, 0)


def recv_sig(buf: np.ndarray) -> tuple[int, int, int, int, int]:
    """The signature a p2p receive into ``buf`` is posted with: its dtype (``p2p_refuses``)."""
    code = DTYPE_CODES.get(buf.dtype)
    return NOSIG if code is None else (0, code + 1, 0, 0, 0)


def p2p_refuses(want: tuple, sig: tuple) -> bool:
    """Whether a p2p message with ``sig`` is of another dtype than a receive posted with
    ``want`` (both said): that receive fails and the message waits for another one."""
    return bool(want[1] and sig[1] and want[1] != sig[1])


def p2p_meta(sig: tuple, nbytes: int) -> tuple[np.dtype | None, tuple[int, ...] | None]:
    """(dtype, shape) a p2p frame's signature says it was sent with; (None, None) where it
    says nothing or something that does not account for exactly ``nbytes`` (``meta_of``)."""
    nd, code = sig[0], sig[1] - 1
    if code < 0:
        return None, None
    if nd == 0 or nd == 2:  # not said / 1-D: from the size
        return meta_of(nbytes, code, None)
    if nd == 1:
        return meta_of(nbytes, code, ())
    v = sig[4] | (sig[2] << 64) | (sig[3] << 96)
    derived = nd > _DERIVED
    ndim = (nd - _DERIVED if derived else nd) - 1
    k = ndim - 1 if derived else ndim
    if k < 1:
        return None, None
    bits = 128 // k
    mask = (1 << bits) - 1
    dims = [(v >> (i * bits)) & mask for i in range(k)]
    if derived:
        dt, _ = meta_of(nbytes, code, None)
        lead = 1
        for d in dims:
            lead *= d
        if dt is None or not lead or (nbytes // dt.itemsize) % lead:
            return None, None
        dims.append(nbytes // dt.itemsize // lead)
    return meta_of(nbytes, code, tuple(dims))

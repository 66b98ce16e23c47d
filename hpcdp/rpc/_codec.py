"""Values on the wire: a msgpack body plus raw array buffers, never pickle.

``encode`` walks a value and produces a msgpack body in which every container is an array whose
first item is a tag (so tuples stay tuples and dict keys may be any supported hashable), and a
list of buffers: each numpy array's bytes, as a zero-copy view, sent after the body. ``decode``
rebuilds the value from the body and the received buffers (arrays are views of them).

Supported: None, bool, int, float, complex, str, bytes, list, tuple, dict, numpy arrays and
scalars of ``hpcdp``'s dtypes (cupy arrays are staged to host and arrive as numpy), RRefs, and
dataclasses registered with ``@rpc.register``. Anything else is a ``TypeError`` on the sender.

The decoder trusts nothing: dtypes come from a fixed table, a class to build must be a
registered dataclass, shapes must match their buffer exactly (and never describe more than a
message may hold, even with no elements), bool bytes must be 0 or 1, every buffer is used
once, and depth, element count and sizes are capped (``Limits``) before anything is allocated:
msgpack reserves room for each array from its announced length (up to 80 KiB a header), so a
body of nested headers announcing what never comes could reserve thousands of times its size:
a C-speed pass over the body (``skip``, which reserves nothing) first proves every announced
item is there. When a
value fails to decode, the RRefs in it are still taken in (``salvage``) so their owners can free.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import threading
from typing import Any, Callable, Sequence

import msgpack
import numpy as np

from .._arrays import SUPPORTED_DTYPES, is_cupy
from .._config import setting
from ..errors import ProtocolError
from . import _registry

__all__ = ["Limits", "encode", "decode", "Encoded"]

LIST, TUPLE, DICT, NDARRAY, COMPLEX, NPSCALAR, BIGINT, DATACLASS, RREF = range(9)

_DTYPES: dict[str, np.dtype] = {dt.name: dt for dt in SUPPORTED_DTYPES}
#: native-order supported dtypes and their wire names (``dtype.name`` is slow to compute)
_NAMES: dict[np.dtype, str] = {dt: dt.name for dt in SUPPORTED_DTYPES}
_SUPPORTED = frozenset(SUPPORTED_DTYPES)
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1
MAX_BIGINT_BYTES = 1024
MAX_NDIM = 32
_TYPES_HELP = ("None, bool, int, float, complex, str, bytes, list, tuple, dict, numpy arrays/"
               "scalars of hpcdp's dtypes, RRefs and @rpc.register-ed dataclasses")


@dataclasses.dataclass(frozen=True)
class Limits:
    """Caps on one message, enforced by the sender (before sending) and the receiver (before
    allocating). Defaults come from ``HPCDP_RPC_MAX_*`` environment variables.

    Args:
        max_message_bytes: body plus array buffers.
        max_body_bytes: the msgpack body alone (everything that is not an array).
        max_depth: nesting of containers.
        max_elements: items in all containers together.
        max_buffers: arrays in one message.
    """

    max_message_bytes: int = dataclasses.field(
        default_factory=lambda: setting("HPCDP_RPC_MAX_MESSAGE"))
    max_body_bytes: int = dataclasses.field(
        default_factory=lambda: setting("HPCDP_RPC_MAX_BODY"))
    max_depth: int = dataclasses.field(default_factory=lambda: setting("HPCDP_RPC_MAX_DEPTH"))
    max_elements: int = dataclasses.field(
        default_factory=lambda: setting("HPCDP_RPC_MAX_ELEMENTS"))
    max_buffers: int = dataclasses.field(
        default_factory=lambda: setting("HPCDP_RPC_MAX_BUFFERS"))

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if type(v) is not int or v < 1:
                raise ValueError(f"rpc Limits: {f.name} must be an int >= 1, got {v!r}")
        if self.max_depth > 512:
            raise ValueError(f"rpc Limits: max_depth must be <= 512, got {self.max_depth}")

    def as_list(self) -> list[int]:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]

    @classmethod
    def from_list(cls, values: Sequence[int]) -> "Limits":
        return cls(*values)


@dataclasses.dataclass
class Encoded:
    """An encoded value: the body and the buffers that follow it."""

    body: bytes
    buffers: Sequence[memoryview]
    #: what encoding RRefs produced (forks to register once the message is sure to go)
    rrefs: Sequence[Any]

    @property
    def nbytes(self) -> int:
        return len(self.body) + sum(b.nbytes for b in self.buffers)


def _too_deep(limits: Limits) -> ValueError:
    return ValueError(f"value nested deeper than {limits.max_depth} levels (Limits.max_depth)")


_PRIMITIVE = frozenset({str, float, bool, bytes, type(None)})
_tls = threading.local()


def _packer() -> msgpack.Packer:
    p = getattr(_tls, "packer", None)
    if p is None:
        p = _tls.packer = msgpack.Packer(use_bin_type=True)
    return p


class _Encoder:
    __slots__ = ("limits", "hook", "buffers", "rrefs", "count")

    def __init__(self, limits: Limits, hook: Callable[[Any], tuple[list, Any]] | None) -> None:
        self.limits, self.hook = limits, hook
        self.buffers: list[memoryview] = []
        self.rrefs: list[Any] = []
        self.count = 0

    def add(self, n: int) -> None:
        self.count += n
        if self.count > self.limits.max_elements:
            raise ValueError(f"value has more than {self.limits.max_elements} elements "
                             "(Limits.max_elements)")

    def enc(self, x: Any, depth: int) -> Any:
        t = type(x)
        if t in _PRIMITIVE:
            return x
        if t is int:
            return x if _INT_MIN <= x <= _INT_MAX else _bigint(x)
        if depth >= self.limits.max_depth:
            raise _too_deep(self.limits)
        d = depth + 1
        if t is tuple or t is list:
            self.add(len(x))
            out = [TUPLE if t is tuple else LIST]
            enc = self.enc
            for v in x:
                out.append(v if type(v) in _PRIMITIVE else enc(v, d))
            return out
        if t is dict:
            self.add(2 * len(x))
            out = [DICT]
            for k, v in x.items():
                out.append(self.enc(k, d))
                out.append(self.enc(v, d))
            return out
        if t is np.ndarray or is_cupy(x):
            return self.array(x)
        if t is complex:
            return [COMPLEX, x.real, x.imag]
        if isinstance(x, np.generic) and x.dtype in _SUPPORTED and t is x.dtype.type:
            return [NPSCALAR, x.dtype.name, x.tobytes()]
        if t is bytearray or t is memoryview:
            return bytes(x)
        if self.hook is not None and getattr(t, "_hpcdp_rref", False):
            wire = self.hook(x)
            self.rrefs.append(wire[1])
            return [RREF, *wire[0]]
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            name = _registry.dataclass_name(t)
            if name is None:
                raise TypeError(f"cannot send a {_tname(t)} over RPC: it is a dataclass that is not "
                                "registered (decorate it with @rpc.register)")
            fields = [f for f in dataclasses.fields(x) if f.init]
            self.add(2 * len(fields))
            out = [DATACLASS, name]
            for f in fields:
                out.append(f.name)
                out.append(self.enc(getattr(x, f.name), d))
            return out
        raise TypeError(f"cannot send a {_tname(t)} over RPC; supported: {_TYPES_HELP}")

    def array(self, x: Any) -> list:
        name = _NAMES.get(x.dtype) if type(x) is np.ndarray else None
        if name is None:  # cupy, another byte order, or a dtype that cannot go
            if is_cupy(x):
                x = x.get()  # staged to host; arrives as numpy
            if not x.dtype.isnative and x.dtype.kind in "biufc":
                x = x.astype(x.dtype.newbyteorder("="))  # travels in native order
            if x.dtype not in _SUPPORTED:
                raise TypeError(f"cannot send a numpy array of dtype {x.dtype} over RPC; "
                                f"supported dtypes: {', '.join(_DTYPES)}")
            name = x.dtype.name
        if x.ndim > MAX_NDIM:
            raise ValueError(f"array with {x.ndim} dimensions; at most {MAX_NDIM}")
        if not x.flags.c_contiguous:
            x = np.ascontiguousarray(x)
        if len(self.buffers) >= self.limits.max_buffers:
            raise ValueError(f"more than {self.limits.max_buffers} arrays in one message "
                             "(Limits.max_buffers)")
        self.buffers.append(memoryview(x.reshape(-1).view(np.uint8)))
        return [NDARRAY, name, list(x.shape), len(self.buffers) - 1]


def encode(obj: Any, limits: Limits, rref_hook: Callable[[Any], tuple[list, Any]] | None = None
           ) -> Encoded:
    """Encode ``obj``; ``TypeError`` for unsupported values, ``ValueError`` past ``limits``.

    ``rref_hook(rref)`` returns the wire form of an RRef and what the agent must record once
    the message goes (the RRef is forked for the receiver).
    """
    if obj is None:
        return _NONE
    if type(obj) is tuple and len(obj) == 2 and type(obj[0]) is tuple and not obj[0] and \
            type(obj[1]) is dict and not obj[1]:
        return _NO_ARGS  # a call without arguments
    e = _Encoder(limits, rref_hook)
    body = _packer().pack(e.enc(obj, 0))
    if len(body) > limits.max_body_bytes:
        raise ValueError(f"message body of {len(body)} bytes exceeds Limits.max_body_bytes "
                         f"({limits.max_body_bytes}); send large data as numpy arrays")
    if e.buffers:
        total = len(body) + sum(b.nbytes for b in e.buffers)
        if total > limits.max_message_bytes:
            raise ValueError(f"message of {total} bytes exceeds Limits.max_message_bytes "
                             f"({limits.max_message_bytes})")
    return Encoded(body, e.buffers, e.rrefs)


_BOOL = np.dtype(np.bool_)
_SMALL_BODY = 1024  # msgpack reserves at most 80 KiB per array header; a body this short
#                     cannot nest enough of them to matter, so it skips the pre-check
_NONE = Encoded(msgpack.packb(None), (), ())
_NO_ARGS = Encoded(msgpack.packb([TUPLE, [TUPLE], [DICT]]), (), ())


def _tname(t: type) -> str:
    mod = getattr(t, "__module__", "")
    return f"{mod}.{t.__qualname__}" if mod and mod != "builtins" else t.__qualname__


def _bigint(x: int) -> list:
    n = (x.bit_length() + 8) // 8
    if n > MAX_BIGINT_BYTES:
        raise ValueError(f"int of {x.bit_length()} bits is too large to send (at most "
                         f"{8 * MAX_BIGINT_BYTES - 1})")
    return [BIGINT, x.to_bytes(n, "little", signed=True)]


def _reject_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack extension type {code} is not part of the RPC format")


class _Decoder:
    __slots__ = ("limits", "buffers", "hook", "used", "count", "seen", "seen_cap", "rrefs_seen")

    def __init__(self, limits: Limits, buffers: Sequence[Any],
                 hook: Callable[[list], Any] | None) -> None:
        self.limits, self.buffers, self.hook = limits, buffers, hook
        self.used = [False] * len(buffers)
        self.count = 0
        self.seen = 0
        #: msgpack items allowed before ``count_list`` gives up: tags, field names and shapes
        #: count too
        self.seen_cap = 2 * limits.max_elements + 64
        self.rrefs_seen: set[int] = set()

    def salvage(self, tree: Any) -> None:
        """After a failure: take in (and drop) every RRef the value holds that ``dec`` did not
        reach, so that each one's fork is confirmed and deleted as usual."""
        stack, n = [tree], 0
        while stack and n < 2 * self.limits.max_elements:
            x = stack.pop()
            n += 1
            if type(x) is not list or not x:
                continue
            if type(x[0]) is int and x[0] == RREF and id(x) not in self.rrefs_seen:
                self.rrefs_seen.add(id(x))
                try:
                    self.hook(x[1:])
                except Exception:  # noqa: BLE001 - a malformed one is simply not an RRef
                    pass
                continue
            stack.extend(v for v in x if type(v) is list)

    def count_list(self, lst: list) -> list:
        # msgpack calls this as each array completes, so a flood of items stops early
        self.seen += len(lst)
        if self.seen > self.seen_cap:
            raise ProtocolError(f"message has more than {self.limits.max_elements} elements")
        return lst

    def add(self, n: int) -> None:
        self.count += n
        if self.count > self.limits.max_elements:
            raise ProtocolError(f"message has more than {self.limits.max_elements} elements")

    def dec(self, x: Any, depth: int) -> Any:
        t = type(x)
        if t in _PRIMITIVE or t is int:
            return x
        if t is not list:
            raise ProtocolError(f"unexpected msgpack {t.__name__} in message body")
        if not x or type(x[0]) is not int:
            raise ProtocolError("untagged array in message body")
        if depth >= self.limits.max_depth:
            raise ProtocolError(f"value nested deeper than {self.limits.max_depth} levels")
        tag, d, n = x[0], depth + 1, len(x) - 1
        if tag == TUPLE or tag == LIST:
            self.add(n)
            dec = self.dec
            items = [v if type(v) in _PRIMITIVE or type(v) is int else dec(v, d)
                     for v in itertools.islice(x, 1, None)]
            return tuple(items) if tag == TUPLE else items
        if tag == DICT:
            if n % 2:
                raise ProtocolError("dict with an odd number of items")
            self.add(n)
            out: dict[Any, Any] = {}
            for i in range(1, n + 1, 2):
                k = self.dec(x[i], d)
                try:
                    out[k] = self.dec(x[i + 1], d)
                except TypeError:
                    raise ProtocolError(f"unhashable dict key of type {type(k).__name__}") from None
            return out
        if tag == NDARRAY:
            return self.array(x)
        if tag == COMPLEX and n == 2 and type(x[1]) is float and type(x[2]) is float:
            return complex(x[1], x[2])
        if tag == NPSCALAR and n == 2 and type(x[1]) is str and type(x[2]) is bytes:
            dt = _DTYPES.get(x[1])
            if dt is None or len(x[2]) != dt.itemsize or (dt == _BOOL and x[2][0] > 1):
                raise ProtocolError(f"bad numpy scalar ({x[1][:40]!r}, {len(x[2])} bytes)")
            return np.frombuffer(x[2], dt)[0]
        if tag == BIGINT and n == 1 and type(x[1]) is bytes and len(x[1]) <= MAX_BIGINT_BYTES:
            return int.from_bytes(x[1], "little", signed=True)
        if tag == DATACLASS and n >= 1 and n % 2 == 1 and type(x[1]) is str:
            return self.dataclass(x, d)
        if tag == RREF:
            if self.hook is None:
                raise ProtocolError("an RRef cannot appear here")
            self.rrefs_seen.add(id(x))
            return self.hook(x[1:])
        raise ProtocolError(f"unknown or malformed value tag {tag} in message body")

    def array(self, x: list) -> np.ndarray:
        if len(x) != 4 or type(x[1]) is not str or type(x[2]) is not list or type(x[3]) is not int:
            raise ProtocolError("malformed array descriptor")
        dt = _DTYPES.get(x[1])
        if dt is None:
            raise ProtocolError(f"array dtype {x[1][:40]!r} is not supported")
        shape = x[2]
        if len(shape) > MAX_NDIM or any(type(s) is not int or s < 0 for s in shape):
            raise ProtocolError(f"bad array shape {shape[:MAX_NDIM + 1]}")
        i = x[3]
        if not 0 <= i < len(self.buffers) or self.used[i]:
            raise ProtocolError(f"array refers to buffer {i} (missing or used twice)")
        buf = self.buffers[i]
        # with a zero in the shape the product says nothing: the other sides still must not
        # describe more than a message may hold (numpy refuses, or allocates for, huge ones)
        nbytes = math.prod(shape) * dt.itemsize
        if (nbytes or math.prod(s for s in shape if s) * dt.itemsize) > \
                self.limits.max_message_bytes:
            raise ProtocolError(f"array of shape {tuple(shape)[:8]} is larger than any "
                                "message may be")
        if nbytes != len(buf):
            raise ProtocolError(f"array of shape {tuple(shape)} {dt} does not match its "
                                f"{len(buf)}-byte buffer")
        a = np.frombuffer(buf, dt)
        if dt == _BOOL and a.size and a.view(np.uint8).max() > 1:
            raise ProtocolError("bool array with bytes other than 0 and 1")
        self.used[i] = True
        return a.reshape(shape)

    def dataclass(self, x: list, d: int) -> Any:
        entry = _registry.lookup(x[1])
        if entry is None or not entry.is_dataclass:
            raise ProtocolError(f"message names class {x[1][:100]!r}, which is not a registered "
                                "dataclass; refusing to build it")
        allowed = {f.name for f in dataclasses.fields(entry.obj) if f.init}
        self.add(len(x) - 2)
        kwargs = {}
        for i in range(2, len(x), 2):
            k = x[i]
            if type(k) is not str or k not in allowed or k in kwargs:
                raise ProtocolError(f"bad field {str(k)[:100]!r} for dataclass {x[1]!r}")
            kwargs[k] = self.dec(x[i + 1], d)
        try:
            return entry.obj(**kwargs)
        except Exception as exc:  # noqa: BLE001 - the registered class refused these fields
            raise ProtocolError(f"dataclass {x[1]!r} rejected its fields: "
                                f"{type(exc).__name__}: {exc}") from None


def decode(body: Any, buffers: Sequence[Any], limits: Limits,
           rref_hook: Callable[[list], Any] | None = None) -> Any:
    """Rebuild a value; ``ProtocolError`` for anything that is not a well-formed RPC value."""
    if len(body) > limits.max_body_bytes:
        raise ProtocolError(f"message body of {len(body)} bytes exceeds the limit of "
                            f"{limits.max_body_bytes}")
    if len(buffers) > limits.max_buffers:
        raise ProtocolError(f"{len(buffers)} arrays exceed the limit of {limits.max_buffers}")
    nb = len(body)
    if nb == 1 and not buffers and body[0] == 0xC0:
        return None
    if nb == len(_NO_ARGS.body) and not buffers and body == _NO_ARGS.body:
        return ((), {})
    d = _Decoder(limits, buffers, rref_hook)
    try:
        if nb > _SMALL_BODY:
            _check_lengths(body)
        # each item takes a byte at least: a body this short cannot trip the count (and a
        # Python call per array is a good part of decoding a small message)
        hook = d.count_list if nb > d.seen_cap else None
        tree = msgpack.unpackb(body, use_list=True, raw=False, strict_map_key=True,
                               list_hook=hook, ext_hook=_reject_ext, max_map_len=0,
                               max_array_len=min(limits.max_elements + 2, nb), max_ext_len=0)
    except ProtocolError:
        raise
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        text = str(exc)
        for key, why in (("max_array_len", f"more than {limits.max_elements} elements in one "
                                            "container"),
                         ("max_ext_len", "a msgpack extension type, which is not part of the "
                                         "RPC format"),
                         ("max_map_len", "a msgpack map (unexpected msgpack dict), which is not "
                                         "part of the RPC format")):
            if key in text:
                raise ProtocolError(f"message body has {why}") from None
        raise ProtocolError(f"malformed message body ({type(exc).__name__}: {exc})") from None
    try:
        value = d.dec(tree, 0)
        if not all(d.used):
            raise ProtocolError(f"{d.used.count(False)} array buffer(s) not referenced by the "
                                "body")
    except BaseException:
        if rref_hook is not None:
            d.salvage(tree)
        raise
    return value


def _check_lengths(body: Any) -> None:
    """Walk the body once in C without building anything (``Unpacker.skip`` allocates nothing
    for an array header): it succeeds only if every announced array length is really there,
    so building the value afterwards preallocates no more than the body holds."""
    u = msgpack.Unpacker(None, max_buffer_size=len(body), max_map_len=0, max_ext_len=0)
    u.feed(body)
    u.skip()
    if u.tell() != len(body):
        raise ProtocolError(f"message body has {len(body) - u.tell()} bytes after its value")
